"""What eval/sft_rm_scale.py and eval/rlhf_scaling_plot.py share: finding runs (local run folders or
wandb) and choosing which of them make the plots, the model size of a run, mean, std and 95% t-interval over
seeds, and writing a figure with its table.

A run is identified by its stage's Args (`args.json` locally, the run config on wandb): `exp_name`
says which stage (and variant) it is, `base_model` which model size, `seed` which seed. Runs are
grouped by (exp_name, base_model, seed) and each key uses one run: the one pinned with --runs, else
the newest that has what the plots need (see choose_runs). The choice is printed as a table and
written next to the plots (runs_used_<script>.{csv,md}).
"""

import datetime
import fnmatch
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from summarize_from_feedback_details.methods import METHODS
from summarize_from_feedback_details.win_rates import t_interval

matplotlib.use("Agg")  # figures go to files only, also on a machine with a display
console = Console(stderr=True, soft_wrap=True)  # long warnings stay on one line (greppable logs)


@dataclass(eq=False)  # two runs with the same config are still two runs: compared (and hashed) by identity
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


# the methods beside SFT, PPO and DPO that hello_world.sh ALGOS=all trains, by exp_name (rloo.py's
# variants take their own), in plot order: the registry's rows (summarize_from_feedback_details/methods.tsv);
# --methods replaces the list. The control is PPO against a reward model that knows nothing (an untrained
# head): the negative control, which must not beat SFT
OTHER_METHODS = [f"{method.run}={method.label}" for method in METHODS if method.name not in ("ppo", "dpo")]
# SFT, PPO and DPO keep their colours in every plot (DPO's is also its colour in sft_rm_scale.py)
FIXED_COLORS = {"SFT": "tab:blue", "PPO": "tab:orange", "DPO": "tab:green"}
MORE_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def policy_labels(source) -> dict:
    """{exp_name: label} of every policy eval/ compares, in plot order: SFT, PPO, DPO (the Args'
    --sft_exp_name, --ppo_exp_name, --dpo_exp_name), then --methods (EXP_NAME=LABEL each); the
    exp_names pairwise distinct, and the labels too (a label names one line of a legend)."""
    flags = {"--sft_exp_name": source.sft_exp_name, "--ppo_exp_name": source.ppo_exp_name,
             "--dpo_exp_name": source.dpo_exp_name}
    labels = {source.sft_exp_name: "SFT", source.ppo_exp_name: "PPO", source.dpo_exp_name: "DPO"}
    for entry in source.methods:
        exp_name, sep, label = entry.partition("=")
        if not sep or not exp_name.strip() or not label.strip():
            raise ValueError(f"--methods: {entry!r} is not EXP_NAME=LABEL (e.g. rloo_k4='RLOO k=4')")
        flags[f"--methods {entry}"] = exp_name.strip()
        labels[exp_name.strip()] = label.strip()
    check_exp_names(flags)
    if len(set(labels.values())) < len(labels):
        raise ValueError(f"--methods: two policies share a label ({', '.join(labels.values())})")
    return labels


def policy_colors(labels: list) -> dict:
    """{label: colour}: SFT, PPO and DPO their own, the other methods the next free colours in order."""
    more = iter(c for c in MORE_COLORS)
    return {label: FIXED_COLORS.get(label) or next(more, "black") for label in labels}


def either(names: list) -> str:
    """['sft', 'reward', 'dpo'] -> 'sft, reward or dpo', for messages."""
    return " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"


def _check_config(config: dict, where: str) -> None:
    missing = [k for k in REQUIRED_CONFIG if k not in config]
    if missing:
        raise ValueError(f"{where}: the run config has no {', '.join(missing)} (is it a run of this project's stages?)")


def pinned(name: str, pins: Sequence[str]) -> bool:
    """Whether --runs (`pins`: run names or shell patterns) names this run."""
    return any(fnmatch.fnmatch(name, pin) for pin in pins)


def wanted(name: str, run_glob: Optional[str], pins: Sequence[str]) -> bool:
    """A run is read when its name matches --run_glob (all when unset) or a --runs pin: a pinned run
    counts even outside --run_glob, so pinning one run never needs the glob rewritten."""
    return run_glob is None or fnmatch.fnmatch(name, run_glob) or pinned(name, pins)


def local_runs(runs_dir: str, exp_names: list, run_glob: Optional[str] = None, pins: Sequence[str] = ()) -> list:
    """Runs in `runs_dir` (one folder with args.json each) of the given experiments whose folder name
    is `wanted`. The name is checked first: other projects' folders outside the glob are not read."""
    if not os.path.isdir(runs_dir):
        raise FileNotFoundError(f"no run folder {runs_dir!r}: run the stages first or pass --runs_dir")
    runs = []
    for name in sorted(os.listdir(runs_dir)):
        args_file = os.path.join(runs_dir, name, "args.json")
        if not os.path.isfile(args_file) or not wanted(name, run_glob, pins):
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


def wandb_runs(project: str, entity: Optional[str], exp_names: list, tags: list, run_glob: Optional[str] = None,
               pins: Sequence[str] = ()) -> list:
    """Runs of a wandb project (`wandb.Api`, needs network and a login) of the given experiments,
    optionally only those with one of `tags`, whose name is `wanted`."""
    import wandb

    filters = {"config.exp_name": {"$in": list(exp_names)}}
    if tags:
        filters = {"$and": [filters, {"tags": {"$in": list(tags)}}]}
    path = f"{entity}/{project}" if entity else project
    runs = []
    for run in wandb.Api().runs(path, filters=filters):
        if not wanted(run.name, run_glob, pins):
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
    """Every run of `exp_names` where the script's Args (`source`: runs_dir, wandb_project,
    wandb_entity, wandb_tags, run_glob, runs) point: the local run folders, or wandb with
    --wandb_project; use_runs picks one per key. Also returns that place, worded for messages."""
    if source.wandb_project:
        runs = wandb_runs(source.wandb_project, source.wandb_entity, exp_names, source.wandb_tags, source.run_glob,
                          source.runs)
        where = f"wandb project {source.wandb_project}"
    else:
        runs = local_runs(source.runs_dir, exp_names, source.run_glob, source.runs)
        where = source.runs_dir
    return runs, where + (f" matching {source.run_glob!r}" if source.run_glob else "")


# ---------------------------------------------------------------------------------------------
# which run of a key makes the plots
# ---------------------------------------------------------------------------------------------

REPORT_COLUMNS = ["exp_name", "base_model", "seed", "run_name", "started", "status", "why"]


def choose_runs(runs: list, pins: Sequence[str], lacks: Callable) -> tuple:
    """The run each (exp_name, base_model, seed) uses, and the report of that choice: one row per run
    (REPORT_COLUMNS), keys in order, newest run first within a key, `status` used or set aside.

    A key's candidates are its runs pinned with --runs if it has any, else all its runs; it uses
    the newest candidate that has what the plots need (`lacks(run)`: what it misses, None when
    nothing). So a newer debug run without --run_eval never displaces a complete run, and nothing
    displaces a pinned one. A pinned run that lacks something is an error (the pin asked for exactly
    that run); a key none of whose runs is complete uses none, and the report says what each lacks."""
    by_key = {}
    for run in runs:
        by_key.setdefault(run.key, []).append(run)
    used, rows = [], []
    for key in sorted(by_key, key=lambda k: tuple(map(str, k))):
        group = sorted(by_key[key], key=lambda r: (r.created, r.name), reverse=True)
        missing = {run: lacks(run) for run in group}
        pinned_runs = [run for run in group if pinned(run.name, pins)]
        complete = [run for run in pinned_runs or group if missing[run] is None]
        if pinned_runs and not complete:
            raise SystemExit(f"--runs pins {', '.join(r.name for r in pinned_runs)} for exp_name={key[0]} "
                             f"base_model={key[1]} seed={key[2]}, but "
                             + "; ".join(f"{r.name} has {missing[r]}" for r in pinned_runs)
                             + ": pin a run that has it, or drop the pin to use the newest run that has it")
        chosen = complete[0] if complete else None
        for position, run in enumerate(group):
            if run is chosen:
                why = ("pinned (--runs)" if pinned_runs else "newest" if position == 0
                       else "newest with what the plots need")
            elif pinned_runs and run not in pinned_runs:
                why = "not pinned (--runs)"
            elif missing[run] is not None:  # a newer run set aside is the one a reader must not miss
                why = ("newer, but " if chosen and position < group.index(chosen) else "") + missing[run]
            else:
                why = "older"
            rows.append({"exp_name": key[0], "base_model": key[1], "seed": key[2], "run_name": run.name,
                         "started": started(run), "status": "used" if run is chosen else "set aside", "why": why})
        if chosen is not None:
            used.append(chosen)
    return used, pd.DataFrame(rows, columns=REPORT_COLUMNS)


def started(run) -> str:
    """When the run started, in UTC (the same in every reader's time zone)."""
    return datetime.datetime.fromtimestamp(run.created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def use_runs(runs: list, source, where: str, lacks: Callable, script: str) -> list:
    """The runs that make the plots (choose_runs over `runs` with the --runs pins of `source`). The
    choice is printed as a table before any plot (not one warning among the plots' messages) and
    written to `source.out` as runs_used_<script>.{csv,md}, so a reader of the plots sees which runs
    made them."""
    used, report = choose_runs(runs, source.runs, lacks)
    notes = [f"--runs {pin!r} matches none of the runs found: it pins nothing"
             for pin in source.runs if not any(pinned(run.name, [pin]) for run in runs)]
    name = os.path.join(source.out, f"runs_used_{script}")
    os.makedirs(source.out, exist_ok=True)
    report.to_csv(f"{name}.csv", index=False)
    with open(f"{name}.md", "w") as f:
        f.write(f"# Runs of {script}.py\n\nFrom {where}: every run found, newest first within each (exp_name, "
                f"base_model, seed); the `used` ones made the plots.\n\n{markdown_table(report)}")
        f.write("".join(f"\n{note}\n" for note in notes))
        if used:  # pinning them all redraws these plots whatever runs come later
            f.write(f"\nTo draw the plots from exactly these runs: `--runs {' '.join(run.name for run in used)}`\n")
    set_aside = (report["status"] == "set aside").sum()
    print_report(report, f"runs of {script}.py from {where}: {len(used)} used, {set_aside} set aside "
                         f"(also in {name}.md)")
    for note in notes:
        console.print(f"[yellow]warning:[/yellow] {escape(note)}")
    return used


def print_report(report: pd.DataFrame, title: str) -> None:
    """The report as a table, one section per key: used runs green, newer runs set aside yellow (the
    ones to look at), the other set-aside runs dim. Names are shown as they are (a run name or a glob
    may hold [...], which rich would read as markup)."""
    table = Table()
    for column in report.columns:
        table.add_column(column)
    for i, row in enumerate(report.itertuples(index=False)):
        if i and row[:3] != tuple(report.iloc[i - 1, :3]):
            table.add_section()
        style = "green" if row.status == "used" else "yellow" if row.why.startswith("newer") else "dim"
        table.add_row(*(Text(str(value)) for value in row), style=style)
    # as wide as its rows: an 80-column log would fold every name into fragments, hard to read and to grep
    wide = Console(stderr=True, width=max(console.width, 250))
    wide.print(Text(title, style="bold"))
    wide.print(table)


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
    seeds, the seeds and their values (space-separated, same order), the mean, the std over seeds
    and the 95% t-interval of the mean (ci_low, ci_high). The std is the sample std (ddof=1), the
    spread one expects between seeds; with a single seed it and the interval are undefined and left
    empty (NaN) and no error bar is drawn."""
    rows = []
    for group, frame in per_seed.groupby(by, sort=True):
        frame = frame.sort_values("seed")
        values = frame["value"].to_numpy(dtype=float)
        rows.append({**dict(zip(by, group)), "n_seeds": len(values),
                     "seeds": " ".join(map(str, frame["seed"])), "values": " ".join(f"{v:.6g}" for v in values),
                     "mean": values.mean(), "std": values.std(ddof=1) if len(values) > 1 else np.nan,
                     **dict(zip(("ci_low", "ci_high"), t_interval(values)))})
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
    """Each seed as a hollow point and the mean over seeds with its 95% t-interval as error bars, against
    model size; `shift` multiplies x so that series sharing a size do not hide each other."""
    ax.scatter(per_seed["model_size"] * shift, per_seed["value"], s=36, facecolors="none", edgecolors=color, alpha=0.7)
    summary = summary.sort_values("model_size")
    ax.errorbar(summary["model_size"] * shift, summary["mean"], yerr=interval_bars(summary), color=color,
                marker="o", markersize=5, capsize=4, label=f"{label} (mean, 95% t-interval over seeds)")


def interval_bars(summary: pd.DataFrame) -> list:
    """matplotlib's asymmetric yerr of seed_summary rows: mean - ci_low, ci_high - mean (0: no interval)."""
    return [(summary["mean"] - summary["ci_low"]).fillna(0), (summary["ci_high"] - summary["mean"]).fillna(0)]


def finish_scaling_axes(ax, sizes, values, min_span: float = 0.02) -> None:
    """Size axis, a y range of at least `min_span` around the data (a lone point or seeds that agree
    to 4 decimals would otherwise fill the plot with noise), and a legend with one entry for the
    seed points, beside the axes."""
    size_axis(ax, sizes)
    low, high = ax.get_ylim()
    if high - low < min_span:
        middle = (float(np.nanmin(values)) + float(np.nanmax(values))) / 2
        ax.set_ylim(middle - min_span / 2, middle + min_span / 2)
    ax.scatter([], [], s=36, facecolors="none", edgecolors="gray", label="each seed")
    # outside the axes: with make compare's eight policies at one size, a legend inside covered its points
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, fontsize=8)


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
