"""Score against bytes: eviction alone, quantization alone and the two together (issue: one byte
budget), one panel a track and mode: the shared-context rows (one 2K context, four questions; later
turns scored) in both modes, and the leaderboard's core tasks (one question) in both tracks.

    .venv/bin/python lab/scripts/equal_bytes_plot.py [RESULTS ...] [--plot PNG] [--tasks T,...]

``RESULTS`` defaults to the equal-bytes grid's three folders (lab/scripts/byte_budget_grid.sh):
``lab/results/shared-context-agnostic`` (a panel each mode), ``lab/results/equal-bytes-agnostic`` and
``lab/results/equal-bytes`` (one question, question-agnostic and -aware). The anchors (issue: one
byte budget) are kvpress's rows on transformers' ``QuantizedCache`` (quanto, 4 and 2 bits, residual
128; ``NAME+quanto4`` in ``--peer-presses``). A point is a (method, precision, ratio): its score
(later turns 2-4 of a conversation, or the one answer's; the mean within each task, then over tasks)
against its cache's size right after the compression as a share of the full bf16 cache's (each
row's ``physical_bytes`` over its sample's full-cache ``logical_bytes``: entries × (key + value) × 2
bytes, no storage room; quantized rows' bytes include scales, minima, key group indices and the
full-precision tail). A point is drawn only with every sample of every task the full cache has.
The model: qwen2.5-coder-0.5b, 4-bit GGUF weights dequantized to bf16.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from kvbudget.eval.store import load_rows
from kvbudget.eval.turns_report import is_conversation, later_turns

DEFAULT_RESULTS = (
    Path("lab/results/shared-context-agnostic"),
    Path("lab/results/equal-bytes-agnostic"),
    Path("lab/results/equal-bytes"),
)
ONE_QUESTION = "one question"
STYLES = {"16": "-", "8": ":", "4": "--", "2": "-.", "8+4": (0, (1, 1, 4, 1))}
MARKERS = {"16": "o", "8+4": "*", "8": "D", "4": "s", "2": "v"}
TICKS = (5, 10, 25, 50, 100)


def _base(label: str) -> tuple[str, str]:
    """``snapkv:kv_bits=4`` → (``snapkv``, ``"4"``); without kv_bits ``"16"``; a byte budget
    (``snapkv:memory=0.125``) → (``snapkv``, ``"8+4"``: its two precisions); an anchor in kvpress's
    environment (``kvpress:no_press+quanto4``) → (``transformers QuantizedCache``, ``"4"``), under a
    press (``kvpress:expected_attention+quanto4``) → (``kvpress expected_attention + QuantizedCache``,
    ``"4"``)."""
    if label.startswith("kvpress:"):
        press, _, cache = label.removeprefix("kvpress:").partition("+quanto")
        name = "transformers QuantizedCache" if press == "no_press" else f"kvpress {press} + QuantizedCache"
        return name, cache
    name, _, options = label.partition(":")
    pairs = dict(p.split("=", 1) for p in options.split(",") if "=" in p)
    bits = "8+4" if pairs.pop("memory", None) is not None else pairs.pop("kv_bits", "16")
    rest = ",".join(f"{k}={v}" for k, v in pairs.items())
    return (name + (":" + rest if rest else ""), bits)


def _budget(row: dict) -> float | None:
    """The row's compression ratio, or its byte budget's share; none for an anchor without a press
    (transformers' QuantizedCache keeps every entry whatever the ratio)."""
    if row["label"].startswith("kvpress:no_press"):
        return None
    return row.get("memory") if row.get("memory") is not None else row.get("compression_ratio")


Key = tuple[str, str, float | None]
Point = tuple[float, float, int]  # bytes share, score, tasks


def panels(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows of each panel: ``"<track>, <mode>"`` for conversations, ``"<track>, one question"``."""
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("error") is not None:
            continue
        track = "question-agnostic" if r.get("mode") == "agnostic" else "question-aware"
        mode = r["conversation"] if is_conversation(r) else ONE_QUESTION
        out[f"{track}, {mode}"].append(r)
    return out


def points(
    rows: list[dict], tasks: set[str] | None = None, skip: set[str] = frozenset()
) -> tuple[dict[Key, Point], list[Key]]:
    """(method, bits, ratio) → (bytes share, score, tasks) for one panel's rows, for the points with
    every sample of every task the full cache has; and the points left out (incomplete)."""
    rows = [
        r  # kvbudget's rows, and kvpress's on transformers' QuantizedCache (the anchors)
        for r in rows
        if (not r["label"].startswith("kvpress:") or "+quanto" in r["label"])
        and (tasks is None or r["task"] in tasks)
        and r["task"] not in skip
    ]
    full = {(r["task"], r["sample"]): r["logical_bytes"] for r in rows if r["label"] == "full"}
    wanted: dict[str, set[int]] = defaultdict(set)
    for task, sample in full:
        wanted[task].add(sample)
    groups: dict[Key, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if (r["task"], r["sample"]) in full:
            groups[(*_base(r["label"]), _budget(r))][r["task"]][r["sample"]] = r
    out, left_out = {}, []
    for key, by in groups.items():
        if any(set(by.get(task, {})) != samples for task, samples in wanted.items()):
            left_out.append(key)
            continue
        share, score = [], []
        for t in wanted:
            runs = list(by[t].values())
            share.append(sum(r["physical_bytes"] / full[(t, r["sample"])] for r in runs) / len(runs))
            score.append(sum(later_turns(r) if is_conversation(r) else r["score"] for r in runs) / len(runs))
        out[key] = (sum(share) / len(share), sum(score) / len(score), len(wanted))
    return out, left_out


def table(title: str, found: dict[Key, Point], left_out: list[Key]) -> list[str]:
    """One panel's points as a markdown table, smallest bytes last."""
    what = "one answer" if title.endswith(ONE_QUESTION) else "later turns"
    tasks = next(iter(found.values()))[2]
    lines = [f"**{title}** ({what}, {tasks} tasks)", ""]
    if left_out:  # the pilots' five-sample points, and the grid's points still running
        lines += [f"{len(left_out)} points left out: not every sample of every task yet", ""]
    lines += ["| method | bits | r (or memory) | bytes % | score |", "|---|---|---|---|---|"]
    for (name, bits, ratio), (share, score, _) in sorted(found.items(), key=lambda kv: -kv[1][0]):
        shown = ratio if ratio is not None else "–"
        lines.append(f"| {name} | {bits} | {shown} | {100 * share:.1f} | {100 * score:.1f} |")
    return lines


def plot(found: dict[str, dict[Key, Point]], path: Path) -> None:
    """One panel a track and mode: score against bytes (log), a line a (method, bits)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({key[0] for pts in found.values() for key in pts})
    cols = 2 if len(found) > 1 else 1
    nrows = (len(found) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.2 * nrows), squeeze=False, sharex=True)
    handles: dict[str, object] = {}
    for ax, (title, pts) in zip(axes.flat, found.items(), strict=False):
        lines: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
        for (name, bits, _), (share, score, _) in pts.items():
            lines[(name, bits)].append((share, score))
        for (name, bits), xy in sorted(lines.items()):
            xy.sort()
            shown = ("full cache" if bits == "16" else "quantization alone") if name == "full" else name
            (line,) = ax.plot(
                [100 * s for s, _ in xy],
                [100 * v for _, v in xy],
                linestyle=STYLES.get(bits, "-"),
                marker=MARKERS.get(bits, "o"),
                markersize=9 if bits == "8+4" else 6,
                markerfacecolor="none" if "QuantizedCache" in name else None,
                color=plt.get_cmap("tab10")(names.index(name) % 10),
                label=f"{shown}, {bits}-bit",
            )
            handles.setdefault(line.get_label(), line)
        ax.set_xscale("log")
        ax.set_xticks(TICKS, [str(t) for t in TICKS])
        ax.set_xlim(4, 120)
        ax.set_ylim(-3, 100)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("later turns, score ×100" if "multi" in title else "score ×100")
        ax.set_xlabel("KV bytes, % of the full bf16 cache (log)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(found) :]:
        ax.set_visible(False)
    labels = sorted(handles)
    fig.legend([handles[k] for k in labels], labels, loc="lower center", ncol=3, fontsize=7)
    fig.suptitle(
        "Equal bytes: qwen2.5-coder-0.5b (4-bit GGUF weights in bf16), 2K-token contexts", fontsize=11
    )
    fig.tight_layout(rect=(0, 0.04 + 0.018 * ((len(labels) + 2) // 3), 1, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path, nargs="*", default=list(DEFAULT_RESULTS))
    parser.add_argument("--plot", type=Path)
    parser.add_argument(
        "--tasks",
        default="",
        help="comma-separated; all: every task; default: all but sc_aggregate (not in the grid)",
    )
    args = parser.parse_args()
    tasks = None if args.tasks == "all" else set(args.tasks.split(",")) if args.tasks else None
    skip = set() if args.tasks else {"sc_aggregate"}
    found: dict[str, dict[Key, Point]] = {}
    for folder in args.results:
        if not (folder / "results.jsonl").exists() and not any(folder.glob("results.*.jsonl.gz")):
            sys.exit(f"no results in {folder}")
        for title, rows in sorted(panels(load_rows(folder / "results.jsonl")).items()):
            pts, left_out = points(rows, tasks, skip)
            if not pts:
                continue
            found[title] = pts
            print("\n".join(table(title, pts, left_out)) + "\n")
    if not found:
        sys.exit("no rows with a full-cache row beside them")
    if args.plot:
        plot(found, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
