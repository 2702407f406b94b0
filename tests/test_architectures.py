"""The whole pipeline on the architectures researchers start from today (tiny_models.py --arch): a
Llama-style model (RMSNorm, SwiGLU, grouped-query attention, tied embeddings) with Llama 3's
tokenizer conventions (a BOS prepended to every encode, no pad token), and a Qwen3-style one (QK-norm
too) with Qwen's (the EOS is also the pad token, no BOS). Each stage runs a step or two: the data
stage, SFT, the reward model (its normalisation kept as config.reward_offset: RMSNorm has no bias),
then PPO, DPO, GRPO (rloo.py) and online DPO from them; the paper's sanity checks hold on each (the
first minibatch's ratio is 1, the references score 0 on average, DPO starts at log 2)."""

import json
import math
import os

import pytest
import torch
from conftest import run_in_process, tiny_dataset_args
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from summarize_from_feedback_details import dpo, online_dpo
from summarize_from_feedback_details import ppo_left_padding as ppo
from summarize_from_feedback_details import reward, rloo, sft, tiny_models, tldr_dataset
from summarize_from_feedback_details.infra import loading
from summarize_from_feedback_details.infra.checkpoints import CHECKPOINT_EXIT_CODE
from summarize_from_feedback_details.infra.lora import with_lora

ARCHS = ["llama", "qwen3"]


def read_metrics(workdir: str, name: str) -> list:
    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module", params=ARCHS)
def pipeline(request, raw_dir, tmp_path_factory) -> dict:
    """tiny-s of the architecture (5 pretraining steps), its tokenized datasets, an SFT of 2 updates
    and a reward model of 2 updates: {"arch", "workdir", "base", "data", "sft", "reward_model"}."""
    arch = request.param
    root = str(tmp_path_factory.mktemp(f"arch_{arch}"))
    tiny_models.build(tiny_models.Args(corpus=os.path.join(raw_dir, "tldr_sft", "train.jsonl"), arch=arch,
                                       output_dir=os.path.join(root, "tiny"), sizes=["s"], pretrain_steps=5))
    paths = {"arch": arch, "workdir": root, "base": os.path.join(root, "tiny", f"{arch}-tiny-s"),
             "data": os.path.join(root, "tldr"), "sft": os.path.join(root, "sft"),
             "reward_model": os.path.join(root, "reward_model")}
    tldr_dataset.run(tiny_dataset_args(raw_dir, paths["base"], paths["data"]))
    run_in_process(sft.main, sft.Args(
        base_model=paths["base"], query_dataset=os.path.join(paths["data"], "sft"), total_episodes=16,
        local_micro_batch_size=8, gradient_accumulation_steps=1, lr=3e-3, run_eval=False, run_name="sft",
        output_dir=paths["sft"]), root)
    run_in_process(reward.main, reward.Args(
        base_model=paths["base"], sft_model_path=paths["sft"], label_dataset=os.path.join(paths["data"], "preference"),
        query_dataset=os.path.join(paths["data"], "sft"), total_episodes=16, local_micro_batch_size=8,
        gradient_accumulation_steps=1, lr=1e-3, local_eval_batch_size=64, run_eval=False, run_name="reward",
        output_dir=paths["reward_model"]), root)
    return paths


def test_data_sft_and_reward_model(pipeline):
    """The [PAD] a loader adds is one embedding row where the vocabulary has no spare one (Llama), none
    where it has (Qwen); the reward model's normalisation lives in its config; plain transformers loads
    both models; the SFT references score 0 on average through every stage's loader."""
    tokenizer = loading.load_tokenizer(pipeline["base"])
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id != tokenizer.eos_token_id
    policy = AutoModelForCausalLM.from_pretrained(pipeline["sft"])
    rows = {"llama": len(tokenizer), "qwen3": 64 * math.ceil(len(tokenizer) / 64)}[pipeline["arch"]]
    assert policy.get_input_embeddings().num_embeddings == rows and policy.config.tie_word_embeddings
    assert policy.config.num_key_value_heads == policy.config.num_attention_heads // 2
    assert any("q_norm" in key for key in policy.state_dict()) == (pipeline["arch"] == "qwen3")  # Qwen3's QK-norm
    # the released models' RoPE bases, not transformers' config default of 10,000
    assert policy.config.rope_parameters["rope_theta"] == {"llama": 500_000, "qwen3": 1_000_000}[pipeline["arch"]]
    with open(os.path.join(pipeline["reward_model"], "config.json")) as f:
        config = json.load(f)
    assert config["reward_offset"] != 0 and config["architectures"][0].endswith("ForSequenceClassification")
    AutoModelForSequenceClassification.from_pretrained(pipeline["reward_model"])
    references = load_from_disk(os.path.join(pipeline["data"], "sft"))["train"]
    rows = torch.cat([torch.tensor(references["query_token"]), torch.tensor(references["reference_response_token"])], 1)
    model = loading.load_reward_model(pipeline["reward_model"], tokenizer).eval()
    with torch.no_grad():
        scores = reward.get_reward(model, rows, tokenizer.pad_token_id)
    assert abs(scores.mean().item()) < 1e-4 and scores.std().item() > 1e-4
    if pipeline["arch"] == "llama":  # the BOS starts each query, once
        query = [t for t in references[0]["query_token"] if t != tokenizer.pad_token_id]
        assert query[0] == tokenizer.bos_token_id and query.count(tokenizer.bos_token_id) == 1


def online_args(stage, pipeline: dict, name: str, **overrides):
    return stage.Args(**{**dict(
        base_model=pipeline["sft"], sft_model_path=pipeline["sft"], reward_model_path=pipeline["reward_model"],
        query_dataset=os.path.join(pipeline["data"], "sft"), response_length=16, run_name=name, seed=3,
        output_dir=os.path.join(pipeline["workdir"], name), print_sample_output_freq=0, total_episodes=16,
        local_micro_batch_size=8, gradient_accumulation_steps=2, local_rollout_forward_batch_size=16), **overrides})


@pytest.mark.parametrize("method", ["ppo", "ppo_lora", "grpo", "online_dpo", "dpo"])
def test_each_method_runs_and_starts_where_the_paper_says(pipeline, method):
    workdir = pipeline["workdir"]
    name = f"{method}_{pipeline['arch']}"
    if method == "dpo":
        args = dpo.Args(base_model=pipeline["sft"], sft_model_path=pipeline["sft"],
                        label_dataset=os.path.join(pipeline["data"], "preference"),
                        query_dataset=os.path.join(pipeline["data"], "sft"), total_episodes=16, local_micro_batch_size=8,
                        gradient_accumulation_steps=2, run_eval=False, run_name=name,
                        output_dir=os.path.join(workdir, name))
        run_in_process(dpo.main, args, workdir)
        (first,) = [m for m in read_metrics(workdir, name) if "train/rm/loss" in m][:1]
        assert first["train/rm/loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference
    else:
        stage, overrides = {"ppo": (ppo, {}), "ppo_lora": (ppo, dict(use_peft=True, lr=3e-5)), "grpo": (rloo, dict(algorithm="grpo", rloo_k=4, local_rollout_forward_batch_size=4)),
                            "online_dpo": (online_dpo, dict(local_rollout_forward_batch_size=8))}[method]
        run_in_process(stage.main, online_args(stage, pipeline, name, **overrides), workdir)
        update = [m for m in read_metrics(workdir, name) if "objective/scores" in m][0]
        assert all(math.isfinite(v) for v in update.values() if isinstance(v, float))
        if method != "online_dpo":  # (online DPO has no ratio: its loss is DPO's)
            assert update["ppo/val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(workdir, name))
    tokenizer = loading.load_tokenizer(os.path.join(workdir, name))
    sample = model.generate(torch.tensor([tokenizer.encode("My boyfriend")]), max_new_tokens=4, do_sample=False)
    assert sample.shape[1] > 2


def test_micro_batch_split_gives_the_same_ppo_update_on_llama(pipeline):
    """PPO's loss is normalised over the minibatch, so micro-batch x accumulation = 1 x 4 and 4 x 1 give
    the same update on the Llama-style model too (eps 1 and lr 0.05, as tests/test_ppo.py does, so
    that a wrongly scaled loss would show; fp32 sums in another order)."""
    if pipeline["arch"] != "llama":
        pytest.skip("the Llama-style model stands for the RMSNorm architectures")
    params = {}
    for micro in (1, 4):
        name = f"split{micro}"
        run_in_process(ppo.main, online_args(ppo, pipeline, name, total_episodes=8, nminibatches=2,
                                             local_micro_batch_size=micro, gradient_accumulation_steps=4 // micro,
                                             local_rollout_forward_batch_size=8, lr=0.05, eps=1.0,
                                             run_eval=False), pipeline["workdir"])
        params[micro] = AutoModelForCausalLM.from_pretrained(os.path.join(pipeline["workdir"], name)).state_dict()
    base = AutoModelForCausalLM.from_pretrained(pipeline["sft"]).state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert (params[1][key] - base[key]).abs().max() > 1e-4  # the update moved the policy (about 3e-4)
    for name, value in params[1].items():
        assert torch.allclose(value, params[4][name], rtol=1e-4, atol=1e-6), name


def test_the_reward_offset_survives_the_lora_wrapping_of_a_critic(pipeline):
    """Under --use_peft peft keeps a trainable copy of the critic's `score` head: the offset is added
    once, by the copy and by the original (the disabled adapter), as without LoRA."""
    tokenizer = loading.load_tokenizer(pipeline["reward_model"])
    critic = loading.load_reward_model(pipeline["reward_model"], tokenizer).eval()
    ids = torch.tensor(load_from_disk(os.path.join(pipeline["data"], "sft"))["train"][:4]["query_reference_response_token"])
    with torch.no_grad():
        plain = ppo.get_values(critic, ids, tokenizer.pad_token_id)
        wrapped = with_lora(critic, ppo.Args(use_peft=True), head="score").eval()
        lora = ppo.get_values(wrapped, ids, tokenizer.pad_token_id)
        with wrapped.disable_adapter():
            disabled = ppo.get_values(wrapped, ids, tokenizer.pad_token_id)
        raw = AutoModelForSequenceClassification.from_pretrained(pipeline["reward_model"]).eval()
        without_offset = ppo.get_values(raw, ids, tokenizer.pad_token_id)
    assert torch.equal(plain, lora) and torch.equal(plain, disabled)
    with open(os.path.join(pipeline["reward_model"], "config.json")) as f:
        offset = json.load(f)["reward_offset"]
    assert torch.allclose(plain, without_offset + offset, atol=1e-5)


def test_resume_after_a_signal_mid_update_equals_the_uninterrupted_run_on_llama(pipeline, monkeypatch):
    """PPO on the Llama-style model, 3 updates of 8: SIGUSR1 in the middle of update 2 checkpoints it and
    exits with 75; --resume then gives the uninterrupted run's weights and metric lines (rates and
    timings aside), bit for bit, as on GPT-NeoX."""
    from conftest import signal_on_call

    if pipeline["arch"] != "llama":
        pytest.skip("the Llama-style model stands for the RMSNorm architectures")
    workdir = pipeline["workdir"]
    common = dict(total_episodes=24, nminibatches=2, local_micro_batch_size=2, gradient_accumulation_steps=2,
                  local_rollout_forward_batch_size=8, lr=1e-3, run_eval=False)
    run_in_process(ppo.main, online_args(ppo, pipeline, "whole", **common), workdir)
    with monkeypatch.context() as patch:
        signal_on_call(patch, ppo, "policy_loss", 16 + 8)  # 4 epochs x 2 minibatches x 2 micro-batches per update
        with pytest.raises(SystemExit) as stopped:
            run_in_process(ppo.main, online_args(ppo, pipeline, "stopped", **common), workdir)
    assert stopped.value.code == CHECKPOINT_EXIT_CODE
    run_in_process(ppo.main, online_args(ppo, pipeline, "stopped", resume=True, **common), workdir)

    def lines(name):
        return [{k: v for k, v in m.items() if not (k.endswith("/eps") or k.startswith(("time/", "throughput/")))}
                for m in read_metrics(workdir, name)]

    assert lines("stopped") == lines("whole") and len(lines("whole")) == 3
    whole, resumed = (AutoModelForCausalLM.from_pretrained(os.path.join(workdir, name)).state_dict()
                      for name in ("whole", "stopped"))
    assert all(torch.equal(whole[key], resumed[key]) for key in whole)
