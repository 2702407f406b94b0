import json
import math
import os
import sys

import pandas as pd
import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import (HALF_PAIRS, accelerate_launcher, as_flags, assert_throughput, first_rows, launched,
                      run_in_process, run_script, run_until_signalled, signal_on_call, stop_and_copy, without_rates)
from summarize_from_feedback_details import dpo, packing, reward, sft
from summarize_from_feedback_details.infra import checkpoints

PAD, EOS = 1, 0  # the tiny tokenizer's ids
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "summarize_from_feedback_details", "dpo.py")
DS_CONFIG = os.path.join(REPO, "tests", "accelerate_configs", "deepspeed_zero2_cpu.yaml")


def sft_model(models_dir):
    """The SFT stand-in: the tiny base model."""
    return os.path.join(models_dir, "pythia-tiny-s")


# ---------------------------------------------------------------------------------------------
# known answers
# ---------------------------------------------------------------------------------------------


def test_sequence_logprobs_count_the_response_with_its_eos_only():
    """Row 0: [query q q | response r EOS | pad]; the label column has the query and padding as pad."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 5)
    labels = torch.tensor([[PAD, PAD, PAD, 3, EOS, PAD],    # response (3, EOS) at positions 3-4
                           [PAD, 4, 2, 2, EOS, PAD]])       # response (4, 2, 2, EOS) at positions 1-4
    logprobs = torch.log_softmax(logits, -1)
    expected = torch.stack([logprobs[0, 2, 3] + logprobs[0, 3, EOS],
                            logprobs[1, 0, 4] + logprobs[1, 1, 2] + logprobs[1, 2, 2] + logprobs[1, 3, EOS]])
    assert torch.allclose(dpo.sequence_logprobs(logits, labels, PAD), expected, atol=1e-6)
    # the same sums as SFT's response-only loss, with the sign flipped
    loss_sums, counts = sft.sequence_losses(logits, labels, PAD)
    assert torch.allclose(dpo.sequence_logprobs(logits, labels, PAD), -loss_sums) and counts.tolist() == [2, 4]


def test_left_aligned_moves_each_rows_trailing_padding_to_its_front():
    ids = torch.tensor([[5, 6, 7, 8, PAD, PAD], [5, 6, 7, 8, 9, 3], [5, PAD, PAD, PAD, PAD, PAD]])
    labels = torch.tensor([[PAD, PAD, 7, EOS, PAD, PAD], [PAD, PAD, PAD, 8, 9, EOS], [PAD] * 6])
    aligned_ids, aligned_labels = dpo.left_aligned(ids, labels, PAD)
    assert aligned_ids.tolist() == [[PAD, PAD, 5, 6, 7, 8], [5, 6, 7, 8, 9, 3], [PAD] * 5 + [5]]
    assert aligned_labels.tolist() == [[PAD, PAD, PAD, PAD, 7, EOS], [PAD, PAD, PAD, 8, 9, EOS], [PAD] * 6]
    assert dpo.response_window(labels, PAD) == 5 and dpo.response_window(aligned_labels, PAD) == 4


@pytest.mark.parametrize("packed", [False, True])
def test_pair_logprobs_run_the_lm_head_on_the_responses_only_and_equal_the_whole_rows(tiny_datasets, models_dir,
                                                                                      packed):
    """The tiny preference rows (query + response + padding, as the paper's) give the log-probs of
    the plain forward over whole rows, while the LM head reads the longest response's window only."""
    rows = load_from_disk(os.path.join(tiny_datasets[0], "preference"))["train"].with_format("torch")[:8]
    columns = [rows[c] for c in dpo.TRAIN_COLUMNS]
    model = AutoModelForCausalLM.from_pretrained(sft_model(models_dir)).eval()
    packing.enable(packed, model)
    head_rows = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: head_rows.append(args[0].shape[:2]))
    with torch.no_grad():
        chosen, rejected = dpo.pair_logprobs(model, *columns, PAD)
    hook.remove()
    packing.enable(False, model)
    with torch.no_grad():
        expected = [dpo.sequence_logprobs(dpo.forward(model, ids, PAD), labels, PAD)
                    for ids, labels in ((columns[0], columns[2]), (columns[1], columns[3]))]
    assert torch.allclose(chosen, expected[0], rtol=1e-5) and torch.allclose(rejected, expected[1], rtol=1e-5)
    window = int(max((c != PAD).sum(1).max() for c in columns[2:])) + 1  # the longest response and one
    lengths = torch.cat([(c != PAD).sum(1) for c in columns[:2]])
    assert window < lengths.min()  # (every row is longer: all of its window is real tokens)
    # packed: the real tokens of each row's last `window` columns; padded: every row's `window` columns
    assert head_rows[0] == ((1, window * 16) if packed else (16, window)), (head_rows, window)


def test_response_label_columns_mask_the_query_and_padding(tiny_datasets, tokenizer):
    """In the tiny preference data the label column keeps exactly the response tokens: the row's
    tokens after the query, ending with the EOS, then padding."""
    train = load_from_disk(os.path.join(tiny_datasets[0], "preference"))["train"]
    for name in ("chosen", "rejected"):
        for row in train.select(range(20)):
            ids, labels = row[f"query_{name}_token"], row[f"query_{name}_token_response_label"]
            kept = [i for i, label in enumerate(labels) if label != PAD]
            assert kept == list(range(kept[0], kept[-1] + 1))  # one contiguous span
            assert [ids[i] for i in kept] == [labels[i] for i in kept] and labels[kept[-1]] == EOS
            assert kept[-1] + 1 == row[f"query_{name}_token_len"]  # ends where the row's padding starts
            assert ids[:kept[0]] == tokenizer.encode(row["query"].strip())


def test_dpo_ipo_and_label_smoothing_known_answers():
    policy_chosen, policy_rejected = torch.tensor([-10.0, -4.0]), torch.tensor([-12.0, -3.0])
    ref_chosen, ref_rejected = torch.tensor([-11.0, -4.0]), torch.tensor([-11.0, -4.0])
    # h = (pc - pr) - (rc - rr) = [2 - 0, -1 - 0]
    h = torch.tensor([2.0, -1.0])
    beta = 0.5
    dpo_loss = dpo.dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, 0.0, False)
    assert torch.allclose(dpo_loss, torch.log1p(torch.exp(-beta * h)))
    smoothed = dpo.dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, 0.1, False)
    assert torch.allclose(smoothed, 0.9 * torch.log1p(torch.exp(-beta * h)) + 0.1 * torch.log1p(torch.exp(beta * h)))
    ipo = dpo.dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, 0.0, True)
    assert torch.allclose(ipo, torch.tensor([(2.0 - 1.0) ** 2, (-1.0 - 1.0) ** 2]))
    assert torch.allclose(dpo.implicit_rewards(policy_chosen, ref_chosen, beta), torch.tensor([0.5, 0.0]))
    # policy == reference: every loss is log 2 and every reward 0
    zero = dpo.dpo_losses(ref_chosen, ref_rejected, ref_chosen, ref_rejected, 0.05, 0.0, False)
    assert torch.allclose(zero, torch.full((2,), math.log(2)))


# ---------------------------------------------------------------------------------------------
# runs of the script
# ---------------------------------------------------------------------------------------------


def dpo_args(tiny_datasets, models_dir, workdir, name, **overrides) -> dpo.Args:
    data_dir, _ = tiny_datasets
    args = dpo.Args(base_model=sft_model(models_dir), sft_model_path=sft_model(models_dir),
                    label_dataset=os.path.join(data_dir, "preference"), query_dataset=os.path.join(data_dir, "sft"),
                    output_dir=os.path.join(workdir, name), run_name=name, seed=3, lr=1e-3, response_length=32,
                    local_eval_batch_size=64)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def read_metrics(workdir, name) -> list:
    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_dpo(tiny_datasets, models_dir, workdir, name, **overrides):
    """dpo.main in this process: (per-update metrics, all metric lines, saved weights)."""
    run_in_process(dpo.main, dpo_args(tiny_datasets, models_dir, workdir, name, **overrides), workdir)
    lines = read_metrics(workdir, name)
    return ([m for m in lines if "train/rm/loss" in m], lines,
            load_file(os.path.join(workdir, name, "model.safetensors")))


def assert_same_params(a, b, rtol, atol):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=rtol, atol=atol), (key, (a[key] - b[key]).abs().max())


def curve(train, key="train/rm/loss"):
    return [m[key] for m in train]


KEY = "gpt_neox.layers.0.attention.dense.weight"


def test_micro_batch_split_gives_the_same_update(tiny_datasets, models_dir, tmp_path):
    """A fixed local batch of 4 pairs: micro-batch 1 x accumulation 4 == 4 x 1. With Adam eps 1 the
    update is ~ lr * gradient, so a loss normalised per micro-batch would move the weights 4x more."""
    common = dict(total_episodes=8, lr=0.1, eps=1.0)
    m1, _, p1 = run_dpo(tiny_datasets, models_dir, str(tmp_path), "micro1", local_micro_batch_size=1,
                        gradient_accumulation_steps=4, **common)
    m4, _, p4 = run_dpo(tiny_datasets, models_dir, str(tmp_path), "micro4", local_micro_batch_size=4,
                        gradient_accumulation_steps=1, **common)
    assert len(m1) == 2
    for key in ("train/rm/loss", "train/rm/accuracy", "train/dpo/logps_rejected"):
        assert curve(m1, key) == pytest.approx(curve(m4, key), rel=1e-5, abs=1e-7), key
    # an implicit reward is beta times a difference of two log-prob sums of ~ -100: their float32 ulps
    # (~1e-5), times beta 0.1, are its noise (measured 2.8e-7 on 0.021)
    assert curve(m1, "train/rm/chosen_rewards") == pytest.approx(curve(m4, "train/rm/chosen_rewards"), abs=2e-6)
    assert_same_params(p1, p4, rtol=1e-5, atol=1e-6)
    base = load_file(os.path.join(sft_model(models_dir), "model.safetensors"))
    assert (p1[KEY] - base[KEY]).abs().max() > 1e-5  # moved far beyond the tolerance above


@pytest.fixture(scope="module")
def trained(tiny_datasets, models_dir, tmp_path_factory):
    """4 updates of 16 pairs with the final eval."""
    workdir = str(tmp_path_factory.mktemp("dpo_run"))
    train, lines, params = run_dpo(tiny_datasets, models_dir, workdir, "dpo", total_episodes=64,
                                   local_micro_batch_size=8, gradient_accumulation_steps=2, run_eval=True)
    return workdir, train, lines, params


def test_first_update_starts_from_the_reference_and_training_separates_the_pairs(trained):
    _, train, _, _ = trained
    first = train[0]  # logged before the first step: policy == reference
    assert first["train/rm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["train/rm/chosen_rewards"] == first["train/rm/rejected_rewards"] == 0
    assert first["train/dpo/logps_chosen"] == first["train/dpo/ref_logps_chosen"]
    assert train[-1]["train/rm/reward_margin"] > 0  # (measured before that update's step: unseen pairs)


def test_update_time_and_throughput(trained, tiny_datasets):
    row = load_from_disk(os.path.join(tiny_datasets[0], "preference"))["train"][0]
    assert_throughput(trained[1], 16 * (len(row["query_chosen_token"]) + len(row["query_rejected_token"])))


def test_the_reference_never_changes(trained, tiny_datasets, models_dir):
    """The reference log-probs logged at every update are those of the SFT checkpoint on that
    update's pairs (train_pairs.csv), computed here independently."""
    workdir, train, _, _ = trained
    pairs = pd.read_csv(os.path.join(workdir, "runs", "dpo", "train_pairs.csv"))
    data = load_from_disk(os.path.join(tiny_datasets[0], "preference"))["train"].with_format("torch")
    model = AutoModelForCausalLM.from_pretrained(sft_model(models_dir)).eval()
    for update, m in enumerate(train, start=1):
        rows = data.select(pairs[pairs["update"] == update]["row_index"].tolist())[:]
        with torch.no_grad():
            chosen, rejected = dpo.pair_logprobs(model, *(rows[c] for c in dpo.TRAIN_COLUMNS), PAD)
        assert m["train/dpo/ref_logps_chosen"] == pytest.approx(chosen.mean().item(), rel=1e-5)
        assert m["train/dpo/ref_logps_rejected"] == pytest.approx(rejected.mean().item(), rel=1e-5)
    # while the policy moved away from it
    assert train[-1]["train/dpo/logps_chosen"] != pytest.approx(train[-1]["train/dpo/ref_logps_chosen"], rel=1e-4)


def test_eval_reports_implicit_reward_accuracy_like_the_reward_model(trained, tiny_datasets):
    workdir, _, lines, _ = trained
    final = {k: v for m in lines for k, v in m.items()}
    preference = load_from_disk(os.path.join(tiny_datasets[0], "preference"))
    for split in ("validation", "validation_cnndm"):
        table = pd.read_csv(os.path.join(workdir, "runs", "dpo", f"eval_{split}_table.csv"), keep_default_na=False)
        assert len(table) == len(preference[split])  # every pair once, no sharding duplicates
        assert list(table.columns) == list(pd.read_csv(os.path.join(workdir, "runs", "dpo",
                                                                    f"eval_{split}_table.csv")).columns)
        assert final[f"eval/rm/{split}/accuracy"] == pytest.approx(table["accuracy"].mean())
        assert final[f"eval/rm/{split}/reward_margin"] == pytest.approx(
            (table["chosen_rewards"] - table["rejected_rewards"]).mean(), abs=1e-6)
        expected = reward.accuracy_breakdown(table, split)
        assert {k: final[k] for k in expected} == pytest.approx(expected)
        assert any(k.startswith(f"eval/rm/{split}/accuracy/confidence/") for k in final)
    # the generation tables that eval/rlhf_scaling_plot.py judges
    sft_data = load_from_disk(os.path.join(tiny_datasets[0], "sft"))
    for split in ("validation", "test"):
        table = pd.read_csv(os.path.join(workdir, "runs", "dpo", f"{split}_table.csv"), keep_default_na=False)
        assert list(table.columns) == ["query", "postprocessed_response", "reference_responses", "contain_eos"]
        assert len(table) == len(sft_data[split])
        assert sorted(table["query"]) == sorted(q.strip() for q in sft_data[split]["query"])


def test_saved_policy_is_a_plain_causal_lm(trained, monkeypatch):
    workdir, _, _, params = trained
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "dpo"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(workdir, "dpo"))
    assert type(model).__name__ == "GPTNeoXForCausalLM" and tokenizer.pad_token_id == PAD
    assert torch.equal(model.state_dict()[KEY], params[KEY])
    assert model.generation_config.eos_token_id == EOS


def test_ipo_and_label_smoothing_train(tiny_datasets, models_dir, tmp_path):
    """The flags reach the loss: before the first step IPO's loss is (1 / (2 beta))^2, and smoothed
    DPO's is still log 2."""
    common = dict(total_episodes=16, local_micro_batch_size=8, gradient_accumulation_steps=1)
    ipo, _, _ = run_dpo(tiny_datasets, models_dir, str(tmp_path), "ipo", ipo=True, beta=0.5, **common)
    assert ipo[0]["train/rm/loss"] == pytest.approx(1.0, rel=1e-6)
    smoothed, _, _ = run_dpo(tiny_datasets, models_dir, str(tmp_path), "smooth", label_smoothing=0.2, **common)
    assert smoothed[0]["train/rm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert ipo[1]["train/rm/loss"] != smoothed[1]["train/rm/loss"]


def test_gradient_checkpointing_changes_nothing(tiny_datasets, models_dir, tmp_path, attention_calls):
    """2 updates of 2 micro-batches: bit-identical, and 2 layers x 4 micro-batches more attention calls."""
    common = dict(total_episodes=8, local_micro_batch_size=2, gradient_accumulation_steps=2)
    plain, _, p_plain = run_dpo(tiny_datasets, models_dir, str(tmp_path), "plain", **common)
    calls_plain = len(attention_calls)
    checkpointed, _, p_checkpointed = run_dpo(tiny_datasets, models_dir, str(tmp_path), "checkpointed",
                                              gradient_checkpointing=True, **common)
    assert len(attention_calls) - calls_plain == calls_plain + 2 * 4
    assert without_rates(plain) == without_rates(checkpointed)
    assert_same_params(p_plain, p_checkpointed, rtol=0, atol=0)



def run_file(workdir, name, table) -> str:
    with open(os.path.join(workdir, "runs", name, f"{table}.csv")) as f:
        return f.read()


@pytest.fixture(scope="module")
def quick_eval_data(tiny_datasets, tmp_path_factory):
    """The tiny default with short eval splits: 20 and 10 preference pairs, 8 validation and 8 test
    queries to generate for. The same training, a quicker eval. (label_dataset, query_dataset)"""
    folder = tmp_path_factory.mktemp("dpo_quick_eval")
    for name, sizes in (("preference", {"validation": 20, "validation_cnndm": 10}), ("sft", {"validation": 8, "test": 8})):
        first_rows(os.path.join(tiny_datasets[0], name), sizes, str(folder / name))
    return str(folder / "preference"), str(folder / "sft")


EVAL_TABLES = ("train_pairs", "eval_validation_table", "eval_validation_cnndm_table", "validation_table", "test_table")


def test_resume_after_a_signal_mid_update_equals_the_uninterrupted_run(tiny_datasets, models_dir, quick_eval_data,
                                                                       tmp_path, monkeypatch):
    """6 updates of 6 pairs (micro-batch 2 x accumulation 3) with the eval (its generation samples at
    the default temperature 0.01 from the RNG streams the checkpoint restores). Each training micro-batch calls
    pair_logprobs twice (reference, then policy; the eval's calls come after training): SIGUSR1
    arrives in the 16th call, the policy forward of update 3's second micro-batch. The run finishes
    update 3, checkpoints, exits with 75 and leaves exactly that checkpoint and no model; --resume
    then gives the uninterrupted run bit for bit: weights, metrics.jsonl (the eval's lines included),
    train_pairs.csv, the implicit-reward eval tables and the generation tables."""
    label_dataset, query_dataset = quick_eval_data
    common = dict(total_episodes=36, local_micro_batch_size=2, gradient_accumulation_steps=3, run_eval=True,
                  label_dataset=label_dataset, query_dataset=query_dataset)
    workdir = str(tmp_path)
    _, whole, p_whole = run_dpo(tiny_datasets, models_dir, workdir, "whole", **common)
    with monkeypatch.context() as patch:
        signal_on_call(patch, dpo, "pair_logprobs", 16)
        with pytest.raises(SystemExit) as stopped:
            run_dpo(tiny_datasets, models_dir, workdir, "stopped", **common)
    assert stopped.value.code == checkpoints.CHECKPOINT_EXIT_CODE == 75
    assert [n for n in os.listdir(tmp_path / "stopped") if n != ".lock"] == ["checkpoints"]  # (no model)
    assert os.listdir(tmp_path / "stopped" / "checkpoints") == ["update-0000003"]
    assert [m["step"] for m in read_metrics(workdir, "stopped")] == [6, 12, 18]
    _, resumed, p_resumed = run_dpo(tiny_datasets, models_dir, workdir, "stopped", resume=True, **common)
    assert without_rates(resumed) == without_rates(whole)
    assert [m["step"] for m in whole] == [6, 12, 18, 24, 30, 36, 36, 36]  # 6 updates, 2 implicit-reward evals
    assert_same_params(p_whole, p_resumed, rtol=0, atol=0)
    for table in EVAL_TABLES:
        assert run_file(workdir, "whole", table) == run_file(workdir, "stopped", table), table
    assert len(pd.read_csv(tmp_path / "runs" / "stopped" / "train_pairs.csv")) == 36


def dpo_command(tiny_datasets, models_dir, tmp_path, name, *flags, launcher=()) -> list:
    data_dir, _ = tiny_datasets
    # (the settings of dpo_args: a run resumed in this process keeps them)
    return [*(launcher or [sys.executable]), SCRIPT, "--base_model", sft_model(models_dir), "--sft_model_path",
            sft_model(models_dir), "--label_dataset", os.path.join(data_dir, "preference"), "--query_dataset",
            os.path.join(data_dir, "sft"), "--response_length", "32", "--output_dir", str(tmp_path / name),
            "--run_name", name, "--seed", "3", *flags]


def launch_dpo(tiny_datasets, models_dir, tmp_path, name, *flags, launcher=()):
    """dpo.py as a user launches it: (stdout, per-update metrics, weights, train_pairs table)."""
    result = run_script(dpo_command(tiny_datasets, models_dir, tmp_path, name, *flags, launcher=launcher), tmp_path)
    train = [m for m in read_metrics(str(tmp_path), name) if "train/rm/loss" in m]
    pairs = pd.read_csv(tmp_path / "runs" / name / "train_pairs.csv")
    return result.stdout, train, load_file(str(tmp_path / name / "model.safetensors")), pairs


# two epochs of the first 150 training pairs (half_pairs_datasets), global batch 30 (10 updates): one
# process (micro-batch 5 x accumulation 6) or two (5 x 3 each); Adam eps 1: update ~ lr * gradient
PROCESSES = {n: dict(num_train_epochs=2, local_micro_batch_size=5, gradient_accumulation_steps=6 // n, lr=0.05, eps=1.0)
             for n in (1, 2)}
TWO = as_flags(PROCESSES[2])


@pytest.fixture(scope="module")
def process_runs(half_pairs_datasets, models_dir, tmp_path_factory):
    """The uninterrupted runs on one process (in this process: nothing about its launch is tested, and
    this saves a process start) and on two (gloo, DDP): (folder, one, two), each (stdout (None for
    one), per-update metrics, weights, train_pairs)."""
    tmp_path = tmp_path_factory.mktemp("dpo_processes")
    train, _, params = run_dpo(half_pairs_datasets, models_dir, str(tmp_path), "one", **PROCESSES[1])
    one = None, train, params, pd.read_csv(tmp_path / "runs" / "one" / "train_pairs.csv")
    two = launch_dpo(half_pairs_datasets, models_dir, tmp_path, "two", *TWO, launcher=accelerate_launcher(2))
    return tmp_path, one, two


@pytest.mark.slow
def test_two_processes_see_every_pair_once_per_epoch_and_match_one_process(process_runs, half_pairs_datasets):
    """One process and two see the same pairs in the same updates, every pair exactly once per
    epoch across both ranks, and give the same curves and weights."""
    _, (_, one, p_one, pairs_one), (out, two, p_two, pairs_two) = process_runs
    n = len(load_from_disk(os.path.join(half_pairs_datasets[0], "preference"))["train"])
    assert "world_size 2" in out and n == HALF_PAIRS and len(two) == 2 * n // 30
    epochs = [pairs_two["row_index"][:n], pairs_two["row_index"][n:]]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert list(epochs[0]) != list(epochs[1])
    for (_, a), (_, b) in zip(pairs_one.groupby("update"), pairs_two.groupby("update")):
        assert sorted(a["row_index"]) == sorted(b["row_index"])
    assert curve(one) == pytest.approx(curve(two), rel=1e-5)
    assert curve(one, "train/rm/accuracy") == pytest.approx(curve(two, "train/rm/accuracy"), abs=1e-9)
    assert_same_params(p_one, p_two, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_resume_on_two_processes_and_on_one(process_runs, half_pairs_datasets, models_dir):
    """Two processes stopped by SIGUSR1 once the first update is logged: they checkpoint at the end
    of the update in progress and exit. Resumed on two processes: the uninterrupted two-process run
    bit for bit (metric lines, weights, train_pairs.csv). Resumed on one process from a copy of the
    same checkpoint (same global batch): the uninterrupted one-process run within the tolerances of
    the test above, with the same pairs in the same updates."""
    tmp_path, (_, one, p_one, pairs_one), (_, two, p_two, pairs_two) = process_runs
    launcher = accelerate_launcher(2)
    checkpoint, moved = stop_and_copy(dpo_command(half_pairs_datasets, models_dir, tmp_path, "stopped", *TWO,
                                                 launcher=launcher), tmp_path, "stopped", len(two))
    out, _, p_resumed, pairs_resumed = launch_dpo(half_pairs_datasets, models_dir, tmp_path, "stopped", *TWO,
                                                  "--resume", launcher=launcher)
    # (rich wraps the console at 80 columns, also inside a long path)
    assert "".join(f"resumed run stopped from {tmp_path / 'stopped' / 'checkpoints' / checkpoint}".split()) in \
        "".join(out.split())
    assert without_rates(read_metrics(str(tmp_path), "stopped")) == without_rates(read_metrics(str(tmp_path), "two"))
    assert_same_params(p_two, p_resumed, rtol=0, atol=0)
    assert pairs_resumed.equals(pairs_two)
    on_one, _, p_on_one = run_dpo(half_pairs_datasets, models_dir, str(moved), "stopped", resume=True,
                                  **PROCESSES[1])
    assert len(on_one) == len(one) == 2 * HALF_PAIRS // 30
    assert curve(on_one) == pytest.approx(curve(one), rel=1e-5)
    assert curve(on_one, "train/rm/accuracy") == pytest.approx(curve(one, "train/rm/accuracy"), abs=1e-9)
    assert_same_params(p_one, p_on_one, rtol=1e-4, atol=1e-6)
    pairs_on_one = pd.read_csv(moved / "runs" / "stopped" / "train_pairs.csv")
    for (_, a), (_, b) in zip(pairs_one.groupby("update"), pairs_on_one.groupby("update"), strict=True):
        assert sorted(a["row_index"]) == sorted(b["row_index"])


# global batch 8 on two processes (micro-batch 2 x accumulation 2 each) for 12 updates: enough of
# them for a stop signal to arrive while the run is still training
ZERO2 = ("--total_episodes", "96", "--local_micro_batch_size", "2", "--gradient_accumulation_steps", "2",
         "--lr", "0.05", "--eps", "1")


@pytest.fixture(scope="module")
def zero2_runs(tiny_datasets, models_dir, tmp_path_factory):
    """The uninterrupted DeepSpeed ZeRO-2 run on two processes: (folder, its launch_dpo result)."""
    tmp_path = tmp_path_factory.mktemp("dpo_zero2")
    return tmp_path, launch_dpo(tiny_datasets, models_dir, tmp_path, "ds", "--deepspeed", *ZERO2,
                                launcher=accelerate_launcher(2, DS_CONFIG))


@pytest.mark.slow
def test_deepspeed_zero2_matches_ddp(zero2_runs, tiny_datasets, models_dir, tmp_path):
    """Global batch 8 for 12 updates on 2 processes: DeepSpeed ZeRO-2 (the reference as a DeepSpeed
    inference engine) == plain PyTorch DDP."""
    _, (out, ds, p_ds, _) = zero2_runs
    _, plain, p_plain, _ = launch_dpo(tiny_datasets, models_dir, tmp_path, "plain", *ZERO2,
                                      launcher=accelerate_launcher(2))
    assert "DeepSpeed engine: ZeRO-2, gradient_clipping 0.0" in out
    assert "reference policy: DeepSpeed ZeRO-0 engine, torch.float32" in " ".join(out.split())
    assert len(ds) == 12
    for key in ("train/rm/loss", "train/rm/chosen_rewards", "train/dpo/ref_logps_chosen"):
        # (abs: chosen_rewards = beta x the difference of two summed log-probs near -50, whose fp32
        # rounding (~4e-6 each, more summed over ~50 tokens) leaves 1e-7 to 5e-7 of noise on values
        # near 0.01: the DDP and ZeRO-2 gradient sums round differently; measured with the packed
        # forwards: 9.5e-8 at most on an Intel CPU, 2.1e-7 (rel 1.2e-5) on an AMD EPYC. A wrong
        # gradient average or reference moves these curves by 1e-3 or more.)
        assert curve(plain, key) == pytest.approx(curve(ds, key), rel=1e-5, abs=5e-7), key
    assert_same_params(p_plain, p_ds, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_deepspeed_resume_equals_the_uninterrupted_run(zero2_runs, tiny_datasets, models_dir):
    """DeepSpeed ZeRO-2 on two processes, stopped by SIGUSR1 once the first update is logged and
    resumed from DeepSpeed's own checkpoint (the frozen reference is not in it: it never changes):
    the uninterrupted run's metric lines, weights and train_pairs.csv, bit for bit."""
    tmp_path, (_, _, p_whole, pairs_whole) = zero2_runs
    launcher = accelerate_launcher(2, DS_CONFIG)
    run_until_signalled(dpo_command(tiny_datasets, models_dir, tmp_path, "stopped", "--deepspeed", *ZERO2,
                                    launcher=launcher), tmp_path, tmp_path / "runs" / "stopped" / "metrics.jsonl", 1)
    (checkpoint,) = os.listdir(tmp_path / "stopped" / "checkpoints")
    assert "pytorch_model" in os.listdir(tmp_path / "stopped" / "checkpoints" / checkpoint)  # DeepSpeed's format
    assert int(checkpoint[len("update-"):]) < 12
    _, _, p_resumed, pairs_resumed = launch_dpo(tiny_datasets, models_dir, tmp_path, "stopped", "--deepspeed", *ZERO2,
                                                "--resume", launcher=launcher)
    assert without_rates(read_metrics(str(tmp_path), "stopped")) == without_rates(read_metrics(str(tmp_path), "ds"))
    assert_same_params(p_whole, p_resumed, rtol=0, atol=0)
    assert pairs_resumed.equals(pairs_whole)


def test_clear_errors(tiny_datasets, models_dir, tmp_path):
    """In this process (as the command line raises them), and once through the command line."""
    data_dir, _ = tiny_datasets
    result = launched([sys.executable, SCRIPT, "--base_model", sft_model(models_dir), "--sft_model_path",
                       sft_model(models_dir), "--output_dir", str(tmp_path / "x"), "--label_dataset", "./nope"],
                      tmp_path, dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode != 0 and "does not exist (build it with tldr_dataset.py)" in result.stderr

    def fails(error, match, **overrides):
        with pytest.raises(error, match=match):
            run_in_process(dpo.main, dpo_args(tiny_datasets, models_dir, str(tmp_path), "x", **overrides), str(tmp_path))

    fails(ValueError, "lacks columns", label_dataset=os.path.join(data_dir, "sft"))
    fails(ValueError, "accelerate is not configured for DeepSpeed", deepspeed=True)
    fails(ValueError, "--offload puts the frozen models on DeepSpeed", offload=True)
    fails(ValueError, "--beta must be > 0", beta=0.0)
    fails(FileNotFoundError, "/no/such/sft does not exist", sft_model_path="/no/such/sft")


# ---------------------------------------------------------------------------------------------
# LoRA (DESIGN section 18)
# ---------------------------------------------------------------------------------------------


def test_lora_dpo_reference_is_the_disabled_adapter(tiny_datasets, models_dir, tmp_path):
    """LoRA DPO: no second model is loaded; the first loss is exactly log 2 (the reference, the
    policy with its adapter disabled, equals the policy at B = 0), micro-batch 1 x 4 == 4 x 1, the
    pairs separate, and the saved model is the SFT model where no adapter sits, bit for bit."""
    common = dict(total_episodes=8, lr=0.1, eps=1.0, use_peft=True, lora_r=4)
    m1, _, p1 = run_dpo(tiny_datasets, models_dir, str(tmp_path), "micro1", local_micro_batch_size=1,
                        gradient_accumulation_steps=4, **common)
    m4, _, p4 = run_dpo(tiny_datasets, models_dir, str(tmp_path), "micro4", local_micro_batch_size=4,
                        gradient_accumulation_steps=1, **common)
    assert len(m1) == 2 and m1[0]["train/rm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert m1[0]["train/dpo/logps_chosen"] == m1[0]["train/dpo/ref_logps_chosen"]
    # the reference stays the SFT model: the policy moved, the reference log-probs did not
    assert m1[1]["train/dpo/logps_chosen"] != m1[1]["train/dpo/ref_logps_chosen"]
    # (implicit rewards: beta x a difference of summed log-probs, whose float32 noise is ~1e-7 of ~50)
    for key in ("train/rm/loss", "train/rm/chosen_rewards", "train/dpo/ref_logps_chosen", "train/dpo/logps_rejected"):
        assert curve(m1, key) == pytest.approx(curve(m4, key), rel=1e-5, abs=1e-6), key
    assert_same_params(p1, p4, rtol=1e-5, atol=1e-6)
    base = load_file(os.path.join(sft_model(models_dir), "model.safetensors"))
    assert (p1[KEY] - base[KEY]).abs().max() > 1e-5  # (an adapted matrix)
    norm = "gpt_neox.final_layer_norm.weight"
    assert torch.equal(p1[norm], base[norm]) and torch.equal(p1["gpt_neox.embed_in.weight"], base["gpt_neox.embed_in.weight"])
    assert os.path.exists(tmp_path / "micro1" / "adapter" / "adapter_model.safetensors")


def test_lora_has_no_reference_to_offload(tiny_datasets, models_dir, tmp_path):
    args = dpo_args(tiny_datasets, models_dir, str(tmp_path), "x", use_peft=True, offload=True)
    with pytest.raises(ValueError, match="with --use_peft there is none"):
        run_in_process(dpo.main, args, str(tmp_path))
