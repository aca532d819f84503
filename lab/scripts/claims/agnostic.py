"""The question-agnostic track's tables, and each method in both tracks side by side."""

from __future__ import annotations

from pathlib import Path

from kvbudget.eval.paired import row_column
from kvbudget.eval.report import PEER_PREFIX
from kvbudget.eval.store import load_rows

from .common import (
    budget_mark,
    difference_cell,
    has_results,
    over_budget_labels,
    paired_on_finished_tasks,
    pct,
)
from .leaderboard import best_against_kvpress, leaderboard_table
from .pairs import SAME_METHOD_PAIRS, pairs_table
from .screen import screen_table

#: The question-agnostic track's pairs: the query-free scores (made for this track) against the
#: question-window scores that lose their question here, the seed methods against SnapKV, and the
#: KVzip family's gradient-weighted member against the other two.
AGNOSTIC_PAIRS = [
    ("keydiff", "snapkv"), ("keydiff", "streamingllm"), ("kvzip", "snapkv"), ("kvzip", "keydiff"),
    ("lagkv", "snapkv"), ("qfilter", "snapkv"), ("chunkkv", "snapkv"), ("lava", "snapkv"),
    ("laq", "snapkv"), ("expected-attention", "snapkv"), ("kvzip", "expected-attention"),
    ("kvgrad", "kvzip"), ("kvgrad", "kvzip+"),
]  # fmt: skip


#: kvbudget's compactor with other seeds of its random sketches against its default draw and
#: kvpress's Compactor: how far the draw alone moves a sketch scorer's score.
COMPACTOR_DRAW_PAIRS = [
    ("compactor:seed=1", "compactor"), ("compactor:seed=2", "compactor"),
    (f"{PEER_PREFIX}compactor", "compactor:seed=1"), (f"{PEER_PREFIX}compactor", "compactor:seed=2"),
]  # fmt: skip


def agnostic_blocks(folder: Path, aware: list[dict]) -> dict[str, list[str]]:
    """The question-agnostic track's tables (``agnostic-RATIO``: kvbudget's methods on the widest task
    set any finished, ``agnostic-kvpress``, ``agnostic-pairs``, ``agnostic-kvpress-same``,
    ``agnostic-compactor-draws``) from ``folder``'s rows, and ``tracks-0.5`` (against the
    question-aware rows ``aware``), or a line saying none ran yet."""
    ratios = (0.875, 0.75, 0.5, 0.25)
    rows = load_rows(folder / "results.jsonl") if has_results(folder) else []
    rows = [r for r in rows if r.get("error") is None]
    ours = [r for r in rows if not r["label"].startswith(PEER_PREFIX)]
    out = {f"agnostic-{ratio:g}": leaderboard_table(ours, ratio) for ratio in ratios}
    out["agnostic-kvpress"] = best_against_kvpress(rows, ratios)
    out["agnostic-pairs"] = pairs_table(rows, AGNOSTIC_PAIRS) if rows else ["(no rows yet)"]
    out["agnostic-kvpress-same"] = pairs_table(rows, SAME_METHOD_PAIRS) if rows else ["(no rows yet)"]
    out["agnostic-compactor-draws"] = pairs_table(rows, COMPACTOR_DRAW_PAIRS) if rows else ["(no rows yet)"]
    out["agnostic-screen"] = screen_table(rows)
    out["tracks-0.5"] = tracks_table(aware, rows, 0.5)
    return out


def tracks_table(aware: list[dict], agnostic: list[dict], ratio: float) -> list[str]:
    """Each kvbudget method at ``ratio`` in both tracks, on the same samples: its question-aware and
    question-agnostic means over the tasks both finished and the paired difference, best aware first."""
    column, tag = ("r", ratio), " (agnostic)"
    at_ratio = [r for r in aware if row_column(r) == column and not r["label"].startswith(PEER_PREFIX)]
    merged = at_ratio + [
        {**r, "label": r["label"] + tag} for r in agnostic
        if row_column(r) == column and not r["label"].startswith(PEER_PREFIX)
    ]  # fmt: skip
    labels = sorted({r["label"] for r in at_ratio})
    found = [
        (label, d)
        for label in labels
        if (d := paired_on_finished_tasks(merged, label, label + tag, column, None))
    ]
    if not found:
        return [f"(no task finished in both tracks at r={ratio:g} yet)"]
    over = over_budget_labels(at_ratio) | over_budget_labels(merged)
    lines = [
        "| method | question-aware | question-agnostic | aware − agnostic [95% CI] | tasks |",
        "|---|---|---|---|---|",
    ]
    for label, d in sorted(found, key=lambda item: (-item[1].a.mean, item[0])):
        mark = budget_mark(label, over)
        lines.append(
            f"| {label}{mark} | {pct(d.a.mean)} | {pct(d.b.mean)} | {difference_cell(d)} | {len(d.tasks)} |"
        )
    return lines
