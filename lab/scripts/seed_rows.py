"""Copy rows of some labels from one results directory into another, so that a grid run there skips
what is already measured (a row's key hashes its model, task, sample, method and options, not the
directory; the rows are the same computation).

    .venv/bin/python lab/scripts/seed_rows.py FROM TO --labels full,snapkv --ratios 0.875 --tasks vt,lcc
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvbudget.eval.store import load_rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--labels", required=True)
    parser.add_argument("--ratios", default=None, help="ratios of the rows that have one")
    parser.add_argument("--tasks", default=None)
    args = parser.parse_args()
    labels = set(args.labels.split(","))
    ratios = {float(r) for r in args.ratios.split(",")} if args.ratios else None
    tasks = set(args.tasks.split(",")) if args.tasks else None
    target = args.target / "results.jsonl"
    have = {r["key"] for r in load_rows(target)} if target.exists() else set()
    chosen = [
        r
        for r in load_rows(args.source / "results.jsonl")
        if r["label"] in labels
        and r.get("error") is None
        and (tasks is None or r["task"] in tasks)
        and (ratios is None or r.get("compression_ratio") is None or r["compression_ratio"] in ratios)
        and r["key"] not in have
    ]
    args.target.mkdir(parents=True, exist_ok=True)
    with target.open("a") as f:
        for r in chosen:
            f.write(json.dumps(r) + "\n")
    print(f"{len(chosen)} rows copied to {target} ({len(have)} were there)")


if __name__ == "__main__":
    main()
