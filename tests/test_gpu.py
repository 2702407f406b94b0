"""`make test-gpu`: sft.py, reward.py, ppo_left_padding.py and dpo.py on one GPU with bf16 and DeepSpeed
ZeRO-2 (the paper's deepspeed.yaml on one process), a few updates each, on a randomly initialised
model of Pythia-410m's shape (vocab 50304; no hub is reachable there either) and data tokenized to
the paper's lengths (query 512, response 53); then PPO with LoRA under the same engine and a LoRA
SFT over 4-bit NF4 base weights. Skipped without CUDA and not part of `make test`.

The same pipeline runs on the CPU at a tiny shape in fp32 inside `make test` (`cpu-smoke`, with
the bf16 thresholds), so this file cannot rot between GPU runs."""

import json
import math
import os
import re
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GPTNeoXConfig
from transformers import GPTNeoXForCausalLM

from conftest import accelerate_launcher, run_script
from summarize_from_feedback_details import tldr_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "tests", "accelerate_configs")

SETTINGS = {
    # Pythia-410m: hidden 1024, 24 layers, 16 heads (the GPT-NeoX config of EleutherAI/pythia-410m-deduped)
    "gpu": dict(shape=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                           vocab_size=50304),
                config=os.path.join(CONFIGS, "deepspeed_zero2_gpu_bf16.yaml"), env={}),
    # the tiny tokenizer's vocabulary; one thread (torch's pool makes hundreds of tiny ops far slower)
    "cpu-smoke": dict(shape=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                                 vocab_size=1024),
                      config=os.path.join(CONFIGS, "deepspeed_zero2_cpu.yaml"), env=dict(OMP_NUM_THREADS="1")),
}
# a few updates per stage: batch 16 = micro-batch 8 x accumulation 2 (PPO: 2 minibatches of 16)
BATCH = ["--local_micro_batch_size", "8", "--gradient_accumulation_steps", "2", "--deepspeed", "--run_eval"]


def random_pythia(shape: dict, tokenizer_dir: str, folder: str) -> str:
    """A randomly initialised GPT-NeoX with Pythia's layout, plus the tiny tokenizer (its ids are a
    subset of Pythia's 50304 rows; EOS 0, [PAD] 1)."""
    torch.manual_seed(0)
    config = GPTNeoXConfig(rotary_pct=0.25, max_position_embeddings=2048, use_parallel_residual=True,
                           bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, **shape)
    GPTNeoXForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def launch(stage: str, setting: str, workdir, *flags, run_name: str = None) -> str:
    script = os.path.join(REPO, "summarize_from_feedback_details", f"{stage}.py")
    command = accelerate_launcher(1, SETTINGS[setting]["config"]) + [script, "--run_name", run_name or stage, *flags]
    start = time.time()
    stdout = run_script(command, workdir, **SETTINGS[setting]["env"]).stdout
    print(f"[{setting}] {stage}: {time.time() - start:.0f} s in all", file=sys.stderr)
    return stdout


def read_metrics(workdir, name) -> list:
    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def seconds_per_update(metrics: list, eps_key: str, batch_size: int) -> float:
    """From the last logged episodes-per-second (episodes since the start / wall time)."""
    return batch_size / [m[eps_key] for m in metrics if eps_key in m][-1]


@pytest.mark.parametrize("setting", [
    pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
    pytest.param("cpu-smoke", marks=pytest.mark.slow),
])
def test_stages_at_a_real_pythia_shape(setting, raw_dir, tokenizer_dir, tmp_path):
    base = random_pythia(SETTINGS[setting]["shape"], tokenizer_dir, str(tmp_path / "base"))
    data = str(tmp_path / "data")
    tldr_dataset.run(tldr_dataset.Args(base_model=base, sft_dataset=os.path.join(raw_dir, "tldr_sft"),
                                       preference_dataset=os.path.join(raw_dir, "comparisons"), output_dir=data))
    sft_data, preference_data = os.path.join(data, "sft"), os.path.join(data, "preference")
    out = {"sft": str(tmp_path / "sft"), "reward": str(tmp_path / "rm"), "ppo_left_padding": str(tmp_path / "ppo"),
           "dpo": str(tmp_path / "dpo")}
    stdout = {
        "sft": launch("sft", setting, tmp_path, "--base_model", base, "--query_dataset", sft_data, "--output_dir",
                      out["sft"], "--total_episodes", "64", "--local_eval_batch_size", "32", *BATCH),
        "reward": launch("reward", setting, tmp_path, "--base_model", base, "--sft_model_path", out["sft"],
                         "--label_dataset", preference_data, "--query_dataset", sft_data, "--output_dir",
                         out["reward"], "--total_episodes", "64", "--local_eval_batch_size", "16", *BATCH),
        "ppo_left_padding": launch(
            "ppo_left_padding", setting, tmp_path, "--base_model", base, "--sft_model_path", out["sft"],
            "--reward_model_path", out["reward"], "--query_dataset", sft_data, "--output_dir", out["ppo_left_padding"],
            "--total_episodes", "64", "--nminibatches", "2", "--local_rollout_forward_batch_size", "16",
            "--local_eval_batch_size", "16", *BATCH),
        "dpo": launch("dpo", setting, tmp_path, "--base_model", base, "--sft_model_path", out["sft"],
                      "--label_dataset", preference_data, "--query_dataset", sft_data, "--output_dir", out["dpo"],
                      "--total_episodes", "64", "--local_eval_batch_size", "16", *BATCH),
    }
    # LoRA: PPO with adapters under the same DeepSpeed engine (the reference = the adapter disabled),
    # and SFT over 4-bit NF4 base weights (bitsandbytes; without DeepSpeed, which cannot shard them)
    stdout["ppo_lora"] = launch(
        "ppo_left_padding", setting, tmp_path, "--base_model", base, "--sft_model_path", out["sft"],
        "--reward_model_path", out["reward"], "--query_dataset", sft_data, "--output_dir", str(tmp_path / "ppo_lora"),
        "--total_episodes", "32", "--nminibatches", "2", "--local_rollout_forward_batch_size", "16",
        "--local_eval_batch_size", "16", "--use_peft", "--lr", "3e-5", *[f for f in BATCH if f != "--run_eval"],
        run_name="ppo_lora")  # (one update, no final eval: the run above has both)
    four_bit = torch.cuda.is_available() or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if four_bit:
        stdout["sft_4bit"] = run_script(
            [sys.executable, os.path.join(REPO, "summarize_from_feedback_details", "sft.py"), "--run_name", "sft_4bit",
             "--base_model", base, "--query_dataset", sft_data, "--output_dir", str(tmp_path / "sft_4bit"),
             "--total_episodes", "32", "--local_micro_batch_size", "8", "--gradient_accumulation_steps", "2",
             "--use_peft", "--load_in_4bit", "--lr", "1e-4"],
            tmp_path, ACCELERATE_MIXED_PRECISION="bf16" if setting == "gpu" else "no",
            **SETTINGS[setting]["env"]).stdout
    metrics = {stage: read_metrics(tmp_path, stage) for stage in stdout}
    for stage, lines in metrics.items():
        assert all(math.isfinite(v) for m in lines for v in m.values() if isinstance(v, float)), stage
    assert len([m for m in metrics["sft"] if "train/sft/loss" in m]) == 4
    assert len([m for m in metrics["reward"] if "train/rm/loss" in m]) == 4
    ppo = [m for m in metrics["ppo_left_padding"] if "ppo/loss/policy_avg" in m]
    assert len(ppo) == 2
    for m in ppo:  # generation logprobs == training logprobs in bf16: the N+ sanity check
        assert m["ppo/val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-2)
        assert m["ppo/policy/approxkl_first_minibatch"] < 1e-3
    for m in [m for m in metrics["ppo_lora"] if "ppo/loss/policy_avg" in m]:
        assert m["ppo/val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-2)
        assert m["ppo/policy/approxkl_first_minibatch"] < 1e-3
    assert "reference policy: the policy, its LoRA adapter disabled" in " ".join(stdout["ppo_lora"].split())
    if four_bit:
        assert len([m for m in metrics["sft_4bit"] if "train/sft/loss" in m]) == 2
    dpo = [m for m in metrics["dpo"] if "train/rm/loss" in m]
    # before its first step the policy is the reference (bf16 policy vs bf16 reference engine)
    assert len(dpo) == 4 and dpo[0]["train/rm/loss"] == pytest.approx(math.log(2), abs=1e-2)
    normalization_error = [m for m in metrics["reward"] if "eval/rm/normalization_max_error" in m][0]
    assert normalization_error["eval/rm/normalization_max_error"] < 1e-2

    # the saved models reload with plain transformers and generate
    device = "cuda" if setting == "gpu" else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(out["ppo_left_padding"])
    query = torch.tensor([tokenizer.encode("SUBREDDIT: r/relationships\n\nTITLE: help\n\nPOST: hi\n\nTL;DR:")],
                         device=device)
    out.update({"ppo_lora": str(tmp_path / "ppo_lora"), "sft_4bit": str(tmp_path / "sft_4bit")})
    for stage in ("sft", "ppo_left_padding", "dpo", "ppo_lora") + (("sft_4bit",) if four_bit else ()):
        model = AutoModelForCausalLM.from_pretrained(out[stage]).to(device)
        assert model.generate(query, max_new_tokens=8, do_sample=False).shape[1] > query.shape[1]
    rm = AutoModelForSequenceClassification.from_pretrained(out["reward"]).to(device)
    assert torch.isfinite(rm(query).logits).all()

    report = []
    for stage, eps_key in (("sft", "train/sft/eps"), ("reward", "train/rm/eps"), ("ppo_left_padding", "ppo/eps"),
                           ("dpo", "train/rm/eps")):
        peak = re.search(r"peak GPU memory of rank 0: ([\d.]+) GiB", stdout[stage])
        assert (peak is not None) == (setting == "gpu"), stage
        report.append(f"{stage}: {seconds_per_update(metrics[stage], eps_key, 16 if stage != 'ppo_left_padding' else 32):.2f} "
                      f"s/update, peak GPU memory {peak.group(1) + ' GiB' if peak else 'n/a (CPU)'}")
    print(f"\n[{setting}] {sum(p.numel() for p in rm.parameters()):,} parameters per model; " + "; ".join(report),
          file=sys.stderr)


@pytest.mark.gpu
def test_torch_sees_the_gpus_nvidia_smi_lists():
    """Not skipped without CUDA: where nvidia-smi lists GPUs that torch cannot see (a CPU build, or a
    CUDA build newer than the driver), `make test-gpu` fails and says why instead of skipping."""
    from summarize_from_feedback_details import run_infra
    assert run_infra.cuda_problem() is None, run_infra.cuda_problem()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_graph_decode_step_samples_what_eager_decode_samples(tokenizer_dir, tmp_path):
    """ppo_left_padding's compiled decode step as the stage builds it on a GPU (torch.compile with
    CUDA graphs) at Pythia-410m's shape, in fp32 so that kernel rounding cannot flip a sample: no
    graph skipped for CUDA graphs, one graph for all steps and decodes, the same tokens as the eager
    decode before and after an in-place weight update (what the optimizer does)."""
    from torch._dynamo.utils import counters
    from summarize_from_feedback_details import rollout
    model = AutoModelForCausalLM.from_pretrained(random_pythia(SETTINGS["gpu"]["shape"], tokenizer_dir,
                                                               str(tmp_path / "base"))).cuda().eval()
    generator = torch.Generator().manual_seed(0)
    queries = torch.randint(2, 1000, (8, 64), generator=generator).cuda()
    queries[:3, :20] = 1  # [PAD]: left padding
    groups = [rollout.SamplingGroup(queries[:4], 0.7, 1), rollout.SamplingGroup(queries[4:], 0.7, 2)]
    compiled_step = rollout.CompiledStep(model, mode="reduce-overhead")

    def same(a, b):
        return all(torch.equal(ta, tb) and (la - lb).abs().max() < 1e-3 for (ta, la), (tb, lb) in zip(a, b))

    counters.clear()
    seconds = []
    for _ in range(3):
        start = time.time()
        compiled = rollout.decode(model, groups, 1, 53, compiled_step)
        torch.cuda.synchronize()
        seconds.append(time.time() - start)
        assert same(rollout.decode(model, groups, 1, 53), compiled)
    assert counters["inductor"]["cudagraph_skips"] == 0 and counters["stats"]["unique_graphs"] == 1
    assert seconds[2] < seconds[0] / 2
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.01)
    assert same(rollout.decode(model, groups, 1, 53), rollout.decode(model, groups, 1, 53, compiled_step))
    print(f"\n[gpu] decode of 8 x (64 + 53) tokens, compiled step: {seconds[0]:.1f} s with the compile, then "
          f"{seconds[1] * 1000:.0f} / {seconds[2] * 1000:.0f} ms", file=sys.stderr)
