"""Bootstrap intervals (kvbudget.eval.intervals) against bounds known without the library.

Exact cases: all-equal values; 0/1 scores, whose bootstrap mean is Binomial(n, p)/n, so with many
resamples the percentile bounds are the binomial quantiles (computed here with math.comb; the
resample counts leave every quantile several standard deviations from a neighbouring value). And
a by-hand numpy bootstrap with the documented seeding, resampling and interpolation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvbudget.errors import KVBudgetError
from kvbudget.eval.intervals import bootstrap_mean, bootstrap_mean_over_groups, bootstrap_p_value_over_groups


def binomial_quantile(n: int, p: float, q: float) -> int:
    """The smallest k with P(Binomial(n, p) ≤ k) ≥ q."""
    total = 0.0
    for k in range(n + 1):
        total += math.comb(n, k) * p**k * (1 - p) ** (n - k)
        if total >= q:
            return k
    return n


def test_all_equal_values_give_a_zero_width_interval():
    interval = bootstrap_mean([0.75] * 9)
    assert (interval.mean, interval.low, interval.high, interval.n) == (0.75, 0.75, 0.75, 9)
    one = bootstrap_mean([0.3])
    assert (one.mean, one.low, one.high, one.n) == (0.3, 0.3, 0.3, 1)


def test_two_samples_span_both_values():
    # resample means of {0, 1}: 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4 → 2.5%/97.5% quantiles 0 and 1
    interval = bootstrap_mean([0.0, 1.0], resamples=4000)
    assert (interval.mean, interval.low, interval.high) == (0.5, 0.0, 1.0)


def test_binary_scores_match_the_binomial_quantiles():
    # 5 of 10 solved: P(X ≤ 1) = 0.011, P(X ≤ 2) = 0.055 → low 2/10;
    # P(X ≤ 7) = 0.945, P(X ≤ 8) = 0.989 → high 8/10
    assert (binomial_quantile(10, 0.5, 0.025), binomial_quantile(10, 0.5, 0.975)) == (2, 8)
    interval = bootstrap_mean([1.0] * 5 + [0.0] * 5, resamples=20000)
    assert interval.mean == 0.5
    assert interval.low == pytest.approx(0.2) and interval.high == pytest.approx(0.8)


def test_a_skewed_binary_interval_is_asymmetric():
    # 18 of 20 solved: Binomial(20, 0.9) quantiles, P(X ≤ 14) = 0.011, P(X ≤ 15) = 0.043 → low 15/20;
    # P(X ≤ 19) = 0.878 → high 20/20 — not mean ± 1.96 sd (0.77, 1.03)
    low_k, high_k = binomial_quantile(20, 0.9, 0.025), binomial_quantile(20, 0.9, 0.975)
    assert (low_k, high_k) == (15, 20)
    interval = bootstrap_mean([1.0] * 18 + [0.0] * 2, resamples=20000)
    assert interval.low == pytest.approx(low_k / 20) and interval.high == pytest.approx(high_k / 20)


def test_matches_a_numpy_bootstrap_by_hand():
    values = np.array([0.1, 0.9, 0.35, 0.0, 1.0, 0.6, 0.2])
    rng = np.random.default_rng(7)
    picks = rng.integers(0, len(values), size=(3000, len(values)))
    means = np.sort(values[picks].mean(axis=1))
    low_pos, high_pos = 0.025 * (len(means) - 1), 0.975 * (len(means) - 1)  # linear interpolation
    low_i, high_i = int(low_pos), int(high_pos)
    low = means[low_i] + (low_pos - low_i) * (means[low_i + 1] - means[low_i])
    high = means[high_i] + (high_pos - high_i) * (means[high_i + 1] - means[high_i])
    interval = bootstrap_mean(values.tolist(), resamples=3000, seed=7)
    assert interval.mean == pytest.approx(values.sum() / 7)
    assert interval.low == pytest.approx(low, abs=1e-12) and interval.high == pytest.approx(high, abs=1e-12)
    again = bootstrap_mean(values.tolist(), resamples=3000, seed=7)
    assert again == interval  # seeded: the same inputs give the same interval


def test_a_wider_level_gives_a_wider_interval():
    values = [0.0, 0.2, 0.4, 0.5, 0.9, 1.0, 0.3]
    narrow, wide = bootstrap_mean(values, level=0.5), bootstrap_mean(values, level=0.99)
    assert wide.low < narrow.low < narrow.high < wide.high


def test_over_groups_weighs_tasks_equally():
    # two tasks, 2 and 8 samples, each all-equal: the mean is over tasks (0.5), not over samples (0.2)
    interval = bootstrap_mean_over_groups([[1.0, 1.0], [0.0] * 8])
    assert (interval.mean, interval.low, interval.high, interval.n) == (0.5, 0.5, 0.5, 10)


def test_over_groups_resamples_within_each_task():
    # task A = {0, 1} (resample means 0, 1/2, 1), task B fixed at 0.4: bounds (0 + 0.4)/2 and (1 + 0.4)/2
    interval = bootstrap_mean_over_groups([[0.0, 1.0], [0.4, 0.4, 0.4]], resamples=4000)
    assert interval.mean == pytest.approx(0.45)
    assert interval.low == pytest.approx(0.2) and interval.high == pytest.approx(0.7)


def test_over_groups_of_binary_tasks_match_the_binomial_quantiles():
    # two tasks of 10 samples, 5 solved each: the task average is Binomial(20, 0.5)/20 under resampling
    low_k, high_k = binomial_quantile(20, 0.5, 0.025), binomial_quantile(20, 0.5, 0.975)
    assert (low_k, high_k) == (6, 14)
    task = [1.0] * 5 + [0.0] * 5
    interval = bootstrap_mean_over_groups([task, list(reversed(task))], resamples=20000)
    assert interval.low == pytest.approx(low_k / 20) and interval.high == pytest.approx(high_k / 20)


def test_one_group_is_the_plain_bootstrap():
    values = [0.1, 0.5, 0.7, 0.2, 0.9]
    assert bootstrap_mean_over_groups([values], seed=3) == bootstrap_mean(values, seed=3)


def test_p_value_of_a_two_sample_task_is_the_binomial_tail():
    # {0, 1}: a resample mean is 0 with probability 1/4 (both draws 0) and never below, so the
    # rarer side of 0 holds ~R/4 means and p = 2 (R/4 + 1) / (R + 1) ≈ 0.5
    p = bootstrap_p_value_over_groups([[0.0, 1.0]], resamples=20000)
    assert p == pytest.approx(0.5, abs=0.02)


def test_p_value_floor_and_ceiling():
    # all differences positive: no resample reaches 0, p = 2 / (R + 1); all zero or symmetric: p = 1
    assert bootstrap_p_value_over_groups([[0.2, 0.4], [0.1]], resamples=999) == 2 / 1000
    assert bootstrap_p_value_over_groups([[0.0] * 5], resamples=999) == 1.0
    assert bootstrap_p_value_over_groups([[-1.0, 1.0], [1.0, -1.0]], resamples=999) == 1.0


def test_p_value_agrees_with_the_interval_it_comes_with():
    """Same seed, same draws: the interval excludes 0 exactly where p < 0.05 (up to one resample at
    the boundary; none of these is at it), and p counts the resampled means by hand."""
    groups = [[0.0, 1.0, 1.0, 0.0, 1.0], [0.5, 0.0, 0.25, 1.0]]
    for shift in (-0.6, -0.2, 0.0, 0.3, 0.7):
        shifted = [[x + shift for x in g] for g in groups]
        interval = bootstrap_mean_over_groups(shifted, resamples=3000, seed=5)
        p = bootstrap_p_value_over_groups(shifted, resamples=3000, seed=5)
        assert (p < 0.05) == (interval.low > 0 or interval.high < 0)
    rng = np.random.default_rng(5)
    arrays = [np.asarray(g) + 0.3 for g in groups]
    means = np.mean([a[rng.integers(0, a.size, size=(3000, a.size))].mean(axis=1) for a in arrays], axis=0)
    rarer = min(int((means <= 1e-12).sum()), int((means >= -1e-12).sum()))
    expected = min(1.0, 2 * (rarer + 1) / 3001)
    assert bootstrap_p_value_over_groups([list(a) for a in arrays], resamples=3000, seed=5) == expected


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: bootstrap_mean([]), "at least one value"),
        (lambda: bootstrap_mean([0.1, float("nan")]), "finite values"),
        (lambda: bootstrap_mean([0.1], resamples=0), "resamples must be an integer ≥ 1"),
        (lambda: bootstrap_mean([0.1], level=1.0), "level must be in (0, 1)"),
        (lambda: bootstrap_mean_over_groups([]), "at least one group"),
        (lambda: bootstrap_mean_over_groups([[0.5], []]), "at least one value"),
        (lambda: bootstrap_p_value_over_groups([]), "at least one group"),
        (lambda: bootstrap_p_value_over_groups([[0.5]], resamples=0), "resamples must be an integer ≥ 1"),
    ],
)
def test_bad_input_is_a_one_line_error(call, words):
    with pytest.raises(KVBudgetError) as info:
        call()
    assert words in str(info.value) and "\n" not in str(info.value)
