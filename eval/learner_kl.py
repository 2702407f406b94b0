"""The learner's KL to SFT in the staleness study (make async): the final policy's own samples, not
the stale rollouts that `objective/kl` is read on.

    python eval/learner_kl.py --run_glob 'async_n*' --out eval/images/async

`objective/kl` (async_table's `kl`) is the k1 estimate sum_t log pi(y_t) - log pi_sft(y_t) over the
rollouts trained on, which at --async_steps N were sampled by the policy of N updates before: it is
not the learner's KL and can be negative. Here each run's final policy (its --output_dir) samples
the first --queries validation queries at the run's temperature through the rollout engine (seed
--seed), and the same sum is read on those samples under the policy and under the SFT it started
from (--sft_model_path), up to and including the first EOS (online_dpo.response_logprob_sums):
the mean over queries is an unbiased estimate of KL(policy || SFT) per response, whatever the
staleness of training.

Writes to --out: async_learner_kl_runs.{csv,md} (one row per run: method, async_steps, seed,
run_name, learner_kl, objective_kl) and async_learner_kl.{csv,md} (per method and async_steps:
seeds, the mean of each over seeds, learner_kl's 95% t-interval over seeds).
"""

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import tyro
from async_table import METHODS, by_method_and_steps, study_runs
from common import write_table
from compare_table import metric_values, read_logged

from summarize_from_feedback_details.infra.loading import load_policy, load_split_dataset, load_tokenizer
from summarize_from_feedback_details.online_dpo import response_logprob_sums
from summarize_from_feedback_details.rollout import SamplingGroup, decode
from summarize_from_feedback_details.win_rates import t_interval


@dataclass
class Args:
    runs_dir: str = "runs"
    """local run folders (runs/<run_name>/ with args.json and metrics.jsonl)"""
    run_glob: str = "async_n*"
    """the study's runs: those whose name matches this shell pattern"""
    queries: int = 500
    """how many validation queries (the first ones) each final policy samples"""
    batch_size: int = 100
    """queries sampled and scored at once"""
    seed: int = 1
    """the sampling seed (batch b draws from seed + b)"""
    last_updates: int = 5
    """objective_kl averages `objective/kl` over this many last updates (async_table's kl)"""
    out: str = "eval/images/async"
    """folder for the tables (CSV, markdown)"""


@torch.no_grad()
def learner_kl(policy, sft, queries: torch.Tensor, tokenizer, temperature: float, response_length: int, seed: int,
               batch_size: int) -> torch.Tensor:
    """Per query, log pi(y) - log pi_sft(y) of one response y that `policy` samples for it (left-padded
    `queries`; each batch of `batch_size` from seed + its index), both summed over y's tokens up to and
    including its first EOS at `temperature`: what `objective/kl` sums, on the policy's own samples."""
    pad_id, eos_id, vocab_end = tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)
    out = []
    for index, batch in enumerate(queries.split(batch_size)):
        ((responses, _),) = decode(policy, [SamplingGroup(batch, temperature, seed + index)], pad_id, vocab_end,
                                   response_length)
        query_responses = torch.cat([batch, responses], 1)
        sums = [response_logprob_sums(model, query_responses, responses, temperature, eos_id, pad_id, vocab_end)
                for model in (policy, sft)]
        out.append(sums[0] - sums[1])
    return torch.cat(out)


def per_run_table(args: Args) -> pd.DataFrame:
    rows, sft_models, query_sets = [], {}, {}
    for run in study_runs(args):
        config = run.config
        tokenizer = load_tokenizer(config["output_dir"])
        if config["sft_model_path"] not in sft_models:
            sft_models[config["sft_model_path"]] = load_policy(config["sft_model_path"], tokenizer).eval()
        if config["query_dataset"] not in query_sets:
            validation = load_split_dataset(config["query_dataset"], ("query_token",))["validation"]
            query_sets[config["query_dataset"]] = validation.with_format("torch")[: args.queries]["query_token"]
        policy = load_policy(config["output_dir"], tokenizer).eval()
        kl = learner_kl(policy, sft_models[config["sft_model_path"]], query_sets[config["query_dataset"]], tokenizer,
                        config["temperature"], config["response_length"], args.seed, args.batch_size)
        objective_kl = metric_values(read_logged(run.folder), "objective/kl")[-args.last_updates:]
        rows.append({"method": METHODS[config["exp_name"]], "async_steps": int(config.get("async_steps", 0)),
                     "seed": config["seed"], "run_name": run.name, "learner_kl": kl.mean().item(),
                     "objective_kl": float(np.mean(objective_kl)) if objective_kl else np.nan})
        print(f"{run.name}: learner KL {rows[-1]['learner_kl']:.3f}, objective/kl {rows[-1]['objective_kl']:.3f}")
    if not rows:
        raise FileNotFoundError(f"no run of {', '.join(METHODS)} matches {args.run_glob!r} in {args.runs_dir}")
    return pd.DataFrame(rows)


def summarize(per_run: pd.DataFrame) -> pd.DataFrame:
    """Per (method, async_steps), methods in METHODS' order and N rising: means over seeds, learner_kl's
    95% t-interval over seeds."""
    rows = []
    for (method, steps), frame in by_method_and_steps(per_run):
        low, high = t_interval(frame["learner_kl"])
        rows.append({"method": method, "async_steps": steps, "seeds": len(frame),
                     "learner_kl": frame["learner_kl"].mean(), "learner_kl_low": low, "learner_kl_high": high,
                     "objective_kl": frame["objective_kl"].mean()})
    return pd.DataFrame(rows)


def main(args: Args) -> None:
    per_run = per_run_table(args)
    summary = summarize(per_run)
    os.makedirs(args.out, exist_ok=True)
    write_table(per_run, args.out, "async_learner_kl_runs")
    write_table(summary, args.out, "async_learner_kl")
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main(tyro.cli(Args))
