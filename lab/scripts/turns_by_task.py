"""First turn and later turns of one shared-context task, per mode, method and ratio, on a task's
first samples: the figures of a task before the leaderboard's tables give it simultaneous intervals.

    python lab/scripts/turns_by_task.py lab/results/shared-context-agnostic --task sc_aggregate --samples 5

The harness's turns table (:func:`kvbudget.eval.turns_report.turns_table`) over that task's rows:
means ×100 (error rows left out), later turns minus the full cache's with a 95% interval not
corrected for multiplicity, and the samples (n).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvbudget.eval.store import load_rows
from kvbudget.eval.turns_report import is_conversation, turns_table


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("folder", type=Path, help="a results folder (its results.jsonl or archive parts)")
    parser.add_argument("--task", required=True)
    parser.add_argument("--samples", type=int, default=None, help="the first N samples (default: all)")
    args = parser.parse_args()
    rows = [
        row
        for row in load_rows(args.folder / "results.jsonl")
        if row["task"] == args.task
        and is_conversation(row)
        and (args.samples is None or row["sample"] < args.samples)
    ]
    if not rows:
        raise SystemExit(f"no {args.task} conversation rows in {args.folder}")
    print("\n".join(turns_table(rows)))


if __name__ == "__main__":
    main()
