"""``kvbudget report DIR``: markdown tables and plots from ``DIR/results.jsonl``.

Writes ``DIR/report.md``, headed by the model, its dtype and what its weights are (a registry
model's quantization and GGUF header name, :func:`kvbudget.models.describe_weights`), with, per
task, a methods × budgets table of the task score (×100), retention (score on the samples the full
cache solves, i.e. full-cache score ≥ 0.5) and fidelity (greedy agreement with the full cache,
KL(full ‖ method)). Every such number comes with its 95 % percentile-bootstrap interval over
samples (:mod:`kvbudget.eval.intervals`), written ``mean [low, high]``; retention, agreement and KL
pool a method's budgets, so they first average each sample over the budgets and resample those
per-sample means.

Budgets are columns ``B=64`` (entries per KV head) or ``r=0.75`` (a compression ratio as kvpress
defines it, the fraction of the compressed tokens removed: rows of ``kvbudget eval
--compression-ratios``, whose entries per head vary with each sample's length). Rows written before
ratios existed carry no ``compression_ratio`` and read as budget rows.

Across tasks (perplexity tasks left out: another scale and direction): per budget or ratio, each
method's rank on each task by mean score (1 = best, ties share their mean rank) and its mean rank
over the tasks; and the mean score over tasks, each task weighing the same, with a stratified
bootstrap interval (samples resampled within each task, tasks fixed) — a table and a
score-vs-compression plot with one line per method. Only methods with scores on every task of a
column are ranked and averaged there; the full cache is the reference line, not ranked.

Rows labelled ``kvpress:NAME`` are NVIDIA kvpress's presses run on the same samples and ratios
(``kvbudget eval --peer-presses``, :mod:`kvbudget.eval.peer_rows`): they are ranked and averaged
beside kvbudget's methods, and the across-tasks section adds, per column where they ran, kvbudget's
best method against kvpress's best press — each the highest mean score over the column's tasks
among its side's methods scored on every task there; kvbudget's side leaves out the methods that
keep more than the budget by design (``exceeds_budget``: ASL's full-cache variant, PyramidInfer) —
with both intervals and the paired difference kvbudget − kvpress on the samples both scored, with
its 95 % interval (:func:`kvbudget.eval.paired.paired_difference`; an interval holding 0 is no
win).

PNGs: score vs budget (and vs ratio) per task with the intervals as error bars, needle heatmaps
(length × depth) per method and budget, per-layer/per-head budget maps; for prune-stage methods,
the distribution of the selection layer per task (table and histogram).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from kvbudget.errors import KVBudgetError
from kvbudget.eval.intervals import (
    DEFAULT_RESAMPLES,
    Interval,
    bootstrap_mean,
    bootstrap_mean_over_groups,
)
from kvbudget.eval.paired import PairedDifference, paired_difference
from kvbudget.eval.store import load_rows, no_results_message
from kvbudget.eval.turns_report import is_conversation, plot_turns, turns_table
from kvbudget.models import describe_weights
from kvbudget.phases import Stage

SOLVED = 0.5
#: the label prefix of kvpress's rows (:mod:`kvbudget.eval.peer_rows`)
PEER_PREFIX = "kvpress:"

#: A table column: ``("B", entries per KV head)`` or ``("r", compression ratio)``.
Column = tuple[str, float]


def is_peer(label: str) -> bool:
    """Whether ``label`` is a kvpress press's (``kvpress:NAME``) rather than a kvbudget method's."""
    return label.startswith(PEER_PREFIX)


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def _fmt(value: float | None, scale: float = 100.0, digits: int = 1) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def _cell(interval: Interval | None, scale: float = 100.0, digits: int = 1) -> str:
    """``mean [low, high]`` scaled, or ``–`` without values."""
    if interval is None:
        return "–"
    low, high = _fmt(interval.low, scale, digits), _fmt(interval.high, scale, digits)
    return f"{_fmt(interval.mean, scale, digits)} [{low}, {high}]"


def _interval(values: list[float | None], resamples: int = DEFAULT_RESAMPLES) -> Interval | None:
    values = [v for v in values if v is not None]
    return bootstrap_mean(values, resamples=resamples) if values else None


def _group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[tuple(row.get(k) for k in keys)].append(row)
    return groups


def _group_by(rows: list[dict], key: Callable[[dict], Hashable]) -> dict[Any, list[dict]]:
    groups: dict[Any, list[dict]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return groups


def _column(row: dict) -> Column | None:
    """The row's column: its compression ratio, else its budget; ``None`` for the full cache."""
    ratio = row.get("compression_ratio")
    if ratio is not None:
        return ("r", float(ratio))
    return None if row.get("budget") is None else ("B", row["budget"])


def _column_label(column: Column | None) -> str:
    if column is None:
        return "all"
    kind, value = column
    return f"B={value}" if kind == "B" else f"r={value:g}"


def _columns(rows: list[dict]) -> list[Column]:
    """The rows' columns: budgets ascending, then ratios ascending."""
    return sorted({c for r in rows if (c := _column(r)) is not None})


def _most_compressed(columns: list[Column]) -> Column:
    """The smallest budget, or without budgets the largest ratio."""
    budgets = [c for c in columns if c[0] == "B"]
    return min(budgets) if budgets else max(columns)


def _is_full(rows: list[dict]) -> bool:
    return all(_column(r) is None for r in rows)


def _per_sample(rows: list[dict], name: str, keep: Callable[[dict], bool] = lambda r: True) -> list[float]:
    """One value per sample: the mean of ``name`` over the sample's rows (its budgets) kept by ``keep``."""
    by_sample = _group_by(
        [r for r in rows if keep(r) and r.get(name) is not None],
        lambda r: (r.get("model"), r["task"], r["length"], r["sample"]),
    )
    return [mean(r[name] for r in mine) for mine in by_sample.values()]


def _counts(counts: list[int]) -> str:
    return (
        "–"
        if not counts
        else str(min(counts))
        if min(counts) == max(counts)
        else f"{min(counts)}–{max(counts)}"
    )


def perplexity_table(rows: list[dict], resamples: int = DEFAULT_RESAMPLES) -> list[str]:
    """Markdown lines: methods × budgets of mean perplexity (lower is better) with intervals."""
    columns = _columns(rows) or [None]
    lines = [
        "| method | " + " | ".join(_column_label(c) for c in columns) + " | n |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    for (label,), mine in _group(rows, "label").items():
        cells, counts = [], []
        for column in columns:
            scores = [r["score"] for r in mine if _column(r) in (column, None)]
            cells.append(_cell(_interval(scores, resamples), 1, 2))
            counts += [len(scores)] if scores else []
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_counts(counts)} |")
    return lines


def task_table(rows: list[dict], resamples: int = DEFAULT_RESAMPLES) -> list[str]:
    """Markdown lines: methods × budgets of mean score with intervals, the samples per cell (n),
    and retention and fidelity columns pooled over the method's budgets."""
    columns = _columns(rows) or [None]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lines = [
        "| method | " + " | ".join(_column_label(c) for c in columns) + " | n | retention | agreement | KL |",
        "|---|" + "---|" * (len(columns) + 4),
    ]
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        if _is_full(mine):  # full cache: one number
            scores = [r["score"] for r in mine]
            cells, counts = [_cell(_interval(scores, resamples))] * len(columns), [len(scores)]
        else:
            cells, counts = [], []
            for column in columns:
                scores = [r["score"] for r in mine if _column(r) == column]
                cells.append(_cell(_interval(scores, resamples)))
                counts += [len(scores)] if scores else []
        solved = _per_sample(mine, "score", lambda r: (r.get("full_score") or 0) >= SOLVED)
        lines.append(
            f"| {label} | " + " | ".join(cells) + f" | {_counts(counts)} "
            f"| {_cell(_interval(solved, resamples))} "
            f"| {_cell(_interval(_per_sample(mine, 'agreement'), resamples))} "
            f"| {_cell(_interval(_per_sample(mine, 'kl'), resamples), 1, 3)} |"
        )
    return lines


# ---------------------------------------------------------------------------------------- across tasks


@dataclass
class AcrossTasks:
    """Scores averaged and ranked over tasks, per column (see the module docstring).

    ``scores[column][label]``: mean over the column's tasks of the label's mean score, with its
    stratified bootstrap interval (the full cache's at every column); ``ranks[column][label]``:
    mean rank over those tasks (1 = best); ``left_out[column]``: labels without a score on every
    task of the column; ``reference[label]``: a full-cache label's mean over all tasks.
    """

    tasks: dict[Column, list[str]] = field(default_factory=dict)
    scores: dict[Column, dict[str, Interval]] = field(default_factory=dict)
    ranks: dict[Column, dict[str, float]] = field(default_factory=dict)
    left_out: dict[Column, list[str]] = field(default_factory=dict)
    reference: dict[str, Interval] = field(default_factory=dict)

    @property
    def columns(self) -> list[Column]:
        return sorted(self.tasks)


def average_ranks(scores: dict[str, float]) -> dict[str, float]:
    """Rank 1 for the highest score; tied scores (equal to 12 decimals) share their mean rank."""
    ordered = sorted(scores, key=lambda label: -scores[label])
    ranks: dict[str, float] = {}
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and round(scores[ordered[end + 1]], 12) == round(
            scores[ordered[start]], 12
        ):
            end += 1
        for label in ordered[start : end + 1]:
            ranks[label] = (start + 1 + end + 1) / 2
        start = end + 1
    return ranks


def across_tasks(rows: list[dict], resamples: int = DEFAULT_RESAMPLES) -> AcrossTasks:
    """Mean scores (with intervals) and mean ranks over the non-perplexity tasks, per column."""
    rows = [r for r in rows if r["metric"] != "perplexity" and r.get("score") is not None]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    full = [label for label in labels if _is_full([r for r in rows if r["label"] == label])]
    scores: dict[tuple[str, str, Column | None], list[float]] = defaultdict(list)
    for row in rows:
        scores[(row["task"], row["label"], _column(row))].append(row["score"])
    result = AcrossTasks()
    for label in full:
        tasks = sorted({t for t, lab, _ in scores if lab == label})
        groups = [scores[(t, label, None)] for t in tasks]
        result.reference[label] = bootstrap_mean_over_groups(groups, resamples=resamples)
    for column in _columns(rows):
        tasks = sorted({t for t, _, c in scores if c == column})
        candidates = [lab for lab in labels if any((t, lab, column) in scores for t in tasks)]
        complete = [lab for lab in candidates if all((t, lab, column) in scores for t in tasks)]
        result.tasks[column] = tasks
        result.left_out[column] = [lab for lab in candidates if lab not in complete]
        cell: dict[str, Interval] = {}
        for label in full:
            if all((t, label, None) in scores for t in tasks):
                groups = [scores[(t, label, None)] for t in tasks]
                cell[label] = bootstrap_mean_over_groups(groups, resamples=resamples)
        for label in complete:
            groups = [scores[(t, label, column)] for t in tasks]
            cell[label] = bootstrap_mean_over_groups(groups, resamples=resamples)
        result.scores[column] = cell
        per_task = [average_ranks({lab: mean(scores[(t, lab, column)]) for lab in complete}) for t in tasks]
        result.ranks[column] = {lab: mean(ranks[lab] for ranks in per_task) for lab in complete}
    return result


def common_tasks(summary: AcrossTasks) -> list[str] | None:
    """The tasks every column has, when the columns cover different task sets (else ``None``:
    the per-column tables already compare like with like)."""
    sets = [set(summary.tasks[c]) for c in summary.columns]
    if len(sets) < 2 or all(s == sets[0] for s in sets):
        return None
    shared = sorted(set.intersection(*sets))
    return shared or None


def across_tasks_tables(summary: AcrossTasks) -> list[str]:
    """Markdown lines: mean rank over tasks, then mean score over tasks with intervals."""
    columns = summary.columns
    if not columns:
        return []
    header = "| method | " + " | ".join(_column_label(c) for c in columns) + " |"
    rule = "|---|" + "---|" * len(columns)
    ranked = list(dict.fromkeys(lab for c in columns for lab in summary.ranks[c]))
    ranked.sort(key=lambda lab: mean(summary.ranks[c][lab] for c in columns if lab in summary.ranks[c]))
    lines = ["### Mean rank over tasks (1 = best)", "", header, rule]
    for label in ranked:
        cells = [_fmt(summary.ranks[c].get(label), 1, 2) for c in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    sizes = [f"{len(summary.ranks[c])} on {len(summary.tasks[c])}" for c in columns]
    lines.append("| *methods ranked on tasks* | " + " | ".join(sizes) + " |")
    lines += ["", "### Mean score over tasks (each task weighs the same)", "", header, rule]
    labels = list(summary.reference) + ranked
    for label in labels:
        cells = [_cell(summary.scores[c].get(label)) for c in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    left = {lab for c in columns for lab in summary.left_out[c]}
    if left:
        lines += ["", "Not ranked where a task lacks their scores: " + ", ".join(sorted(left)) + "."]
    return lines


@dataclass
class BestVersusBest:
    """One column's best of each side: ``ours`` / ``theirs`` the labels sharing the highest mean
    score over the column's tasks among kvbudget's methods held to the budget / kvpress's presses
    (full-cache labels left out), with that score's interval; ``difference``: the paired
    ``ours[0] − theirs[0]`` on the samples both scored in the column."""

    column: Column
    ours: list[str]
    ours_score: Interval | None
    theirs: list[str]
    theirs_score: Interval | None
    difference: PairedDifference | None = None

    @property
    def verdict(self) -> str:
        """From the paired difference's interval: a side ahead only where it excludes 0."""
        if self.difference is None:
            return "–"
        return _VERDICTS[self.difference.verdict]


#: :attr:`PairedDifference.verdict` of kvbudget − kvpress, said of the two sides
_VERDICTS = {
    "ahead": "kvbudget ahead",
    "behind": "kvpress ahead",
    "no clear difference": "no clear difference (the interval holds 0)",
}


def beyond_budget_labels(rows: list[dict]) -> frozenset[str]:
    """The labels of rows whose method keeps more than the budget by design (a registered method's
    ``exceeds_budget``); kvpress's presses and unregistered names are not among them."""
    from kvbudget.methods.registry import method_info, method_names  # torch: only when asked

    known = set(method_names())
    return frozenset(
        r["label"] for r in rows
        if r.get("method") in known and method_info(r["method"]).exceeds_budget
    )  # fmt: skip


def best_versus_best(
    summary: AcrossTasks,
    rows: list[dict] | None = None,
    beyond_budget: frozenset[str] = frozenset(),
    resamples: int = DEFAULT_RESAMPLES,
) -> list[BestVersusBest]:
    """Per column where a kvpress press was scored on every task: kvbudget's best method held to the
    budget (``beyond_budget`` labels left out) against kvpress's best press by mean score over the
    tasks (ties: every label sharing the best mean, sorted by name), and with ``rows`` the paired
    difference of the first of each."""
    result = []
    for column in summary.columns:
        cell = {lab: iv for lab, iv in summary.scores[column].items() if lab not in summary.reference}
        sides = []
        for peer in (False, True):
            mine = {lab: iv for lab, iv in cell.items() if is_peer(lab) == peer and lab not in beyond_budget}
            top = max((iv.mean for iv in mine.values()), default=0.0)
            best = sorted(lab for lab, iv in mine.items() if round(iv.mean - top, 12) == 0)
            sides.append((best, mine[best[0]] if best else None))
        (ours, ours_score), (theirs, theirs_score) = sides
        if not theirs:
            continue
        difference = None
        if rows is not None and ours:  # over the column's tasks (perplexity is never among them)
            tasks = summary.tasks[column]
            difference = paired_difference(rows, ours[0], theirs[0], column, tasks, resamples)
        result.append(BestVersusBest(column, ours, ours_score, theirs, theirs_score, difference))
    return result


def best_versus_best_lines(
    summary: AcrossTasks,
    rows: list[dict] | None = None,
    beyond_budget: frozenset[str] = frozenset(),
    resamples: int = DEFAULT_RESAMPLES,
) -> list[str]:
    """Markdown lines: the :func:`best_versus_best` table, or nothing without kvpress rows."""
    pairs = best_versus_best(summary, rows, beyond_budget, resamples)
    if not pairs:
        return []
    lines = [
        "### kvbudget's best method vs kvpress's best press",
        "",
        "Per column, the highest mean score over the column's tasks on each side (methods scored on every "
        "task there; ties list every label), with its 95% interval, and the paired difference of the two "
        "(the first of tied labels) on the samples both scored, with its 95% interval: a side is ahead "
        "only where that interval excludes 0.",
        "",
        "| column | kvbudget's best | score | kvpress's best | score | kvbudget − kvpress | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for pair in pairs:
        lines.append(
            f"| {_column_label(pair.column)} | {', '.join(pair.ours) or '–'} | {_cell(pair.ours_score)} "
            f"| {', '.join(pair.theirs)} | {_cell(pair.theirs_score)} | {_difference_cell(pair.difference)} "
            f"| {pair.verdict} |"
        )
    left = sorted(beyond_budget & {lab for pair in pairs for lab in summary.scores[pair.column]})
    if left:
        lines += ["", "Left out of kvbudget's side (they keep more than the budget by design): "
                  + ", ".join(left) + "."]  # fmt: skip
    return lines


def _difference_cell(difference: PairedDifference | None) -> str:
    if difference is None:
        return "–"
    d = difference.difference
    return f"{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"


# ---------------------------------------------------------------------------------------- plots


def _draw_score_lines(
    lines: dict[str, list[tuple[float, Interval]]],
    references: dict[str, Interval],
    kind: str,
    title: str,
    path: Path,
    bands: bool = False,
) -> None:
    """Score (×100) vs budget (``kind`` ``B``, log axis) or ratio (``r``): one line per label with
    its intervals as error bars (``bands``: as shaded bands); reference labels as a dashed line
    over a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab20").colors
    markers = "osD^v<>ph*"
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for label, interval in references.items():
        ax.axhline(100 * interval.mean, color="black", linestyle="--", label=label)
        ax.axhspan(100 * interval.low, 100 * interval.high, color="black", alpha=0.08, linewidth=0)
    for i, (label, points) in enumerate(lines.items()):
        xs = [x for x, _ in points]
        ys = [100 * iv.mean for _, iv in points]
        color, style = colors[i % len(colors)], "-" if i < len(colors) else ":"
        style = "-." if is_peer(label) and style == "-" else style  # kvpress's presses
        if bands:
            lows, highs = [100 * iv.low for _, iv in points], [100 * iv.high for _, iv in points]
            ax.fill_between(xs, lows, highs, color=color, alpha=0.12, linewidth=0)
            ax.plot(xs, ys, label=label, color=color, marker=markers[i % len(markers)], linestyle=style,
                    markersize=4, linewidth=1.2)  # fmt: skip
            continue
        errors = [[y - 100 * iv.low for y, (_, iv) in zip(ys, points, strict=True)],
                  [100 * iv.high - y for y, (_, iv) in zip(ys, points, strict=True)]]  # fmt: skip
        ax.errorbar(
            xs, ys, yerr=errors, label=label, color=color, marker=markers[i % len(markers)],
            linestyle=style, capsize=2, markersize=4, linewidth=1.2,
        )  # fmt: skip
    if kind == "B":
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (entries per KV head)")
    else:
        ax.set_xlabel("compression ratio (fraction of tokens removed, as kvpress)")
    ax.set_ylabel("score (95% bootstrap interval)")
    ax.set_ylim(-5, 105)
    ax.set_title(title)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_score_vs_budget(
    rows: list[dict], task: str, path: Path, kind: str = "B", resamples: int = DEFAULT_RESAMPLES
) -> bool:
    """One task's score vs budget (``kind="B"``) or compression ratio (``"r"``) with intervals;
    ``False`` (nothing written) when no row has that kind of column."""
    lines: dict[str, list[tuple[float, Interval]]] = {}
    references: dict[str, Interval] = {}
    for (label,), mine in _group(rows, "label").items():
        if _is_full(mine):
            references[label] = bootstrap_mean([r["score"] for r in mine], resamples=resamples)
            continue
        points = []
        for column in _columns(mine):
            if column[0] == kind:
                scores = [r["score"] for r in mine if _column(r) == column]
                points.append((column[1], bootstrap_mean(scores, resamples=resamples)))
        if points:
            lines[label] = points
    if not lines:
        return False
    _draw_score_lines(lines, references, kind, task, path)
    return True


def plot_across_tasks(summary: AcrossTasks, kind: str, path: Path) -> bool:
    """Mean score over tasks vs budget (``kind="B"``) or ratio (``"r"``), one line per method, with
    the stratified bootstrap intervals as bands; ``False`` when no column has that kind."""
    lines: dict[str, list[tuple[float, Interval]]] = defaultdict(list)
    for column in summary.columns:
        if column[0] != kind:
            continue
        for label, interval in summary.scores[column].items():
            if label not in summary.reference:
                lines[label].append((column[1], interval))
    if not lines:
        return False
    tasks = sorted({t for c in summary.columns if c[0] == kind for t in summary.tasks[c]})
    title = f"mean over {len(tasks)} tasks"
    _draw_score_lines(dict(lines), summary.reference, kind, title, path, bands=True)
    return True


def plot_needle_heatmaps(rows: list[dict], path: Path) -> bool:
    """One panel per (method, budget): score by context length (x) and needle depth (y)."""
    rows = [r for r in rows if "depth" in r.get("meta", {})]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = list(_group_by(rows, lambda r: (r["label"], _column(r))).items())
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["meta"]["depth"] for r in rows})
    cols = min(4, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols, 2.4 * nrows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, ((label, column), mine) in zip(axes.flat, panels, strict=False):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, depth in enumerate(depths):
            for j, length in enumerate(lengths):
                scores = [r["score"] for r in mine if r["length"] == length and r["meta"]["depth"] == depth]
                if scores and None not in scores:
                    grid[i, j] = 100 * mean(scores)
        ax.axis("on")
        ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(f"{label} {_column_label(column)}", fontsize=8)
    fig.supxlabel("context length (tokens)", fontsize=8)
    fig.supylabel("needle depth", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_budget_maps(rows: list[dict], path: Path) -> bool:
    """Mean kept entries per (layer, KV head), one panel per method at its smallest budget (or,
    with ratios only, its largest compression ratio)."""
    rows = [r for r in rows if r.get("budgets") and _column(r) is not None]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = []
    for label, mine in _group(rows, "label").items():
        smallest = _most_compressed(_columns(mine))
        maps = np.array([r["budgets"] for r in mine if _column(r) == smallest], dtype=float)
        panels.append((label[0], smallest, maps.mean(0)))
    fig, axes = plt.subplots(1, len(panels), figsize=(1.9 * len(panels) + 1, 4), squeeze=False)
    for ax, (label, budget, grid) in zip(axes[0], panels, strict=True):
        image = ax.imshow(grid, aspect="auto", cmap="viridis")
        ax.set_title(f"{label}\n{_column_label(budget)}", fontsize=8)
        ax.set_xlabel("KV head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        fig.colorbar(image, ax=ax, fraction=0.08)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


@functools.cache
def _is_prune_method(name: str) -> bool:
    from kvbudget.methods.presets import split_preset
    from kvbudget.methods.registry import REGISTRY

    base = split_preset(name.partition(":")[0])[0]
    return base in REGISTRY and Stage.PRUNE in REGISTRY[base].stages


def selection_layer_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per prune-stage method, budget and task, how often each layer was the
    selection layer (``-`` = nothing pruned), from the rows' ``selection_layer``."""
    rows = [r for r in rows if _is_prune_method(r["method"]) and _column(r) is not None]
    if not rows:
        return []
    lines = ["| method | budget | task | selection layer: samples | mean layer |", "|---|---|---|---|---|"]
    groups = _group_by(rows, lambda r: (r["label"], _column(r), r["task"]))
    for (label, column, task), mine in sorted(groups.items()):
        counts: dict[Any, int] = defaultdict(int)
        for r in mine:
            counts[r["selection_layer"]] += 1
        keys = sorted(k for k in counts if k is not None) + ([None] if None in counts else [])
        cells = ", ".join(f"{'-' if k is None else k}: {counts[k]}" for k in keys)
        layers = [r["selection_layer"] for r in mine if r["selection_layer"] is not None]
        lines.append(
            f"| {label} | {_column_label(column)} | {task} | {cells} | {_fmt(_mean(layers), 1, 1)} |"
        )
    return lines


def plot_selection_layers(rows: list[dict], path: Path) -> bool:
    """Histogram of selection layers per task, one panel per prune-stage method (smallest budget)."""
    rows = [r for r in rows if r.get("selection_layer") is not None and _column(r) is not None]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r["label"] for r in rows})
    tasks = sorted({r["task"] for r in rows})
    top = max(r["selection_layer"] for r in rows)
    fig, axes = plt.subplots(1, len(labels), figsize=(3.2 * len(labels) + 0.5, 3), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        mine = [r for r in rows if r["label"] == label]
        smallest = _most_compressed(_columns(mine))
        at_budget = [r for r in mine if _column(r) == smallest]
        data = [[r["selection_layer"] for r in at_budget if r["task"] == t] for t in tasks]
        ax.hist(data, bins=range(0, top + 2), label=tasks, align="left")
        ax.set_title(f"{label} {_column_label(smallest)}", fontsize=8)
        ax.set_xlabel("selection layer", fontsize=7)
        ax.set_ylabel("samples", fontsize=7)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(out: Path, resamples: int = DEFAULT_RESAMPLES) -> Path:
    """Write ``out/report.md`` and its PNGs; returns the report's path.

    ``resamples``: bootstrap resamples per interval (fewer renders faster, with noisier bounds).
    """
    out = Path(out)
    rows = load_rows(out / "results.jsonl")
    if not rows:
        raise KVBudgetError(no_results_message(out))
    conversations = [r for r in rows if is_conversation(r)]
    # a shared-context run writes a row per mode: the generic tables read each mode as a task of its own
    rows = [{**r, "task": f"{r['task']}-{r['conversation']}"} if r.get("conversation") else r for r in rows]
    ok = [r for r in rows if r.get("error") is None]
    errors = [r for r in rows if r.get("error") is not None]
    models = sorted({r["model"] for r in rows})
    dtypes = sorted({r["dtype"] for r in rows if r.get("dtype")})
    lines = [
        f"# kvbudget evaluation report — {out}",
        "",
        f"Model(s): {', '.join(models)}"
        + (f" ({', '.join(dtypes)})" if dtypes else "")
        + "."
        + "".join(f" Weights of `{model}`: {describe_weights(model)}." for model in models),
        "",
        f"{len(ok)} runs, {len(errors)} errors. Scores ×100; every cell is `mean [low, high]`, the "
        "mean over samples with its 95% percentile-bootstrap interval (samples resampled, "
        f"{resamples} resamples, seed 0); n = samples per cell. Columns: `B=` entries per KV head, "
        "`r=` compression ratio (fraction of the compressed tokens removed, as kvpress). Retention = "
        "score on samples the full cache solves; agreement = greedy tokens equal to the full cache's "
        "answer (×100); KL = mean KL(full ‖ method) per answer token under teacher forcing; these "
        "three pool a method's columns (each sample averaged over them first).",
        "",
    ]
    peers = [r for r in rows if is_peer(r["label"])]
    if peers:
        versions = sorted({(r.get("peer") or {}).get("versions") or "kvpress" for r in peers})
        lines += [
            f"Rows labelled `{PEER_PREFIX}NAME` are NVIDIA kvpress's presses ({'; '.join(versions)}, in "
            "their own process) on the same samples, ratios and question mode, scored by the same task "
            "metrics; their agreement and KL are not measured (–), their times are kvpress's process's.",
            "",
        ]
    summary = across_tasks(ok, resamples)
    if summary.columns:
        lines += ["## Across tasks", "", *across_tasks_tables(summary), ""]
        beyond = beyond_budget_labels(ok) if any(is_peer(r["label"]) for r in ok) else frozenset()
        versus = best_versus_best_lines(summary, ok, beyond, resamples)
        if versus:
            lines += [*versus, ""]
        shared = common_tasks(summary)
        if shared is not None:  # columns cover different tasks: compare them on the shared ones
            summary = across_tasks([r for r in ok if r["task"] in shared], resamples)
            lines += [
                f"## Across the {len(shared)} tasks every column has ({', '.join(shared)})",
                "",
                *across_tasks_tables(summary),
                "",
                *best_versus_best_lines(summary, ok, beyond, resamples),
                "",
            ]
        for kind, name in (("B", "budget"), ("r", "ratio")):
            png = out / f"score_vs_{name}_mean.png"
            if plot_across_tasks(summary, kind, png):
                lines += [f"![mean score over tasks vs {name}]({png.name})", ""]
    for (task,), task_rows in _group(ok, "task").items():
        if task_rows[0]["metric"] == "perplexity":
            lines += [
                f"## {task} (perplexity, lower is better)",
                "",
                *perplexity_table(task_rows, resamples),
                "",
            ]
            continue
        lines += [f"## {task}", "", *task_table(task_rows, resamples), ""]
        for kind, name in (("B", "budget"), ("r", "ratio")):
            png = out / f"score_vs_{name}_{task}.png"
            if plot_score_vs_budget(task_rows, task, png, kind, resamples):
                lines += [f"![score vs {name}, {task}]({png.name})", ""]
    if conversations:
        lines += [
            "## Turn 1 and later turns (shared-context tasks)",
            "",
            "One context, several questions: turn 1 is answered from the cache compressed for it; in "
            "`multi-turn` each later question follows the earlier answers in one conversation, in "
            "`multi-request` each is a new request on the same compressed context. Later turns = the "
            "mean of turns 2, 3, …; later − full = the paired difference from the full cache on them "
            "(scores ×100, means over tasks). Compress s and KV KiB: the first prompt's compression.",
            "",
            *turns_table(conversations, resamples),
            "",
        ]
        if plot_turns(conversations, out / "turns.png"):
            lines += ["![mean score by turn](turns.png)", ""]
    if plot_needle_heatmaps([r for r in ok if r["family"] == "needle"], out / "needle_heatmaps.png"):
        lines += ["## Needle heatmaps", "", "![needle heatmaps](needle_heatmaps.png)", ""]
    if plot_budget_maps(ok, out / "budget_maps.png"):
        lines += ["## Budgets per layer and head", "", "![budget maps](budget_maps.png)", ""]
    selection = selection_layer_table(ok)
    if selection:
        lines += ["## Selection layers (prune-stage methods)", "", *selection, ""]
        if plot_selection_layers(ok, out / "selection_layers.png"):
            lines += ["![selection layers](selection_layers.png)", ""]
    timing = _group([r for r in ok if r["metric"] != "perplexity"], "label")
    lines += [
        "## Speed and memory",
        "",
        "| method | TTFT s | compress s | TPOT ms | KV logical MiB | KV physical MiB |",
        "|---|---|---|---|---|---|",
    ]
    for (label,), mine in timing.items():
        lines.append(
            f"| {label} | {_fmt(_mean([r['ttft_s'] for r in mine]), 1, 2)} "
            f"| {_fmt(_mean([r['compress_s'] for r in mine]), 1, 3)} "
            f"| {_fmt(_mean([r.get('tpot_s') for r in mine]), 1000, 0)} "
            f"| {_fmt(_mean([r['logical_bytes'] for r in mine]), 1 / 2**20, 1)} "
            f"| {_fmt(_mean([r['physical_bytes'] for r in mine]), 1 / 2**20, 1)} |"
        )
    if errors:
        lines += ["", "## Errors", ""]
        lines += [
            f"- {r['task']} #{r['sample']} {r['label']} {_column_label(_column(r))}: {r['error']}"
            for r in errors
        ]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return report
