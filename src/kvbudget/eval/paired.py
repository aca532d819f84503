"""Paired comparisons of two methods on the same samples, with stratified bootstrap intervals.

Two methods scored on the same samples differ less by chance than their two separate intervals
suggest: each sample's difference ``score_a − score_b`` removes what the sample itself contributes
(an easy needle is easy for both). :func:`paired_difference` takes the samples both methods scored
in one column (a compression ratio or a budget; the full cache has no column and is matched to
every column), averages the differences within each task, then over tasks (each task weighs the
same), with the stratified percentile bootstrap of
:func:`~kvbudget.eval.intervals.bootstrap_mean_over_groups` (tasks fixed, samples resampled within
each task, the same resample for both methods).

A difference whose interval excludes 0 is a measured win; one whose interval holds 0 is not.

Each difference also carries its two-sided p-value (:attr:`PairedDifference.p_value`): the stratified
sign-flip permutation test of the same statistic (:func:`~kvbudget.eval.sign_flip.sign_flip_p_value`,
exact up to 20 nonzero differences, else 20,000 random sign patterns), which keeps its level at the
10–20 paired samples a task has here, where the percentile bootstrap's p-value is too liberal (its
bootstrap counterpart stays available: ``bootstrap_p_value``).
Several comparisons read as one family — a claim naming several baselines — are corrected for
multiplicity by :func:`holm_adjust` (Holm–Bonferroni), so that the chance of any false win in the
family stays at the level, not at the level per comparison.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from kvbudget.errors import KVBudgetError
from kvbudget.eval.intervals import (
    DEFAULT_RESAMPLES,
    Interval,
    bootstrap_mean_over_groups,
    bootstrap_p_value_over_groups,
)
from kvbudget.eval.sign_flip import sign_flip_p_value

#: A column: ``("r", ratio)`` or ``("B", entries per KV head)``.
Column = tuple[str, float]


@dataclass(frozen=True)
class PairedDifference:
    """``a`` and ``b``'s mean scores over ``tasks`` on their shared samples, and the paired
    difference ``a − b`` (each with its bootstrap interval; ``n`` = shared samples) with its
    two-sided sign-flip p-value (``a − b = 0``) and, for comparison, the bootstrap's (the same
    resamples as ``difference``'s interval)."""

    a: Interval
    b: Interval
    difference: Interval
    tasks: tuple[str, ...]
    p_value: float
    bootstrap_p_value: float | None = None

    @property
    def verdict(self) -> str:
        d = self.difference
        if d.low > 0:
            return "ahead"
        if d.high < 0:
            return "behind"
        return "no clear difference"


def row_column(row: dict) -> Column | None:
    """The row's column: its compression ratio, else its budget; ``None`` for the full cache."""
    ratio = row.get("compression_ratio")
    if ratio is not None:
        return ("r", float(ratio))
    return None if row.get("budget") is None else ("B", float(row["budget"]))


def _scores(rows: list[dict], label: str, column: Column) -> dict[tuple[str, int, int], float]:
    """``label``'s scores in ``column`` (or, for a full-cache label, its column-less rows), by
    (task, length, sample)."""
    found: dict[tuple[str, int, int], float] = {}
    for row in rows:
        if row["label"] != label or row.get("score") is None or row.get("error") is not None:
            continue
        where = row_column(row)
        if where is None or where == column:
            found[(row["task"], row["length"], row["sample"])] = float(row["score"])
    return found


def paired_difference(
    rows: list[dict],
    a: str,
    b: str,
    column: Column,
    tasks: list[str] | None = None,
    resamples: int = DEFAULT_RESAMPLES,
) -> PairedDifference:
    """``a − b`` in ``column`` over ``tasks`` (default: every task where both scored a sample)."""
    left, right = _scores(rows, a, column), _scores(rows, b, column)
    shared = sorted(set(left) & set(right))
    if tasks is not None:
        shared = [key for key in shared if key[0] in tasks]
    if not shared:
        raise KVBudgetError(f"{a} and {b} share no scored sample at {column}")
    by_task: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for key in shared:
        by_task[key[0]].append((left[key], right[key]))
    names = tuple(sorted(by_task))
    groups = [by_task[t] for t in names]

    def interval(values: list[list[float]]) -> Interval:
        return bootstrap_mean_over_groups(values, resamples=resamples)

    differences = [[x - y for x, y in g] for g in groups]
    # one seed for all: the same resampled samples for a, b, their difference and its p-value
    return PairedDifference(
        a=interval([[x for x, _ in g] for g in groups]),
        b=interval([[y for _, y in g] for g in groups]),
        difference=interval(differences),
        tasks=names,
        p_value=sign_flip_p_value(differences),
        bootstrap_p_value=bootstrap_p_value_over_groups(differences, resamples=resamples),
    )


def holm_adjust(p_values: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values of one family of ``m`` comparisons, in the input order.

    Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 6 (1979)
    65–70: order the p-values
    ``p_(1) ≤ … ≤ p_(m)``; the ``i``-th adjusted value is ``max_{j ≤ i} min(1, (m − j + 1) · p_(j))``.
    Rejecting every hypothesis whose adjusted p is below ``α`` is the step-down test (reject while
    ``p_(i) < α / (m − i + 1)``, stop at the first that is not) and keeps the chance of rejecting
    any true hypothesis of the family at most ``α``, whatever their dependence. Tied p-values keep
    their input order. An empty family gives an empty list.
    """
    for p in p_values:
        if not 0.0 <= p <= 1.0:
            raise KVBudgetError(f"p-values must be in [0, 1], got {p!r}")
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
