"""Known answers of win_rates.py: the intervals over prompts and over seeds, and the length-controlled
win rate."""

import numpy as np
import pytest

from summarize_from_feedback_details import win_rates


def test_wilson_interval_known_answers():
    # 7 of 10: center (0.7 + 1.96^2 / 20) / (1 + 1.96^2 / 10), the textbook (0.3968, 0.8922)
    assert win_rates.wilson_interval(0.7, 10) == pytest.approx((0.39677, 0.89222), abs=1e-4)
    low, high = win_rates.wilson_interval(0.0, 2)  # no win in 2 prompts: still wide
    assert low == 0.0 and high == pytest.approx(0.65762, abs=1e-4)
    assert win_rates.wilson_interval(1.0, 5) == pytest.approx((0.56552, 1.0), abs=1e-4)
    assert all(np.isnan(win_rates.wilson_interval(0.5, 0)))


def z_196_interval(p, n, z=1.96):
    """The Wilson interval written out with the textbook's z = 1.96."""
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return center - half, center + half


def test_wilson_z_follows_the_level():
    assert win_rates.normal_quantile(0.95) == pytest.approx(1.959964, abs=1e-6)
    assert win_rates.normal_quantile(0.90) == pytest.approx(1.644854, abs=1e-6)
    assert win_rates.normal_quantile(0.99) == pytest.approx(2.575829, abs=1e-6)
    # the default level (0.95) still gives z = 1.96's numbers (z differs by 4e-5)
    for p, n in ((0.7, 10), (0.25, 40), (0.5, 2000)):
        assert win_rates.wilson_interval(p, n) == pytest.approx(z_196_interval(p, n), abs=2e-5)
    # 0.90 is z = 1.645's interval, narrower: 7 of 10 -> (0.4417, 0.8731) against 0.95's (0.3968, 0.8922)
    assert win_rates.wilson_interval(0.7, 10, level=0.90) == pytest.approx(z_196_interval(0.7, 10, z=1.644854), abs=1e-6)
    assert win_rates.wilson_interval(0.7, 10, level=0.90) == pytest.approx((0.44170, 0.87312), abs=1e-4)


def test_bootstrap_interval_known_answers():
    # every resample of identical outcomes gives the same mean: a zero-width interval
    assert win_rates.bootstrap_interval([0.5] * 20) == (0.5, 0.5)
    # 50 wins and 50 losses: the bootstrap mean has std 0.05, the 95% interval ~ 0.5 -+ 1.96 x 0.05
    low, high = win_rates.bootstrap_interval([1.0] * 50 + [0.0] * 50, resamples=4000)
    assert low == pytest.approx(0.402, abs=0.015) and high == pytest.approx(0.598, abs=0.015)
    # seeded: a rerun prints the same interval
    outcomes = np.random.default_rng(0).choice([0.0, 0.5, 1.0], 37)
    assert win_rates.bootstrap_interval(outcomes) == win_rates.bootstrap_interval(outcomes)


@pytest.mark.parametrize("df, quantile", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)])
def test_t_quantile_matches_the_tables(df, quantile):
    assert win_rates.t_quantile(df) == pytest.approx(quantile, abs=1e-4)


def test_t_interval_known_answers():
    low, high = win_rates.t_interval([1.0, 2.0, 3.0])  # mean 2, std 1, n 3: 2 -+ 4.3027 / sqrt(3)
    assert (low, high) == pytest.approx((2 - 4.302653 / 3 ** 0.5, 2 + 4.302653 / 3 ** 0.5), abs=1e-5)
    assert win_rates.t_interval([0.5, 0.5]) == (0.5, 0.5)
    assert all(np.isnan(win_rates.t_interval([0.7])))  # one seed: no spread, no interval


def length_decides(shift: float, n: int = 2000, seed: int = 0):
    """Outcomes where only length matters: P(win) = sigmoid(0.5 x length difference), the differences
    centred on `shift` (a policy `shift` tokens longer than the reference on average)."""
    rng = np.random.default_rng(seed)
    difference = rng.integers(-8, 9, n) + shift
    return (rng.random(n) < 1 / (1 + np.exp(-0.5 * difference))).astype(float), difference


def test_length_controlled_rate_is_a_half_where_length_alone_decides():
    for shift in (0, 4, -4):
        outcomes, difference = length_decides(shift)
        raw = outcomes.mean()
        assert win_rates.length_controlled_win_rate(outcomes, difference) == pytest.approx(0.5, abs=0.03)
        if shift:  # the raw rate rewards (or punishes) the length; the controlled one does not
            assert abs(raw - 0.5) > 0.2
    outcomes, difference = length_decides(4, n=400)
    low, high = win_rates.length_controlled_interval(outcomes, difference, resamples=200)
    assert low < 0.5 < high and high - low < 0.2


def test_length_controlled_rate_keeps_a_real_advantage_and_survives_separation():
    # a policy better at every length: sigmoid(1 + 0.5 d) read at d = 0 is sigmoid(1) = 0.731
    rng = np.random.default_rng(1)
    difference = rng.integers(-8, 9, 4000).astype(float)
    outcomes = (rng.random(4000) < 1 / (1 + np.exp(-(1 + 0.5 * difference)))).astype(float)
    assert win_rates.length_controlled_win_rate(outcomes, difference) == pytest.approx(0.731, abs=0.03)
    # ties are half a win: all ties is 0.5 at every length
    assert win_rates.length_controlled_win_rate([0.5] * 10, list(range(10))) == pytest.approx(0.5, abs=1e-6)
    # longer always wins (perfect separation): a finite fit, symmetric data read at 0 gives 0.5
    difference = np.array([-3.0, -2, -1, 1, 2, 3])
    assert win_rates.length_controlled_win_rate((difference > 0).astype(float), difference) == pytest.approx(0.5, abs=1e-3)


def newton_fit_one_row(y, x, ridge=1e-3, steps=50):
    """The logistic fit written out for one row (the loop logistic_fits runs for every row at once)."""
    y, x = np.asarray(y, dtype=float), np.asarray(x, dtype=float)
    scale = x.std() or 1.0
    design = np.stack([np.ones_like(x), x / scale], axis=1)
    penalty = np.diag([0.0, ridge * len(y)])
    beta = np.zeros(2)
    for _ in range(steps):
        mu = 1 / (1 + np.exp(-np.clip(design @ beta, -30, 30)))
        step = np.linalg.solve(design.T @ (design * (mu * (1 - mu))[:, None]) + penalty + 1e-12 * np.eye(2),
                               design.T @ (y - mu) - penalty @ beta)
        beta += step
        if np.abs(step).max() < 1e-10:
            break
    return beta[0], beta[1] / scale


def test_the_batched_fit_and_bootstrap_equal_one_row_at_a_time():
    """Rows that converge after different numbers of steps (a separable one, all ties, a constant
    covariate) fitted together give each row's own fit; the bootstrap of the length-controlled rate
    equals the one that fits its resamples one by one (the same resamples, to float noise)."""
    rng = np.random.default_rng(3)
    rows = [length_decides(shift, n=60, seed=seed) for seed, shift in enumerate((0, 3, -5))]
    separable = np.array([-3.0, -2, -1, 1, 2, 3] * 10)
    rows += [((separable > 0).astype(float), separable), (np.full(60, 0.5), separable),
             (rng.choice([0.0, 0.5, 1.0], 60), np.zeros(60))]
    fits = win_rates.logistic_fits([y for y, _ in rows], [x for _, x in rows])
    for (y, x), fit in zip(rows, fits):
        assert fit == pytest.approx(newton_fit_one_row(y, x), rel=1e-9, abs=1e-12)
    outcomes, difference = length_decides(2, n=300)

    def one_at_a_time(y, x):
        intercept, _ = newton_fit_one_row(y, x)
        return 1 / (1 + np.exp(-np.clip(intercept, -30, 30)))

    expected = win_rates.bootstrap_interval((outcomes, difference), one_at_a_time, resamples=200, seed=4)
    assert win_rates.length_controlled_interval(outcomes, difference, resamples=200, seed=4) == pytest.approx(
        expected, abs=1e-12)
    assert np.isnan(win_rates.length_controlled_win_rate([1.0], [2.0]))


# ---------------------------------------------------------------- paired against a baseline

def by_length(query, response):
    """A stand-in judge: the number of words of the response (the query is not read)."""
    return float(len(response.split()))


def test_paired_comparison_known_answers():
    # per prompt policy - baseline: +2, +1, 0, -1 -> mean +0.5; head to head W W T L -> 0.625
    policy = {"a": 3.0, "b": 2.0, "c": 1.0, "d": 0.0}
    baseline = {"d": 1.0, "c": 1.0, "b": 1.0, "a": 1.0}
    paired = win_rates.paired_comparison(policy, baseline)
    assert paired["prompts"] == 4 and paired["policy_mean"] == 1.5 and paired["baseline_mean"] == 1.0
    assert paired["difference"] == 0.5 and paired["head_to_head"] == 0.625
    assert paired["head_to_head_ci"] == win_rates.wilson_interval(0.625, 4)
    assert paired["difference_ci"] == win_rates.bootstrap_interval(np.array([2.0, 1.0, 0.0, -1.0]))
    low, high = paired["difference_ci"]
    assert -1.0 <= low < 0.5 < high <= 2.0
    # the same difference on every prompt: a zero-width interval, whatever the prompts' own scores
    same = win_rates.paired_comparison({"a": 5.0, "b": -3.0, "c": 0.25}, {"a": 4.75, "b": -3.25, "c": 0.0})
    assert same["difference"] == 0.25 and same["difference_ci"] == (0.25, 0.25) and same["head_to_head"] == 1.0
    # 100 prompts, the policy +1 on 60 and -1 on 40: mean +0.2, bootstrap std 2 x sqrt(0.24 / 100) = 0.098
    big = win_rates.paired_comparison({i: float(i < 60) for i in range(100)}, {i: float(i >= 60) for i in range(100)})
    assert big["difference"] == pytest.approx(0.2) and big["head_to_head"] == pytest.approx(0.6)
    assert big["difference_ci"] == pytest.approx((0.2 - 1.96 * 0.098, 0.2 + 1.96 * 0.098), abs=0.03)
    assert big["head_to_head_ci"] == pytest.approx((0.50200, 0.69054), abs=1e-4)  # Wilson, 60 of 100


def test_paired_tables_join_on_the_query():
    # the same prompts in another order: paired by query, not by row
    policy = {"query": ["q1", "q2", "q3"], "postprocessed_response": ["one two three", "one", "one two"]}
    baseline = {"query": ["q3", "q1", "q2"], "postprocessed_response": ["one two", "one", "one two three four"]}
    paired = win_rates.paired_tables(policy, baseline, by_length)  # q1 +2, q2 -3, q3 0
    assert paired["difference"] == pytest.approx(-1 / 3) and paired["head_to_head"] == pytest.approx(0.5)
    assert paired["policy_mean"] == 2.0 and paired["baseline_mean"] == pytest.approx(7 / 3)
    # the row order does not move the bootstrap interval
    reordered = {column: values[::-1] for column, values in policy.items()}
    assert win_rates.paired_tables(reordered, baseline, by_length) == paired
    assert win_rates.scores_by_query(["q1", "q2"], [3, 1]) == {"q1": 3.0, "q2": 1.0}


def test_paired_tables_refuse_different_prompts():
    policy = {"query": ["q1", "q2"], "postprocessed_response": ["a", "b"]}
    with pytest.raises(ValueError, match="do not hold the same prompts: 1 only in the policy's, 1 only in the baseline's"):
        win_rates.paired_tables(policy, {"query": ["q1", "q3"], "postprocessed_response": ["a", "b"]}, by_length)
    with pytest.raises(ValueError, match="0 only in the policy's, 1 only in the baseline's"):
        win_rates.paired_tables(policy, {"query": ["q1", "q2", "q3"], "postprocessed_response": ["a", "b", "c"]},
                                by_length)
    with pytest.raises(ValueError, match="the policy's table: the query 'q1' appears more than once"):
        win_rates.paired_tables({"query": ["q1", "q1"], "postprocessed_response": ["a", "b"]}, policy, by_length)
    with pytest.raises(ValueError, match="SFT: the query 'q2' appears more than once"):
        win_rates.scores_by_query(["q1", "q2", "q2"], [1.0, 2.0, 3.0], "SFT")
    with pytest.raises(ValueError, match="no prompt"):
        win_rates.paired_comparison({}, {})


def test_paired_with_sft_is_paired_comparison_and_refuses_a_reason():
    """The one pairing against SFT of every results table: paired_comparison's numbers, and a table that has a
    reason instead of scores (a repeated query) refused with that reason."""
    policy, sft = {"a": 3.0, "b": 1.0}, {"a": 2.0, "b": 2.0}
    assert win_rates.paired_with_sft(policy, sft) == win_rates.paired_comparison(policy, sft)
    assert win_rates.paired_with_sft(policy, sft)["difference"] == 0.0
    for scores, baseline in ((policy, "SFT's table repeats a query"), ("SFT's table repeats a query", sft)):
        with pytest.raises(ValueError, match="repeats a query"):
            win_rates.paired_with_sft(scores, baseline)
