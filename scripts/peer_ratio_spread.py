"""Run-by-run wall-time ratios of `kvbudget bench peer` runs: per pair and pooled, with their spread.

    python scripts/peer_ratio_spread.py runs/peer6 runs/peer7 runs/peer8

``peer.md`` gives each pair's ratio of summed per-sample medians; this reads the rows behind it
(``ours.jsonl`` / ``kvpress.jsonl``), pairs every run with the other side's run of the same
(sample, method, budget, repeat), and prints per run directory and pair: the geometric mean of
the paired wall-time ratios ours / kvpress ×/÷ its standard error (of the log ratios) and the
verdict of :func:`kvbudget.bench.peer.paired_ratio`, the
ratio of the sums, and the mean page faults per run of each side (when the rows have them).
Then the same pooled over all directories, for the pairs that run the same algorithm on both
sides (``--same``) and for every pair but H2O (whose kvpress side needs eager attention).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvbudget.bench.peer import SAME_ALGORITHM, paired_ratio, run_pairs


def paired(run_dir: Path) -> dict[str, list[tuple[dict, dict]]]:
    """Per method, the (ours, kvpress) run pairs of ``run_dir``."""
    sides = []
    for name in ("ours.jsonl", "kvpress.jsonl"):
        path = run_dir / name
        if not path.exists():
            raise SystemExit(f"{path} is missing: not a `kvbudget bench peer` output directory")
        sides.append([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    pairs: dict[str, list[tuple[dict, dict]]] = {}
    for (_, method, _), group in run_pairs(*sides).items():
        pairs.setdefault(method, []).extend(group)
    return pairs


def step_parts(pairs: list[tuple[dict, dict]]) -> list[tuple[dict, dict]]:
    """The pairs whose rows both time their decode steps (``step_s``, since session 8) and took at
    least two, as rows of ``first_step_s`` (the first decode forward after the prefill) and
    ``later_step_s`` (the median of the others)."""

    def parts(row: dict) -> dict:
        return {"first_step_s": row["step_s"][0], "later_step_s": statistics.median(row["step_s"][1:])}

    timed = [(a, b) for a, b in pairs if min(len(a.get("step_s", ())), len(b.get("step_s", ()))) > 1]
    return [(parts(a), parts(b)) for a, b in timed]


def summary(pairs: list[tuple[dict, dict]]) -> str:
    stats = paired_ratio(pairs)
    se = f"×/÷ {stats['se_factor']:.3f} ({stats['verdict']})" if stats["se_factor"] else "(one run)"
    sums = sum(a["wall_s"] for a, _ in pairs) / sum(b["wall_s"] for _, b in pairs)
    text = f"n={stats['n']:3d}  geo {stats['ratio']:.3f} {se}  sums {sums:.3f}"
    steps = step_parts(pairs)
    if steps:
        first, later = (paired_ratio(steps, key) for key in ("first_step_s", "later_step_s"))
        text += (f"  decode steps: first {first['ratio']:.3f} ({first['verdict']}),"
                 f" later (median) {later['ratio']:.3f} ({later['verdict']})")  # fmt: skip
    faults = [(a.get("minor_faults"), b.get("minor_faults")) for a, b in pairs]
    if all(x is not None and y is not None for x, y in faults):
        ours, theirs = (statistics.mean(side) / 1000 for side in zip(*faults, strict=True))
        text += f"  faults/run ours {ours:.0f}k kvpress {theirs:.0f}k"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="`bench peer --out` directories")
    parser.add_argument("--same", default=",".join(SAME_ALGORITHM), help="pairs running the same algorithm")
    args = parser.parse_args()
    same = args.same.split(",")
    pooled: dict[str, list[tuple[dict, dict]]] = {}
    for run_dir in args.runs:
        print(run_dir)
        for method, pairs in sorted(paired(run_dir).items()):
            print(f"  {method:13s} {summary(pairs)}")
            pooled.setdefault(method, []).extend(pairs)
    groups = {"same algorithm": same, "all but h2o": [m for m in pooled if m != "h2o"]}
    print("pooled over", ", ".join(map(str, args.runs)))
    for label, methods in groups.items():
        pairs = [p for m in methods for p in pooled.get(m, [])]
        if pairs:
            print(f"  {label:15s} {summary(pairs)}")


if __name__ == "__main__":
    main()
