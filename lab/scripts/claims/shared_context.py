"""docs/leaderboard.md's shared-context section: which methods hold later turns, at what cost.

The rule, written before the figures (docs/leaderboard.md, "One context, several questions"): in
each track and mode, every (method, ratio) is compared with the full cache on its later turns
(turns 2–4) — the paired per-sample difference, averaged within each task, then over tasks — with
a simultaneous 95% interval (Bonferroni over that track and mode's comparisons: each interval at
``1 − 0.05 / m``). A method **holds** later turns at a ratio when the interval lies above −10 points,
**loses** them when it lies wholly below −10, and is **undecided** otherwise. Each configuration is
compared on the tasks × n of its samples (each task's first n of those the full cache also has) that
cover the most, so a run in progress shows what it has; below :data:`MIN_VERDICT_SAMPLES` a task it has
no interval and no verdict (a bootstrap over one or two samples is not an interval).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from kvbudget.eval.conversation import MODES
from kvbudget.eval.intervals import Interval
from kvbudget.eval.paired import row_column
from kvbudget.eval.store import load_rows
from kvbudget.eval.turns_report import is_conversation, later_minus_full, later_turns, mean_over_tasks

from .common import has_results

#: how far below the full cache's later-turn score (points ×100) a method may be and still hold them
MARGIN = 0.10
#: the family's overall level; each of its m intervals is at 1 − LEVEL / m
LEVEL = 0.05
#: the fewest samples a task (the pilots' five) on which a configuration gets an interval and a verdict
MIN_VERDICT_SAMPLES = 5


def verdict(low: float, high: float, margin: float = MARGIN) -> str:
    """The rule's verdict for a later-turn difference's interval ``[low, high]`` (fractions)."""
    if low > -margin:
        return "holds"
    if high < -margin:
        return "loses"
    return "undecided"


def _samples(rows: list[dict]) -> dict[tuple[str, str, tuple | None], set[int]]:
    """The samples of each (task, label, column)."""
    found: dict[tuple[str, str, tuple | None], set[int]] = defaultdict(set)
    for r in rows:
        found[(r["task"], r["label"], row_column(r))].add(r["sample"])
    return found


def _mib(rows: list[dict]) -> str:
    """The cache's physical MiB right after the first prompt's compression, mean over tasks."""
    return f"{mean_over_tasks(rows, lambda r: r['physical_bytes']) / 2**20:.1f}"


@dataclass(frozen=True)
class Entry:
    """One (mode, configuration) line of the section: its rows and the later-turn comparison."""

    mode: str
    column: tuple | None  # ("r", ratio) or None (the full cache, a byte budget)
    label: str
    rows: list[dict]
    tasks: int
    n: int
    difference: Interval | None = None  # later − full, simultaneous over the mode's comparisons

    @property
    def verdict(self) -> str:
        return "–" if self.difference is None else verdict(self.difference.low, self.difference.high)

    def mean(self, value) -> float:
        return mean_over_tasks(self.rows, value)


def _coverage(per_task: dict[str, list[int]]) -> dict[str, set[int]]:
    """The ``tasks × n`` of these samples that covers the most (ties: the larger n): each chosen
    task's first ``n`` samples."""
    best, size = {}, 0
    for n in sorted({len(s) for s in per_task.values() if s}, reverse=True):
        tasks = [t for t, s in per_task.items() if len(s) >= n]
        if n * len(tasks) > size:
            best, size = {t: set(per_task[t][:n]) for t in tasks}, n * len(tasks)
    return best


def _rows_of(rows: list[dict], chosen: dict[str, set[int]]) -> list[dict]:
    return [r for r in rows if r["sample"] in chosen.get(r["task"], ())]


def shared_context_entries(rows: list[dict]) -> list[Entry]:
    """Per mode: the full cache's entry, then every (ratio, method) on the tasks × n of its samples
    the full cache also has that cover the most, compared with it there on later turns."""
    rows = [r for r in rows if is_conversation(r) and r.get("error") is None]
    entries = []
    for mode in MODES:
        here = [r for r in rows if r["conversation"] == mode]
        samples = _samples(here)
        tasks = sorted({t for (t, label, _) in samples if label == "full"})
        groups = sorted({(column, label) for (_, label, column) in samples if label != "full"},
                        key=lambda g: (-(g[0][1] if g[0] else 0.0), g[1]))  # fmt: skip
        level = 1 - LEVEL / max(1, len(groups))
        full = _coverage({t: sorted(samples[(t, "full", None)]) for t in tasks})
        if full:
            n = len(next(iter(full.values())))
            full_rows = _rows_of([r for r in here if r["label"] == "full"], full)
            entries.append(Entry(mode, None, "full", full_rows, len(full), n))
        for column, label in groups:
            common = {
                t: sorted(samples.get((t, label, column), set()) & samples[(t, "full", None)]) for t in tasks
            }
            chosen = _coverage(common)
            if not chosen:
                continue
            compared = _rows_of(here, chosen)
            group = [r for r in compared if r["label"] == label and row_column(r) == column]
            n = len(next(iter(chosen.values())))
            difference = None
            if n >= MIN_VERDICT_SAMPLES:
                difference = later_minus_full(compared, label, column, mode, level=level)
            entries.append(Entry(mode, column, label, group, len(chosen), n, difference))
    return entries


def shared_context_table(rows: list[dict], track: str) -> list[str]:
    """The section's table for one track's rows: per mode, ratio and method, turn 1, later turns,
    later − full [simultaneous 95% CI], the verdict, the compression's seconds and the cache's MiB."""
    entries = shared_context_entries(rows)
    if not entries:
        return [f"No {track} shared-context rows yet."]
    lines = [
        "| mode | r | method | turn 1 | later turns | later − full [simultaneous 95% CI] | verdict "
        "| compress s | KV MiB | tasks × n |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        first, later = 100 * e.mean(lambda r: r["turns"][0]["score"]), 100 * e.mean(later_turns)
        size = f"{e.tasks} × {e.n}"
        if e.label == "full":
            lines.append(
                f"| {e.mode} | – | full | {first:.1f} | {later:.1f} | – | – | – | {_mib(e.rows)} | {size} |"
            )
            continue
        d = e.difference
        cell = "–" if d is None else f"{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"
        lines.append(
            f"| {e.mode} | {f'{e.column[1]:g}' if e.column else '–'} | {e.label} | {first:.1f} | {later:.1f} "
            f"| {cell} | {e.verdict} | {e.mean(lambda r: r['compress_s']):.1f} | {_mib(e.rows)} | {size} |"
        )
    return lines


def shared_context_blocks(agnostic: Path, aware: Path) -> dict[str, list[str]]:
    """The ``shared-context-agnostic`` and ``shared-context-aware`` blocks, from their folders."""
    out = {}
    for name, folder, track in (
        ("agnostic", agnostic, "question-agnostic"),
        ("aware", aware, "question-aware"),
    ):
        rows = load_rows(folder / "results.jsonl") if has_results(folder) else []
        out[f"shared-context-{name}"] = shared_context_table(rows, track)
    return out
