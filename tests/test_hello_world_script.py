"""hello_world.sh's wiring, with every program it starts replaced by a recorder: which stages run
with which flags, the batch arithmetic of the memory knobs, skipping finished stages. (The real
tiny run is `./hello_world.sh` itself; this checks the GPU path that cannot run here.)
TEST_BASH=/path/to/bash runs the script with another bash, e.g. a 4.2 build (tests/test_shell_scripts.py)."""

import json
import os
import shutil
import signal
import stat
import subprocess
import time

import pytest

from summarize_from_feedback_details import dpo, ppo_left_padding, reward, sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASH = os.environ.get("TEST_BASH", "bash")
# stands in for .venv/bin/python, .venv/bin/accelerate and make: records its argv and, like the
# stages, writes <output_dir>/model.safetensors
RECORDER = """#!/usr/bin/env python3
import json, os, sys, time
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\\n")
# EVENTS: when each stage (by its --output_dir) starts and ends, on how many threads, and which cores
# it takes at which update (TAKE_CORES_AT); SLOW_STAGE takes a second; FAILING_STAGE fails
stage = sys.argv[sys.argv.index("--output_dir") + 1] if "--output_dir" in sys.argv else None
def event(what):
    if os.environ.get("EVENTS") and stage:
        with open(os.environ["EVENTS"], "a") as f:
            f.write(json.dumps([what, stage, os.environ.get("OMP_NUM_THREADS"),
                                os.environ.get("TAKE_CORES_AT")]) + "\\n")
event("start")
# like a stage (infra/preflight.py, infra/checkpoints.py): a checkpoint in <output_dir>/checkpoints is
# refused without --resume and needed with it, a fresh run refuses a run folder with logs, a resumed one
# appends to them; a stage in STOP_STAGES (its pid in <output_dir>/pid) waits for Ctrl-C or SIGTERM, then
# writes a checkpoint (taking STOP_SECONDS to finish its update) and exits 75
if stage and "--run_name" in sys.argv:
    checkpoints = os.path.join(stage, "checkpoints")
    held = sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else []
    run = os.path.join("runs", sys.argv[sys.argv.index("--run_name") + 1])
    if held and "--resume" not in sys.argv:
        sys.exit(f"FileExistsError: --output_dir {stage} holds checkpoints of an earlier run")
    if "--resume" in sys.argv and not held:
        sys.exit(f"FileNotFoundError: --resume: no checkpoint in {checkpoints}")
    if not held and os.path.isdir(run):
        sys.exit(f"FileExistsError: {run} already holds a run's logs")
    os.makedirs(run, exist_ok=True)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"resumed_from": held[-1] if held else None}) + "\\n")
    if stage in os.environ.get("STOP_STAGES", "").split():
        import signal
        stopped = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: stopped.append(signum))
        os.makedirs(stage, exist_ok=True)
        with open(os.path.join(stage, "pid"), "w") as f:
            f.write(str(os.getpid()))
        event("waiting")
        deadline = time.time() + 30
        while not stopped and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(float(os.environ.get("STOP_SECONDS", "0")))
        os.makedirs(os.path.join(checkpoints, "update-0000003"))
        event("stopped")
        sys.exit(75)
if stage and stage == os.environ.get("SLOW_STAGE"):
    time.sleep(1)
if stage and stage == os.environ.get("FAILING_STAGE"):
    sys.exit(1)
if "summarize_from_feedback_details.check_gpu" in sys.argv and os.environ.get("GPU_PROBLEM"):
    print(os.environ["GPU_PROBLEM"], file=sys.stderr)
    sys.exit(1)
if "--output_dir" in sys.argv:
    out = sys.argv[sys.argv.index("--output_dir") + 1]
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "model.safetensors"), "w").close()
    if "--sizes" in sys.argv:  # tiny_models: a folder per size
        prefix = {"gpt_neox": "pythia"}.get(sys.argv[sys.argv.index("--arch") + 1], sys.argv[sys.argv.index("--arch") + 1])
        os.makedirs(os.path.join(out, prefix + "-tiny-" + sys.argv[sys.argv.index("--sizes") + 1]), exist_ok=True)
event("end")
"""


def executable(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def checkout(tmp_path):
    shutil.copy(os.path.join(ROOT, "hello_world.sh"), tmp_path / "hello_world.sh")
    shutil.copytree(os.path.join(ROOT, "sbatches"), tmp_path / "sbatches")  # the tiny default's settings
    copy_registry(tmp_path)
    for name in (".venv/bin/python", ".venv/bin/accelerate", "bin/make"):
        executable(tmp_path / name, RECORDER)
    return tmp_path


def copy_registry(checkout):
    """The registry of methods, which hello_world.sh and the sbatch files read (sbatches/methods.sh)."""
    (checkout / "summarize_from_feedback_details").mkdir(exist_ok=True)
    shutil.copy(os.path.join(ROOT, "summarize_from_feedback_details", "methods.tsv"),
                checkout / "summarize_from_feedback_details" / "methods.tsv")


def run(checkout, gpus, *flags, **env):
    (checkout / "bin/nvidia-smi").unlink(missing_ok=True)
    if gpus:  # none: a machine without nvidia-smi
        executable(checkout / "bin/nvidia-smi", "#!/bin/sh\n" + "".join(f"echo 'GPU {i}: H100'\n" for i in range(gpus)))
    record = checkout / "record.jsonl"
    record.unlink(missing_ok=True)
    # one stage at a time unless a test says otherwise: the call order is then fixed
    environment = {"PATH": f"{checkout / 'bin'}:/usr/bin:/bin", "RECORD": str(record), "HOME": str(checkout),
                   "SIDE_BY_SIDE": "0", **env}
    result = subprocess.run([BASH, "hello_world.sh", *flags], cwd=checkout, env=environment, capture_output=True,
                            text=True, timeout=60)
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return result, calls


def flag(call, name):
    return call[call.index(name) + 1]


def stage_calls(calls, script):
    return [c for c in calls if any(arg.endswith(script) for arg in c)]


@pytest.mark.parametrize("gpus", [8, 1])
def test_real_pipeline_keeps_the_paper_batch_sizes(checkout, gpus):
    result, calls = run(checkout, gpus, MODEL="EleutherAI/pythia-1b-deduped")
    assert result.returncode == 0, result.stderr
    (data,) = stage_calls(calls, "tldr_dataset.py")
    # the hub data with the paper's lengths, tokenized for the model
    assert flag(data, "--base_model") == "EleutherAI/pythia-1b-deduped" and not any("params" in a for a in data)
    out = "models/hello_world_pythia-1b-deduped"
    for script, batch in (("sft.py", 128), ("reward.py", 64), ("ppo_left_padding.py", 512), ("dpo.py", 64)):
        (call,) = stage_calls(calls, script)
        assert call[:6] == ["accelerate", "launch", "--config_file", "deepspeed.yaml", "--num_processes", str(gpus)]
        assert {"--deepspeed", "--run_eval"} <= set(call) and "--lr" not in call and "--track" not in call
        assert int(flag(call, "--local_micro_batch_size")) * int(flag(call, "--gradient_accumulation_steps")) * gpus == batch
        assert flag(call, "--query_dataset") == "data/pythia-1b-deduped/sft"
    # the paper's learning rate is each stage's default
    assert sft.Args.lr == reward.Args.lr == ppo_left_padding.Args.lr == dpo.Args.lr == 3e-6
    (dpo_call,) = stage_calls(calls, "dpo.py")
    assert flag(dpo_call, "--sft_model_path") == f"{out}/sft" and flag(dpo_call, "--output_dir") == f"{out}/dpo"
    assert dpo.Args.beta == 0.05 and dpo.Args.num_train_epochs == 1 and "--offload" not in dpo_call
    (rm,) = stage_calls(calls, "reward.py")
    assert flag(rm, "--sft_model_path") == f"{out}/sft"
    (ppo,) = stage_calls(calls, "ppo_left_padding.py")
    assert (flag(ppo, "--sft_model_path"), flag(ppo, "--reward_model_path")) == (f"{out}/sft", f"{out}/reward_model")
    assert "--offload" not in ppo and ppo_left_padding.Args.total_episodes == 1_000_000
    (report,) = [c for c in calls if "summarize_from_feedback_details.hello_world_report" in c]
    assert "--no_gold_judge" in report and flag(report, "--models_dir") == out
    # no gold judge for real data, and no chat judge without a key
    assert stage_calls(calls, "eval/sft_rm_scale.py") and not stage_calls(calls, "eval/rlhf_scaling_plot.py")
    assert "set OPENAI_API_KEY" in result.stdout


def test_real_pipeline_knobs_and_errors(checkout):
    result, calls = run(checkout, 2, MODEL="EleutherAI/pythia-2.8b-deduped", PPO_MICRO_BATCH="4", PPO_OFFLOAD="1",
                        TRACK="1")
    assert result.returncode == 0, result.stderr
    (ppo,) = stage_calls(calls, "ppo_left_padding.py")
    assert flag(ppo, "--gradient_accumulation_steps") == "64" and {"--offload", "--track"} <= set(ppo)
    (dpo_call,) = stage_calls(calls, "dpo.py")  # the same offload of its frozen reference
    assert flag(dpo_call, "--gradient_accumulation_steps") == "4" and {"--offload", "--track"} <= set(dpo_call)
    _, calls = run(checkout, 2, MODEL="EleutherAI/pythia-2.8b-deduped", OPENAI_API_KEY="key", JUDGE_MODEL="judge")
    (judge,) = stage_calls(calls, "eval/rlhf_scaling_plot.py")
    assert (flag(judge, "--judge"), flag(judge, "--chat.model")) == ("chat", "judge")
    assert flag(judge, "--run_glob") == "hello_world_pythia-2.8b-deduped_*"
    # a micro batch that cannot make the paper's batch is refused before anything runs
    shutil.rmtree(checkout / "models")
    result, calls = run(checkout, 8, MODEL="EleutherAI/pythia-2.8b-deduped", SFT_MICRO_BATCH="24")
    assert result.returncode == 2 and "batch 128 is not a multiple of micro batch 24 x 8 GPUs" in result.stderr
    assert not stage_calls(calls, ".py")
    result, _ = run(checkout, 0, MODEL="EleutherAI/pythia-1b-deduped")
    assert result.returncode == 2 and "needs GPUs" in result.stderr


def test_gpus_that_torch_cannot_see_stop_the_real_pipeline(checkout):
    """check_gpu fails (nvidia-smi lists GPUs, torch sees none): the real pipeline stops with its
    reason before any stage; the embedded default runs on the CPU, saying so."""
    problem = "nvidia-smi lists 8 GPU(s) (H100, driver 535.104.05) but torch sees none: torch is a CPU build"
    result, calls = run(checkout, 8, MODEL="EleutherAI/pythia-1b-deduped", GPU_PROBLEM=problem)
    assert result.returncode == 2 and f"error: {problem}" in result.stderr and not stage_calls(calls, ".py")
    assert ["python", "-m", "summarize_from_feedback_details.check_gpu"] in calls
    result, calls = run(checkout, 8, GPU_PROBLEM=problem)
    assert result.returncode == 0, result.stderr
    assert f"warning: {problem}; the embedded default runs on the CPU" in result.stdout
    assert len(stage_calls(calls, "sft.py")) == 2


def test_gpu_count_honours_cuda_visible_devices(checkout):
    def processes(**env):
        shutil.rmtree(checkout / "models", ignore_errors=True)
        result, calls = run(checkout, 4, MODEL="EleutherAI/pythia-1b-deduped", **env)
        assert result.returncode == 0, result.stderr
        counts = {flag(call, "--num_processes") for call in calls if call[0] == "accelerate"}
        assert len(counts) == 1 and len(stage_calls(calls, ".py")) >= 3
        return int(counts.pop())

    # nvidia-smi -L lists 4 GPUs: all of them unless CUDA_VISIBLE_DEVICES narrows them down
    assert processes() == 4
    assert processes(CUDA_VISIBLE_DEVICES="0,1") == 2
    assert processes(CUDA_VISIBLE_DEVICES="GPU-3f2a,1,") == 2
    assert processes(CUDA_VISIBLE_DEVICES="0,1", NUM_GPUS="1") == 1  # NUM_GPUS still wins
    # set but empty, or -1 (CUDA stops at the first invalid entry): no GPU at all
    for hidden in ("", "-1"):
        result, calls = run(checkout, 4, MODEL="EleutherAI/pythia-1b-deduped", CUDA_VISIBLE_DEVICES=hidden)
        assert result.returncode == 2 and "needs GPUs" in result.stderr and not stage_calls(calls, ".py")


def test_finished_stages_are_skipped_and_force_reruns(checkout):
    result, first = run(checkout, 0)
    assert result.returncode == 0, result.stderr
    # the embedded default: one process, no accelerate; the RM on the all-token SFT, PPO on the other
    assert not [c for c in first if c[0] == "accelerate"]
    (rm,) = stage_calls(first, "reward.py")
    assert flag(rm, "--sft_model_path") == "models/hello_world/sft_all_tokens"
    (ppo,) = stage_calls(first, "ppo_left_padding.py")
    assert flag(ppo, "--sft_model_path") == "models/hello_world/sft" and flag(ppo, "--total_episodes") == str(15 * 64)
    (dpo_call,) = stage_calls(first, "dpo.py")  # DPO from the policy's SFT, like PPO
    assert flag(dpo_call, "--sft_model_path") == "models/hello_world/sft"
    backbone, policy = stage_calls(first, "sft.py")
    assert "--run_eval" not in backbone and "--run_eval" in policy  # nothing samples the RM's backbone
    (tokenize,) = stage_calls(first, "tldr_dataset.py")  # its output does not depend on --num_proc
    assert int(flag(tokenize, "--num_proc")) == len(os.sched_getaffinity(0))
    # the base model of the size it uses, nothing more (scaling.sh adds the others)
    (base,) = [c for c in first if "summarize_from_feedback_details.tiny_models" in c]
    assert flag(base, "--sizes") == "m" and flag(base, "--output_dir") == "models/tiny"
    # the base model also reads the data stage's posts that end in a TL;DR (docs/scaling.md)
    (data,) = [c for c in first if "summarize_from_feedback_details.synthetic_tldr" in c]
    assert flag(data, "--num_pretrain_posts") == "18000"
    assert flag(base, "--extra_corpus") == "data/raw/pretrain/train.jsonl"
    # GPT-NeoX's base reads the first 6,000 of them, its base of before (docs/real_pipeline.md)
    assert flag(base, "--extra_corpus_rows") == "6000"
    # DPO takes one pass over 6000 of the preference pairs, whatever their number
    assert flag(dpo_call, "--total_episodes") == "6000"
    # plots of this run's folders only, with the gold judge
    for script in ("eval/sft_rm_scale.py", "eval/rlhf_scaling_plot.py"):
        (call,) = stage_calls(first, script)
        assert (flag(call, "--run_glob"), flag(call, "--out")) == ("hello_world_*", "eval/images/hello_world")
    assert flag(stage_calls(first, "eval/rlhf_scaling_plot.py")[0], "--judge") == "gold"
    result, second = run(checkout, 0)
    assert result.returncode == 0 and result.stdout.count("exists, skipping") == 8
    assert not stage_calls(second, "sft.py") and not stage_calls(second, "ppo_left_padding.py")
    assert not stage_calls(second, "dpo.py")
    _, forced = run(checkout, 0, "--force")
    assert len(stage_calls(forced, "sft.py")) == 2 and len(stage_calls(forced, "ppo_left_padding.py")) == 1
    assert len(stage_calls(forced, "dpo.py")) == 1


def cores(checkout, count):
    """This machine's cores, as nproc reports them to the script."""
    executable(checkout / "bin/nproc", f"#!/bin/sh\necho {count}\n")


def events(checkout):
    """(start or end, the training stage's model folder under models/hello_world, OMP_NUM_THREADS,
    TAKE_CORES_AT)"""
    lines = [json.loads(line) for line in (checkout / "events.jsonl").read_text().splitlines()]
    out = "models/hello_world/"
    return [(what, stage.removeprefix(out), *env) for what, stage, *env in lines if stage.startswith(out)]


def test_the_policy_chain_runs_beside_the_reward_model_chain_on_a_cpu(checkout):
    """On a CPU of 4 cores, the policy's SFT and DPO run in the background beside the reward model's
    SFT and the reward model, each chain on 2 threads; the reward model alone takes all 4, at the end
    of its update 375 (two per DPO update: 6000 pairs at batch 32), once the other chain's marker is
    gone (without DPO, at its start); PPO waits for both and gets every core."""
    cores(checkout, 4)
    result, calls = run(checkout, 0, SIDE_BY_SIDE="1", EVENTS=str(checkout / "events.jsonl"),
                        SLOW_STAGE="models/hello_world/dpo")
    assert result.returncode == 0, result.stderr
    seen = events(checkout)
    threads = {stage: omp for what, stage, omp, _ in seen if what == "start"}
    assert threads == {"sft": "2", "dpo": "2", "sft_all_tokens": "2", "reward_model": "2", "ppo": None}
    take = {stage: cores_spec for what, stage, _, cores_spec in seen if what == "start"}
    assert {stage for stage, cores_spec in take.items() if cores_spec} == {"reward_model"}
    count, side_marker, update = take["reward_model"].split(" ")
    assert count == "4" and side_marker.endswith("/side") and update == "375"
    assert not os.path.exists(os.path.dirname(side_marker))  # the markers go with the run
    order = [(what, stage) for what, stage, _, _ in seen]
    for before, after in ((("end", "sft"), ("start", "dpo")), (("end", "sft_all_tokens"), ("start", "reward_model")),
                          (("end", "dpo"), ("start", "ppo")), (("end", "reward_model"), ("start", "ppo"))):
        assert order.index(before) < order.index(after)
    assert order.index(("start", "reward_model")) < order.index(("end", "dpo"))  # side by side
    log = checkout / "runs/hello_world_side_by_side.log"
    assert f"output: {log.relative_to(checkout)}" in result.stdout and "== dpo.py done in" in log.read_text()
    assert "==   dpo.py done in" in result.stdout  # the side chain's stages, listed when it is done
    # ALGOS without dpo: the policy's SFT alone beside the reward model's chain
    (checkout / "events.jsonl").unlink()
    result, _ = run(checkout, 0, "--force", SIDE_BY_SIDE="1", ALGOS="ppo", EVENTS=str(checkout / "events.jsonl"))
    assert result.returncode == 0 and "sft_policy in the background" in result.stdout and "dpo" not in log.read_text()
    assert [cores_spec.split(" ")[-1] for what, stage, _, cores_spec in events(checkout)
            if what == "start" and stage == "reward_model"] == ["0"]


@pytest.mark.parametrize("setting", ["SIDE_BY_SIDE=0", "OMP_NUM_THREADS=1", "one core", "a GPU"])
def test_one_stage_at_a_time(checkout, setting):
    """SIDE_BY_SIDE=0, OMP_NUM_THREADS set by the caller (a sweep's parallel runs), one core, or a GPU
    that runs the stages: the stages run one after another in the order of the script."""
    cores(checkout, 1 if setting == "one core" else 4)
    env = {"SIDE_BY_SIDE": "1", "EVENTS": str(checkout / "events.jsonl")}
    if "=" in setting:
        env.update([setting.split("=")])
    result, calls = run(checkout, 1 if setting == "a GPU" else 0, **env)
    assert result.returncode == 0, result.stderr
    seen = events(checkout)
    stages = [stage for what, stage, _, _ in seen if what == "start"]
    assert stages == ["sft_all_tokens", "sft", "reward_model", "ppo", "dpo"]
    assert [what for what, _, _, _ in seen] == ["start", "end"] * 5
    assert {omp for _, _, omp, _ in seen} == {"1" if setting == "OMP_NUM_THREADS=1" else None}
    assert {cores_spec for _, _, _, cores_spec in seen} == {None}
    assert not (checkout / "runs/hello_world_side_by_side.log").exists()


def test_a_failure_in_either_chain_stops_the_run(checkout):
    """A failed side stage fails the run after the reward model's chain, with its output's last lines,
    and nothing after runs; a failed reward model stops the side chain at once."""
    cores(checkout, 2)
    (checkout / "tmp").mkdir()  # where the chains' marker files go (mktemp)
    result, calls = run(checkout, 0, SIDE_BY_SIDE="1", FAILING_STAGE="models/hello_world/dpo",
                        TMPDIR=str(checkout / "tmp"))
    assert result.returncode == 1 and "error: the stages beside failed" in result.stderr
    assert not list((checkout / "tmp").iterdir())
    assert "== dpo.py" in result.stderr and not stage_calls(calls, "ppo_left_padding.py")
    shutil.rmtree(checkout / "models")
    started = time.monotonic()
    result, calls = run(checkout, 0, SIDE_BY_SIDE="1", EVENTS=str(checkout / "events.jsonl"),
                        FAILING_STAGE="models/hello_world/reward_model", SLOW_STAGE="models/hello_world/sft",
                        TMPDIR=str(checkout / "tmp"))
    assert result.returncode != 0 and not stage_calls(calls, "ppo_left_padding.py")
    assert not list((checkout / "tmp").iterdir())
    time.sleep(max(0.0, 2 - (time.monotonic() - started)))  # past the end of the slow stage, had it lived
    assert [what for what, stage, _, _ in events(checkout) if stage == "sft"] == ["start"]
    assert not stage_calls(calls, "dpo.py")


def resumed_from(checkout, stage):
    """What each run of a stage into runs/hello_world_<stage> resumed from (None: it started afresh)."""
    lines = (checkout / f"runs/hello_world_{stage}/metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["resumed_from"] for line in lines]


def start_until_stages_wait(checkout, environment, count):
    """hello_world.sh started in a session of its own (the process group a terminal's Ctrl-C reaches),
    once `count` of its STOP_STAGES wait for a signal."""
    script = subprocess.Popen([BASH, "hello_world.sh"], cwd=checkout, env=environment, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 30
    while len([1 for what, *_ in (events(checkout) if (checkout / "events.jsonl").exists() else [])
               if what == "waiting"]) < count:
        assert time.monotonic() < deadline and script.poll() is None, script.communicate()
        time.sleep(0.05)
    return script


def test_an_interrupted_run_resumes_its_stopped_stages_when_rerun(checkout):
    """Ctrl-C while the reward model trains beside DPO (the whole foreground process group gets SIGINT,
    as from a terminal): both stages write a checkpoint and exit 75, and so does the script, having
    waited for the stage beside. The same command again resumes both (--resume, their run folders
    kept), runs the rest, and deletes the checkpoints of the finished stages; --force instead
    discards a checkpoint and starts that stage over."""
    cores(checkout, 2)
    record, events_file = checkout / "record.jsonl", checkout / "events.jsonl"
    environment = {"PATH": f"{checkout / 'bin'}:/usr/bin:/bin", "RECORD": str(record), "HOME": str(checkout),
                   "SIDE_BY_SIDE": "1", "EVENTS": str(events_file),
                   "STOP_STAGES": "models/hello_world/reward_model models/hello_world/dpo"}
    script = start_until_stages_wait(checkout, environment, 2)
    os.killpg(script.pid, signal.SIGINT)
    stdout, stderr = script.communicate(timeout=30)
    assert script.returncode == 75, stderr
    assert {stage for what, stage, *_ in events(checkout) if what == "stopped"} == {"reward_model", "dpo"}
    for stage in ("reward_model", "dpo"):
        assert (checkout / f"models/hello_world/{stage}/checkpoints/update-0000003").is_dir()
    assert "== reward stopped with a checkpoint in models/hello_world/reward_model/checkpoints: rerun" in stderr
    assert not (checkout / "models/hello_world/ppo").exists()

    result, calls = run(checkout, 0, SIDE_BY_SIDE="1")
    assert result.returncode == 0, result.stderr
    for stage, run_folder in (("reward_model", "reward"), ("dpo", "dpo")):
        assert f"== resuming the run stopped at models/hello_world/{stage}/checkpoints/update-0000003" in \
            result.stdout + (checkout / "runs/hello_world_side_by_side.log").read_text()
        assert resumed_from(checkout, run_folder) == [None, "update-0000003"]  # one run folder, continued
        assert not (checkout / f"models/hello_world/{stage}/checkpoints").exists()
    # the stopped run's side-by-side log is kept beside the new one (whether it got to say that its stage
    # stopped depends on which signal reached that stage last: test_a_stopped_stage_stops_the_chain_beside...)
    assert "== dpo.py\n" in (checkout / "runs/hello_world_side_by_side.previous.log").read_text()
    (rm,), (dpo_call,), (ppo,) = (stage_calls(calls, s) for s in ("reward.py", "dpo.py", "ppo_left_padding.py"))
    assert rm[-1] == dpo_call[-1] == "--resume" and "--resume" not in ppo
    assert not stage_calls(calls, "sft.py")  # finished before the stop: skipped

    # --force: a stopped stage's checkpoint is discarded, said so, and the stage starts over
    (checkout / "models/hello_world/ppo/checkpoints/update-0000002").mkdir(parents=True)
    result, calls = run(checkout, 0, "--force", ALGOS="ppo")
    assert result.returncode == 0, result.stderr
    assert ("== --force: discarding the checkpoints of an earlier run in models/hello_world/ppo/checkpoints "
            "(newest: update-0000002)") in result.stdout
    assert all("--resume" not in call for call in calls) and resumed_from(checkout, "ppo") == [None]


def test_a_stopped_stage_stops_the_chain_beside_after_its_checkpoint(checkout):
    """SIGTERM to the reward model's stage alone (a failure or a stop in that chain): the script stops the
    stage beside with SIGTERM and exits only once that stage has written its checkpoint (it takes a
    second here), so that a rerun finds the checkpoint and the folder free."""
    cores(checkout, 2)
    environment = {"PATH": f"{checkout / 'bin'}:/usr/bin:/bin", "RECORD": str(checkout / "record.jsonl"),
                   "HOME": str(checkout), "SIDE_BY_SIDE": "1", "EVENTS": str(checkout / "events.jsonl"),
                   "STOP_STAGES": "models/hello_world/reward_model models/hello_world/dpo", "STOP_SECONDS": "1"}
    script = start_until_stages_wait(checkout, environment, 2)
    os.kill(int((checkout / "models/hello_world/reward_model/pid").read_text()), signal.SIGTERM)
    _, stderr = script.communicate(timeout=30)
    assert script.returncode == 75 and "== stopping the stage beside (pid" in stderr
    assert (checkout / "models/hello_world/dpo/checkpoints/update-0000003").is_dir()
    # the chain beside logged where its stage stopped, and started nothing after it
    log = (checkout / "runs/hello_world_side_by_side.log").read_text()
    assert "== dpo stopped with a checkpoint in models/hello_world/dpo/checkpoints" in log


def test_a_stage_that_cannot_resume_says_what_force_does(checkout):
    """A checkpoint the stage refuses (another run's settings; here: a stage that fails) fails the run
    naming the checkpoint and how to start over."""
    (checkout / "models/hello_world/reward_model/checkpoints/update-0000001").mkdir(parents=True)
    result, _ = run(checkout, 0, FAILING_STAGE="models/hello_world/reward_model")
    assert result.returncode == 1
    assert ("== reward failed resuming models/hello_world/reward_model/checkpoints/update-0000001; "
            "--force discards that checkpoint and starts over") in result.stderr


def test_data_only(checkout):
    result, calls = run(checkout, 0, "--data")
    assert result.returncode == 0, result.stderr
    assert calls[1] == ["python", "-m", "summarize_from_feedback_details.check_gpu"]  # after make install
    assert [c[2] if c[1] == "-m" else c[1] for c in calls[2:]] == [
        "summarize_from_feedback_details.synthetic_tldr", *["summarize_from_feedback_details.tiny_models"] * 3,
        "summarize_from_feedback_details/tldr_dataset.py"]
    # every size, one at a time (the sweeps and the sbatch chain read them); none twice
    assert [flag(c, "--sizes") for c in calls[3:6]] == ["s", "m", "l"]
    result, calls = run(checkout, 0, "--data")
    assert result.returncode == 0 and not [c for c in calls if "summarize_from_feedback_details.tiny_models" in c]
    # the data kept was generated with the default's flags, or the run stops (synthetic_tldr.check_recorded_args)
    (check,) = [c for c in calls if c[1] == "-c"]
    assert "check_recorded_args(sys.argv[1:])" in check[2] and check[3:5] == ["--output_dir", "data/raw"]
    assert flag(check, "--fact_swap_fraction") == "0.6" and flag(check, "--seed") == "1"
    result, calls = run(checkout, 0, "--data", FAILING_STAGE="data/raw")
    assert result.returncode == 2 and calls[-1][1] == "-c"
    result, _ = run(checkout, 8, "--data", MODEL="EleutherAI/pythia-1b-deduped")
    assert result.returncode == 2 and "leave MODEL unset" in result.stderr


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_arch_builds_the_embedded_default_in_its_own_folders(checkout, arch):
    """ARCH=llama (or qwen3): its tiny base model, tokenized datasets, models and runs apart from the
    Pythia default's (another tokenizer: nothing may be shared)."""
    result, calls = run(checkout, 0, ARCH=arch)
    assert result.returncode == 0, result.stderr
    (build,) = [c for c in calls if "summarize_from_feedback_details.tiny_models" in c]
    assert flag(build, "--arch") == arch and flag(build, "--output_dir") == f"models/tiny_{arch}"
    assert flag(build, "--sizes") == "m"
    # the pretraining budget at which the family's SFT copies the post's relation (docs/real_pipeline.md)
    assert flag(build, "--pretrain_tokens_per_parameter") == {"llama": "12", "qwen3": "6"}[arch]
    # the Llama-style base reads three times the TL;DR posts and is pretrained again from the next seed
    # until it copies the post's feeling and duration
    copy_check = build[build.index("--copy_check") + 1:] if "--copy_check" in build else []
    assert copy_check == {"llama": ["feeling", "duration"], "qwen3": []}[arch]
    assert flag(build, "--extra_corpus_rows") == {"llama": "18000", "qwen3": "6000"}[arch]
    (data,) = stage_calls(calls, "tldr_dataset.py")
    assert flag(data, "--base_model") == f"models/tiny_{arch}/{arch}-tiny-m" and flag(data, "--output_dir") == f"data/tldr_{arch}"
    sft_calls = stage_calls(calls, "sft.py")
    assert len(sft_calls) == 2 and all(flag(c, "--base_model") == f"models/tiny_{arch}/{arch}-tiny-m" for c in sft_calls)
    assert all(flag(c, "--query_dataset") == f"data/tldr_{arch}/sft" for c in sft_calls)
    (rm,) = stage_calls(calls, "reward.py")
    # every architecture alike since the Qwen3-style one's eight epochs (docs/real_pipeline.md, measured per arch)
    assert (flag(rm, "--lr"), flag(rm, "--num_train_epochs")) == ("3e-4", "8")
    (ppo,) = stage_calls(calls, "ppo_left_padding.py")
    assert flag(ppo, "--output_dir") == f"models/hello_world_{arch}/ppo"
    assert flag(ppo, "--reward_model_path") == f"models/hello_world_{arch}/reward_model"
    result, calls = run(checkout, 0)  # the default: Pythia's folders, built with --arch gpt_neox
    (build,) = [c for c in calls if "summarize_from_feedback_details.tiny_models" in c]
    assert flag(build, "--arch") == "gpt_neox" and flag(build, "--output_dir") == "models/tiny"
    # GPT-NeoX takes the Llama-style recipe (docs/real_pipeline.md, "GPT-NeoX's pretraining budget ...")
    assert flag(build, "--pretrain_tokens_per_parameter") == "12" and "--copy_check" not in build
    assert (flag(stage_calls(calls, "reward.py")[0], "--lr"), flag(stage_calls(calls, "reward.py")[0], "--num_train_epochs")) == ("3e-4", "8")
    result, calls = run(checkout, 0, ARCH="mamba")
    assert result.returncode == 2 and "ARCH: 'mamba' is none of: gpt_neox llama qwen3" in result.stderr and not calls


def test_own_flags_reach_their_stages_last_and_name_separates_the_run(checkout):
    """NAME=lora_hello_world PPO_FLAGS=... (docs/lora.md's LoRA example): PPO alone gets the flags, after
    its own (so --lr wins), EXTRA_FLAGS reaches every training stage, and the models, runs and plots
    go under the new name; on the GPU path too."""
    result, calls = run(checkout, 0, NAME="lora_hello_world", PPO_FLAGS="--use_peft --lr 3e-4",
                        EXTRA_FLAGS="--gradient_checkpointing")
    assert result.returncode == 0, result.stderr
    (ppo,) = stage_calls(calls, "ppo_left_padding.py")
    assert ppo[-3:] == ["--use_peft", "--lr", "3e-4"] and ppo.count("--lr") == 2
    assert flag(ppo, "--output_dir") == "models/lora_hello_world/ppo" and flag(ppo, "--run_name") == "lora_hello_world_ppo"
    training = [c for script in ("sft.py", "reward.py", "ppo_left_padding.py", "dpo.py") for c in stage_calls(calls, script)]
    assert len(training) == 5 and all("--gradient_checkpointing" in c for c in training)
    assert not [c for c in training if "--use_peft" in c and c is not ppo]
    (plot,) = stage_calls(calls, "eval/rlhf_scaling_plot.py")
    assert flag(plot, "--run_glob") == "lora_hello_world_*"
    result, calls = run(checkout, 8, MODEL="EleutherAI/pythia-1b-deduped", DPO_FLAGS="--beta 0.1")
    assert result.returncode == 0, result.stderr
    (dpo_call,) = stage_calls(calls, "dpo.py")
    assert dpo_call[-2:] == ["--beta", "0.1"] and dpo_call[0] == "accelerate"


def last_flag(call, name):
    """The value of a flag's last occurrence: the one tyro takes."""
    return call[len(call) - 1 - call[::-1].index(name) + 1]


def calls_of(calls, script):
    """The calls of `script` by its file name (stage_calls would count online_dpo.py as dpo.py)."""
    return [c for c in calls if any(os.path.basename(arg) == script for arg in c)]


def test_algos_chooses_the_methods_after_the_reward_model(checkout):
    """ALGOS=ppo (what scaling.sh passes): no dpo.py; ALGOS=all (compare.sh): RLOO with k=2 and 4,
    GRPO and online DPO beside PPO and DPO, each at PPO's 30 x 64 episodes in its own folders under its
    own exp_name, with its own flags last; a name it does not know is refused."""
    result, calls = run(checkout, 0, ALGOS="ppo")
    assert result.returncode == 0, result.stderr
    assert not calls_of(calls, "dpo.py") and len(calls_of(calls, "ppo_left_padding.py")) == 1
    assert not calls_of(calls, "rloo.py") + calls_of(calls, "online_dpo.py")
    assert len(stage_calls(calls, "eval/rlhf_scaling_plot.py")) == 1
    result, calls = run(checkout, 0, "--force", ALGOS="all", RLOO_FLAGS="--kl_coef 0.1", ONLINE_DPO_FLAGS="--beta 0.2")
    assert result.returncode == 0, result.stderr
    assert len(calls_of(calls, "dpo.py")) == 1 and len(calls_of(calls, "ppo_left_padding.py")) == 3  # the controls' too
    rloo, rloo_k4, grpo = calls_of(calls, "rloo.py")
    (online,) = calls_of(calls, "online_dpo.py")
    for call, name, k in ((rloo, "rloo", 2), (rloo_k4, "rloo_k4", 4), (grpo, "grpo", 4), (online, "online_dpo", 2)):
        assert flag(call, "--output_dir") == f"models/hello_world/{name}" and flag(call, "--run_name") == f"hello_world_{name}"
        assert flag(call, "--sft_model_path") == "models/hello_world/sft"
        assert flag(call, "--reward_model_path") == "models/hello_world/reward_model"
        assert flag(call, "--total_episodes") == str(15 * 64)
        # 64 episodes per update: queries x k = micro 16 x accumulation 4, generated in one chunk of queries
        assert (flag(call, "--local_micro_batch_size"), flag(call, "--gradient_accumulation_steps")) == ("16", "4")
        assert flag(call, "--local_rollout_forward_batch_size") == str(64 // k)
        assert name == "rloo" or call.count("--exp_name") == (name != "online_dpo")
    assert "--rloo_k" not in rloo and flag(rloo_k4, "--rloo_k") == flag(grpo, "--rloo_k") == "4"
    assert flag(grpo, "--algorithm") == "grpo" and flag(grpo, "--exp_name") == "grpo"
    assert flag(rloo_k4, "--exp_name") == "rloo_k4"
    assert all(c[-2:] == ["--kl_coef", "0.1"] for c in (rloo, rloo_k4, grpo)) and online[-2:] == ["--beta", "0.2"]
    # the critic-free methods' steps per batch (tiny_default.sh), after PPO's flags: RLOO and GRPO two epochs at
    # PPO's lr; online DPO one step at twice it (the later --lr wins, as in tyro)
    for call in (rloo, rloo_k4, grpo):
        assert flag(call, "--noptepochs") == "2" and call.count("--lr") == 1 and flag(call, "--lr") == "1e-4"
    assert (flag(online, "--lr"), last_flag(online, "--lr")) == ("1e-4", "2e-4") and "--noptepochs" not in online
    # the control: a reward model that is never trained (its seeded random head, normalised) and PPO
    # against it with PPO's flags, in folders of their own
    rm, control_rm = calls_of(calls, "reward.py")
    assert flag(control_rm, "--total_episodes") == "0" and flag(control_rm, "--exp_name") == "reward_control"
    shared = rm[:rm.index("--output_dir")]
    assert control_rm[:len(shared)] == shared
    ppo, control, null = calls_of(calls, "ppo_left_padding.py")
    assert flag(control, "--reward_model_path") == "models/hello_world/reward_model_control"
    assert (flag(control, "--exp_name"), flag(control, "--output_dir")) == ("ppo_control", "models/hello_world/ppo_control")
    assert control[:control.index("--reward_model_path")] == ppo[:ppo.index("--reward_model_path")]
    # the null control: PPO's flags against the trained reward model, its scores dealt at random, the critic at 0
    assert null[:null.index("--exp_name")] == ppo[:ppo.index("--output_dir")] + ["--negative_control", "reward_and_critic"]
    assert (flag(null, "--exp_name"), flag(null, "--output_dir")) == ("ppo_null_control", "models/hello_world/ppo_null_control")
    result, calls = run(checkout, 8, MODEL="EleutherAI/pythia-1b-deduped", ALGOS="rloo_k4 online_dpo")
    assert result.returncode == 0, result.stderr
    assert not calls_of(calls, "ppo_left_padding.py") and not calls_of(calls, "dpo.py")
    (rloo_k4,) = calls_of(calls, "rloo.py")
    (online,) = calls_of(calls, "online_dpo.py")
    assert "--noptepochs" not in rloo_k4 and "--lr" not in online  # the tiny default's steps stay there
    for call, k in ((rloo_k4, 4), (online, 2)):  # the paper's 512 episodes over 8 GPUs
        assert call[0] == "accelerate" and flag(call, "--num_processes") == "8"
        micro, accumulation = int(flag(call, "--local_micro_batch_size")), int(flag(call, "--gradient_accumulation_steps"))
        assert micro * accumulation * 8 == 512 and micro % 2 == 0
        assert flag(call, "--local_rollout_forward_batch_size") == str(min(64, 512 // 8 // k))
    result, _ = run(checkout, 0, ALGOS="ppo reinforce")
    assert result.returncode == 2 and "ALGOS: 'reinforce' is none of" in result.stderr


# stands in for hello_world.sh in scaling.sh's tests: records the environment it was started with
HELLO_WORLD_RECORDER = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    env = {k: os.environ.get(k) for k in ("NAME", "MODEL", "SEED", "ALGOS")}
    env.update({k: os.environ[k] for k in ("ARCH", "SIZES") if k in os.environ})  # compare.sh's only
    f.write(json.dumps(["hello_world.sh", *sys.argv[1:], env]) + "\\n")
"""


@pytest.fixture
def scaling_checkout(tmp_path):
    for name in ("scaling.sh", "compare.sh", "sweep_args.sh", "sbatches/tiny_default.sh"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    executable(tmp_path / "hello_world.sh", HELLO_WORLD_RECORDER)
    executable(tmp_path / ".venv/bin/python", RECORDER)
    for size in "sml":
        (tmp_path / "models/tiny" / f"pythia-tiny-{size}").mkdir(parents=True)
    (tmp_path / "models/tiny_llama/llama-tiny-m").mkdir(parents=True)
    return tmp_path


def run_scaling(checkout, *flags, **env):
    record = checkout / "record.jsonl"
    record.unlink(missing_ok=True)
    # SLURM=0 unless a test says otherwise: a machine where sinfo answers must not submit jobs
    environment = {"PATH": f"{checkout / 'bin'}:/usr/bin:/bin", "RECORD": str(record), "HOME": str(checkout),
                   "SLURM": "0", **env}
    result = subprocess.run([BASH, "scaling.sh", *flags], cwd=checkout, env=environment, capture_output=True,
                            text=True, timeout=60)
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return result, calls


def test_scaling_runs_every_size_and_seed_through_hello_world_then_the_plots(scaling_checkout):
    result, calls = run_scaling(scaling_checkout)
    assert result.returncode == 0, result.stderr
    assert calls[0] == ["hello_world.sh", "--data", {"NAME": None, "MODEL": None, "SEED": None, "ALGOS": None}]
    runs = [c[-1] for c in calls[1:10]]
    assert runs == [{"NAME": f"scaling_{size}_{seed}", "MODEL": f"models/tiny/pythia-tiny-{size}", "SEED": seed,
                     "ALGOS": "ppo"} for size in "sml" for seed in "123"]
    assert all(c[0] == "hello_world.sh" and len(c) == 2 for c in calls[1:10])  # no --force: finished stages are reused
    # then the plots over all of them, and the table from the plots' tables
    plots = calls[10:]
    assert [c[1] for c in plots] == ["eval/sft_rm_scale.py", "eval/rlhf_scaling_plot.py", "eval/scaling_table.py"]
    assert all(flag(c, "--run_glob") == "scaling_*" and flag(c, "--out") == "eval/images/scaling" and
               flag(c, "--runs_dir") == "runs" for c in plots[:2])
    assert flag(plots[1], "--judge") == "gold" and flag(plots[2], "--plots_dir") == "eval/images/scaling"


def test_scaling_sizes_seeds_force_and_errors(scaling_checkout):
    result, calls = run_scaling(scaling_checkout, "--force", SIZES="l m", SEEDS="7")
    assert result.returncode == 0, result.stderr
    assert [(c[1], c[-1]["NAME"]) for c in calls[1:3]] == [("--force", "scaling_l_7"), ("--force", "scaling_m_7")]
    for env, message in (({"SEEDS": "1 x"}, "is not a seed"), ({"SIZES": "m ../x"}, "is not a tiny size name"),
                         ({"SEEDS": " "}, "at least one size and one seed"), ({"SIZES": "xl"}, "no base model")):
        result, calls = run_scaling(scaling_checkout, **env)
        assert result.returncode == 2 and message in result.stderr, (env, result.stderr)
        assert not [c for c in calls if c[0] == "hello_world.sh" and c[-1]["NAME"]]
    result, _ = run_scaling(scaling_checkout, "--fast")
    assert result.returncode == 2 and "usage" in result.stderr


def test_scaling_checks_every_size_before_training_any(scaling_checkout):
    result, calls = run_scaling(scaling_checkout, SIZES="s xl")
    assert result.returncode == 2 and "no base model models/tiny/pythia-tiny-xl" in result.stderr
    assert [c[1] for c in calls] == ["--data"]  # tiny-s was not trained first


def test_compare_runs_every_method_per_seed_through_hello_world_then_the_table(scaling_checkout):
    """compare.sh (make compare): hello_world.sh with ALGOS=all under make scaling's names (so its SFT,
    reward model and PPO are reused), tiny-m x seeds 1 2 3 by default; then the plots and the table of
    every seed found of those sizes."""
    def run_compare(*flags, **env):
        record = scaling_checkout / "record.jsonl"
        record.unlink(missing_ok=True)
        result = subprocess.run([BASH, "compare.sh", *flags], cwd=scaling_checkout, capture_output=True, text=True,
                                env={"PATH": "/usr/bin:/bin", "RECORD": str(record), "HOME": str(scaling_checkout),
                                     **env}, timeout=60)
        return result, [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    result, calls = run_compare()
    assert result.returncode == 0, result.stderr
    assert calls[0][:2] == ["hello_world.sh", "--data"] and calls[0][-1]["SIZES"] == "m"  # only the sizes compared
    assert [c[-1] for c in calls[1:4]] == [{"NAME": f"scaling_m_{seed}", "MODEL": "models/tiny/pythia-tiny-m",
                                            "SEED": seed, "ALGOS": "all", "ARCH": "gpt_neox"} for seed in "123"]
    assert all(len(c) == 2 for c in calls[1:4])  # no --force: finished stages are reused
    plots = calls[4:]
    assert [c[1] for c in plots] == ["eval/rlhf_scaling_plot.py", "eval/compare_table.py"]
    assert all(flag(c, "--run_glob") == "scaling_[m]_*" and flag(c, "--out") == "eval/images/compare" for c in plots)
    assert flag(plots[0], "--judge") == "gold"
    result, calls = run_compare("--force", SIZES="m l", SEEDS="7")
    assert result.returncode == 0, result.stderr
    assert [(c[1], c[-1]["NAME"]) for c in calls[1:3]] == [("--force", "scaling_m_7"), ("--force", "scaling_l_7")]
    assert flag(calls[3], "--run_glob") == "scaling_[ml]_*"
    # another architecture: its base models, its own run names and plots folder, apart from Pythia's
    result, calls = run_compare(ARCH="llama", SEEDS="2")
    assert result.returncode == 0, result.stderr
    assert calls[0][-1]["ARCH"] == "llama"
    assert calls[1][-1] == {"NAME": "scaling_llama_m_2", "MODEL": "models/tiny_llama/llama-tiny-m", "SEED": "2",
                            "ALGOS": "all", "ARCH": "llama"}
    assert all(flag(c, "--run_glob") == "scaling_llama_[m]_*" and flag(c, "--out") == "eval/images/compare_llama"
               for c in calls[2:])
    for env, message in (({"SEEDS": "1 x"}, "is not a seed"), ({"SIZES": "m ../x"}, "is not a tiny size name"),
                         ({"SIZES": " "}, "at least one size and one seed"), ({"SIZES": "xl"}, "no base model"),
                         ({"ARCH": "mamba"}, "ARCH: 'mamba' is none of"),
                         ({"ARCH": "qwen3"}, "no base model models/tiny_qwen3/qwen3-tiny-m")):
        result, calls = run_compare(**env)
        assert result.returncode == 2 and message in result.stderr, (env, result.stderr)
        assert not [c for c in calls if c[0] == "hello_world.sh" and c[-1]["NAME"]]


# stand-ins for Slurm's commands in scaling.sh's tests. sbatch records its arguments and the
# environment the job would get, prints a new job id, and "runs" a PPO job at once: the PPO model of
# every seed of its grid (SEEDS) but those in FAIL_SEEDS; squeue lists the submitted jobs' tasks the
# first SQUEUE_ROUNDS times it is asked, then nothing (all finished); sinfo answers unless NO_CLUSTER.
FAKE_SBATCH = """#!/usr/bin/env python3
import json, os, sys
keys = ("MODELS", "SEEDS", "SBATCH_ARRAY_INX", "TINY", "SBATCH_GPUS_PER_TASK", "RESUME", "OUTPUT_ROOT")
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps(["sbatch", *sys.argv[1:], {k: os.environ.get(k) for k in keys}]) + "\\n")
with open(os.environ["RECORD"] + ".jobs", "a") as f:
    f.write("x\\n")
with open(os.environ["RECORD"] + ".jobs") as f:
    job = 100 + len(f.read().split())
if sys.argv[-1].endswith("ppo_left_padding.sbatch"):
    for seed in os.environ["SEEDS"].split():
        if seed in os.environ.get("FAIL_SEEDS", "").split():
            continue
        size = os.path.basename(os.environ["MODELS"])
        out = os.path.join(os.environ["OUTPUT_ROOT"], "models", size, f"ppo_{seed}")
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "model.safetensors"), "w").close()
print(f"{job};cluster")
"""
FAKE_SQUEUE = """#!/usr/bin/env python3
import os
path = os.environ["RECORD"] + ".squeue"
rounds = len(open(path).read().split()) if os.path.exists(path) else 0
with open(path, "a") as f:
    f.write("x\\n")
if rounds < int(os.environ.get("SQUEUE_ROUNDS", "2")):
    print("101 sft 0 COMPLETED")
    print("102 reward 0 RUNNING")
    print("102 reward 1 PENDING")
    print("999 someone_else 0 RUNNING")
"""
FAKE_SINFO = """#!/bin/sh
[ -z "$NO_CLUSTER" ]
"""


@pytest.fixture
def slurm_checkout(scaling_checkout):
    executable(scaling_checkout / "bin/sbatch", FAKE_SBATCH)
    executable(scaling_checkout / "bin/squeue", FAKE_SQUEUE)
    executable(scaling_checkout / "bin/sinfo", FAKE_SINFO)
    return scaling_checkout


def submissions(calls):
    return [c for c in calls if c[0] == "sbatch"]


def test_scaling_submits_the_tiny_chain_where_slurm_answers(slurm_checkout):
    result, calls = run_scaling(slurm_checkout, SLURM="auto", SIZES="s m", SEEDS="1 2", POLL_SECONDS="0")
    assert result.returncode == 0, result.stderr
    assert calls[0][:2] == ["hello_world.sh", "--data"]
    assert not [c for c in calls[1:] if c[0] == "hello_world.sh"]  # nothing trained here
    jobs = submissions(calls)
    # per size: sft -> reward -> ppo (afterany, as docs/real_pipeline.md's chain), one array task per seed
    assert [(c[-2], [a for a in c[1:-2] if a.startswith("--dependency")]) for c in jobs] == [
        ("sbatches/sft.sbatch", []), ("sbatches/reward.sbatch", ["--dependency=afterany:101"]),
        ("sbatches/ppo_left_padding.sbatch", ["--dependency=afterany:102"]),
        ("sbatches/sft.sbatch", []), ("sbatches/reward.sbatch", ["--dependency=afterany:104"]),
        ("sbatches/ppo_left_padding.sbatch", ["--dependency=afterany:105"])]
    assert all("--parsable" in c and "sbatches/dpo.sbatch" not in c for c in jobs)
    for c, size in zip(jobs, "sssmmm"):
        assert c[-1] == {"MODELS": f"models/tiny/pythia-tiny-{size}", "SEEDS": "1 2", "SBATCH_ARRAY_INX": "0-1",
                         "TINY": "1", "SBATCH_GPUS_PER_TASK": "0", "RESUME": "1", "OUTPUT_ROOT": "slurm/scaling"}
    # it waited while its tasks were queued or running (not the other user's), then drew the plots
    assert "reward pending: 1, reward running: 1, sft completed: 1" in result.stdout
    assert "someone_else" not in result.stdout
    assert len((slurm_checkout / "record.jsonl.squeue").read_text().split()) == 3
    plots = [c for c in calls if len(c) > 1 and str(c[1]).startswith("eval/")]
    assert [c[1] for c in plots] == ["eval/sft_rm_scale.py", "eval/rlhf_scaling_plot.py", "eval/scaling_table.py"]
    assert all(flag(c, "--runs_dir") == "slurm/scaling/runs" and "--run_glob" not in c for c in plots[:2])


def test_scaling_on_slurm_reuses_finished_runs_and_reports_failures(slurm_checkout):
    done = slurm_checkout / "slurm/scaling/models/pythia-tiny-m/ppo_2"
    done.mkdir(parents=True)
    (done / "model.safetensors").write_text("")
    result, calls = run_scaling(slurm_checkout, SLURM="1", SIZES="m l", SEEDS="1 2", POLL_SECONDS="0",
                                FAIL_SEEDS="1", SQUEUE_ROUNDS="0")
    assert result.returncode == 1
    jobs = submissions(calls)
    assert [(c[-1]["MODELS"][-1], c[-1]["SEEDS"], c[-1]["SBATCH_ARRAY_INX"]) for c in jobs[::3]] == [
        ("m", "1", "0-0"), ("l", "1 2", "0-1")]
    assert "tiny-m seed 2 finished before" in result.stdout
    # tiny-m seed 1 is array task 0 of the first chain, tiny-l seed 1 task 0 of the second
    assert ("tiny-m seed 1 saved no PPO model; its logs: slurm/logs/sft_101_0.out, slurm/logs/reward_102_0.out, "
            "slurm/logs/ppo_left_padding_103_0.out") in result.stderr
    assert "tiny-l seed 1 saved no PPO model" in result.stderr and "tiny-l seed 2" not in result.stderr
    assert "2 of 3 submitted runs failed" in result.stderr
    assert not [c for c in calls if len(c) > 1 and str(c[1]).startswith("eval/")]  # no plots of a partial sweep
    # --force: everything again, its checkpoints deleted (RESUME=0)
    result, calls = run_scaling(slurm_checkout, "--force", SLURM="1", SIZES="m", SEEDS="2", POLL_SECONDS="0")
    assert result.returncode == 0, result.stderr
    assert [c[-1]["SEEDS"] + c[-1]["RESUME"] for c in submissions(calls)] == ["20", "20", "20"]


def test_scaling_where_slurm_does_not_answer(slurm_checkout):
    result, calls = run_scaling(slurm_checkout, SLURM="auto", NO_CLUSTER="1", SIZES="s", SEEDS="1")
    assert result.returncode == 0, result.stderr
    assert not submissions(calls) and [c[-1]["NAME"] for c in calls if c[0] == "hello_world.sh"] == [None, "scaling_s_1"]
    result, calls = run_scaling(slurm_checkout, SLURM="1", NO_CLUSTER="1")
    assert result.returncode == 2 and "no Slurm cluster answers sinfo" in result.stderr and not calls
    result, calls = run_scaling(slurm_checkout, SLURM="yes")
    assert result.returncode == 2 and "SLURM must be auto, 0 or 1" in result.stderr and not calls
