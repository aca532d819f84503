"""Mean score per method over some tasks at one compression ratio, from a results folder's rows.

    python lab/scripts/track_means.py lab/results/leaderboard-agnostic --ratio 0.875 \
        --tasks needle,niah_single_2,niah_multikey_1,niah_multikey_2

Error rows are left out; each method's sample count is printed beside its mean (×100).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--ratio", type=float, required=True)
    parser.add_argument("--tasks", required=True)
    args = parser.parse_args()
    tasks = set(args.tasks.split(","))
    rows = {}
    for path in sorted(args.folder.glob("results*.jsonl*")):
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as handle:
            for line in handle:
                row = json.loads(line)
                rows[row["key"]] = row
    scores: dict[str, list[float]] = defaultdict(list)
    for row in rows.values():
        if row["compression_ratio"] == args.ratio and row["task"] in tasks and row["error"] is None:
            scores[row["label"]].append(row["score"])
    means = sorted(((sum(v) / len(v) * 100, k, len(v)) for k, v in scores.items()), reverse=True)
    for mean, label, n in means:
        print(f"{label:24} {mean:5.1f}  ({n} samples)")


if __name__ == "__main__":
    main()
