"""CPU smoke run of benchmarks/ppo_speed.py (so the benchmark cannot rot): ppo_left_padding.py in one
process and DDP on 2 processes, and the side-by-side against TRL 1.12, at the tiniest shape with 2
updates and short sequences. Its timings mean nothing; the wiring, the CSV and the arithmetic do."""

import contextlib
import csv
import importlib.util
import io
import math
import os
import socket
import subprocess

import numpy as np
import pytest
import torch
from conftest import launch_port, launched, subprocess_with
from transformers import GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

from summarize_from_feedback_details.infra import ports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# benchmarks/ is a folder of scripts, not a package: load the file itself
_spec = importlib.util.spec_from_file_location("ppo_speed", os.path.join(REPO, "benchmarks", "ppo_speed.py"))
ppo_speed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ppo_speed)

# TRL's config keeps transformers' deprecated `gradient_checkpointing` field (unused by its PPO trainer)
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

SPEED_COLUMNS = {"shape", "params", "strategy", "processes", "micro_batch", "batch", "query_length", "response_length",
                 "device", "precision", "threads", "updates_measured", "s_per_update", "s_per_update_min",
                 "s_per_update_max", "tokens_per_s", "generated_tokens_per_s", "tflop_per_update", "achieved_tflops",
                 "peak_tflops", "utilisation", "other_s", "decode_ms_per_step", "floor_ms_per_step", "bandwidth_gb_s",
                 "variant", "forwards", "sampler", "async_steps", "trainable_params", "peak_memory_gib",
                 "epoch_utilisation", "status"}
# the per-update phases ppo_left_padding.py logs under time/
STAGE_PHASES = {"validation", "generation", "reference_forward", "value_forward", "reward_forward", "ppo_epochs"}
TRL_PHASES = {"generation", "reference_forward", "value_forward", "reward_forward"}


def read_csv(path) -> list:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One `--mode both` run: the table for single + ddp x2, each with every weight and with LoRA
    (rank 4), then one round of ours vs TRL. One
    torch thread (generation is hundreds of tiny ops: a thread pool on a small shared CPU only slows
    them down), a small matmul for the peak."""
    folder = tmp_path_factory.mktemp("ppo_speed")
    args = ppo_speed.Args(
        mode="both", shapes=["tiny-s"], strategies=["single", "ddp"], micro_batch_sizes=[4], num_processes=2,
        variants=["full", "lora"], lora_r=4,
        batch_size=4, query_length=16, response_length=8, eval_batch_size=1, updates=2, rounds=1, threads=1,
        matmul_size=256, out=str(folder / "out"), cache_dir=str(folder / "cache"),
    )
    stdout = io.StringIO()
    threads = torch.get_num_threads()

    def run(cmd, cwd, env, capture_output, text):  # the multi-process rows' launches, forked (conftest.launched)
        assert capture_output and text
        return launched(cmd, cwd, env)

    try:
        with contextlib.redirect_stdout(stdout), pytest.MonkeyPatch.context() as patch:
            patch.setattr(ppo_speed, "subprocess", subprocess_with(run=run))  # (its one call is the launch)
            results = ppo_speed.main(args)
    finally:
        torch.set_num_threads(threads)
    return args, results, stdout.getvalue()


@pytest.mark.slow
def test_speed_csv_rows_and_columns(smoke):
    args, _, stdout = smoke
    rows = read_csv(os.path.join(args.out, "ppo_speed.csv"))
    # (the micro-batch is capped at each process's share of the batch)
    assert [(r["strategy"], r["processes"], r["micro_batch"], r["variant"]) for r in rows] == [
        ("single", "1", "4", "full"), ("single", "1", "4", "lora"),
        ("ddp", "2", "2", "full"), ("ddp", "2", "2", "lora")]
    for row in rows:
        assert row["status"] == "ok", stdout
        assert SPEED_COLUMNS | {f"time/{p}" for p in STAGE_PHASES} <= set(row), set(row) ^ SPEED_COLUMNS
        assert row["shape"] == "tiny-s" and int(row["params"]) == 231168 and row["device"] == "cpu"
        assert int(row["updates_measured"]) == 1  # 2 updates, the first is warm-up
        values = {k: float(row[k]) for k in row if k.startswith(("s_per", "time/", "tokens", "generated", "tflop",
                                                                   "achieved", "peak_tflops", "utilisation"))}
        assert all(math.isfinite(v) and v > 0 for v in values.values()), values
        # the phases are parts of the update (one measured update: the medians are its own values)
        assert sum(v for k, v in values.items() if k.startswith("time/")) <= values["s_per_update"] * (1 + 1e-9)
        assert float(row["other_s"]) == pytest.approx(
            values["s_per_update"] - sum(v for k, v in values.items() if k.startswith("time/")), abs=1e-9)
        assert values["tokens_per_s"] == pytest.approx(4 * (16 + 8) / values["s_per_update"])
        assert float(row["decode_ms_per_step"]) == pytest.approx(1e3 * values["time/generation"] / 8)
        # a process decodes its eval + batch rows over 16 + 8 positions (bandwidth: its share of the bus)
        rows_decoded = 1 + 4 // int(row["processes"])
        assert float(row["floor_ms_per_step"]) == pytest.approx(
            1e3 * ppo_speed.decode_step_bytes("tiny-s", rows_decoded, 24, 4, 4) / (float(row["bandwidth_gb_s"]) * 1e9))
        assert 0 < float(row["floor_ms_per_step"]) < float(row["decode_ms_per_step"])
        # policy 231,168 + critic 165,696 (the backbone and a 64-wide head); LoRA rank 4: 8,192 adapter
        # weights per model (4 x (in + out) of 4 matrices x 2 layers) and the critic's head
        assert int(row["trainable_params"]) == (396864 if row["variant"] == "full" else 2 * 8192 + 64)
        # what the one-process runs added to this process at their peak (models, optimizer state, activations)
        if row["strategy"] == "single":
            assert 0 < float(row["peak_memory_gib"]) < 24
        else:
            assert math.isnan(float(row["peak_memory_gib"]))
    assert "seconds per update" in stdout and "tiny-s" in stdout  # the rich table
    assert os.path.getsize(os.path.join(args.out, "ppo_speed.png")) > 0


@pytest.mark.slow
def test_trl_side_by_side(smoke):
    args, results, stdout = smoke
    rows = read_csv(os.path.join(args.out, "trl_side_by_side.csv"))
    assert len(rows) == len(results["trl"]) == 1  # one round, one measured update per side
    row = {k: (v if k in ("shape", "forwards", "first", "device") else float(v)) for k, v in rows[0].items()}
    assert row["shape"] == "tiny-s" and row["first"] == "packed" and row["update"] == 2 and row["forwards"] == "packed"
    assert 0 <= row["padding_share"] < 0.5  # left-padded queries of 50-100% of their length, full responses
    assert {f"ours_{p}" for p in STAGE_PHASES} | {f"trl_{p}" for p in TRL_PHASES} <= set(row)
    for side in ("ours", "trl"):
        seconds = row[f"{side}_s"]
        assert math.isfinite(seconds) and seconds > 0
        phases = [v for k, v in row.items() if k.startswith(f"{side}_") and k not in (f"{side}_s", f"{side}_other")]
        assert all(v > 0 for v in phases) and sum(phases) <= seconds * (1 + 1e-9)
        assert row[f"{side}_other"] == pytest.approx(seconds - sum(phases), abs=1e-9)
    assert row["ratio_trl_over_ours"] == pytest.approx(row["trl_s"] / row["ours_s"])
    line = next(line for line in stdout.splitlines() if line.startswith("ratio TRL / ours"))
    assert "(tiny-s, packed): median" in line and "min" in line and "max" in line and "over 1 paired updates" in line
    assert os.path.getsize(os.path.join(args.out, "trl_side_by_side.png")) > 0


# ---------------------------------------------------------------------------------------------
# the pure helpers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["tiny-s", "1m"])
def test_parameter_counts_match_the_models(shape):
    config = ppo_speed.model_config(shape)
    embedding = config.vocab_size * config.hidden_size
    policy = sum(p.numel() for p in GPTNeoXForCausalLM(config).parameters())
    critic = sum(p.numel() for p in GPTNeoXForSequenceClassification(ppo_speed.model_config(shape, num_labels=1))
                 .parameters())
    assert ppo_speed.matmul_params(shape) == (policy - embedding, critic - embedding)
    assert ppo_speed.total_params(shape) == policy


def test_named_shapes_have_their_size():
    for shape, size in (("1m", 1e6), ("10m", 1e7), ("pythia-160m", 1.6e8), ("pythia-1b", 1e9), ("pythia-6.9b", 6.9e9)):
        assert 0.9 < ppo_speed.total_params(shape) / size < 1.15, shape


def test_flops_per_update_known_answer():
    # 6 x (10 + 5) x 2 x (3 + 1) x 4 epochs + 2 x (20 + 10) x 8 tokens + 2 x (10 + 10) x 1 x 4
    assert ppo_speed.flops_per_update(10, 5, batch_size=2, eval_queries=1, query_length=3, response_length=1,
                                      epochs=4) == 2880 + 480 + 160


def test_decode_step_bytes_known_answer():
    # tiny-s: 165,632 matmul weights in fp32, and keys + values of 2 layers x 64 wide x 10 positions
    # x 3 rows in bf16
    assert ppo_speed.matmul_params("tiny-s")[0] == 165632
    assert ppo_speed.decode_step_bytes("tiny-s", rows=3, context=10, weight_bytes=4, cache_bytes=2) == \
        165632 * 4 + 2 * 2 * 64 * 10 * 3 * 2


def test_memory_bandwidth_is_a_plausible_copy_rate():
    bandwidth = ppo_speed.memory_bandwidth("cpu", threads=1, megabytes=32, repeats=2)
    assert 1e8 < bandwidth < 1e13  # between 0.1 GB/s and 10 TB/s


def test_synthetic_queries_and_tokenizer():
    rows = ppo_speed.left_padded_queries(50, 12, 100, np.random.default_rng(0))
    for row in rows:
        real = [t for t in row if t != ppo_speed.PAD_ID]
        assert len(row) == 12 and 6 <= len(real) <= 12 and row[12 - len(real):] == real
        assert all(2 <= t < 100 for t in real)
    tokenizer = ppo_speed.synthetic_tokenizer(100)
    assert len(tokenizer) == 100 and tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 1
    assert tokenizer.decode([5, 99, 0]) == "t5 t99 <|endoftext|>"
    # text reads back to its ids (grpo_vs_trl.py's TRL side reads the queries as text)
    assert tokenizer("t5 t99  t7\tt3")["input_ids"] == [5, 99, 7, 3]


# the shape of a launched run's stderr when a rank raises: its traceback, then the launcher's own
RANK_FAILED_STDERR = """Traceback (most recent call last):
  File "ppo_left_padding.py", line 3, in <module>
    raise ValueError("boom on rank 1")
ValueError: boom on rank 1
E1123 17:58:53.657000 17734 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1
Traceback (most recent call last):
  File ".venv/bin/accelerate", line 6, in <module>
    sys.exit(main())
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Root Cause (first observed failure):
  rank      : 1 (local_rank: 1)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_samplers_set_the_stages_async_flags_and_share_the_cores():
    """sync: today's loop; sequential: --async_steps only; overlapped: a CPU worker whose threads come out of
    the setting's (4 threads: the learner 3, the worker 1), one process only."""
    args = ppo_speed.Args(shapes=["tiny-s"], samplers=["sync", "sequential", "overlapped"], async_steps=2, threads=4,
                          micro_batch_sizes=[4], batch_size=4)
    settings = ppo_speed.speed_settings(args, "cpu")
    assert [(s.sampler, s.threads) for s in settings] == [("sync", 4), ("sequential", 4), ("overlapped", 3)]
    stages = [ppo_speed.stage_args(args, s, "sft", "rm", "data", s.sampler) for s in settings]
    assert [(st.async_steps, st.async_worker, st.async_worker_threads) for st in stages] == [
        (0, None, 1), (2, None, 1), (2, "cpu", 1)]
    assert all(ppo_speed.check_setting(args, s) is None for s in settings)
    launched_overlap = ppo_speed.Setting("tiny-s", "ddp", 2, 2, 1, sampler="overlapped")
    assert ppo_speed.check_setting(args, launched_overlap) == "the overlapped sampler is measured on one process"


def test_launched_failure_names_the_ranks_error():
    assert ppo_speed.launched_failure(RANK_FAILED_STDERR) == "ValueError: boom on rank 1"
    assert ppo_speed.launched_failure("Killed\n") == "Killed"
    error = RuntimeError("exit status 1: ValueError: boom (whole output: work/x.log)\nmore")
    assert ppo_speed.failure_reason(error) == "exit status 1: ValueError: boom (whole output: work/x.log)"


def test_launched_runs_get_a_free_rendezvous_port():
    setting = ppo_speed.Setting(shape="tiny-s", strategy="ddp", num_processes=2, micro_batch_size=2, threads=1,
                                variant="full")
    command = ppo_speed.launch_command(setting, "cpu")
    port = int(command[command.index("--main_process_port") + 1])
    with socket.socket() as probe:  # nothing listens there: it can be bound
        probe.bind(("127.0.0.1", port))
    # below the ephemeral range (a port bind(0) hands back can be taken by any socket opened before the
    # launch binds it: a CI launch on one hung 600 s) and below the tests' own launches (from 20000 up)
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert port in ppo_speed.PORTS and max(ppo_speed.PORTS) < launch_port() < ports.EPHEMERAL_START <= low


def test_a_port_is_handed_out_once_and_never_a_taken_one(monkeypatch):
    monkeypatch.setattr(ports, "_handed_out", set())
    assert len({ports.free_port(range(10000, 10060)) for _ in range(60)}) == 60
    with pytest.raises(RuntimeError, match="no free TCP port in 10000-10059"):
        ports.free_port(range(10000, 10060))
    monkeypatch.setattr(ports, "_handed_out", set())
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 10100))
        listener.listen()
        assert ports.free_port(range(10100, 10102)) == 10101


# a launched run whose rank 1 died as it exited (CI, twice): every update done, then SIGABRT
DIED_AT_EXIT_STDERR = """ppo 100%
terminate called without an active exception
W1123 18:47:47.308000 7869 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 7872 closing signal SIGTERM
E1123 18:47:47.325000 7869 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1
Traceback (most recent call last):
  File ".venv/bin/accelerate", line 6, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 7873)  (SIGABRT)
============================================================
"""


def test_died_after_finishing_only_when_every_update_is_logged_and_no_rank_raised():
    assert ppo_speed.died_after_finishing(DIED_AT_EXIT_STDERR, logged=2, updates=2)
    assert not ppo_speed.died_after_finishing(DIED_AT_EXIT_STDERR, logged=1, updates=2)  # died mid-run
    # a rank that raised (rank 0 then got SIGTERM: a negative exit code too) is a real failure
    raised = RANK_FAILED_STDERR.replace("  rank      : 1", "  exitcode  : -15 (pid: 1)\n  rank      : 1")
    assert not ppo_speed.died_after_finishing(raised, logged=2, updates=2)


def test_a_run_killed_at_exit_is_run_once_more(tmp_path, monkeypatch):
    """subprocess.run stands in for the launcher: it logs every update, then fails as DIED_AT_EXIT_STDERR
    (`failures` times, or forever), or logs only one update and fails so."""
    def launcher(failures, logged=2):
        calls = []

        def run(command, cwd, **kwargs):
            calls.append(command)
            folder = os.path.join(cwd, "runs", "r")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
                f.writelines('{"time/update": 1.0}\n' for _ in range(logged))
            failed = failures is None or len(calls) <= failures
            return subprocess.CompletedProcess(command, 1 if failed else 0, "", DIED_AT_EXIT_STDERR if failed else "")
        return calls, run

    setting = ppo_speed.Setting(shape="tiny-s", strategy="ddp", num_processes=2, micro_batch_size=2, threads=1)
    stage = ppo_speed.ppo.Args(run_name="r")
    console = ppo_speed.Console(file=io.StringIO(), width=400)
    calls, run = launcher(failures=1)
    monkeypatch.setattr(ppo_speed, "subprocess", subprocess_with(run=run))
    ppo_speed.run_ours_launched(stage, setting, str(tmp_path), "cpu", 2, console)
    assert len(calls) == 2 and "a rank was killed by a signal after the run's last update" in console.file.getvalue()
    # the second run starts from an empty run folder: its metrics are its own
    assert ppo_speed.logged_updates(str(tmp_path / "runs/r")) == 2
    for failures, logged in ((None, 2), (1, 1)):  # twice in a row; or before the last update: no rerun
        calls, run = launcher(failures, logged)
        monkeypatch.setattr(ppo_speed, "subprocess", subprocess_with(run=run))
        with pytest.raises(RuntimeError, match="exit status 1"):
            ppo_speed.run_ours_launched(stage, setting, str(tmp_path), "cpu", 2, console)
        assert len(calls) == (2 if failures is None else 1)


def test_epoch_profile_times_each_part_per_forwards_setting(tmp_path, capsys):
    """benchmarks/epoch_profile.py at the tiniest shape (the compiled setting runs in benchmarks only:
    its inductor compile takes minutes here)."""
    spec = importlib.util.spec_from_file_location("epoch_profile", os.path.join(REPO, "benchmarks", "epoch_profile.py"))
    epoch_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(epoch_profile)
    args = epoch_profile.Args(shape="tiny-s", batch_size=2, query_length=8, response_length=4,
                              forwards=["padded", "packed"], warmup=1, repeats=1, cache_dir=str(tmp_path))
    medians = epoch_profile.main(args)
    for forwards in ("padded", "packed"):
        parts = medians[forwards]
        assert all(parts[p] > 0 for p in epoch_profile.PARTS)
        assert parts["step"] == pytest.approx(sum(parts[p] for p in epoch_profile.PARTS))
    assert "policy forward" in capsys.readouterr().out


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_prompts_read_back_to_the_queries_and_completions_append():
    """TRL's side sees the queries as text: its tokenizer must give back each query's ids, and its
    reward model's input (prompt + completion, concatenated as text) the query's then the response's."""
    grpo_vs_trl = load_benchmark("grpo_vs_trl")
    tokenizer = ppo_speed.synthetic_tokenizer(100)
    queries = ppo_speed.left_padded_queries(20, 12, 100, np.random.default_rng(0))
    texts = grpo_vs_trl.prompt_texts(queries)
    for row, text in zip(queries, texts):
        real = [t for t in row if t != ppo_speed.PAD_ID]
        assert tokenizer(text)["input_ids"] == real
        completion = tokenizer.decode([7, 42, 9])
        assert tokenizer(text + completion)["input_ids"] == real + [7, 42, 9]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*checkpointing.*:FutureWarning")
def test_grpo_against_trl_side_by_side(tmp_path, capsys):
    """benchmarks/grpo_vs_trl.py at the tiniest shape: both sides run their real loops, one paired
    update, every phase positive and inside the update, the ratio what the seconds give."""
    grpo_vs_trl = load_benchmark("grpo_vs_trl")
    args = grpo_vs_trl.Args(shapes=["tiny-s"], queries=4, k=4, micro_batch_size=8, query_length=16,
                            response_length=8, eval_batch_size=1, updates=2, rounds=1, threads=1,
                            out=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    try:
        rows = grpo_vs_trl.main(args)
    finally:
        torch.set_num_threads(threads)
    assert rows == [{**rows[0], "shape": "tiny-s", "round": 1, "update": 2, "first": "ours", "k": 4, "queries": 4}]
    written = read_csv(os.path.join(args.out, "grpo_vs_trl.csv"))
    assert len(written) == 1
    assert float(written[0]["ratio_trl_over_ours"]) == pytest.approx(rows[0]["trl_s"] / rows[0]["ours_s"])
    row = rows[0]
    assert {"ours_generation", "ours_reference_forward", "ours_reward_forward", "ours_ppo_epochs", "trl_generation",
            "trl_reference_forward", "trl_reward_forward"} <= set(row)
    for side in ("ours", "trl"):
        phases = [v for k, v in row.items() if k.startswith(f"{side}_") and k not in (f"{side}_s", f"{side}_other")]
        assert all(v > 0 for v in phases) and sum(phases) <= row[f"{side}_s"] * (1 + 1e-9)
        assert row[f"{side}_other"] == pytest.approx(row[f"{side}_s"] - sum(phases), abs=1e-9)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ratio TRL / ours"))
    assert "(tiny-s, GRPO k=4): median" in line and "over 1 paired updates" in line
    assert os.path.getsize(os.path.join(args.out, "grpo_vs_trl.png")) > 0


def test_time_to_gold_known_answers():
    time_to_gold = load_benchmark("async_time_to_gold")
    rows = [{"update": t, "elapsed": 10.0 * t, "gold": g} for t, g in enumerate([1.0, 1.0, 4.0, 2.0, 3.0, 4.0], 1)]
    assert time_to_gold.running_gold(rows) == pytest.approx([1.0, 1.0, 2.0, 7 / 3, 3.0, 3.0])
    # G0 1, G* (2 + 3 + 4) / 3 = 3: 90% of the gain is 2.8
    assert time_to_gold.gold_target(rows, 0.9) == pytest.approx(2.8)
    assert time_to_gold.time_to(rows, 2.8) == (5, 50.0)
    assert time_to_gold.time_to(rows, 3.5) is None
    # the learner gives the worker its threads, never its last one
    args = time_to_gold.Args(threads=2, worker_threads=1)
    assert [time_to_gold.learner_threads(args, s) for s in time_to_gold.SAMPLERS] == [2, 2, 1]
    assert time_to_gold.learner_threads(time_to_gold.Args(threads=1), "overlapped") == 1


def test_time_to_gold_runs_hello_worlds_ppo():
    """The three runs are hello_world's PPO stage: its batch, micro-batch, updates and flags."""
    time_to_gold = load_benchmark("async_time_to_gold")
    stage = time_to_gold.hello_world_ppo(time_to_gold.Args(async_steps=2), "r", "overlapped")
    batch, micro, updates, flags = time_to_gold.tiny_default("TINY_PPO_BATCH", "TINY_PPO_MICRO_BATCH",
                                                             "TINY_PPO_UPDATES", "TINY_PPO_FLAGS")
    assert stage.total_episodes == int(updates) * int(batch) and stage.local_rollout_forward_batch_size == int(batch)
    assert stage.local_micro_batch_size * stage.gradient_accumulation_steps == int(batch) == 4 * int(micro)
    assert "--lr" in flags and stage.lr == float(flags.split()[flags.split().index("--lr") + 1])
    assert (stage.async_steps, stage.async_worker) == (2, "cpu")
    sync = time_to_gold.hello_world_ppo(time_to_gold.Args(async_steps=2), "r", "sync")
    assert (sync.async_steps, sync.async_worker) == (0, None)


@pytest.mark.slow
def test_time_to_gold_end_to_end(checkpoints, tiny_datasets, models_dir, tmp_path, monkeypatch, capsys):
    """Three short runs from the shared tiny checkpoints (hello_world's settings shrunk to 2 updates of 8):
    sequential and overlapped learn the same gold curve, update by update; the table and files written."""
    time_to_gold = load_benchmark("async_time_to_gold")
    settings = {"TINY_PPO_BATCH": "8", "TINY_PPO_MICRO_BATCH": "4", "TINY_PPO_UPDATES": "2",
                "TINY_PPO_FLAGS": "--lr 1e-4 --response_length 8 --local_eval_batch_size 4"}
    monkeypatch.setattr(time_to_gold, "tiny_default", lambda *names: [settings[n] for n in names])
    args = time_to_gold.Args(models=os.path.dirname(checkpoints[0]),
                             base_model=os.path.join(models_dir, "pythia-tiny-s"), query_dataset=os.path.join(tiny_datasets[0], "sft"), threads=2, out=str(tmp_path / "out"))
    threads = torch.get_num_threads()
    try:
        result = time_to_gold.main(args)
    finally:
        torch.set_num_threads(threads)
    runs = result["runs"]
    assert [len(runs[s]) for s in time_to_gold.SAMPLERS] == [2, 2, 2]
    assert [r["gold"] for r in runs["sequential"]] == [r["gold"] for r in runs["overlapped"]]
    assert runs["sync"][0]["gold"] == runs["sequential"][0]["gold"]  # update 1: the SFT policy, the same queries
    assert all(0 <= r["worker_hidden_fraction"] <= 1 for r in runs["overlapped"][1:])
    for rows in runs.values():
        assert [r["elapsed"] for r in rows] == pytest.approx(np.cumsum([r["seconds"] for r in rows]).tolist())
    assert "time to 90% of the synchronous run's gold gain" in capsys.readouterr().out
    assert len(read_csv(os.path.join(args.out, "time_to_gold.csv"))) == 6
    assert os.path.getsize(os.path.join(args.out, "time_to_gold.png")) > 0
