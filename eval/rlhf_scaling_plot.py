"""Win rate of SFT, PPO, DPO, RLOO, GRPO and online DPO summaries against the reference summaries, by model
size and by length.

    python eval/rlhf_scaling_plot.py --run_glob 'hello_world_*' --judge gold      # embedded default
    python eval/rlhf_scaling_plot.py --judge chat --chat.model gpt-3.5-turbo-0125 \\
        --wandb_project tldr_summarize --wandb_entity <entity>               # paper runs, LLM judge

Reads each run's eval table (`validation_table` by default: columns query, postprocessed_response,
reference_responses, optionally scores and reference_scores) from its local run folder
(`runs/<run_name>/<table>.csv`) or, with --wandb_project, from the wandb table logged under that
key; sft.py, ppo_left_padding.py, dpo.py, rloo.py and online_dpo.py write these tables with
--run_eval. A run's exp_name says its policy: --sft_exp_name (SFT), --ppo_exp_name (PPO),
--dpo_exp_name (DPO), then --methods (EXP_NAME=LABEL; by default the rloo, rloo_k4, grpo and
online_dpo runs of hello_world.sh ALGOS=all), all different names; plots and tables list the
policies in that order, each with its own colour and legend entry, and a policy without runs is
simply absent (without DPO runs the outputs are those of SFT and PPO alone). Runs are grouped by (exp_name,
base_model, seed); a key uses its run pinned with --runs, else its newest run that has the table,
so a newer run without --run_eval does not displace a complete one. A judge compares every response
with its reference (see eval/judges.py): `gold`, the synthetic task's exact judge, or `chat`, an LLM
behind an OpenAI-compatible API (cached, so a rerun costs nothing).

Writes to --out:
- runs_used_rlhf_scaling_plot.{csv,md}: every run found, which one each key used and why the
  others were set aside (also printed first);
- rlhf_scale_plot.{png,pdf,csv,md}: win rate vs model size, each seed and the mean with its 95%
  t-interval over seeds (and the std, ddof=1, in the table);
- rlhf_scale_plot_runs.{csv,md}: per run counts (wins, ties, losses, unparsed), win rate with its 95%
  Wilson interval over prompts (ties half), the length-controlled win rate with its 95% bootstrap
  interval, mean length, and with the chat judge in both orders the flips and the flip rate (by
  policy, then in run order); with the gold judge also the run's mean gold score (`gold`) and, paired
  per prompt with the SFT run of its (base_model, seed), its mean gold score minus SFT's with the
  95% bootstrap interval over prompts (`gold_minus_sft`, the embedded default's headline) and its
  head-to-head rate against SFT with its Wilson interval (`head_to_head_sft`); NaN with the chat judge;
- rlhf_scale_plot_token_length.{png,pdf,csv,md}: each run's win rate vs its mean response length,
  and the win rate in response-length bins (all sizes and seeds of a policy pooled);
- judged/<run_name>.csv: every row with its verdict (and the chat judge's reply).
"""

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Literal, Optional

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import tyro

from common import (OTHER_METHODS, console, either, find_runs, finish_scaling_axes, format_size, model_sizes,
                    parse_size_overrides, plot_over_sizes, policy_colors, policy_labels, save_figure, seed_summary,
                    shifts, use_runs, write_table)
from judges import EOS_TEXT, PAD_TEXT, ChatJudge, ChatJudgeConfig, gold_verdicts, win_counts

from summarize_from_feedback_details.gold_judge import gold_score
from summarize_from_feedback_details.win_rates import (length_controlled_interval, length_controlled_win_rate,
                                                       outcome_of, paired_with_sft, scores_by_query, wilson_interval)


@dataclass
class Args:
    runs_dir: str = "runs"
    """local run folders (runs/<run_name>/ with args.json and the eval tables)"""
    wandb_project: Optional[str] = None
    """read the runs from this wandb project instead of --runs_dir"""
    wandb_entity: Optional[str] = None
    """wandb entity (user or team) of --wandb_project; default your default entity"""
    wandb_tags: list[str] = field(default_factory=list)
    """only wandb runs with one of these tags (all when empty)"""
    run_glob: Optional[str] = None
    """only runs whose name matches this shell pattern, e.g. 'hello_world_*'"""
    runs: list[str] = field(default_factory=list)
    """pin runs (names or shell patterns): a pinned run is used for its (exp_name, base_model, seed)
    whatever newer runs exist, and is read even outside --run_glob"""
    sft_exp_name: str = "sft"
    """exp_name of the SFT runs"""
    ppo_exp_name: str = "ppo_left_padding"
    """exp_name of the PPO runs"""
    dpo_exp_name: str = "dpo"
    """exp_name of the DPO runs"""
    methods: list[str] = field(default_factory=lambda: list(OTHER_METHODS))
    """the policies beside SFT, PPO and DPO, as EXP_NAME=LABEL in plot order (default: the rloo.py and
    online_dpo.py runs of hello_world.sh ALGOS=all)"""
    table: str = "validation_table"
    """eval table to judge: `<table>.csv` in a run folder, the table logged under this key on wandb"""
    num_rows: Optional[int] = None
    """judge only the first N rows of each table (all when unset)"""
    judge: Literal["gold", "chat"] = "gold"
    """gold: the synthetic task's exact judge; chat: an LLM judge (--chat.* flags)"""
    chat: ChatJudgeConfig = field(default_factory=ChatJudgeConfig)
    tokenizer: Optional[str] = None
    """tokenizer that measures response lengths; default each run's output_dir, else its base_model"""
    length_bins: int = 6
    """equal-width response-length bins of the length plot"""
    model_size: list[str] = field(default_factory=list)
    """BASE_MODEL=PARAMETERS overrides of the x axis, e.g. EleutherAI/pythia-1b-deduped=1e9"""
    out: str = "eval/images"
    """folder for the plots (PNG, PDF) and their tables (CSV, markdown)"""


TABLE_COLUMNS = ("query", "postprocessed_response", "reference_responses")


def has_table(run, name: str) -> bool:
    """Whether the run saved the eval table `name` (a run without --run_eval, or still running, did
    not); nothing is downloaded."""
    if run.folder is not None:
        return os.path.isfile(os.path.join(run.folder, f"{name}.csv"))
    # wandb.log({name: wandb.Table(...)}) leaves a reference to the table's JSON file in the summary
    ref = run.wandb_run.summary_metrics.get(name)
    return isinstance(ref, dict) and ref.get("_type") == "table-file"


def load_table(run, name: str, download_dir: str) -> pd.DataFrame:
    """The run's eval table (one it has: see has_table)."""
    if run.folder is not None:
        path = os.path.join(run.folder, f"{name}.csv")
        table, where = pd.read_csv(path, keep_default_na=False), path  # an empty response stays ""
    else:
        ref = run.wandb_run.summary_metrics[name]
        run.wandb_run.file(ref["path"]).download(root=download_dir, replace=True)
        with open(os.path.join(download_dir, ref["path"])) as f:
            data = json.load(f)
        table, where = pd.DataFrame(data["data"], columns=data["columns"]).fillna(""), f"wandb run {run.name}"
    missing = [c for c in TABLE_COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"{where}: the eval table has no column {', '.join(missing)} (columns: {list(table.columns)})")
    return table


def response_lengths(responses: list, tokenizer) -> list:
    """Tokens of each response up to its EOS (EOS not counted), as the policy generated them."""
    texts = [r.split(EOS_TEXT)[0].replace(PAD_TEXT, "") for r in responses]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def run_tokenizer(run, override: Optional[str], loaded: dict):
    """The tokenizer of the run's model (its output_dir when it is here, else its base model)."""
    from transformers import AutoTokenizer

    path = override
    if path is None:
        output_dir = run.config.get("output_dir") or ""
        path = output_dir if os.path.isfile(os.path.join(output_dir, "tokenizer_config.json")) else run.config["base_model"]
    if path not in loaded:
        loaded[path] = AutoTokenizer.from_pretrained(path)
    return loaded[path]


def per_run_table(judged: pd.DataFrame, order: list) -> pd.DataFrame:
    """One row per run: verdict counts, win rate (ties half, unparsed left out) with its 95% Wilson
    interval over prompts, the length-controlled win rate (win on the length difference to the
    reference, read at zero) with its 95% bootstrap interval, mean length, mean gold score (NaN with the
    chat judge), and with the chat judge in both orders the flips (verdicts that changed with the
    order) and their share of the rows judged in both; by policy in `order` (labels), the runs of a
    policy in the order use_runs gave them."""
    rows = []
    for (policy, base_model, model_size, seed, run_name), frame in judged.groupby(
            ["policy", "base_model", "model_size", "seed", "run_name"], sort=False):
        counts = win_counts(list(frame["verdict"]))
        outcomes = frame["verdict"].map(outcome_of)
        parsed = outcomes.notna()
        outcomes, difference = outcomes[parsed].to_numpy(float), (frame["length"] - frame["reference_length"])[parsed]
        ci = wilson_interval(counts["win_rate"], int(parsed.sum()))
        lc_ci = length_controlled_interval(outcomes, difference.to_numpy(float))
        pairs = frame["flipped"].dropna() if "flipped" in frame else pd.Series(dtype=bool)
        rows.append({"policy": policy, "base_model": base_model, "model_size": model_size, "seed": seed,
                     "run_name": run_name, "rows": len(frame), "wins": counts["policy"], "ties": counts["tie"],
                     "losses": counts["reference"], "unparsed": counts["unparsed"], "win_rate": counts["win_rate"],
                     "ci_low": ci[0], "ci_high": ci[1],
                     "lc_win_rate": length_controlled_win_rate(outcomes, difference.to_numpy(float)),
                     "lc_ci_low": lc_ci[0], "lc_ci_high": lc_ci[1], "mean_length": frame["length"].mean(),
                     "gold": frame["gold"].mean(),
                     "flips": int(pairs.astype(bool).sum()) if len(pairs) else np.nan,
                     "flip_rate": float(pairs.astype(bool).mean()) if len(pairs) else np.nan})
    return by_policy(pd.DataFrame(rows), order, [])


PAIRED_COLUMNS = ("gold_minus_sft", "gold_minus_sft_ci_low", "gold_minus_sft_ci_high", "head_to_head_sft",
                  "head_to_head_sft_ci_low", "head_to_head_sft_ci_high")


def paired_sft_columns(per_run: pd.DataFrame, scores: dict) -> pd.DataFrame:
    """`per_run` (columns policy, base_model, seed, run_name) with PAIRED_COLUMNS: each run against the
    SFT run of its (base_model, seed), the policy it started from, paired per prompt on the gold judge's
    scores (`scores`: {run_name: {query: score}}, or a string saying why a run has none): the mean
    score difference with its 95% bootstrap interval over prompts and the head-to-head rate (ties
    half) with its Wilson interval (win_rates.paired_with_sft). NaN for SFT runs, runs without an
    SFT run of their seed, and pairs that cannot be paired (other prompts, a repeated query: warned)."""
    sft = {(r.base_model, r.seed): r.run_name for r in per_run.itertuples() if r.policy == "SFT"}
    rows = []
    for run in per_run.itertuples():
        baseline = sft.get((run.base_model, run.seed)) if run.policy != "SFT" else None
        row = dict.fromkeys(PAIRED_COLUMNS, np.nan)
        if baseline is not None:
            try:
                paired = paired_with_sft(scores[run.run_name], scores[baseline])
                row = dict(zip(PAIRED_COLUMNS, (paired["difference"], *paired["difference_ci"], paired["head_to_head"],
                                                *paired["head_to_head_ci"])))
            except ValueError as error:
                console.print(f"[yellow]warning:[/yellow] {run.run_name} not paired with {baseline}: {error}")
        rows.append(row)
    return pd.concat([per_run.reset_index(drop=True), pd.DataFrame(rows, columns=list(PAIRED_COLUMNS))], axis=1)


def gold_by_query(judged: pd.DataFrame) -> dict:
    """{run_name: {query: gold score}} of every run judged with the gold judge (scores_by_query: a
    repeated query is refused, so a run holding one gets the reason instead)."""
    scores = {}
    for run_name, frame in judged.groupby("run_name", sort=False):
        try:
            scores[run_name] = scores_by_query(frame["query"], frame["gold"], run_name)
        except ValueError as error:
            scores[run_name] = str(error)
    return scores


def length_bin_table(judged: pd.DataFrame, n_bins: int, order: list) -> pd.DataFrame:
    """Win rate per policy in `n_bins` equal-width bins of response length, with its 95% Wilson
    interval; the bins span all policies' lengths (unparsed rows left out), the last bin includes
    its upper edge, and empty bins are not listed."""
    judged = judged[judged["verdict"] != "unparsed"]
    edges = np.linspace(judged["length"].min(), judged["length"].max(), n_bins + 1)
    index = np.clip(np.searchsorted(edges, judged["length"], side="right") - 1, 0, n_bins - 1)
    rows = []
    for (policy, b), frame in judged.groupby([judged["policy"], index], sort=False):
        counts = win_counts(list(frame["verdict"]))
        low, high = wilson_interval(counts["win_rate"], len(frame))
        rows.append({"policy": policy, "bin": int(b), "length_low": edges[b], "length_high": edges[b + 1],
                     "rows": len(frame), "wins": counts["policy"], "ties": counts["tie"], "losses": counts["reference"],
                     "win_rate": counts["win_rate"], "ci_low": low, "ci_high": high})
    return by_policy(pd.DataFrame(rows), order, ["bin"])


def by_policy(frame: pd.DataFrame, order: list, then: list) -> pd.DataFrame:
    """Rows in plot order: the policies in `order` (SFT, PPO, DPO, then the other methods), then by the
    columns `then`; a stable sort, so rows equal in all of these keep their order."""
    rank = frame["policy"].map(order.index)
    return (frame.assign(_order=rank).sort_values(["_order", *then], kind="stable").drop(columns="_order")
            .reset_index(drop=True))


def reference_line(ax) -> None:
    ax.axhline(0.5, color="gray", linestyle="--", linewidth=1, label="reference summary")


def main(args: Args) -> None:
    policies = policy_labels(args)
    exp_names, order = list(policies), list(policies.values())
    colors = policy_colors(order)
    if args.length_bins < 1:
        raise ValueError("--length_bins must be at least 1")
    judge = ChatJudge(args.chat) if args.judge == "chat" else None  # fails now on a missing model or key
    judge_name = "gold judge" if judge is None else f"{args.chat.model} judge"

    # 1. the runs and their eval tables
    found, where = find_runs(args, list(policies))
    runs = use_runs(found, args, where, lambda run: None if has_table(run, args.table) else f"no {args.table} table",
                    "rlhf_scaling_plot")
    if not runs:
        raise SystemExit(f"no {either(exp_names)} run with a {args.table} table in {where}")
    with tempfile.TemporaryDirectory() as download_dir:
        tables = {run.name: load_table(run, args.table, download_dir) for run in runs}
    if args.num_rows:
        tables = {name: table.head(args.num_rows) for name, table in tables.items()}
    sizes = model_sizes(runs, parse_size_overrides(args.model_size))

    # 2. every row of every table, judged in one go (one progress bar, one concurrency bound)
    frames, tokenizers = [], {}
    for run in runs:
        table = tables[run.name]
        frames.append(pd.DataFrame({
            "policy": policies[run.config["exp_name"]], "base_model": run.config["base_model"],
            "model_size": sizes[run.config["base_model"]], "seed": run.config["seed"], "run_name": run.name,
            "query": table["query"].astype(str), "response": table["postprocessed_response"].astype(str),
            "reference": table["reference_responses"].astype(str),
            "length": response_lengths(list(table["postprocessed_response"].astype(str)),
                                       run_tokenizer(run, args.tokenizer, tokenizers)),
            "reference_length": response_lengths(list(table["reference_responses"].astype(str)),
                                                 run_tokenizer(run, args.tokenizer, tokenizers)),
        }))
    judged = pd.concat(frames, ignore_index=True)
    rows = list(zip(judged["query"], judged["response"], judged["reference"]))
    judged["gold"] = np.nan  # the synthetic task's gold score of each response: the paired headline
    if judge is None:
        judged["verdict"] = gold_verdicts(rows)
        judged["gold"] = [gold_score(query, response) for query, response, _ in rows]
    else:
        results = pd.DataFrame(judge.judge(rows))
        for column in ("verdict", "flipped", "policy_slot", "preferred", "reply"):
            judged[column] = results[column].to_numpy()
    os.makedirs(os.path.join(args.out, "judged"), exist_ok=True)
    for run_name, frame in judged.groupby("run_name"):
        frame.to_csv(os.path.join(args.out, "judged", f"{run_name}.csv"), index=False)

    # 3. win rate vs model size
    per_run = per_run_table(judged, order)
    if judge is None:
        per_run = paired_sft_columns(per_run, gold_by_query(judged))
    else:
        per_run = per_run.assign(**dict.fromkeys(PAIRED_COLUMNS, np.nan))
    write_table(per_run, args.out, "rlhf_scale_plot_runs")
    unjudged = per_run[per_run["win_rate"].isna()]
    if len(unjudged):
        console.print(f"[yellow]warning:[/yellow] no parsed verdict in {', '.join(unjudged['run_name'])}; left out of the plots")
    per_seed = per_run.dropna(subset=["win_rate"]).rename(columns={"win_rate": "value"})
    if per_seed.empty:
        raise SystemExit(f"not one parsed verdict: see the judge's replies in {os.path.join(args.out, 'judged')}")
    summary = seed_summary(per_seed, ["policy", "base_model", "model_size"])
    totals = per_run.groupby(["policy", "base_model"])[["rows", "unparsed"]].sum().reset_index()
    summary = summary.merge(totals, on=["policy", "base_model"], how="left")
    summary = by_policy(summary, order, ["model_size"])
    write_table(summary, args.out, "rlhf_scale_plot")

    fig, ax = plt.subplots(figsize=(6, 4.5))
    plotted = [policy for policy in order if policy in set(summary["policy"])]
    for policy, shift in zip(plotted, shifts(len(plotted))):
        plot_over_sizes(ax, per_seed[per_seed["policy"] == policy], summary[summary["policy"] == policy],
                        policy, colors[policy], shift)
    reference_line(ax)
    ax.set_ylim(0, 1)
    ax.set_ylabel("win rate against reference summaries")
    ax.set_title(f"TL;DR {args.table.removesuffix('_table')}, {judge_name}")
    finish_scaling_axes(ax, per_seed["model_size"], per_seed["value"])
    save_figure(fig, args.out, "rlhf_scale_plot")

    # 4. win rate vs response length
    bins = length_bin_table(judged, args.length_bins, order)
    write_table(bins, args.out, "rlhf_scale_plot_token_length")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    size_markers = dict(zip(sorted(set(per_seed["model_size"])), "os^Dvp*hX"))
    for policy, color in colors.items():
        runs_of = per_seed[per_seed["policy"] == policy]
        for size, marker in size_markers.items():
            runs_at = runs_of[runs_of["model_size"] == size]
            left.scatter(runs_at["mean_length"], runs_at["value"], color=color, marker=marker, alpha=0.8)
        if len(runs_of):
            left.scatter([], [], color=color, marker="s", label=policy)
        bins_of = bins[bins["policy"] == policy]
        if len(bins_of):
            centers = (bins_of["length_low"] + bins_of["length_high"]) / 2
            yerr = [bins_of["win_rate"] - bins_of["ci_low"], bins_of["ci_high"] - bins_of["win_rate"]]
            right.errorbar(centers, bins_of["win_rate"], yerr=yerr, color=color, marker="o", capsize=3,
                           label=f"{policy} (95% interval)")
    for size, marker in size_markers.items():
        left.scatter([], [], color="gray", marker=marker, label=format_size(size))
    for ax in (left, right):
        reference_line(ax)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    left.set_xlabel("mean response length of the run (tokens)")
    left.set_ylabel("win rate against reference summaries")
    left.set_title("per run (colour: policy, marker: model size)")
    right.set_xlabel(f"response length (tokens, {args.length_bins} equal bins)")
    right.set_title("per response, all sizes and seeds pooled")
    fig.suptitle(f"TL;DR {args.table.removesuffix('_table')}, {judge_name}")
    save_figure(fig, args.out, "rlhf_scale_plot_token_length")


if __name__ == "__main__":
    main(tyro.cli(Args))
