"""The leaderboard's tables: every method's mean over tasks at one ratio, and kvbudget's best
method held to the budget against kvpress's best press."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvbudget.eval.paired import PairedDifference, row_column
from kvbudget.eval.report import PEER_PREFIX, across_tasks

from .common import (
    BEYOND_BUDGET,
    budget_mark,
    complete_tasks,
    difference_cell,
    mean_over_tasks,
    over_budget_labels,
    paired_on_finished_tasks,
    pct,
    peers_of,
)


def leaderboard_table(rows: list[dict], ratio: float, shared: bool = False) -> list[str]:
    """Mean over tasks ×100 with its stratified interval, mean rank, then each task's mean.

    Default: the tasks the most complete labels share (the largest task set any label finished), and
    every label that finished all of them. ``shared``: every kvbudget method at ``ratio`` (methods
    added later included; kvpress's presses are in :func:`best_against_kvpress`) on the tasks all of
    them finished (a method with no finished task yet is left out). Methods at ``ratio`` left out
    (kvpress's aside) are named under the table."""
    column = ("r", ratio)
    mine = [r for r in rows if row_column(r) in (None, column) and r.get("score") is not None]
    complete = complete_tasks(mine, column)
    if shared:  # kvpress's presses have their own block (best_against_kvpress)
        complete = {label: done for label, done in complete.items()
                    if not label.startswith(PEER_PREFIX) and (done or label == "full")}  # fmt: skip
        tasks = sorted(set.intersection(*complete.values())) if complete else []
        labels = [label for label in complete if label != "full"]
    else:
        widest = max((complete[label] & complete["full"] for label in complete if label != "full"),
                     key=len, default=set())  # fmt: skip
        tasks = sorted(widest)
        labels = [label for label in complete if label != "full" and widest <= complete[label]]
    if not tasks or not labels:
        return [f"(no task finished by every method at r={ratio:g} yet)"]
    left_out = sorted({r["label"] for r in mine if row_column(r) == column} - {*labels, *peers_of(mine)})
    keep = {*labels, "full"}
    mine = [r for r in mine if r["task"] in tasks and r["label"] in keep]
    summary = across_tasks(mine, resamples=2000)
    over = over_budget_labels(mine)
    cell = summary.scores[column]
    order = sorted(cell, key=lambda label: -cell[label].mean)
    lines = [
        "| method | mean [95% CI] | mean rank | " + " | ".join(tasks) + " |",
        "|---|---|---|" + "---|" * len(tasks),
    ]
    for label in order:
        iv = cell[label]
        per_task = [
            statistics.mean(r["score"] for r in mine if r["task"] == t and r["label"] == label
                            and (row_column(r) == column or label in summary.reference))
            for t in tasks
        ]  # fmt: skip
        rank = summary.ranks[column].get(label)
        mark = budget_mark(label, over)
        lines.append(
            f"| {label}{mark} | {pct(iv.mean)} [{pct(iv.low)}, {pct(iv.high)}] | "
            + ("–" if rank is None else f"{rank:.1f}")
            + " | "
            + " | ".join(f"{100 * v:.0f}" for v in per_task)
            + " |"
        )
    if left_out:
        lines += [
            "",
            f"Not in this table (fewer of these tasks or samples at r = {ratio:g}): "
            + ", ".join(left_out)
            + ".",
        ]
    return lines


def best_label(labels: list[str], means: dict[str, float]) -> str:
    """The label with the highest mean; ties go to the first name in sorted order, so every render
    prints the same row."""
    return min(labels, key=lambda label: (-means[label], label))


def best_cell(best: str, labels: list[str], means: dict[str, float]) -> str:
    tied = sum(1 for label in labels if label != best and means[label] == means[best])
    return f"{best} {100 * means[best]:.1f}" + (f" (tied with {tied} more)" if tied else "")


@dataclass
class BestPair:
    """At one ratio: kvbudget's best method held to the budget (``ours``) and kvpress's best press
    (``peer``) over ``tasks``, every label's mean there, and the paired difference ours − peer."""

    ours: str
    peer: str
    our_labels: list[str]
    peer_labels: list[str]
    means: dict[str, float]
    diff: PairedDifference | None
    tasks: list[str]

    def cells(self) -> tuple[str, str]:
        ours = best_cell(self.ours, self.our_labels, self.means)
        return ours, best_cell(self.peer, self.peer_labels, self.means)


def held_to_budget(label: str) -> bool:
    """A kvbudget method that competes for "best held to the budget": not the full cache, not a
    kvpress press, not a method that keeps more than the budget by design."""
    return label not in ("full", *BEYOND_BUDGET) and not label.startswith(PEER_PREFIX)


def best_pair(rows: list[dict], ratio: float, competes=None) -> BestPair | None:
    """kvbudget's best against kvpress's best at ``ratio``, on the tasks both bests finished
    (``MIN_SAMPLES`` each): the largest task set a kvpress press finished, and every press that
    finished those tasks (a press screened on fewer samples or tasks is left out until it finishes
    them); ``None`` until such tasks exist. ``competes``: which of kvbudget's labels compete
    (default: :func:`held_to_budget`)."""
    column = ("r", ratio)
    mine = [r for r in rows if row_column(r) in (None, column) and r.get("score") is not None]
    complete = complete_tasks(mine, column)
    finished = [complete[label] for label in complete if label.startswith(PEER_PREFIX) and complete[label]]
    if not finished:
        return None
    tasks = max(finished, key=lambda t: (len(t), sorted(t)))
    peers = [label for label in complete if label.startswith(PEER_PREFIX) and tasks <= complete[label]]
    competes = competes or held_to_budget
    ours = [label for label in complete if competes(label) and tasks <= complete[label]]
    if not tasks or not ours:
        return None
    means = {label: mean_over_tasks(mine, label, column, tasks) for label in [*ours, *peers]}
    best_ours, best_peer = best_label(ours, means), best_label(peers, means)
    diff = paired_on_finished_tasks(rows, best_ours, best_peer, column, sorted(tasks))
    return BestPair(best_ours, best_peer, ours, peers, means, diff, sorted(tasks))


def best_against_kvpress(rows: list[dict], ratios: tuple[float, ...]) -> list[str]:
    """At each ratio, kvbudget's best method held to the budget against kvpress's best press, on the
    tasks the most complete kvpress presses and both bests finished: their means and the paired
    difference."""
    lines = [
        "| ratio | kvbudget's best | kvpress's best | best − best [95% CI] | tasks |",
        "|---|---|---|---|---|",
    ]
    found = False
    for ratio in ratios:
        pair = best_pair(rows, ratio)
        if pair is None:
            continue
        ours, peer = pair.cells()
        lines.append(f"| {ratio:g} | {ours} | {peer} | {difference_cell(pair.diff)} | {len(pair.tasks)} |")
        found = True
    return lines if found else ["(no kvpress rows finished yet)"]
