"""docs/leaderboard.md's shared-context section: which methods hold later turns, at what cost.

The rule, written before the figures (docs/leaderboard.md, "One context, several questions"): in
each track and mode, every (method, ratio) is compared with the full cache on its later turns
(turns 2–4) — the paired per-sample difference, averaged within each task, then over tasks — with
a simultaneous 95% interval (Bonferroni over that track and mode's comparisons: each interval at
``1 − 0.05 / m``). A method **holds** later turns at a ratio when the interval lies above −10 points,
**loses** them when it lies wholly below −10, and is **undecided** otherwise. Only tasks where both
have every sample of the shown count (the most any has) are compared.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from kvbudget.eval.conversation import MODES
from kvbudget.eval.paired import row_column
from kvbudget.eval.store import load_rows
from kvbudget.eval.turns_report import is_conversation, later_minus_full, later_turns, mean_over_tasks

from .common import has_results

#: how far below the full cache's later-turn score (points ×100) a method may be and still hold them
MARGIN = 0.10
#: the family's overall level; each of its m intervals is at 1 − LEVEL / m
LEVEL = 0.05


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


def shared_context_table(rows: list[dict], track: str) -> list[str]:
    """The section's table for one track's rows: per mode, ratio and method, turn 1, later turns,
    later − full [simultaneous 95% CI], the verdict, the compression's seconds and the cache's MiB."""
    rows = [r for r in rows if is_conversation(r) and r.get("error") is None]
    if not rows:
        return [f"No {track} shared-context rows yet."]
    lines = [
        "| mode | r | method | turn 1 | later turns | later − full [simultaneous 95% CI] | verdict "
        "| compress s | KV MiB | tasks × n |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        here = [r for r in rows if r["conversation"] == mode]
        samples = _samples(here)
        n = max((len(s) for s in samples.values()), default=0)
        full_tasks = {t for (t, label, _), s in samples.items() if label == "full" and len(s) == n}
        groups = sorted({(column, label) for (_, label, column) in samples if label != "full"},
                        key=lambda g: (-(g[0][1] if g[0] else 0.0), g[1]))  # fmt: skip
        level = 1 - LEVEL / max(1, len(groups))
        full = [r for r in here if r["label"] == "full" and r["task"] in full_tasks]
        if full:
            lines.append(
                f"| {mode} | – | full | {100 * mean_over_tasks(full, lambda r: r['turns'][0]['score']):.1f} "
                f"| {100 * mean_over_tasks(full, later_turns):.1f} | – | – | – "
                f"| {_mib(full)} | {len(full_tasks)} × {n} |"
            )
        for column, label in groups:
            tasks = {t for t in full_tasks if len(samples.get((t, label, column), ())) == n}
            if not tasks:
                continue  # still running: shown once it has every sample of a task the full cache has
            group = [
                r for r in here if r["label"] == label and row_column(r) == column and r["task"] in tasks
            ]
            compared = [r for r in here if r["task"] in tasks]
            difference = later_minus_full(compared, label, column, mode, level=level)
            cell, judged = "–", "–"
            if difference is not None:
                d = difference
                cell = f"{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"
                judged = verdict(difference.low, difference.high)
            lines.append(
                f"| {mode} | {f'{column[1]:g}' if column else '–'} | {label} "
                f"| {100 * mean_over_tasks(group, lambda r: r['turns'][0]['score']):.1f} "
                f"| {100 * mean_over_tasks(group, later_turns):.1f} | {cell} | {judged} "
                f"| {mean_over_tasks(group, lambda r: r['compress_s']):.1f} "
                f"| {_mib(group)} | {len(tasks)} × {n} |"
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
