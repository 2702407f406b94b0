"""How far to trust a win rate (DESIGN.md section 20): intervals over prompts and over seeds, and the
length-controlled win rate. Pure functions over per-prompt outcomes, shared by hello_world_report and
eval/; nothing here changes a training result.

An outcome is the policy's score on one prompt against the reference: 1 a win, 0.5 a tie (ties count
half everywhere), 0 a loss; unparsed verdicts are left out before they get here.
- Over prompts, for one run: the Wilson score interval of the rate (closed form; with ties it treats
  the tie-half rate as a proportion over the judged prompts, an approximation that the percentile
  bootstrap, which resamples the outcomes themselves, does not need; its z follows LEVEL) and the
  percentile bootstrap. Tables and plots of eval/ and hello_world's table print the Wilson interval
  of a rate; the length-controlled rate and the mean of a score have no such closed form and take the
  bootstrap.
- Over seeds, for a mean: the t-interval, mean +- t(0.975, n - 1) x sample std / sqrt(n).
- Length-controlled: a logistic fit of the outcome on the length difference (policy minus reference,
  in tokens), read at zero difference: the win rate of a summary as long as the reference (the paper
  repo's rlhf_log_length analysis; AlpacaEval's length control, reduced to the one covariate).
- Paired against a baseline (the embedded default's headline: a policy against the SFT it started
  from): both policies answered the same validation prompts, so the judge's score is compared prompt
  by prompt. The mean per-prompt difference, with its percentile bootstrap interval over prompts,
  removes the spread between prompts (an easy post helps both policies) that two unpaired means keep;
  beside it the head-to-head rate (policy's score above the baseline's: 1, equal: 0.5, below: 0) with
  its Wilson interval. The scores are passed in (on the synthetic task its exact gold judge's), and
  a table is anything whose ["query"] and ["postprocessed_response"] iterate (a pandas frame, a dict
  of lists), so nothing here depends on the project's judge or on pandas.
"""

import functools
import math
import statistics
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

LEVEL = 0.95


def normal_quantile(level: float = LEVEL) -> float:
    """z of a two-sided interval at `level`: the (1 + level) / 2 quantile of the standard normal
    (1.95996 at 0.95), so the Wilson interval follows LEVEL as the bootstrap does."""
    return statistics.NormalDist().inv_cdf((1 + level) / 2)


def wilson_interval(p: float, n: int, level: float = LEVEL) -> tuple:
    """Wilson score interval (95% by default) of a rate p over n prompts: unlike p +- standard error it
    does not shrink to nothing at p = 0 or 1, so a bin of 2 prompts looks as uncertain as it is."""
    if n <= 0 or not np.isfinite(p):
        return float("nan"), float("nan")
    z = normal_quantile(level)
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return min(p, center - half), max(p, center + half)  # float noise must not put p outside


def bootstrap_interval(outcomes: Sequence, statistic: Callable = np.mean, resamples: int = 2000, seed: int = 0,
                       level: float = LEVEL, batched: bool = False) -> tuple:
    """Percentile bootstrap interval of `statistic` over prompts: `resamples` resamples of the rows
    (with replacement, seeded, so a rerun prints the same interval); `outcomes` is an array whose first
    axis is the prompt (a tuple of arrays is resampled row for row together). `batched`: `statistic`
    takes every resample at once (a leading resample axis) and returns one value per resample."""
    arrays = outcomes if isinstance(outcomes, tuple) else (outcomes,)
    arrays = tuple(np.asarray(a, dtype=float) for a in arrays)
    n = len(arrays[0])
    if n == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    resampled_rows = (rng.integers(0, n, n) for _ in range(resamples))
    if batched:
        rows = np.stack(list(resampled_rows))
        values = np.asarray(statistic(*(a[rows] for a in arrays)), dtype=float)
    else:
        values = np.array([statistic(*(a[rows] for a in arrays)) for rows in resampled_rows])
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return float("nan"), float("nan")
    tail = (1 - level) / 2 * 100
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


@functools.cache  # about 0.4 s per call, and every table of seeds asks for the same few
def t_quantile(df: int, p: float = 0.975) -> float:
    """The p quantile of Student's t with `df` degrees of freedom (scipy is not a dependency):
    bisection on its CDF, the density integrated by Simpson's rule; within 1e-5 of the tables."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, steps: int = 4000) -> float:  # 0.5 + the integral of the density from 0 to x
        h = x / steps
        f = [math.exp(log_norm - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(steps + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    low, high = 0.0, 1.0
    while cdf(high) < p:
        low, high = high, high * 2
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < p else (low, middle)
    return (low + high) / 2


def t_interval(values: Sequence) -> tuple:
    """95% interval of the mean of `values` (one per seed): mean +- t(0.975, n - 1) x std (ddof=1) /
    sqrt(n); (nan, nan) for fewer than two values, where the spread between seeds is unknown."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float("nan"), float("nan")
    half = t_quantile(len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values))
    return float(values.mean() - half), float(values.mean() + half)


def logistic_fits(outcomes: Sequence, covariate: Sequence, ridge: float = 1e-3, steps: int = 50) -> np.ndarray:
    """(intercept, slope) of P(win) = sigmoid(intercept + slope x covariate) for each row of two
    (rows, prompts) arrays, fitted by Newton's method to fractional outcomes (a tie is half a win, as a
    weight); every row at once, each taking steps until its own step is below 1e-10 (a bootstrap's 500
    fits one by one took seconds). The slope carries a small L2 penalty (`ridge`, on the covariate
    scaled to unit std) so that data the covariate separates perfectly still gives a finite fit; the
    intercept is not penalised, but the linear predictor stays within +-30 (all wins read as
    1 - 1e-13, not as a diverging fit)."""
    y = np.atleast_2d(np.asarray(outcomes, dtype=float))
    x = np.atleast_2d(np.asarray(covariate, dtype=float))
    scale = x.std(axis=1)
    scale[scale == 0] = 1.0
    design = np.stack([np.ones_like(x), x / scale[:, None]], axis=2)  # (rows, prompts, 2)
    penalty = np.diag([0.0, ridge * y.shape[1]])
    beta = np.zeros((len(y), 2))
    fitting = np.arange(len(y))
    for _ in range(steps):
        d, b = design[fitting], beta[fitting]
        d_t = d.transpose(0, 2, 1)
        mu = 1 / (1 + np.exp(-np.clip((d @ b[..., None])[..., 0], -30, 30)))
        gradient = (d_t @ (y[fitting] - mu)[..., None])[..., 0] - b @ penalty
        hessian = d_t @ (d * (mu * (1 - mu))[..., None]) + penalty + 1e-12 * np.eye(2)
        step = np.linalg.solve(hessian, gradient[..., None])[..., 0]
        beta[fitting] = b + step
        fitting = fitting[np.abs(step).max(axis=1) >= 1e-10]
        if len(fitting) == 0:
            break
    return np.stack([beta[:, 0], beta[:, 1] / scale], axis=1)


def length_controlled_win_rates(outcomes: Sequence, length_difference: Sequence) -> np.ndarray:
    """The win rate at zero length difference of each row of two (rows, prompts) arrays: sigmoid of
    the fitted intercept (see logistic_fits). Where only length decides, about 0.5 whatever the raw
    rate; nan for fewer than 2 prompts."""
    outcomes = np.atleast_2d(np.asarray(outcomes, dtype=float))
    if outcomes.shape[1] < 2:
        return np.full(len(outcomes), float("nan"))
    intercept = logistic_fits(outcomes, length_difference)[:, 0]
    return 1 / (1 + np.exp(-np.clip(intercept, -30.0, 30.0)))


def length_controlled_win_rate(outcomes: Sequence, length_difference: Sequence) -> float:
    """length_controlled_win_rates of one set of prompts."""
    return float(length_controlled_win_rates([outcomes], [length_difference])[0])


def length_controlled_interval(outcomes: Sequence, length_difference: Sequence, resamples: int = 500,
                               seed: int = 0) -> tuple:
    """Percentile bootstrap interval of the length-controlled win rate over prompts."""
    return bootstrap_interval((outcomes, length_difference), length_controlled_win_rates, resamples, seed,
                              batched=True)


def outcome_of(verdict: str) -> Optional[float]:
    """1 / 0.5 / 0 for a policy win, tie, reference win; None for an unparsed verdict."""
    return {"policy": 1.0, "tie": 0.5, "reference": 0.0}.get(verdict)


def score_outcomes(a, b) -> np.ndarray:
    """Per row 1 / 0.5 / 0 where score a beats, ties or loses to score b (on the gold judge's scores:
    gold_preference, ties half)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return np.where(a > b, 1.0, np.where(a < b, 0.0, 0.5))


def shorten(text: str, width: int = 60) -> str:
    """The start of a (long) query, for messages."""
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def scores_by_query(queries: Sequence, scores: Sequence, name: str = "table") -> dict:
    """{query: score} from a table's query column and the judge's score of each row's response. A
    query that appears twice is refused: paired by query, its two responses would have no partner."""
    by_query = {}
    for query, score in zip(queries, scores, strict=True):
        if query in by_query:
            raise ValueError(f"{name}: the query {shorten(query)!r} appears more than once; a paired comparison "
                             f"needs each prompt once")
        by_query[query] = float(score)
    return by_query


def paired_with_sft(scores, sft_scores) -> dict:
    """A policy against the SFT policy it started from, the headline of every results table (hello_world's report,
    eval/'s per-run tables): paired_comparison of their {query: score}. Either may instead be a string, the reason
    it has none (a table that repeats a query): refused with that reason (ValueError), as paired_comparison
    refuses tables of other prompts."""
    why = next((s for s in (scores, sft_scores) if isinstance(s, str)), None)
    if why:
        raise ValueError(why)
    return paired_comparison(scores, sft_scores)


def paired_comparison(policy: Mapping, baseline: Mapping, resamples: int = 2000, seed: int = 0,
                      level: float = LEVEL) -> dict:
    """A policy against a baseline on the same prompts, from {query: score} of each (scores_by_query):
    - difference: the mean over prompts of score(policy) - score(baseline), with its percentile
      bootstrap interval over prompts (difference_ci);
    - head_to_head: the rate at which the policy's score beats the baseline's on a prompt, ties half
      (on the gold judge exactly gold_preference(query, policy, baseline)), with its Wilson interval;
    - prompts, and each side's mean score (policy_mean, baseline_mean).
    Refused (ValueError) unless both hold the same prompts: a prompt only one side answered would turn
    the paired difference into a difference of two samples. The prompts are taken in sorted order, so
    the bootstrap interval does not depend on the order of the tables' rows."""
    only_policy, only_baseline = set(policy) - set(baseline), set(baseline) - set(policy)
    if only_policy or only_baseline:
        example = next(iter(sorted(only_policy or only_baseline)))
        raise ValueError(f"the two tables do not hold the same prompts: {len(only_policy)} only in the policy's, "
                         f"{len(only_baseline)} only in the baseline's (e.g. {shorten(example)!r}); pair tables "
                         f"of the same validation prompts")
    if not policy:
        raise ValueError("the two tables hold no prompt to compare")
    queries = sorted(policy)
    a = np.array([policy[q] for q in queries], dtype=float)
    b = np.array([baseline[q] for q in queries], dtype=float)
    difference = a - b
    outcomes = score_outcomes(a, b)
    head_to_head = float(outcomes.mean())
    return {"prompts": len(queries), "policy_mean": float(a.mean()), "baseline_mean": float(b.mean()),
            "difference": float(difference.mean()),
            "difference_ci": bootstrap_interval(difference, resamples=resamples, seed=seed, level=level),
            "head_to_head": head_to_head, "head_to_head_ci": wilson_interval(head_to_head, len(queries), level)}


def paired_tables(policy_table, baseline_table, score: Callable[[str, str], float], **kwargs) -> dict:
    """paired_comparison of two validation tables (columns query and postprocessed_response: a pandas
    frame or a dict of lists), each response scored by `score(query, response)`: on the synthetic task
    its gold_score (hello_world_report and eval/ score each table once and pair the scores instead)."""
    def by_query(table, name):
        queries = list(table["query"])
        return scores_by_query(queries, [score(q, r) for q, r in zip(queries, table["postprocessed_response"],
                                                                     strict=True)], name)

    return paired_comparison(by_query(policy_table, "the policy's table"),
                             by_query(baseline_table, "the baseline's table"), **kwargs)
