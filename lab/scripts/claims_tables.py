"""The tables of docs/claims.md, from committed results (no model runs):

    .venv/bin/python lab/scripts/claims_tables.py [--update docs/claims.md]
        [--leaderboard lab/results/leaderboard] [--baklava lab/results/claims-baklava]
        [--asl-ttft lab/results/claims-asl-ttft] [--dtype-check DIR]
        [--agnostic lab/results/leaderboard-agnostic] [--ea-floor lab/results/ea-kvpress]
        [--d2o-longgen lab/results/claims-d2o-longgen]
        [--shared-context lab/results/shared-context] [--shared-context-agnostic DIR]
        [--equal-bytes lab/results/equal-bytes] [--equal-bytes-agnostic DIR]

Without --update it prints every table in its ``<!-- claims:NAME -->`` block; with it, it rewrites
those blocks in the file.

Every difference is paired (the same samples for both methods; kvbudget.eval.paired) with its 95%
stratified bootstrap interval; ``ahead``/``behind`` only where the interval excludes 0.

The ``verdicts`` block applies docs/claims.md's rule: each paper's pre-registered headline family
(:data:`FAMILIES`), its comparisons' bootstrap p-values corrected together by Holm
(kvbudget.eval.paired.holm_adjust), and the verdict of :func:`family_verdict`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the tables' package beside this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))

# The tables live in lab/scripts/claims/, one module per kind of table; the names the sibling
# scripts (leaderboard_summary.py, agnostic_cost_plot.py) and tests/test_claims_tables_script.py
# read are re-exported here.
from claims.agnostic import COMPACTOR_DRAW_PAIRS, agnostic_blocks, tracks_table  # noqa: E402
from claims.blocks import blocks, name_tuned_profiles  # noqa: E402
from claims.common import (  # noqa: E402
    BEYOND_BUDGET,
    EVERY_RATIO,
    MIN_SAMPLES,
    complete_tasks,
    difference_cell,
    has_results,
    mean_over_tasks,
    paired_on_finished_tasks,
)
from claims.document import update  # noqa: E402
from claims.equal_bytes import equal_bytes_blocks  # noqa: E402
from claims.leaderboard import (  # noqa: E402
    best_against_kvpress,
    best_cell,
    best_label,
    best_pair,
    leaderboard_table,
)
from claims.pairs import SAME_METHOD_PAIRS, pairs_table  # noqa: E402
from claims.screen import SCREEN_COUNTERPARTS, SCREEN_RATIO, same_answers, screen_rows, screen_table  # noqa: E402
from claims.server_default import server_default_blocks  # noqa: E402
from claims.shared_context import shared_context_blocks  # noqa: E402
from claims.verdicts import (  # noqa: E402
    CORE,
    FAMILIES,
    Comparison,
    Family,
    check_block,
    family_verdict,
    machine_time,
    verdicts_table,
)

__all__ = [
    "BEYOND_BUDGET", "COMPACTOR_DRAW_PAIRS", "CORE", "EVERY_RATIO", "FAMILIES", "MIN_SAMPLES",
    "SAME_METHOD_PAIRS", "SCREEN_COUNTERPARTS", "SCREEN_RATIO", "Comparison", "Family", "agnostic_blocks",
    "best_against_kvpress", "best_cell", "best_label", "best_pair", "blocks", "check_block",
    "complete_tasks", "difference_cell", "equal_bytes_blocks", "family_verdict", "has_results",
    "leaderboard_table",
    "machine_time", "main", "mean_over_tasks", "name_tuned_profiles", "paired_on_finished_tasks",
    "pairs_table", "same_answers", "screen_rows", "screen_table", "server_default_blocks",
    "shared_context_blocks", "tracks_table",
    "update", "verdicts_table",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--leaderboard", type=Path, default=Path("lab/results/leaderboard"))
    parser.add_argument("--baklava", type=Path, default=Path("lab/results/claims-baklava"))
    parser.add_argument("--asl-ttft", type=Path, default=Path("lab/results/claims-asl-ttft"))
    parser.add_argument("--dtype-check", type=Path, default=Path("lab/results/dtype-check"))
    parser.add_argument("--agnostic", type=Path, default=Path("lab/results/leaderboard-agnostic"))
    parser.add_argument("--ea-floor", type=Path, default=Path("lab/results/ea-kvpress"))
    parser.add_argument("--d2o-longgen", type=Path, default=Path("lab/results/claims-d2o-longgen"))
    parser.add_argument("--check", type=Path, default=Path("lab/results/check-1.5b"))
    parser.add_argument("--shared-context", type=Path, default=Path("lab/results/shared-context"))
    parser.add_argument(
        "--shared-context-agnostic", type=Path, default=Path("lab/results/shared-context-agnostic")
    )
    parser.add_argument("--equal-bytes", type=Path, default=Path("lab/results/equal-bytes"))
    parser.add_argument("--equal-bytes-agnostic", type=Path, default=Path("lab/results/equal-bytes-agnostic"))
    parser.add_argument(
        "--update", type=Path, action="append", default=None,
        help="rewrite the tables of this file (repeatable: docs/claims.md, docs/leaderboard-analysis.md)",
    )  # fmt: skip
    args = parser.parse_args()
    tables = blocks(args)
    tables.update(shared_context_blocks(args.shared_context_agnostic, args.shared_context))
    tables.update(server_default_blocks(args.shared_context_agnostic))
    tables.update(
        equal_bytes_blocks(args.shared_context_agnostic, args.equal_bytes, args.equal_bytes_agnostic)
    )
    if args.update is not None:
        for path in args.update:
            print(f"{path}: " + ", ".join(update(path, tables)))
        return
    for name, lines in tables.items():
        print(f"<!-- claims:{name} -->\n" + "\n".join(lines) + f"\n<!-- /claims:{name} -->\n")


if __name__ == "__main__":
    main()
