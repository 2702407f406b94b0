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
