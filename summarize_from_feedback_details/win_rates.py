"""How far to trust a win rate (DESIGN.md section 20): intervals over prompts and over seeds, and the
length-controlled win rate. Pure functions over per-prompt outcomes, shared by hello_world_report and
eval/; nothing here changes a training result.

An outcome is the policy's score on one prompt against the reference: 1 a win, 0.5 a tie (ties count
half everywhere), 0 a loss; unparsed verdicts are left out before they get here.
- Over prompts, for one run: the Wilson score interval of the rate (closed form; with ties it treats
  the tie-half rate as a proportion over the judged prompts, an approximation that the percentile
  bootstrap, which resamples the outcomes themselves, does not need) and the percentile bootstrap.
  Tables and plots of eval/ and hello_world's table print the Wilson interval; the length-controlled
  rate has no closed form and takes the bootstrap.
- Over seeds, for a mean: the t-interval, mean +- t(0.975, n - 1) x sample std / sqrt(n).
- Length-controlled: a logistic fit of the outcome on the length difference (policy minus reference,
  in tokens), read at zero difference: the win rate of a summary as long as the reference (the paper
  repo's rlhf_log_length analysis; AlpacaEval's length control, reduced to the one covariate).
"""

import math
from typing import Callable, Optional, Sequence

import numpy as np

LEVEL = 0.95


def wilson_interval(p: float, n: int, z: float = 1.96) -> tuple:
    """95% Wilson score interval of a rate p over n prompts: unlike p +- standard error it does not
    shrink to nothing at p = 0 or 1, so a bin of 2 prompts looks as uncertain as it is."""
    if n <= 0 or not np.isfinite(p):
        return float("nan"), float("nan")
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return min(p, center - half), max(p, center + half)  # float noise must not put p outside


def bootstrap_interval(outcomes: Sequence, statistic: Callable = np.mean, resamples: int = 2000, seed: int = 0,
                       level: float = LEVEL) -> tuple:
    """Percentile bootstrap interval of `statistic` over prompts: `resamples` resamples of the rows
    (with replacement, seeded, so a rerun prints the same interval); `outcomes` is an array whose first
    axis is the prompt (a tuple of arrays is resampled row for row together)."""
    arrays = outcomes if isinstance(outcomes, tuple) else (outcomes,)
    arrays = tuple(np.asarray(a, dtype=float) for a in arrays)
    n = len(arrays[0])
    if n == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    values = np.array([statistic(*(a[rows] for a in arrays))
                       for rows in (rng.integers(0, n, n) for _ in range(resamples))])
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return float("nan"), float("nan")
    tail = (1 - level) / 2 * 100
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


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


def logistic_fit(outcomes: Sequence, covariate: Sequence, ridge: float = 1e-3, steps: int = 50) -> tuple:
    """(intercept, slope) of P(win) = sigmoid(intercept + slope x covariate), fitted by Newton's method
    to fractional outcomes (a tie is half a win, as a weight). The slope carries a small L2 penalty
    (`ridge`, on the covariate scaled to unit std) so that data the covariate separates perfectly
    still gives a finite fit; the intercept is not penalised, but the linear predictor stays within
    +-30 (all wins read as 1 - 1e-13, not as a diverging fit)."""
    y = np.asarray(outcomes, dtype=float)
    x = np.asarray(covariate, dtype=float)
    scale = x.std() or 1.0
    design = np.stack([np.ones_like(x), x / scale], axis=1)
    penalty = np.diag([0.0, ridge * len(y)])
    beta = np.zeros(2)
    for _ in range(steps):
        mu = 1 / (1 + np.exp(-np.clip(design @ beta, -30, 30)))
        gradient = design.T @ (y - mu) - penalty @ beta
        hessian = design.T @ (design * (mu * (1 - mu))[:, None]) + penalty + 1e-12 * np.eye(2)
        step = np.linalg.solve(hessian, gradient)
        beta += step
        if np.abs(step).max() < 1e-10:
            break
    return float(beta[0]), float(beta[1] / scale)


def length_controlled_win_rate(outcomes: Sequence, length_difference: Sequence) -> float:
    """The win rate at zero length difference: sigmoid of the fitted intercept (see logistic_fit).
    Where only length decides, about 0.5 whatever the raw rate; nan for fewer than 2 prompts."""
    if len(outcomes) < 2:
        return float("nan")
    intercept, _ = logistic_fit(outcomes, length_difference)
    return float(1 / (1 + math.exp(-min(max(intercept, -30.0), 30.0))))


def length_controlled_interval(outcomes: Sequence, length_difference: Sequence, resamples: int = 500,
                               seed: int = 0) -> tuple:
    """Percentile bootstrap interval of the length-controlled win rate over prompts."""
    return bootstrap_interval((outcomes, length_difference), length_controlled_win_rate, resamples, seed)


def outcome_of(verdict: str) -> Optional[float]:
    """1 / 0.5 / 0 for a policy win, tie, reference win; None for an unparsed verdict."""
    return {"policy": 1.0, "tie": 0.5, "reference": 0.0}.get(verdict)
