import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

import forked_launches
import pytest
from accelerate.state import AcceleratorState, GradientState

from summarize_from_feedback_details import synthetic_tldr, tiny_models, tldr_dataset
from summarize_from_feedback_details.infra.ports import EPHEMERAL_START, free_port

# tests/cpu_seconds.py: `--cpu-durations`, what each test cost in CPU, launched runs included (make test
# shows it); pytester runs pytest inside a test (tests/test_cpu_seconds.py)
pytest_plugins = ["cpu_seconds", "pytester"]

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_default_array(name: str) -> list:
    """The words of bash array `name` in sbatches/tiny_default.sh (the embedded default's settings)."""
    script = f'source sbatches/tiny_default.sh; printf "%s\\n" "${{{name}[@]}}"'
    return subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, check=True, capture_output=True,
                          text=True).stdout.split()


def tiny_lengths() -> tuple:
    """TINY_LENGTHS, the lengths hello_world.sh's data stage passes, as (tldr_params, cnndm_params)."""
    params = {"tldr_params": {}, "cnndm_params": {}}
    words = tiny_default_array("TINY_LENGTHS")
    for flag, value in zip(words[::2], words[1::2]):
        group, key = flag.removeprefix("--").split(".")
        params[group][key] = int(value)
    assert all(params.values()), f"sbatches/tiny_default.sh: TINY_LENGTHS lacks a group: {words}"
    return params["tldr_params"], params["cnndm_params"]


# the tests' datasets have hello_world's lengths: queries short enough for tiny models on a CPU, some
# synthetic posts long enough to need smart truncation
TINY_TLDR_PARAMS, TINY_CNNDM_PARAMS = tiny_lengths()


def small_synthetic_args(output_dir: str, seed: int = 1) -> synthetic_tldr.Args:
    return synthetic_tldr.Args(
        output_dir=output_dir, seed=seed, num_sft_train=300, num_sft_validation=60, num_sft_test=60,
        num_comparison_train=300, num_comparison_validation=160, num_comparison_validation_cnndm=40,
        # pairs of two policies' summaries only: the stages' short runs on toy models check their
        # mechanics on pairs that differ in more than one fact (test_rlhf_learns uses minimal pairs)
        minimal_pair_fraction=0.0,
    )


def first_rows(dataset: str, sizes: dict, output: str) -> None:
    """The data stage's `dataset` with each split named in `sizes` cut to its first sizes[split] rows (the
    others whole), saved to `output` with the dataset's tokenizer record."""
    from datasets import DatasetDict, load_from_disk

    from summarize_from_feedback_details.infra.loading import TOKENIZER_RECORD

    data = load_from_disk(dataset)
    DatasetDict({split: ds.select(range(sizes[split])) if split in sizes else ds for split, ds in data.items()}
                ).save_to_disk(output)
    if os.path.isfile(os.path.join(dataset, TOKENIZER_RECORD)):
        shutil.copy(os.path.join(dataset, TOKENIZER_RECORD), output)


def tiny_dataset_args(raw_dir: str, tokenizer_dir: str, output_dir: str, **overrides) -> tldr_dataset.Args:
    args = tldr_dataset.Args(
        base_model=tokenizer_dir,
        sft_dataset=os.path.join(raw_dir, "tldr_sft"),
        preference_dataset=os.path.join(raw_dir, "comparisons"),
        output_dir=output_dir,
    )
    for key, value in TINY_TLDR_PARAMS.items():
        setattr(args.tldr_params, key, value)
    for key, value in TINY_CNNDM_PARAMS.items():
        setattr(args.cnndm_params, key, value)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@pytest.fixture(scope="session")
def raw_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("synthetic") / "raw")
    synthetic_tldr.generate(small_synthetic_args(path))
    return path


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory, raw_dir):
    path = str(tmp_path_factory.mktemp("tiny") / "models")
    tiny_models.build(tiny_models.Args(
        corpus=os.path.join(raw_dir, "tldr_sft", "train.jsonl"), output_dir=path, sizes=["s", "m"], pretrain_steps=5,
    ))
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(models_dir):
    return os.path.join(models_dir, "pythia-tiny-s")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return tldr_dataset.load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_datasets(tmp_path_factory, raw_dir, tokenizer_dir):
    """The tokenized tiny default: (output folder, stats)."""
    out = str(tmp_path_factory.mktemp("tldr") / "tldr")
    stats = tldr_dataset.run(tiny_dataset_args(raw_dir, tokenizer_dir, out))
    return out, stats


# the two-process and resume tests of reward.py and dpo.py: two epochs of these pairs at a global batch of 30
HALF_PAIRS = 150


@pytest.fixture(scope="session")
def half_pairs_datasets(tiny_datasets, tmp_path_factory):
    """`tiny_datasets` with the first HALF_PAIRS of the 300 training pairs and the first 30 SFT references
    (what a reward model's normalisation scores): two epochs in 10 updates instead of 20, the other
    splits whole. (folder, stats)"""
    out = tmp_path_factory.mktemp("half_pairs")
    for name, sizes in (("preference", {"train": HALF_PAIRS}), ("sft", {"train": 30})):
        first_rows(os.path.join(tiny_datasets[0], name), sizes, str(out / name))
    return str(out), tiny_datasets[1]


# The modules that cost the most, in the order they start: two pytest-xdist workers each take one
# module at a time (make test), so the longest go first and the short ones fill in around them. By CPU
# seconds on a fresh clone (--cpu-durations, bf667dd): 798, 225, 185, 176, 142, 100, then 98, 83, 69,
# 55 and 52, which in the alphabetical order started late and left one worker alone at the end.
LONGEST_MODULES = ("test_rlhf_learns.py", "test_sft.py", "test_ppo.py", "test_reward.py", "test_dpo.py", "test_gpu.py",
                   "test_tldr_dataset.py", "test_run_infra.py", "test_gpu_report.py", "test_architectures.py",
                   "test_forked_launches.py")


def pytest_collection_modifyitems(items):
    def start(item):
        name = item.path.name
        return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)

    items.sort(key=start)  # (a stable sort: each module's tests keep their order)


def is_wall_clock(key: str) -> bool:
    """A metric the wall clock decides (episodes per second, time/ phases, throughput/, the overlapped
    sampler's seconds): it differs between runs that are otherwise equal."""
    return key.endswith("/eps") or key.startswith(("time/", "throughput/", "async/worker_"))


def without_rates(metrics: list) -> list:
    """Metric lines without the wall-clock metrics."""
    return [{k: v for k, v in m.items() if not is_wall_clock(k)} for m in metrics]


def assert_throughput(lines: list, tokens_per_update: int) -> None:
    """Every training line (those with time/update) logs a positive update time and the global
    batch's tokens per second of it; `tokens_per_update`: positions of the global batch."""
    timed = [m for m in lines if "time/update" in m]
    assert timed and all(m["time/update"] > 0 for m in timed)
    for m in timed:
        assert m["throughput/tokens_per_second"] == pytest.approx(tokens_per_update / m["time/update"], rel=1e-9)


@pytest.fixture(scope="session")
def checkpoints(models_dir, tmp_path_factory):
    """(SFT, reward model) stand-ins for the online stages' tests (PPO, RLOO, online DPO). The tiny base
    model (5 pretraining steps) almost never samples EOS, so the "SFT" is the base model with an EOS
    bias: the final layer norm's bias gets a unit vector u and EOS's output row 0.5 u, so about half of
    the 32-token rollouts end, at varied lengths, and the masks, the EOS penalty and the score placement
    take part in every run. The reward model is that backbone with a seeded head, saved as reward.py
    saves one."""
    import torch
    from transformers import AutoModelForCausalLM

    from summarize_from_feedback_details import reward
    from summarize_from_feedback_details.infra import loading

    base = os.path.join(models_dir, "pythia-tiny-s")
    folder = tmp_path_factory.mktemp("online_checkpoints")
    sft_path, rm_path = str(folder / "sft"), str(folder / "reward_model")
    tokenizer = loading.load_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    u = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.gpt_neox.final_layer_norm.bias += 3 * u / u.norm()
        model.get_output_embeddings().weight[tokenizer.eos_token_id] += 0.5 * u / u.norm()
    model.save_pretrained(sft_path)
    tokenizer.save_pretrained(sft_path)
    reward.reward_model_to_train(sft_path, tokenizer, head_seed=1).save_pretrained(rm_path)
    tokenizer.save_pretrained(rm_path)
    return sft_path, rm_path


def launch_port() -> int:
    """A free rendezvous port for a launched run (infra/ports.py): from 20000 up, above the benchmarks'
    own; under pytest-xdist each worker draws only the ports of its own residue modulo the number of
    workers, so two workers never hand out one port."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return free_port(range(20000 + worker, EPHEMERAL_START, workers))


def side_by_side(**calls) -> dict:
    """name -> the finished Future of call() for `calls` run at once, each in a thread: .result() gives its
    value, or raises its failure in the test that reads it. For launches: one launch's ranks wait on each
    other (start, rendezvous, collectives) and on the disk, so launches side by side fill the time one leaves
    idle (the runs are the same; each launch has its own port, output and run folder)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
    return futures


def accelerate_launcher(num_processes: int, config: str = None) -> list:
    """`accelerate launch` with a DeepSpeed config file, or DDP over gloo on CPU processes."""
    base = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch",
            "--main_process_port", str(launch_port())]
    if config:
        return base + ["--config_file", config, "--num_processes", str(num_processes)]
    return base + ["--multi_gpu", "--num_processes", str(num_processes)]


def subprocess_with(**functions):
    """A stand-in for one module's own `subprocess` name (monkeypatch.setattr(module, "subprocess", ...)):
    the real module's contents with `functions` replaced, so that only that module's calls change."""
    return types.SimpleNamespace(**{**vars(subprocess), **functions})


def launched(cmd: list, cwd, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, ...), without the cost of starting Python
    where `cmd` is a launch or a script of this interpreter (tests/forked_launches.py)."""
    if forked_launches.launchable(cmd):
        return forked_launches.run(cmd, cwd, env, timeout)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def run_script(cmd: list, cwd, **env) -> subprocess.CompletedProcess:
    """A stage script as a user launches it (forked: `launched`), offline; a failure shows the tail of its
    output."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", **env)
    if "--multi_gpu" in cmd:  # DDP over gloo on CPU (with DeepSpeed this variable would drop the plugin)
        env["ACCELERATE_USE_CPU"] = "1"
    result = launched(cmd, cwd, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def as_flags(settings: dict) -> tuple:
    """The command-line flags of `settings` (a stage's Args fields as keyword overrides), for a launched
    run of the settings an in-process run takes as keywords."""
    return tuple(part for key, value in settings.items() for part in (f"--{key}", str(value)))


def command_line_flags(args) -> list:
    """The command line of a stage's `args`: its flags whose values differ from the defaults. Fields
    derived at run time are not flags (tyro.conf.Suppress), though a run fills them in."""
    import typing

    import tyro

    suppressed = typing.get_args(tyro.conf.Suppress[int])[1:]
    hints, default = typing.get_type_hints(type(args), include_extras=True), type(args)()
    out = []
    for key, value in vars(args).items():
        if getattr(default, key) == value or any(m in suppressed for m in typing.get_args(hints[key])[1:]):
            continue
        out.append(f"--{key}" if value is True else f"--no_{key}" if value is False else f"--{key}={value}")
    return out


def ratios_near_one() -> tuple:
    """(logratio of 2 epochs x 2 minibatches x 8 x 16 units within ~1e-4 of 0, the mask of the units that
    count, the variance of their ratios in float64, 1.045e-8): the known answer for PPO's and RLOO's
    ppo/val/ratio_var, where E[r^2] - E[r]^2 in float32 cancels to a multiple of 1.2e-7."""
    import torch

    g = torch.Generator().manual_seed(0)
    logratio = 1e-4 * torch.randn(2, 2, 8, 16, generator=g)
    mask = torch.rand(2, 2, 8, 16, generator=g) > 0.25
    return logratio, mask, logratio.exp()[mask].double().var(correction=0).item()


class BackendFailingAfterFirst:
    """A torch.compile backend whose first compile succeeds (the graph runs as captured) and every
    later one raises, as a toolchain that breaks on a recompile would; `compiles` counts them."""

    def __init__(self):
        self.compiles = 0

    def __call__(self, graph_module, example_inputs):
        self.compiles += 1
        if self.compiles > 1:
            raise RuntimeError("the recompile failed")
        return graph_module.forward


def tiny_llama_config(vocab_size: int, hidden_size: int = 32, **extra):
    """A Llama-style config for the tests' random models: RMSNorm, SwiGLU, grouped-query attention (4
    query heads, 2 key/value heads), tied embeddings; EOS id 0 as BOS and EOS."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True, bos_token_id=0,
                       eos_token_id=0, **extra)


def run_in_process(main, args, workdir) -> None:
    """A stage's `main(args)` in this process, run from `workdir` (its runs/ folder lands there)."""
    cwd = os.getcwd()
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        main(args)
    finally:
        os.chdir(cwd)
        for sig, handler in handlers.items():  # the stage's stop-signal handlers end with it
            signal.signal(sig, handler)
        # accelerate keeps process-wide singletons; the next in-process run starts clean
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.fixture
def attention_calls(monkeypatch):
    """The sequence length of every GPT-NeoX attention call from here on. Activation checkpointing
    shows up as one extra call per layer and training forward (the backward's recompute), and a
    generation that keeps its KV cache as calls of length 1 (one new token each)."""
    from transformers.models.gpt_neox import modeling_gpt_neox

    lengths, original = [], modeling_gpt_neox.GPTNeoXAttention.forward

    def counted(self, hidden_states, *args, **kwargs):
        lengths.append(hidden_states.shape[1])
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(modeling_gpt_neox.GPTNeoXAttention, "forward", counted)
    return lengths


def signal_on_call(monkeypatch, module, name: str, call: int, signum=signal.SIGUSR1) -> None:
    """This process gets `signum` from inside the `call`-th call of `module.name`: in the middle of
    an update, as a preemption notice would arrive."""
    original, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


# torchrun's agent (accelerate launch with several processes or DeepSpeed) forwards these to the
# ranks (its --signals_to_handle, read from PET_SIGNALS_TO_HANDLE); SIGUSR1 is not among its
# defaults. The sbatch files set the same.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def run_until_signalled(cmd: list, cwd, metrics_path, after_lines: int, **env) -> subprocess.CompletedProcess:
    """A stage as a user launches it, sent SIGUSR1 (as Slurm does before a preemption) once
    `after_lines` lines are in its metrics.jsonl: it must checkpoint at the end of the update in
    progress and exit; the stdout says where."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PET_SIGNALS_TO_HANDLE=FORWARDED_SIGNALS, **env)
    if "--multi_gpu" in cmd:
        env["ACCELERATE_USE_CPU"] = "1"
    if forked_launches.launchable(cmd):
        process = forked_launches.start(cmd, cwd, env)
    else:
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    while process.poll() is None:
        if os.path.exists(metrics_path):
            with open(metrics_path) as f:
                if sum(1 for _ in f) >= after_lines:
                    process.send_signal(signal.SIGUSR1)
                    break
        time.sleep(0.02)
    stdout, stderr = process.communicate(timeout=600)
    assert "checkpoint saved at update" in stdout, stdout[-3000:] + stderr[-3000:]
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def stop_and_copy(cmd: list, workdir, name: str, updates: int) -> tuple:
    """`cmd` (run `name`: output in workdir/name, run folder workdir/runs/name) stopped by SIGUSR1 once
    its first update is logged. It leaves exactly one checkpoint, of an update before its last
    (`updates`), and the metric lines up to it. Returns (the checkpoint's folder name, workdir/moved
    holding a copy of the output and run folders, to resume elsewhere)."""
    workdir = pathlib.Path(workdir)
    stopped = run_until_signalled(cmd, workdir, workdir / "runs" / name / "metrics.jsonl", 1)
    (checkpoint,) = os.listdir(workdir / name / "checkpoints")
    update = int(checkpoint[len("update-"):])
    assert f"checkpoint saved at update {update}" in stopped.stdout and update < updates
    with open(workdir / "runs" / name / "metrics.jsonl") as f:
        assert sum(1 for _ in f) == update
    moved = workdir / "moved"
    shutil.copytree(workdir / name, moved / name)
    shutil.copytree(workdir / "runs" / name, moved / "runs" / name)
    return checkpoint, moved
