"""Paired differences: rows written by hand, bounds known exactly (see tests/test_report.py's note:
all-equal values give zero-width intervals; {0, 1, 0, 1}-like sets of 4 resample to k/4 with
k ~ Binomial(4, 1/2), whose 2.5 % / 97.5 % quantiles are 0 and 4)."""

from __future__ import annotations

import pytest

from kvbudget.errors import KVBudgetError
from kvbudget.eval.paired import holm_adjust, paired_difference


def _row(task, label, sample, score, ratio=None) -> dict:
    return {
        "task": task, "length": 2048, "sample": sample, "label": label, "score": score, "error": None,
        "compression_ratio": ratio, "budget": None if ratio is None else 100,
    }  # fmt: skip


def test_pairing_removes_what_the_samples_share():
    # b swings 0/1 from sample to sample; a is always b + 0.25: separately both intervals are wide
    # and overlap, the paired difference is exactly 0.25
    b = [0.0, 0.75, 0.0, 0.75]
    rows = [_row("t", "b", i, v, 0.5) for i, v in enumerate(b)]
    rows += [_row("t", "a", i, v + 0.25, 0.5) for i, v in enumerate(b)]
    result = paired_difference(rows, "a", "b", ("r", 0.5), resamples=500)
    assert (result.a.low, result.a.high) == (0.25, 1.0)
    assert (result.b.low, result.b.high) == (0.0, 0.75)
    d = result.difference
    assert (d.mean, d.low, d.high, d.n) == (0.25, 0.25, 0.25, 4)
    assert result.verdict == "ahead"


def test_tasks_weigh_the_same_and_only_shared_samples_count():
    rows = [_row("t1", "a", i, 1.0, 0.5) for i in range(4)] + [_row("t1", "b", i, 0.0, 0.5) for i in range(4)]
    rows += [_row("t2", "a", i, 0.0, 0.5) for i in range(2)] + [
        _row("t2", "b", i, 0.0, 0.5) for i in range(3)
    ]
    rows += [_row("t1", "a", 0, 0.0, 0.75)]  # another column: ignored
    result = paired_difference(rows, "a", "b", ("r", 0.5), resamples=500)
    # t1: difference 1 on 4 samples; t2: 0 on the 2 samples both scored → (1 + 0) / 2
    assert result.difference.mean == 0.5 and result.difference.n == 6
    assert (result.difference.low, result.difference.high) == (0.5, 0.5)
    assert result.tasks == ("t1", "t2")
    only_t2 = paired_difference(rows, "a", "b", ("r", 0.5), tasks=["t2"], resamples=500)
    assert only_t2.verdict == "no clear difference" and only_t2.difference.n == 2


def test_the_full_cache_is_matched_to_every_column_and_a_loss_is_behind():
    rows = [_row("t", "full", i, 1.0) for i in range(4)]
    rows += [_row("t", "m", i, s, 0.875) for i, s in enumerate([0.0, 1.0, 0.0, 1.0])]
    result = paired_difference(rows, "m", "full", ("r", 0.875), resamples=500)
    assert result.difference.mean == -0.5
    assert (result.difference.low, result.difference.high) == (-1.0, 0.0)  # holds 0: not behind
    assert result.verdict == "no clear difference"
    rows += [_row("t", "m", i, 0.0, 0.75) for i in range(4)]
    assert paired_difference(rows, "m", "full", ("r", 0.75), resamples=500).verdict == "behind"


def test_no_shared_sample_is_a_one_line_error():
    with pytest.raises(KVBudgetError, match="share no scored sample"):
        paired_difference([_row("t", "a", 0, 1.0, 0.5)], "a", "b", ("r", 0.5))


def test_the_difference_carries_the_sign_flip_p_and_the_bootstraps():
    # every sample's difference is +0.25: no resample reaches 0, so the bootstrap's p is its floor
    # 2 / (R + 1); the exact sign-flip test's is 2 of the 2^4 sign patterns
    b = [0.0, 0.75, 0.0, 0.75]
    rows = [_row("t", "b", i, v, 0.5) for i, v in enumerate(b)]
    rows += [_row("t", "a", i, v + 0.25, 0.5) for i, v in enumerate(b)]
    difference = paired_difference(rows, "a", "b", ("r", 0.5), resamples=499)
    assert difference.bootstrap_p_value == 2 / 500 and difference.p_value == 2 / 16
    # a ties b everywhere: p = 1
    rows += [_row("t", "c", i, v, 0.5) for i, v in enumerate(b)]
    tie = paired_difference(rows, "c", "b", ("r", 0.5), resamples=499)
    assert tie.p_value == tie.bootstrap_p_value == 1.0


def test_holm_matches_the_textbook_example():
    """Wikipedia's "Holm–Bonferroni method" example: four p-values 0.01, 0.04, 0.03, 0.005 at α = 0.05.
    By hand: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04; running
    maximum 0.02, 0.03, 0.06, 0.06. The step-down test rejects H4 (0.005 < 0.05/4) and H1
    (0.01 < 0.05/3) and stops at H3 (0.03 > 0.05/2), so H2 is kept though 0.04 < 0.05/1."""
    adjusted = holm_adjust([0.01, 0.04, 0.03, 0.005])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert [p < 0.05 for p in adjusted] == [True, False, False, True]


def test_holm_caps_at_one_keeps_a_single_p_and_ties_in_order():
    assert holm_adjust([0.5, 0.4, 0.9]) == pytest.approx([1.0, 1.0, 1.0])  # 3·0.4 = 1.2 → 1
    assert holm_adjust([0.03]) == [0.03]  # a family of one is not corrected
    assert holm_adjust([0.01, 0.01]) == pytest.approx([0.02, 0.02])
    assert holm_adjust([]) == []
    with pytest.raises(KVBudgetError, match="p-values must be in"):
        holm_adjust([0.2, 1.5])
