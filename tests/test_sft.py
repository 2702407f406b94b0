import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaForCausalLM

from conftest import (accelerate_launcher, as_flags, assert_throughput, launched, run_in_process, run_script,
                      run_until_signalled, signal_on_call, tiny_llama_config, without_rates)
from summarize_from_feedback_details import evaluation, packing, rollout, sft
from summarize_from_feedback_details.infra import checkpoints, launch, lora, saving, tracking

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "summarize_from_feedback_details", "sft.py")
DS_CONFIG = os.path.join(REPO, "tests", "accelerate_configs", "deepspeed_zero2_cpu.yaml")
DS_ZERO3_CONFIG = os.path.join(REPO, "tests", "accelerate_configs", "deepspeed_zero3_cpu.yaml")
# the paper's GPU setting (ZeRO-2, bf16) on CPU processes
DS_BF16_CONFIG = os.path.join(REPO, "tests", "accelerate_configs", "deepspeed_zero2_cpu_bf16.yaml")


# ---------------------------------------------------------------------------------------------
# pure helpers
# ---------------------------------------------------------------------------------------------


def test_sequence_losses_known_answer():
    pad = 1
    logits = torch.zeros(2, 4, 3)
    logits[0, 0, 2] = 10.0  # predicts label 2 at position 1 almost surely
    labels = torch.tensor([[0, 2, 0, 1], [0, 0, 1, 1]])  # pads are ignored
    sums, counts = sft.sequence_losses(logits, labels, pad)
    log3 = torch.log(torch.tensor(3.0))
    expected0 = -torch.log_softmax(logits[0, 0], -1)[2] + log3  # targets 2 (confident) and 0 (uniform)
    assert counts.tolist() == [2, 1]
    assert torch.allclose(sums, torch.stack([expected0, log3]), atol=1e-6)
    seq = sft.normalized_loss(sums, counts, "sequence", 2.0)
    tok = sft.normalized_loss(sums, counts, "token", 3.0)
    assert torch.allclose(seq, (sums[0] / 2 + sums[1]) / 2)
    assert torch.allclose(tok, sums.sum() / 3)


def test_loss_normalisation_is_additive_over_micro_batches():
    """Summing micro-batch contributions gives the same objective for any split of the batch."""
    torch.manual_seed(0)
    sums, counts = torch.rand(8) * 10, torch.randint(1, 20, (8,))
    for normalization, normalizer in (("sequence", 8.0), ("token", counts.sum().item())):
        whole = sft.normalized_loss(sums, counts, normalization, normalizer)
        for micro in (1, 2, 4):
            parts = sum(sft.normalized_loss(sums[i:i + micro], counts[i:i + micro], normalization, normalizer)
                        for i in range(0, 8, micro))
            assert torch.allclose(parts, whole, atol=1e-6)


def test_clipping_norm_unset_or_not_positive_means_off():
    assert [launch.clipping_norm(x) for x in (None, 0.0, -1.0, 0.5, 1e9)] == [None, None, None, 0.5, 1e9]
    assert sft.Args().max_grad_norm is None  # the paper's runs did not clip (DESIGN section 4)


@pytest.mark.parametrize("packed", [False, True])
def test_forward_builds_no_kv_cache(packed):
    model = tiny_lm("gpt_neox")
    packing.enable(packed, model)
    ids = torch.tensor([[1, 1, 5, 6, 7]])
    assert model.config.use_cache  # left to the model, it would return one
    caches = []
    model.register_forward_hook(lambda module, args, output: caches.append(output.past_key_values))
    with torch.no_grad():
        sft.forward(model, ids, 1)
    assert caches == [None]


def test_derive_batch_sizes():
    args = sft.Args(local_micro_batch_size=2, gradient_accumulation_steps=4)
    sft.derive_batch_sizes(args, world_size=2, dataset_len=1000)
    assert (args.local_batch_size, args.batch_size, args.total_episodes, args.num_updates) == (8, 16, 1000, 62)
    args = sft.Args(local_micro_batch_size=2, batch_size=32)
    sft.derive_batch_sizes(args, world_size=4, dataset_len=64)
    assert args.gradient_accumulation_steps == 4 and args.num_updates == 2
    with pytest.raises(ValueError, match="not divisible"):
        sft.derive_batch_sizes(sft.Args(local_micro_batch_size=3, batch_size=32), world_size=2, dataset_len=64)
    with pytest.raises(ValueError, match="no update possible"):
        sft.derive_batch_sizes(sft.Args(total_episodes=8, local_micro_batch_size=4, gradient_accumulation_steps=4),
                               world_size=1, dataset_len=64)
    with pytest.raises(ValueError, match="local_micro_batch_size must be >= 1"):
        sft.derive_batch_sizes(sft.Args(local_micro_batch_size=0), world_size=1, dataset_len=64)


def test_epoch_permutations():
    order = sft.epoch_permutations(10, 2, seed=3)
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:]) == list(range(10))
    assert order[:10] != order[10:]
    assert order == sft.epoch_permutations(10, 2, seed=3) and order != sft.epoch_permutations(10, 2, seed=4)


def tiny_lm(kind: str, vocab: int = 40):
    torch.manual_seed(0)
    if kind == "llama":  # RMSNorm, SwiGLU, grouped-query attention, tied embeddings
        return LlamaForCausalLM(tiny_llama_config(vocab)).eval()
    if kind == "gpt2":  # absolute position embeddings
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                          bos_token_id=0, eos_token_id=0)).eval()
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                            intermediate_size=64, bos_token_id=0, eos_token_id=0)).eval()


@pytest.mark.parametrize("kind", ["gpt_neox", "gpt2", "llama"])
def test_forward_and_sampling_ignore_left_padding(kind):
    pad = 1
    model = tiny_lm(kind)
    text = torch.tensor([[5, 6, 7, 8, 9]])
    padded = torch.tensor([[pad, pad, pad, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        a = sft.forward(model, text, pad)[:, -1]
        b = sft.forward(model, padded, pad)[:, -1]
    assert torch.allclose(a, b, atol=1e-5)
    # the evaluation's sampler, the rollout engine (evaluation.generation_rows)
    ((ra, _),) = rollout.decode(model, [rollout.SamplingGroup(text, 0.01, 1)], pad, 40, 6)
    ((rb, _),) = rollout.decode(model, [rollout.SamplingGroup(padded, 0.01, 1)], pad, 40, 6)
    assert ra.shape == (1, 6) and torch.equal(ra, rb)


def test_pad_is_never_sampled_and_length_is_exact():
    """At T=1 a random 40-token model would sample [PAD] ~10 times in 400 draws; it never does, and
    EOS (id 0) does not stop generation."""
    pad, eos = 1, 0
    model = tiny_lm("gpt_neox")
    queries = torch.tensor([[pad, 5, 6], [7, 8, 9]])
    ((responses, _),) = rollout.decode(model, [rollout.SamplingGroup(queries, 1.0, 0)], pad, 40, 200)
    assert responses.shape == (2, 200)
    assert (responses != pad).all()
    first_eos = evaluation.first_true_indices(responses == eos)
    assert (first_eos < 150).all()  # EOS was sampled early, and generation went on to 200 tokens


# ---------------------------------------------------------------------------------------------
# runs of the script
# ---------------------------------------------------------------------------------------------


def sft_command(tiny_datasets, tokenizer_dir, tmp_path, name, *flags, launcher=()):
    data_dir, _ = tiny_datasets
    cmd = [*launcher] if launcher else [sys.executable]
    return cmd + [SCRIPT, "--base_model", tokenizer_dir, "--query_dataset", os.path.join(data_dir, "sft"),
                  "--response_length", "32", "--lr", "3e-3", "--seed", "3", "--run_name", name,
                  "--output_dir", str(tmp_path / name), *flags]


def run_sft(tiny_datasets, tokenizer_dir, tmp_path, name, *flags, launcher=()):
    result = run_script(sft_command(tiny_datasets, tokenizer_dir, tmp_path, name, *flags, launcher=launcher), tmp_path)
    with open(tmp_path / "runs" / name / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    return result, metrics, load_file(str(tmp_path / name / "model.safetensors"))


def assert_same_params(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=rtol, atol=atol), (key, (a[key] - b[key]).abs().max())


def losses(metrics):
    return [m["train/sft/loss"] for m in metrics if "train/sft/loss" in m]


def sft_in_process(tiny_datasets, tokenizer_dir, workdir, name, **overrides):
    """sft.main in this process: (metrics, saved weights)."""
    args = sft.Args(**{**dict(base_model=tokenizer_dir, query_dataset=os.path.join(tiny_datasets[0], "sft"),
                              response_length=32, lr=3e-3, seed=3, run_name=name,
                              output_dir=os.path.join(workdir, name)), **overrides})
    run_in_process(sft.main, args, workdir)
    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    return metrics, load_file(os.path.join(workdir, name, "model.safetensors"))


@pytest.mark.parametrize("normalization", ["sequence", "token"])
def test_micro_batch_split_gives_the_same_update(tiny_datasets, tokenizer_dir, tmp_path, normalization):
    """A fixed local batch of 4: micro-batch 1 x accumulation 4 == micro-batch 4 x accumulation 1."""
    common = dict(total_episodes=4, loss_normalization=normalization)
    m1, p1 = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "micro1", local_micro_batch_size=1,
                            gradient_accumulation_steps=4, **common)
    m4, p4 = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "micro4", local_micro_batch_size=4,
                            gradient_accumulation_steps=1, **common)
    assert losses(m1) == pytest.approx(losses(m4), rel=1e-6)
    assert_same_params(p1, p4)
    # and the update really moved the weights
    base = load_file(os.path.join(tokenizer_dir, "model.safetensors"))
    assert any(not torch.equal(p1[k], base[k]) for k in p1)


def test_gradient_checkpointing_changes_nothing(tiny_datasets, tokenizer_dir, tmp_path, attention_calls):
    """2 updates of 2 micro-batches: the same losses and weights, bit for bit; the backward really
    recomputed each layer of each training forward (2 layers x 4 micro-batches extra attention calls)."""
    common = dict(total_episodes=16, local_micro_batch_size=4, gradient_accumulation_steps=2)
    plain, p_plain = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "plain", **common)
    calls_plain = len(attention_calls)
    checkpointed, p_checkpointed = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "checkpointed",
                                                  gradient_checkpointing=True, **common)
    assert len(attention_calls) - calls_plain == calls_plain + 2 * 4
    assert losses(plain) == losses(checkpointed) and len(losses(plain)) == 2
    assert_same_params(p_plain, p_checkpointed, rtol=0, atol=0)


def test_max_grad_norm_zero_means_no_clipping(tiny_datasets, tokenizer_dir, tmp_path):
    """0 is "off" (torch's clip_grad_norm_ at 0 would zero every gradient, so without weight decay
    nothing would move), and off is the default."""
    common = dict(total_episodes=8, local_micro_batch_size=4, gradient_accumulation_steps=2, weight_decay=0.0)
    _, p_default = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "default", **common)
    _, p_zero = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "zero", max_grad_norm=0.0, **common)
    assert_same_params(p_default, p_zero, rtol=0, atol=0)
    base = load_file(os.path.join(tokenizer_dir, "model.safetensors"))
    assert all(not torch.equal(p_zero[k], base[k]) for k in p_zero if "layers.0.attention" in k)



def test_resume_after_a_signal_mid_update_equals_the_uninterrupted_run(tiny_datasets, tokenizer_dir, tmp_path,
                                                                       monkeypatch):
    """6 updates of 8 (micro-batch 4 x 2), with sample generations every 2 updates (they draw from
    the torch RNG). SIGUSR1 arrives in the 6th training forward, the middle of update 3: the run
    finishes update 3, checkpoints and exits with 75; --resume then gives the uninterrupted run's
    weights and metrics.jsonl, bit for bit."""
    common = dict(total_episodes=48, local_micro_batch_size=4, gradient_accumulation_steps=2, print_sample_output_freq=2)
    whole, p_whole = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "whole", **common)
    with monkeypatch.context() as patch:
        signal_on_call(patch, sft, "sequence_losses", 6)
        with pytest.raises(SystemExit) as stopped:
            sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "stopped", **common)
    assert stopped.value.code == checkpoints.CHECKPOINT_EXIT_CODE == 75
    assert os.listdir(tmp_path / "stopped" / "checkpoints") == ["update-0000003"]
    assert len(losses(read_metrics(tmp_path, "stopped"))) == 3
    resumed, p_resumed = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "stopped", resume=True, **common)
    assert without_rates(resumed) == without_rates(whole) and len(losses(whole)) == 6
    assert_same_params(p_whole, p_resumed, rtol=0, atol=0)
    for update in (2, 4, 6):  # the sampled tables too (RNG streams restored)
        assert (tmp_path / "runs" / "whole" / f"samples_{update}.csv").read_text() == \
            (tmp_path / "runs" / "stopped" / f"samples_{update}.csv").read_text()


def test_resume_refuses_changed_settings_unless_told(tiny_datasets, tokenizer_dir, tmp_path, capsys):
    """A checkpoint records the settings that decide the results: a resume with another learning
    rate or model path is refused, naming them; --accept_changed_settings continues with a warning.
    Memory knobs may change (micro-batch 4 x 2 -> 2 x 4)."""
    common = dict(total_episodes=16, local_micro_batch_size=4, gradient_accumulation_steps=2, checkpoint_every=1)
    sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "run", **common)
    with pytest.raises(ValueError, match=r"update-0000002 was written with other settings: lr 0.003 there, 0.001 "
                                         r"here; response_length 32 there, 16 here\. Resume with"):
        sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "run", resume=True, lr=1e-3, response_length=16,
                       **common)
    capsys.readouterr()
    sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "run", resume=True, lr=1e-3,
                   accept_changed_settings=True, **common)
    assert "WARNING: resumed with changed settings (--accept_changed_settings): lr 0.003 there, 0.001 here" in \
        " ".join(capsys.readouterr().out.split())
    sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "run", resume=True,
                   **{**common, "local_micro_batch_size": 2, "gradient_accumulation_steps": 4})


def test_checkpoints_are_kept_and_bad_ones_refused(tiny_datasets, tokenizer_dir, tmp_path):
    """--checkpoint_every with --keep_checkpoints; --resume without a checkpoint, with another
    stage's or another batch arithmetic's, across backends, or from a corrupt file stops with a
    message naming the checkpoint and the mismatch. A write that never finished is ignored."""
    common = dict(local_micro_batch_size=4, gradient_accumulation_steps=2)
    sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "run", total_episodes=24, checkpoint_every=1,
                   keep_checkpoints=2, **common)
    out = str(tmp_path / "run")
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["update-0000002", "update-0000003"]
    identity = {"stage": "sft", "seed": 3, "batch_size": 8, "total_episodes": 24, "num_updates": 3}
    os.makedirs(os.path.join(out, "checkpoints", ".update-0000004.partial"))  # killed while writing
    path, state = checkpoints.find_checkpoint(out, identity, world_size=1, deepspeed=False)
    assert path.endswith("update-0000003") and state["update"] == 3 and state["run_name"] == "run"
    with pytest.raises(FileNotFoundError, match=r"--resume: no checkpoint in .*/nothing/checkpoints"):
        checkpoints.find_checkpoint(str(tmp_path / "nothing"), identity, world_size=1, deepspeed=False)
    with pytest.raises(ValueError, match=r"update-0000003 is not a checkpoint of this run: stage 'sft' there, 'reward' here"):
        checkpoints.find_checkpoint(out, {**identity, "stage": "reward"}, world_size=1, deepspeed=False)
    with pytest.raises(ValueError, match=r"batch_size 8 there, 16 here; num_updates 3 there, 1 here"):
        checkpoints.find_checkpoint(out, {**identity, "batch_size": 16, "num_updates": 1}, world_size=1, deepspeed=False)
    with pytest.raises(ValueError, match=r"update-0000003 was written without DeepSpeed"):
        checkpoints.find_checkpoint(out, identity, world_size=1, deepspeed=True)
    # a corrupt model file: the run stops, naming the checkpoint
    with open(os.path.join(path, "state.pt"), "wb") as f:
        f.write(b"not a torch file")
    with pytest.raises(ValueError, match=r"update-0000003: cannot load the checkpoint \(UnpicklingError"):
        sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "run", total_episodes=24, resume=True, **common)
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        f.write("{truncated")
    with pytest.raises(ValueError, match=r"update-0000003/trainer_state.json: not a readable checkpoint state"):
        checkpoints.find_checkpoint(out, identity, world_size=1, deepspeed=False)
    with pytest.raises(ValueError, match="--resume and --checkpoint_every keep checkpoints in <output_dir>"):
        run_in_process(sft.main, sft.Args(base_model=tokenizer_dir, query_dataset=os.path.join(tiny_datasets[0], "sft"),
                                          output_dir="", resume=True), str(tmp_path))


@pytest.fixture(scope="module")
def checkpointed_run(tiny_datasets, tokenizer_dir, tmp_path_factory):
    """The run the full-disk tests repeat (3 updates), on a disk with room: its saved weights."""
    workdir = str(tmp_path_factory.mktemp("roomy"))
    return sft_in_process(tiny_datasets, tokenizer_dir, workdir, "roomy", **FULL_DISK_RUN)[1]


FULL_DISK_RUN = dict(total_episodes=24, local_micro_batch_size=4, gradient_accumulation_steps=2, checkpoint_every=1)


def assert_nothing_lost(error, out, rescue, checkpointed_run):
    """A run whose second checkpoint and final save failed: the first checkpoint kept whole and
    resumable, no partial folder left, and the rescued model the very weights a run with room saved."""
    message = str(error.value)
    assert message.startswith(f"the final save to {out} failed (") and f"The trained model was written to {rescue}/rescued_" \
        in message and message.endswith(f": move its files into {out}")
    assert os.listdir(os.path.join(out, "checkpoints")) == ["update-0000001"]
    assert not [n for n in os.listdir(out) if "partial" in n]
    assert checkpoints.find_checkpoint(out, {"stage": "sft"}, 1, False)[1]["update"] == 1
    (rescued,) = [n for n in os.listdir(rescue) if n.startswith("rescued_")]  # ($TMPDIR: torch may cache there)
    saved = load_file(os.path.join(rescue, rescued, "model.safetensors"))
    assert saved.keys() == checkpointed_run.keys() and all(torch.equal(saved[k], checkpointed_run[k]) for k in saved)
    assert os.path.isfile(os.path.join(rescue, rescued, "tokenizer.json"))


def test_a_failed_checkpoint_and_final_save_lose_nothing(tiny_datasets, tokenizer_dir, tmp_path, monkeypatch, capsys,
                                                         checkpointed_run):
    """Case 4 of the lost-run reports, the writes failing as a full disk fails them (torch's
    "unexpected pos" for the checkpoints after the first, safetensors' SafetensorError for the final
    save): a checkpoint's failure is a warning naming its path and cause, the run goes on, and the
    final save's failure puts the trained weights on another disk ($TMPDIR here) and ends the run
    saying where."""
    from safetensors import SafetensorError

    writes, original_write, original_model = [], checkpoints.Checkpoints.write, saving.write_model

    def checkpoint_write(self, partial, *rest):
        writes.append(partial)
        if len(writes) >= 2:  # (a full disk stays full)
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
        return original_write(self, partial, *rest)

    def model_write(module, state_dict, tokenizer, output_dir):
        if output_dir == out:  # (as safetensors' serializer reports a full disk)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return original_model(module, state_dict, tokenizer, output_dir)

    out, rescue = str(tmp_path / "full"), tmp_path / "rescue"
    rescue.mkdir()
    monkeypatch.setenv("TMPDIR", str(rescue))
    monkeypatch.setattr(checkpoints.Checkpoints, "write", checkpoint_write)
    monkeypatch.setattr(launch, "write_model", model_write)
    with pytest.raises(RuntimeError) as error:
        sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "full", **FULL_DISK_RUN)
    printed = " ".join(capsys.readouterr().out.split())
    assert (f"WARNING: checkpoint {out}/checkpoints/update-0000002 could not be written (RuntimeError: [enforce fail "
            "at inline_container.cc:664] . unexpected pos 64 vs 0;") in printed
    assert f"The last checkpoint, {out}/checkpoints/update-0000001, is kept; the run goes on" in printed
    assert "(SafetensorError: Error while serializing: I/O error: No space left on device (os error 28);" in str(
        error.value)
    assert_nothing_lost(error, out, rescue, checkpointed_run)


def test_a_really_full_disk_loses_nothing(tiny_datasets, tokenizer_dir, tmp_path, monkeypatch, capsys,
                                          checkpointed_run):
    """The same on a real full disk: --output_dir on a 3.5 MiB tmpfs that holds the model (0.9 MiB)
    and one checkpoint (2.7 MiB) but not two, nor the model beside one. The start warns; the second
    checkpoint fails and is skipped; the final save goes to $TMPDIR. (Mounting needs root.)"""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3584k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        out, rescue = str(disk / "out"), tmp_path / "rescue"
        rescue.mkdir()
        monkeypatch.setenv("TMPDIR", str(rescue))
        with pytest.raises(RuntimeError) as error:
            sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "full", output_dir=out, **FULL_DISK_RUN)
        printed = " ".join(capsys.readouterr().out.split())
        assert re.search(rf"WARNING: {out}'s disk has 3.\d MiB free; the model and 2 checkpoints of about 2.\d MiB", printed)
        assert f"WARNING: checkpoint {out}/checkpoints/update-0000002 could not be written (" in printed
        assert_nothing_lost(error, out, rescue, checkpointed_run)
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # (the failed run still holds its .lock open)


def test_a_disk_that_cannot_hold_the_model_is_refused_before_training(tmp_path):
    module = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32))
    numel = sum(p.numel() for p in module.parameters())
    assert saving.disk_needs(module) == (numel * 4, numel * 12)  # fp32 weights; + AdamW's two fp32 moments
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(OSError, match=rf"--output_dir {tmp_path}: the trained model needs about .* at the end of the "
                                      r"run, and its disk has .* free. Free space there or choose another --output_dir"):
        saving.check_disk_space(str(tmp_path), free + 2 ** 30, 0, 0)
    assert saving.check_disk_space(str(tmp_path), 1, free, 0) is None  # no checkpoints asked for
    assert "a checkpoint that does not fit is skipped with a warning" in saving.check_disk_space(
        str(tmp_path), 1, free, 2)
    assert [saving.human_bytes(b) for b in (512, 3 * 2 ** 19, 5 * 2 ** 30)] == ["512 B", "1.5 MiB", "5.0 GiB"]


def read_metrics(workdir, name) -> list:
    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# global batch 8 for 6 updates: one process (micro-batch 2 x accumulation 4) or two (2 x 2 each);
# a sample table every update (generation: the runs draw from their RNG, and an update takes long
# enough for a signal to arrive in the middle of the run)
PROCESSES = {n: dict(total_episodes=48, local_micro_batch_size=2, gradient_accumulation_steps=8 // 2 // n,
                     print_sample_output_freq=1) for n in (1, 2)}
TWO = as_flags(PROCESSES[2])


@pytest.fixture(scope="module")
def process_runs(tiny_datasets, tokenizer_dir, tmp_path_factory):
    """The uninterrupted runs on one process (in this one: only the two-process run's launch is under
    test) and on two processes (gloo, DDP)."""
    tmp_path = tmp_path_factory.mktemp("sft_processes")
    one = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "one", **PROCESSES[1])
    two = run_sft(tiny_datasets, tokenizer_dir, tmp_path, "two", *TWO, launcher=accelerate_launcher(2))
    return tmp_path, one, two


@pytest.mark.slow
def test_two_processes_match_one_process(process_runs):
    _, (one, p_one), (result, two, p_two) = process_runs
    assert "world_size 2" in result.stdout
    assert len(losses(one)) == 6
    assert losses(one) == pytest.approx(losses(two), rel=1e-5)  # float reduction order differs slightly
    assert_same_params(p_one, p_two, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_resume_on_two_processes_and_on_one(process_runs, tiny_datasets, tokenizer_dir):
    """Two processes stopped by SIGUSR1 once the first update is logged. Resumed on two processes:
    the uninterrupted two-process run, bit for bit. Resumed on one process from a copy of the same
    checkpoint (same global batch): the uninterrupted one-process run, within the tolerance of the
    test above."""
    tmp_path, (one, p_one), (_, two, p_two) = process_runs
    stopped = run_until_signalled(sft_command(tiny_datasets, tokenizer_dir, tmp_path, "stopped", *TWO,
                                              launcher=accelerate_launcher(2)),
                                  tmp_path, tmp_path / "runs" / "stopped" / "metrics.jsonl", 1)
    (checkpoint,) = os.listdir(tmp_path / "stopped" / "checkpoints")
    assert f"checkpoint saved at update {int(checkpoint[len('update-'):])}" in stopped.stdout
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "stopped", moved / "stopped")
    shutil.copytree(tmp_path / "runs" / "stopped", moved / "runs" / "stopped")
    result, resumed, p_resumed = run_sft(tiny_datasets, tokenizer_dir, tmp_path, "stopped", *TWO, "--resume",
                                         launcher=accelerate_launcher(2))
    assert f"resumed run stopped from {tmp_path / 'stopped' / 'checkpoints' / checkpoint}" in " ".join(result.stdout.split())
    assert without_rates(resumed) == without_rates(two)
    assert_same_params(p_two, p_resumed, rtol=0, atol=0)
    on_one, p_on_one = sft_in_process(tiny_datasets, tokenizer_dir, str(moved), "stopped", resume=True,
                                      **PROCESSES[1])
    assert losses(on_one) == pytest.approx(losses(one), rel=1e-5) and len(losses(on_one)) == 6
    assert_same_params(p_one, p_on_one, rtol=1e-4, atol=1e-6)


# the DeepSpeed comparison's global batch of 8 for 2 updates, with the eval
DS_COMMON = ("--total_episodes", "16", "--local_micro_batch_size", "2", "--run_eval", "--local_eval_batch_size", "40")


@pytest.fixture(scope="module")
def plain_run(tiny_datasets, tokenizer_dir, tmp_path_factory):
    """The one-process run without DeepSpeed that each DeepSpeed setting is compared with: one run for
    all of them, in this process (its launch is not under test): (metrics, weights)."""
    return sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path_factory.mktemp("sft_plain")), "plain",
                          total_episodes=16, local_micro_batch_size=2, run_eval=True, local_eval_batch_size=40,
                          gradient_accumulation_steps=4)


@pytest.mark.slow
@pytest.mark.parametrize("config,num_processes", [(DS_CONFIG, 1), (DS_CONFIG, 2), (DS_ZERO3_CONFIG, 2)],
                         ids=["zero2-1proc", "zero2-2proc", "zero3-2proc"])
def test_deepspeed_matches_ddp(plain_run, tiny_datasets, tokenizer_dir, tmp_path, config, num_processes):
    """Same global batch of 8 for 2 updates; with ZeRO-3 (weights sharded across ranks) also the
    eval's generation, which needs every rank to take the same number of steps."""
    plain, p_plain = plain_run
    ds_out, ds, p_ds = run_sft(tiny_datasets, tokenizer_dir, tmp_path, "ds", "--deepspeed", *DS_COMMON,
                               "--gradient_accumulation_steps", str(4 // num_processes),
                               launcher=accelerate_launcher(num_processes, config))
    assert "DeepSpeed engine: ZeRO-" in ds_out.stdout and "gradient_clipping 0.0" in ds_out.stdout  # off, not 1.0
    assert losses(plain) == pytest.approx(losses(ds), rel=1e-5)
    assert_same_params(p_plain, p_ds, rtol=1e-4, atol=1e-6)
    evals = [{k: v for m in run for k, v in m.items() if k.startswith("validation/")} for run in (plain, ds)]
    assert len(evals[0]) == len(evals[1]) == 4
    assert evals[0]["validation/sft/loss"] == pytest.approx(evals[1]["validation/sft/loss"], rel=1e-4)
    # greedy samples of a 2-update model: its near-tied top logits may flip a token under the weights'
    # float noise (measured: ROUGE-1 0.0281 vs 0.0303 over 60 samples); the weights are compared above
    assert evals[0] == pytest.approx(evals[1], abs=5e-3)


@pytest.mark.slow
def test_deepspeed_resume_equals_the_uninterrupted_run(tiny_datasets, tokenizer_dir, tmp_path):
    """DeepSpeed ZeRO-2 on two processes, stopped by SIGUSR1 once the first update is logged and
    resumed from DeepSpeed's own checkpoint: the uninterrupted run's metrics and weights, bit for
    bit. A ZeRO checkpoint is sharded by rank: resuming it on one process is refused."""
    launcher = accelerate_launcher(2, DS_CONFIG)
    _, whole, p_whole = run_sft(tiny_datasets, tokenizer_dir, tmp_path, "whole", "--deepspeed", *TWO,
                                launcher=launcher)
    run_until_signalled(sft_command(tiny_datasets, tokenizer_dir, tmp_path, "stopped", "--deepspeed", *TWO,
                                    launcher=launcher), tmp_path, tmp_path / "runs" / "stopped" / "metrics.jsonl", 1)
    (checkpoint,) = os.listdir(tmp_path / "stopped" / "checkpoints")
    assert "pytorch_model" in os.listdir(tmp_path / "stopped" / "checkpoints" / checkpoint)  # DeepSpeed's format
    _, resumed, p_resumed = run_sft(tiny_datasets, tokenizer_dir, tmp_path, "stopped", "--deepspeed", *TWO,
                                    "--resume", launcher=launcher)
    assert without_rates(resumed) == without_rates(whole)
    assert_same_params(p_whole, p_resumed, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"DeepSpeed's ZeRO checkpoint of 2 processes loads only on as many"):
        checkpoints.find_checkpoint(str(tmp_path / "stopped"), {}, world_size=1, deepspeed=True)


def test_deepspeed_flag_without_deepspeed_is_an_error(tiny_datasets, tokenizer_dir, tmp_path):
    """In this process, as the command line raises it (test_clear_errors checks that the command line
    turns such an error into a failed exit and the message)."""
    with pytest.raises(ValueError, match="accelerate is not configured for DeepSpeed"):
        sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "x", deepspeed=True)


@pytest.mark.slow
def test_training_lowers_the_loss_and_saves_a_plain_model(tiny_datasets, tokenizer_dir, tmp_path):
    common = ("--local_micro_batch_size", "16", "--gradient_accumulation_steps", "1", "--run_eval",
              "--local_eval_batch_size", "64")
    result, trained, _ = run_sft(tiny_datasets, tokenizer_dir, tmp_path, "trained", "--total_episodes", "640",
                                 "--lr", "1e-3", "--track", *common)
    train_loss = losses(trained)
    assert len(train_loss) == 40  # 640 episodes of 300 rows: reshuffled passes, not a silent early stop
    lrs = [m["train/sft/lr"] for m in trained if "train/sft/lr" in m]
    assert lrs[0] == 1e-3 and lrs[20] == pytest.approx(0.5e-3) and lrs == sorted(lrs, reverse=True)  # cosine, no warmup
    assert train_loss[-1] < train_loss[0] - 1.0
    width = len(load_from_disk(os.path.join(tiny_datasets[0], "sft"))["train"][0]["query_reference_response_token"])
    assert_throughput(trained, 16 * width)
    evals = {k: v for m in trained for k, v in m.items() if k.startswith(("validation/", "test/"))}
    assert set(evals) == {f"{s}/sft/{k}" for s in ("validation", "test")
                          for k in ("loss", "rouge/rouge1", "rouge/rouge2", "rouge/rougeL")}
    import pandas as pd

    table = pd.read_csv(tmp_path / "runs" / "trained" / "validation_table.csv")
    assert list(table.columns) == ["query", "postprocessed_response", "reference_responses", "contain_eos"]
    assert table["contain_eos"].dtype == bool
    assert len(table) == 60  # every validation row once: no sharding duplicates
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "trained")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id and model.config.model_type == "gpt_neox"
    # eval generated with EOS cleared from the model's generation config; the saved one keeps it,
    # so a user's plain generate() stops at EOS
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert os.path.isdir(tmp_path / "wandb")  # --track wrote an offline wandb run


def test_logger_uses_wandb_only_for_its_own_tracked_run(tmp_path, monkeypatch):
    """An untracked run in a process where wandb is already imported (a notebook, the test suite)
    writes its tables locally and never calls wandb."""
    import types

    import pandas as pd
    import wandb

    monkeypatch.chdir(tmp_path)
    logger = tracking.Logger(sft.Args(run_name="untracked"), types.SimpleNamespace(is_main_process=True))
    logger.table("validation_table", pd.DataFrame({"query": ["q"], "postprocessed_response": ["r"]}))
    logger.close()
    assert wandb.run is None
    assert pd.read_csv(tmp_path / "runs" / "untracked" / "validation_table.csv")["query"].tolist() == ["q"]


def test_clear_errors(tiny_datasets, tokenizer_dir, tmp_path):
    """In this process (as the command line raises them), and once through the command line."""
    data_dir, _ = tiny_datasets
    sft_data = os.path.join(data_dir, "sft")
    result = launched([sys.executable, SCRIPT, "--base_model", tokenizer_dir, "--query_dataset", "./nope",
                       "--output_dir", str(tmp_path / "x")], tmp_path, dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode != 0 and "does not exist (build it with tldr_dataset.py)" in result.stderr

    def fails(error, match, **overrides):
        with pytest.raises(error, match=match):
            sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "x", **overrides)

    fails(ValueError, "lacks columns", query_dataset=os.path.join(data_dir, "preference"))
    fails(FileNotFoundError, "/no/such/model does not exist", base_model="/no/such/model", query_dataset=sft_data)
    fails(ValueError, "not divisible", local_micro_batch_size=3, batch_size=16)
    from transformers import AutoTokenizer

    from tokenizers import processors

    bad = AutoTokenizer.from_pretrained(tokenizer_dir)  # an EOS appended to every encode: refused
    bad.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A $B <|endoftext|>", special_tokens=[("<|endoftext|>", 0)])
    bad.save_pretrained(tmp_path / "badtok")
    for f in os.listdir(tokenizer_dir):
        if not f.startswith("tokenizer"):
            os.symlink(os.path.join(tokenizer_dir, f), tmp_path / "badtok" / f)
    fails(ValueError, r"adds \[\] before and \['<\|endoftext\|>'\] after every text", base_model=str(tmp_path / "badtok"))


# ---------------------------------------------------------------------------------------------
# LoRA and 4-bit base weights (DESIGN section 18)
# ---------------------------------------------------------------------------------------------

ADAPTED = ("query_key_value.weight", "attention.dense.weight", "dense_h_to_4h.weight", "dense_4h_to_h.weight")


def test_lora_micro_batch_split_and_the_saved_merged_model(tiny_datasets, tokenizer_dir, tmp_path, capsys):
    """LoRA SFT: micro-batch 1 x 4 == 4 x 1; the saved model is the base where no adapter sits
    (embeddings, norms, LM head: bit for bit) and base + the adapter's update where one does, with
    the logits of the base wrapped in the saved adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # (lr 1e-3: Adam (eps 1e-5) magnifies float noise in a near-zero gradient by up to lr / eps; at 1e-2
    # the two splits differed by 1.1e-6 in a merged weight on some CPUs)
    common = dict(total_episodes=8, use_peft=True, lora_r=4, lr=1e-3)
    capsys.readouterr()
    m1, p1 = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "lora1", local_micro_batch_size=1,
                            gradient_accumulation_steps=4, **common)
    # r 4 x (in + out features) of qkv 64->192, dense 64->64, 64->256, 256->64, in 2 layers
    assert "model: 8,192 trainable parameters of" in capsys.readouterr().out
    m4, p4 = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "lora4", local_micro_batch_size=4,
                            gradient_accumulation_steps=1, **common)
    assert losses(m1) == pytest.approx(losses(m4), rel=1e-6) and len(losses(m1)) == 2
    assert_same_params(p1, p4)
    base = load_file(os.path.join(tokenizer_dir, "model.safetensors"))
    assert p1.keys() == base.keys()
    for key in base:
        if key.endswith(ADAPTED):
            assert (p1[key] - base[key]).abs().max() > 1e-4, key
        else:
            assert torch.equal(p1[key], base[key]), key
    rows = torch.randint(2, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    wrapped = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tokenizer_dir),
                                        str(tmp_path / "lora1" / "adapter")).eval()
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "lora1")).eval()
    with torch.no_grad():
        assert torch.allclose(plain(rows).logits, wrapped(rows).logits, atol=1e-5)


@pytest.mark.slow
def test_lora_under_deepspeed_bf16_saves_the_model_it_trained(tiny_datasets, tokenizer_dir, tmp_path):
    """Under DeepSpeed bf16 the engine holds the module in bf16. The saved merged model is the
    adapter merged into the full-precision base from disk: its logits equal those of the fp32 base
    wrapped in the saved adapter, to fp32 noise. (Merged into the engine's bf16 weights, as before,
    they were 2.7e-2 apart: a delta of std 1e-4 on weights of std 0.02 loses about a third of itself.)
    The engine accumulates gradients in fp32 (in bf16 the micro-batch split changed the update)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result, _, saved = run_sft(tiny_datasets, tokenizer_dir, tmp_path, "lora_bf16", "--total_episodes", "64",
                               "--local_micro_batch_size", "8", "--gradient_accumulation_steps", "2", "--use_peft",
                               "--lr", "3e-3", "--deepspeed", launcher=accelerate_launcher(1, DS_BF16_CONFIG))
    out = " ".join(result.stdout.split())
    assert "weights torch.bfloat16, gradients accumulated in torch.float32" in out
    assert all(v.dtype == torch.float32 for v in saved.values())
    rows = torch.randint(2, 1000, (4, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(tokenizer_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(rows).logits
        wrapped = PeftModel.from_pretrained(base, str(tmp_path / "lora_bf16" / "adapter")).eval()
        adapted = wrapped(rows).logits
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "lora_bf16"), dtype=torch.float32).eval()(rows).logits
    assert (adapted - before).abs().max() > 0.1  # the adapter moved the logits
    assert (merged - adapted).abs().max() < 1e-4


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="4-bit needs AVX2")
def test_load_in_4bit_trains_lora_over_nf4_weights(tiny_datasets, tokenizer_dir, tmp_path):
    """--load_in_4bit: the base's linear layers in NF4 (so the first loss is not the fp32 model's),
    2 updates with an eval-mode sample generation after each (on AVX512-BF16 CPUs bitsandbytes would
    switch the weights to an inference layout there, breaking the next backward), and a saved model
    that is the fp32 base with the adapter merged in."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    common = dict(total_episodes=16, local_micro_batch_size=4, gradient_accumulation_steps=2, use_peft=True, lora_r=4,
                  lr=1e-2, print_sample_output_freq=1)
    full, _ = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "lora", **common)
    quantized, _ = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "lora4bit", load_in_4bit=True, **common)
    assert len(losses(quantized)) == 2 and all(map(math.isfinite, losses(quantized)))
    assert abs(losses(quantized)[0] - losses(full)[0]) > 1e-4  # the same data through NF4 weights
    assert losses(quantized)[1] != losses(full)[1]
    expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tokenizer_dir),
                                         str(tmp_path / "lora4bit" / "adapter")).merge_and_unload()
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "lora4bit"))
    assert_same_params(saved.state_dict(), expected.state_dict(), rtol=0, atol=1e-7)
    assert all(v.dtype == torch.float32 for v in saved.state_dict().values())


def test_peft_settings_that_cannot_work_are_refused(monkeypatch):
    def fails(match, deepspeed=False, **settings):
        with pytest.raises(ValueError, match=match):
            lora.check_peft_args(sft.Args(**settings), deepspeed)

    fails("add --use_peft", load_in_4bit=True)
    fails("--lora_r must be >= 1", use_peft=True, lora_r=0)
    fails(r"--lora_dropout must be in \[0, 1\)", use_peft=True, lora_dropout=1.0)
    fails("DeepSpeed cannot partition", deepspeed=True, use_peft=True, load_in_4bit=True)
    lora.check_peft_args(sft.Args(use_peft=True, load_in_4bit=True), False)  # this machine: fine
    monkeypatch.setattr(lora.platform, "machine", lambda: "arm64")
    fails("need a CUDA GPU or an x86-64 CPU with AVX2; this machine has no GPU and a arm64 CPU",
          use_peft=True, load_in_4bit=True)


@pytest.mark.parametrize("four_bit", [False, pytest.param(True, marks=pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="4-bit needs AVX2"))],
    ids=["lora", "lora-4bit"])
def test_lora_resume_equals_the_uninterrupted_run(tiny_datasets, tokenizer_dir, tmp_path, monkeypatch, four_bit):
    """A LoRA run (over 4-bit weights too) stopped by SIGUSR1 in update 2 of 4 and resumed: the
    uninterrupted run's metrics and saved model, bit for bit; a run without LoRA refuses its
    checkpoint, naming the setting."""
    common = dict(total_episodes=32, local_micro_batch_size=4, gradient_accumulation_steps=2, use_peft=True, lora_r=4,
                  load_in_4bit=four_bit)
    whole, p_whole = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "whole", **common)
    with monkeypatch.context() as patch:
        signal_on_call(patch, sft, "sequence_losses", 3)
        with pytest.raises(SystemExit):
            sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "stopped", **common)
    assert os.listdir(tmp_path / "stopped" / "checkpoints") == ["update-0000002"]
    with pytest.raises(ValueError, match=r"lora \[4, 32.0, \['all-linear'\], (True|False)\] there, None here"):
        sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "stopped", resume=True,
                       **{**common, "use_peft": False, "load_in_4bit": False})
    resumed, p_resumed = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "stopped", resume=True, **common)
    assert without_rates(resumed) == without_rates(whole) and len(losses(whole)) == 4
    assert_same_params(p_whole, p_resumed, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# no silent failure (DESIGN section 22)
# ---------------------------------------------------------------------------------------------


def strict_metrics(workdir, name) -> list:
    """metrics.jsonl read by a strict JSON reader (NaN and Infinity are not JSON)."""
    def refuse(constant):
        raise ValueError(f"{constant} in metrics.jsonl")

    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def nan_loss_in_call(monkeypatch, call: int) -> None:
    """sft.sequence_losses returns NaN losses in its `call`-th call (a micro-batch's forward)."""
    original, calls = sft.sequence_losses, []

    def with_nan(*args, **kwargs):
        calls.append(1)
        loss_sums, counts = original(*args, **kwargs)
        return (loss_sums * float("nan"), counts) if len(calls) == call else (loss_sums, counts)

    monkeypatch.setattr(sft, "sequence_losses", with_nan)


def test_divergence_stops_the_run_and_keeps_the_last_checkpoint(tiny_datasets, tokenizer_dir, tmp_path, monkeypatch,
                                                                capsys):
    """--lr 1e9 (the issue's run): update 1 throws the weights far out, update 2's loss is not finite,
    and the run stops there, naming the update, the phase and the tensor: exit 1, no model saved.
    A NaN loss in update 3 with a checkpoint every update: the checkpoint of update 2 stays, metrics.jsonl
    stays strict JSON, and --resume finishes the run as if nothing had happened."""
    common = dict(total_episodes=32, local_micro_batch_size=4, gradient_accumulation_steps=2, checkpoint_every=1)
    with pytest.raises(SystemExit) as stopped:
        sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "diverged", lr=1e9, **common)
    assert stopped.value.code == launch.NONFINITE_EXIT_CODE == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "STOPPED: update 2, optimizer step: non-finite loss" in out and "No model saved" in out
    assert not os.path.exists(tmp_path / "diverged" / "model.safetensors")

    whole, p_whole = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "whole", **common)
    with monkeypatch.context() as patch:
        nan_loss_in_call(patch, 5)  # update 3, first micro-batch
        with pytest.raises(SystemExit) as stopped:
            sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "nan", **common)
    assert stopped.value.code == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "STOPPED: update 3, optimizer step: non-finite loss and gradient norm" in out
    assert f"the last checkpoint, {tmp_path / 'nan' / 'checkpoints' / 'update-0000002'}, is kept" in out
    assert not os.path.exists(tmp_path / "nan" / "model.safetensors")
    assert os.listdir(tmp_path / "nan" / "checkpoints") == ["update-0000002"]
    assert len(strict_metrics(tmp_path, "nan")) == 2
    resumed, p_resumed = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "nan", resume=True, **common)
    assert without_rates(resumed) == without_rates(whole)
    assert_same_params(p_whole, p_resumed, rtol=0, atol=0)


def test_on_nonfinite_skip_skips_the_update_and_counts_it(tiny_datasets, tokenizer_dir, tmp_path, monkeypatch, capsys):
    """A NaN loss in the second micro-batch of update 2 (of 3): with --on_nonfinite skip that update
    changes no weight (the checkpoints of updates 1 and 2 hold the same weights), the run goes on and
    counts it; metrics.jsonl stays strict JSON (the NaN loss is null)."""
    common = dict(total_episodes=24, local_micro_batch_size=4, gradient_accumulation_steps=2, on_nonfinite="skip",
                  checkpoint_every=1, keep_checkpoints=3)
    nan_loss_in_call(monkeypatch, 4)
    metrics, params = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "skip", **common)
    assert "update 2, optimizer step: non-finite loss and gradient norm; skipped" in " ".join(capsys.readouterr().out.split())
    metrics = strict_metrics(tmp_path, "skip")
    assert [m["nonfinite/skipped"] for m in metrics] == [0, 1, 1]
    assert metrics[1]["train/sft/loss"] is None and metrics[2]["train/sft/loss"] is not None
    after = {u: torch.load(tmp_path / "skip" / "checkpoints" / f"update-000000{u}" / "state.pt")["model"]
             for u in (1, 2, 3)}
    assert all(torch.equal(after[1][k], after[2][k]) for k in after[1])  # the skipped update moved nothing
    assert any(not torch.equal(after[2][k], after[3][k]) for k in after[2])  # the next one did
    assert all(torch.isfinite(p).all() for p in params.values())


def test_ctrl_c_mid_update_checkpoints_and_resumes_to_the_uninterrupted_run(tiny_datasets, tokenizer_dir, tmp_path,
                                                                            monkeypatch, capsys):
    """SIGINT (Ctrl-C) is a stop signal: in the middle of update 2 the run finishes the update,
    checkpoints, exits 75, and --resume gives the uninterrupted run's weights bit for bit. After the
    first Ctrl-C a second one raises KeyboardInterrupt at once (the default handler is back)."""
    import signal

    common = dict(total_episodes=32, local_micro_batch_size=4, gradient_accumulation_steps=2)
    whole, p_whole = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "whole", **common)
    handlers = []
    with monkeypatch.context() as patch:
        signal_on_call(patch, sft, "sequence_losses", 3, signum=signal.SIGINT)
        original = checkpoints.Checkpoints.exit_after_stop

        def note_handler(self, *args):
            handlers.append(signal.getsignal(signal.SIGINT))
            original(self, *args)

        patch.setattr(checkpoints.Checkpoints, "exit_after_stop", note_handler)
        with pytest.raises(SystemExit) as stopped:
            sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "stopped", **common)
    assert stopped.value.code == 75 and handlers == [signal.default_int_handler]
    assert "Ctrl-C: stopping with a checkpoint" in capsys.readouterr().out
    assert os.listdir(tmp_path / "stopped" / "checkpoints") == ["update-0000002"]
    resumed, p_resumed = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "stopped", resume=True, **common)
    assert without_rates(resumed) == without_rates(whole)
    assert_same_params(p_whole, p_resumed, rtol=0, atol=0)


def test_a_stop_signal_during_the_final_eval_ends_it_promptly(tiny_datasets, tokenizer_dir, tmp_path, monkeypatch):
    """SIGUSR1 in the second generation of the final eval: the eval stops after that batch with a
    checkpoint of the last update, exit 75; --resume only evaluates and saves, and gives the
    uninterrupted run's model and eval metrics."""
    common = dict(total_episodes=16, local_micro_batch_size=4, gradient_accumulation_steps=2, run_eval=True,
                  local_eval_batch_size=16)
    whole, p_whole = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "whole", **common)
    generations = []
    with monkeypatch.context() as patch:
        signal_on_call(patch, sft, "generation_rows", 2)
        original = sft.generation_rows
        patch.setattr(sft, "generation_rows", lambda *a, **k: generations.append(1) or original(*a, **k))
        with pytest.raises(SystemExit) as stopped:
            sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "stopped", **common)
    batches = -(-len(load_from_disk(os.path.join(tiny_datasets[0], "sft"))["validation"]) // 16)
    assert stopped.value.code == 75 and len(generations) == 2 < batches
    assert os.listdir(tmp_path / "stopped" / "checkpoints") == ["update-0000002"]
    assert not os.path.exists(tmp_path / "stopped" / "model.safetensors")
    resumed, p_resumed = sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "stopped", resume=True, **common)
    assert without_rates(resumed) == without_rates(whole)
    assert_same_params(p_whole, p_resumed, rtol=0, atol=0)


def test_bad_settings_are_refused_before_training(tiny_datasets, tokenizer_dir, tmp_path):
    """--response_length 0, a LoRA target that names no layer, and --run_eval on a dataset without a
    validation split: each a one-line error that says what to do, before any update."""
    data = load_from_disk(os.path.join(tiny_datasets[0], "sft"))
    no_validation = str(tmp_path / "no_validation")
    type(data)({s: d for s, d in data.items() if s != "validation"}).save_to_disk(no_validation)
    with pytest.raises(ValueError, match="--response_length must be >= 1, got 0"):
        sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "zero", response_length=0)
    with pytest.raises(ValueError, match=r"--lora_target_modules qkv: .* This model's linear layers are named "
                                         r"dense dense_4h_to_h dense_h_to_4h lm_head query_key_value \(or use all-linear\)"):
        sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "lora", use_peft=True, lora_target_modules=["qkv"])
    with pytest.raises(ValueError, match=r"no_validation has no 'validation' split, which --run_eval .* needs"):
        sft_in_process(tiny_datasets, tokenizer_dir, str(tmp_path), "split", query_dataset=no_validation, run_eval=True)
    assert not os.path.exists(tmp_path / "runs")  # refused before the logs began


def test_a_run_shows_progress_lines_and_ends_with_a_summary(tiny_datasets, tokenizer_dir, tmp_path):
    """Under a redirect (not a terminal): plain progress lines with the loss and an ETA, no library
    noise, and the summary block naming the model, metrics.jsonl and TensorBoard folders."""
    result, metrics, _ = run_sft(tiny_datasets, tokenizer_dir, tmp_path, "shown", "--total_episodes", "48",
                                 "--local_micro_batch_size", "4", "--gradient_accumulation_steps", "1", "--run_eval",
                                 "--local_eval_batch_size", "16")
    lines = result.stdout.splitlines()
    progress = [line for line in lines if line.startswith("sft ")]
    assert progress[0].startswith("sft 1/12 (8%) | loss ") and "elapsed, ETA" in progress[0]
    assert progress[-1].startswith("sft 12/12 (100%) | loss ") and progress[-1].endswith("ETA 0:00:00")
    assert any(line.startswith("eval validation ") for line in lines)
    assert "── sft done: shown, 12 updates in" in result.stdout
    assert f"model        {tmp_path / 'shown'}" in result.stdout
    assert f"metrics      {os.path.join('runs', 'shown', 'metrics.jsonl')}" in result.stdout
    last_loss = [m["train/sft/loss"] for m in metrics if "train/sft/loss" in m][-1]
    assert f"last values  loss {last_loss:.4g}" in result.stdout
    for noise in ("gemm_4bit", "Setting accelerator to CPU", "LOAD REPORT", "Loading weights", "Writing model shards"):
        assert noise not in result.stdout + result.stderr, noise
