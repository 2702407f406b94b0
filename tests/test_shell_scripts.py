"""The shell side of launching: sbatches/*.sbatch with sbatches/common.sh, and hello_world.sh.

- Bash 4.2 (older cluster login nodes, e.g. RHEL/CentOS 7): under `set -u`, bash before 4.4 aborts
  on "${a[@]}" of an EMPTY array ("a[@]: unbound variable"), so an array that may be empty must be
  expanded as ${a[@]+"${a[@]}"}. No bash 4.2 ships with this machine's Debian (and BASH_COMPAT=42
  does not bring the old behaviour back), so a static check guards every script; TEST_BASH=<a bash
  4.2 build> also runs the sbatch wiring below (and tests/test_hello_world_script.py) under it.
- The sbatch files' wiring, with the launcher replaced by a recorder (LAUNCHER, or a stand-in
  `accelerate` on PATH): the flags each stage gets, wandb only with TRACK=1, the node's whole
  memory, checkpoints and --resume, the multi-node launch line (stand-in `srun` and `scontrol` on
  PATH), and the batch shell's signal handling: SIGUSR1 passed on to the stage, then the task
  requeued; SIGTERM not passed on. (`make test-slurm` submits them to real Slurm clusters of one
  and of two nodes.)
"""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASH = os.environ.get("TEST_BASH", "bash")
SBATCHES = ("sft.sbatch", "reward.sbatch", "ppo_left_padding.sbatch", "dpo.sbatch")
ONLINE_SBATCHES = ("rloo.sbatch", "online_dpo.sbatch")  # beside PPO, after the reward model
# the scripts a user runs on a login or compute node. tests/slurm/test_sbatch_chain.sh is not one:
# it runs as root on a Debian machine with its bash 5.
SCRIPTS = ("hello_world.sh", "scaling.sh", "compare.sh", "async.sh", "sweep_args.sh", "sbatches/common.sh",
           "sbatches/tiny_default.sh", *(f"sbatches/{name}" for name in SBATCHES + ONLINE_SBATCHES))

# --- the static check ------------------------------------------------------------------------------
GUARDED = re.compile(r'\$\{(\w+)\[([@*])\]\+"\$\{\1\[\2\]\}"\}')  # ${a[@]+"${a[@]}"}
EXPANSION = re.compile(r"\$\{(\w+)\[[@*]\]")  # "${a[@]}", ${a[*]}, ${a[@]:1}; not ${#a[@]}, ${!a[@]}
LITERAL = re.compile(r"(?:^|[\s;&|(])(?:local\s+|declare\s+(?:-\w+\s+)*)?(\w+)=\(")  # a=(...), not a+=(...)
READ_INTO = re.compile(r"\bread\b[^\n;|&<]*?\s-[A-Za-z]*a\s*(\w+)")  # read -ra a, read -r -d '' -a a
MAPFILE_INTO = re.compile(r"\b(?:mapfile|readarray)\b[^\n;|&<]*?\s(\w+)\s*(?:<|$)", re.M)
CHECKED = re.compile(r"\(\(\s*\$\{#(\w+)\[@\]\}\s*\)\)\s*\|\|")  # ((${#a[@]})) || die ...


def code_of(text):
    """The text without its comment lines (the #SBATCH lines and the comments that explain)."""
    return "\n".join("" if line.lstrip().startswith("#") else line for line in text.splitlines())


def literal_body(code, start):
    """The words between the parentheses of a=( ... ) whose "(" ends at `start`."""
    depth, quote, i = 1, None, start
    while depth:
        c = code[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        i += 1
    return code[start:i - 1]


def never_empty(code):
    """Arrays that cannot be empty where they are expanded: every a=(...) of them lists at least one
    word besides other arrays' expansions, and none is filled by read -a / mapfile (which give an
    empty array for blank input) unless the scripts check `((${#a[@]})) || ...`. Arrays the scripts
    never assign (none today) count as possibly empty."""
    literals = {}
    for match in LITERAL.finditer(code):
        body = GUARDED.sub(" ", literal_body(code, match.end()))
        body = re.sub(r'"?\$\{\w+\[[@*]\]\}"?|\\\n', " ", body)
        literals.setdefault(match.group(1), []).append(bool(body.strip()))
    filled = {m.group(1) for m in READ_INTO.finditer(code)} | {m.group(1) for m in MAPFILE_INTO.finditer(code)}
    checked = {m.group(1) for m in CHECKED.finditer(code)}
    return {name for name, full in literals.items() if all(full) and name not in filled} | checked


def unguarded_expansions(texts):
    """(file, line, array) of each "${a[@]}" / ${a[*]} expansion of an array that may be empty.
    `texts` maps file names to contents; they are checked together, as common.sh is sourced by the
    sbatch files (a name that may be empty in one file counts as possibly empty in all)."""
    codes = {name: code_of(text) for name, text in texts.items()}
    safe = never_empty("\n".join(codes.values()))
    problems = []
    for name, code in codes.items():
        for number, line in enumerate(code.splitlines(), 1):
            for match in EXPANSION.finditer(GUARDED.sub("", line)):
                if match.group(1) not in safe:
                    problems.append((name, number, match.group(1)))
    return problems


def test_no_unguarded_expansion_of_a_possibly_empty_array():
    texts = {}
    for name in SCRIPTS:
        with open(os.path.join(ROOT, name)) as f:
            texts[name] = f.read()
    assert unguarded_expansions(texts) == [], 'use ${a[@]+"${a[@]}"} for these (bash < 4.4 with set -u)'


BAD = """set -u
a=()
opt=()
if [[ ${X:-} == 1 ]]; then opt=(--x); fi
read -ra extra <<<"${EXTRA:-}"
full=(one "two words")
echo "${full[@]}" "${a[@]}" ${opt[*]}
printf '%s\\n' "${extra[@]}"
"""
GOOD = """set -u
a=()
opt=()
read -ra extra <<<"${EXTRA:-}"
read -ra launcher <<<"${LAUNCHER:-python}"
((${#launcher[@]})) || exit 2
full=(one "two words" ${a[@]+"${a[@]}"})
echo "${full[@]}" ${a[@]+"${a[@]}"} ${opt[*]+"${opt[*]}"} "${#extra[@]}" "${launcher[@]}"
printf '%s\\n' ${extra[@]+"${extra[@]}"}
"""


def test_the_check_finds_what_bash_42_rejects():
    assert unguarded_expansions({"bad.sh": BAD}) == [("bad.sh", 7, "a"), ("bad.sh", 7, "opt"),
                                                     ("bad.sh", 8, "extra")]
    assert unguarded_expansions({"good.sh": GOOD}) == []


def bash_version(bash):
    out = subprocess.run([bash, "-c", 'echo "${BASH_VERSINFO[0]} ${BASH_VERSINFO[1]}"'], capture_output=True,
                         text=True, check=True).stdout
    return tuple(int(v) for v in out.split())


@pytest.mark.skipif(bash_version(BASH) >= (4, 4), reason="needs TEST_BASH=<bash before 4.4>, e.g. a 4.2 build")
def test_old_bash_agrees_with_the_check():
    bad = subprocess.run([BASH, "-c", BAD], capture_output=True, text=True)
    assert bad.returncode != 0 and "a[@]: unbound variable" in bad.stderr
    good = subprocess.run([BASH, "-c", GOOD], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr


# --- the sbatch files ------------------------------------------------------------------------------
def header(name):
    """The #SBATCH options sbatch reads: those before the first command of the file."""
    options = []
    with open(os.path.join(ROOT, "sbatches", name)) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                break
            if line.startswith("#SBATCH "):
                options.append(line.split()[1])
    return options


@pytest.mark.parametrize("name", SBATCHES + ONLINE_SBATCHES)
def test_sbatch_asks_for_the_whole_node(name):
    options = header(name)
    job = name.removesuffix(".sbatch")
    assert options == [f"--job-name={job}", "--array=0-11", "--nodes=1", "--ntasks-per-node=1", "--gpus-per-task=8",
                       "--exclusive", "--mem=0", "--requeue", "--signal=B:USR1@900", "--open-mode=append",
                       "--output=slurm/logs/%x_%A_%a.out"]
    # the lead time the batch shell assumes (torchrun's shutdown timeout) is the header's
    with open(os.path.join(ROOT, "sbatches/common.sh")) as f:
        assert "SIGNAL_LEAD=${SBATCH_SIGNAL:-B:USR1@900}" in f.read()


# stands in for the launcher: records its argv (and the environment it got) and, like the stages,
# saves a model to --output_dir
RECORDER = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
with open(os.environ["RECORD"] + ".env", "a") as f:
    f.write(json.dumps({{k: v for k, v in os.environ.items() if k.startswith(("PET_", "SLURM_NODEID", "ACCELERATE_"))}})
            + "\\n")
if "--output_dir" in sys.argv:
    out = sys.argv[sys.argv.index("--output_dir") + 1]
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "config.json"), "w").close()
"""

# stands in for srun: records its options, then runs the command once per node (SLURM_NODEID
# 0..N-1, one after the other, or at once with SRUN_PARALLEL=1, passing signals on as srun does)
FAKE_SRUN = f"""#!{sys.executable}
import json, os, signal, subprocess, sys
args = sys.argv[1:]
i = next(i for i, a in enumerate(args) if not a.startswith("-"))
options, command = args[:i], args[i:]
with open(os.environ["RECORD"] + ".srun", "a") as f:
    f.write(json.dumps(options) + "\\n")
nodes = int(next(o.split("=")[1] for o in options if o.startswith("--nodes=")))
env = lambda n: dict(os.environ, SLURM_NODEID=str(n), SLURM_PROCID=str(n))
if os.environ.get("SRUN_PARALLEL") == "1":
    tasks = [subprocess.Popen(command, env=env(n)) for n in range(nodes)]
    signal.signal(signal.SIGUSR1, lambda s, f: [t.send_signal(s) for t in tasks])
    sys.exit(max(t.wait() for t in tasks))
sys.exit(max(subprocess.run(command, env=env(n)).returncode for n in range(nodes)))
"""

# stands in for scontrol: the allocation's hosts gpu07 and gpu08 at 10.0.0.7 and 10.0.0.8; records
# every call
FAKE_SCONTROL = """#!/bin/bash
echo "$*" >>"$RECORD.scontrol"
case "$1 $2" in
    "show hostnames") printf '%s\\n' gpu07 gpu08 ;;
    "-o show") echo "NodeName=$4 Arch=x86_64 CoresPerSocket=48 NodeAddr=10.0.0.${4#gpu0} NodeHostName=$4 Port=0" ;;
esac
"""


def executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def repo(tmp_path):
    """A submit directory with the sbatch files, the embedded default's inputs (empty), a recorder
    as the launcher, and bin/ with stand-ins for accelerate (the recorder), srun and scontrol."""
    shutil.copytree(os.path.join(ROOT, "sbatches"), tmp_path / "repo/sbatches")
    (tmp_path / "repo/summarize_from_feedback_details").mkdir()
    shutil.copy(os.path.join(ROOT, "summarize_from_feedback_details/methods.tsv"),
                tmp_path / "repo/summarize_from_feedback_details/methods.tsv")
    for need in ("data/tldr/sft", "data/tldr/preference", "models/tiny/pythia-tiny-s"):
        (tmp_path / "repo" / need).mkdir(parents=True)
    executable(tmp_path / "record.py", RECORDER)
    (tmp_path / "bin").mkdir()
    executable(tmp_path / "bin/accelerate", RECORDER)
    executable(tmp_path / "bin/srun", FAKE_SRUN)
    executable(tmp_path / "bin/scontrol", FAKE_SCONTROL)
    return tmp_path


def environment(repo, models, task, **env):
    """What Slurm gives array task `task` of a job over MODELS x seeds 1 and 2, plus `env`."""
    n = len(models.split()) * 2
    return {"PATH": "/usr/bin:/bin", "HOME": str(repo), "RECORD": str(repo / "record.jsonl"),
            "LAUNCHER": str(repo / "record.py"), "MODELS": models, "SEEDS": "1 2", "OUTPUT_ROOT": str(repo / "out"),
            "SLURM_SUBMIT_DIR": str(repo / "repo"), "SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "7",
            "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": str(n), "SLURM_ARRAY_TASK_MIN": "0",
            "SLURM_ARRAY_TASK_MAX": str(n - 1), "SLURM_GPUS_PER_TASK": "8", **env}


def records(repo, suffix=""):
    path = repo / f"record.jsonl{suffix}"
    if suffix == ".scontrol":
        return path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def chain(repo, models="EleutherAI/pythia-1b-deduped", task=0, names=SBATCHES, **env):
    """Runs array task `task` of sft, reward, ppo_left_padding and dpo.sbatch (or `names`) one after
    the other, as Slurm would (bash, in the submit directory); returns the last result and the
    recorded argvs. (Slurm runs dpo beside reward and ppo, after sft: it reads only the SFT model.)"""
    for suffix in ("", ".env", ".srun", ".scontrol"):
        (repo / f"record.jsonl{suffix}").unlink(missing_ok=True)
    environ = environment(repo, models, task, **env)
    for name in names:
        result = subprocess.run([BASH, f"sbatches/{name}"], cwd=repo / "repo", env=environ,
                                capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            break
    return result, records(repo)


def flag(call, name):
    return call[call.index(name) + 1]


def test_no_wandb_unless_track_is_1(repo):
    result, calls = chain(repo)
    assert result.returncode == 0, result.stderr
    assert [os.path.basename(c[0]) for c in calls] == ["sft.py", "reward.py", "ppo_left_padding.py", "dpo.py"]
    assert all("--deepspeed" in c and "--track" not in c for c in calls)
    result, calls = chain(repo, TRACK="1", EXTRA_FLAGS="--push_to_hub --hf_entity me", PPO_FLAGS="--ppo.kl_coef 0.1",
                          DPO_FLAGS="--beta 0.1")
    assert result.returncode == 0, result.stderr
    # --track, then EXTRA_FLAGS, then the stage's own, after the file's flags
    assert len(calls) == 4
    for call in calls:
        assert call.index("--local_eval_batch_size") < call.index("--track") < call.index("--push_to_hub")
        assert flag(call, "--hf_entity") == "me"
    assert calls[2][-2:] == ["--ppo.kl_coef", "0.1"] and "--ppo.kl_coef" not in calls[0] + calls[1] + calls[3]
    assert calls[3][-2:] == ["--beta", "0.1"] and "--beta" not in calls[0] + calls[1] + calls[2]
    # the embedded default tracks only when asked too
    result, calls = chain(repo, models="models/tiny/pythia-tiny-s", TINY="1")
    assert result.returncode == 0, result.stderr
    assert len(calls) == 5 and all("--track" not in c and "--deepspeed" not in c for c in calls)
    result, calls = chain(repo, models="models/tiny/pythia-tiny-s", TINY="1", TRACK="1")
    assert result.returncode == 0 and all("--track" in c for c in calls)


def test_memory_knobs_by_model_size(repo):
    models = "EleutherAI/pythia-6.9b-deduped EleutherAI/pythia-1b-deduped"
    result, big = chain(repo, models=models, task=0)
    assert result.returncode == 0, result.stderr
    result, small = chain(repo, models=models, task=2)
    assert result.returncode == 0, result.stderr
    # the paper's batches 128 / 64 / 512 / 64 (SFT, RM, PPO, DPO) on 8 GPUs; only 6.9b offloads PPO's
    # frozen models and DPO's frozen reference
    assert len(big) == len(small) == 4
    for calls, micro, evals in ((big, (1, 1, 1, 1), (1, 1, 1, 1)), (small, (16, 8, 16, 8), (8, 8, 8, 8))):
        for call, m, e, batch in zip(calls, micro, evals, (128, 64, 512, 64), strict=True):
            assert int(flag(call, "--local_micro_batch_size")) == m
            assert m * int(flag(call, "--gradient_accumulation_steps")) * 8 == batch
            assert int(flag(call, "--local_eval_batch_size")) == e
    for i in (2, 3):
        assert "--offload" in big[i] and "--offload" not in small[i]
    assert not any("--offload" in c for c in big[:2] + small[:2])
    assert flag(big[0], "--output_dir").endswith("out/models/pythia-6.9b-deduped/sft_1")
    # DPO: the paper's batch of 64 pairs on other GPU counts too (accumulation derived)
    result, four = chain(repo, models=models, task=2, SLURM_GPUS_PER_TASK="4")
    assert result.returncode == 0, result.stderr
    assert flag(four[3], "--gradient_accumulation_steps") == "2" and flag(four[3], "--local_micro_batch_size") == "8"


def test_lora_flags_reach_every_stage_and_6_9b_dpo_offloads_nothing(repo):
    """EXTRA_FLAGS="--use_peft ..." (docs/lora.md's LoRA chain): every stage gets the flags; at 6.9b
    PPO still offloads its frozen reward model, DPO (whose reference is then the policy with its
    adapter disabled) has nothing to offload and is not given --offload, which it would refuse."""
    result, calls = chain(repo, models="EleutherAI/pythia-6.9b-deduped", task=0,
                          EXTRA_FLAGS="--use_peft --lora_r 64 --lora_alpha 128")
    assert result.returncode == 0, result.stderr
    assert len(calls) == 4
    for call in calls:
        assert "--use_peft" in call and flag(call, "--lora_r") == "64" and flag(call, "--lora_alpha") == "128"
    assert "--offload" in calls[2] and "--offload" not in calls[3]
    result, calls = chain(repo, models="EleutherAI/pythia-6.9b-deduped", task=0, DPO_FLAGS="--use_peft")
    assert result.returncode == 0, result.stderr
    assert "--offload" in calls[2] and "--offload" not in calls[3] and "--use_peft" in calls[3]


def test_dpo_reads_the_sft_model_of_its_model_and_seed(repo):
    models = "EleutherAI/pythia-6.9b-deduped EleutherAI/pythia-1b-deduped"
    result, calls = chain(repo, models=models, task=3)  # model 1 (1b), seed 2
    assert result.returncode == 0, result.stderr
    sft, dpo = calls[0], calls[3]
    assert os.path.basename(dpo[0]) == "dpo.py"
    out = str(repo / "out/models/pythia-1b-deduped")
    assert flag(sft, "--output_dir") == flag(dpo, "--sft_model_path") == f"{out}/sft_2"
    assert flag(dpo, "--output_dir") == f"{out}/dpo_2"
    assert flag(dpo, "--base_model") == "EleutherAI/pythia-1b-deduped" and flag(dpo, "--seed") == "2"
    assert "--deepspeed" in dpo and "--run_eval" in dpo and "--track" not in dpo
    assert "--reward_model_path" not in dpo and "--label_dataset" not in dpo  # the paper's hub datasets


def test_dpo_tiny_runs_the_embedded_default(repo):
    result, calls = chain(repo, models="models/tiny/pythia-tiny-s", task=1, TINY="1")
    assert result.returncode == 0, result.stderr
    dpo, base = calls[4], str(repo / "repo")
    assert dpo[0] == f"{base}/summarize_from_feedback_details/dpo.py"
    out = str(repo / "out/models/pythia-tiny-s")
    assert flag(dpo, "--base_model") == f"{base}/models/tiny/pythia-tiny-s"
    assert flag(dpo, "--sft_model_path") == f"{out}/sft_2" and flag(dpo, "--output_dir") == f"{out}/dpo_2"
    assert flag(dpo, "--label_dataset") == f"{base}/data/tldr/preference"
    assert flag(dpo, "--query_dataset") == f"{base}/data/tldr/sft"
    assert flag(dpo, "--response_length") == "32" and flag(dpo, "--lr") == "1e-4"
    assert flag(dpo, "--local_micro_batch_size") == "32" and flag(dpo, "--gradient_accumulation_steps") == "1"
    assert flag(dpo, "--local_eval_batch_size") == "100"
    assert "--run_eval" in dpo and not {"--deepspeed", "--offload", "--track"} & set(dpo)


@pytest.mark.parametrize("name, missing", [("reward.sbatch", "SFT model"), ("ppo_left_padding.sbatch", "SFT model"),
                                           ("dpo.sbatch", "SFT model"), ("rloo.sbatch", "SFT model"),
                                           ("online_dpo.sbatch", "SFT model")])
def test_a_missing_earlier_model_stops_the_stage(repo, name, missing):
    result, calls = chain(repo, task=1, names=(name,))
    out = repo / "out/models/pythia-1b-deduped/sft_2"
    assert result.returncode == 2 and not calls
    assert f"no {missing} at {out}: did array task 1 of its job fail?" in result.stderr


def test_online_methods_keep_ppos_batch_on_every_size_and_method(repo):
    """rloo.sbatch (RLOO_METHOD rloo, rloo_k4, grpo) and online_dpo.sbatch after the reward model: PPO's
    512 episodes per update on 8 GPUs, generation chunks within a process's queries (512 / k / 8),
    online DPO's micro batch even, 6.9b's frozen models offloaded; the method names its folder."""
    models = "EleutherAI/pythia-6.9b-deduped EleutherAI/pythia-1b-deduped"
    for task, model in ((0, "pythia-6.9b-deduped"), (2, "pythia-1b-deduped")):
        for method, k, own in (("rloo", 2, []), ("rloo_k4", 4, ["--rloo_k", "4", "--exp_name", "rloo_k4"]),
                               ("grpo", 4, ["--algorithm", "grpo", "--rloo_k", "4", "--exp_name", "grpo"])):
            result, calls = chain(repo, models=models, task=task, names=SBATCHES[:2] + ("rloo.sbatch",),
                                  RLOO_METHOD=method, RLOO_FLAGS="--kl_coef 0.1")
            assert result.returncode == 0, result.stderr
            rloo = calls[2]
            assert os.path.basename(rloo[0]) == "rloo.py" and rloo[1:3] == ["--checkpoint_every", "25"]
            out = str(repo / f"out/models/{model}")
            assert flag(rloo, "--sft_model_path") == f"{out}/sft_1"
            assert flag(rloo, "--reward_model_path") == f"{out}/reward_model_1"
            assert flag(rloo, "--output_dir") == f"{out}/{method}_1"
            for i, word in enumerate(own):  # the method's flags, before the file's
                assert rloo[rloo.index(own[0]) + i] == word
            assert ("--rloo_k" in rloo) == (k == 4) and rloo[-2:] == ["--kl_coef", "0.1"]
            micro = int(flag(rloo, "--local_micro_batch_size"))
            assert micro * int(flag(rloo, "--gradient_accumulation_steps")) * 8 == 512
            assert int(flag(rloo, "--local_rollout_forward_batch_size")) <= 512 // k // 8
            assert ("--offload" in rloo) == (task == 0) and "--deepspeed" in rloo and "--run_eval" in rloo
        result, calls = chain(repo, models=models, task=task, names=SBATCHES[:2] + ("online_dpo.sbatch",),
                              ONLINE_DPO_FLAGS="--beta 0.2", ONLINE_DPO_CHECKPOINT_EVERY="5")
        assert result.returncode == 0, result.stderr
        online = calls[2]
        assert os.path.basename(online[0]) == "online_dpo.py" and online[1:3] == ["--checkpoint_every", "5"]
        assert flag(online, "--output_dir") == str(repo / f"out/models/{model}/online_dpo_1")
        micro = int(flag(online, "--local_micro_batch_size"))
        assert micro % 2 == 0 and micro * int(flag(online, "--gradient_accumulation_steps")) * 8 == 512
        assert int(flag(online, "--local_rollout_forward_batch_size")) <= 512 // 2 // 8
        assert ("--offload" in online) == (task == 0) and online[-2:] == ["--beta", "0.2"]
    result, calls = chain(repo, names=("rloo.sbatch",), RLOO_METHOD="ppo")
    assert result.returncode == 2 and not calls
    assert "RLOO_METHOD must be one of rloo.py's rows of summarize_from_feedback_details/methods.tsv: rloo rloo_k4 " \
           "grpo (got 'ppo')" in result.stderr
    # the reward model is needed too
    shutil.rmtree(repo / "out")
    result, calls = chain(repo, names=("sft.sbatch", "online_dpo.sbatch"))
    assert result.returncode == 2 and "no reward model at" in result.stderr and len(calls) == 1


def test_blank_launcher_is_refused(repo):
    result, calls = chain(repo, LAUNCHER=" ")
    assert result.returncode == 2 and "LAUNCHER is blank" in result.stderr and not calls


# --- checkpoints and --resume ----------------------------------------------------------------------
def test_checkpoint_every_by_stage(repo):
    result, calls = chain(repo)
    assert result.returncode == 0, result.stderr
    # right after the script, so that a stage's own flags come later and win (tyro takes the last)
    assert [c[1:3] for c in calls] == [["--checkpoint_every", e] for e in ("100", "100", "25", "100")]
    result, calls = chain(repo, models="models/tiny/pythia-tiny-s", TINY="1")
    assert result.returncode == 0, result.stderr
    assert [c[1:3] for c in calls] == [["--checkpoint_every", e] for e in ("4", "4", "4", "1", "2")]
    result, calls = chain(repo, models="models/tiny/pythia-tiny-s", TINY="1", names=ONLINE_SBATCHES)
    assert result.returncode == 0, result.stderr
    assert [c[1:3] for c in calls] == [["--checkpoint_every", "1"]] * 2
    result, calls = chain(repo, CHECKPOINT_EVERY="7", PPO_CHECKPOINT_EVERY="3", SFT_FLAGS="--checkpoint_every 9")
    assert result.returncode == 0, result.stderr
    assert [c[2] for c in calls] == ["7", "7", "3", "7"] and calls[0][-2:] == ["--checkpoint_every", "9"]
    result, calls = chain(repo, names=("dpo.sbatch",), DPO_CHECKPOINT_EVERY="often")
    assert result.returncode == 2 and not calls
    assert "DPO_CHECKPOINT_EVERY / CHECKPOINT_EVERY must be a number of updates, got 'often'" in result.stderr


def checkpoints(repo, stage="sft_1"):
    return repo / "out/models/pythia-1b-deduped" / stage / "checkpoints"


def test_resume_only_when_a_requeued_task_has_a_checkpoint(repo):
    sft = ("sft.sbatch",)
    # a first run, and a rerun (SLURM_RESTART_COUNT: Slurm requeued the task) without a checkpoint
    for env in ({}, {"SLURM_RESTART_COUNT": "1"}):
        result, calls = chain(repo, names=sft, **env)
        assert result.returncode == 0 and len(calls) == 1 and "--resume" not in calls[0], result.stderr
    # one being written (hidden, renamed when complete) does not count
    (checkpoints(repo) / ".update-0000005.partial").mkdir(parents=True)
    result, calls = chain(repo, names=sft, SLURM_RESTART_COUNT="1")
    assert result.returncode == 0 and "--resume" not in calls[0], result.stderr
    # a rerun with a checkpoint resumes: --resume comes last
    for update in (4, 12):
        (checkpoints(repo) / f"update-{update:07d}").mkdir(parents=True)
    result, calls = chain(repo, names=sft, SLURM_RESTART_COUNT="1", SFT_FLAGS="--lr 1e-5")
    assert result.returncode == 0, result.stderr
    assert calls[0][-3:] == ["--lr", "1e-5", "--resume"]
    # the stage finished: its checkpoints served their purpose and are deleted (not with
    # KEEP_FINISHED_CHECKPOINTS=1)
    assert not checkpoints(repo).exists()
    assert f"the stage finished: deleting its checkpoints in {checkpoints(repo)}" in result.stdout
    (checkpoints(repo) / "update-0000004").mkdir(parents=True)
    result, calls = chain(repo, names=sft, SLURM_RESTART_COUNT="2", KEEP_FINISHED_CHECKPOINTS="1")
    assert result.returncode == 0 and calls[0][-1] == "--resume" and (checkpoints(repo) / "update-0000004").is_dir()
    # a first run that finds one (left by an earlier submission that did not finish) stops
    result, calls = chain(repo, names=sft)
    assert result.returncode == 2 and not calls
    assert (f"{checkpoints(repo)} holds update-0000004 of an earlier submission of this task that did not finish: "
            "RESUME=1 continues it, RESUME=0 deletes it and starts over") in result.stderr
    result, calls = chain(repo, names=sft, RESUME="1", KEEP_FINISHED_CHECKPOINTS="1")
    assert result.returncode == 0 and calls[0][-1] == "--resume"
    result, calls = chain(repo, names=sft, RESUME="0", KEEP_FINISHED_CHECKPOINTS="1")
    assert result.returncode == 0 and "--resume" not in calls[0] and not checkpoints(repo).exists()
    # each stage looks into its own output dir
    (checkpoints(repo, "ppo_1") / "update-0000010").mkdir(parents=True)
    result, calls = chain(repo, SLURM_RESTART_COUNT="1")
    assert result.returncode == 0, result.stderr
    assert ["--resume" in c for c in calls] == [False, False, True, False]


# --- several nodes ---------------------------------------------------------------------------------
TWO_NODES = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_CPUS_ON_NODE": "96",
             "LAUNCHER": ""}


def stage_args(call):
    """The stage's own arguments of a recorded launcher call (after the script)."""
    script = next(i for i, a in enumerate(call) if a.endswith(".py"))
    return call[script:]


def test_two_nodes_launch_line(repo):
    models = "EleutherAI/pythia-6.9b-deduped EleutherAI/pythia-1b-deduped"
    path = f"{repo / 'bin'}:/usr/bin:/bin"
    for task, ga_one_node in ((0, (16, 8, 64, 8)), (2, (1, 1, 4, 1))):
        result, one = chain(repo, models=models, task=task, PATH=path, LAUNCHER="")
        assert result.returncode == 0, result.stderr
        assert not records(repo, ".srun") and len(one) == 4
        result, two = chain(repo, models=models, task=task, PATH=path, **TWO_NODES)
        assert result.returncode == 0, result.stderr
        # one srun per stage, one launcher per node, with all of the node's CPUs
        assert records(repo, ".srun") == [["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                                           "--cpus-per-task=96"]] * 4
        assert records(repo, ".scontrol")[:2] == ["show hostnames gpu[07-08]", "-o show node gpu07"]
        assert len(two) == 8
        config = str(repo / "repo/deepspeed.yaml")
        for i, (single, node0, node1) in enumerate(zip(one, two[::2], two[1::2])):
            assert single[:5] == ["launch", "--config_file", config, "--num_processes", "8"]
            for rank, call in enumerate((node0, node1)):
                assert call[:15] == ["launch", "--config_file", config, "--num_processes", "16",
                                     "--deepspeed_multinode_launcher", "standard", "--num_machines", "2",
                                     "--machine_rank", str(rank), "--main_process_ip", "10.0.0.7",
                                     "--main_process_port", str(20000 + 4242 % 10000)]
                assert stage_args(call) == stage_args(node0)
            # the same global batch over 16 processes
            ga = int(flag(node0, "--gradient_accumulation_steps"))
            micro = int(flag(node0, "--local_micro_batch_size"))
            batch = (128, 64, 512, 64)[i]
            assert micro * ga * 16 == batch
            assert int(flag(single, "--gradient_accumulation_steps")) == ga_one_node[i]
            if task == 0:  # 6.9b: micro batch 1, so the accumulation halves
                assert micro == 1 and ga == ga_one_node[i] // 2
                assert stage_args(node0) == [a if a != str(ga_one_node[i]) else str(ga) for a in stage_args(single)]
        if task == 2:  # 1b: micro 16 / 8 shrinks to the 8 / 4 examples each of 16 processes gets
            assert [int(flag(c, "--local_micro_batch_size")) for c in two[::2]] == [8, 4, 16, 4]
            assert flag(two[4], "--local_rollout_forward_batch_size") == "32"  # = PPO's local batch
        env = records(repo, ".env")
        assert [e["SLURM_NODEID"] for e in env] == ["0", "1"] * 4
        assert all(e["PET_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" and
                   e["PET_SHUTDOWN_TIMEOUT"] == "900" for e in env)


def test_two_nodes_tiny(repo):
    path = f"{repo / 'bin'}:/usr/bin:/bin"
    result, one = chain(repo, models="models/tiny/pythia-tiny-s", TINY="1", task=1)
    assert result.returncode == 0, result.stderr
    result, two = chain(repo, models="models/tiny/pythia-tiny-s", TINY="1", task=1, PATH=path, **TWO_NODES)
    assert result.returncode == 0, result.stderr
    assert len(one) == 5 and len(two) == 10  # TINY=1: two SFT runs
    for i, (single, node0, node1) in enumerate(zip(one, two[::2], two[1::2], strict=True)):
        assert node0[:11] == ["launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "2",
                              "--machine_rank", "0", "--main_process_ip", "10.0.0.7", "--main_process_port"]
        assert node1[:8] == node0[:7] + ["1"] and stage_args(node1) == stage_args(node0)
        assert stage_args(single)[0] == stage_args(node0)[0]  # the same script; python launched it before
        # the embedded default's batch, split over the two CPU processes
        local = int(flag(node0, "--local_micro_batch_size")) * int(flag(node0, "--gradient_accumulation_steps"))
        assert local * 2 == int(flag(single, "--local_micro_batch_size")) * int(
            flag(single, "--gradient_accumulation_steps")) == (32, 32, 32, 64, 32)[i]
    assert flag(two[6], "--local_rollout_forward_batch_size") == "32"
    assert all(e["ACCELERATE_USE_CPU"] == "1" for e in records(repo, ".env")[-10:])


# the flags that name where a stage reads and writes, and those only one of the two scripts passes
PATH_FLAGS = ("--base_model", "--sft_model_path", "--reward_model_path", "--output_dir", "--query_dataset",
              "--label_dataset")
OWN_FLAGS = ("--run_name", "--checkpoint_every")


def stage_flags(argv):
    """A stage's command line after its script as {flag: value} (True for a flag without one; the
    last of a repeated flag wins, as in tyro), without PATH_FLAGS and OWN_FLAGS, and its paths."""
    script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    flags, args, i = {}, argv[script + 1:], 0
    while i < len(args):
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        flags[args[i]] = args[i + 1] if takes_value else True
        i += 2 if takes_value else 1
    paths = {k: flags.pop(k) for k in PATH_FLAGS if k in flags}
    for k in OWN_FLAGS:
        flags.pop(k, None)
    return os.path.basename(argv[script]), flags, paths


def test_tiny_sbatch_chain_runs_hello_worlds_settings(repo, tmp_path):
    """TINY=1 is hello_world.sh's pipeline, stage by stage with the same flags (scaling.sh submits it
    as the Slurm path of `make scaling`): two SFT runs, the reward model on the all-tokens one, PPO
    and DPO on the summary-only one; with ALGOS=all, rloo.sbatch (its three RLOO_METHODs) and
    online_dpo.sbatch as hello_world's rloo, rloo_k4, grpo and online_dpo."""
    import test_hello_world_script as hello_world_wiring

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(os.path.join(ROOT, "hello_world.sh"), checkout / "hello_world.sh")
    shutil.copytree(os.path.join(ROOT, "sbatches"), checkout / "sbatches")  # tiny_default.sh: the one source
    hello_world_wiring.copy_registry(checkout)
    for name in (".venv/bin/python", ".venv/bin/accelerate", "bin/make"):
        hello_world_wiring.executable(checkout / name, hello_world_wiring.RECORDER)
    # every method but the control, which compare.sh runs through hello_world.sh only
    result, calls = hello_world_wiring.run(checkout, 0, MODEL="models/tiny/pythia-tiny-s", SEED="2",
                                           ALGOS="ppo dpo rloo rloo_k4 grpo online_dpo")
    assert result.returncode == 0, result.stderr
    scripts = ("sft.py", "reward.py", "ppo_left_padding.py", "dpo.py", "rloo.py", "online_dpo.py")
    local = [stage_flags(c) for c in calls if any(a.startswith("summarize_from_feedback_details/") and
                                                     os.path.basename(a) in scripts for a in c)]
    result, launched = chain(repo, models="models/tiny/pythia-tiny-s", task=1, TINY="1")  # seed 2
    assert result.returncode == 0, result.stderr
    for method in ("rloo", "rloo_k4", "grpo"):
        result, more = chain(repo, models="models/tiny/pythia-tiny-s", task=1, names=("rloo.sbatch",), TINY="1",
                             RLOO_METHOD=method)
        assert result.returncode == 0, result.stderr
        launched += more
    result, more = chain(repo, models="models/tiny/pythia-tiny-s", task=1, names=("online_dpo.sbatch",), TINY="1")
    assert result.returncode == 0, result.stderr
    submitted = [stage_flags(c) for c in launched + more]
    assert [s for s, _, _ in submitted] == [s for s, _, _ in local] == ["sft.py", "sft.py", "reward.py",
                                                                        "ppo_left_padding.py", "dpo.py", "rloo.py",
                                                                        "rloo.py", "rloo.py", "online_dpo.py"]
    for (script, ours, _), (_, theirs, _) in zip(local, submitted, strict=True):
        assert ours == theirs, (script, set(ours.items()) ^ set(theirs.items()))
    assert local[0][1]["--exp_name"] == "sft_all_tokens" and "--response_only_loss" in local[1][1]
    assert "--run_eval" not in local[0][1] and "--run_eval" in local[1][1]  # nothing samples the RM's backbone
    assert local[3][1]["--total_episodes"] == local[5][1]["--total_episodes"] == str(15 * 64)
    assert local[7][1]["--algorithm"] == "grpo"
    # the same models in the same roles: models/<NAME>/<stage> there, <OUTPUT_ROOT>/models/<model>/<stage>_<seed> here
    out = str(repo / "out/models/pythia-tiny-s")
    roles = [(0, "--output_dir", "sft_all_tokens"), (1, "--output_dir", "sft"), (2, "--sft_model_path", "sft_all_tokens"),
             (2, "--output_dir", "reward_model"), (3, "--sft_model_path", "sft"), (3, "--reward_model_path", "reward_model"),
             (3, "--output_dir", "ppo"), (4, "--sft_model_path", "sft"), (4, "--output_dir", "dpo")]
    for i, folder in ((5, "rloo"), (6, "rloo_k4"), (7, "grpo"), (8, "online_dpo")):
        roles += [(i, "--sft_model_path", "sft"), (i, "--reward_model_path", "reward_model"), (i, "--output_dir", folder)]
    for i, name, folder in roles:
        assert local[i][2][name] == f"models/hello_world/{folder}"
        assert submitted[i][2][name] == f"{out}/{folder}_2"
    for (_, _, ours), (_, _, theirs) in zip(local, submitted, strict=True):
        assert os.path.basename(ours["--base_model"]) == os.path.basename(theirs["--base_model"]) == "pythia-tiny-s"
        assert ours["--query_dataset"].endswith("data/tldr/sft") and theirs["--query_dataset"].endswith("data/tldr/sft")


def test_tiny_sft_rerun_keeps_a_saved_backbone(repo):
    """TINY=1's sft.sbatch trains two models in one task: a task Slurm runs again (requeued while it
    trained the policy) does not train a backbone again that was saved; a new submission does."""
    tiny = dict(models="models/tiny/pythia-tiny-s", names=("sft.sbatch",), TINY="1")
    backbone = repo / "out/models/pythia-tiny-s/sft_all_tokens_1"
    backbone.mkdir(parents=True)
    (backbone / "model.safetensors").write_text("")
    result, calls = chain(repo, **tiny, SLURM_RESTART_COUNT="1")
    assert result.returncode == 0, result.stderr
    assert [flag(c, "--output_dir") for c in calls] == [str(repo / "out/models/pythia-tiny-s/sft_1")]
    assert f"the reward model's backbone was saved before this task was requeued: {backbone}" in result.stdout
    result, calls = chain(repo, **tiny)
    assert result.returncode == 0, result.stderr
    assert [os.path.basename(flag(c, "--output_dir")) for c in calls] == ["sft_all_tokens_1", "sft_1"]
    (backbone / "model.safetensors").unlink()  # requeued while the backbone trained: both run
    result, calls = chain(repo, **tiny, SLURM_RESTART_COUNT="1")
    assert [os.path.basename(flag(c, "--output_dir")) for c in calls] == ["sft_all_tokens_1", "sft_1"]


def test_nodes_must_match_the_allocation(repo):
    result, calls = chain(repo, names=("sft.sbatch",), NODES="2", SLURM_JOB_NUM_NODES="1")
    assert result.returncode == 2 and not calls
    assert "NODES=2, but this job has 1 node(s): submit with sbatch --nodes=2" in result.stderr


# --- the batch shell and stop signals ---------------------------------------------------------------
# stands in for a stage: it records its pid once started; SIGUSR1 or SIGTERM makes it finish "the
# update" (a second signal arriving meanwhile is recorded too), write update-0000003 to its
# checkpoints and exit 75, as the stages do. Without a signal it ends after STAGE_SECONDS (30) with
# status 0.
STAGE = f"""#!{sys.executable}
import os, signal, sys, time
out = sys.argv[sys.argv.index("--output_dir") + 1]
record = os.environ["RECORD"]
got = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda signum, frame: got.append(signal.Signals(signum).name))
with open(record + ".pid" + os.environ.get("SLURM_NODEID", ""), "w") as f:
    f.write(str(os.getpid()))
deadline = time.time() + float(os.environ.get("STAGE_SECONDS", "30"))
while not got and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.5)
with open(record + ".signals", "a") as f:
    f.write(" ".join(got) + "\\n")
if got:
    os.makedirs(os.path.join(out, "checkpoints", "update-0000003"), exist_ok=True)
    sys.exit(75)
"""


def start_stage(repo, pid_files=("",), **env):
    """sft.sbatch with the stand-in stage as its launcher, once the stage runs (on every node)."""
    executable(repo / "stage.py", STAGE)
    for suffix in (".signals", ".scontrol", ".srun"):
        (repo / f"record.jsonl{suffix}").unlink(missing_ok=True)
    environ = environment(repo, "EleutherAI/pythia-1b-deduped", 0, **{
        "PATH": f"{repo / 'bin'}:/usr/bin:/bin", **env, "LAUNCHER": str(repo / "stage.py")})
    process = subprocess.Popen([BASH, "sbatches/sft.sbatch"], cwd=repo / "repo", env=environ,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = [repo / f"record.jsonl.pid{n}" for n in pid_files]
    deadline = time.time() + 30
    while not all(p.exists() and p.read_text() for p in pids):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.05)
    return process, [int(p.read_text()) for p in pids]


def test_usr1_reaches_the_stage_then_the_task_requeues_itself(repo):
    process, _ = start_stage(repo)
    process.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@900 does: to the batch shell only
    out, err = process.communicate(timeout=60)
    assert process.returncode == 75, out + err
    assert (repo / "record.jsonl.signals").read_text() == "SIGUSR1\n"
    checkpoint = checkpoints(repo) / "update-0000003"
    assert records(repo, ".scontrol") == ["requeue 4242"]
    assert f"requeueing job 4242 (7_0): its rerun resumes from {checkpoint}" in out
    assert checkpoint.is_dir()


def test_usr1_reaches_every_node_through_srun(repo):
    process, _ = start_stage(repo, pid_files=("0", "1"), SRUN_PARALLEL="1", **TWO_NODES)
    process.send_signal(signal.SIGUSR1)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 75, out + err
    assert (repo / "record.jsonl.signals").read_text() == "SIGUSR1\nSIGUSR1\n"
    assert records(repo, ".srun") == [["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                                       "--cpus-per-task=96"]]
    assert records(repo, ".scontrol")[-1] == "requeue 4242"


def test_term_is_not_passed_on_and_slurm_decides(repo):
    process, (stage,) = start_stage(repo)
    # how Slurm ends a job (scontrol requeue, preemption, scancel): SIGTERM to every process at once
    process.send_signal(signal.SIGTERM)
    os.kill(stage, signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 75, out + err
    # the stage got it once (torchrun's agent, signalled twice, would abandon its ranks), and the
    # task did not requeue itself: Slurm requeues it, or cancels it
    assert (repo / "record.jsonl.signals").read_text() == "SIGTERM\n"
    assert records(repo, ".scontrol") == []
    assert "SIGTERM (the job is being ended" in out


def test_a_finished_stage_is_not_requeued(repo):
    process, _ = start_stage(repo, STAGE_SECONDS="1")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0 and records(repo, ".scontrol") == [], out + err
