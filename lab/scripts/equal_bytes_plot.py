"""Score against bytes: eviction alone, quantization alone and the two together (issue: one byte
budget), from the shared-context rows (one 2K context, four questions; later turns scored).

    .venv/bin/python lab/scripts/equal_bytes_plot.py lab/results/shared-context-agnostic \\
        [--plot PNG] [--mode multi-request] [--tasks sc_keys,sc_code,sc_vt]

The anchors (issue: one byte budget) are kvpress's rows on transformers' ``QuantizedCache`` (quanto,
4 and 2 bits, residual 128; ``NAME+quanto4`` in ``--peer-presses``). A point is a (method, precision,
ratio): its later-turn score (turns 2-4, the mean within each task,
then over tasks) against its cache's size right after the compression as a share of the full bf16
cache's (each row's ``physical_bytes`` over its sample's full-cache ``logical_bytes``: entries ×
(key + value) × 2 bytes, no storage room; quantized rows' bytes include scales, minima, key group
indices and the full-precision tail). Only tasks where every plotted label has the same samples are
used. The model: qwen2.5-coder-0.5b, 4-bit GGUF weights dequantized to bf16.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from kvbudget.eval.store import load_rows
from kvbudget.eval.turns_report import is_conversation, later_turns


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
    """The row's compression ratio, or its byte budget's share."""
    return row.get("memory") if row.get("memory") is not None else row.get("compression_ratio")


Key = tuple[str, str, float | None]


def points(
    rows: list[dict], mode: str, tasks: set[str] | None = None
) -> tuple[dict[Key, tuple[float, float, int]], list[Key]]:
    """(method, bits, ratio) → (bytes share, later-turn score, tasks), for the points with every
    sample of every task the full cache has; and the points left out (incomplete)."""
    rows = [r for r in rows if is_conversation(r) and r.get("error") is None and r["conversation"] == mode]
    rows = [  # kvbudget's rows, and kvpress's on transformers' QuantizedCache (the anchors)
        r
        for r in rows
        if (not r["label"].startswith("kvpress:") or "+quanto" in r["label"])
        and (tasks is None or r["task"] in tasks)
    ]
    full = {(r["task"], r["sample"]): r["logical_bytes"] for r in rows if r["label"] == "full"}
    wanted: dict[str, set[int]] = defaultdict(set)
    for task, sample in full:
        wanted[task].add(sample)
    groups: dict[Key, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if (r["task"], r["sample"]) in full:
            groups[(*_base(r["label"]), _budget(r))][r["task"]].append(r)
    out, left_out = {}, []
    for key, by in groups.items():
        if any({r["sample"] for r in by.get(task, [])} != samples for task, samples in wanted.items()):
            left_out.append(key)
            continue
        share = [
            sum(r["physical_bytes"] / full[(t, r["sample"])] for r in by[t]) / len(by[t]) for t in wanted
        ]
        score = [sum(later_turns(r) for r in by[t]) / len(by[t]) for t in wanted]
        out[key] = (sum(share) / len(share), sum(score) / len(score), len(wanted))
    return out, left_out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path)
    parser.add_argument("--mode", default="multi-request", choices=("multi-request", "multi-turn"))
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--tasks", default="sc_keys,sc_code,sc_vt", help="comma-separated; all: every task")
    args = parser.parse_args()
    tasks = None if args.tasks == "all" else set(args.tasks.split(","))
    found, left_out = points(load_rows(args.results / "results.jsonl"), args.mode, tasks)
    if not found:
        sys.exit("no shared-context rows with a full-cache row beside them")
    tasks = next(iter(found.values()))[2]
    print(f"{args.mode}, later turns, {tasks} tasks: score (x100) at a share of the full bf16 cache's bytes")
    if left_out:
        print(
            "left out (not every sample of every task yet): "
            + ", ".join(f"{n} {b}-bit {r}" for n, b, r in left_out)
        )
    print("| method | bits | r (or memory) | bytes % | later turns |")
    print("|---|---|---|---|---|")
    for (name, bits, ratio), (share, score, _) in sorted(found.items(), key=lambda kv: kv[1][0]):
        shown = ratio if ratio is not None else "–"
        print(f"| {name} | {bits} | {shown} | {100 * share:.1f} | {100 * score:.1f} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        lines: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
        for (name, bits, _), (share, score, _) in found.items():
            lines[(name if name != "full" else "full (quantization alone)", bits)].append((share, score))
        names = sorted({name for name, _ in lines})
        for (name, bits), pts in sorted(lines.items()):
            pts.sort()
            style = {"16": "-", "8": ":", "4": "--", "2": "-.", "8+4": (0, (1, 1, 4, 1))}[bits]
            color = plt.get_cmap("tab10")(names.index(name) % 10)
            ax.plot(
                [100 * s for s, _ in pts],
                [100 * v for _, v in pts],
                style,
                marker="o",
                color=color,
                label=f"{name}, {bits}-bit",
            )
        ax.set_xscale("log")
        ax.set_xlabel("KV bytes, % of the full bf16 cache (log)")
        ax.set_ylabel("later turns, score ×100")
        ax.set_title(f"One context, four questions ({args.mode}), question-agnostic")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
