"""Turn 1 against later turns: the shared-context tasks' tables and plot (:mod:`kvbudget.eval.conversation`).

A shared-context row holds one run's turns in one mode (``conversation``: ``multi-turn`` or
``multi-request``), each scored (``row["turns"][i]["score"]``). Here a sample's *later turns* score
is the mean of its turns 2, 3, …; the full cache's row for the same sample and mode is its
reference, and ``later − full`` is the paired per-sample difference of the two later-turn scores,
averaged within each task, then over tasks, with the stratified bootstrap interval of
:func:`~kvbudget.eval.intervals.bootstrap_mean_over_groups` (tasks fixed, samples resampled in each).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from kvbudget.eval.intervals import DEFAULT_LEVEL, DEFAULT_RESAMPLES, Interval, bootstrap_mean_over_groups
from kvbudget.eval.paired import Column, row_column


def is_conversation(row: dict) -> bool:
    """Whether ``row`` is a shared-context row (one run's turns in one mode)."""
    return row.get("conversation") is not None and bool(row.get("turns"))


def later_turns(row: dict, key: str = "score") -> float:
    """Mean of ``key`` over turns 2, 3, … of a conversation row."""
    later = [t[key] for t in row["turns"][1:]]
    if not later:
        raise ValueError(f"row {row['key']} has no turn after the first")
    return sum(later) / len(later)


def _column_text(column: Column | None) -> str:
    return "–" if column is None else (f"r={column[1]:g}" if column[0] == "r" else f"B={column[1]:g}")


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def _interval_cell(interval: Interval | None) -> str:
    if interval is None:
        return "–"
    return f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]"


def later_minus_full(
    rows: list[dict], label: str, column: Column | None, mode: str, resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
) -> Interval | None:  # fmt: skip
    """The paired difference of later-turn scores, ``label`` at ``column`` minus the full cache, in
    ``mode``, over the samples both have (``None`` where none)."""
    full = {
        (r["task"], r["length"], r["sample"]): later_turns(r)
        for r in rows
        if r["label"] == "full" and r["conversation"] == mode  # the model's dtype: not full:kv_bits=4
    }
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["label"] == label and r["conversation"] == mode and row_column(r) == column:
            reference = full.get((r["task"], r["length"], r["sample"]))
            if reference is not None:
                by_task[r["task"]].append(later_turns(r) - reference)
    if not by_task:
        return None
    return bootstrap_mean_over_groups([by_task[t] for t in sorted(by_task)], resamples, level)


def mean_over_tasks(rows: list[dict], value) -> float:
    """Each task's mean of ``value(row)``, then the mean over tasks (each task weighs the same)."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(value(r))
    return sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)


def turns_table(rows: list[dict], resamples: int = DEFAULT_RESAMPLES) -> list[str]:
    """Markdown lines: per mode, method and column, the mean score of turn 1 and of later turns (over
    tasks, each weighing the same), later turns minus the full cache's with its 95% interval, the
    compression's seconds and the cache's KiB right after it, and the samples (n)."""
    rows = [r for r in rows if is_conversation(r) and r.get("error") is None]
    lines = [
        "| mode | method | column | turn 1 | later turns | later − full [95% CI] | compress s | KV KiB | n |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str, Column | None], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["conversation"], r["label"], row_column(r))].append(r)
    order = sorted(groups, key=lambda g: (g[0], g[1] != "full", g[2] or ("", 0.0), g[1]))
    for mode, label, column in order:
        mine = groups[(mode, label, column)]
        difference = None if label == "full" else later_minus_full(rows, label, column, mode, resamples)
        lines.append(
            f"| {mode} | {label} | {_column_text(column)} "
            f"| {_pct(mean_over_tasks(mine, lambda r: r['turns'][0]['score']))} "
            f"| {_pct(mean_over_tasks(mine, later_turns))} | {_interval_cell(difference)} "
            f"| {mean_over_tasks(mine, lambda r: r['compress_s']):.1f} "
            f"| {mean_over_tasks(mine, lambda r: r['physical_bytes']) / 1024:.0f} | {len(mine)} |"
        )
    return lines


def plot_turns(rows: list[dict], path: Path) -> bool:
    """Mean score by turn number (over tasks), one panel per mode and column, a line per method;
    ``False`` (nothing written) without conversation rows."""
    rows = [r for r in rows if is_conversation(r) and r.get("error") is None]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["conversation"] for r in rows})
    columns = sorted({row_column(r) for r in rows if r["method"] != "full"} - {None}, key=lambda c: c[1])
    columns = columns or [None]
    fig, axes = plt.subplots(
        len(modes), len(columns), figsize=(4 * len(columns), 3.2 * len(modes)), squeeze=False, sharey=True
    )
    for i, mode in enumerate(modes):
        for j, column in enumerate(columns):
            ax = axes[i][j]
            here = [r for r in rows if r["conversation"] == mode]
            mine = [r for r in here if r["method"] == "full" or row_column(r) == column]
            for label in sorted({r["label"] for r in mine}, key=lambda name: (name != "full", name)):
                labelled = [r for r in mine if r["label"] == label]
                turns = max(len(r["turns"]) for r in labelled)
                means = [
                    mean_over_tasks(
                        [r for r in labelled if len(r["turns"]) > k], lambda r, k=k: r["turns"][k]["score"]
                    )
                    for k in range(turns)
                ]
                style = {"color": "black", "linewidth": 2} if label == "full" else {}
                ax.plot(range(1, turns + 1), [100 * m for m in means], marker="o", label=label, **style)
            ax.set_title(f"{mode}, {_column_text(column)}")
            ax.set_xlabel("turn")
            ax.set_xticks(range(1, max(len(r["turns"]) for r in mine) + 1))
            if j == 0:
                ax.set_ylabel("mean score over tasks")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
