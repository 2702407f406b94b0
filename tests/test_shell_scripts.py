"""The shell side of launching: sbatches/*.sbatch with sbatches/common.sh, and hello_world.sh.

- Bash 4.2 (older cluster login nodes, e.g. RHEL/CentOS 7): under `set -u`, bash before 4.4 aborts
  on "${a[@]}" of an EMPTY array ("a[@]: unbound variable"), so an array that may be empty must be
  expanded as ${a[@]+"${a[@]}"}. No bash 4.2 ships with this machine's Debian (and BASH_COMPAT=42
  does not bring the old behaviour back), so a static check guards every script; TEST_BASH=<a bash
  4.2 build> also runs the sbatch wiring below (and tests/test_hello_world_script.py) under it.
- The sbatch files' wiring, with the launcher replaced by a recorder (LAUNCHER): the flags each
  stage gets, wandb only with TRACK=1, the node's whole memory. (`make test-slurm` submits them to
  a real one-node Slurm cluster.)
"""

import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASH = os.environ.get("TEST_BASH", "bash")
SBATCHES = ("sft.sbatch", "reward.sbatch", "ppo_left_padding.sbatch", "dpo.sbatch")
# the scripts a user runs on a login or compute node. tests/slurm/test_sbatch_chain.sh is not one:
# it runs as root on a Debian machine with its bash 5.
SCRIPTS = ("hello_world.sh", "sbatches/common.sh", *(f"sbatches/{name}" for name in SBATCHES))

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


@pytest.mark.parametrize("name", SBATCHES)
def test_sbatch_asks_for_the_whole_node(name):
    options = header(name)
    job = name.removesuffix(".sbatch")
    assert options == [f"--job-name={job}", "--array=0-11", "--ntasks=1", "--gpus-per-task=8", "--exclusive",
                       "--mem=0", "--output=slurm/logs/%x_%A_%a.out"]


# stands in for the launcher: records its argv and, like the stages, saves a model to --output_dir
RECORDER = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if "--output_dir" in sys.argv:
    out = sys.argv[sys.argv.index("--output_dir") + 1]
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "config.json"), "w").close()
"""


@pytest.fixture
def repo(tmp_path):
    """A submit directory with the sbatch files, the embedded default's inputs (empty) and a
    recorder as the launcher."""
    shutil.copytree(os.path.join(ROOT, "sbatches"), tmp_path / "repo/sbatches")
    for need in ("data/tldr/sft", "data/tldr/preference", "models/tiny/pythia-tiny-s"):
        (tmp_path / "repo" / need).mkdir(parents=True)
    recorder = tmp_path / "record.py"
    recorder.write_text(RECORDER)
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def chain(repo, models="EleutherAI/pythia-1b-deduped", task=0, names=SBATCHES, **env):
    """Runs array task `task` of sft, reward, ppo_left_padding and dpo.sbatch (or `names`) one after
    the other, as Slurm would (bash, in the submit directory); returns the last result and the
    recorded argvs. (Slurm runs dpo beside reward and ppo, after sft: it reads only the SFT model.)"""
    record = repo / "record.jsonl"
    record.unlink(missing_ok=True)
    n = len(models.split()) * 2
    environment = {
        "PATH": "/usr/bin:/bin", "HOME": str(repo), "RECORD": str(record), "LAUNCHER": str(repo / "record.py"),
        "MODELS": models, "SEEDS": "1 2", "OUTPUT_ROOT": str(repo / "out"), "SLURM_SUBMIT_DIR": str(repo / "repo"),
        "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": str(n),
        "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": str(n - 1), "SLURM_GPUS_PER_TASK": "8", **env}
    for name in names:
        result = subprocess.run([BASH, f"sbatches/{name}"], cwd=repo / "repo", env=environment,
                                capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            break
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return result, calls


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
    assert len(calls) == 4 and all("--track" not in c and "--deepspeed" not in c for c in calls)
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
    dpo, base = calls[3], str(repo / "repo")
    assert dpo[0] == f"{base}/summarize_from_feedback_details/dpo.py"
    out = str(repo / "out/models/pythia-tiny-s")
    assert flag(dpo, "--base_model") == f"{base}/models/tiny/pythia-tiny-s"
    assert flag(dpo, "--sft_model_path") == f"{out}/sft_2" and flag(dpo, "--output_dir") == f"{out}/dpo_2"
    assert flag(dpo, "--label_dataset") == f"{base}/data/tldr/preference"
    assert flag(dpo, "--query_dataset") == f"{base}/data/tldr/sft"
    assert flag(dpo, "--response_length") == "32" and flag(dpo, "--lr") == "1e-4"
    assert 100 <= int(flag(dpo, "--total_episodes")) <= 1000
    assert flag(dpo, "--local_micro_batch_size") == "32" and flag(dpo, "--gradient_accumulation_steps") == "1"
    assert flag(dpo, "--local_eval_batch_size") == "100"
    assert "--run_eval" in dpo and not {"--deepspeed", "--offload", "--track"} & set(dpo)


@pytest.mark.parametrize("name, missing", [("reward.sbatch", "SFT model"), ("ppo_left_padding.sbatch", "SFT model"),
                                           ("dpo.sbatch", "SFT model")])
def test_a_missing_earlier_model_stops_the_stage(repo, name, missing):
    result, calls = chain(repo, task=1, names=(name,))
    out = repo / "out/models/pythia-1b-deduped/sft_2"
    assert result.returncode == 2 and not calls
    assert f"no {missing} at {out}: did array task 1 of its job fail?" in result.stderr


def test_blank_launcher_is_refused(repo):
    result, calls = chain(repo, LAUNCHER=" ")
    assert result.returncode == 2 and "LAUNCHER is blank" in result.stderr and not calls
