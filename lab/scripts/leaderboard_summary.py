"""The summary that opens docs/leaderboard.md, from the committed rows (no model runs):

    .venv/bin/python lab/scripts/leaderboard_summary.py [--update docs/leaderboard.md]
        [--plot docs/leaderboard-summary.png]

Per track (question-agnostic first, kvpress's protocol) and ratio, like with like
(:mod:`claims.like_with_like`): the method each library's best is, against the other library's
version of it on the same samples ("not run" where it has not run); then kvbudget's best among the
methods kvpress does not ship against kvpress's best press, picked and scored on all samples, and
picked on the even samples and scored on the odd ones (95% stratified bootstrap intervals, sign-flip
p-values). The
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


def like_with_like(tracks: list[tuple[str, list[dict]]]) -> list[str]:
    """The summary block: the same method in both libraries, then what kvpress does not ship
    against kvpress's best press (:mod:`claims.like_with_like`), and the screen's agreement for the
    pairs whose press has not run."""
    from claims.like_with_like import same_method_table, unshipped_table

    not_run: list[tuple[str, float, str, str]] = []
    same = same_method_table(tracks, not_run)
    rows_of = dict(tracks)
    screened = ct.screen_rows(rows_of.get("question-agnostic", []))
    notes, partial = {}, []
    for track, ratio, ours, press in not_run:
        notes.setdefault(press, screen_agreement(screened, ours, press))
        if track == "question-agnostic":
            started = partial_run_agreement(rows_of[track], ratio, ours, press)
            partial += [started] if started and started not in partial else []
    lines = [
        "**The same method in both libraries** (each side's best at that track and ratio, against "
        "the other library's version of it, on the same samples):",
        "",
        *same,
    ]
    if any(" ³ |" in line for line in same):
        lines += [
            "",
            "³ On a subsample: kvpress's press ran the first 3 samples of each task (needle aside) at "
            "these ratios, the whole grid not fitting (its KVgrad took 1.3–3.8 minutes a prompt here, "
            "answers included; "
            "`bash lab/scripts/kvpress_same_method.sh`); kvbudget's side on the same samples.",
        ]
    if notes:
        lines += [
            "",
            "Where the other library's version has not run there, on the screen's samples "
            "(question-agnostic, r = 0.5) the press gave kvbudget's answer on "
            + ", ".join(notes.values())
            + "."
            + "".join(f" Question-agnostic, {note}." for note in partial),
        ]
    lines += [
        "",
        "**What kvpress does not ship, against kvpress's best press** (both bests picked on "
        "all 20 samples a task and scored on them; and, against that selection, picked on the "
        "even-numbered samples and scored on the odd ones):",
        "",
        *unshipped_table(tracks),
    ]
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
    table = like_with_like(tracks)
    if args.plot:
        plot(tracks, args.plot)
    if args.update:
        print(f"{args.update}: " + ", ".join(ct.update(args.update, {"summary": table})))
    else:
        print("\n".join(table))


if __name__ == "__main__":
    main()
