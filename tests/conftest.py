import os
import subprocess
import sys

import pytest
from accelerate.state import AcceleratorState, GradientState

from summarize_from_feedback_details import synthetic_tldr, tiny_models, tldr_dataset

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# Lengths of the tiny default (hello_world.sh passes the same flags): queries are short enough for
# tiny models on a CPU, and some synthetic posts are long enough to need smart truncation.
TINY_TLDR_PARAMS = dict(length=160, max_sft_response_length=32, max_sft_query_response_length=192,
                        max_rm_response_length=80, max_rm_query_response_length=240)
TINY_CNNDM_PARAMS = dict(length=320, max_rm_response_length=80, max_rm_query_response_length=400)


def small_synthetic_args(output_dir: str, seed: int = 1) -> synthetic_tldr.Args:
    return synthetic_tldr.Args(
        output_dir=output_dir, seed=seed, num_sft_train=300, num_sft_validation=60, num_sft_test=60,
        num_comparison_train=300, num_comparison_validation=160, num_comparison_validation_cnndm=40,
    )


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


def accelerate_launcher(num_processes: int, config: str = None) -> list:
    """`accelerate launch` with a DeepSpeed config file, or DDP over gloo on CPU processes."""
    base = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch"]
    if config:
        return base + ["--config_file", config, "--num_processes", str(num_processes)]
    return base + ["--multi_gpu", "--num_processes", str(num_processes)]


def run_script(cmd: list, cwd, **env) -> subprocess.CompletedProcess:
    """A stage script as a user launches it, offline; a failure shows the tail of its output."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", **env)
    if "--multi_gpu" in cmd:  # DDP over gloo on CPU (with DeepSpeed this variable would drop the plugin)
        env["ACCELERATE_USE_CPU"] = "1"
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def run_in_process(main, args, workdir) -> None:
    """A stage's `main(args)` in this process, run from `workdir` (its runs/ folder lands there)."""
    cwd = os.getcwd()
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    try:
        main(args)
    finally:
        os.chdir(cwd)
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
