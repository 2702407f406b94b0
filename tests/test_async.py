"""Asynchronous RLHF (`--async_steps N`): the rollouts trained on at update t are sampled by the policy
of update t - N. The sampler's weights (rollout.StalePolicy), which policy decodes what, which
log-probabilities the ratio reads, and exact resume with a stale sampler."""

import hashlib
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import signal_on_call, without_rates
import test_online_dpo
import test_rloo
from summarize_from_feedback_details import online_dpo
from summarize_from_feedback_details import ppo_left_padding as ppo
from summarize_from_feedback_details import rollout
from summarize_from_feedback_details.infra.checkpoints import CHECKPOINT_EXIT_CODE
from test_ppo import assert_same_params, read_metrics, run_ppo, tiny_args


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny decodes are many small ops: one thread is many times faster on a small shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TwoLayers(torch.nn.Module):
    """A trained layer and a frozen one (a LoRA run's base): only trained weights are lent."""

    def __init__(self):
        super().__init__()
        self.trained, self.frozen = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


@pytest.mark.parametrize("async_steps", [0, 1, 3])
def test_stale_policy_lends_the_weights_of_update_t_minus_n(async_steps):
    """Update t (weights all t): inside `weights()` the policy holds update max(1, t - N)'s weights,
    after it its own bit for bit; a copy restored from `state_dict` mid-run lends the same."""
    policy = TwoLayers()
    stale, restored = rollout.StalePolicy(policy, async_steps), None
    frozen = policy.frozen.weight.clone()
    for update in range(1, 7):
        with torch.no_grad():
            policy.trained.weight.fill_(update)
            policy.trained.bias.fill_(-update + 0.5)  # (a value float32 holds exactly)
        own = {k: v.clone() for k, v in policy.state_dict().items()}
        for sampler in (stale, restored) if restored else (stale,):
            sampler.start_update()
            assert sampler.staleness() == min(async_steps, update - 1)
            with sampler.weights() as lent:
                assert lent is policy
                assert torch.all(policy.trained.weight == max(1, update - async_steps))
                assert torch.all(policy.trained.bias == -max(1, update - async_steps) + 0.5)
                assert torch.equal(policy.frozen.weight, frozen)
            for key, value in policy.state_dict().items():
                assert torch.equal(value, own[key]), key
            if async_steps:  # (what the overlapped worker samples update t + 1 with)
                assert torch.all(sampler.next_weights()["trained.weight"] == max(1, update + 1 - async_steps))
        if update == 3:
            restored = rollout.StalePolicy(policy, async_steps)
            restored.load_state_dict(stale.state_dict())
    assert len(stale.snapshots) == (async_steps + 1 if async_steps else 0)
    assert all(set(s) == {"trained.weight", "trained.bias"} for s in stale.snapshots)
    with pytest.raises(ValueError, match="--async_steps -1"):
        rollout.StalePolicy(policy, -1)


def test_rollout_chunks_and_the_batches_ahead_known_answer():
    """Chunks of 2 of a process's 4 queries (its rows start at 8 of the global batch), sampled k times
    chunk-major: sample j of the chunk at global row r from the seed of (seed, 0, update, r, j); once
    (PPO), from (seed, 0, update, r). with_next pairs each batch with the next one, the last with None."""
    queries = torch.arange(12).view(4, 3)
    groups = rollout.RolloutChunks(0.7, 5, 8, 2, samples=2).groups({"query_token": queries}, 3)
    assert [g.seed for g in groups] == [rollout.derived_seed(5, 0, 3, row, j) for row in (8, 10) for j in (0, 1)]
    assert all(torch.equal(g.queries, queries[i: i + 2]) for g, i in zip(groups, (0, 0, 2, 2)))
    assert {g.temperature for g in groups} == {0.7}
    once = rollout.RolloutChunks(0.7, 5, 8, 2)
    assert [g.seed for g in once.groups({"query_token": queries}, 3)] == [rollout.derived_seed(5, 0, 3, row)
                                                                         for row in (8, 10)]
    assert once.groups(None, 4) == []
    assert list(rollout.with_next(iter("abc"))) == [("a", "b"), ("b", "c"), ("c", None)]
    assert list(rollout.with_next(iter(""))) == []
    with pytest.raises(ValueError, match="--async_worker cpu needs --async_steps >= 1"):
        rollout.StalePolicy(TwoLayers(), 0, "cpu")


def test_staleness_metrics_known_answer():
    stale = rollout.StalePolicy(TwoLayers(), 2)
    stale.start_update()
    stale.start_update()
    log_ratios = torch.log(torch.tensor([[2.0, 0.5, 7.0], [1.0, 1.5, 9.0]]))
    mask = torch.tensor([[True, True, False], [True, True, False]])  # (padding excluded)
    metrics = rollout.staleness_metrics(stale, log_ratios, mask)
    assert metrics["async/staleness"] == 1
    assert metrics["async/token_ratio_mean"] == pytest.approx(1.25)
    assert metrics["async/token_ratio_std"] == pytest.approx(torch.tensor([2.0, 0.5, 1.0, 1.5]).std().item())
    assert (metrics["async/token_ratio_min"], metrics["async/token_ratio_max"]) == pytest.approx((0.5, 2.0))
    assert rollout.staleness_metrics(rollout.StalePolicy(TwoLayers(), 0), log_ratios, mask) == {}


def test_learner_logprobs_known_answer(checkpoints, tokenizer):
    """The log-probabilities of the sampled tokens under the learner: log-softmax of its logits at
    the response positions over the temperature, [PAD] and the rows past the tokenizer excluded."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(checkpoints[0]).eval()
    pad_id, vocab_end, temperature = tokenizer.pad_token_id, len(tokenizer), 0.7
    query = torch.tensor([[pad_id, pad_id, 5, 6, 7], [8, 9, 10, 11, 12]])
    response = torch.tensor([[13, 14, 15], [16, 17, 18]])
    got = ppo.learner_logprobs(policy, torch.cat([query, response], 1), response, temperature, pad_id, vocab_end)
    for row in range(2):
        tokens = torch.cat([query[row][query[row] != pad_id], response[row]])
        with torch.no_grad():
            logits = policy(tokens[None]).logits[0, -4:-1].double()
        logits[:, pad_id] = float("-inf")
        logits[:, vocab_end:] = float("-inf")
        expected = torch.log_softmax(logits / (temperature + 1e-7), -1).gather(1, response[row][:, None])[:, 0]
        torch.testing.assert_close(got[row].double(), expected, rtol=0, atol=1e-5)


def fingerprint(model) -> str:
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def recorded_decodes(monkeypatch) -> list:
    """(fingerprint of the decoding weights, temperatures of its groups) of every decode."""
    calls, original = [], rollout.decode_in_batches

    def recorded(model, groups, *args, **kwargs):
        calls.append((fingerprint(model), {g.temperature for g in groups}))
        return original(model, groups, *args, **kwargs)

    monkeypatch.setattr(rollout, "decode_in_batches", recorded)
    return calls


def assert_sampled_by_update_t_minus_2(calls: list, metrics: list) -> None:
    """4 updates at N = 2: update 1 decodes its validation and rollout queries together (its sampler
    is the learner); from update 2 on the rollouts (temperature 0.7) are decoded by the weights that
    decoded update max(1, t - 2)'s validation queries (temperature 0.01, always the learner's)."""
    assert [temperatures for _, temperatures in calls[:7]] == [{0.7, 0.01}] + [{0.7}, {0.01}] * 3
    learner = [calls[0][0]] + [weights for weights, _ in calls[2:7:2]]  # the validation decodes, updates 1-4
    sampler = [calls[0][0]] + [weights for weights, _ in calls[1:7:2]]
    assert len(set(learner)) == 4  # (the policy learns every update)
    assert sampler == [learner[max(1, t - 2) - 1] for t in range(1, 5)]
    assert [m["async/staleness"] for m in metrics] == [0, 1, 2, 2]


COMMON = dict(total_episodes=32, local_micro_batch_size=2, gradient_accumulation_steps=4,
              local_rollout_forward_batch_size=8, local_eval_batch_size=4, lr=3e-3)


def test_ppo_rollouts_are_sampled_by_the_policy_of_update_t_minus_n(tiny_datasets, checkpoints, tmp_path,
                                                                   monkeypatch):
    """4 updates of 8. Synchronously, one decode per update holds the validation and rollout queries
    (today's loop) and nothing async/ is logged. At N = 2 the rollouts of update t are decoded by the
    weights that decoded update max(1, t - 2)'s validation queries (the learner's then); the samples
    are stale (importance ratios learner / sampler away from 1) and yet PPO's first ratio of every
    update is 1: the ratio reads the learner's recomputed log-probabilities, not the sampler's."""
    workdir = str(tmp_path)
    runs = {}
    for async_steps in (0, 2):
        with monkeypatch.context() as patch:
            calls = recorded_decodes(patch)
            args = tiny_args(tiny_datasets, checkpoints, workdir, f"async{async_steps}", async_steps=async_steps,
                             **COMMON)
            runs[async_steps] = calls, run_ppo(args, workdir)[:4]
    calls, metrics = runs[0]
    assert [temperatures for _, temperatures in calls[:4]] == [{0.7, 0.01}] * 4
    assert not any(key.startswith("async/") for m in metrics for key in m)

    calls, metrics = runs[2]
    assert_sampled_by_update_t_minus_2(calls, metrics)
    for m in metrics:
        assert abs(m["ppo/val/ratio_first_minibatch"] - 1) < 1e-5
        assert m["ppo/policy/approxkl_first_minibatch"] < 1e-9
    assert metrics[0]["async/token_ratio_std"] == 0 and min(m["async/token_ratio_std"] for m in metrics[1:]) > 0.01
    # the samples differ from the synchronous run's from update 2 on (not the same run twice)
    assert runs[0][1][1]["objective/scores"] != metrics[1]["objective/scores"]

    # overlapped: a worker process (one thread, as this one) samples update t + 1's rollouts during update t; the
    # same tokens, so the same run to the bit, and it says how much of its decode the learner did not wait for
    args = tiny_args(tiny_datasets, checkpoints, workdir, "overlapped", async_steps=2, async_worker="cpu", **COMMON)
    overlapped = run_ppo(args, workdir)
    worker_keys = {"async/worker_generation_seconds", "async/worker_wait_seconds", "async/worker_hidden_fraction"}
    assert not worker_keys & set(overlapped[0]) and all(worker_keys <= set(m) for m in overlapped[1:4])
    assert all(0 <= m["async/worker_hidden_fraction"] <= 1 for m in overlapped[1:4])
    assert without_rates(overlapped[:4]) == without_rates(metrics)
    assert_same_params(load_file(os.path.join(workdir, "async2", "model.safetensors")),
                       load_file(os.path.join(workdir, "overlapped", "model.safetensors")), rtol=0, atol=0)


def test_ppo_async_resume_equals_the_uninterrupted_run(tiny_datasets, checkpoints, tmp_path, monkeypatch):
    """N = 1, 4 updates of 8 (16 policy losses an update). SIGUSR1 in update 2: the checkpoint
    holds the sampler's weights, and the resumed run ends with the uninterrupted one's weights and
    metrics, bit for bit (fp32, one process)."""
    workdir = str(tmp_path)
    common = dict(COMMON, async_steps=1, ppo_whiten_rewards=True)
    whole = run_ppo(tiny_args(tiny_datasets, checkpoints, workdir, "whole", **common), workdir)
    with monkeypatch.context() as patch:
        signal_on_call(patch, ppo, "policy_loss", 16 + 8)
        with pytest.raises(SystemExit) as stopped:
            run_ppo(tiny_args(tiny_datasets, checkpoints, workdir, "stopped", **common), workdir)
    assert stopped.value.code == CHECKPOINT_EXIT_CODE
    assert [m["step"] for m in read_metrics(workdir, "stopped")] == [1, 2]
    resumed = run_ppo(tiny_args(tiny_datasets, checkpoints, workdir, "stopped", resume=True, **common), workdir)
    assert [m["async/staleness"] for m in whole[:4]] == [0, 1, 1, 1]
    assert without_rates(resumed) == without_rates(whole)
    assert_same_params(load_file(os.path.join(workdir, "whole", "model.safetensors")),
                       load_file(os.path.join(workdir, "stopped", "model.safetensors")), rtol=0, atol=0)


ONLINE_DPO = dict(total_episodes=32, local_micro_batch_size=2, gradient_accumulation_steps=4,
                  local_rollout_forward_batch_size=2, local_eval_batch_size=4, lr=0.05, eps=1.0)


def online_dpo_args(tiny_datasets, checkpoints, workdir, name, **changes) -> online_dpo.Args:
    return test_online_dpo.tiny_args(os.path.join(tiny_datasets[0], "sft"), checkpoints, workdir, name,
                                     **{**ONLINE_DPO, **changes})


def test_online_dpo_pairs_are_sampled_by_the_policy_of_update_t_minus_n(tiny_datasets, checkpoints, tmp_path,
                                                                       monkeypatch):
    """N = 2, 4 updates of 4 pairs: the pairs of update t are decoded by update max(1, t - 2)'s
    weights; the learner's sequence log-probabilities differ from the sampler's on stale pairs
    only (update 1: the same weights, float noise)."""
    workdir = str(tmp_path)
    with monkeypatch.context() as patch:
        calls = recorded_decodes(patch)
        metrics = test_online_dpo.run_online_dpo(online_dpo_args(tiny_datasets, checkpoints, workdir, "async2",
                                                                 async_steps=2), workdir)[:4]
    assert_sampled_by_update_t_minus_2(calls, metrics)
    assert metrics[0]["async/sequence_ratio_std"] < 1e-4
    assert min(m["async/sequence_ratio_std"] for m in metrics[1:]) > 0.01


def test_online_dpo_async_resume_equals_the_uninterrupted_run(tiny_datasets, checkpoints, tmp_path, monkeypatch):
    """N = 1, 4 updates of 4 micro-batches: SIGUSR1 in update 2, then --resume: the uninterrupted
    run's weights and metrics, bit for bit. The stopped and resumed run samples in a worker process
    (--async_worker cpu, overlapped: its pending samples are dropped at the stop and the resumed run's
    first update samples in the learner), the uninterrupted one in the learner: the same tokens."""
    workdir = str(tmp_path)
    whole = test_online_dpo.run_online_dpo(online_dpo_args(tiny_datasets, checkpoints, workdir, "whole",
                                                           async_steps=1), workdir)
    overlapped = dict(async_steps=1, async_worker="cpu")
    with monkeypatch.context() as patch:
        signal_on_call(patch, online_dpo, "preference_losses", 4 + 2)
        with pytest.raises(SystemExit) as stopped:
            test_online_dpo.run_online_dpo(online_dpo_args(tiny_datasets, checkpoints, workdir, "stopped",
                                                           **overlapped), workdir)
    assert stopped.value.code == CHECKPOINT_EXIT_CODE
    resumed = test_online_dpo.run_online_dpo(online_dpo_args(tiny_datasets, checkpoints, workdir, "stopped",
                                                             **overlapped, resume=True), workdir)
    sampled_by_worker = {m["step"]: "async/worker_hidden_fraction" in m for m in resumed if "async/staleness" in m}
    assert sampled_by_worker == {1: False, 2: True, 3: False, 4: True}
    assert [m["async/staleness"] for m in whole[:4]] == [0, 1, 1, 1]
    assert without_rates(resumed) == without_rates(whole)
    assert_same_params(test_online_dpo.saved(workdir, "whole"), test_online_dpo.saved(workdir, "stopped"),
                       rtol=0, atol=0)


@pytest.mark.parametrize("algorithm", ["rloo", "grpo"])
def test_rloo_and_grpo_rollouts_are_sampled_by_the_policy_of_update_t_minus_n(algorithm, tiny_datasets, checkpoints,
                                                                             tmp_path, monkeypatch):
    """N = 2, 4 updates of 4 queries x k = 2: the rollouts of update t are decoded by update
    max(1, t - 2)'s weights; the stale samples' importance ratios move away from 1 and the first
    ratio of every update is 1 (the learner's recomputed log-probabilities)."""
    workdir = str(tmp_path)
    with monkeypatch.context() as patch:
        calls = recorded_decodes(patch)
        args = test_rloo.tiny_args(tiny_datasets, checkpoints, workdir, algorithm, algorithm=algorithm, async_steps=2,
                                   local_micro_batch_size=4, gradient_accumulation_steps=1, local_eval_batch_size=4,
                                   **{**test_rloo.BASE, "total_episodes": 32, "lr": 0.05})
        metrics = test_rloo.run_rloo(args, workdir)[:4]
    assert_sampled_by_update_t_minus_2(calls, metrics)
    for m in metrics:
        assert abs(m["ppo/val/ratio_first_minibatch"] - 1) < 1e-5
    assert metrics[0]["async/token_ratio_std"] == 0 and min(m["async/token_ratio_std"] for m in metrics[1:]) > 1e-4
