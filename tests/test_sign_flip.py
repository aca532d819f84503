"""The stratified sign-flip permutation test (:mod:`kvbudget.eval.sign_flip`) against a plain
enumeration written here, the small-sample case that prompted it, and its Monte Carlo path."""

from __future__ import annotations

import itertools
import math

import pytest

from kvbudget.errors import KVBudgetError
from kvbudget.eval import sign_flip
from kvbudget.eval.sign_flip import sign_flip_p_value


def _by_hand(groups: list[list[float]]) -> float:
    """Every sign pattern of every value (zeros included), the mean over tasks of task means."""

    def statistic(signed: list[list[float]]) -> float:
        return sum(sum(g) / len(g) for g in signed) / len(signed)

    flat = [v for g in groups for v in g]
    observed = abs(statistic(groups))
    hits = 0
    for signs in itertools.product((1, -1), repeat=len(flat)):
        it = iter(s * v for s, v in zip(signs, flat, strict=True))
        signed = [[next(it) for _ in g] for g in groups]
        hits += abs(statistic(signed)) >= observed - 1e-12
    return hits / 2 ** len(flat)


@pytest.mark.parametrize(
    "groups",
    [
        [[0.5, -1.0, 2.0], [3.0, 0.0]],
        [[1.0, 1.0, -0.25, 0.0, 0.5], [-2.0, 0.1], [0.3]],
        [[0.2, 0.2, 0.2, -0.2]],
    ],
)
def test_the_exact_test_is_the_enumeration_of_every_sign_pattern(groups) -> None:
    assert sign_flip_p_value(groups) == pytest.approx(_by_hand(groups), abs=1e-12)


def test_four_differences_of_ten_all_one_way_give_one_in_eight() -> None:
    """The 1.5B LAQ check's lcc family: 4 of 10 samples differ, all in the same direction. However
    large they are, only all-as-observed and all-flipped are as extreme: 2 of 16 patterns."""
    assert sign_flip_p_value([[0.3, 0.1, 0.0, 0.0, 0.7, 0.0, 0.2, 0.0, 0.0, 0.0]]) == 0.125
    assert sign_flip_p_value([[0.0] * 5, [0.0] * 3]) == 1.0


def test_the_monte_carlo_path_estimates_the_exact_p(monkeypatch) -> None:
    groups = [[0.4, -0.1, 0.3, 0.2, 0.5, -0.2, 0.1], [0.6, 0.2, -0.3, 0.4, 0.1, 0.2]]
    exact = sign_flip_p_value(groups)
    monkeypatch.setattr(sign_flip, "EXACT_LIMIT", 4)
    draws = 20_000
    estimate = sign_flip_p_value(groups, draws=draws, seed=3)
    assert abs(estimate - exact) < 4 * math.sqrt(exact * (1 - exact) / draws) + 1 / draws
    assert sign_flip_p_value([[1.0] * 30], draws=999) == 1 / 1000  # never 0


@pytest.mark.parametrize(
    ("groups", "draws", "message"),
    [([], 10, "at least one value"), ([[1.0], []], 10, "at least one value"),
     ([[1.0, math.nan]], 10, "not finite"), ([[1.0]], 0, "draws must be")],
)  # fmt: skip
def test_bad_input_is_one_line(groups, draws, message) -> None:
    with pytest.raises(KVBudgetError, match=message):
        sign_flip_p_value(groups, draws=draws)
