"""Per-task scores behind docs/leaderboard.md's equal-bytes readings, and one configuration against
the full cache on the same samples (the readings' descriptive interval).

    .venv/bin/python lab/scripts/equal_bytes_detail.py lab/results/equal-bytes-agnostic \\
        --against full --label kvzip:memory=0.125
    .venv/bin/python lab/scripts/equal_bytes_detail.py lab/results/shared-context-agnostic --bytes

One-question rows (the core tasks) are scored as the table scores them; ``--bytes`` prints each
label's cache as a share of the full bf16 cache's bytes on the same samples, one-question rows or a
shared-context task's multi-turn rows (quantization alone's shares). The interval: the stratified
percentile bootstrap of the paired per-sample difference (``bootstrap_mean_over_groups``: resampled
within each task, task means then their mean) — descriptive, not a family's verdict.
The model: qwen2.5-coder-0.5b, 4-bit GGUF weights dequantized to bf16.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from kvbudget.eval.intervals import bootstrap_mean_over_groups
from kvbudget.eval.store import load_rows

SAMPLES = 20


def _key(row: dict) -> str:
    ratio = row.get("compression_ratio")
    return row["label"] if ratio is None else f"{row['label']} r={ratio:g}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path)
    parser.add_argument("--label", default=None, help="compare this configuration (label [r=R]) ...")
    parser.add_argument("--against", default="full", help="... with this one, sample by sample")
    parser.add_argument("--bytes", action="store_true", help="bytes shares instead of scores")
    args = parser.parse_args()
    rows = [
        r
        for r in load_rows(args.results / "results.jsonl")
        if r.get("error") is None
        and r["sample"] < SAMPLES
        and r.get("conversation") in ((None, "multi-turn") if args.bytes else (None,))
    ]
    by: dict[str, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        by[_key(r)][r["task"]][r["sample"]] = r
    tasks = sorted({t for per in by.values() for t in per})
    full = by.get("full", {})
    print("| configuration | " + " | ".join(tasks) + " | mean |")
    print("|---|" + "---|" * (len(tasks) + 1))
    for key in sorted(by):
        cells = []
        for t in tasks:
            got = by[key].get(t, {})
            if args.bytes:
                shares = [
                    r["physical_bytes"] / full[t][s]["logical_bytes"]
                    for s, r in got.items()
                    if s in full.get(t, {})
                ]
                cells.append(100 * sum(shares) / len(shares) if shares else None)
            else:
                cells.append(100 * sum(r["score"] for r in got.values()) / len(got) if got else None)
        shown = [f"{c:.1f}" if c is not None else "–" for c in cells]
        mean = f"{sum(cells) / len(cells):.1f}" if None not in cells else "–"
        print(f"| {key} | " + " | ".join(shown) + f" | {mean} |")
    if args.label:
        one, other = by[args.label], by[args.against]
        diffs = {
            t: [one[t][s]["score"] - other[t][s]["score"] for s in sorted(one[t]) if s in other.get(t, {})]
            for t in tasks
            if t in one
        }
        d = bootstrap_mean_over_groups(list(diffs.values()))
        n = ", ".join(f"{t} {len(d)}" for t, d in diffs.items())
        shown = f"{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"
        print(f"\n{args.label} − {args.against}: {shown} (samples: {n})")


if __name__ == "__main__":
    main()
