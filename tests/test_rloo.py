"""rloo.py (RLOO and GRPO, DESIGN.md section 19): known answers of the advantages, KL estimators and losses;
runs of the tiny default that check the rollout layout and seeds, the split and process-count invariance,
exact resume, an lr=0 update and GRPO."""

import functools
import glob
import json
import math
import os
import re
import types

import pandas as pd
import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import (accelerate_launcher, command_line_flags, is_wall_clock, ratios_near_one, run_in_process,
                      run_script, signal_on_call, without_rates, side_by_side)
from summarize_from_feedback_details import rloo, rollout
from summarize_from_feedback_details.infra import loading
from summarize_from_feedback_details.infra.checkpoints import CHECKPOINT_EXIT_CODE

PAD, EOS = 1, 0  # the tiny tokenizer's ids
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "summarize_from_feedback_details", "rloo.py")
DS_CONFIG = os.path.join(REPO, "tests", "accelerate_configs", "deepspeed_zero2_cpu.yaml")
# ---------------------------------------------------------------------------------------------
# known answers
# ---------------------------------------------------------------------------------------------


def test_rloo_advantages_known_answers():
    # one group [1, 0, 0, 0]: baselines 0, 1/3, 1/3, 1/3
    assert rloo.rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]])).flatten().tolist() == pytest.approx(
        [1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-7)
    # two groups [1, 0] and [5, 3]: each sample against the other one
    assert rloo.rloo_advantages(torch.tensor([[1.0, 0.0], [5.0, 3.0]])).flatten().tolist() == [1.0, -1.0, 2.0, -2.0]
    # a singleton group has no other sample: the raw reward
    assert rloo.rloo_advantages(torch.tensor([[2.5], [-1.0]])).flatten().tolist() == [2.5, -1.0]
    # the baseline never includes the sample itself: [3, 1, 2] -> 3 - 1.5, 1 - 2.5, 2 - 2
    assert rloo.rloo_advantages(torch.tensor([[3.0, 1.0, 2.0]])).flatten().tolist() == [1.5, -1.5, 0.0]


def test_grpo_advantages_known_answers():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    # mean 0.25; sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; population std sqrt(0.1875)
    assert rloo.grpo_advantages(rewards, "sample", eps=0.0).flatten().tolist() == [1.5, -0.5, -0.5, -0.5]
    assert rloo.grpo_advantages(rewards).flatten().tolist() == pytest.approx([0.75 / 0.5001] + [-0.25 / 0.5001] * 3)
    assert rloo.grpo_advantages(rewards).flatten().tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-3)
    population = math.sqrt(0.1875)
    assert rloo.grpo_advantages(rewards, "population", eps=0.0).flatten().tolist() == pytest.approx(
        [0.75 / population] + [-0.25 / population] * 3)
    # Dr. GRPO: no std scaling; groups are independent
    assert rloo.grpo_advantages(torch.tensor([[1.0, 0.0], [5.0, 3.0]]), scale=False).flatten().tolist() == [
        0.5, -0.5, 1.0, -1.0]
    # a singleton group: 0 (with either std, and unscaled)
    for std in ("sample", "population"):
        assert rloo.grpo_advantages(torch.tensor([[2.5], [-1.0]]), std).flatten().tolist() == [0.0, 0.0]
    # equal rewards: 0, not a division by zero
    assert rloo.grpo_advantages(torch.tensor([[2.0, 2.0]])).flatten().tolist() == [0.0, 0.0]


def test_whitening_is_over_the_whole_batch():
    values = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, sample std sqrt(14 / 3)
    assert rloo.whiten(values).tolist() == pytest.approx([(v - 3) / (math.sqrt(14 / 3) + 1e-8) for v in (1, 2, 3, 6)])


def test_sequence_kl_and_k3_known_answers():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -9.0], [-0.5, -1.0, -2.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    # 0.5 - 1 (the third token is after the EOS); 0 + 0.5 + 1.5
    assert rloo.sequence_kl(logprobs, ref_logprobs, mask).tolist() == [-0.5, 2.0]
    # k3 = exp(d) - d - 1 with d = ref - logp: d = -0.5, 1.0
    assert rloo.k3_kl(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])).tolist() == pytest.approx(
        [math.exp(-0.5) + 0.5 - 1, math.e - 2])
    assert rloo.k3_kl(logprobs, logprobs).abs().max() == 0  # the same policy: exactly 0
    assert (rloo.k3_kl(logprobs, ref_logprobs) >= 0).all()


MASK = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
OLD = -torch.ones(3, 3)
# token log-ratios: row 0 0.2 each (+5 after its EOS, which must not count), row 1 -0.1 each, row 2 0.05 then 0
NEW = OLD + torch.tensor([[0.2, 0.2, 5.0], [-0.1, -0.1, -0.1], [0.05, 0.0, 0.0]])
ADVANTAGES = torch.tensor([1.0, -2.0, 0.5])


def objective(**flags):
    return rloo.policy_objective(NEW, OLD, OLD, ADVANTAGES, MASK, rloo.Args(**flags))


def test_clipped_sequence_ratio_loss_known_answer():
    """The sequence ratio exp(sum of the real tokens' log-ratios): e^0.4 (clipped at 1.2 with A > 0),
    e^-0.3 (clipped at 0.8 with A < 0: the clipped loss is the larger), e^0.05 (inside the range)."""
    losses, kl_losses, logratio, ratio, clipped, units = objective()
    assert logratio.tolist() == pytest.approx([0.4, -0.3, 0.05])
    assert ratio.tolist() == pytest.approx([math.exp(0.4), math.exp(-0.3), math.exp(0.05)])
    assert losses.tolist() == pytest.approx([-1.2, 2 * 0.8, -0.5 * math.exp(0.05)])
    assert clipped.tolist() == [1.0, 1.0, 0.0] and units.tolist() == [True, True, True]
    assert kl_losses.tolist() == [0.0, 0.0, 0.0]


def test_token_level_ratio_and_no_clip_losses_known_answer():
    # per token: row 0's tokens at e^0.2 > 1.2 are clipped (-1.2 each, two real tokens), row 1's e^-0.1 and
    # row 2's are inside the range; the token losses are summed per response
    losses, _, logratio, ratio, clipped, units = objective(token_level_ratio=True)
    assert losses.tolist() == pytest.approx([-2.4, 3 * 2 * math.exp(-0.1), -0.5 * (math.exp(0.05) + 2)])
    assert clipped[MASK].tolist() == [1, 1, 0, 0, 0, 0, 0, 0] and torch.equal(units, MASK)
    assert ratio.shape == (3, 3) and logratio[0, 2] == 0  # (after the EOS: no log-ratio)
    # REINFORCE: -A * sum of the real tokens' new logprobs
    losses, _, _, _, clipped, _ = objective(no_clip=True)
    assert losses.tolist() == pytest.approx([1.0 * (0.8 + 0.8), -2.0 * (1.1 * 3), -0.5 * (-0.95 - 2)])
    assert clipped.abs().sum() == 0


def test_at_ratio_one_the_three_rloo_losses_have_the_same_gradient():
    """Sequence ratio, per-token ratio (summed over the response) and REINFORCE: d loss / d logp_t = -A on
    every real token, 0 after the EOS."""
    gradients = []
    for flags in ({}, {"token_level_ratio": True}, {"no_clip": True}):
        new = OLD.clone().requires_grad_()
        rloo.policy_objective(new, OLD, OLD, ADVANTAGES, MASK, rloo.Args(**flags))[0].sum().backward()
        gradients.append(new.grad)
    expected = (-ADVANTAGES.unsqueeze(1) * MASK).expand(3, 3)
    for gradient in gradients:
        assert torch.allclose(gradient, expected)


def test_grpo_losses_known_answer():
    """Ratio 1, the reference 0.1 nats below on every token: each real token's loss is -A + 0.05 * k3(-0.1);
    DeepSeekMath averages over the response's tokens, Dr. GRPO divides by response_length (3)."""
    new = OLD.clone()
    ref = OLD - 0.1
    k3 = 0.05 * (math.exp(-0.1) + 0.1 - 1)
    advantages = torch.tensor([1.0, -1.0, 0.5])
    losses, kl_losses, _, ratio, clipped, units = rloo.policy_objective(
        new, OLD, ref, advantages, MASK, rloo.Args(algorithm="grpo"))
    assert losses.tolist() == pytest.approx([-1 + k3, 1 + k3, -0.5 + k3], rel=1e-5)
    assert kl_losses.tolist() == pytest.approx([k3] * 3, rel=1e-5)
    assert ratio.shape == (3, 3) and torch.equal(units, MASK) and clipped.sum() == 0
    losses, kl_losses, *_ = rloo.policy_objective(new, OLD, ref, advantages, MASK,
                                                  rloo.Args(algorithm="grpo", grpo_loss="dr_grpo"))
    assert losses.tolist() == pytest.approx([(-2 + 2 * k3) / 3, (3 + 3 * k3) / 3, (-1.5 + 3 * k3) / 3], rel=1e-5)
    assert kl_losses.tolist() == pytest.approx([2 * k3 / 3, k3, k3], rel=1e-5)


def test_each_algorithm_gets_its_own_advantages_and_a_new_one_is_refused():
    """RLOO: the KL (0.05 x 0.2) in the reward, leave-one-out baseline; GRPO: the score alone, group-normalised. A value
    with no arm (one added to the Literal and nowhere else; set past tyro here) is refused at the advantages and at the
    loss, not run as another method."""
    rewards, advantages = rloo.algorithm_advantages(rloo.Args(), torch.tensor([1.0, 0.0]), torch.tensor([0.2, 0.0]), 2)
    assert rewards.tolist() == pytest.approx([0.99, 0.0]) and advantages.tolist() == pytest.approx([0.99, -0.99])
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    rewards, advantages = rloo.algorithm_advantages(rloo.Args(algorithm="grpo"), scores, torch.ones(4), 4)
    assert torch.equal(rewards, scores) and advantages.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-3)
    args = rloo.Args()
    args.algorithm = "reinforce_pp"
    with pytest.raises(ValueError, match="--algorithm reinforce_pp: no advantages for it"):
        rloo.algorithm_advantages(args, scores, torch.zeros(4), 2)
    with pytest.raises(ValueError, match="--algorithm reinforce_pp: no objective for it"):
        rloo.policy_objective(OLD, OLD, OLD, torch.tensor([1.0, -1.0, 0.5]), MASK, args)


def test_query_major_layout():
    """Groups in (chunk, sample j) order: chunk 0 (queries 0, 1) j = 0, 1; chunk 1 (queries 2, 3) j = 0, 1, each
    chunk's samples in one batch (`chunk_batches`). Row q * k + j is sample j of query q."""
    groups = [rollout.SamplingGroup(torch.tensor([[q] for q in chunk]), 0.7, j) for chunk in ((0, 1), (2, 3))
              for j in range(2)]
    generated = [(torch.tensor([[q * 10 + j] for q in chunk]), torch.tensor([q + j / 10 for q in chunk]))
                 for chunk in ((0, 1), (2, 3)) for j in range(2)]
    batches = rollout.chunk_batches(groups, generated, 2)
    assert [queries.flatten().tolist() for queries, _, _ in batches] == [[0, 1, 0, 1], [2, 3, 2, 3]]
    assert rloo.query_major([responses for _, responses, _ in batches], 2).flatten().tolist() == [
        0, 1, 10, 11, 20, 21, 30, 31]
    assert rloo.query_major([logprobs for _, _, logprobs in batches], 2).tolist() == pytest.approx(
        [0, 0.1, 1, 1.1, 2, 2.1, 3, 3.1])


@pytest.mark.parametrize("flags, message", [
    ({"rloo_k": 1}, r"--rloo_k 1: rloo needs >= 2 samples per query .* the advantage is the raw reward \(biased\)"),
    ({"rloo_k": 1, "algorithm": "grpo"}, r"--rloo_k 1: grpo needs >= 2 samples per query .* every advantage is 0"),
    ({"no_clip": True, "noptepochs": 3}, r"--no_clip with --noptepochs 3 --nminibatches 1: plain REINFORCE is "
                                         r"on-policy, one step per batch"),
    ({"no_clip": True, "nminibatches": 2, "local_micro_batch_size": 4}, r"--no_clip with --noptepochs 1 "
                                                                        r"--nminibatches 2"),
    ({"grpo_std": "population"}, r"--grpo_std does nothing under --algorithm rloo"),
    ({"grpo_loss": "dr_grpo"}, r"--grpo_loss does nothing under --algorithm rloo"),
    ({"algorithm": "grpo", "token_level_ratio": True}, r"--token_level_ratio does nothing under --algorithm grpo"),
])
def test_settings_that_cannot_learn_or_do_nothing_are_refused(flags, message):
    """Legal flags that would waste a run: a group of one (GRPO: all-zero advantages; RLOO: the raw
    reward as advantage), plain REINFORCE over stale samples (the ratio reached 23,004 at epoch 3),
    and a flag the chosen algorithm never reads."""
    with pytest.raises(ValueError, match=message):
        rloo.derive_batch_sizes(rloo.Args(**{"local_rollout_forward_batch_size": 1, **flags}), 1)
    for allowed in ({"no_clip": True}, {"algorithm": "grpo", "grpo_std": "population", "grpo_loss": "dr_grpo"},
                    {"token_level_ratio": True, "noptepochs": 2}):
        rloo.derive_batch_sizes(rloo.Args(local_rollout_forward_batch_size=1, **allowed), 1)


def test_derive_batch_sizes():
    args = rloo.Args(local_micro_batch_size=2, gradient_accumulation_steps=4, nminibatches=2,
                     local_rollout_forward_batch_size=4, total_episodes=100, rloo_k=2)
    rloo.derive_batch_sizes(args, world_size=2)
    assert (args.local_mini_batch_size, args.local_batch_size, args.mini_batch_size, args.batch_size,
            args.num_updates, args.local_generation_batch_size) == (8, 16, 16, 32, 3, 2 + 2 * 4)
    paper = rloo.Args(local_micro_batch_size=16, gradient_accumulation_steps=4)  # 8 GPUs: 512 episodes
    rloo.derive_batch_sizes(paper, world_size=8)
    assert (paper.batch_size, paper.num_updates, paper.batch_size // paper.rloo_k) == (512, 1953, 256)
    with pytest.raises(ValueError, match="not divisible by --rloo_k 3"):
        rloo.derive_batch_sizes(rloo.Args(local_micro_batch_size=4, gradient_accumulation_steps=1, rloo_k=3), 1)
    with pytest.raises(ValueError, match="the 2 queries of a process per update are not divisible"):
        rloo.derive_batch_sizes(rloo.Args(local_micro_batch_size=4, gradient_accumulation_steps=1), 1)
    with pytest.raises(ValueError, match="rloo_k must be >= 1"):
        rloo.derive_batch_sizes(rloo.Args(rloo_k=0), 1)


# ---------------------------------------------------------------------------------------------
# runs of the script
# ---------------------------------------------------------------------------------------------


def tiny_args(tiny_datasets, checkpoints, workdir, name, **overrides) -> rloo.Args:
    data_dir, _ = tiny_datasets
    sft_path, rm_path = checkpoints
    return rloo.Args(**{**dict(
        base_model=sft_path, sft_model_path=sft_path, reward_model_path=rm_path,
        query_dataset=os.path.join(data_dir, "sft"), response_length=20, run_name=name, seed=3,
        output_dir=os.path.join(workdir, name), print_sample_output_freq=0), **overrides})


def read_metrics(workdir, name) -> list:
    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_rloo(args: rloo.Args, workdir) -> list:
    """rloo.main in this process, run from `workdir`, on one thread (generation runs hundreds of tiny ops: on a
    small shared CPU torch's thread pool makes them many times slower); the metrics lines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_in_process(rloo.main, args, workdir)
    finally:
        torch.set_num_threads(threads)
    return read_metrics(workdir, args.run_name)


def flags(args: rloo.Args) -> list:
    """The command line of `args` (the flags that differ from the defaults)."""
    return command_line_flags(args)


def training_lines(metrics: list) -> list:
    return [m for m in metrics if "ppo/lr" in m]


def assert_same_metrics(a: list, b: list, rel: float, abs_: float, clipfrac_abs: float = 0.0) -> None:
    assert [m["step"] for m in a] == [m["step"] for m in b] and a
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in [k for k in x if k != "step" and not is_wall_clock(k)]:
            tolerance = dict(rel=0, abs=clipfrac_abs) if clipfrac_abs and "clipfrac" in key else dict(rel=rel, abs=abs_)
            assert x[key] == pytest.approx(y[key], **tolerance), (x["step"], key, x[key], y[key])


def assert_same_params(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=rtol, atol=atol), (key, (a[key] - b[key]).abs().max())


METRIC_NAMES = {
    "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward", "objective/scores",
    "objective/validation_score", "eval/gold/score", "eval/gold/win_rate", "eval/gold/reference_score",
    "ppo/policy/approxkl_avg", "ppo/policy/clipfrac_avg", "ppo/loss/policy_avg",
    "ppo/policy/entropy_avg", "ppo/val/ratio", "ppo/val/ratio_var", "ppo/val/ratio_first_minibatch",
    "ppo/policy/approxkl_first_minibatch", "ppo/policy/clipfrac_first_minibatch", "ppo/val/num_eos_tokens",
    "ppo/val/response_length", "ppo/lr", "ppo/episode", "ppo/eps", "rloo/loss/kl_avg", "rloo/reward_mean",
    "rloo/reward_std_within_query", "rloo/advantage_mean", "rloo/advantage_std", "rloo/advantage_abs_max",
    "time/generation", "time/validation", "time/reference_forward", "time/reward_forward", "time/advantages",
    "time/ppo_epochs", "time/update", "throughput/tokens_per_second", "throughput/generated_tokens_per_second",
}
# 3 updates of 8 episodes (4 queries x rloo_k 2) in 2 minibatches of 4, 2 epochs, chunks of 2 queries. Adam with
# eps 1 steps ~ lr * g (its default eps steps ~ lr * sign(g), blind to a wrongly scaled loss), so the split and
# process-count comparisons see the loss normalisation.
BASE = dict(total_episodes=24, rloo_k=2, nminibatches=2, noptepochs=2, local_rollout_forward_batch_size=2,
            lr=0.005, eps=1.0, print_sample_output_freq=1)
# Tolerances of the invariance runs (PPO's): the same responses are sampled, gradients summed in another order.
# A clip fraction counts responses past a clipping boundary (the sequence ratio): where a query's two responses
# both lack an EOS, their scores tie and the advantage is kl_coef x the KL difference, float noise before the first
# step (~1e-9), whose sign decides which side such a response clips on. 0.07 allows one response of the 16 (4
# per minibatch x 2 minibatches x 2 epochs): seen under DeepSpeed ZeRO-3 offload, whose reference logprobs carry
# other float noise; its gradient is ~1e-9 of the others', and the weights stay within RUN_REL / RUN_ABS.
RUN_REL, RUN_ABS, CLIPFRAC_ABS = 1e-4, 1e-6, 0.07


@pytest.fixture(scope="module")
def base_run(tiny_datasets, checkpoints, tmp_path_factory):
    """BASE on one process as micro-batch 4 x accumulation 1, with the final eval; the rollouts that reach
    gather_global recorded (one process: the global batch)."""
    workdir = str(tmp_path_factory.mktemp("rloo_base"))
    recorded = []
    original = rloo.gather_global

    def recording(accelerator, *tensors):
        recorded.append([t.clone() for t in tensors])
        return original(accelerator, *tensors)

    rloo.gather_global = recording
    try:
        args = tiny_args(tiny_datasets, checkpoints, workdir, "base", local_micro_batch_size=4,
                         gradient_accumulation_steps=1, local_eval_batch_size=4, run_eval=True, **BASE)
        metrics = run_rloo(args, workdir)
    finally:
        rloo.gather_global = original
    return workdir, args, metrics, load_file(os.path.join(workdir, "base", "model.safetensors")), recorded


def test_tiny_run_logs_saves_and_evaluates(base_run, checkpoints, tiny_datasets, monkeypatch):
    workdir, args, metrics, params, _ = base_run
    lines = training_lines(metrics)
    assert [m["step"] for m in lines] == [1, 2, 3] and all(METRIC_NAMES <= m.keys() for m in lines)
    first = lines[0]
    assert first["ppo/episode"] == 8 and first["ppo/lr"] == args.lr
    # before the first step the ratio is 1 (generation logprobs = training logprobs) and policy = reference
    assert first["ppo/val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5)
    assert first["ppo/policy/approxkl_first_minibatch"] < 1e-9 and first["ppo/policy/clipfrac_first_minibatch"] == 0
    assert abs(first["objective/kl"]) < 1e-4
    assert first["objective/rlhf_reward"] == pytest.approx(first["objective/scores"] - 0.05 * first["objective/kl"])
    # rloo advantages sum to 0 within each query: their mean is 0
    assert all(abs(m["rloo/advantage_mean"]) < 1e-6 and m["rloo/advantage_std"] > 0 for m in lines)
    assert lines[-1]["ppo/policy/approxkl_avg"] > 1e-6  # later minibatches see a moved policy
    assert 0 < sum(m["ppo/val/num_eos_tokens"] for m in lines) < 24  # some responses end, some do not
    # PPO's eval tables (eval/ judges them), the whole split once
    data = load_from_disk(os.path.join(tiny_datasets[0], "sft"))
    final = {k: v for line in metrics for k, v in line.items()}
    for split in ("validation", "test"):
        table = pd.read_csv(os.path.join(workdir, "runs", "base", f"{split}_table.csv"), keep_default_na=False)
        assert list(table.columns) == ["query", "postprocessed_response", "reference_responses", "scores",
                                       "reference_scores", "contain_eos"]
        assert table["contain_eos"].dtype == bool
        assert len(table) == len(data[split])
        assert final[f"eval/{split}/scores"] == pytest.approx(table["scores"].mean(), abs=1e-5)
    assert len(glob.glob(os.path.join(workdir, "runs", "base", "samples_*.csv"))) == 3
    # only the policy, a plain causal LM that loads offline, moved by the updates
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = load_file(os.path.join(checkpoints[0], "model.safetensors"))
    assert params.keys() == base.keys()
    key = "gpt_neox.layers.0.attention.dense.weight"
    assert (params[key] - base[key]).abs().max() > 5e-5  # moved by the updates (float noise is ~1e-7)
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "base"))
    assert type(policy).__name__ == "GPTNeoXForCausalLM"
    assert AutoTokenizer.from_pretrained(os.path.join(workdir, "base")).pad_token_id == PAD


def test_a_querys_samples_share_the_query_and_come_from_their_own_seeds(base_run, checkpoints, tiny_datasets):
    """In the global batch row q * k + j is sample j of query q: the k rows of a query share its tokens and
    differ in their responses; update 1's responses are exactly what the rollout engine samples from the SFT
    model for chunk c (queries 2c, 2c + 1 of the global order) and sample j under derived_seed(seed, 0, 1,
    2c, j), i.e. seeds fixed by the place in the global batch."""
    _, args, _, _, recorded = base_run
    query_responses, responses = recorded[0][0], recorded[0][1]
    assert len(recorded) == 3 and responses.shape == (8, 20)
    queries = query_responses[:, :-20]
    for q in range(4):
        assert torch.equal(queries[2 * q], queries[2 * q + 1])
        assert not torch.equal(responses[2 * q], responses[2 * q + 1])
    assert len({tuple(queries[2 * q].tolist()) for q in range(4)}) == 4
    train = load_from_disk(os.path.join(tiny_datasets[0], "sft"))["train"]
    order = rloo.epoch_permutations(len(train), 1, args.seed)[:4]
    assert torch.equal(queries[::2], torch.tensor(train[order]["query_token"]))
    tokenizer = loading.load_tokenizer(checkpoints[0])
    sft = loading.load_policy(checkpoints[0], tokenizer).eval()
    groups = [rollout.SamplingGroup(queries[::2][c: c + 2], 0.7, rollout.derived_seed(args.seed, 0, 1, c, j))
              for c in (0, 2) for j in range(2)]
    sampled = [responses for _, responses, _ in rollout.chunk_batches(groups, rollout.decode(
        sft, groups, PAD, len(tokenizer), 20), 2)]
    assert torch.equal(rloo.query_major(sampled, 2), responses)


def test_micro_batch_split_gives_the_same_update(base_run, tiny_datasets, checkpoints):
    workdir, _, metrics, params, _ = base_run
    args = tiny_args(tiny_datasets, checkpoints, workdir, "micro1", local_micro_batch_size=1,
                     gradient_accumulation_steps=4, local_eval_batch_size=4, **BASE)
    split = run_rloo(args, workdir)
    assert_same_metrics(training_lines(metrics), split, rel=1e-4, abs_=1e-6)
    assert_same_params(params, load_file(os.path.join(workdir, "micro1", "model.safetensors")), rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def two_process_runs(base_run, tiny_datasets, checkpoints):
    """BASE launched on two processes (micro-batch 2 each) under DDP ("two") and under DeepSpeed ZeRO-2
    ("zero2"), side by side: name -> the Future of its finished process."""
    workdir = base_run[0]

    def launch(name, deepspeed):
        args = tiny_args(tiny_datasets, checkpoints, workdir, name, local_micro_batch_size=2,
                         gradient_accumulation_steps=1, local_eval_batch_size=2, deepspeed=deepspeed, **BASE)
        launcher = accelerate_launcher(2, DS_CONFIG if deepspeed else None)
        return run_script(launcher + [SCRIPT, *flags(args)], workdir, OMP_NUM_THREADS="1")

    return side_by_side(two=functools.partial(launch, "two", False), zero2=functools.partial(launch, "zero2", True))


@pytest.mark.slow
@pytest.mark.parametrize("deepspeed", [False, True], ids=["ddp", "zero2"])
def test_two_processes_match_one_process(base_run, two_process_runs, deepspeed):
    """BASE on two processes (2 queries each, micro-batch 2), under DDP and under DeepSpeed ZeRO-2 (the frozen
    reference and reward model as inference engines): each query's samples on one process, from the same seeds;
    the minibatches drawn from the gathered global batch."""
    workdir, _, metrics, params, _ = base_run
    name = "zero2" if deepspeed else "two"
    result = two_process_runs[name].result()
    assert "world_size 2" in result.stdout and "4 queries x rloo_k 2" in " ".join(result.stdout.split())
    assert ("DeepSpeed engine: ZeRO-2" in result.stdout) == deepspeed
    assert_same_metrics(training_lines(metrics), read_metrics(workdir, name), RUN_REL, RUN_ABS, CLIPFRAC_ABS)
    assert_same_params(params, load_file(os.path.join(workdir, name, "model.safetensors")), rtol=1e-4, atol=1e-6)


def test_resume_after_a_signal_mid_update_equals_the_uninterrupted_run(base_run, tiny_datasets, checkpoints,
                                                                       monkeypatch):
    """BASE with the final eval, SIGUSR1 in the 6th policy loss (2 epochs x 2 minibatches = 4 per update: the
    middle of update 2): the run finishes update 2, checkpoints it and exits with 75; --resume then gives the
    uninterrupted run's metrics (wall clock aside), sample and eval tables and weights, bit for bit."""
    workdir, _, whole, params, _ = base_run
    args = tiny_args(tiny_datasets, checkpoints, workdir, "stopped", local_micro_batch_size=4,
                     gradient_accumulation_steps=1, local_eval_batch_size=4, run_eval=True, **BASE)
    with monkeypatch.context() as patch:
        signal_on_call(patch, rloo, "policy_objective", 4 + 2)
        with pytest.raises(SystemExit) as stopped:
            run_rloo(args, workdir)
    assert stopped.value.code == CHECKPOINT_EXIT_CODE
    assert os.listdir(os.path.join(workdir, "stopped", "checkpoints")) == ["update-0000002"]
    assert [m["step"] for m in read_metrics(workdir, "stopped")] == [1, 2]
    resumed = run_rloo(tiny_args(tiny_datasets, checkpoints, workdir, "stopped", resume=True, local_micro_batch_size=4,
                                 gradient_accumulation_steps=1, local_eval_batch_size=4, run_eval=True, **BASE),
                       workdir)
    assert without_rates(resumed) == without_rates(whole)
    assert_same_params(params, load_file(os.path.join(workdir, "stopped", "model.safetensors")), rtol=0, atol=0)
    for pattern in ("samples_*.csv", "*_table.csv"):
        files = {os.path.basename(p): open(p).read() for p in glob.glob(os.path.join(workdir, "runs", "base", pattern))}
        assert files and files == {os.path.basename(p): open(p).read()
                                   for p in glob.glob(os.path.join(workdir, "runs", "stopped", pattern))}


def test_ratio_var_is_the_variance_of_ratios_near_one():
    """ppo/val/ratio_var of per-token ratios within ~1e-4 of 1 is their variance to 1e-3 (float32's E[r^2] -
    E[r]^2 read a multiple of 1.2e-7)."""
    logratio, mask, variance = ratios_near_one()
    stats, zeros = torch.zeros(2, 2, len(rloo.STAT_NAMES)), torch.zeros(8, 16)
    for epoch, minibatch in ((0, 0), (0, 1), (1, 0), (1, 1)):
        ratio, real = logratio[epoch, minibatch].exp(), mask[epoch, minibatch]
        stats[epoch, minibatch, 2:] = rloo.ratio_stats(logratio[epoch, minibatch], ratio, zeros, real, zeros, real)
    m = rloo.rloo_update_metrics(types.SimpleNamespace(reduce=lambda t, op: t), stats, scores=torch.zeros(8), kl=torch.zeros(8),
                                 rewards=torch.zeros(8), advantages=torch.zeros(8), logprobs=zeros, padding_mask=~mask[0, 0],
                                 contain_eos=torch.ones(8, dtype=torch.bool), sequence_lengths=torch.ones(8),
                                 args=rloo.Args(), validation_metrics={})
    assert 5e-9 < variance < 2e-8 and m["ppo/val/ratio_var"] == pytest.approx(variance, rel=1e-3)


def test_an_lr_0_update_has_ratio_1_and_clips_nothing(tiny_datasets, checkpoints, tmp_path):
    """Learning rate 0: every minibatch of both epochs sees the rollout's policy, so the ratio is 1 up to the
    float noise between the generation's and the training forward's logprobs, nothing is clipped and the
    weights stay the SFT model's. With the per-token ratio too."""
    for name, token_level in (("lr0", False), ("lr0_token", True)):
        args = tiny_args(tiny_datasets, checkpoints, str(tmp_path), name, local_micro_batch_size=4,
                         gradient_accumulation_steps=1, local_eval_batch_size=2,
                         **{**BASE, "lr": 0.0, "total_episodes": 8, "token_level_ratio": token_level})
        (m,) = run_rloo(args, str(tmp_path))
        assert m["ppo/val/ratio"] == pytest.approx(1.0, abs=1e-5) and m["ppo/val/ratio_var"] < 1e-9, name
        assert m["ppo/policy/clipfrac_avg"] == 0 and m["ppo/policy/approxkl_avg"] < 1e-9, name
        assert abs(m["objective/kl"]) < 1e-4, name
        saved = load_file(os.path.join(str(tmp_path), name, "model.safetensors"))
        sft = load_file(os.path.join(checkpoints[0], "model.safetensors"))
        assert all(torch.equal(saved[k], sft[k]) for k in sft)


def test_early_warnings_print_with_their_update(tiny_datasets, checkpoints, tmp_path, capfd):
    """--warn: a signal crossed at the first update prints once, naming update, metric and threshold; one
    never crossed prints nothing (the run and its metrics are those of a run without --warn)."""
    args = tiny_args(tiny_datasets, checkpoints, str(tmp_path), "warn", local_micro_batch_size=4,
                     gradient_accumulation_steps=1, local_eval_batch_size=2,
                     **{**BASE, "total_episodes": 16, "warn": ["kl=-1", "entropy=-1"]})
    run_rloo(args, str(tmp_path))
    out = capfd.readouterr().out
    assert out.count("early warning at update 1: objective/kl") == 1 and "(--warn kl=-1)" in out
    assert "objective/entropy" not in out.split("early warning")[-1].split("\n")[0] and out.count("early warning") == 1


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo"])
def test_grpo_moves_the_weights_and_logs_its_metrics(tiny_datasets, checkpoints, tmp_path, loss):
    """GRPO, 2 queries x 4 samples per update: advantages of mean 0 in each group, of sample std ~ 1 with
    DeepSeekMath's scaling (without the EOS penalty no two scores are equal), the raw score as the reward, a
    positive k3 KL term once the policy moved; Dr. GRPO leaves the advantages unscaled."""
    args = tiny_args(tiny_datasets, checkpoints, str(tmp_path), loss, algorithm="grpo", grpo_loss=loss, rloo_k=4,
                     non_eos_penalty=False, local_micro_batch_size=4, gradient_accumulation_steps=2,
                     local_eval_batch_size=2, local_rollout_forward_batch_size=2, total_episodes=16, noptepochs=2,
                     lr=0.05, eps=1.0)
    metrics = run_rloo(args, str(tmp_path))
    assert len(metrics) == 2 and all(METRIC_NAMES <= m.keys() for m in metrics)
    for m in metrics:
        assert abs(m["rloo/advantage_mean"]) < 1e-5
        assert m["rloo/reward_mean"] == pytest.approx(m["objective/scores"])  # no KL in the reward
        if loss == "grpo":  # each group's population std is sqrt(3 / 4) x its sample std, ~1
            assert m["rloo/advantage_std"] == pytest.approx(math.sqrt(3 / 4), rel=1e-2)
        else:
            assert m["rloo/advantage_abs_max"] < 2 * m["rloo/reward_std_within_query"] * math.sqrt(3)
        assert m["ppo/val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5)
    assert metrics[1]["rloo/loss/kl_avg"] > 0 and abs(metrics[1]["objective/kl"]) > 1e-4
    saved = load_file(os.path.join(str(tmp_path), loss, "model.safetensors"))
    sft = load_file(os.path.join(checkpoints[0], "model.safetensors"))
    key = "gpt_neox.layers.0.attention.dense.weight"
    assert (saved[key] - sft[key]).abs().max() > 1e-4  # (Dr. GRPO's loss is ~ 1 / response_length of GRPO's)


def test_lora_reference_is_the_policy_without_its_adapter(tiny_datasets, checkpoints, tmp_path):
    """LoRA: the reference is the policy with its adapter disabled, so the first rollout's KL is 0 (the
    adapter starts as a zero update); the saved model is the merged plain causal LM (the SFT weights where
    LoRA has no adapter, moved where it has one) and the adapter alone is in <output_dir>/adapter."""
    args = tiny_args(tiny_datasets, checkpoints, str(tmp_path), "lora", use_peft=True, lora_r=4,
                     local_micro_batch_size=4, gradient_accumulation_steps=1, local_eval_batch_size=2,
                     **{**BASE, "total_episodes": 16, "lr": 3e-3, "eps": 1e-5})
    metrics = run_rloo(args, str(tmp_path))
    assert len(metrics) == 2 and abs(metrics[0]["objective/kl"]) < 1e-5
    assert metrics[0]["ppo/val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5)
    merged = load_file(os.path.join(str(tmp_path), "lora", "model.safetensors"))
    sft = load_file(os.path.join(checkpoints[0], "model.safetensors"))
    assert merged.keys() == sft.keys()
    assert torch.equal(merged["embed_out.weight"], sft["embed_out.weight"])  # (no adapter on the LM head)
    key = "gpt_neox.layers.0.attention.dense.weight"
    assert (merged[key] - sft[key]).abs().max() > 1e-4
    assert os.path.exists(os.path.join(str(tmp_path), "lora", "adapter", "adapter_config.json"))


def test_a_reward_model_that_scores_nan_stops_the_run(tiny_datasets, checkpoints, tmp_path, capsys):
    """NaN scores stop the run at the first rollout, naming the update, phase and tensors (exit 1, no model)."""
    from safetensors.torch import save_file

    nan_rm = tmp_path / "nan_rm"
    nan_rm.mkdir()
    for name in os.listdir(checkpoints[1]):
        (nan_rm / name).write_bytes(open(os.path.join(checkpoints[1], name), "rb").read())
    weights = load_file(str(nan_rm / "model.safetensors"))
    weights["score.weight"] = torch.full_like(weights["score.weight"], float("nan"))
    save_file(weights, str(nan_rm / "model.safetensors"), metadata={"format": "pt"})
    args = tiny_args(tiny_datasets, checkpoints, str(tmp_path), "nan", reward_model_path=str(nan_rm),
                     local_micro_batch_size=4, gradient_accumulation_steps=1, local_eval_batch_size=2, **BASE)
    with pytest.raises(SystemExit) as stopped:
        run_rloo(args, str(tmp_path))
    assert stopped.value.code == 1
    # the first update whose scores are NaN after the EOS penalty (responses without EOS score -1)
    assert re.search(r"STOPPED: update \d+, rollout: non-finite scores and advantages",
                     " ".join(capsys.readouterr().out.split()))
    assert not os.path.exists(tmp_path / "nan" / "model.safetensors")
