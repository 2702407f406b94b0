"""What eval/sft_rm_scale.py and eval/rlhf_scaling_plot.py share: finding runs (local run folders or
wandb), the model size of a run, mean and std over seeds, and writing a figure with its table.

A run is identified by its stage's Args (`args.json` locally, the run config on wandb): `exp_name`
says which stage (and variant) it is, `base_model` which model size, `seed` which seed. Runs are
grouped by (exp_name, base_model, seed); when a key has several runs the newest is kept.
"""

import datetime
import fnmatch
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from rich.console import Console

matplotlib.use("Agg")  # figures go to files only, also on a machine with a display
console = Console(stderr=True, soft_wrap=True)  # long warnings stay on one line (greppable logs)


@dataclass
class Run:
    name: str
    config: dict
    """the stage's Args as it saved them (args.json) or as wandb recorded them (run config)"""
    created: float
    """unix time the run started: decides between two runs with the same key"""
    folder: Optional[str] = None
    """the local run folder (runs/<run_name>), or None for a wandb run"""
    wandb_run: Any = None
    """a `wandb.apis.public.Run`, or None for a local run"""

    @property
    def key(self) -> tuple:
        return self.config["exp_name"], self.config["base_model"], self.config["seed"]


REQUIRED_CONFIG = ("exp_name", "base_model", "seed")


def check_exp_names(flags: dict) -> list:
    """The exp_names of `flags` ({"--sft_exp_name": "sft", ...}), each stage's own: a run is given to
    exactly one stage by its exp_name, so two flags with one value would count its runs twice."""
    by_value = {}
    for flag, value in flags.items():
        by_value.setdefault(value, []).append(flag)
    shared = {value: names for value, names in by_value.items() if len(names) > 1}
    if shared:
        raise ValueError("; ".join(f"{' and '.join(names)} are both {value!r}" for value, names in shared.items())
                         + ": each stage needs its own exp_name")
    return list(flags.values())


def either(names: list) -> str:
    """['sft', 'reward', 'dpo'] -> 'sft, reward or dpo', for messages."""
    return " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"


def _check_config(config: dict, where: str) -> None:
    missing = [k for k in REQUIRED_CONFIG if k not in config]
    if missing:
        raise ValueError(f"{where}: the run config has no {', '.join(missing)} (is it a run of this project's stages?)")


def local_runs(runs_dir: str, exp_names: list, run_glob: Optional[str] = None) -> list:
    """Runs in `runs_dir` (one folder with args.json each) of the given experiments, optionally only
    folders whose name matches the shell pattern `run_glob`."""
    if not os.path.isdir(runs_dir):
        raise FileNotFoundError(f"no run folder {runs_dir!r}: run the stages first or pass --runs_dir")
    runs = []
    for name in sorted(os.listdir(runs_dir)):
        args_file = os.path.join(runs_dir, name, "args.json")
        if not os.path.isfile(args_file) or (run_glob and not fnmatch.fnmatch(name, run_glob)):
            continue
        with open(args_file) as f:
            config = json.load(f)
        _check_config(config, args_file)
        if config["exp_name"] in exp_names:
            runs.append(Run(name=name, config=config, created=_start_time(name, args_file),
                            folder=os.path.join(runs_dir, name)))
    return runs


def _start_time(run_name: str, args_file: str) -> float:
    """The unix time the stages put at the end of run names (`exp__seed__time`); for hand-picked
    names (`--run_name hello_world_sft`), when args.json was written (at the start of the run)."""
    last = run_name.rsplit("__", 1)[-1]
    return float(last) if "__" in run_name and last.isdigit() else os.path.getmtime(args_file)


def wandb_runs(project: str, entity: Optional[str], exp_names: list, tags: list, run_glob: Optional[str] = None) -> list:
    """Runs of a wandb project (`wandb.Api`, needs network and a login) of the given experiments,
    optionally only those with one of `tags` and a name matching `run_glob`."""
    import wandb

    filters = {"config.exp_name": {"$in": list(exp_names)}}
    if tags:
        filters = {"$and": [filters, {"tags": {"$in": list(tags)}}]}
    path = f"{entity}/{project}" if entity else project
    runs = []
    for run in wandb.Api().runs(path, filters=filters):
        if run_glob and not fnmatch.fnmatch(run.name, run_glob):
            continue
        config = dict(run.config)
        _check_config(config, f"wandb run {path}/{run.id}")
        if config["exp_name"] in exp_names:  # the server filters too; this keeps the rule in one place
            created = datetime.datetime.fromisoformat(run.created_at.replace("Z", "+00:00"))
            if created.tzinfo is None:  # wandb reports UTC without an offset
                created = created.replace(tzinfo=datetime.timezone.utc)
            runs.append(Run(name=run.name, config=config, created=created.timestamp(), wandb_run=run))
    return runs


def find_runs(source, exp_names: list) -> tuple:
    """The newest run per (exp_name, base_model, seed) of `exp_names`, from where the script's Args
    (`source`: runs_dir, wandb_project, wandb_entity, wandb_tags, run_glob) point: the local run
    folders, or wandb with --wandb_project. Also returns that place, worded for messages."""
    if source.wandb_project:
        runs = wandb_runs(source.wandb_project, source.wandb_entity, exp_names, source.wandb_tags, source.run_glob)
        where = f"wandb project {source.wandb_project}"
    else:
        runs = local_runs(source.runs_dir, exp_names, source.run_glob)
        where = source.runs_dir
    return newest_per_key(runs), where + (f" matching {source.run_glob!r}" if source.run_glob else "")


def newest_per_key(runs: list) -> list:
    """One run per (exp_name, base_model, seed): the newest, with a warning naming the others."""
    by_key = {}
    for run in runs:
        by_key.setdefault(run.key, []).append(run)
    kept = []
    for key, group in by_key.items():
        group.sort(key=lambda r: r.created)
        if len(group) > 1:
            console.print(f"[yellow]warning:[/yellow] {len(group)} runs for exp_name={key[0]} base_model={key[1]} "
                          f"seed={key[2]}: keeping the newest, {group[-1].name}; ignoring "
                          f"{', '.join(r.name for r in group[:-1])} (use --run_glob to choose)")
        kept.append(group[-1])
    return sorted(kept, key=lambda r: (r.config["exp_name"], str(r.config["base_model"]), str(r.config["seed"])))


# ---------------------------------------------------------------------------------------------
# model size
# ---------------------------------------------------------------------------------------------

SIZE_UNITS = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
SIZE_IN_NAME = re.compile(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)([kmbt])(?![a-z0-9])")


def size_from_name(name: str) -> Optional[float]:
    """The parameter count a hub name states: pythia-1b-deduped -> 1e9, pythia-410m -> 4.1e8,
    pythia-2.8b -> 2.8e9; None when the name states none."""
    match = SIZE_IN_NAME.search(name.rstrip("/").split("/")[-1].lower())
    return float(match.group(1)) * SIZE_UNITS[match.group(2)] if match else None


def count_parameters(model_dir: str) -> int:
    """Parameters of the causal LM that `model_dir/config.json` describes, built on the meta device
    (no weights are read). A reward model's config gives its backbone's count plus the LM head, so
    SFT, reward and PPO runs of one base model land on the same x."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def parse_size_overrides(overrides: list) -> dict:
    """`--model_size NAME=SIZE` flags (SIZE: 1e9, 1000000000 or 1b) -> {base_model: parameters}."""
    sizes = {}
    for item in overrides:
        name, sep, value = item.rpartition("=")
        size = None
        if sep and name:
            try:
                size = float(value)
            except ValueError:
                size = size_from_name(value)
        if size is None or size <= 0:
            raise ValueError(f"--model_size {item!r}: expected BASE_MODEL=PARAMETERS, e.g. EleutherAI/pythia-1b-deduped=1e9")
        sizes[name] = size
    return sizes


def model_sizes(runs: list, overrides: dict) -> dict:
    """{base_model: parameter count} for the x axis. In order: `--model_size`, the config of the base
    model folder or of one of its runs' `output_dir` (exact), the size in the hub name."""
    sizes = {}
    for base_model in sorted({r.config["base_model"] for r in runs}):
        if base_model in overrides:
            sizes[base_model] = int(overrides[base_model])
            continue
        folders = [base_model] + sorted({r.config.get("output_dir") or "" for r in runs if r.config["base_model"] == base_model})
        with_config = [d for d in folders if d and os.path.isfile(os.path.join(d, "config.json"))]
        size = count_parameters(with_config[0]) if with_config else size_from_name(base_model)
        if size is None:
            raise ValueError(f"cannot tell the size of {base_model!r}: no config.json in {folders} and no size in "
                             f"its name; pass --model_size '{base_model}=<parameters>'")
        sizes[base_model] = int(size)
    return sizes


def format_size(parameters: float) -> str:
    """1.01e9 -> '1.01B', 4.05e8 -> '405M', 2.3e5 -> '230K'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= scale:
            return f"{parameters / scale:.3g}{unit}"
    return f"{parameters:.0f}"


def model_label(base_model: str, size: float) -> str:
    return f"{format_size(size)} ({base_model.rstrip('/').split('/')[-1]})"


# ---------------------------------------------------------------------------------------------
# statistics over seeds and outputs
# ---------------------------------------------------------------------------------------------


def seed_summary(per_seed: pd.DataFrame, by: list) -> pd.DataFrame:
    """One row per group of `by` from one row per (group, seed) with a `value` column: the number of
    seeds, the seeds and their values (space-separated, same order), the mean and the std over
    seeds. The std is the sample std (ddof=1), the spread one expects between seeds; with a single
    seed it is undefined and left empty (NaN) and no error bar is drawn."""
    rows = []
    for group, frame in per_seed.groupby(by, sort=True):
        frame = frame.sort_values("seed")
        values = frame["value"].to_numpy(dtype=float)
        rows.append({**dict(zip(by, group)), "n_seeds": len(values),
                     "seeds": " ".join(map(str, frame["seed"])), "values": " ".join(f"{v:.6g}" for v in values),
                     "mean": values.mean(), "std": values.std(ddof=1) if len(values) > 1 else np.nan})
    return pd.DataFrame(rows)


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub markdown table; floats with 4 decimals, NaN as an empty cell."""
    def cell(value) -> str:
        if isinstance(value, float):
            return "" if np.isnan(value) else f"{value:.4f}"
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def write_table(frame: pd.DataFrame, out: str, name: str) -> None:
    os.makedirs(out, exist_ok=True)
    frame.to_csv(os.path.join(out, f"{name}.csv"), index=False)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(markdown_table(frame))


def save_figure(fig, out: str, name: str) -> None:
    os.makedirs(out, exist_ok=True)
    for ext in ("png", "pdf"):
        fig.savefig(os.path.join(out, f"{name}.{ext}"), dpi=150, bbox_inches="tight")
    plt.close(fig)
    console.print(f"wrote {os.path.join(out, name)}.{{png,pdf,csv,md}}")


def plot_over_sizes(ax, per_seed: pd.DataFrame, summary: pd.DataFrame, label: str, color: str,
                    shift: float = 1.0) -> None:
    """Each seed as a hollow point and the mean over seeds with +-std error bars, against model
    size; `shift` multiplies x so that series sharing a size do not hide each other."""
    ax.scatter(per_seed["model_size"] * shift, per_seed["value"], s=36, facecolors="none", edgecolors=color, alpha=0.7)
    summary = summary.sort_values("model_size")
    ax.errorbar(summary["model_size"] * shift, summary["mean"], yerr=summary["std"].fillna(0), color=color,
                marker="o", markersize=5, capsize=4, label=f"{label} (mean ± std over seeds)")


def finish_scaling_axes(ax, sizes, values, min_span: float = 0.02) -> None:
    """Size axis, a y range of at least `min_span` around the data (a lone point or seeds that agree
    to 4 decimals would otherwise fill the plot with noise), and a legend with one entry for the
    seed points."""
    size_axis(ax, sizes)
    low, high = ax.get_ylim()
    if high - low < min_span:
        middle = (float(np.nanmin(values)) + float(np.nanmax(values))) / 2
        ax.set_ylim(middle - min_span / 2, middle + min_span / 2)
    ax.scatter([], [], s=36, facecolors="none", edgecolors="gray", label="each seed")
    ax.legend(loc="best", fontsize=8)


def shifts(count: int, step: float = 1.06) -> list:
    """x multipliers that spread `count` series around each size on a log axis."""
    return [step ** (i - (count - 1) / 2) for i in range(count)]


def size_axis(ax, sizes) -> None:
    """Log-scale x with a tick at each model size, labelled with its parameter count."""
    sizes = sorted(set(float(s) for s in sizes))
    ax.set_xscale("log")
    ax.set_xticks(sizes, [format_size(s) for s in sizes])
    ax.minorticks_off()
    if len(sizes) == 1:  # keep a lone point off the edges of the axes
        ax.set_xlim(sizes[0] / 2, sizes[0] * 2)
    else:
        ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.3)
    ax.set_xlabel("model size (parameters)")
    ax.grid(alpha=0.3)
