"""The command line of the stages: nothing here changes a result but LoRA's settings, which DESIGN
section 1 counts as plumbing. `RunArgs`: the flags every training stage shares, word for word; `EngineArgs`:
those of the online stages' sampler and packed forwards; `parse_args` is tyro's, with our names for flags that
TRL, CleanRL or the paper's scripts name differently.
"""

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

import tyro

from summarize_from_feedback_details.infra.checkpoints import Resumable


@dataclass
class EngineArgs:
    """The memory and speed of the online stages' engines (rollout.py's sampler, packing.py's forwards), shared word
    for word by ppo_left_padding.py, rloo.py and online_dpo.py: listed after the method's memory and speed knobs
    (`class Args(RunArgs, EngineArgs, MethodArgs)`). None changes a sample; packing moves a result by float noise."""

    packing: bool = True
    """forwards on real tokens only (packing.py; the same result to float noise); --no_packing: padded"""
    compile_train: bool = False
    """the packed forwards (and backward) of the trained model(s) under torch.compile (packing.py)"""
    compile_decode: Resumable[bool] = True
    """on a GPU, run the decode step under torch.compile with CUDA graphs (mode reduce-overhead) when the weights
    are in the compute dtype (fp32, or bf16/fp16 under DeepSpeed); the first update pays the compile. CPU runs,
    and autocast over fp32 weights, decode eagerly"""
    free_decode_cache: Resumable[bool] = False
    """with the compiled decode: free its static KV cache after each rollout, before the training step (the first
    rollout prints its size: 5.0 GiB at Pythia-1B for 72 rows of 565 positions in bf16), at the cost of recording
    the CUDA graphs again every update"""
    async_worker: Resumable[Optional[str]] = None
    """with --async_steps >= 1: a worker process on this device (cpu, cuda:1) samples the next update's rollouts"""
    async_worker_threads: Resumable[int] = 1
    """the CPU threads of --async_worker cpu"""


@dataclass
class RunArgs:
    """The run plumbing of every training stage. A stage's Args inherits it, so tyro lists these flags, names
    and helps included, as if the stage declared them: after the method's fields and before the stage's own
    plumbing (`class Args(RunArgs, MethodArgs)`: a dataclass lists its last base's fields first)."""

    # naming
    run_name: Resumable[Optional[str]] = None
    """defaults to `{exp_name}__{seed}__{unix time of rank 0}`"""

    # checkpoints (DESIGN section 15): in `<output_dir>/checkpoints`
    checkpoint_every: Resumable[int] = 0
    """also save a checkpoint every this many updates (0: only on SIGTERM / SIGUSR1)"""
    keep_checkpoints: Resumable[int] = 1
    """the newest checkpoints to keep"""
    resume: Resumable[bool] = False
    """continue from the newest checkpoint (the same stage, seed and batch arithmetic; any process count)"""
    accept_changed_settings: Resumable[bool] = False
    """with --resume: continue although flags that change results (lr, lengths, model paths, ...) differ
    from the checkpoint's (refused otherwise; memory knobs and logging may always change)"""
    on_nonfinite: Resumable[Literal["stop", "skip"]] = "stop"
    """what a non-finite loss or gradient norm (and in the online stages a rollout's score, value, KL or
    advantage) does: `stop` ends the run (exit 1) naming the update, phase and tensor, saves no model and
    keeps the last checkpoint; `skip` skips that optimizer step (a rollout's: the rest of its update) and
    counts it (`nonfinite/skipped`)"""

    # tracking and the hub
    track: Resumable[bool] = False
    """also log to Weights & Biases (TensorBoard events and metrics.jsonl in runs/<run_name> are always written)"""
    wandb_project_name: Resumable[str] = "tldr_summarize"
    """the wandb project of --track"""
    wandb_entity: Resumable[Optional[str]] = None
    """the wandb team or user of --track (None: your default entity)"""
    push_to_hub: Resumable[bool] = False
    """upload the saved model to <hf_entity>/<base_model>__<exp_name>__tldr, revision <run_name> (else no hub call)"""
    hf_entity: Resumable[Optional[str]] = None
    """the hub user or organisation of --push_to_hub (None: the logged-in user)"""

    # LoRA and 4-bit base weights (DESIGN.md section 18)
    use_peft: bool = False
    """train LoRA adapters (peft) instead of every weight; heads (the reward model's, the critic's) train in
    full, and DPO, RLOO and online DPO take the policy with its adapter disabled as their reference.
    <output_dir> gets the adapter merged in (plain transformers loads it; every later stage reads it) and
    <output_dir>/adapter the adapter alone"""
    lora_r: int = 16
    """rank of the LoRA adapters"""
    lora_alpha: float = 32.0
    """LoRA scaling: an adapter's update is multiplied by lora_alpha / lora_r"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input. The stages run without dropout (N+ detail); > 0 makes the training
    forwards differ from the rollouts' and the reference's (PPO's and RLOO's first ratio is no longer 1,
    online DPO's first h no longer 0)"""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """module names to adapt (e.g. query_key_value dense); all-linear: every linear layer but the LM head"""
    load_in_4bit: bool = False
    """with --use_peft: the frozen base weights of the trained models in 4-bit NF4 (bitsandbytes; a CUDA
    GPU or an x86-64 CPU with AVX2; not under DeepSpeed). The saved merged model puts the adapter on the
    full-precision base (QLoRA's usual export)"""


TRL, CLEANRL, PAPER = "TRL's", "CleanRL's", "the paper's"
# Settings that another codebase names differently: foreign flag -> (whose name, [(our flag, what differs)]).
# The first of our flags that the stage has is suggested; a stage with none of them leaves the flag to tyro.
# Sources: TRL 1.12 (transformers' TrainingArguments under every config; SFTConfig, DPOConfig, RLOOConfig /
# GRPOConfig, the experimental PPOConfig; ModelConfig and ScriptArguments of its example scripts), TRL's
# PPOConfig before 0.12, CleanRL's ppo.py, and the paper's scripts (vwxyzjn/summarize_from_feedback_details).
# A nested name (`--ppo.num_mini_batches`, `--reward.kl_coef`) is also looked up by its last part, and a flag
# of ours given at another depth (`--kl_coef` for `--ppo.kl_coef`) is found by its name.
FOREIGN_FLAGS = {
    "learning_rate": (TRL + " and " + CLEANRL, [("lr", "")]),
    "per_device_train_batch_size": (TRL, [("local_micro_batch_size", "")]),
    "per_device_eval_batch_size": (TRL, [("local_eval_batch_size", "")]),
    "adam_epsilon": (TRL, [("eps", "")]),
    "lr_scheduler_type": (TRL, [("scheduler", "")]),
    "warmup_steps": (TRL, [("warm_up_steps", "")]),
    "optim": (TRL, [("optimizer", "adamw or adam")]),
    "report_to": (TRL, [("track", "a switch for wandb; TensorBoard and metrics.jsonl are always written")]),
    "max_steps": (TRL, [("total_episodes", "in episodes: updates x batch_size")]),
    "num_train_epochs": (TRL, [("total_episodes", "in episodes: epochs x the queries of the train split")]),
    "save_steps": (TRL, [("checkpoint_every", "")]),
    "save_total_limit": (TRL, [("keep_checkpoints", "")]),
    "resume_from_checkpoint": (TRL, [("resume", "a switch: the newest checkpoint in <output_dir>/checkpoints")]),
    "do_eval": (TRL, [("run_eval", "")]),
    "hub_model_id": (TRL, [("hf_entity", "the repo is <hf_entity>/<base_model>__<exp_name>__tldr")]),
    "model_name_or_path": (TRL, [("sft_model_path", "the model trained from; the tokenizer is --base_model"),
                                 ("base_model", "")]),
    "dataset_name": (TRL, [("label_dataset", "the preference pairs"), ("query_dataset", "")]),
    "completion_only_loss": (TRL, [("response_only_loss", "")]),
    "assistant_only_loss": (TRL, [("response_only_loss", "")]),
    "loss_type": (TRL, [("ipo", "a switch for the IPO loss; DPO's sigmoid loss is the default"),
                        ("grpo_loss", "grpo (DeepSeekMath) or dr_grpo")]),
    "beta": (TRL + " GRPO/RLOO", [("ppo.kl_coef", ""), ("kl_coef", "")]),
    "epsilon": (TRL + " GRPO/RLOO", [("ppo.cliprange", ""), ("cliprange", "")]),
    "num_iterations": (TRL + " GRPO/RLOO", [("ppo.noptepochs", ""), ("noptepochs", "")]),
    "num_generations": (TRL + " GRPO/RLOO", [("rloo_k", "samples per query")]),
    "max_completion_length": (TRL, [("response_length", "the tokens generated per query")]),
    "max_new_tokens": (TRL, [("response_length", "the tokens generated per query")]),
    "num_mini_batches": (TRL, [("nminibatches", "")]),
    "num_ppo_epochs": (TRL, [("ppo.noptepochs", ""), ("noptepochs", "")]),
    "num_total_batches": (TRL, [("total_episodes", "num_updates = total_episodes // batch_size")]),
    "micro_batch_size": (TRL + " and " + PAPER, [("local_micro_batch_size", "per process, not over all of them")]),
    "missing_eos_penalty": (TRL, [("penalty_reward_value", "the score a response without EOS gets, not an amount "
                                                           "taken off")]),
    "stop_token": (TRL, [("truncate_token", "")]),
    "stop_token_id": (TRL, [("truncate_token", "the tokenizer's EOS, the only choice")]),
    "num_sample_generations": (TRL, [("print_sample_output_freq", "every this many updates, not a count")]),
    "init_kl_coef": (TRL, [("ppo.kl_coef", ""), ("kl_coef", "")]),
    "adap_kl_ctrl": (TRL, [("ppo.use_adaptive_kl", "")]),
    "ppo_epochs": (TRL, [("ppo.noptepochs", ""), ("noptepochs", "")]),
    "forward_batch_size": (TRL, [("local_rollout_forward_batch_size", "")]),
    "total_timesteps": (CLEANRL, [("total_episodes", "")]),
    "num_minibatches": (CLEANRL, [("nminibatches", "")]),
    "update_epochs": (CLEANRL, [("ppo.noptepochs", ""), ("noptepochs", "")]),
    "clip_coef": (CLEANRL, [("ppo.cliprange", "the value loss clips at --ppo.cliprange_value"), ("cliprange", "")]),
    "gae_lambda": (CLEANRL, [("ppo.lam", "")]),
    "ppo.nminibatches": (PAPER, [("nminibatches", "the one the paper's ppo.py read; --ppo.nminibatches did nothing")]),
    "truncate_token_id": (PAPER, [("truncate_token", "the tokenizer's EOS, the only choice")]),
    "hf_repo_id": (PAPER, [("hf_entity", "the repo is <hf_entity>/<base_model>__<exp_name>__tldr")]),
    "hf_repo_revision": (PAPER, [("run_name", "the revision pushed to")]),
}
# never suggested for a foreign flag: fields derived at run time (a value given to them is ignored; PPO's
# batch_size is one of them)
RUN_TIME_FIELDS = ("world_size", "local_batch_size", "local_mini_batch_size", "mini_batch_size", "batch_size",
                   "num_updates")


def flag_names(args_class, prefix: str = "") -> set:
    """The flags of a tyro Args dataclass as field paths with underscores (`lr`, `ppo.kl_coef`)."""
    names = set()
    hints = typing.get_type_hints(args_class)
    for f in dataclasses.fields(args_class):
        if dataclasses.is_dataclass(hints[f.name]):
            names |= flag_names(hints[f.name], f"{prefix}{f.name}.")
        else:
            names.add(prefix + f.name)
    return names


def foreign_flag_hint(flag: str, ours: set, foreign: dict) -> Optional[str]:
    """Why `flag` (as typed, `--x.y=1` or `--x-y` too) is not a flag of ours, where the stage (`ours`, from
    flag_names) has the setting under another name; None for our own flags (`--no-<switch>` included) and
    for flags we know nothing about, which tyro answers."""
    typed = flag.split("=", 1)[0]
    name = typed[2:].replace("-", "_")
    prefix, _, leaf = name.rpartition(".")
    switch = prefix + "." + leaf[3:] if prefix else leaf[3:]  # (tyro's `--no-<switch>` and `--ppo.no-<switch>`)
    if name in ours or (leaf.startswith("no_") and switch in ours):
        return None
    for key in (name, leaf):
        source, targets = foreign.get(key, ("", []))
        for target, note in targets:
            if target in ours:
                return f"{typed} is {source} name; here it is --{target}" + (f" ({note})" if note else "")
    # one of our flags at another depth (`--kl_coef`, `--ppo.lr`, the paper's `--reward.adaptive_kl.target`)
    same = sorted(n for n in ours if n.rpartition(".")[2] == leaf and leaf not in RUN_TIME_FIELDS)
    return f"{typed} is --{' or --'.join(same)} here" if same else None


def parse_args(args_class, foreign: Optional[dict] = None, args: Optional[list] = None):
    """`tyro.cli(args_class)`, after a look for flags that TRL, CleanRL or the paper's scripts name differently
    (FOREIGN_FLAGS, with the stage's own `foreign` entries on top): those stop with our name for them (exit 2,
    like any usage error), where tyro would only say "unrecognized". Everything else is tyro's, its
    misspelling suggestions included. `args`: the command line without the program (default sys.argv[1:])."""
    argv = sys.argv[1:] if args is None else list(args)
    argv = argv[:argv.index("--")] if "--" in argv else argv  # (after "--" every token is a value)
    ours, table = flag_names(args_class), {**FOREIGN_FLAGS, **(foreign or {})}
    hints = [foreign_flag_hint(token, ours, table) for token in argv if token.startswith("--")]
    hints = [hint for hint in hints if hint]
    if hints:
        prog = os.path.basename(sys.argv[0])
        print("\n".join(f"{prog}: {hint}" for hint in hints + ["see --help for every flag"]), file=sys.stderr)
        raise SystemExit(2)
    return tyro.cli(args_class, args=args)
