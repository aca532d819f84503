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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvbudget.errors import KVBudgetError
from kvbudget.eval.intervals import DEFAULT_RESAMPLES, Interval, bootstrap_mean_over_groups

#: A column: ``("r", ratio)`` or ``("B", entries per KV head)``.
Column = tuple[str, float]


@dataclass(frozen=True)
class PairedDifference:
    """``a`` and ``b``'s mean scores over ``tasks`` on their shared samples, and the paired
    difference ``a − b`` (each with its interval; ``n`` = shared samples)."""

    a: Interval
    b: Interval
    difference: Interval
    tasks: tuple[str, ...]

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

    # one seed for all three: the same resampled samples for a, b and their difference
    return PairedDifference(
        a=interval([[x for x, _ in g] for g in groups]),
        b=interval([[y for _, y in g] for g in groups]),
        difference=interval([[x - y for x, y in g] for g in groups]),
        tasks=names,
    )
