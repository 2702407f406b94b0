"""The command line of the stages: every flag's --help says what it does, and flags that TRL, CleanRL or the
paper's scripts spell differently stop with our name for them (issue 24, items 1 and 9).

In-process throughout (tyro's parser and `--help` of the imported Args): a subprocess per stage would pay
the torch import each time."""

import ast
import collections
import contextlib
import dataclasses
import inspect
import io
import re
import textwrap
import typing
import warnings
from dataclasses import dataclass

import pytest
import tyro

from summarize_from_feedback_details import (dpo, online_dpo, ppo_left_padding, reward, rloo, sft, synthetic_tldr,
                                             tiny_models)
from summarize_from_feedback_details.infra import checkpoints
from summarize_from_feedback_details.infra.checkpoints import resumable_fields
from summarize_from_feedback_details.infra.flags import FOREIGN_FLAGS, EngineArgs, RunArgs, flag_names, parse_args

STAGES = {"sft": sft, "reward": reward, "dpo": dpo, "ppo_left_padding": ppo_left_padding, "rloo": rloo,
          "online_dpo": online_dpo, "tiny_models": tiny_models, "synthetic_tldr": synthetic_tldr}
TRAINING_STAGES = ("sft", "reward", "dpo", "ppo_left_padding", "rloo", "online_dpo")
DERIVING_THE_BATCH = ("ppo_left_padding", "rloo", "online_dpo")  # (batch_size is derived, not a flag)
# speed knobs that change a result, so a resume refuses a changed one (not Resumable): packing and the compiled
# body to float noise, the rollout forward batch which responses are drawn
SPEED_KNOBS_KEPT_ON_RESUME = {"packing", "compile_train", "local_rollout_forward_batch_size"}
METHOD, MEMORY_AND_SPEED, RUN, STAGE_PLUMBING = range(4)


def flag_helps(args_class) -> dict:
    """--flag -> the help text that `--help` shows for it, without tyro's "(default: ...)" and with its
    whitespace collapsed. (tyro's get_parser is deprecated but is the API that hands out each flag's help;
    `test_help_texts_are_what_help_prints` checks that they are what --help prints.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        parser = tyro.extras.get_parser(args_class)
    helps = {}
    for action in parser._actions:
        if "--help" in action.option_strings:
            continue
        text = (action.help or "").replace("%%", "%")  # (argparse's escape of %)
        default = text.rfind("(default:")
        helps[action.option_strings[0]] = " ".join((text[:default] if default >= 0 else text).split())
    return helps


def help_problems(helps: dict) -> list:
    """Flags without a help of their own: an empty one, or one that other flags share (what a `# group`
    comment above undocumented fields gives them all)."""
    problems = [f"{flag} has no help" for flag, text in helps.items() if not text]
    by_text = collections.defaultdict(list)
    for flag, text in helps.items():
        if text:
            by_text[text].append(flag)
    problems += [f"{' '.join(flags)} share the help {text!r}" for text, flags in by_text.items() if len(flags) > 1]
    return problems


@pytest.mark.parametrize("stage", STAGES)
def test_every_flag_has_a_help_of_its_own(stage):
    helps = flag_helps(STAGES[stage].Args)
    assert len(helps) >= 10, helps  # (the parser really lists the flags)
    assert help_problems(helps) == []


@dataclass
class _Undocumented:
    # optimizer
    lr: float = 3e-6
    eps: float = 1e-5

    seed: int = 1
    documented: bool = False
    """a flag with its own help"""


def test_the_help_check_can_fail():
    helps = flag_helps(_Undocumented)
    assert helps["--lr"] == helps["--eps"] == "optimizer"  # (tyro's inheritance of the group comment)
    problems = help_problems(helps)
    assert any("--lr" in p and "--eps" in p and "optimizer" in p for p in problems), problems
    assert "--seed has no help" in problems
    assert not any("--documented" in p for p in problems)


@pytest.mark.parametrize("stage", STAGES)
def test_help_texts_are_what_help_prints(stage, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # (one column of option groups, as on a terminal)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        tyro.cli(STAGES[stage].Args, args=["--help"])
    assert exit_info.value.code == 0
    shown = " ".join(re.sub("[│╭╮╰╯─]", " ", out.getvalue()).split())  # (box borders and wrapping undone)
    assert [flag for flag, text in flag_helps(STAGES[stage].Args).items() if text not in shown] == []


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_training_stages_have_on_nonfinite(stage):
    args_class = STAGES[stage].Args
    assert typing.get_args(typing.get_type_hints(args_class)["on_nonfinite"]) == ("stop", "skip")
    assert args_class().on_nonfinite == "stop"


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_training_stages_parse_their_command_line_with_parse_args(stage):
    """`python <stage>.py ...` goes through infra.flags.parse_args, not tyro.cli directly."""
    tree = ast.parse(open(STAGES[stage].__file__).read())
    guard = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
    assert len(guard) == 1 and "main(parse_args(Args))" in ast.unparse(guard[0])


@pytest.mark.parametrize("stage, argv, suggestion", [
    ("ppo_left_padding", ["--ppo.num_mini_batches", "4"], "here it is --nminibatches"),
    ("ppo_left_padding", ["--num-mini-batches=4"], "here it is --nminibatches"),
    ("ppo_left_padding", ["--ppo.nminibatches", "4"], "here it is --nminibatches"),  # (the paper's unused one)
    ("ppo_left_padding", ["--num_ppo_epochs", "2"], "here it is --ppo.noptepochs"),
    ("ppo_left_padding", ["--init_kl_coef", "0.1"], "here it is --ppo.kl_coef"),
    ("ppo_left_padding", ["--beta", "0.1"], "here it is --ppo.kl_coef"),
    ("ppo_left_padding", ["--kl_coef", "0.1"], "--kl_coef is --ppo.kl_coef here"),
    ("ppo_left_padding", ["--reward.kl_coef", "0.1"], "--reward.kl_coef is --ppo.kl_coef here"),
    ("ppo_left_padding", ["--reward.adaptive_kl.target", "3"], "is --ppo.target here"),
    ("ppo_left_padding", ["--ppo.total_episodes", "1024"], "is --total_episodes here"),
    ("ppo_left_padding", ["--total_timesteps", "1024"], "here it is --total_episodes"),
    ("ppo_left_padding", ["--missing_eos_penalty", "1"], "here it is --penalty_reward_value"),
    ("ppo_left_padding", ["--model_name_or_path", "m"], "here it is --sft_model_path"),
    ("sft", ["--learning_rate", "1e-5"], "here it is --lr"),
    ("sft", ["--per_device_train_batch_size", "2"], "here it is --local_micro_batch_size"),
    ("sft", ["--model_name_or_path", "m"], "here it is --base_model"),
    ("reward", ["--model_name_or_path", "m"], "here it is --sft_model_path"),
    ("reward", ["--dataset_name", "d"], "here it is --label_dataset"),
    ("dpo", ["--loss_type", "ipo"], "here it is --ipo"),
    ("rloo", ["--beta", "0.05"], "here it is --kl_coef"),
    ("rloo", ["--num_generations", "4"], "here it is --rloo_k"),
    ("rloo", ["--loss_type", "dr_grpo"], "here it is --grpo_loss"),
    ("rloo", ["--num_ppo_epochs", "2"], "here it is --noptepochs"),
    ("dpo", ["--lr_scheduler_type", "linear"], "here it is --scheduler"),
])
def test_foreign_flags_stop_with_our_name(stage, argv, suggestion, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(STAGES[stage].Args, args=["--seed", "3", *argv])
    assert exit_info.value.code != 0
    assert suggestion in capsys.readouterr().err


def test_our_own_flags_in_every_spelling_reach_tyro():
    args = parse_args(ppo_left_padding.Args, args=[
        "--ppo.kl-coef", "0.1", "--ppo.no-whiten-rewards", "--no_compile_decode", "--local_micro_batch_size=2",
        "--on_nonfinite", "skip", "--lora_target_modules", "query_key_value", "dense"])
    assert (args.ppo.kl_coef, args.ppo.whiten_rewards, args.compile_decode, args.local_micro_batch_size,
            args.on_nonfinite, args.lora_target_modules) == (0.1, False, False, 2, "skip", ["query_key_value", "dense"])
    assert parse_args(dpo.Args, args=["--beta", "0.1"]).beta == 0.1  # (DPO's own beta is no KL coef)


def test_unknown_flags_are_left_to_tyro(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(sft.Args, args=["--lrr", "1e-5"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "here it is" not in captured.err and "--lrr" in captured.out + captured.err  # (tyro's message)


def test_every_foreign_flag_leads_to_a_flag_that_exists():
    """A typo in FOREIGN_FLAGS (a flag renamed since) would make its suggestion a dead end."""
    flags = {stage: flag_names(STAGES[stage].Args) for stage in TRAINING_STAGES}
    for name, (source, targets) in FOREIGN_FLAGS.items():
        assert source and targets, name
        for target, _ in targets:
            assert any(target in stage_flags for stage_flags in flags.values()), (name, target)
        assert not all(name in stage_flags for stage_flags in flags.values()), f"--{name} is a flag of every stage"
    assert {"lr", "nminibatches", "ppo.kl_coef", "ppo.noptepochs", "on_nonfinite"} <= flags["ppo_left_padding"]


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_fields_derived_at_run_time_are_not_flags(stage, capsys):
    """PPO's batch_size, num_updates, world_size, ...: derived from other flags and overwritten, so a
    value given for one would vanish without a word. They are not flags: tyro refuses them (exit 2)."""
    args_class = STAGES[stage].Args
    derived = [f for f in ("world_size", "local_batch_size", "num_updates") if hasattr(args_class(), f)]
    derived += [f for f in ("batch_size", "mini_batch_size", "local_mini_batch_size") if hasattr(args_class(), f)
                and stage in DERIVING_THE_BATCH]
    helps = flag_helps(args_class)
    for name in derived:
        assert f"--{name}" not in helps and f"--{name.replace('_', '-')}" not in helps
        with pytest.raises(SystemExit) as refused:
            parse_args(args_class, args=[f"--{name}", "512"])
        assert refused.value.code == 2 and "Unrecognized" in capsys.readouterr().err
    if stage not in DERIVING_THE_BATCH:  # (sft/reward/dpo take the global batch, derive the accumulation)
        assert parse_args(args_class, args=["--batch_size", "64"]).batch_size == 64


def sections(args_class) -> list:
    """(field, section) for each field of a stage's Args in their order: the method's (what changes a
    result), memory and speed (Resumable, or a speed knob), the shared RunArgs, the stage's own plumbing."""
    names = [f.name for f in dataclasses.fields(args_class)]
    run_fields, resumable = {f.name for f in dataclasses.fields(RunArgs)}, resumable_fields(args_class)
    last_run_field = max(i for i, name in enumerate(names) if name in run_fields)
    return [(name, RUN if name in run_fields else STAGE_PLUMBING if i > last_run_field
             else MEMORY_AND_SPEED if name in resumable | SPEED_KNOBS_KEPT_ON_RESUME else METHOD)
            for i, name in enumerate(names)]


def under_the_memory_and_speed_header(method_args) -> dict:
    """field -> whether MethodArgs declares it below its `# memory and speed` comment."""
    source = textwrap.dedent(inspect.getsource(method_args))
    header = next(i for i, line in enumerate(source.splitlines()) if line.strip().startswith("# memory and speed"))
    declared = [node for node in ast.parse(source).body[0].body if isinstance(node, ast.AnnAssign)]
    return {node.target.id: node.lineno - 1 > header for node in declared}


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_args_read_algorithm_first(stage):
    """DESIGN section 1: the method's hyperparameters and data, then memory and speed under their header,
    then the run plumbing (RunArgs' fields, then the stage's own), which changes no result."""
    args_class = STAGES[stage].Args
    order = sections(args_class)
    assert [section for _, section in order] == sorted(section for _, section in order), order
    assert order[0][1] == METHOD
    below = under_the_memory_and_speed_header(STAGES[stage].MethodArgs)
    if issubclass(args_class, EngineArgs):  # (the online stages: the engine's knobs follow the method's)
        below |= {f.name: True for f in dataclasses.fields(EngineArgs)}
    assert below == {name: section == MEMORY_AND_SPEED for name, section in order if section <= MEMORY_AND_SPEED}
    hints, resumable = typing.get_type_hints(args_class, include_extras=True), resumable_fields(args_class)
    for name, section in order:
        if section == STAGE_PLUMBING:  # may change on resume, or is no flag at all
            assert name in resumable or "Suppress" in str(hints[name]), name


def test_the_order_check_can_fail():
    @dataclass
    class MethodArgs:
        lr: float = 1.0
        # memory and speed
        local_micro_batch_size: checkpoints.Resumable[int] = 1
        seed: int = 1  # a method field among the memory knobs

    @dataclass
    class Args(RunArgs, MethodArgs):
        output_dir: checkpoints.Resumable[str] = ""

    order = sections(Args)
    assert [section for _, section in order][:3] == [METHOD, MEMORY_AND_SPEED, METHOD]
    assert order[-1] == ("output_dir", STAGE_PLUMBING)
    assert under_the_memory_and_speed_header(MethodArgs) == {"lr": False, "local_micro_batch_size": True, "seed": True}


@pytest.mark.parametrize("stage", TRAINING_STAGES)
def test_run_fields_are_declared_once_in_run_args(stage):
    """The run plumbing every stage shares comes from infra.flags.RunArgs, which tyro flattens: each stage's
    Args inherits it and declares none of its fields again (a redeclared field would drift)."""
    args_class, method_args = STAGES[stage].Args, STAGES[stage].MethodArgs
    assert issubclass(args_class, RunArgs) and issubclass(args_class, method_args)
    own = set(vars(method_args).get("__annotations__", {})) | set(vars(args_class).get("__annotations__", {}))
    assert not own & {f.name for f in dataclasses.fields(RunArgs)}
    assert issubclass(args_class, EngineArgs) == (stage in ("ppo_left_padding", "rloo", "online_dpo"))
    if issubclass(args_class, EngineArgs):  # (sft, reward and dpo declare their own --packing)
        assert not own & {f.name for f in dataclasses.fields(EngineArgs)}
    assert {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(RunArgs)} <= set(flag_helps(args_class))
