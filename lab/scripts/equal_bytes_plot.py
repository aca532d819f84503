"""Score against bytes: eviction alone, quantization alone and the two together (issue: one byte
budget), from the shared-context rows (one 2K context, four questions; later turns scored).

    .venv/bin/python lab/scripts/equal_bytes_plot.py lab/results/shared-context-agnostic \\
        [--plot docs/equal-bytes.png] [--mode multi-request]

A point is a (method, precision, ratio): its later-turn score (turns 2-4, the mean within each task,
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


def _base(label: str) -> tuple[str, int]:
    """``snapkv:kv_bits=4`` → (``snapkv``, 4); a label without kv_bits is at 16."""
    name, _, options = label.partition(":")
    pairs = dict(p.split("=", 1) for p in options.split(",") if "=" in p)
    bits = int(pairs.pop("kv_bits", 16))
    rest = ",".join(f"{k}={v}" for k, v in pairs.items())
    return (name + (":" + rest if rest else ""), bits)


def points(rows: list[dict], mode: str) -> dict[tuple[str, int, float | None], tuple[float, float, int]]:
    """(method, bits, ratio) → (bytes share, later-turn score, tasks) over the common tasks."""
    rows = [r for r in rows if is_conversation(r) and r.get("error") is None and r["conversation"] == mode]
    rows = [r for r in rows if not r["label"].startswith("kvpress:")]
    full = {(r["task"], r["sample"]): r["logical_bytes"] for r in rows if r["label"] == "full"}
    groups: dict[tuple[str, int, float | None], dict[str, list[dict]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in rows:
        if (r["task"], r["sample"]) in full:
            groups[(*_base(r["label"]), r.get("compression_ratio"))][r["task"]].append(r)
    samples = {key: {t: {r["sample"] for r in rs} for t, rs in by.items()} for key, by in groups.items()}
    tasks = set.intersection(*(set(s) for s in samples.values())) if samples else set()
    tasks = {t for t in tasks if len({frozenset(s[t]) for s in samples.values()}) == 1}
    out = {}
    for key, by in groups.items():
        share = [sum(r["physical_bytes"] / full[(t, r["sample"])] for r in by[t]) / len(by[t]) for t in tasks]
        score = [sum(later_turns(r) for r in by[t]) / len(by[t]) for t in tasks]
        if tasks:
            out[key] = (sum(share) / len(share), sum(score) / len(score), len(tasks))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path)
    parser.add_argument("--mode", default="multi-request", choices=("multi-request", "multi-turn"))
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    found = points(load_rows(args.results / "results.jsonl"), args.mode)
    if not found:
        sys.exit("no shared-context rows with a full-cache row beside them")
    tasks = next(iter(found.values()))[2]
    print(f"{args.mode}, later turns, {tasks} tasks: score (x100) at a share of the full bf16 cache's bytes")
    print("| method | bits | r | bytes % | later turns |")
    print("|---|---|---|---|---|")
    for (name, bits, ratio), (share, score, _) in sorted(found.items(), key=lambda kv: kv[1][0]):
        shown = ratio if ratio is not None else "–"
        print(f"| {name} | {bits} | {shown} | {100 * share:.1f} | {100 * score:.1f} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        lines: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
        for (name, bits, _), (share, score, _) in found.items():
            lines[(name if name != "full" else "full (quantization alone)", bits)].append((share, score))
        names = sorted({name for name, _ in lines})
        for (name, bits), pts in sorted(lines.items()):
            pts.sort()
            style = {16: "-", 8: ":", 4: "--", 2: "-."}[bits]
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
