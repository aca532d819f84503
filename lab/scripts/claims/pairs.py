"""Tables of method pairs: ``a − b`` per compression column, and the selection layers of the
methods that choose one; the pairs of kvpress's presses with kvbudget's same methods."""

from __future__ import annotations

import statistics
from collections import defaultdict

from kvbudget.eval.report import PEER_PREFIX

from .common import MIN_SAMPLES, column_label, columns_of, difference_cell, paired_on_finished_tasks, pct


def pairs_table(
    rows: list[dict],
    pairs: list[tuple[str, str]],
    tasks: list[str] | None = None,
    min_samples: int = MIN_SAMPLES,
    scale: float = 100.0,
) -> list[str]:
    """One row per pair, one column per compression column: mean(a) vs mean(b), a − b [95% CI].

    A column where no pair has a finished task yet (a ratio still running) is left out."""
    columns = columns_of([r for r in rows if r["label"] in {x for p in pairs for x in p}])
    grid = {
        (pair, c): paired_on_finished_tasks(rows, *pair, c, tasks, min_samples)
        for pair in pairs
        for c in columns
    }
    columns = [c for c in columns if any(grid[pair, c] is not None for pair in pairs)]
    lines = [
        "| a − b | " + " | ".join(column_label(c) for c in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for a, b in pairs:
        cells = []
        for column in columns:
            result = grid[(a, b), column]
            if result is None:
                cells.append("–")
                continue
            means = f"{pct(result.a.mean, scale)} vs {pct(result.b.mean, scale)}"
            cells.append(f"{means}: {difference_cell(result, scale)} ({len(result.tasks)} tasks)")
        lines.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
    return lines


def selection_layers(rows: list[dict], methods: list[str]) -> list[str]:
    """Per task: each method's selection layers (median, range, share with none selected), on the
    (task, ratio) cells every method has finished (``MIN_SAMPLES`` samples)."""
    by = defaultdict(list)
    for r in rows:
        if r["method"] in methods and r.get("score") is not None and r.get("compression_ratio") is not None:
            by[(r["task"], r["method"], r["compression_ratio"])].append(r.get("selection_layer"))
    lines = ["| task | ratio | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    cells_done = {(t, c) for t, _, c in by if all(len(by.get((t, m, c), [])) >= MIN_SAMPLES for m in methods)}
    for task, ratio in sorted(cells_done):
        cells = []
        for m in methods:
            layers = by.get((task, m, ratio), [])
            chosen = [x for x in layers if x is not None]
            if not layers:
                cells.append("–")
                continue
            none = len(layers) - len(chosen)
            text = f"{statistics.median(chosen):g} ({min(chosen)}–{max(chosen)})" if chosen else "none"
            cells.append(text + (f", none in {none}/{len(layers)}" if none and chosen else ""))
        lines.append(f"| {task} | {ratio:g} | " + " | ".join(cells) + " |")
    return lines


#: kvpress's presses against kvbudget's implementation of the same method, same samples. SnapKV,
#: AdaKV and PyramidKV run at kvpress's defaults there (window 64) and at the papers' here.
SAME_METHOD_PAIRS = [
    (f"{PEER_PREFIX}{press}", ours)
    for press, ours in [
        ("expected_attention", "expected-attention"), ("keydiff", "keydiff"), ("knorm", "knorm"),
        ("tova", "tova"), ("observed_attention", "observed-attention"), ("streaming_llm", "streamingllm"),
        ("snapkv", "snapkv"), ("adakv_snapkv", "ada-snapkv"), ("pyramidkv", "pyramidkv"),
        ("compactor", "compactor"), ("snapkv@paper", "snapkv"), ("adakv_snapkv@paper", "ada-snapkv"),
        ("pyramidkv@paper", "pyramidkv"), ("chunkkv", "chunkkv"), ("kvgrad", "kvgrad"),
        ("leverage", "leverage"),
        # AdaKV's head split over Compactor's scores; the head floors differ (kvpress's safeguard,
        # AdaKV's n_h(1 − α) + α·B' here), so the kept positions are not the same
        ("adakv_compactor", "compactor:head_alloc=ada"),
    ]
]  # fmt: skip
