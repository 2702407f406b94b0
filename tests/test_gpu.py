"""`make test-gpu`: sft.py, reward.py, ppo_left_padding.py and dpo.py on one GPU with bf16 and DeepSpeed
ZeRO-2 (the paper's deepspeed.yaml on one process), a few updates each, on a randomly initialised
model of Pythia-410m's shape (vocab 50304; no hub is reachable there either) and data tokenized to
the paper's lengths (query 512, response 53); then PPO with LoRA under the same engine and a LoRA
SFT over 4-bit NF4 base weights. Skipped without CUDA and not part of `make test`.

The same pipeline runs on the CPU at a tiny shape, on data tokenized to the tiny default's lengths
(query 160), in fp32 inside `make test` (`cpu-smoke`, with the bf16 thresholds), so this file cannot
rot between GPU runs."""

import functools
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

from conftest import accelerate_launcher, run_script, side_by_side, tiny_dataset_args
from summarize_from_feedback_details import ppo_left_padding, reward, rollout, tldr_dataset
from summarize_from_feedback_details.infra import loading

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


def run_rounds(rounds: list, at_once: bool) -> dict:
    """name -> the stdout of every launch, round after round. On the CPU each launch uses one thread, so
    a round's launches go side by side (they share no output); on the GPU one after another, so each
    one's seconds per update and peak memory are its own."""
    stdout = {}
    for calls in rounds:
        if at_once:
            stdout.update({name: future.result() for name, future in side_by_side(**calls).items()})
        else:
            stdout.update({name: call() for name, call in calls.items()})
    return stdout


@pytest.mark.parametrize("setting", [
    pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
    pytest.param("cpu-smoke", marks=pytest.mark.slow),
])
def test_stages_at_a_real_pythia_shape(setting, raw_dir, tokenizer_dir, tmp_path):
    base = random_pythia(SETTINGS[setting]["shape"], tokenizer_dir, str(tmp_path / "base"))
    data = str(tmp_path / "data")
    # the paper's lengths where they are the point (the GPU's memory and speed); on the CPU the tiny default's, which
    # run the same code (the test alone: 84 -> 63 CPU s)
    tldr_dataset.run(tldr_dataset.Args(base_model=base, sft_dataset=os.path.join(raw_dir, "tldr_sft"),
                                       preference_dataset=os.path.join(raw_dir, "comparisons"), output_dir=data)
                     if setting == "gpu" else tiny_dataset_args(raw_dir, base, data))
    sft_data, preference_data = os.path.join(data, "sft"), os.path.join(data, "preference")
    out = {"sft": str(tmp_path / "sft"), "reward": str(tmp_path / "rm"), "ppo_left_padding": str(tmp_path / "ppo"),
           "dpo": str(tmp_path / "dpo")}
    four_bit = torch.cuda.is_available() or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")

    def launch_later(name: str, *flags, run_name: str = None):
        return functools.partial(launch, name, setting, tmp_path, *flags, run_name=run_name)

    rounds = [{  # each round needs only the models of the rounds before it
        "sft": launch_later("sft", "--base_model", base, "--query_dataset", sft_data, "--output_dir", out["sft"],
                            "--total_episodes", "64", "--local_eval_batch_size", "32", *BATCH),
        # LoRA SFT over 4-bit NF4 base weights (bitsandbytes; without DeepSpeed, which cannot shard them)
        **({"sft_4bit": lambda: run_script(
            [sys.executable, os.path.join(REPO, "summarize_from_feedback_details", "sft.py"), "--run_name", "sft_4bit",
             "--base_model", base, "--query_dataset", sft_data, "--output_dir", str(tmp_path / "sft_4bit"),
             "--total_episodes", "32", "--local_micro_batch_size", "8", "--gradient_accumulation_steps", "2",
             "--use_peft", "--load_in_4bit", "--lr", "1e-4"],
            tmp_path, ACCELERATE_MIXED_PRECISION="bf16" if setting == "gpu" else "no",
            **SETTINGS[setting]["env"]).stdout} if four_bit else {}),
    }, {
        "reward": launch_later("reward", "--base_model", base, "--sft_model_path", out["sft"], "--label_dataset",
                               preference_data, "--query_dataset", sft_data, "--output_dir", out["reward"],
                               "--total_episodes", "64", "--local_eval_batch_size", "16", *BATCH),
        "dpo": launch_later("dpo", "--base_model", base, "--sft_model_path", out["sft"], "--label_dataset",
                            preference_data, "--query_dataset", sft_data, "--output_dir", out["dpo"],
                            "--total_episodes", "64", "--local_eval_batch_size", "16", *BATCH),
    }, {
        "ppo_left_padding": launch_later(
            "ppo_left_padding", "--base_model", base, "--sft_model_path", out["sft"], "--reward_model_path",
            out["reward"], "--query_dataset", sft_data, "--output_dir", out["ppo_left_padding"], "--total_episodes",
            "64", "--nminibatches", "2", "--local_rollout_forward_batch_size", "16", "--local_eval_batch_size", "16",
            *BATCH),
        # PPO with LoRA adapters under the same DeepSpeed engine (the reference = the adapter disabled);
        # one update, no final eval: the run above has both
        "ppo_lora": launch_later(
            "ppo_left_padding", "--base_model", base, "--sft_model_path", out["sft"], "--reward_model_path",
            out["reward"], "--query_dataset", sft_data, "--output_dir", str(tmp_path / "ppo_lora"),
            "--total_episodes", "32", "--nminibatches", "2", "--local_rollout_forward_batch_size", "16",
            "--local_eval_batch_size", "16", "--use_peft", "--lr", "3e-5", *[f for f in BATCH if f != "--run_eval"],
            run_name="ppo_lora"),
    }]
    stdout = run_rounds(rounds, at_once=setting == "cpu-smoke")
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
    # the decode path PPO took, and on a GPU its logged counters: no CUDA graph skipped, one batch
    # shape (decode_in_batches pads to it), the compiled step never given up
    path = "torch.compile with CUDA graphs" if setting == "gpu" else "eager (CUDA graphs need a GPU)"
    assert f"decode: {path}" in " ".join(stdout["ppo_left_padding"].split())
    for m in ppo if setting == "gpu" else ():
        assert (m["decode/cudagraph_skips"], m["decode/given_up"], m["decode/shapes"]) == (0, 0, 1)
    device = "cuda" if setting == "gpu" else "cpu"
    # LoRA under the bf16 engine: the saved model is the adapter merged into the full-precision base
    from peft import PeftModel
    rows = torch.randint(2, 1000, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        base_fp32 = AutoModelForCausalLM.from_pretrained(out["sft"], dtype=torch.float32).to(device).eval()
        wrapped = PeftModel.from_pretrained(base_fp32, str(tmp_path / "ppo_lora" / "adapter")).eval()(rows).logits
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ppo_lora"), dtype=torch.float32).to(device)
        assert (merged.eval()(rows).logits - wrapped).abs().max() < 1e-3
    drift = bf16_drift(out["ppo_left_padding"], sft_data, device)
    assert drift["mean"] < 0.05, drift

    # the saved models reload with plain transformers and generate
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
    print(f"\n[{setting}] {sum(p.numel() for p in rm.parameters()):,} parameters per model; " + "; ".join(report)
          + f"; bf16 vs fp32 logprobs of the trained PPO policy: |delta| max {drift['max']:.3g}, mean "
          f"{drift['mean']:.3g}", file=sys.stderr)


@torch.no_grad()
def bf16_drift(model_dir: str, sft_data: str, device: str) -> dict:
    """The trained policy's log-probabilities of its own samples (8 validation queries, T 0.7) scored in
    fp32 and in bf16: the max and mean |delta| over the response tokens."""
    from datasets import load_from_disk
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    queries = torch.tensor(load_from_disk(sft_data)["validation"][:8]["query_token"], device=device)
    vocab_end = policy.config.vocab_size  # (the tiny default's rows: its tokenizer's len, [PAD] included)
    ((responses, _),) = rollout.decode(policy, [rollout.SamplingGroup(queries, 0.7, 0)], 1, vocab_end, 53)
    query_responses = torch.cat([queries, responses], 1)

    def logprobs(model):
        logits = ppo_left_padding.response_logits(model, query_responses, 1, 53)
        return ppo_left_padding.gather_logprobs(ppo_left_padding.scaled_logits(logits, 0.7, 1, vocab_end), responses)

    fp32 = logprobs(policy)
    delta = (logprobs(policy.to(torch.bfloat16)) - fp32).abs()
    return {"max": delta.max().item(), "mean": delta.mean().item()}


PYTHIA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192,
                 vocab_size=50304)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("variant", ["zero2", "offload", "4bit", "two_gpus"])
def test_ppo_at_the_pythia_1b_shape(variant, raw_dir, tokenizer_dir, tmp_path):
    """One PPO update at Pythia-1B's shape with the sbatch files' 1b knobs (micro-batch 16, rollout
    chunk 64, eval batch 8; batch 64, one GPU's share of the paper's 512 on 8): its peak memory bounds
    the 8-GPU run's. `offload`: the frozen reference and reward model as ZeRO-3 engines on the CPU;
    `4bit`: LoRA over NF4 base weights, without DeepSpeed; `two_gpus`: the same batch over two
    processes (NCCL) against one, to bf16 noise (skipped below two GPUs)."""
    if variant == "two_gpus" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    base = random_pythia(PYTHIA_1B, tokenizer_dir, str(tmp_path / "base"))
    tokenizer = loading.load_tokenizer(base)
    reward.reward_model_to_train(base, tokenizer, head_seed=1).save_pretrained(str(tmp_path / "rm"))
    tokenizer.save_pretrained(str(tmp_path / "rm"))
    data = str(tmp_path / "data")
    tldr_dataset.run(tldr_dataset.Args(base_model=base, sft_dataset=os.path.join(raw_dir, "tldr_sft"),
                                       preference_dataset=os.path.join(raw_dir, "comparisons"), output_dir=data))
    flags = ["--base_model", base, "--sft_model_path", base, "--reward_model_path", str(tmp_path / "rm"),
             "--query_dataset", os.path.join(data, "sft"), "--total_episodes", "64", "--local_micro_batch_size", "16",
             "--local_rollout_forward_batch_size", "64", "--local_eval_batch_size", "8", "--print_sample_output_freq",
             "0"]

    def ppo(name: str, processes: int, *more):
        if variant == "4bit":
            command = [sys.executable, os.path.join(REPO, "summarize_from_feedback_details", "ppo_left_padding.py")]
            env = dict(ACCELERATE_MIXED_PRECISION="bf16")
        else:
            command, env = accelerate_launcher(processes, SETTINGS["gpu"]["config"]) + [
                os.path.join(REPO, "summarize_from_feedback_details", "ppo_left_padding.py"), "--deepspeed"], {}
        start = time.time()
        stdout = run_script(command + flags + ["--run_name", name, "--output_dir", str(tmp_path / name), *more],
                            tmp_path, **env).stdout
        (line,) = [m for m in read_metrics(tmp_path, name) if "ppo/loss/policy_avg" in m]
        peak = re.search(r"peak GPU memory of rank 0: ([\d.]+) GiB", stdout)
        print(f"\n[gpu] PPO at Pythia-1B's shape ({variant}, {name}): {time.time() - start:.0f} s with the set-up, "
              f"{line['time/update']:.1f} s for the update, peak GPU memory of rank 0 {peak.group(1)} GiB",
              file=sys.stderr)
        assert all(math.isfinite(v) for v in line.values() if isinstance(v, float))
        assert line["ppo/val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-2)
        return line

    if variant == "zero2":
        ppo("ppo_1b", 1, "--gradient_accumulation_steps", "4")
    elif variant == "offload":
        ppo("ppo_1b_offload", 1, "--gradient_accumulation_steps", "4", "--offload")
    elif variant == "4bit":
        ppo("ppo_1b_4bit", 1, "--gradient_accumulation_steps", "4", "--use_peft", "--load_in_4bit", "--lr", "3e-5")
    else:
        # (rollout chunks of 32 on both: a chunk's position in the global batch seeds its samples)
        one = ppo("ppo_1b_one", 1, "--gradient_accumulation_steps", "4", "--local_rollout_forward_batch_size", "32")
        two = ppo("ppo_1b_two", 2, "--gradient_accumulation_steps", "2", "--local_rollout_forward_batch_size", "32",
                  "--local_eval_batch_size", "4")
        for key in ("objective/kl", "objective/scores", "ppo/loss/policy_avg", "ppo/loss/value_avg"):
            assert two[key] == pytest.approx(one[key], rel=2e-2, abs=1e-3), key


@pytest.mark.gpu
def test_torch_sees_the_gpus_nvidia_smi_lists():
    """Not skipped without CUDA: where nvidia-smi lists GPUs that torch cannot see (a CPU build, or a
    CUDA build newer than the driver), `make test-gpu` fails and says why instead of skipping."""
    from summarize_from_feedback_details.infra import preflight
    assert preflight.cuda_problem() is None, preflight.cuda_problem()


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
    rows = model.config.vocab_size  # (every row a token)

    def same(a, b):
        return all(torch.equal(ta, tb) and (la - lb).abs().max() < 1e-3 for (ta, la), (tb, lb) in zip(a, b))

    counters.clear()
    seconds = []
    for _ in range(3):
        start = time.time()
        compiled = rollout.decode(model, groups, 1, rows, 53, compiled_step)
        torch.cuda.synchronize()
        seconds.append(time.time() - start)
        assert same(rollout.decode(model, groups, 1, rows, 53), compiled)
    assert counters["inductor"]["cudagraph_skips"] == 0 and counters["stats"]["unique_graphs"] == 1
    assert seconds[2] < seconds[0] / 2
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.01)
    assert same(rollout.decode(model, groups, 1, rows, 53), rollout.decode(model, groups, 1, rows, 53, compiled_step))
    print(f"\n[gpu] decode of 8 x (64 + 53) tokens, compiled step: {seconds[0]:.1f} s with the compile, then "
          f"{seconds[1] * 1000:.0f} / {seconds[2] * 1000:.0f} ms", file=sys.stderr)


# Llama 3.2 1B: hidden 2048, 16 layers, 32 query and 8 key/value heads, SwiGLU 8192, tied embeddings
LLAMA_3_2_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)


@torch.no_grad()
def packed_and_padded_errors(shape: dict, device: str) -> dict:
    """A random Llama-style policy and critic of `shape` on sdpa, 16 rows of 512 + 53 tokens with left
    and right padding, scored padded and packed (real tokens only, one row), in fp32 and in bf16: for
    the log-probabilities of the real response tokens, the critic's values at real tokens and the
    rewards, the max and mean |difference| from the padded fp32 forward. Also whether the packed
    forward left every padding position's logits at 0."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from summarize_from_feedback_details import packing, sft
    pad = 1
    torch.manual_seed(0)
    config = LlamaConfig(bos_token_id=0, eos_token_id=0, pad_token_id=pad, num_labels=1, **shape)
    policy = LlamaForCausalLM(config).to(device).eval()
    critic = LlamaForSequenceClassification(config).to(device).eval()
    assert policy.config._attn_implementation == "sdpa"
    ids = torch.randint(2, shape["vocab_size"], (16, 565), generator=torch.Generator().manual_seed(1))
    for row, (left, right) in enumerate(zip(range(0, 400, 25), range(53, 0, -3))):
        ids[row, :left], ids[row, ids.shape[1] - right:] = pad, pad
    ids, real = ids.to(device), (ids != pad).to(device)
    kept = real[:, -54:]
    scores, padding_untouched = {}, True
    for dtype in (torch.float32, torch.bfloat16):
        policy.to(dtype), critic.to(dtype)
        for packed in (False, True):
            packing.enable(packed, policy, critic)
            logits = sft.forward(policy, ids, pad, 54)
            padding_untouched &= not packed or bool((logits[~kept] == 0).all())
            scores[dtype, packed] = [torch.log_softmax(logits.float(), -1)[kept],
                                     ppo_left_padding.get_values(critic, ids, pad).float()[real],
                                     reward.get_reward(critic, ids, pad).float()]
    reference = scores[torch.float32, False]
    errors = {(dtype, packed, name): ((a - b).abs().max().item(), (a - b).abs().mean().item())
              for (dtype, packed), score in scores.items()
              for name, a, b in zip(("logprob", "value", "reward"), score, reference)}
    return {"errors": errors, "padding_untouched": padding_untouched}


def assert_packing_adds_no_error(result: dict, fp32_tolerance: float):
    """In fp32 the packed forwards equal the padded ones to float noise; in bf16 each path rounds
    its own way, so packed is held to padded's own distance from fp32 (not to padded bf16 itself:
    on the GPU below, packed and padded bf16 differ by up to 0.14 in log-probability while each is
    0.45 from fp32)."""
    errors = result["errors"]
    assert result["padding_untouched"]
    for name in ("logprob", "value", "reward"):
        assert errors[torch.float32, True, name][0] < fp32_tolerance, (name, errors[torch.float32, True, name])
        packed_bf16, padded_bf16 = errors[torch.bfloat16, True, name], errors[torch.bfloat16, False, name]
        assert packed_bf16[0] <= 1.25 * padded_bf16[0], (name, packed_bf16, padded_bf16)
        if name != "reward":  # 16 rewards are too few for a mean to compare; thousands of tokens are not
            assert packed_bf16[1] <= 1.1 * padded_bf16[1], (name, packed_bf16, padded_bf16)


def test_packing_error_check_at_a_tiny_llama_shape():
    """The GPU test's plumbing on the CPU (a two-layer Llama of the same layout), so it cannot rot."""
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024, tie_word_embeddings=True)
    assert_packing_adds_no_error(packed_and_padded_errors(shape, "cpu"), fp32_tolerance=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_packed_forwards_match_padded_at_the_llama_3_2_1b_shape():
    """The packed forwards against the padded ones on a random model of Llama 3.2 1B's shape on sdpa
    (what the stages run on a GPU). On one H200 (2026-11-28): fp32 packed vs padded max |difference|
    4.6e-5 (log-prob), 2.8e-5 (value), 1.8e-5 (reward); in bf16 both paths are 0.45 (log-prob max)
    from fp32, 0.041 on average."""
    result = packed_and_padded_errors(LLAMA_3_2_1B, "cuda")
    print("\n[gpu] Llama 3.2 1B shape on sdpa, max / mean |difference| from padded fp32: " + "; ".join(
        f"{dtype_name} {'packed' if packed else 'padded'} {name} {e[0]:.3g} / {e[1]:.3g}"
        for (dtype, packed, name), e in result["errors"].items()
        for dtype_name in [str(dtype).removeprefix("torch.")]), file=sys.stderr)
    assert_packing_adds_no_error(result, fp32_tolerance=1e-3)
