"""What every table of docs/claims.md shares: the labels held beyond the budget, the task sets,
the paired difference on the tasks both methods finished, and the cells' formats."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Collection
from pathlib import Path

from kvbudget.errors import KVBudgetError
from kvbudget.eval.paired import PairedDifference, paired_difference, row_column
from kvbudget.eval.report import PEER_PREFIX
from kvbudget.eval.store import archive_parts
from kvbudget.eval.suites import LEADERBOARD_PLAN
from kvbudget.methods.registry import method_info, method_names

#: Methods that hold more than the budget by design (marked ¹ in docs/leaderboard-analysis.md): their classes'
#: ``exceeds_budget``.
BEYOND_BUDGET = tuple(name for name in method_names() if method_info(name).exceeds_budget)


def over_budget_labels(rows: list[dict]) -> set[str]:
    """Labels (not :data:`BEYOND_BUDGET`'s) with a row whose kept entries, summed over layers and
    heads, exceed its budget × layers × heads (marked † in the tables: the pyramid family's floored
    layer schedule keeps up to a few percent more, as the authors' code does)."""
    found = set()
    for r in rows:
        kept, budget = r.get("budgets"), r.get("budget")
        if not kept or budget is None or r["label"].split(":")[0] in BEYOND_BUDGET:
            continue
        if sum(map(sum, kept)) > budget * len(kept) * len(kept[0]) * (1 + 1e-9):
            found.add(r["label"])
    return found


def budget_mark(label: str, over: set[str]) -> str:
    """`` ¹`` for a method over the budget by design, `` †`` for one measured over it, else nothing."""
    if label.split(" (")[0] in BEYOND_BUDGET:
        return " ¹"
    return " †" if label in over else ""


#: The tasks the leaderboard plan runs at every ratio (0.875, 0.75, 0.5 and 0.25): a gain read across
#: ratios over these is read on one task set.
EVERY_RATIO = sorted(set.intersection(*(set(tasks) for _, tasks in LEADERBOARD_PLAN if tasks is not None)))


def pct(value: float, scale: float = 100.0) -> str:
    """``value`` × ``scale`` with one decimal (scores ×100)."""
    return f"{scale * value:.1f}"


def difference_cell(result: PairedDifference | None, scale: float = 100.0) -> str:
    """A paired difference as ``+mean [+low, +high]`` (× ``scale``), or ``–`` where none was measured."""
    if result is None:
        return "–"
    d = result.difference
    return f"{scale * d.mean:+.1f} [{scale * d.low:+.1f}, {scale * d.high:+.1f}]"


def columns_of(rows: list[dict]) -> list[tuple[str, float]]:
    """The compression columns (``("r", ratio)`` or ``("B", budget)``) of ``rows``, sorted."""
    found = {row_column(r) for r in rows} - {None}
    return sorted(found, key=lambda c: (c[0], c[1]))  # type: ignore[arg-type]


def column_label(column: tuple[str, float]) -> str:
    """A column's header: ``r=0.875`` or ``B=128``."""
    return f"r={column[1]:g}" if column[0] == "r" else f"B={column[1]:g}"


#: Tasks count only where both methods have at least this many samples (a task still running is left out).
MIN_SAMPLES = 20


def paired_on_finished_tasks(
    rows: list[dict],
    a: str,
    b: str,
    column: tuple[str, float],
    tasks: Collection[str] | None,
    min_samples: int = MIN_SAMPLES,
) -> PairedDifference | None:
    """``a − b`` over the tasks (of ``tasks``, if given) where both scored ``MIN_SAMPLES`` samples."""
    per_label = []
    for label in (a, b):
        seen = {(r["task"], r["sample"]) for r in rows if r["label"] == label and r.get("score") is not None
                and row_column(r) in (None, column)}  # fmt: skip
        per_label.append(Counter(task for task, _ in seen))
    complete = [
        t for t, n in per_label[0].items()
        if n >= min_samples and per_label[1][t] >= min_samples and (tasks is None or t in tasks)
    ]  # fmt: skip
    if not complete:
        return None
    try:
        return paired_difference(rows, a, b, column, tasks=complete, resamples=2000)
    except KVBudgetError:
        return None


def has_results(folder: Path) -> bool:
    """Whether ``folder`` holds a results file (``results.jsonl`` or its committed archive)."""
    return (folder / "results.jsonl").exists() or bool(archive_parts(folder / "results.jsonl"))


def p_text(p: float) -> str:
    return f"{p:.3f}" if p >= 0.0005 else "<0.001"


def complete_tasks(mine: list[dict], column: tuple[str, float]) -> dict[str, set[str]]:
    """Each label's tasks with ``MIN_SAMPLES`` scored samples at ``column`` (the full cache: any column)."""
    samples: dict[tuple[str, str], set[int]] = defaultdict(set)
    for r in mine:
        samples[(r["label"], r["task"])].add(r["sample"])
    labels = {r["label"] for r in mine if row_column(r) == column}
    tasks = {r["task"] for r in mine if row_column(r) == column}
    return {
        label: {t for t in tasks if len(samples[(label, t)]) >= MIN_SAMPLES} for label in [*labels, "full"]
    }


def peers_of(rows: list[dict]) -> set[str]:
    """kvpress's labels among ``rows``."""
    return {r["label"] for r in rows if r["label"].startswith(PEER_PREFIX)}


def mean_over_tasks(rows: list[dict], label: str, column: tuple[str, float], tasks: set[str]) -> float:
    """The mean over ``tasks`` of ``label``'s per-task mean at ``column`` (each task weighs the same)."""
    return statistics.mean(
        statistics.mean(
            r["score"] for r in rows if r["label"] == label and r["task"] == t and row_column(r) == column
        )
        for t in sorted(tasks)
    )
