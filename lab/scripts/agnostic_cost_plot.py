"""What each point of accuracy costs, question-agnostic: score against time to first token for the
KVzip family, KVzap and the sketch scorers of both libraries (issue #48), from committed rows only.

    .venv/bin/python lab/scripts/agnostic_cost_plot.py lab/results/leaderboard-agnostic \\
        lab/results/agnostic-cost [more bench peer folders] [--plot docs/agnostic-cost.png] \\
        [--update docs/leaderboard.md]

The score of a method (``kvbudget`` label or ``kvpress:NAME``) at a ratio is its mean over the core
tasks, each task's mean of 20 samples (the leaderboard's rows); the table also gives each method's
mean on the kvpress screen's samples (the first 3 of niah_multikey_2 and vt at r = 0.5), where the
20-sample rows are not in yet. Its time to first token is the median
``prefill_s`` (the compressed context's prefill with the method's scoring, then the question's) of
``kvbudget bench peer`` on both sides of each pair, interleaved run by run on the same samples — the
leaderboard rows' own times are not used: those runs were paused and resumed while other work had
the machine. A method without both figures is left out and listed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import claims_tables as ct  # noqa: E402  (a sibling script)

from kvbudget.bench.peer import AGNOSTIC_PEERS, PEERS  # noqa: E402
from kvbudget.eval.paired import row_column  # noqa: E402
from kvbudget.eval.report import PEER_PREFIX  # noqa: E402
from kvbudget.eval.store import load_rows  # noqa: E402

CORE = ("needle", "niah_single_2", "niah_multikey_1", "niah_multikey_2", "vt", "lcc")
RATIOS = (0.5, 0.75, 0.875)
#: bench peer's name → (our leaderboard label, kvpress's leaderboard label)
LABELS = {name: (spec, PEER_PREFIX + press) for name, (spec, press, _) in AGNOSTIC_PEERS.items()}


def scores(rows: list[dict], ratio: float) -> dict[str, float]:
    """Each label's mean over :data:`CORE` at ``ratio``, when it has 20 samples of every core task."""
    column = ("r", ratio)
    mine = [
        r for r in rows if row_column(r) == column and r.get("score") is not None and r.get("error") is None
    ]
    complete = ct.complete_tasks(mine, column)
    return {
        label: ct.mean_over_tasks(mine, label, column, set(CORE))
        for label, tasks in complete.items()
        if label != "full" and set(CORE) <= tasks
    }


def _medians(path: Path) -> dict[str, float]:
    """Median ``prefill_s`` per bench peer method name in one side's rows (error rows left out)."""
    by_method: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("error") is None:
            by_method.setdefault(row["method"], []).append(row["prefill_s"])
    return {method: statistics.median(values) for method, values in by_method.items()}


def ttfts(peer: Path) -> dict[str, float]:
    """Median ``prefill_s`` per leaderboard label, from bench peer's ``ours.jsonl`` / ``kvpress.jsonl``."""
    out = {}
    for side, index in (("ours", 0), ("kvpress", 1)):
        path = peer / f"{side}.jsonl"
        if path.is_file():
            out |= {LABELS[m][index]: t for m, t in _medians(path).items() if m in LABELS}
    return out


def screen_scores(rows: list[dict]) -> dict[str, tuple[float, int]]:
    """Each label's mean (and row count) on the kvpress screen's samples (``claims_tables.screen_rows``),
    for methods without the 20-sample rows yet."""
    return {
        label: (statistics.mean(r["score"] for r in by.values()), len(by))
        for label, by in ct.screen_rows(rows).items()
    }


def table(
    points: dict[float, dict[str, tuple[float, float]]],
    missing: list[str],
    times: dict[str, float] | None = None,
    screen: dict[str, tuple[float, int]] | None = None,
) -> list[str]:
    times, screen = times or {}, screen or {}
    lines = ["| method | TTFT (s) | screen (samples) | " + " | ".join(f"r = {r:g}" for r in RATIOS) + " |",
             "|---|---|---|" + "---|" * len(RATIOS)]  # fmt: skip
    labels = sorted(
        {label for by in points.values() for label in by} | {label for label in times if label in screen},
        key=lambda x: (x.startswith(PEER_PREFIX), x),
    )
    for label in labels:
        ttft = next((by[label][0] for by in points.values() if label in by), times.get(label))
        cells = [f"{100 * points[r][label][1]:.1f}" if label in points[r] else "–" for r in RATIOS]
        seen = f"{100 * screen[label][0]:.1f} ({screen[label][1]})" if label in screen else "–"
        lines.append(f"| {label} | {ttft:.2f} | {seen} | " + " | ".join(cells) + " |")
    missing = [label for label in missing if label not in labels]
    if missing:
        lines += [
            "",
            "Not drawn (no score at any of these ratios or no time yet): " + ", ".join(sorted(missing)) + ".",
        ]
    return lines


#: issue #48's goal: ``kvzap`` level with ``kvzip+`` at no more than this share of KVzip's added TTFT
GOAL_SHARE = 0.10
THRESHOLD_LABEL = "kvzap:threshold=-6"


def added_ttft(peer: Path) -> dict[str, float] | None:
    """Seconds each of kvbudget's methods adds to the uncompressed prefill (the medians of one bench
    peer folder's ``ours.jsonl``, which must hold ``full``, ``kvzip`` and ``kvzap``), else ``None``."""
    path = peer / "ours.jsonl"
    medians = _medians(path) if path.is_file() else {}
    if not {"full", "kvzip", "kvzap"} <= set(medians):
        return None
    base = medians.pop("full")
    return {m: t - base for m, t in medians.items()} | {"full": base}


def reached_ratio(row: dict) -> float:
    """The fraction of the compressed context a row's heads removed: ``1 − mean(budgets) / context``,
    the context's length recovered from the row's ratio and budget (``ratio_budget``)."""
    heads = [b for layer in row["budgets"] for b in layer]
    context = row["budget"] / (1 - row["compression_ratio"])
    return 1 - statistics.mean(heads) / context


def goal_lines(rows: list[dict], added: dict[str, float] | None) -> list[str]:
    """Issue #48's goal, from the rows: ``kvzap − kvzip+`` per ratio over the core tasks (level when
    the interval holds 0), KVzap's added time to first token as a share of KVzip's, and KVzap by
    threshold (the ratio it reached, its mean over the core tasks, and its paired difference with
    kvzip+ at r = 0.5)."""
    lines = ["| r | kvzap − kvzip+ [95% CI] | tasks | level with kvzip+? |", "|---|---|---|---|"]
    for ratio in RATIOS:
        pair = ct.paired_on_finished_tasks(rows, "kvzap", "kvzip+", ("r", ratio), set(CORE))
        if pair is None or set(pair.tasks) != set(CORE):
            done = len(pair.tasks) if pair else 0
            lines.append(f"| {ratio:g} | – | {done} of {len(CORE)} | pending |")
            continue
        level = "yes" if pair.verdict == "no clear difference" else "no"
        lines.append(f"| {ratio:g} | {ct.difference_cell(pair)} | {len(CORE)} | {level} |")
    if added is not None:
        share = added["kvzap"] / added["kvzip"]
        met = "met" if share <= GOAL_SHARE else "not met"
        kvzap, full, kvzip = (f"{added[m]:.2f} s" for m in ("kvzap", "full", "kvzip"))
        lines += [
            "",
            f"KVzap adds {kvzap} to the uncompressed prefill's {full}, KVzip {kvzip}: "
            f"{100 * share:.0f}% of KVzip's added time (goal ≤ {100 * GOAL_SHARE:.0f}%: {met}).",
        ]
    mine = [r for r in rows if r["label"] == THRESHOLD_LABEL and r.get("score") is not None]
    column = ("r", 0.5)
    if set(CORE) <= ct.complete_tasks(mine, column).get(THRESHOLD_LABEL, set()):
        reached = [reached_ratio(r) for r in mine]
        score = ct.mean_over_tasks(mine, THRESHOLD_LABEL, column, set(CORE))
        pair = ct.paired_on_finished_tasks(rows, THRESHOLD_LABEL, "kvzip+", column, set(CORE))
        lines += ["", f"`{THRESHOLD_LABEL}` (adaptive) removed {100 * statistics.mean(reached):.1f}% of the "
                  f"context on average ({100 * min(reached):.1f}–{100 * max(reached):.1f}% across rows) and "
                  f"scores {100 * score:.1f} over the core tasks; paired with kvzip+ at r = 0.5 (which "
                  f"removes 50%): {ct.difference_cell(pair)} ({pair.verdict})."]  # fmt: skip
    else:
        lines += ["", f"`{THRESHOLD_LABEL}` (adaptive): pending ({len(mine)} rows)."]
    return lines


def plot(
    points: dict[float, dict[str, tuple[float, float]]],
    path: Path,
    screened: dict[str, tuple[float, float]] | None = None,
) -> None:
    """One panel per ratio (the core tasks' means), and first, when given, the screen's samples:
    ``screened`` label → (TTFT, mean), where every timed method has a point before its 20-sample rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"the screen's samples, r = {ct.SCREEN_RATIO:g}", screened)] if screened else []
    panels += [(f"core tasks, r = {ratio:g}", points[ratio]) for ratio in RATIOS]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), sharey=True)
    for ax, (title, by_label) in zip(axes, panels, strict=True):
        for label, (ttft, score) in sorted(by_label.items()):
            peer = label.startswith(PEER_PREFIX)
            ax.scatter(
                ttft, 100 * score, marker="s" if peer else "o", color="tab:gray" if peer else "tab:blue"
            )
            ax.annotate(label, (ttft, 100 * score), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_title(f"question-agnostic, {title}", fontsize=10)
        ax.set_xlabel("time to first token (s, median; log scale)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean score (×100)")
    fig.suptitle("kvbudget (circles) and kvpress (squares): score against the prefill's cost")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path, help="the question-agnostic leaderboard's results folder")
    parser.add_argument(
        "peer",
        type=Path,
        nargs="+",
        help="`kvbudget bench peer` output folders (a later "
        "folder's times replace an earlier one's for the methods it ran)",
    )
    parser.add_argument("--plot", type=Path)
    parser.add_argument(
        "--update", type=Path, help="a page with `agnostic-cost` and `agnostic-goal` blocks to fill"
    )
    args = parser.parse_args()
    rows = [r for r in load_rows(args.results / "results.jsonl") if r.get("error") is None]
    times = {label: t for folder in args.peer for label, t in ttfts(folder).items()}
    wanted = {label for pair in LABELS.values() for label in pair}
    points: dict[float, dict[str, tuple[float, float]]] = {}
    for ratio in RATIOS:
        got = scores(rows, ratio)
        points[ratio] = {
            label: (times[label], got[label]) for label in wanted if label in got and label in times
        }
    drawn = {label for by in points.values() for label in by}
    screen = {label: v for label, v in screen_scores(rows).items() if label in wanted}
    lines = table(points, sorted(wanted - drawn), times, screen)
    added = next((a for folder in args.peer if (a := added_ttft(folder)) is not None), None)
    goal = goal_lines(rows, added)
    print("\n".join(lines + [""] + goal))
    if args.plot:
        plot(
            points, args.plot, {label: (times[label], screen[label][0]) for label in screen if label in times}
        )
    if args.update:
        ct.update(args.update, {"agnostic-cost": lines, "agnostic-goal": goal})


if __name__ == "__main__":
    assert set(LABELS) <= set(PEERS)
    main()
