"""online_dpo.py: known answers of its pieces, then tiny end-to-end runs (one step per batch, the
reward model's choice with the EOS penalty, the loss against the frozen SFT reference) and the
guarantees of every stage: micro-batch split, process count, exact resume, LoRA's exact reference."""

import functools
import glob
import json
import math
import os

import pandas as pd
import pytest
import torch
from datasets import DatasetDict, load_from_disk
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

from conftest import (accelerate_launcher, command_line_flags, is_wall_clock, run_in_process, run_script,
                      signal_on_call, without_rates, side_by_side)
from summarize_from_feedback_details import online_dpo, reward, rollout
from summarize_from_feedback_details.infra import loading
from summarize_from_feedback_details.infra.checkpoints import CHECKPOINT_EXIT_CODE
from summarize_from_feedback_details import ppo_left_padding as ppo

PAD, EOS = 1, 0  # the tiny tokenizer's ids (Pythia: [PAD] 50277, EOS 0)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "summarize_from_feedback_details", "online_dpo.py")
DS_CONFIG = os.path.join(REPO, "tests", "accelerate_configs", "deepspeed_zero2_cpu.yaml")
KEY = "gpt_neox.layers.0.attention.dense.weight"  # a weight every run trains (LoRA: an adapted one)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Generation runs hundreds of tiny ops; on a small shared CPU, torch's thread pool makes them
    10-50x slower than one thread (the launched runs get OMP_NUM_THREADS=1 for the same reason)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# known answers (the copies of other stages' helpers: tests/test_run_infra.py's IDENTICAL_COPIES)
# ---------------------------------------------------------------------------------------------


RESPONSES = torch.tensor([  # two samples of each of four queries: rows 2q and 2q + 1
    [5, EOS, 7, 8], [5, 6, EOS, 8],    # both end
    [5, 6, 7, 8], [5, EOS, PAD, 3],    # the first never ends
    [5, 6, EOS, 3], [6, 6, EOS, 4],    # both end
    [5, 6, 7, 8], [9, 9, 9, 9],        # neither ends
])


def test_the_chosen_sample_is_the_reward_models_argmax_after_the_eos_penalty():
    """Query 0: the higher score wins. Query 1: the reward model prefers the sample without EOS (3.0),
    which the EOS trick scores -1, so the other is chosen. Query 2: a tie chooses the first sample.
    Query 3: neither ends, both score -1: a tie, although the raw scores differ."""
    raw = torch.tensor([0.2, 0.5, 3.0, 0.1, 0.4, 0.4, 0.1, 0.9])
    post = online_dpo.truncate_response(RESPONSES, EOS, PAD)
    scores = online_dpo.penalize_missing_eos(raw, post, EOS, -1.0)
    assert scores.tolist() == pytest.approx([0.2, 0.5, -1.0, 0.1, 0.4, 0.4, -1.0, -1.0])
    assert online_dpo.chosen_samples(scores.view(-1, 2)).tolist() == [1, 1, 0, 0]
    assert online_dpo.chosen_samples(raw.view(-1, 2)).tolist() == [1, 0, 0, 1]  # (the penalty decided 1 and 3)


def test_masked_sums_and_the_sequence_kl_known_answer():
    """Sums over each response's tokens up to and including its first EOS (all four without one): the
    junk put after every EOS never counts. The sequence KL (k1) of a sample is the sum of logprob -
    ref_logprob over those tokens."""
    logprobs = -torch.arange(1, 33, dtype=torch.float32).view(8, 4) / 10
    ref_logprobs = logprobs - torch.tensor([0.1, 0.2, 0.3, 0.4])  # the policy puts more on every token
    after_eos = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 1, 1],
                              [0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    logprobs = logprobs.masked_fill(after_eos, 1e6)
    assert online_dpo.masked_sums(logprobs, RESPONSES, EOS).tolist() == pytest.approx(
        [-0.3, -1.8, -4.2, -2.7, -5.4, -6.6, -10.6, -12.2])
    kl = online_dpo.masked_sums(logprobs - ref_logprobs, RESPONSES, EOS)
    assert kl.tolist() == pytest.approx([0.3, 0.6, 1.0, 0.3, 0.6, 0.6, 1.0, 1.0])


def tiny_lm(vocab: int = 40):
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=64, bos_token_id=EOS,
                                            eos_token_id=EOS)).eval()


def test_response_logprobs_are_those_of_the_sampling_distribution():
    """The summed log-probs the loss reads at T are those the rollout engine drew the samples with
    (each sampled token's logprob at T, summed up to the EOS), on left-padded queries; at T = 1
    they are the model's own log-probs (a full forward, [PAD] impossible), another number."""
    model = tiny_lm()
    queries = torch.randint(2, 40, (6, 6), generator=torch.Generator().manual_seed(1))
    queries[1, :3] = PAD
    ((responses, logprobs),) = rollout.decode(model, [rollout.SamplingGroup(queries, 0.7, 6)], PAD, 40, 12)
    ends = (responses == EOS).any(1)
    assert ends.any() and not ends.all()  # (the mask takes part)
    query_responses = torch.cat([queries, responses], 1)
    with torch.no_grad():
        sums = online_dpo.response_logprob_sums(model, query_responses, responses, 0.7, EOS, PAD, 40)
        at_one = online_dpo.response_logprob_sums(model, query_responses, responses, 1.0, EOS, PAD, 40)
        logits = online_dpo.forward(model, query_responses, PAD)[:, 5:-1]
    assert torch.allclose(sums, online_dpo.masked_sums(logprobs, responses, EOS), atol=1e-4)
    own = torch.log_softmax(logits.masked_fill(torch.arange(40) == PAD, -torch.inf), -1)
    assert torch.allclose(at_one, online_dpo.masked_sums(own.gather(-1, responses[..., None]).squeeze(-1), responses,
                                                         EOS), atol=1e-4)
    assert (at_one - sums).abs().min() > 1e-2


def test_derive_batch_sizes():
    args = online_dpo.Args(local_micro_batch_size=16, gradient_accumulation_steps=4)  # PPO's 1B sbatch knobs
    online_dpo.derive_batch_sizes(args, world_size=8)
    assert (args.local_batch_size, args.batch_size, args.num_updates) == (64, 512, 1953)
    default = online_dpo.Args()
    online_dpo.derive_batch_sizes(default, world_size=8)  # 256 queries x 2 samples on 8 processes
    assert (default.batch_size, default.num_updates, default.local_generation_batch_size) == (512, 1953, 2 + 64)
    with pytest.raises(ValueError, match="must be even"):
        online_dpo.derive_batch_sizes(online_dpo.Args(local_micro_batch_size=3), world_size=1)
    with pytest.raises(ValueError, match="the 8 queries of local_batch_size 16 are not divisible by "
                                         "--local_rollout_forward_batch_size 3"):
        online_dpo.derive_batch_sizes(online_dpo.Args(local_micro_batch_size=4, gradient_accumulation_steps=4,
                                                      local_rollout_forward_batch_size=3), world_size=1)
    with pytest.raises(ValueError, match="no update possible"):
        online_dpo.derive_batch_sizes(online_dpo.Args(total_episodes=100), world_size=2)
    with pytest.raises(ValueError, match="--beta must be > 0"):
        online_dpo.check_loss_args(online_dpo.Args(beta=0))
    with pytest.raises(ValueError, match="--label_smoothing must be in"):
        online_dpo.check_loss_args(online_dpo.Args(label_smoothing=0.5))
    with pytest.raises(ValueError, match="--label_smoothing does nothing under --loss_type ipo"):
        online_dpo.check_loss_args(online_dpo.Args(loss_type="ipo", label_smoothing=0.1))


def test_preference_losses_known_answers_and_a_new_loss_type_is_refused():
    """h = (2 - 0) - (0.5 - 0.5) = 2 and h = -1: DPO -logsigmoid(beta h), smoothed (1 - ls) -logsigmoid(beta h) +
    ls -logsigmoid(-beta h); IPO (h - 1 / (2 beta))^2 = (2 - 1)^2, (-1 - 1)^2 at beta 0.5. A loss type without an arm
    (set past tyro) is refused, not run as another loss."""
    sums = torch.tensor([2.0, -1.0]), torch.zeros(2), torch.full((2,), 0.5), torch.full((2,), 0.5)
    dpo_losses = online_dpo.preference_losses(*sums, "dpo", 0.5, 0.0)
    assert dpo_losses.tolist() == pytest.approx([math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.5))])
    smoothed = online_dpo.preference_losses(*sums, "dpo", 0.5, 0.25)
    assert smoothed[0].item() == pytest.approx(0.75 * math.log1p(math.exp(-1.0)) + 0.25 * math.log1p(math.exp(1.0)))
    assert online_dpo.preference_losses(*sums, "ipo", 0.5, 0.0).tolist() == pytest.approx([1.0, 4.0])
    with pytest.raises(ValueError, match="--loss_type hinge: no preference loss for it"):
        online_dpo.preference_losses(*sums, "hinge", 0.5, 0.0)


# ---------------------------------------------------------------------------------------------
# runs of the script
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_eval_data(tiny_datasets, tmp_path_factory):
    """The tiny SFT dataset with 16 validation and 8 test queries: the same training, a quicker eval."""
    folder = tmp_path_factory.mktemp("online_dpo_data")
    data = load_from_disk(os.path.join(tiny_datasets[0], "sft"))
    DatasetDict({"train": data["train"], "validation": data["validation"].select(range(16)),
                 "test": data["test"].select(range(8))}).save_to_disk(str(folder / "sft"))
    return str(folder / "sft")


def tiny_args(quick_eval_data, checkpoints, workdir, name, **overrides) -> online_dpo.Args:
    sft_path, rm_path = checkpoints
    args = online_dpo.Args(base_model=sft_path, sft_model_path=sft_path, reward_model_path=rm_path,
                           query_dataset=quick_eval_data, response_length=32, run_name=name, seed=3,
                           output_dir=os.path.join(workdir, name), print_sample_output_freq=0)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def read_metrics(workdir, name) -> list:
    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_online_dpo(args: online_dpo.Args, workdir) -> list:
    """online_dpo.main in this process, run from `workdir` (runs/ lands there); the metric lines."""
    run_in_process(online_dpo.main, args, workdir)
    return read_metrics(workdir, args.run_name)


def saved(workdir, name) -> dict:
    return load_file(os.path.join(workdir, name, "model.safetensors"))


METRIC_NAMES = {
    "objective/kl", "objective/entropy", "objective/scores", "objective/validation_score", "eval/gold/score",
    "eval/gold/win_rate", "eval/gold/reference_score", "online_dpo/loss",
    "online_dpo/accuracy", "online_dpo/chosen_rewards", "online_dpo/rejected_rewards", "online_dpo/score_margin",
    "ppo/val/num_eos_tokens", "ppo/val/response_length", "ppo/lr", "ppo/episode", "ppo/eps", "time/update",
    "time/generation", "time/validation", "time/reward_forward", "time/reference_forward", "time/training",
    "throughput/tokens_per_second", "throughput/generated_tokens_per_second",
}
PHASES = ("generation", "validation", "reward_forward", "reference_forward", "training")


PENALTY = -4.0


@pytest.fixture(scope="module")
def trained(quick_eval_data, checkpoints, tmp_path_factory):
    """4 updates of 32 episodes (16 queries x 2 samples; micro-batch 8 x accumulation 4) at a high
    learning rate, a checkpoint after every update, a sample table every other update, and the
    final eval. The seeded reward head scores the stand-in SFT's ending responses around -2.5, so the
    EOS penalty sits below them at -4 (at the paper's -1 a response that never ends would win its
    pair, and the run would learn to stop ending: measured, 8 of 32 ending samples fell to 6)."""
    workdir = str(tmp_path_factory.mktemp("online_dpo_run"))
    args = tiny_args(quick_eval_data, checkpoints, workdir, "run", total_episodes=128, local_micro_batch_size=8,
                     gradient_accumulation_steps=4, local_rollout_forward_batch_size=8, local_eval_batch_size=8,
                     lr=1e-3, penalty_reward_value=PENALTY, checkpoint_every=1, keep_checkpoints=4,
                     print_sample_output_freq=2, run_eval=True)
    return workdir, args, run_online_dpo(args, workdir)


def test_first_update_starts_at_log_2_and_logs_ppos_metrics(trained, quick_eval_data):
    """Before the first step the policy is its reference: every pair's h is exactly 0, so the loss is
    log 2, both implicit rewards 0 (no pair counts as separated) and the KL 0. The update logs PPO's
    metric names where the quantity is the same, with per-phase seconds that add up within the update."""
    _, args, lines = trained
    train = [m for m in lines if "online_dpo/loss" in m]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 4, 4]  # 4 updates, then validation and test
    first = train[0]
    assert METRIC_NAMES <= first.keys()
    assert first["online_dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["online_dpo/chosen_rewards"] == first["online_dpo/rejected_rewards"] == 0
    assert first["online_dpo/accuracy"] == 0 and first["objective/kl"] == 0
    # chosen is the better of two: a positive margin; some responses end and some do not
    assert first["online_dpo/score_margin"] > 0 and 2 <= first["ppo/val/num_eos_tokens"] <= 30
    assert [m["ppo/episode"] for m in train] == [32, 64, 96, 128]
    assert [m["ppo/lr"] for m in train] == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    context_length = len(load_from_disk(quick_eval_data)["train"][0]["query_token"])
    for m in train:
        phases = sum(m[f"time/{phase}"] for phase in PHASES)
        assert all(m[f"time/{phase}"] > 0 for phase in PHASES) and phases <= m["time/update"]
        assert m["throughput/tokens_per_second"] == pytest.approx(32 * (context_length + 32) / m["time/update"])
        # 32 rollout responses and 8 validation responses from the decodes
        assert m["throughput/generated_tokens_per_second"] == pytest.approx((32 + 8) * 32 / m["time/generation"])


def first_update_pairs(args: online_dpo.Args, quick_eval_data) -> tuple:
    """The first update's 16 queries (the global order), their two samples each drawn here from the SFT
    model with the seeds of their chunk (8 queries) and sample, with their log-probs at T, the reward
    model's EOS-penalised scores and the sample it chooses: (query_responses, responses, logprobs,
    scores [16, 2], chosen [16])."""
    tokenizer = loading.load_tokenizer(args.base_model)
    train = load_from_disk(quick_eval_data)["train"]
    order = online_dpo.epoch_permutations(len(train), -(-args.total_episodes // (2 * len(train))), args.seed)
    queries = torch.tensor(train.select(order[:16])["query_token"])
    sft = loading.load_policy(args.sft_model_path, tokenizer).eval()
    groups = [rollout.SamplingGroup(queries[i: i + 8], 0.7, rollout.derived_seed(args.seed, 0, 1, i, sample))
              for i in (0, 8) for sample in (0, 1)]
    decoded = rollout.decode_in_batches(sft, groups, PAD, len(tokenizer), 32, 16)
    responses, logprobs = (torch.stack([torch.cat(x[0::2]), torch.cat(x[1::2])], 1).flatten(0, 1)  # rows 2q + s
                           for x in zip(*decoded))
    query_responses = torch.cat([queries.repeat_interleave(2, 0), responses], 1)
    postprocessed = online_dpo.truncate_response(responses, EOS, PAD)
    reward_model = loading.load_reward_model(args.reward_model_path, tokenizer).eval()
    with torch.no_grad():
        scores = reward.get_reward(reward_model, torch.cat([queries.repeat_interleave(2, 0), postprocessed], 1), PAD)
    scores = ppo.penalize_missing_eos(scores, postprocessed, EOS, args.penalty_reward_value).view(16, 2)
    return query_responses, responses, logprobs, scores, scores.argmax(1)


def test_the_first_step_trains_on_the_reward_models_choice_and_separates_those_pairs(trained, quick_eval_data):
    """The first update's pairs, rebuilt here from the global order, the seeds and the reward model:
    the run logged their scores, margin, endings and log-probs, so it ranked exactly these samples. After its one
    step (the checkpoint of update 1), the implicit reward beta (log pi - log ref) of the chosen
    exceeds the rejected's on most of these pairs, and their DPO loss is below log 2."""
    workdir, args, lines = trained
    query_responses, responses, logprobs, scores, chosen = first_update_pairs(args, quick_eval_data)
    first = lines[0]
    assert first["objective/scores"] == pytest.approx(scores.mean().item(), abs=1e-5)
    # the loss read the log-probs of the distribution that drew the samples (T 0.7)
    assert first["objective/entropy"] == pytest.approx(-online_dpo.masked_sums(logprobs, responses, EOS).mean().item(),
                                                       abs=1e-3)
    margin = (scores.max(1).values - scores.min(1).values).mean().item()
    assert first["online_dpo/score_margin"] == pytest.approx(margin, abs=1e-5)
    assert first["ppo/val/num_eos_tokens"] == (responses == EOS).any(1).sum().item()
    assert ((scores[:, 0] == scores[:, 1]) & (scores[:, 0] == PENALTY)).any()  # (ties: both without EOS; argmax takes
    # the first, as the run)
    tokenizer = loading.load_tokenizer(args.base_model)
    reference = loading.load_policy(args.sft_model_path, tokenizer).eval()
    policy = loading.load_policy(args.sft_model_path, tokenizer).eval()
    state = torch.load(os.path.join(workdir, "run", "checkpoints", "update-0000001", "state.pt"), weights_only=False)
    policy.load_state_dict(state["model"])
    rows = 2 * torch.arange(16) + chosen, 2 * torch.arange(16) + 1 - chosen
    with torch.no_grad():
        sums = [[online_dpo.response_logprob_sums(model, query_responses[r], responses[r], 0.7, EOS, PAD,
                                                  len(tokenizer)) for r in rows]
                for model in (policy, reference)]
    losses = online_dpo.preference_losses(*sums[0], *sums[1], "dpo", 0.1, 0.0)
    chosen_rewards, rejected_rewards = (online_dpo.implicit_rewards(sums[0][i], sums[1][i], 0.1) for i in (0, 1))
    # (measured: loss 0.33, every pair separated)
    assert losses.mean() < 0.5 and (chosen_rewards > rejected_rewards).float().mean() >= 0.9


def test_training_raises_the_reward_models_score(trained):
    """The pairs favour responses that end (a response without EOS scores -4, below the reward model's
    scores of ending ones): within 4 steps the samples end more often (measured 8 -> 26 of 32) and
    score higher (-3.62 -> -2.77), and move away from the reference."""
    _, _, lines = trained
    train = [m for m in lines if "online_dpo/loss" in m]
    scores = [m["objective/scores"] for m in train]
    assert (scores[2] + scores[3]) / 2 > scores[0] + 0.3
    assert train[-1]["ppo/val/num_eos_tokens"] > train[0]["ppo/val/num_eos_tokens"] + 8
    assert train[1]["objective/kl"] > 0.05 and train[-1]["objective/kl"] > train[1]["objective/kl"]


def test_eval_tables_and_the_saved_policy(trained, quick_eval_data, checkpoints, monkeypatch):
    """--run_eval writes PPO's tables (what eval/ judges), every query once; the saved policy is a
    plain causal LM, the last checkpoint's weights, loadable offline, that still stops at EOS."""
    workdir, _, lines = trained
    final = {k: v for m in lines for k, v in m.items()}
    data = load_from_disk(quick_eval_data)
    for split in ("validation", "test"):
        table = pd.read_csv(os.path.join(workdir, "runs", "run", f"{split}_table.csv"), keep_default_na=False)
        assert list(table.columns) == ["query", "postprocessed_response", "reference_responses", "scores",
                                       "reference_scores", "contain_eos"]
        assert table["contain_eos"].dtype == bool
        assert len(table) == len(data[split])
        assert final[f"eval/{split}/scores"] == pytest.approx(table["scores"].mean(), abs=1e-5)
    assert len(pd.read_csv(os.path.join(workdir, "runs", "run", "samples_3.csv"))) == 8
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    weights, sft = saved(workdir, "run"), load_file(os.path.join(checkpoints[0], "model.safetensors"))
    assert weights.keys() == sft.keys() and (weights[KEY] - sft[KEY]).abs().max() > 1e-4
    last = torch.load(os.path.join(workdir, "run", "checkpoints", "update-0000004", "state.pt"), weights_only=False)
    assert torch.equal(last["model"][KEY], weights[KEY])
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "run"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(workdir, "run"))
    assert type(policy).__name__ == "GPTNeoXForCausalLM" and tokenizer.pad_token_id == PAD
    assert policy.generation_config.eos_token_id == EOS


def test_a_zero_learning_rate_leaves_the_policy_and_the_loss_at_log_2(quick_eval_data, checkpoints, tmp_path):
    """lr 0: the optimizer steps (AdamW, weight decay included) leave every weight as it was, so every
    update's policy is its reference: loss log 2, KL 0, and the saved model is the SFT model bit for bit."""
    args = tiny_args(quick_eval_data, checkpoints, str(tmp_path), "lr0", total_episodes=16, local_micro_batch_size=4,
                     gradient_accumulation_steps=2, local_rollout_forward_batch_size=2, local_eval_batch_size=2, lr=0.0)
    lines = run_online_dpo(args, str(tmp_path))
    assert len(lines) == 2
    for m in lines:
        assert m["online_dpo/loss"] == pytest.approx(math.log(2), abs=1e-6) and m["objective/kl"] == 0
    weights, sft = saved(str(tmp_path), "lr0"), load_file(os.path.join(checkpoints[0], "model.safetensors"))
    assert weights.keys() == sft.keys() and all(torch.equal(weights[k], sft[k]) for k in sft)


def test_ipo_and_label_smoothing_reach_the_loss(quick_eval_data, checkpoints, tmp_path):
    """Before the first step h = 0: IPO's loss is (1 / (2 beta))^2 = 25 at beta 0.1, smoothed DPO's
    still log 2."""
    common = dict(total_episodes=8, local_micro_batch_size=8, gradient_accumulation_steps=1,
                  local_rollout_forward_batch_size=4, local_eval_batch_size=2)
    (ipo,) = run_online_dpo(tiny_args(quick_eval_data, checkpoints, str(tmp_path), "ipo", loss_type="ipo", **common),
                            str(tmp_path))
    assert ipo["online_dpo/loss"] == pytest.approx(25.0, rel=1e-6)
    (smoothed,) = run_online_dpo(tiny_args(quick_eval_data, checkpoints, str(tmp_path), "smoothed",
                                           label_smoothing=0.2, **common), str(tmp_path))
    assert smoothed["online_dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)


# global batch 8 episodes (4 queries x 2 samples) for 3 updates; Adam eps 1 makes the update ~ lr x
# gradient, so a loss normalised per micro-batch would move the weights differently (Adam's default
# eps makes its first step nearly sign(gradient), blind to the scale)
SPLIT = dict(total_episodes=24, local_rollout_forward_batch_size=2, lr=0.05, eps=1.0, print_sample_output_freq=1)


@pytest.fixture(scope="module")
def split_runs(quick_eval_data, checkpoints, tmp_path_factory):
    """The same run as micro-batch 2 x accumulation 4 and as 8 x 1, in this process; and `args(name,
    **changes)`, micro2's settings as another run."""
    workdir = str(tmp_path_factory.mktemp("online_dpo_split"))

    def args(name, **changes):
        settings = {**SPLIT, "local_micro_batch_size": 2, "gradient_accumulation_steps": 4, "local_eval_batch_size": 4}
        return tiny_args(quick_eval_data, checkpoints, workdir, name, **{**settings, **changes})

    runs = {micro: run_online_dpo(args(f"micro{micro}", local_micro_batch_size=micro,
                                       gradient_accumulation_steps=8 // micro), workdir) for micro in (2, 8)}
    return workdir, args, {micro: (metrics, saved(workdir, f"micro{micro}")) for micro, metrics in runs.items()}


def assert_same_metrics(a: list, b: list, rel: float, abs_: float) -> None:
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in [k for k in x if k != "step" and not is_wall_clock(k)]:
            assert x[key] == pytest.approx(y[key], rel=rel, abs=abs_), (x["step"], key, x[key], y[key])


def assert_same_params(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=rtol, atol=atol), (key, (a[key] - b[key]).abs().max())


def test_micro_batch_split_gives_the_same_update(split_runs, checkpoints):
    _, _, runs = split_runs
    (one, p_one), (other, p_other) = runs[2], runs[8]
    assert len(one) == 3 and one[1]["online_dpo/loss"] != pytest.approx(math.log(2), abs=1e-3)
    # float32 sums in another order (the KL is a difference of two sums of 32 log-probs each: ~4e-6 apart
    # here, as the micro-batches skip other amounts of shared padding); Adam with eps 1 does not magnify them
    assert_same_metrics(one, other, rel=1e-4, abs_=1e-6)
    assert_same_params(p_one, p_other, rtol=1e-5, atol=1e-6)
    sft = load_file(os.path.join(checkpoints[0], "model.safetensors"))
    assert (p_one[KEY] - sft[KEY]).abs().max() > 1e-4  # (moved far beyond the tolerance)


def run_files(workdir, name: str, pattern: str) -> dict:
    """The text of the files `pattern` in the run's folder, by file name."""
    return {os.path.basename(p): open(p).read() for p in glob.glob(os.path.join(workdir, "runs", name, pattern))}


def test_resume_after_a_signal_mid_update_equals_the_uninterrupted_run(split_runs, monkeypatch):
    """micro2's run, sent SIGUSR1 in the 6th DPO loss (4 micro-batches per update: the middle of update
    2): it finishes update 2, checkpoints it and exits with 75, leaving no model. --resume (no run name
    given: the checkpoint's) then gives the uninterrupted run's metric lines (rates aside), sample
    tables and weights bit for bit: the queries come from the global order, each sample's noise from
    its (update, row, sample) seed."""
    workdir, args, runs = split_runs
    whole, p_whole = runs[2]
    stopped_args = args("stopped")
    with monkeypatch.context() as patch:
        signal_on_call(patch, online_dpo, "preference_losses", 4 + 2)
        with pytest.raises(SystemExit) as stopped:
            run_online_dpo(stopped_args, workdir)
    assert stopped.value.code == CHECKPOINT_EXIT_CODE == 75
    assert os.listdir(os.path.join(workdir, "stopped", "checkpoints")) == ["update-0000002"]
    assert not os.path.exists(os.path.join(workdir, "stopped", "model.safetensors"))
    assert [m["step"] for m in read_metrics(workdir, "stopped")] == [1, 2]
    resumed = run_online_dpo(args("stopped", resume=True, run_name=None), workdir)
    assert without_rates(resumed) == without_rates(whole)
    assert_same_params(p_whole, saved(workdir, "stopped"), rtol=0, atol=0)
    samples = run_files(workdir, "micro2", "samples_*.csv")
    assert len(samples) == 3 and run_files(workdir, "stopped", "samples_*.csv") == samples


def flags(args: online_dpo.Args) -> list:
    """The command line of `args` (the flags that differ from the defaults)."""
    return command_line_flags(args)


# tolerance of one vs two processes: the same responses (per-chunk seeds), gradients summed in another
# order over processes (PPO's RUN_REL, RUN_ABS)
RUN_REL, RUN_ABS = 1e-4, 1e-6


@pytest.fixture(scope="module")
def two_process_runs(split_runs):
    """micro2's run launched on two processes under DDP ("two") and under DeepSpeed ZeRO-2 ("zero2"),
    side by side: name -> the Future of its finished process."""
    workdir, args, _ = split_runs

    def launch(name, deepspeed):
        two_args = args(name, gradient_accumulation_steps=2, local_eval_batch_size=2, deepspeed=deepspeed)
        launcher = accelerate_launcher(2, DS_CONFIG if deepspeed else None)
        return run_script(launcher + [SCRIPT, *flags(two_args)], workdir, OMP_NUM_THREADS="1")

    return side_by_side(two=functools.partial(launch, "two", False), zero2=functools.partial(launch, "zero2", True))


@pytest.mark.slow
@pytest.mark.parametrize("deepspeed", [False, True], ids=["ddp", "zero2"])
def test_two_processes_match_one_process(split_runs, two_process_runs, deepspeed):
    """micro2's run on two processes (micro-batch 2 x accumulation 2 each, the same global batch of 8
    and validation batch of 4), under DDP over gloo and under DeepSpeed ZeRO-2 (the frozen reference
    and reward model as inference engines): the same metrics and weights. The samples of a query come
    from its chunk's seeds on whichever rank it lands."""
    workdir, _, runs = split_runs
    one, p_one = runs[2]
    name = "zero2" if deepspeed else "two"
    result = two_process_runs[name].result()
    assert "world_size 2 x local_micro_batch_size 2 x gradient_accumulation_steps 2 = batch_size 8 episodes" in \
        " ".join(result.stdout.split())
    assert ("DeepSpeed engine: ZeRO-2" in result.stdout) == deepspeed
    assert_same_metrics(one, read_metrics(workdir, name), RUN_REL, RUN_ABS)
    assert_same_params(p_one, saved(workdir, name), rtol=1e-4, atol=1e-6)


def test_lora_reference_is_exact_and_the_merged_policy_is_saved(quick_eval_data, checkpoints, tmp_path):
    """--use_peft: no second model; the reference is the policy with its adapter disabled, which equals
    the policy at B = 0 bit for bit, so the first loss is log 2 and the first KL exactly 0. The adapters
    then move the policy; the saved model is the SFT model where no adapter sits and SFT + the
    adapter's update where one does, with the adapter alone in adapter/."""
    args = tiny_args(quick_eval_data, checkpoints, str(tmp_path), "lora", total_episodes=16, local_micro_batch_size=4,
                     gradient_accumulation_steps=2, local_rollout_forward_batch_size=2, local_eval_batch_size=2,
                     lr=1e-2, use_peft=True, lora_r=4)
    lines = run_online_dpo(args, str(tmp_path))
    assert lines[0]["online_dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert lines[0]["objective/kl"] == 0 and lines[0]["online_dpo/chosen_rewards"] == 0
    assert lines[1]["objective/kl"] > 1e-3
    weights, sft = saved(str(tmp_path), "lora"), load_file(os.path.join(checkpoints[0], "model.safetensors"))
    assert weights.keys() == sft.keys() and (weights[KEY] - sft[KEY]).abs().max() > 1e-4
    for key in ("gpt_neox.final_layer_norm.weight", "gpt_neox.embed_in.weight", "embed_out.weight"):
        assert torch.equal(weights[key], sft[key]), key
    assert os.path.exists(tmp_path / "lora" / "adapter" / "adapter_model.safetensors")


def test_a_reward_model_that_scores_nan_stops_the_run(quick_eval_data, checkpoints, tmp_path, capsys):
    """A reward model with NaN weights: the first ranking's scores are NaN; the run stops there naming
    the update, the phase and the tensor (exit 1, no model saved)."""
    nan_rm = tmp_path / "nan_rm"
    nan_rm.mkdir()
    for name in os.listdir(checkpoints[1]):
        (nan_rm / name).write_bytes(open(os.path.join(checkpoints[1], name), "rb").read())
    weights = load_file(str(nan_rm / "model.safetensors"))
    weights["score.weight"] = torch.full_like(weights["score.weight"], float("nan"))
    save_file(weights, str(nan_rm / "model.safetensors"), metadata={"format": "pt"})
    args = tiny_args(quick_eval_data, checkpoints, str(tmp_path), "nan", reward_model_path=str(nan_rm),
                     total_episodes=16, local_micro_batch_size=8, gradient_accumulation_steps=1,
                     local_rollout_forward_batch_size=4, local_eval_batch_size=2)
    with pytest.raises(SystemExit) as stopped:
        run_online_dpo(args, str(tmp_path))
    assert stopped.value.code == 1
    assert "STOPPED: update 1, rollout: non-finite scores" in " ".join(capsys.readouterr().out.split())
    assert not os.path.exists(tmp_path / "nan" / "model.safetensors")
