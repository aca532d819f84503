"""First turn and later turns of one shared-context task, per method, ratio and mode, on a task's
first samples: the pilot's figures before the leaderboard's tables give the task intervals.

    python lab/scripts/turns_by_task.py lab/results/shared-context-agnostic --task sc_aggregate --samples 5

Means ×100 over the samples (error rows left out), the count of samples beside them; no interval.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from kvbudget.eval.store import load_rows
from kvbudget.eval.turns_report import is_conversation, later_turns


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("folder", type=Path, help="a results folder (its results.jsonl or archive parts)")
    parser.add_argument("--task", required=True)
    parser.add_argument("--samples", type=int, default=None, help="the first N samples (default: all)")
    args = parser.parse_args()
    cells: dict[tuple[str, str, str], list[tuple[float, float]]] = defaultdict(list)
    for row in load_rows(args.folder / "results.jsonl"):
        if row["task"] != args.task or row.get("error") or not is_conversation(row):
            continue
        if args.samples is not None and row["sample"] >= args.samples:
            continue
        ratio = "–" if row["compression_ratio"] is None else f"{row['compression_ratio']:g}"
        cells[(row["conversation"], row["label"], ratio)].append((row["turns"][0]["score"], later_turns(row)))
    if not cells:
        raise SystemExit(f"no {args.task} conversation rows in {args.folder}")
    print("| mode | method | r | turn 1 | later turns | n |\n|---|---|---|---:|---:|---:|")
    for (mode, label, ratio), pairs in sorted(cells.items()):
        first = 100 * sum(a for a, _ in pairs) / len(pairs)
        later = 100 * sum(b for _, b in pairs) / len(pairs)
        print(f"| {mode} | {label} | {ratio} | {first:.1f} | {later:.1f} | {len(pairs)} |")


if __name__ == "__main__":
    main()
