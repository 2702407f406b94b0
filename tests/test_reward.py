import json
import math
import os
import sys

import pandas as pd
import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GPT2Config,
                          GPT2ForSequenceClassification, GPTNeoXConfig, GPTNeoXForSequenceClassification,
                          LlamaForSequenceClassification)

from conftest import (HALF_PAIRS, accelerate_launcher, as_flags, assert_throughput, first_rows, run_in_process,
                      run_script, tiny_llama_config, run_until_signalled, signal_on_call, stop_and_copy, without_rates)
from summarize_from_feedback_details import reward, sft
from summarize_from_feedback_details.infra import checkpoints, loading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "summarize_from_feedback_details", "reward.py")
DS_CONFIG = os.path.join(REPO, "tests", "accelerate_configs", "deepspeed_zero2_cpu.yaml")
DS_ZERO3_CONFIG = os.path.join(REPO, "tests", "accelerate_configs", "deepspeed_zero3_cpu.yaml")

PAD, EOS = 1, 0  # the tiny tokenizer's ids (Pythia: [PAD] 50277, EOS 0)


def sft_model(models_dir):
    # the tiny base model stands in for an SFT checkpoint: same architecture, a causal-LM head
    return os.path.join(models_dir, "pythia-tiny-s")


def run_reward(tiny_datasets, models_dir, workdir, name, **overrides):
    """reward.main in this process, run from `workdir` (runs/ lands there); returns the metrics."""
    data_dir, _ = tiny_datasets
    args = reward.Args(
        base_model=sft_model(models_dir), sft_model_path=sft_model(models_dir),
        label_dataset=os.path.join(data_dir, "preference"), query_dataset=os.path.join(data_dir, "sft"),
        output_dir=os.path.join(workdir, name), run_name=name, seed=3, lr=1e-3, local_eval_batch_size=64,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    run_in_process(reward.main, args, workdir)
    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        metrics = {}
        for line in f:
            metrics.update(json.loads(line))  # keys are unique except `step`
    return metrics


def random_rm(kind: str, hidden: int = 32, vocab: int = 40):
    torch.manual_seed(0)
    if kind == "llama":  # RMSNorm, SwiGLU, grouped-query attention, tied embeddings
        return LlamaForSequenceClassification(tiny_llama_config(vocab, hidden, num_labels=1, pad_token_id=PAD)).eval()
    if kind == "gpt2":  # absolute position embeddings
        config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=2, n_head=2, n_positions=64, bos_token_id=EOS,
                            eos_token_id=EOS, num_labels=1, pad_token_id=PAD)
        return GPT2ForSequenceClassification(config).eval()
    config = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, bos_token_id=EOS, eos_token_id=EOS, num_labels=1, pad_token_id=PAD)
    return GPTNeoXForSequenceClassification(config).eval()


# ---------------------------------------------------------------------------------------------
# pure helpers
# ---------------------------------------------------------------------------------------------


def test_head_init_std_and_zero_bias(models_dir):
    """N(0, 1/sqrt(hidden+1)), no bias; the backbone is the SFT checkpoint's, the LM head is gone."""
    big = random_rm("gpt_neox", hidden=1024, vocab=8)
    reward.init_score_head(big, seed=1)
    weight = big.score.weight
    expected = 1 / math.sqrt(1024 + 1)
    assert weight.shape == (1, 1024) and big.score.bias is None  # HF's head has no bias: bias 0
    assert weight.std().item() == pytest.approx(expected, rel=0.1)  # 1024 draws: ~2% sampling error
    assert abs(weight.mean().item()) < 4 * expected / math.sqrt(1024)
    again = random_rm("gpt_neox", hidden=1024, vocab=8)
    reward.init_score_head(again, seed=1)
    assert torch.equal(again.score.weight, weight)  # the global seed alone decides: same on every rank

    tokenizer = loading.load_tokenizer(sft_model(models_dir))
    model = reward.reward_model_to_train(sft_model(models_dir), tokenizer, head_seed=1)
    assert type(model).__name__ == "GPTNeoXForSequenceClassification" and model.config.num_labels == 1
    assert model.config.pad_token_id == tokenizer.pad_token_id == PAD
    assert model.score.weight.std().item() == pytest.approx(1 / math.sqrt(64 + 1), rel=0.35)  # 64 draws
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    lm = AutoModelForCausalLM.from_pretrained(sft_model(models_dir))
    lm_state = lm.state_dict()
    for key, value in model.gpt_neox.state_dict().items():
        assert torch.equal(value, lm_state[f"gpt_neox.{key}"]), key


def test_reward_is_read_at_the_eos(tiny_datasets, models_dir):
    data_dir, _ = tiny_datasets
    tokenizer = loading.load_tokenizer(sft_model(models_dir))
    model = reward.reward_model_to_train(sft_model(models_dir), tokenizer, head_seed=1).eval()
    rows = load_from_disk(os.path.join(data_dir, "preference"))["validation"].select(range(4))
    ids = torch.tensor(rows["query_chosen_token"])  # right-padded query+response
    eos_index = torch.tensor(rows["query_chosen_token_len"]) - 1
    assert (ids[torch.arange(4), eos_index] == EOS).all() and (ids[:, -1] == PAD).all()
    assert torch.equal(reward.last_non_pad_index(ids, PAD), eos_index)
    with torch.no_grad():
        r = reward.get_reward(model, ids, PAD)
        # the score head applied to the hidden state of the EOS token, computed by hand
        hidden = model.gpt_neox(input_ids=ids, attention_mask=ids != PAD).last_hidden_state
        by_hand = model.score(hidden)[torch.arange(4), eos_index, 0]
        assert torch.allclose(r, by_hand, atol=1e-6)
        # plain transformers, as a user of the saved model would call it, reads the same token
        plain = model(input_ids=ids, attention_mask=ids != PAD).logits[:, 0]
        assert torch.allclose(r, plain, atol=1e-6)
        # more or less padding after the EOS changes nothing
        more = torch.cat([ids, torch.full((4, 9), PAD)], 1)
        fewer = ids[:, : eos_index.max() + 1]
        assert torch.allclose(reward.get_reward(model, more, PAD), r, atol=1e-6)
        assert torch.allclose(reward.get_reward(model, fewer, PAD), r, atol=1e-6)
        # moving the EOS one token earlier (dropping the last word): the reward follows it, read at its
        # new place; a different last real token is read where the EOS was (what is read is the last
        # real token, not a fixed column)
        moved = ids.clone()
        moved[torch.arange(4), eos_index - 1] = EOS
        moved[torch.arange(4), eos_index] = PAD
        no_eos = ids.clone()
        no_eos[torch.arange(4), eos_index] = 5
        for changed, index in ((moved, eos_index - 1), (no_eos, eos_index)):
            hidden = model.gpt_neox(input_ids=changed, attention_mask=changed != PAD).last_hidden_state
            changed_by_hand = model.score(hidden)[torch.arange(4), index, 0]
            assert torch.allclose(reward.get_reward(model, changed, PAD), changed_by_hand, atol=1e-6)
            assert (changed_by_hand - r).abs().max() > 1e-4


@pytest.mark.parametrize("kind", ["gpt_neox", "gpt2", "llama"])
def test_left_padding_does_not_change_the_reward(kind):
    """Same text, 0 / 3 / 11 left pads in one batch and some right pads: the same reward, also for
    GPT-2's absolute positions (positions come from the attention mask)."""
    model = random_rm(kind)
    text = [5, 6, 7, 8, 9, 10, 11, EOS]
    rows = [[PAD] * k + text + [PAD] * (11 - k) for k in (0, 3, 11)]
    with torch.no_grad():
        r = reward.get_reward(model, torch.tensor(rows), PAD)
        alone = reward.get_reward(model, torch.tensor([text]), PAD)
    assert torch.allclose(r, alone.expand(3), atol=1e-5), r
    # the head reads the last real token whatever the padding side
    assert reward.last_non_pad_index(torch.tensor(rows), PAD).tolist() == [7, 10, 18]


def test_same_real_tokens_and_shift_rewards():
    a = torch.tensor([[5, 6, 0, PAD, PAD], [5, 6, 0, PAD, PAD]])
    b = torch.tensor([[PAD, 5, 6, 0, PAD, PAD, PAD], [PAD, 5, 7, 0, PAD, PAD, PAD]])
    assert reward.same_real_tokens(a, b, PAD).tolist() == [True, False]
    for kind in ("gpt_neox", "gpt2"):
        model = random_rm(kind)
        ids = torch.tensor([[5, 6, 7, EOS, PAD], [9, 8, EOS, PAD, PAD]])
        with torch.no_grad():
            before = model(input_ids=ids, attention_mask=ids != PAD).logits[:, 0]
            reward.shift_rewards(model, -1.75)
            after = model(input_ids=ids, attention_mask=ids != PAD).logits[:, 0]
        assert torch.allclose(after, before - 1.75, atol=1e-5), kind


def test_preference_loss_is_additive_over_micro_batches():
    torch.manual_seed(0)
    chosen, rejected = torch.randn(8), torch.randn(8)
    whole = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
    for micro in (1, 2, 4, 8):
        parts = sum(reward.preference_loss(chosen[i:i + micro], rejected[i:i + micro], 8.0) for i in range(0, 8, micro))
        assert torch.allclose(parts, whole, atol=1e-6)
    # known answer: equal rewards give log 2
    assert reward.preference_loss(torch.zeros(2), torch.zeros(2), 2.0).item() == pytest.approx(math.log(2))


def test_accuracy_breakdown():
    table = pd.DataFrame({"accuracy": [1.0, 0.0, 1.0, 1.0], "split": ["valid1", "valid1", "valid2", "valid2"],
                          "batch": ["b1", "b2", "b2", "b2"], "confidence": ["1", "9", "9", "None"]})
    m = reward.accuracy_breakdown(table, "validation")
    assert m["eval/rm/validation/accuracy"] == 0.75
    assert m["eval/rm/validation/accuracy/split/valid1"] == 0.5 and m["eval/rm/validation/accuracy/split/valid2"] == 1
    assert m["eval/rm/validation/accuracy/batch/b1"] == 1 and m["eval/rm/validation/accuracy/batch/b2"] == 2 / 3
    assert m["eval/rm/validation/accuracy/confidence/9"] == 0.5 and m["eval/rm/validation/accuracy/confidence/None"] == 1


# ---------------------------------------------------------------------------------------------
# runs of the script (in-process)
# ---------------------------------------------------------------------------------------------


def test_micro_batch_split_gives_the_same_update(tiny_datasets, models_dir, tmp_path):
    """A fixed local batch of 4 pairs: micro-batch 1 x accumulation 4 == micro-batch 4 x accumulation 1.

    Adam's first step is lr * g / (|g| + eps). With the default eps 1e-5 it is nearly sign(g): blind
    to a wrongly scaled loss, and it magnifies float noise in near-zero gradients by up to 1/eps. With
    eps 1 the update is ~ lr * g, so a loss normalised per micro-batch instead of per global batch
    would move the weights 4x more in one run (differences ~1e-3, far above the tolerance). Gradient
    clipping stays off (the default) for the same reason: it would rescale a wrong gradient."""
    common = dict(total_episodes=4, local_eval_batch_size=128, lr=0.1, eps=1.0)
    m1 = run_reward(tiny_datasets, models_dir, str(tmp_path), "micro1", local_micro_batch_size=1,
                    gradient_accumulation_steps=4, **common)
    m4 = run_reward(tiny_datasets, models_dir, str(tmp_path), "micro4", local_micro_batch_size=4,
                    gradient_accumulation_steps=1, **common)
    assert m1["train/rm/loss"] == pytest.approx(m4["train/rm/loss"], rel=1e-6)
    assert m1["train/rm/chosen_rewards"] == pytest.approx(m4["train/rm/chosen_rewards"], rel=1e-6)
    p1, p4 = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("micro1", "micro4"))
    assert p1.keys() == p4.keys()
    for key in p1:  # a few float32 ulps; the final norm's bias holds the normalisation offset, a mean of the
        # validation rewards divided through the head's norm, which scales their float noise up (measured 1.1e-6)
        rtol = 1e-5 if key == "gpt_neox.final_layer_norm.bias" else 1e-6
        assert torch.allclose(p1[key], p4[key], rtol=rtol, atol=1e-7), (key, (p1[key] - p4[key]).abs().max())
    # and the update really moved the backbone
    sft = load_file(os.path.join(sft_model(models_dir), "model.safetensors"))
    key = "gpt_neox.layers.0.attention.dense.weight"
    assert (p1[key] - sft[key]).abs().max() > 1e-4


def saved_params(workdir, name):
    return load_file(os.path.join(workdir, name, "model.safetensors"))


def test_max_grad_norm_unset_zero_or_negative_means_no_clipping(tiny_datasets, models_dir, tmp_path):
    """Adam eps 1 (update ~ lr * g, see above): unset, 0 and -1 give exactly the unclipped update of
    a norm that never binds (1e9), and clipping at 0.01 changes it. (torch's clip_grad_norm_ at 0
    would zero every gradient.)"""
    common = dict(total_episodes=4, local_micro_batch_size=4, gradient_accumulation_steps=1, lr=0.1, eps=1.0,
                  local_eval_batch_size=128)
    workdir = str(tmp_path)
    for name, norm in (("unset", None), ("zero", 0.0), ("negative", -1.0), ("huge", 1e9), ("clipped", 0.01)):
        run_reward(tiny_datasets, models_dir, workdir, name, max_grad_norm=norm, **common)
    unclipped = saved_params(workdir, "huge")
    for name in ("unset", "zero", "negative"):
        assert_same_params(saved_params(workdir, name), unclipped, rtol=0, atol=0)
    key = "gpt_neox.layers.0.attention.dense.weight"
    sft = load_file(os.path.join(sft_model(models_dir), "model.safetensors"))
    moved = (unclipped[key] - sft[key]).abs().max()
    assert moved > 1e-4 and (saved_params(workdir, "clipped")[key] - sft[key]).abs().max() < moved / 2


def test_gradient_checkpointing_changes_nothing(tiny_datasets, models_dir, tmp_path, attention_calls):
    """2 updates of 2 micro-batches of 2 pairs: the same metrics and weights, bit for bit; the
    backward recomputed each layer of each training forward (2 layers x 4 micro-batches more calls)."""
    common = dict(total_episodes=8, local_micro_batch_size=2, gradient_accumulation_steps=2, local_eval_batch_size=128)
    workdir = str(tmp_path)
    plain = run_reward(tiny_datasets, models_dir, workdir, "plain", **common)
    calls_plain = len(attention_calls)
    checkpointed = run_reward(tiny_datasets, models_dir, workdir, "checkpointed", gradient_checkpointing=True, **common)
    assert len(attention_calls) - calls_plain == calls_plain + 2 * 4
    assert without_rates([plain]) == without_rates([checkpointed])
    assert_same_params(saved_params(workdir, "plain"), saved_params(workdir, "checkpointed"), rtol=0, atol=0)


def read_metrics(workdir, name) -> list:
    """Every line of a run's metrics.jsonl, in order."""
    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]



def run_file(workdir, name, table) -> str:
    with open(os.path.join(workdir, "runs", name, f"{table}.csv")) as f:
        return f.read()


@pytest.fixture(scope="module")
def quick_eval_data(tiny_datasets, tmp_path_factory):
    """The tiny default's preference data with short eval splits (20 and 10 pairs) and the first 30
    SFT train references (what the normalisation scores): the same training, a quicker eval and
    normalisation. (label_dataset, query_dataset)"""
    folder = tmp_path_factory.mktemp("reward_quick_eval")
    for name, sizes in (("preference", {"validation": 20, "validation_cnndm": 10}), ("sft", {"train": 30})):
        first_rows(os.path.join(tiny_datasets[0], name), sizes, str(folder / name))
    return str(folder / "preference"), str(folder / "sft")


def test_resume_after_a_signal_mid_update_equals_the_uninterrupted_run(tiny_datasets, models_dir, quick_eval_data,
                                                                       tmp_path, monkeypatch):
    """6 updates of 6 pairs (micro-batch 2 x accumulation 3) with the eval. SIGUSR1 arrives in the
    8th training forward (pair_rewards; the eval's come after training), the second of update 3's
    three micro-batches: the run finishes update 3, checkpoints, exits with 75 and leaves exactly
    that checkpoint and no model. --resume then gives the uninterrupted run bit for bit: weights,
    metrics.jsonl (the eval's and the normalisation's lines included), train_pairs.csv (the first
    3 updates' pairs come from the checkpoint), the eval tables and the reference rewards."""
    label_dataset, query_dataset = quick_eval_data
    common = dict(total_episodes=36, local_micro_batch_size=2, gradient_accumulation_steps=3, run_eval=True,
                  label_dataset=label_dataset, query_dataset=query_dataset)
    workdir = str(tmp_path)
    run_reward(tiny_datasets, models_dir, workdir, "whole", **common)
    with monkeypatch.context() as patch:
        signal_on_call(patch, reward, "pair_rewards", 8)
        with pytest.raises(SystemExit) as stopped:
            run_reward(tiny_datasets, models_dir, workdir, "stopped", **common)
    assert stopped.value.code == checkpoints.CHECKPOINT_EXIT_CODE == 75
    assert [n for n in os.listdir(tmp_path / "stopped") if n != ".lock"] == ["checkpoints"]  # (no model)
    assert os.listdir(tmp_path / "stopped" / "checkpoints") == ["update-0000003"]
    assert [m["step"] for m in read_metrics(workdir, "stopped")] == [6, 12, 18]
    run_reward(tiny_datasets, models_dir, workdir, "stopped", resume=True, **common)
    whole = read_metrics(workdir, "whole")
    assert without_rates(read_metrics(workdir, "stopped")) == without_rates(whole)
    assert [m["step"] for m in whole] == [6, 12, 18, 24, 30, 36, 36, 36, 36]  # 6 updates, 2 evals, normalisation
    assert "eval/rm/validation/accuracy" in whole[6] and "eval/rm/normalization_offset" in whole[-1]
    assert_same_params(saved_params(workdir, "whole"), saved_params(workdir, "stopped"), rtol=0, atol=0)
    for table in ("train_pairs", "eval_validation_table", "eval_validation_cnndm_table", "reference_rewards"):
        assert run_file(workdir, "whole", table) == run_file(workdir, "stopped", table), table
    assert len(pd.read_csv(tmp_path / "runs" / "stopped" / "train_pairs.csv")) == 36


@pytest.fixture(scope="module")
def trained(tiny_datasets, models_dir, tmp_path_factory):
    """One short run with eval: 8 updates of 16 pairs (128 pairs), micro-batch 8 x accumulation 2."""
    workdir = str(tmp_path_factory.mktemp("reward_run"))
    metrics = run_reward(tiny_datasets, models_dir, workdir, "rm", total_episodes=128, local_micro_batch_size=8,
                         gradient_accumulation_steps=2, run_eval=True)
    return workdir, metrics


def test_saved_model_is_plain_and_normalised(trained, tiny_datasets, monkeypatch):
    workdir, metrics = trained
    data_dir, _ = tiny_datasets
    folder = os.path.join(workdir, "rm")
    with open(os.path.join(folder, "config.json")) as f:
        config_text = f.read()
    config = json.loads(config_text)
    assert config["architectures"] == ["GPTNeoXForSequenceClassification"] and "auto_map" not in config
    assert config["pad_token_id"] == PAD and len(config["id2label"]) == 1
    assert workdir not in config_text and "pythia-tiny" not in config_text  # no path of this machine
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.pad_token_id == PAD and tokenizer.eos_token_id == EOS

    references = load_from_disk(os.path.join(data_dir, "sft"))["train"]
    ids = torch.tensor(references["query_reference_response_token"])
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=ids != PAD).logits[:, 0]  # no extra line
        concat = torch.cat([torch.tensor(references["query_token"]), torch.tensor(references["reference_response_token"])], 1)
        as_ppo = reward.get_reward(model, concat, PAD)
    assert abs(plain.mean().item()) < 1e-4
    assert abs(as_ppo.mean().item()) < 1e-4
    assert plain.std().item() == pytest.approx(metrics["eval/rm/reference_std_before_normalization"], rel=1e-4)
    assert plain.std().item() > 1e-3  # not a degenerate constant model

    # logged statistics and the consistency check
    assert metrics["eval/rm/reference_mean_before_normalization"] == pytest.approx(
        -metrics["eval/rm/normalization_offset"])
    assert abs(metrics["eval/rm/reference_mean_after_normalization"]) < 1e-6
    assert metrics["eval/rm/reference_std_after_normalization"] == pytest.approx(
        metrics["eval/rm/reference_std_before_normalization"])
    assert metrics["eval/rm/normalization_max_error"] < 1e-5
    assert metrics["eval/rm/consistency/frac_same_tokens"] == 1.0
    assert metrics["eval/rm/consistency/frac_gt_tolerance"] == 0.0
    assert metrics["eval/rm/consistency/max_abs_diff"] < 1e-4
    table = pd.read_csv(os.path.join(workdir, "runs", "rm", "reference_rewards.csv"))
    assert len(table) == len(references)
    assert torch.allclose(torch.tensor(table["reward"].values, dtype=torch.float32), plain, atol=1e-4)


def test_update_time_and_throughput(trained, tiny_datasets):
    row = load_from_disk(os.path.join(tiny_datasets[0], "preference"))["train"][0]
    assert_throughput(read_metrics(trained[0], "rm"), 16 * (len(row["query_chosen_token"]) +
                                                           len(row["query_rejected_token"])))


def test_eval_breakdown_matches_the_table(trained, tiny_datasets):
    workdir, metrics = trained
    data_dir, _ = tiny_datasets
    preference = load_from_disk(os.path.join(data_dir, "preference"))
    for split in ("validation", "validation_cnndm"):
        table = pd.read_csv(os.path.join(workdir, "runs", "rm", f"eval_{split}_table.csv"))
        assert list(table.columns) == ["query", "chosen", "rejected", "batch", "split", "confidence", "choice",
                                       "policies", "chosen_policy", "rejected_policy", "accuracy", "chosen_rewards",
                                       "rejected_rewards"]
        # every pair exactly once (64-row eval batches do not divide the split: no duplicates)
        assert len(table) == len(preference[split]) and len(preference[split]) % 64
        assert list(table["chosen"]) == list(preference[split]["chosen"])
        assert (table["accuracy"] == (table["chosen_rewards"] > table["rejected_rewards"])).all()
        assert metrics[f"eval/rm/{split}/accuracy"] == pytest.approx(table["accuracy"].mean(), abs=1e-6)
        for column in ("batch", "split", "confidence"):
            groups = table.groupby(column)["accuracy"].mean()
            assert len(groups) > 1
            for value, accuracy in groups.items():
                assert metrics[f"eval/rm/{split}/accuracy/{column}/{value}"] == pytest.approx(accuracy, abs=1e-6)
    assert sorted(pd.read_csv(os.path.join(workdir, "runs", "rm", "eval_validation_table.csv"))["batch"].unique()) == \
        sorted(set(preference["validation"]["batch"]))
    # training was logged per update against episodes (pairs): 8 updates of 16
    with open(os.path.join(workdir, "runs", "rm", "metrics.jsonl")) as f:
        train = [json.loads(line) for line in f if "train/rm/loss" in line]
    assert [m["step"] for m in train] == [16 * i for i in range(1, 9)]
    assert all(0 <= m["train/rm/accuracy"] <= 1 and m["train/rm/lr"] > 0 for m in train)


def test_eval_rewards_match_the_saved_model(trained, tiny_datasets):
    """The eval table's rewards were taken before normalisation: the saved model gives them minus the mean."""
    workdir, metrics = trained
    data_dir, _ = tiny_datasets
    table = pd.read_csv(os.path.join(workdir, "runs", "rm", "eval_validation_table.csv"))
    rows = load_from_disk(os.path.join(data_dir, "preference"))["validation"].select(range(8))
    model = AutoModelForSequenceClassification.from_pretrained(os.path.join(workdir, "rm")).eval()
    ids = torch.tensor(rows["query_chosen_token"])
    with torch.no_grad():
        r = model(input_ids=ids, attention_mask=ids != PAD).logits[:, 0]
    expected = torch.tensor(table["chosen_rewards"].values[:8], dtype=torch.float32) + metrics["eval/rm/normalization_offset"]
    assert torch.allclose(r, expected, atol=1e-4)


def test_clear_errors(tiny_datasets, models_dir, tmp_path):
    data_dir, _ = tiny_datasets
    preference = load_from_disk(os.path.join(data_dir, "preference"))
    preference.remove_columns(["query_chosen_token"]).save_to_disk(str(tmp_path / "no_column"))
    with pytest.raises(ValueError, match=r"lacks columns \['query_chosen_token'\]"):
        run_reward(tiny_datasets, models_dir, str(tmp_path), "a", label_dataset=str(tmp_path / "no_column"))
    with pytest.raises(ValueError, match="lacks columns"):  # the SFT dataset where preferences belong
        run_reward(tiny_datasets, models_dir, str(tmp_path), "b", label_dataset=os.path.join(data_dir, "sft"))
    with pytest.raises(ValueError, match=r"lacks columns \['query_reference_response_token'"):
        run_reward(tiny_datasets, models_dir, str(tmp_path), "b2", query_dataset=os.path.join(data_dir, "preference"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_reward(tiny_datasets, models_dir, str(tmp_path), "b3", label_dataset="./no_such_dataset")
    with pytest.raises(FileNotFoundError, match="/no/such/sft does not exist"):
        run_reward(tiny_datasets, models_dir, str(tmp_path), "c", sft_model_path="/no/such/sft")
    with pytest.raises(FileNotFoundError, match="/no/such/rm does not exist"):
        run_reward(tiny_datasets, models_dir, str(tmp_path), "d", reward_model_path="/no/such/rm")
    with pytest.raises(ValueError, match="not divisible"):
        run_reward(tiny_datasets, models_dir, str(tmp_path), "e", local_micro_batch_size=4, batch_size=6)


# ---------------------------------------------------------------------------------------------
# launched runs: two processes and DeepSpeed ZeRO-2 on CPU
# ---------------------------------------------------------------------------------------------


def reward_command(tiny_datasets, models_dir, tmp_path, name, *flags, launcher=()) -> list:
    data_dir, _ = tiny_datasets
    return [*(launcher or [sys.executable]), SCRIPT, "--base_model", sft_model(models_dir), "--sft_model_path",
            sft_model(models_dir), "--label_dataset", os.path.join(data_dir, "preference"), "--query_dataset",
            os.path.join(data_dir, "sft"), "--output_dir", str(tmp_path / name), "--run_name", name, "--seed", "3",
            "--lr", "1e-3", "--local_eval_batch_size", "64", *flags]


def run_outputs(tmp_path, name) -> tuple:
    """A finished run's (per-update metrics, weights, train_pairs table)."""
    train = [m for m in read_metrics(str(tmp_path), name) if "train/rm/loss" in m]
    pairs = pd.read_csv(tmp_path / "runs" / name / "train_pairs.csv")
    return train, load_file(str(tmp_path / name / "model.safetensors")), pairs


def launch_reward(tiny_datasets, models_dir, tmp_path, name, *flags, launcher=()):
    """reward.py as a user launches it; returns (stdout, per-update metrics, weights, train_pairs table)."""
    result = run_script(reward_command(tiny_datasets, models_dir, tmp_path, name, *flags, launcher=launcher), tmp_path)
    return result.stdout, *run_outputs(tmp_path, name)


def reference_run(tiny_datasets, models_dir, tmp_path, name, settings: dict):
    """A plain one-process reference run in this process (nothing about its launch is tested; this saves
    a process start): launch_reward's result, without the stdout."""
    run_reward(tiny_datasets, models_dir, str(tmp_path), name, **settings)
    return None, *run_outputs(tmp_path, name)


def curve(train, key="train/rm/loss"):
    return [m[key] for m in train]


def assert_same_params(a, b, rtol=1e-4, atol=1e-6):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=rtol, atol=atol), (key, (a[key] - b[key]).abs().max())


# two epochs of the first 150 training pairs (half_pairs_datasets), global batch 30 (10 updates): one
# process (micro-batch 5 x accumulation 6) or two (5 x 3 each). Adam eps 1 and no clipping make the
# update ~ lr * gradient (see the micro-batch test), so a gradient averaged wrongly over ranks would show.
PROCESSES = {n: dict(num_train_epochs=2, local_micro_batch_size=5, gradient_accumulation_steps=6 // n, lr=0.05, eps=1.0)
             for n in (1, 2)}
TWO = as_flags(PROCESSES[2])


@pytest.fixture(scope="module")
def process_runs(half_pairs_datasets, models_dir, tmp_path_factory):
    """The uninterrupted runs on one process (in this process) and on two (gloo, DDP; rank 0 tracks to
    an offline wandb run): (folder, one, two), each (stdout, per-update metrics, weights, train_pairs)."""
    tmp_path = tmp_path_factory.mktemp("reward_processes")
    one = reference_run(half_pairs_datasets, models_dir, tmp_path, "one", PROCESSES[1])
    two = launch_reward(half_pairs_datasets, models_dir, tmp_path, "two", *TWO, "--track",
                        launcher=accelerate_launcher(2))
    return tmp_path, one, two


@pytest.mark.slow
def test_two_processes_see_every_pair_once_per_epoch_and_match_one_process(process_runs, half_pairs_datasets,
                                                                            models_dir):
    """Each epoch covers every pair id exactly once across both ranks, in a fresh order, and the
    loss curve and weights match one process; the tolerances cover float summation order."""
    tmp_path, (_, one, p_one, pairs_one), (out, two, p_two, pairs_two) = process_runs
    n = len(load_from_disk(os.path.join(half_pairs_datasets[0], "preference"))["train"])
    assert "world_size 2" in out and n == HALF_PAIRS
    assert len(os.listdir(tmp_path / "wandb" / "latest-run")) > 0  # --track: one offline wandb run (rank 0)
    assert len([d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run")]) == 1
    assert len(two) == 2 * n // 30 and len(pairs_two) == 2 * n
    assert (pairs_two.groupby("update").size() == 30).all()
    epochs = [pairs_two["row_index"][:n], pairs_two["row_index"][n:]]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))  # every pair exactly once per epoch
    assert list(epochs[0]) != list(epochs[1])  # reshuffled between epochs
    # the same pairs in the same updates as one process
    for (_, a), (_, b) in zip(pairs_one.groupby("update"), pairs_two.groupby("update")):
        assert sorted(a["row_index"]) == sorted(b["row_index"])
    assert curve(one) == pytest.approx(curve(two), rel=1e-5)  # float reduction order differs slightly
    assert curve(one, "train/rm/accuracy") == pytest.approx(curve(two, "train/rm/accuracy"), abs=1e-9)
    assert_same_params(p_one, p_two)
    # the paper's order, kept behind a flag: each rank shuffles with its own seed, so an epoch
    # repeats some pairs and misses others
    _, _, _, paper = launch_reward(half_pairs_datasets, models_dir, tmp_path, "paper", *TWO,
                                   "--rank_dependent_shuffle", launcher=accelerate_launcher(2))
    first_epoch = set(paper["row_index"][:n])
    assert len(paper) == 2 * n and len(first_epoch) < 0.9 * n


@pytest.mark.slow
def test_resume_on_two_processes_and_on_one(process_runs, half_pairs_datasets, models_dir):
    """Two processes stopped by SIGUSR1 once the first update is logged: they checkpoint at the end
    of the update in progress and exit. Resumed on two processes: the uninterrupted two-process run
    bit for bit (metric lines, the normalisation's included; weights; train_pairs.csv; reference
    rewards). Resumed on one process from a copy of the same checkpoint (same global batch): the
    uninterrupted one-process run, within the tolerances of the test above, with the same pairs
    in the same updates."""
    tmp_path, (_, one, p_one, pairs_one), (_, two, p_two, pairs_two) = process_runs
    launcher = accelerate_launcher(2)
    checkpoint, moved = stop_and_copy(reward_command(half_pairs_datasets, models_dir, tmp_path, "stopped", *TWO,
                                                    launcher=launcher), tmp_path, "stopped", len(two))
    out, _, p_resumed, pairs_resumed = launch_reward(half_pairs_datasets, models_dir, tmp_path, "stopped", *TWO,
                                                     "--resume", launcher=launcher)
    # on one line, the path whole however long (rich wrapped it at 80 columns before)
    resumed = f"resumed run stopped from {tmp_path / 'stopped' / 'checkpoints' / checkpoint} at update "
    assert any(line.startswith(resumed) for line in out.splitlines()), out
    assert without_rates(read_metrics(str(tmp_path), "stopped")) == without_rates(read_metrics(str(tmp_path), "two"))
    assert_same_params(p_two, p_resumed, rtol=0, atol=0)
    assert pairs_resumed.equals(pairs_two)
    assert run_file(str(tmp_path), "stopped", "reference_rewards") == run_file(str(tmp_path), "two", "reference_rewards")
    run_reward(half_pairs_datasets, models_dir, str(moved), "stopped", resume=True, **PROCESSES[1])
    on_one = [m for m in read_metrics(str(moved), "stopped") if "train/rm/loss" in m]
    assert len(on_one) == len(one) == 2 * HALF_PAIRS // 30
    assert curve(on_one) == pytest.approx(curve(one), rel=1e-5)
    assert curve(on_one, "train/rm/accuracy") == pytest.approx(curve(one, "train/rm/accuracy"), abs=1e-9)
    assert_same_params(p_one, saved_params(str(moved), "stopped"))
    pairs_on_one = pd.read_csv(moved / "runs" / "stopped" / "train_pairs.csv")
    for (_, a), (_, b) in zip(pairs_one.groupby("update"), pairs_on_one.groupby("update"), strict=True):
        assert sorted(a["row_index"]) == sorted(b["row_index"])


# global batch 8 (micro-batch 2) for 16 updates: enough of them for a stop signal to arrive while
# the run is still training. Adam eps 1 as above; clipping at 0.1 is active here (at 1.0 these
# gradients are not clipped), so both backends must clip the same way.
ZERO2 = dict(total_episodes=128, local_micro_batch_size=2, lr=0.05, eps=1.0, max_grad_norm=0.1)


@pytest.fixture(scope="module")
def zero2_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("reward_zero2")


@pytest.fixture(scope="module")
def zero2_plain(tiny_datasets, models_dir, zero2_dir):
    """Plain PyTorch on one process, this one (micro-batch 2 x accumulation 4)."""
    return reference_run(tiny_datasets, models_dir, zero2_dir, "plain", dict(ZERO2, gradient_accumulation_steps=4))


@pytest.fixture(scope="module")
def zero2_two(tiny_datasets, models_dir, zero2_dir):
    """DeepSpeed ZeRO-2 on two processes (micro-batch 2 x accumulation 2 each), uninterrupted."""
    return launch_reward(tiny_datasets, models_dir, zero2_dir, "ds2", "--deepspeed", *as_flags(ZERO2),
                         "--gradient_accumulation_steps", "2", launcher=accelerate_launcher(2, DS_CONFIG))


@pytest.mark.slow
@pytest.mark.parametrize("num_processes", [1, 2])
def test_deepspeed_zero2_matches_ddp(tiny_datasets, models_dir, zero2_dir, zero2_plain, request, num_processes):
    """Same global batch of 8 for 16 updates: DeepSpeed ZeRO-2 (1 or 2 processes) == plain PyTorch."""
    _, plain, p_plain, _ = zero2_plain
    if num_processes == 2:
        out, ds, p_ds, _ = request.getfixturevalue("zero2_two")
    else:
        out, ds, p_ds, _ = launch_reward(tiny_datasets, models_dir, zero2_dir, "ds1", "--deepspeed", *as_flags(ZERO2),
                                         "--gradient_accumulation_steps", "4", launcher=accelerate_launcher(1, DS_CONFIG))
    assert "DeepSpeed engine: ZeRO-2, gradient_clipping 0.1" in out and len(ds) == 16
    assert curve(plain) == pytest.approx(curve(ds), rel=1e-5)
    assert_same_params(p_plain, p_ds)


@pytest.mark.slow
def test_deepspeed_resume_equals_the_uninterrupted_run(zero2_two, zero2_dir, tiny_datasets, models_dir):
    """DeepSpeed ZeRO-2 on two processes, stopped by SIGUSR1 once the first update is logged and
    resumed from DeepSpeed's own checkpoint: the uninterrupted run's metric lines, weights and
    train_pairs.csv, bit for bit."""
    _, _, p_whole, pairs_whole = zero2_two
    launcher = accelerate_launcher(2, DS_CONFIG)
    flags = ("--deepspeed", *as_flags(ZERO2), "--gradient_accumulation_steps", "2")
    run_until_signalled(reward_command(tiny_datasets, models_dir, zero2_dir, "ds2_stopped", *flags, launcher=launcher),
                        zero2_dir, zero2_dir / "runs" / "ds2_stopped" / "metrics.jsonl", 1)
    (checkpoint,) = os.listdir(zero2_dir / "ds2_stopped" / "checkpoints")
    assert "pytorch_model" in os.listdir(zero2_dir / "ds2_stopped" / "checkpoints" / checkpoint)  # DeepSpeed's format
    assert int(checkpoint[len("update-"):]) < 16
    _, _, p_resumed, pairs_resumed = launch_reward(tiny_datasets, models_dir, zero2_dir, "ds2_stopped", *flags,
                                                   "--resume", launcher=launcher)
    assert without_rates(read_metrics(str(zero2_dir), "ds2_stopped")) == without_rates(read_metrics(str(zero2_dir), "ds2"))
    assert_same_params(p_whole, p_resumed, rtol=0, atol=0)
    assert pairs_resumed.equals(pairs_whole)


@pytest.mark.slow
def test_deepspeed_zero3_matches_ddp_and_saves_the_normalised_model(tiny_datasets, models_dir, tmp_path):
    """ZeRO-3 shards every weight: the normalisation shift must gather the two it changes, and the
    saved model must still give the SFT train references mean reward 0."""
    common = dict(ZERO2, total_episodes=16)
    _, plain, p_plain, _ = reference_run(tiny_datasets, models_dir, tmp_path, "plain",
                                         dict(common, gradient_accumulation_steps=4))
    _, ds, p_ds, _ = launch_reward(tiny_datasets, models_dir, tmp_path, "z3", "--deepspeed", *as_flags(common),
                                   "--gradient_accumulation_steps", "2", launcher=accelerate_launcher(2, DS_ZERO3_CONFIG))
    assert curve(plain) == pytest.approx(curve(ds), rel=1e-5)
    assert_same_params(p_plain, p_ds)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "z3").eval()
    references = load_from_disk(os.path.join(tiny_datasets[0], "sft"))["train"]
    ids = torch.tensor(references["query_reference_response_token"])
    with torch.no_grad():
        rewards = model(input_ids=ids, attention_mask=ids != PAD).logits[:, 0]
    assert abs(rewards.mean().item()) < 1e-4 and rewards.std().item() > 1e-3


# ---------------------------------------------------------------------------------------------
# algorithm helpers repeated from sft.py on purpose (what can change a result stays in the stage) must not drift
# ---------------------------------------------------------------------------------------------


def test_copies_of_sft_helpers_behave_the_same():
    assert reward.epoch_permutations(7, 3, seed=5) == sft.epoch_permutations(7, 3, seed=5)
    for flags in (dict(local_micro_batch_size=2, gradient_accumulation_steps=4),
                  dict(local_micro_batch_size=2, batch_size=16), dict(total_episodes=37, gradient_accumulation_steps=8)):
        a, b = reward.Args(**flags), sft.Args(**flags)
        reward.derive_batch_sizes(a, 2, 100)
        sft.derive_batch_sizes(b, 2, 100)
        assert (a.local_batch_size, a.batch_size, a.gradient_accumulation_steps, a.num_updates, a.total_episodes) == \
            (b.local_batch_size, b.batch_size, b.gradient_accumulation_steps, b.num_updates, b.total_episodes)


# ---------------------------------------------------------------------------------------------
# LoRA (DESIGN section 18)
# ---------------------------------------------------------------------------------------------


def test_lora_trains_adapters_and_head_and_saves_a_normalised_merged_model(tiny_datasets, models_dir, tmp_path):
    """LoRA reward model, micro-batch 1 x 4 == 4 x 1 (Adam eps 1, as above). Saved: a plain model
    in which only the adapted matrices, the head and the final norm's bias (the normalisation) differ
    from the initial reward model; its rewards of the references average 0. The adapter alone, head
    included, lies in adapter/."""
    from peft import PeftModel

    # (lr 0.02: at 0.1 the two splits' merged weights differed by 2.5e-7, float noise scaled by the
    # adapter's alpha / r = 8, just past the tolerance on some CPUs)
    common = dict(total_episodes=4, local_eval_batch_size=128, lr=0.02, eps=1.0, use_peft=True, lora_r=4)
    m1 = run_reward(tiny_datasets, models_dir, str(tmp_path), "micro1", local_micro_batch_size=1,
                    gradient_accumulation_steps=4, **common)
    m4 = run_reward(tiny_datasets, models_dir, str(tmp_path), "micro4", local_micro_batch_size=4,
                    gradient_accumulation_steps=1, **common)
    assert m1["train/rm/loss"] == pytest.approx(m4["train/rm/loss"], rel=1e-6)
    p1, p4 = saved_params(str(tmp_path), "micro1"), saved_params(str(tmp_path), "micro4")
    assert p1.keys() == p4.keys()
    for key in p1:
        assert torch.allclose(p1[key], p4[key], rtol=1e-6, atol=1e-7), (key, (p1[key] - p4[key]).abs().max())
    tokenizer = loading.load_tokenizer(sft_model(models_dir))
    initial = reward.reward_model_to_train(sft_model(models_dir), tokenizer, head_seed=3)
    adapted = ("query_key_value.weight", "attention.dense.weight", "dense_h_to_4h.weight", "dense_4h_to_h.weight")
    before = {k: v for k, v in initial.state_dict().items()}
    assert p1.keys() == before.keys()
    for key in before:
        if key.endswith(adapted) or key in ("score.weight", "gpt_neox.final_layer_norm.bias"):
            assert (p1[key] - before[key]).abs().max() > 1e-5, key  # (least: 9e-5, layer 0's dense_4h_to_h)
        else:
            assert torch.equal(p1[key], before[key]), key
    assert m1["eval/rm/normalization_max_error"] < 1e-5 and abs(m1["eval/rm/reference_mean_after_normalization"]) < 1e-6
    # the adapter as trained (before the normalisation shift) on the initial model: the saved rewards
    # up to the normalisation offset
    wrapped = PeftModel.from_pretrained(initial, str(tmp_path / "micro1" / "adapter")).eval()
    merged = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "micro1")).eval()
    ids = torch.tensor(load_from_disk(os.path.join(tiny_datasets[0], "sft"))["train"][:8]["query_reference_response_token"])
    with torch.no_grad():
        shifted = reward.get_reward(wrapped, ids, PAD) + m1["eval/rm/normalization_offset"]
        assert torch.allclose(reward.get_reward(merged, ids, PAD), shifted, atol=1e-5)


def test_zero_episodes_saves_the_untrained_head_normalised(tiny_datasets, models_dir, tmp_path):
    """--total_episodes 0 (make compare's control): no update, the backbone under its seeded random head
    (reward_model_to_train's), normalised as every reward model is: mean 0 over the SFT references."""
    data_dir, _ = tiny_datasets
    metrics = run_reward(tiny_datasets, models_dir, str(tmp_path), "control", total_episodes=0)
    assert not any(key.startswith("train/") for key in metrics) and abs(metrics["eval/rm/reference_mean_after_normalization"]) < 1e-6
    saved = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "control")).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "control"))
    untrained = reward.reward_model_to_train(sft_model(models_dir), tokenizer, head_seed=3)
    assert torch.equal(saved.score.weight, untrained.score.weight)
    references = load_from_disk(os.path.join(data_dir, "sft"))["train"]
    ids = torch.tensor(references["query_reference_response_token"])
    with torch.no_grad():
        scores = saved(input_ids=ids, attention_mask=ids != PAD).logits[:, 0]
    assert abs(scores.mean().item()) < 1e-4 and scores.std().item() > 1e-3


def llama_style_sft(tokenizer_dir: str, folder: str) -> str:
    """A randomly initialised Llama-style causal LM (RMSNorm, SwiGLU, grouped-query attention, tied
    embeddings) with the tiny tokenizer: an SFT checkpoint whose final norm has no bias."""
    from transformers import LlamaForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(len(tokenizer), max_position_embeddings=512, pad_token_id=PAD)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_an_rmsnorm_reward_model_keeps_its_normalisation_in_the_config(tiny_datasets, models_dir, tmp_path):
    """A final norm without a bias (Llama, Qwen, ...) cannot hold the shift: it is saved as
    config.reward_offset, the weights stay plain transformers ones, and every stage's scoring (the
    padded and packed rewards, the critic's values at every position) adds it, so the SFT references
    score 0 on average, as on GPT-NeoX."""
    from summarize_from_feedback_details import packing
    from summarize_from_feedback_details import ppo_left_padding as ppo
    data_dir, _ = tiny_datasets
    base = llama_style_sft(sft_model(models_dir), str(tmp_path / "llama_sft"))
    metrics = run_reward(tiny_datasets, models_dir, str(tmp_path), "llama_rm", base_model=base, sft_model_path=base,
                         total_episodes=64, local_micro_batch_size=8)
    folder = str(tmp_path / "llama_rm")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["reward_offset"] == pytest.approx(metrics["eval/rm/normalization_offset"]) != 0
    assert metrics["eval/rm/normalization_max_error"] < 1e-5 and metrics["eval/rm/consistency/max_abs_diff"] < 1e-4
    plain = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert set(load_file(os.path.join(folder, "model.safetensors"))) == set(plain.state_dict())  # nothing extra

    references = load_from_disk(os.path.join(data_dir, "sft"))["train"]
    ids = torch.tensor(references["query_reference_response_token"])
    left_padded = torch.cat([torch.tensor(references["query_token"]), torch.tensor(references["reference_response_token"])], 1)
    tokenizer = loading.load_tokenizer(folder)
    loaded = loading.load_reward_model(folder, tokenizer).eval()
    loading.add_reward_offset(loaded)  # a second call adds nothing
    with torch.no_grad():
        raw = plain(input_ids=ids, attention_mask=ids != PAD).logits[:, 0]
        rewards = reward.get_reward(loaded, left_padded, PAD)
        values = ppo.get_values(loaded, left_padded[:16], PAD)
        plain_values = plain.score(packing.transformer_body(plain)(
            input_ids=left_padded[:16], attention_mask=left_padded[:16] != PAD,
            position_ids=((left_padded[:16] != PAD).cumsum(1) - 1).clamp(min=0)).last_hidden_state).squeeze(-1)
        packing.enable(True, loaded)
        packed = reward.get_reward(loaded, left_padded, PAD)
    assert raw.mean().item() == pytest.approx(-config["reward_offset"], abs=1e-4) and raw.std().item() > 1e-3
    assert abs((raw + config["reward_offset"]).mean().item()) < 1e-4  # what docs/stages.md tells a plain user
    assert abs(rewards.mean().item()) < 1e-4 and torch.allclose(rewards, raw + config["reward_offset"], atol=1e-4)
    assert torch.allclose(packed, rewards, atol=1e-5)
    real = left_padded[:16] != PAD
    assert torch.allclose(values[real], (plain_values + config["reward_offset"])[real], atol=1e-4)
    # the report's scoring from text adds the offset once, whichever loader made the model
    from summarize_from_feedback_details.evaluation import reward_scores
    texts = dict(queries=references["query"][:4], responses=references["reference_response"][:4],
                 contain_eos=[True] * 4)
    from_plain, from_loader = reward_scores(plain, tokenizer, **texts), reward_scores(loaded, tokenizer, **texts)
    assert from_loader == pytest.approx(from_plain, abs=1e-4)
