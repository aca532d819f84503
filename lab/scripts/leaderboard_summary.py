"""The summary that opens docs/leaderboard.md, from the committed rows (no model runs):

    .venv/bin/python lab/scripts/leaderboard_summary.py [--update docs/leaderboard.md]
        [--plot docs/leaderboard-summary.png]

Per track (question-agnostic first, kvpress's protocol) and ratio: kvbudget's best method held to
the budget against kvpress's best press on the tasks the most complete presses finished, their
means and the paired difference with its 95% stratified bootstrap interval
(``claims_tables.best_pair``). The
plot draws score against ratio for the top methods of both libraries in both tracks, each point
the mean over the tasks run at every ratio (:data:`claims_tables.EVERY_RATIO`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import claims_tables as ct  # noqa: E402  (a sibling script)

from kvbudget.eval.paired import row_column  # noqa: E402
from kvbudget.eval.report import PEER_PREFIX  # noqa: E402
from kvbudget.eval.store import load_rows  # noqa: E402

RATIOS = (0.875, 0.75, 0.5, 0.25)
#: kvbudget's methods that kvpress ships too → the press's label (kept positions checked equal in
#: tests/test_kvpress_oracle.py)
SAME_AS_PRESS = {ours: f"{PEER_PREFIX}{press}" for press, ours in ct.SCREEN_COUNTERPARTS.items()}
MARK = "²"
#: methods per library in the plot, ranked by their mean over the ratios they finished
TOP = 4


def _rows(folder: Path) -> list[dict]:
    if not ct.has_results(folder):
        return []
    return [r for r in load_rows(folder / "results.jsonl") if r.get("error") is None]


def screen_agreement(scored: dict[str, dict[tuple[str, int], dict]], ours: str, press: str) -> str:
    """``press``'s agreement with kvbudget's ``ours`` on the screen's samples ``scored``
    (:func:`claims_tables.screen_rows`): "`press` k of n", or "`press` not screened" where they
    share no screened sample."""
    common = [k for k in scored.get(press, {}) if k in scored.get(ours, {})]
    if not common:
        return f"`{press}` not screened"
    return f"`{press}` {ct.same_answers(scored, press, ours, common)} of {len(common)}"


def partial_run_agreement(rows: list[dict], ratio: float, ours: str, press: str) -> str | None:
    """Where ``press`` has rows at ``ratio`` beyond the screen's but has not finished the tasks the
    line is over: its mean and kvbudget's ``ours`` on the samples both ran, and how many answers
    match; None where it has no such row."""
    column = ("r", ratio)
    scored = {
        label: {(r["task"], r["sample"]): r for r in rows
                if r["label"] == label and r.get("score") is not None and row_column(r) == column}
        for label in (ours, press)
    }  # fmt: skip
    # the screen's samples are those at its own ratio: at another ratio the same (task, sample) is a
    # row of its own, past the screen
    screened = (
        ct.screen_rows([r for r in rows if r["label"] == press]).get(press, {})
        if ratio == ct.SCREEN_RATIO
        else {}
    )
    common = [k for k in scored[press] if k in scored[ours] and k not in screened]
    if not common:
        return None
    tasks = len({task for task, _ in common})
    mean = {label: 100 * statistics.mean(scored[label][k]["score"] for k in common) for label in scored}
    return (
        f"at r = {ratio:g}, `{press}` has rows for {len(common)} samples, on {tasks} of the tasks: "
        f"{mean[press]:.1f} against `{ours}`'s {mean[ours]:.1f} on them, the same answer "
        f"on {ct.same_answers(scored, press, ours, common)} of {len(common)}"
    )


def same_method_note(agreements: list[str], partial: list[str] | None = None) -> str:
    """The footnote for the lines whose kvbudget best is a method kvpress ships too but has not run
    there: the difference is then against another press, not against kvpress's own version."""
    return (
        f"{MARK} A method kvpress ships too, whose press has not run (or not finished) these tasks at "
        "this ratio: the difference is against kvpress's best press that has, not against kvpress's "
        "own version. "
        "The two keep the same positions (tests/test_kvpress_oracle.py); on the screen's samples "
        "(question-agnostic, r = 0.5) the press gave kvbudget's answer on "
        + ", ".join(agreements)
        + "."
        + "".join(f" Question-agnostic, {note}." for note in partial or [])
    )


def summary_table(tracks: list[tuple[str, list[dict]]]) -> list[str]:
    """One line per track and ratio; where the two sides finished no task set in common at a ratio,
    each side's best on its own tasks (or "not run yet") and no difference. A line whose kvbudget
    best is a method kvpress ships too, where that press has not run, is marked :data:`MARK` and
    footnoted under the table (the screen's agreement from the question-agnostic track's rows)."""
    screened = ct.screen_rows(next((rows for track, rows in tracks if track == "question-agnostic"), []))
    notes: dict[str, str] = {}
    partial: list[str] = []
    lines = [
        "| track | r | kvbudget's best (held to the budget) | kvpress's best "
        "| kvbudget − kvpress [95% CI] | tasks |",
        "|---|---|---|---|---|---|",
    ]
    for track, rows in tracks:
        for ratio in RATIOS:
            pair = ct.best_pair(rows, ratio)
            if pair is None:
                # no task both sides finished: each side's best on its own widest task set
                alone, peer = ct.best_alone(rows, ratio), ct.best_alone(rows, ratio, peers=True)
                ours = alone[0] if alone else "not run yet"
                theirs = peer[0] if peer else "no press finished here yet"
                if alone and peer:  # different task sets: no difference, each count named
                    tasks = f"{alone[1]} (kvbudget) / {peer[1]} (kvpress)"
                else:
                    tasks = str((alone or peer or (None, "–"))[1])
                lines.append(f"| {track} | {ratio:g} | {ours} | {theirs} | – | {tasks} |")
                continue
            ours, peer = pair.cells()
            press = SAME_AS_PRESS.get(pair.ours)
            if press is not None and press not in pair.peer_labels:
                ours += f" {MARK}"
                notes.setdefault(press, screen_agreement(screened, pair.ours, press))
                if track == "question-agnostic":
                    started = partial_run_agreement(rows, ratio, pair.ours, press)
                    partial += [started] if started else []
            difference = ct.difference_cell(pair.diff)
            lines.append(f"| {track} | {ratio:g} | {ours} | {peer} | {difference} | {len(pair.tasks)} |")
    if notes:
        lines += ["", same_method_note(list(notes.values()), partial)]
    return lines


def curve_points(rows: list[dict], label: str, tasks: list[str]) -> dict[float, float]:
    """``label``'s mean over ``tasks`` (each weighs the same) at each ratio where it finished all of
    them with ``MIN_SAMPLES`` samples."""
    points = {}
    for ratio in RATIOS:
        column = ("r", ratio)
        means = []
        for task in tasks:
            scores = [
                r["score"] for r in rows
                if r["label"] == label and r["task"] == task and r.get("score") is not None
                and (row_column(r) == column or (label == "full" and row_column(r) is None))
            ]  # fmt: skip
            if len(scores) < ct.MIN_SAMPLES:
                break
            means.append(statistics.mean(scores))
        else:
            points[ratio] = statistics.mean(means)
    return points


def top_labels(rows: list[dict], tasks: list[str]) -> tuple[list[str], list[str]]:
    """The top :data:`TOP` kvbudget methods held to the budget and kvpress presses, by their mean
    over the ratios they finished."""
    curves = {label: curve_points(rows, label, tasks) for label in {r["label"] for r in rows} - {"full"}}
    ranked = sorted(
        (label for label, c in curves.items() if c),
        key=lambda label: (-statistics.mean(curves[label].values()), label),
    )
    ours = [x for x in ranked if not x.startswith(PEER_PREFIX) and x.split(":")[0] not in ct.BEYOND_BUDGET]
    peers = [x for x in ranked if x.startswith(PEER_PREFIX)]
    return ours[:TOP], peers[:TOP]


def plot(tracks: list[tuple[str, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = ct.EVERY_RATIO
    fig, axes = plt.subplots(1, len(tracks), figsize=(6 * len(tracks), 4.2), sharey=True)
    for ax, (track, rows) in zip(axes, tracks, strict=True):
        ours, peers = top_labels(rows, tasks)
        full = curve_points(rows, "full", tasks)
        if full:
            ax.axhline(100 * next(iter(full.values())), color="black", lw=1, ls=":", label="full cache")
        for labels, style in ((ours, "-o"), (peers, "--s")):
            for label in labels:
                c = curve_points(rows, label, tasks)
                xs = sorted(c)
                ax.plot(xs, [100 * c[x] for x in xs], style, label=label, ms=4)
        ax.set_title(f"{track} ({', '.join(tasks)})", fontsize=9)
        ax.set_xlabel("compression ratio (fraction of the prompt removed)")
        ax.set_xticks(RATIOS)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    axes[0].set_ylabel("mean score ×100")
    fig.suptitle("qwen2.5-coder-0.5b (4-bit GGUF Q4_K_M, dequantized to bf16), 2K tokens, 20 samples a task",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--leaderboard", type=Path, default=Path("lab/results/leaderboard"))
    parser.add_argument("--agnostic", type=Path, default=Path("lab/results/leaderboard-agnostic"))
    parser.add_argument("--update", type=Path, help="rewrite the summary block of this file")
    parser.add_argument("--plot", type=Path, help="write the score-against-ratio plot here")
    args = parser.parse_args()
    tracks = [("question-agnostic", _rows(args.agnostic)), ("question-aware", _rows(args.leaderboard))]
    table = summary_table(tracks)
    if args.plot:
        plot(tracks, args.plot)
    if args.update:
        print(f"{args.update}: " + ", ".join(ct.update(args.update, {"summary": table})))
    else:
        print("\n".join(table))


if __name__ == "__main__":
    main()
