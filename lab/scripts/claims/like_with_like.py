"""docs/leaderboard.md's summary, like with like (the evidence issue's second independent reading).

Comparing kvbudget's best method with kvpress's best press reads as library against library, but
where kvbudget's best is a method kvpress ships too and that press has not run, it measures one
method against another. So the summary is two tables:

1. **The same method in both libraries** (:func:`same_method_table`): at each track and ratio, the
   method each side's best is, against the other library's version of it on the same samples, where
   both ran (level or not); where kvpress's press ran only the first :data:`SUBSAMPLE` samples of
   each task (its slow presses), on those (marked ³); "not run" where the other has not.
2. **What kvpress does not ship, against kvpress's best press** (:func:`unshipped_table`): kvbudget's
   best method among those kvpress has no press of (held to the budget) against kvpress's best press.
   Both bests are picked on the very samples that then score them, which favours small leads; so the
   table also picks them on the even-numbered samples of each task and measures the difference on
   the odd ones (each half 10 of the 20 samples).

p-values are the stratified sign-flip test's (:mod:`kvbudget.eval.sign_flip`); intervals the
stratified bootstrap's. Neither table decides a claim: they describe.
"""

from __future__ import annotations

from kvbudget.eval.report import PEER_PREFIX

from .common import MIN_SAMPLES, difference_cell, paired_on_finished_tasks
from .leaderboard import best_label, best_pair, held_to_budget, mean_over_tasks
from .pairs import SAME_METHOD_PAIRS
from .screen import SCREEN_COUNTERPARTS

RATIOS = (0.875, 0.75, 0.5, 0.25)
#: the samples of each task a slow press ran where the whole grid did not fit (marked ³)
SUBSAMPLE = 3
SUBSAMPLE_TASKS = (
    "niah_single_2",
    "niah_multikey_1",
    "niah_multikey_2",
    "vt",
    "lcc",
)  # needle takes no limit

#: kvbudget's method → kvpress's press of the same method (its default settings' label)
PRESS_OF: dict[str, str] = {}
for _press, _ours in SAME_METHOD_PAIRS:
    if "@" not in _press:
        PRESS_OF.setdefault(_ours, _press)
for _press, _ours in SCREEN_COUNTERPARTS.items():
    PRESS_OF.setdefault(_ours, f"{PEER_PREFIX}{_press}")
#: kvpress's press → kvbudget's method of the same name
METHOD_OF = {press: ours for ours, press in PRESS_OF.items()}


def shipped(label: str) -> bool:
    """Whether kvpress has a press of kvbudget's method ``label`` (its options aside)."""
    return label in PRESS_OF or label.split(":")[0] in PRESS_OF


def _p(value: float) -> str:
    return "<0.001" if value < 0.001 else f"{value:.3f}"


def same_method_table(
    tracks: list[tuple[str, list[dict]]], not_run: list[tuple[str, float, str, str]] | None = None
) -> list[str]:
    """Per track and ratio, each side's best method against the other library's version of it;
    the pairs whose other version has not run are added to ``not_run`` (track, ratio, method, press)."""
    lines = [
        "| track | r | method (whose best) | kvbudget | kvpress | kvbudget − kvpress [95% CI] | p | tasks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for track, rows in tracks:
        for ratio in RATIOS:
            pair = best_pair(rows, ratio)
            if pair is None:
                lines.append(f"| {track} | {ratio:g} | – | not run | not run | – | – | – |")
                continue
            column = ("r", ratio)
            candidates = []
            if pair.ours.split(":")[0] in PRESS_OF:
                candidates.append((pair.ours, PRESS_OF[pair.ours.split(":")[0]], "kvbudget's"))
            if pair.peer in METHOD_OF:
                candidates.append((METHOD_OF[pair.peer], pair.peer, "kvpress's"))
            if not candidates:
                lines.append(f"| {track} | {ratio:g} | neither best is a method of both | | | – | – | – |")
            for ours, press, whose in candidates:
                d = paired_on_finished_tasks(rows, ours, press, column, pair.tasks)
                sub = None if d is not None else subsample_difference(rows, ours, press, column, pair.tasks)
                if sub is not None:  # kvpress's press ran the same subsample at every such ratio
                    lines.append(
                        f"| {track} | {ratio:g} | {ours} ({whose}) ³ | {100 * sub.a.mean:.1f} "
                        f"| {100 * sub.b.mean:.1f} | {difference_cell(sub)} | {_p(sub.p_value)} "
                        f"| {len(sub.tasks)} × {SUBSAMPLE} |"
                    )
                    continue
                if d is None:  # the other library's version has not run these tasks
                    if not_run is not None and whose == "kvbudget's":
                        not_run.append((track, ratio, ours, press))
                    mine, theirs = pair.means.get(ours), pair.means.get(press)
                    cells = ["not run" if v is None or side != whose else f"{100 * v:.1f}"
                             for v, side in ((mine, "kvbudget's"), (theirs, "kvpress's"))]  # fmt: skip
                    lines.append(
                        f"| {track} | {ratio:g} | {ours} ({whose}) | {cells[0]} | {cells[1]} | – | – | – |"
                    )
                    continue
                lines.append(
                    f"| {track} | {ratio:g} | {ours} ({whose}) | {100 * d.a.mean:.1f} | {100 * d.b.mean:.1f} "
                    f"| {difference_cell(d)} | {_p(d.p_value)} | {len(d.tasks)} |"
                )
    return lines


def subsample_difference(rows: list[dict], ours: str, press: str, column, tasks):
    """``ours − press`` on the first :data:`SUBSAMPLE` samples of each of :data:`SUBSAMPLE_TASKS`
    (all of them among ``tasks``), once kvpress's press has run all of them there
    (lab/scripts/kvpress_same_method.sh); ``None`` before (a screen's two tasks do not count)."""
    if not set(SUBSAMPLE_TASKS) <= set(tasks):
        return None
    first = [r for r in rows if r["sample"] < SUBSAMPLE and r["task"] in SUBSAMPLE_TASKS]
    d = paired_on_finished_tasks(first, ours, press, column, SUBSAMPLE_TASKS, SUBSAMPLE)
    return d if d is not None and len(d.tasks) == len(SUBSAMPLE_TASKS) else None


def _half(rows: list[dict], parity: int) -> list[dict]:
    return [r for r in rows if r["sample"] % 2 == parity]


def unshipped_table(tracks: list[tuple[str, list[dict]]]) -> list[str]:
    """Per track and ratio, kvbudget's best among the methods kvpress does not ship against kvpress's
    best press: picked and scored on all samples, and picked on the even samples, scored on the odd."""
    lines = [
        "| track | r | kvbudget's best kvpress does not ship | kvpress's best | difference [95% CI], p "
        "| picked on even samples: the pair | its difference on the odd samples [95% CI], p | tasks |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def competes(label: str) -> bool:
        return held_to_budget(label) and not shipped(label)

    for track, rows in tracks:
        for ratio in RATIOS:
            pair = best_pair(rows, ratio, competes)
            if pair is None:
                lines.append(f"| {track} | {ratio:g} | not run | not run | – | – | – | – |")
                continue
            ours, peer = pair.cells()
            whole = f"{difference_cell(pair.diff)}, p {_p(pair.diff.p_value)}" if pair.diff else "–"
            column, tasks = ("r", ratio), set(pair.tasks)
            even, odd = _half(rows, 0), _half(rows, 1)
            means = {
                label: mean_over_tasks(even, label, column, tasks)
                for label in [*pair.our_labels, *pair.peer_labels]
            }
            picked = (best_label(pair.our_labels, means), best_label(pair.peer_labels, means))
            held_out = paired_on_finished_tasks(odd, *picked, column, pair.tasks, MIN_SAMPLES // 2)
            cell = f"{difference_cell(held_out)}, p {_p(held_out.p_value)}" if held_out else "–"
            lines.append(
                f"| {track} | {ratio:g} | {ours} | {peer} | {whole} | {picked[0]} vs {picked[1]} | {cell} "
                f"| {len(pair.tasks)} |"
            )
    return lines
