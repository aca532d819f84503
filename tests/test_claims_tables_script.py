"""lab/scripts/claims_tables.py renders the same kvbudget-vs-kvpress row whatever order the rows come in:
tied methods are broken by name, not by the order a set of labels happens to iterate in."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "lab" / "scripts" / "claims_tables.py"


def _load():
    spec = importlib.util.spec_from_file_location("claims_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _load_summary():
    """lab/scripts/leaderboard_summary.py, which imports claims_tables as a sibling."""
    _load()
    spec = importlib.util.spec_from_file_location(
        "leaderboard_summary", SCRIPT.with_name("leaderboard_summary.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(scores: dict[str, float]) -> list[dict]:
    rows = []
    for label, score in scores.items():
        for sample in range(20):
            rows.append({"label": label, "task": "needle", "length": 2048, "sample": sample,
                         "compression_ratio": None if label == "full" else 0.5,
                         "score": score if sample % 2 else 1.0})  # fmt: skip
    return rows


def test_tied_best_methods_render_the_same_row_in_any_order():
    tables = _load()
    scores = {"full": 1.0, "snapkv": 0.0, "zeta": 1.0, "alpha": 1.0}
    scores |= {"kvpress:snapkv": 0.0, "kvpress:tova": 0.5}
    rendered = set()
    for seed in range(5):
        rows = _rows(scores)
        random.Random(seed).shuffle(rows)
        rendered.add("\n".join(tables.best_against_kvpress(rows, (0.5,))))
    assert len(rendered) == 1
    (table,) = rendered
    best_row = table.splitlines()[-1]
    assert best_row.startswith("| 0.5 | alpha 100.0 (tied with 1 more) | kvpress:tova 75.0 |")
    assert best_row.endswith("| 1 |")


def test_a_press_screened_on_fewer_samples_waits_until_it_finishes_them():
    """A press with 3 samples (a screen) neither empties the comparison nor becomes the best, however
    well it scores; once it has the most complete presses' samples it counts."""
    tables = _load()
    rows = _rows({"full": 1.0, "snapkv": 0.5, "kvpress:snapkv": 0.0})
    screened = [{**r, "label": "kvpress:kvzip", "score": 1.0} for r in _rows({"x": 0.0}) if r["sample"] < 3]
    pair = tables.best_pair(rows + screened, 0.5)
    assert pair is not None and pair.peer == "kvpress:snapkv" and "kvpress:kvzip" not in pair.peer_labels
    finished = [{**r, "label": "kvpress:kvzip", "score": 1.0} for r in _rows({"x": 0.0})]
    assert tables.best_pair(rows + finished, 0.5).peer == "kvpress:kvzip"


def test_a_single_best_is_named_without_a_tie_note():
    tables = _load()
    means = {"a": 0.5, "b": 0.75, "c": 0.25}
    assert tables.best_label(list(means), means) == "b"
    assert tables.best_cell("b", list(means), means) == "b 75.0"


def test_each_kvpress_press_is_paired_with_a_registered_method_of_the_same_name():
    """A misspelt name would render a silent "–" row: every pair names a press the peer harness runs
    and a method kvbudget registers, and each of the nine presses the leaderboard first ran has its
    pair (kvpress's other presses, issue #45, mostly have no kvbudget counterpart)."""
    from kvbudget.eval.peer_rows import PRESSES
    from kvbudget.eval.report import PEER_PREFIX
    from kvbudget.methods.registry import method_names
    from kvbudget.methods.spec import MethodSpec

    pairs = _load().SAME_METHOD_PAIRS
    presses = [press.removeprefix(PEER_PREFIX) for press, _ in pairs]
    assert len(set(presses)) == len(presses) and set(presses) <= set(PRESSES) - {"no_press"}
    nine = {
        "snapkv", "streaming_llm", "knorm", "tova", "keydiff", "expected_attention", "observed_attention",
        "adakv_snapkv", "pyramidkv",
    }  # fmt: skip
    assert nine <= set(presses)
    # kvbudget's side is a registry name or a spec with options (``compactor:head_alloc=ada``): its
    # name is registered and its options build (MethodSpec.parse raises on an unknown option)
    assert all(MethodSpec.parse(ours).name in method_names() for _, ours in pairs)
    # the compactor draws' table: kvbudget's specs build, kvpress's side is a press it runs
    for a, b in _load().COMPACTOR_DRAW_PAIRS:
        for label in (a, b):
            if label.startswith(PEER_PREFIX):
                assert label.removeprefix(PEER_PREFIX) in PRESSES
            else:
                assert MethodSpec.parse(label).name in method_names()


def test_screen_table_counts_same_answers_on_the_samples_both_ran():
    """The screen: a press's mean over its own rows, kvbudget's same method's mean over those very samples
    (the press's mean on them beside it when the press ran more), the same-answer count after stripping,
    best press first; a press with no counterpart gets dashes; rows outside the screen are ignored."""
    from kvbudget.eval.peer_rows import PRESSES
    from kvbudget.methods.registry import method_names

    tables = _load()
    assert set(tables.SCREEN_COUNTERPARTS) <= set(PRESSES) - {"no_press"}
    assert set(tables.SCREEN_COUNTERPARTS.values()) <= set(method_names())

    def row(label, task, sample, score, text, ratio=0.5):
        return {"label": label, "task": task, "length": 2048, "sample": sample, "compression_ratio": ratio,
                "score": score, "prediction": text}  # fmt: skip

    rows = [
        row("kvpress:kvzip", "niah_multikey_2", 0, 1.0, "123"),
        row("kvpress:kvzip", "niah_multikey_2", 1, 0.0, "9"),
        row("kvpress:kvzip", "vt", 0, 0.5, "A B"),
        row("kvzip", "niah_multikey_2", 0, 1.0, " 123 "), row("kvzip", "niah_multikey_2", 1, 1.0, "456"),
        row("kvzip", "niah_multikey_2", 2, 1.0, "7"),  # a sample the press did not run: not counted
        row("kvpress:cur", "niah_multikey_2", 0, 1.0, "1"),
        row("kvpress:cur", "niah_multikey_2", 3, 0.0, "1"),  # beyond the screen's 3 samples
        row("kvpress:cur", "vt", 1, 0.0, "x", ratio=0.75),  # another ratio
        row("kvpress:leverage", "vt", 2, 0.0, "x"),
    ]  # fmt: skip
    lines = tables.screen_table(rows)
    body = lines[2:]
    assert body[0] == "| kvpress:cur | 1 | 100.0 | – | – | – |"
    assert body[1] == "| kvpress:kvzip | 3 | 50.0 | kvzip | 100.0 (press 50.0 on these) | 1 of 2 |"
    assert body[2] == "| kvpress:leverage | 1 | 0.0 | leverage | not run on these samples | – |"
    assert len(body) == 3
    assert tables.screen_table([row("kvzip", "vt", 0, 1.0, "a")]) == ["(no screen rows yet)"]


def test_a_method_screened_on_a_few_samples_is_named_under_the_table_not_emptying_it():
    """A method with 3 samples of a task (a screen) neither empties the table nor shrinks its tasks, in
    either mode: it is named under the table; kvpress's presses are not."""
    tables = _load()
    rows = [{"label": label, "task": task, "length": 2048, "sample": i, "score": score,
             "compression_ratio": None if label == "full" else 0.5}
            | {"metric": "exact", "family": "ruler"}
            for label, score in {"full": 1.0, "a": 0.5, "kvpress:x": 0.25}.items()
            for task in ("needle", "vt") for i in range(20)]  # fmt: skip
    rows += [{**r, "label": "screened"} for r in rows if r["label"] == "a" and r["sample"] < 3]
    for shared in (False, True):
        lines = tables.leaderboard_table(rows, 0.5, shared=shared)
        assert lines[0].endswith("| needle | vt |")
        assert any(line.startswith("| a | 50.0") for line in lines)
        assert lines[-1] == "Not in this table (fewer of these tasks or samples at r = 0.5): screened."
        assert not any(line.startswith("| screened") for line in lines)


def _track(scores: dict[str, list[float]]) -> list[dict]:
    return [
        {"label": label, "task": "needle", "length": 2048, "sample": i, "compression_ratio": 0.5, "score": s}
        for label, per_sample in scores.items()
        for i, s in enumerate(per_sample)
    ]


def test_tracks_table_pairs_each_method_with_itself_across_the_two_tracks():
    """Question-aware against question-agnostic on the same samples: the means and the paired difference
    are the hand-computed ones; kvpress's presses and methods that ran in one track only get no row."""
    tables = _load()
    ones, alternating = [1.0] * 20, [float(i % 2 == 0) for i in range(20)]
    aware = _track({"snapkv": ones, "keydiff": alternating, "kvpress:snapkv": ones, "lava": ones})
    agnostic = _track({"snapkv": alternating, "keydiff": alternating, "kvpress:snapkv": alternating})
    lines = tables.tracks_table(aware, agnostic, 0.5)
    assert len(lines) == 4  # header, rule, snapkv, keydiff
    snapkv, keydiff = lines[2].split(" | "), lines[3].split(" | ")
    assert snapkv[:3] == ["| snapkv", "100.0", "50.0"] and snapkv[-1] == "1 |"
    low, high = (float(x) for x in snapkv[3].split("[")[1].rstrip("]").split(", "))
    assert snapkv[3].startswith("+50.0 [") and 0 < low < 50 < high <= 100
    assert keydiff[:4] == ["| keydiff", "50.0", "50.0", "+0.0 [+0.0, +0.0]"]
    assert tables.tracks_table(aware, [], 0.5) == ["(no task finished in both tracks at r=0.5 yet)"]


def test_pairs_table_leaves_out_a_ratio_no_pair_has_finished():
    """A ratio still running (fewer than 20 samples of every task) gets no column of dashes; a finished
    ratio keeps its column with the hand-computed means."""
    tables = _load()
    done = [{"label": label, "task": "needle", "length": 2048, "sample": i, "compression_ratio": 0.5,
             "score": score} for label, score in (("a", 1.0), ("b", 0.5)) for i in range(20)]  # fmt: skip
    running = [dict(row, compression_ratio=0.75) for row in done if row["sample"] < 5]
    table = tables.pairs_table(done + running, [("a", "b")])
    assert table[0] == "| a − b | r=0.5 |"
    assert table[2].startswith("| a − b | 100.0 vs 50.0: +50.0 [+50.0, +50.0] (1 tasks) |")
    assert "r=0.75" not in "\n".join(table)


def test_every_ratio_tasks_are_the_plans_shared_tasks_and_filter_a_pair_table():
    """The LAQ-by-ratio table reads one task set: the five core tasks but lcc, which the plan runs only
    at 0.875 and 0.5; a pair table given those tasks leaves lcc's samples out of its means."""
    tables = _load()
    assert tables.EVERY_RATIO == ["needle", "niah_multikey_1", "niah_multikey_2", "niah_single_2", "vt"]
    rows = [{"label": label, "task": task, "length": 2048, "sample": i, "compression_ratio": 0.75,
             "score": 1.0 if label == "a" and task == "lcc" else 0.5}
            for label in ("a", "b") for task in ("lcc", "vt") for i in range(20)]  # fmt: skip
    assert "+25.0 [" in tables.pairs_table(rows, [("a", "b")])[2]
    every = tables.pairs_table(rows, [("a", "b")], tasks=tables.EVERY_RATIO)
    assert every[2] == "| a − b | 50.0 vs 50.0: +0.0 [+0.0, +0.0] (1 tasks) |"


def test_family_verdict_applies_the_rule():
    """docs/claims.md's rule on (direction, a − b, Holm-adjusted p) triples: every comparison held in
    the claimed direction → reproduced; one held against it → not reproduced, whatever the others;
    anything else → inconclusive; a comparison not run (None) or an empty family → pending."""
    tables = _load()
    v = tables.family_verdict
    assert v([(1, 2.7, 0.01), (1, 14.2, 0.005)]) == "reproduced"
    assert v([(-1, -0.06, 0.004), (-1, -0.18, 0.004)]) == "reproduced"  # lower is better, and lower
    assert v([(1, 14.2, 0.005), (1, -5.5, 0.006)]) == "not reproduced"
    assert v([(1, 2.7, 0.054), (1, -5.5, 0.006)]) == "not reproduced"
    assert v([(-1, 0.039, 0.049)]) == "not reproduced"  # KL higher where the claim says lower
    assert v([(1, 2.7, 0.054), (1, 14.2, 0.005)]) == "inconclusive at this scale"
    assert v([(1, -3.0, 0.2)]) == "inconclusive at this scale"  # against, but not significant
    assert v([(1, 2.7, 0.05)]) == "inconclusive at this scale"  # p must be below α, not at it
    assert v([(1, 9.6, 0.003), None]) == v([]) == "pending (not run)"


def test_verdicts_table_corrects_each_family_by_holm_and_leaves_unrun_comparisons_pending():
    """Three comparisons, each a win on 4 of 20 samples: each bootstrap interval excludes 0 (a
    resample misses all 4 with probability 0.8^20 = 0.012 per side), but the exact sign-flip test
    gives p = 2/2^4 = 0.125 (only the patterns as observed and all flipped are as extreme), Holm
    multiplies the smallest of three equal p-values by 3, and the family is inconclusive. A
    one-comparison family of a clear win is reproduced, uncorrected; a family with a comparison
    whose rows do not exist is pending, its row "not run"."""
    tables = _load()
    rows = []
    for label, scores in {
        "m": [1.0] * 20,
        "x": [0.0] * 20,
        **{y: [0.0] * 4 + [1.0] * 16 for y in "uvw"},
    }.items():
        rows += [{"label": label, "task": "t", "length": 2048, "sample": i, "compression_ratio": 0.5,
                  "score": s} for i, s in enumerate(scores)]  # fmt: skip
    col = ("r", 0.5)
    three = tables.Family("P", "r = 0.5", tuple(tables.Comparison("m", y, col) for y in "uvw"))
    one = tables.Family("Q", "r = 0.5", (tables.Comparison("m", "x", col),))
    unrun = tables.Family(
        "R", "r = 0.5", (tables.Comparison("m", "x", col), tables.Comparison("m", "z", col))
    )
    lines = tables.verdicts_table({"leaderboard": rows}, [three, one, unrun])
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[2:]]
    assert len(cells) == 6
    for row in cells[:3]:
        low = float(row[4].split("[")[1].split(",")[0])
        p, holm = float(row[6]), float(row[7])
        assert row[3] == "100.0 vs 80.0" and low > 0 and p == 0.125
        assert holm == pytest.approx(3 * p, abs=2e-3) and holm > 0.05
    assert cells[0][8:] == ["**inconclusive at this scale**", "–"] and cells[1][8:] == cells[2][8:] == [
        "",
        "",
    ]
    assert cells[3][2] == "m − x" and cells[3][6] == cells[3][7] and cells[3][8] == "**reproduced**"
    assert cells[4][8] == "**pending (not run)**" and cells[5][3] == "not run"


def test_a_family_is_decided_by_its_final_comparisons_once_they_have_every_task():
    """A family with stand-in baselines (provisional, its pending run named) switches to its final
    comparisons only when each has every task its stand-in has (or every task it names): while the
    final baseline has one task of two, the stand-ins decide and the pending note stays; with both
    tasks the final setting is shown, its own verdict (here the opposite one) decides, and nothing
    is pending."""
    tables = _load()

    def rows_of(label: str, score: float, tasks: tuple[str, ...]) -> list[dict]:
        return [{"label": label, "task": t, "length": 2048, "sample": i, "compression_ratio": 0.5,
                 "score": score} for t in tasks for i in range(20)]  # fmt: skip

    col = ("r", 0.5)
    family = tables.Family(
        "P", "stand-in", (tables.Comparison("m", "b", col),), pending="b at P's settings",
        final=(tables.Comparison("m", "b@p", col),), final_setting="b at P's settings",
    )  # fmt: skip
    both = ("t1", "t2")
    rows = rows_of("m", 0.5, both) + rows_of("b", 0.0, both) + rows_of("b@p", 1.0, ("t1",))

    def first(rows):
        return [
            c.strip() for c in tables.verdicts_table({"leaderboard": rows}, [family])[2].strip("|").split("|")
        ]

    partial = first(rows)
    assert partial[1:3] == ["stand-in", "m − b"] and partial[8:] == ["**reproduced**", "b at P's settings"]
    final = first(rows + rows_of("b@p", 1.0, ("t2",)))
    assert final[1:3] == ["b at P's settings", "m − b@p"] and final[8:] == ["**not reproduced**", "–"]
    assert final[5] == "2"
    # a final comparison naming its tasks (a run cut to them) decides once it has those
    family = tables.Family(
        "P", "stand-in", (tables.Comparison("m", "b", col),), pending="b at P's settings",
        final=(tables.Comparison("m", "b@p", col, tasks=("t1",)),), final_setting="b at P's, t1",
    )  # fmt: skip
    cut = first(rows)
    assert cut[1:3] == ["b at P's, t1", "m − b@p"] and cut[5] == "1"
    assert cut[8:] == ["**not reproduced**", "–"]


def test_the_cost_plot_pairs_each_score_with_its_median_time(tmp_path):
    """lab/scripts/agnostic_cost_plot.py: a label is drawn with its mean over the core tasks (20
    samples each) and the median prefill time of its side in bench peer's rows; one without a time,
    or short of a task, is listed as not drawn."""
    _load()  # the cost script imports claims_tables as a sibling
    path = SCRIPT.with_name("agnostic_cost_plot.py")
    spec = importlib.util.spec_from_file_location("agnostic_cost_plot", path)
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    rows = []
    for label, score in {"full": 1.0, "kvzip": 0.8, "kvpress:kvzip": 0.6, "leverage": 0.4}.items():
        for task in cost.CORE[: None if label != "leverage" else -1]:  # leverage misses lcc
            for sample in range(20):
                rows.append({"label": label, "task": task, "length": 2048, "sample": sample, "score": score,
                             "compression_ratio": None if label == "full" else 0.5})  # fmt: skip
    ours = [{"method": "kvzip", "prefill_s": s} for s in (3.0, 1.0, 2.0)]
    theirs = [{"method": "kvzip", "prefill_s": 5.0}, {"method": "leverage", "prefill_s": 0.5}]
    (tmp_path / "ours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ours))
    (tmp_path / "kvpress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in theirs))
    times = cost.ttfts(tmp_path)
    assert times == {"kvzip": 2.0, "kvpress:kvzip": 5.0, "kvpress:leverage": 0.5}
    got = cost.scores(rows, 0.5)
    assert got == {"kvzip": pytest.approx(0.8), "kvpress:kvzip": pytest.approx(0.6)}
    points = {r: {} for r in cost.RATIOS} | {0.5: {k: (times[k], got[k]) for k in got}}
    lines = cost.table(points, ["leverage", "kvpress:leverage"])
    assert lines[2].startswith("| kvzip | 2.00 | – | 80.0 |") and lines[3].startswith(
        "| kvpress:kvzip | 5.00 | – | 60.0 |"
    )
    assert "kvpress:leverage, leverage" in lines[-1]
    # the screen's samples (the first 3 of niah_multikey_2 and vt at r = 0.5) give a timed press its row
    screen = cost.screen_scores(rows)
    assert screen["leverage"] == (pytest.approx(0.4), 6) and screen["kvzip"] == (pytest.approx(0.8), 6)
    screened = [{**r, "label": "kvpress:leverage", "score": 0.5} for r in rows if r["label"] == "leverage"]
    screen = cost.screen_scores(screened)
    lines = cost.table(points, ["leverage", "kvpress:leverage"], times, screen)
    assert "| kvpress:leverage | 0.50 | 50.0 (6) | – | – | – |" in lines
    assert lines[-1].endswith("leverage.") and "kvpress:leverage" not in lines[-1]


def test_the_1_5b_check_judges_each_family_once_every_core_task_has_its_10_samples():
    """The check's families read its own rows (10 samples a task): LAVa ahead of every baseline on
    all six core tasks is reproduced; with one task missing for a baseline, the comparison is not
    run and the family pending (no verdict from a part); the machine time sums the rows' gaps and
    leaves out a pause over 10 minutes."""
    tables = _load()

    def rows_of(label: str, score: float, tasks) -> list[dict]:
        return [{"label": label, "task": t, "length": 4096, "sample": i, "compression_ratio": 0.875,
                 "score": score, "time": "2026-11-29T10:00:00"}
                for t in tasks for i in range(10)]  # fmt: skip

    core = tables.CORE
    baselines = ("snapkv@lava", "ada-snapkv@lava", "pyramidkv@lava", "ada-pyramidkv@lava", "cake@lava")
    rows = rows_of("lava", 1.0, core) + [r for b in baselines for r in rows_of(b, 0.0, core)]
    lines = tables.check_block(rows)
    lava = [c.strip() for c in lines[2].strip("|").split("|")]
    assert lava[:3] == [
        "LAVa",
        "r = 0.875, 6 core tasks, the baselines at LAVa's App. D settings (`@lava`)",
        "lava − snapkv@lava",
    ]
    assert lava[5] == "6" and lava[8] == "**reproduced**"
    asl = next(line for line in lines if line.startswith("| ASL"))
    assert "**pending (not run)**" in asl
    partial = [r for r in rows if not (r["label"] == "cake@lava" and r["task"] == "lcc")]
    lava = [c.strip() for c in tables.check_block(partial)[2].strip("|").split("|")]
    assert lava[8] == "**pending (not run)**"
    cake = next(line for line in tables.check_block(partial) if "lava − cake@lava" in line)
    assert "not run" in cake
    stamps = [{"time": t} for t in ("2026-11-29T10:00:00", "2026-11-29T10:05:00", "2026-11-29T11:00:00",
                                     "2026-11-29T11:02:00")]  # fmt: skip
    assert tables.machine_time(stamps) == 7 * 60
    assert lines[-1].startswith(f"{len(rows)} rows (")


def test_the_kvzap_goal_lines_pair_kvzap_with_kvzip_plus_and_share_of_kvzips_added_time(tmp_path):
    """lab/scripts/agnostic_cost_plot.py, issue #48's goal: per ratio, kvzap − kvzip+ over the six
    core tasks (level when the interval holds 0, pending with a task short); KVzap's added TTFT over
    the uncompressed prefill as a share of KVzip's; the threshold rows' removed share read from
    their per-head budgets, and their paired difference with kvzip+ at r = 0.5."""
    _load()
    path = SCRIPT.with_name("agnostic_cost_plot.py")
    spec = importlib.util.spec_from_file_location("agnostic_cost_plot", path)
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)

    def rows_of(label, ratio, score_of, tasks=cost.CORE, **extra):
        return [{"label": label, "task": t, "length": 2048, "sample": i, "compression_ratio": ratio,
                 "score": score_of(i), **extra} for t in tasks for i in range(20)]  # fmt: skip

    rows = rows_of("kvzip+", 0.5, lambda i: float(i % 2)) + rows_of("kvzap", 0.5, lambda i: float(i % 2 == 0))
    rows += rows_of("kvzip+", 0.875, lambda i: 1.0) + rows_of("kvzap", 0.875, lambda i: float(i < 4))
    rows += rows_of("kvzip+", 0.75, lambda i: 1.0) + rows_of("kvzap", 0.75, lambda i: 1.0, cost.CORE[:-1])
    # a 1,000-token context at r = 0.5 (budget 500); the threshold kept 250 and 350 per head: 70% removed
    rows += rows_of(cost.THRESHOLD_LABEL, 0.5, lambda i: 1.0, budget=500, budgets=[[250, 350], [300, 300]])
    lines = cost.goal_lines(rows, None)
    by_ratio = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| 0.")}
    assert by_ratio["0.5"].endswith("| 6 | yes |")  # 50% each on other samples: the interval holds 0
    assert by_ratio["0.875"].endswith("| 6 | no |") and "-80.0" in by_ratio["0.875"]
    assert by_ratio["0.75"].endswith("| 5 of 6 | pending |")
    assert "removed 70.0% of the context on average (70.0–70.0%" in lines[-1] and "scores 100.0" in lines[-1]
    assert "paired with kvzip+ at r = 0.5 (which removes 50%): +50.0 [" in lines[-1]  # 1.0 vs i % 2
    assert lines[-1].endswith("(ahead).")

    ours = [{"method": m, "prefill_s": s} for m, s in (("full", 10.0), ("full", 12.0), ("kvzip", 31.0),
                                                       ("kvzap", 12.0), ("kvzap", 13.0))]  # fmt: skip
    (tmp_path / "ours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ours))
    added = cost.added_ttft(tmp_path)
    assert added == {"full": 11.0, "kvzip": 20.0, "kvzap": pytest.approx(1.5)}
    line = next(x for x in cost.goal_lines(rows, added) if x.startswith("KVzap adds"))
    assert "8% of KVzip's added time (goal ≤ 10%: met)" in line
    (tmp_path / "ours.jsonl").write_text(json.dumps({"method": "kvzip", "prefill_s": 1.0}) + "\n")
    assert cost.added_ttft(tmp_path) is None  # no uncompressed prefill to subtract


def test_tables_name_a_tuned_profile_instead_of_printing_its_path():
    module = _load()
    path = "lab/results/claims-baklava/profile.json"
    out = module.name_tuned_profiles({"verdicts": [f"| baklava:profile={path} − streamingllm | +0.4 |",
                                                   "| baklava − streamingllm | −7.7 |"]})  # fmt: skip
    expected = ["| baklava (tuned) − streamingllm | +0.4 |", "| baklava − streamingllm | −7.7 |"]
    assert out["verdicts"] == expected
    assert path not in "".join(out["verdicts"])


def _conversation_rows(
    label: str, ratio, later: list[float], first: float = 1.0, task: str = "t"
) -> list[dict]:
    return [
        {"key": f"{label}{ratio}{i}{mode}", "task": task, "length": 2048, "sample": i, "label": label,
         "method": label, "compression_ratio": ratio, "budget": None if ratio is None else 64, "error": None,
         "conversation": mode, "compress_s": 2.0, "physical_bytes": 2**20,
         "turns": [{"score": first}] + [{"score": s} for s in [later[i]] * 3]}
        for i in range(len(later)) for mode in ("multi-turn", "multi-request")
    ]  # fmt: skip


def test_shared_context_rule_holds_loses_and_undecided_by_hand():
    _load()
    from claims.shared_context import shared_context_table, verdict

    assert verdict(-0.05, 0.02) == "holds" and verdict(-0.3, -0.12) == "loses"
    assert verdict(-0.12, 0.0) == "undecided"
    rows = (
        _conversation_rows("full", None, [1.0] * 20)
        + _conversation_rows("same", 0.5, [1.0] * 20)  # no difference: holds
        + _conversation_rows("lost", 0.5, [0.0] * 20, first=0.0)  # −100 on every sample: loses
        + _conversation_rows("half", 0.5, [1.0, 0.0] * 10)  # −50 ± a wide interval: loses or undecided
        + _conversation_rows("late", 0.5, [1.0] * 5)  # fewer samples than the rest: on its five
        + _conversation_rows("begun", 0.75, [0.0] * 2, first=0.0)  # two samples: no interval, no verdict
    )
    table = shared_context_table(rows, "question-agnostic")
    by_label = {line.split(" | ")[2]: line for line in table[2:] if line.startswith("| multi-turn")}
    assert set(by_label) == {"full", "same", "lost", "half", "late", "begun"}
    assert by_label["begun"].split(" | ")[5:7] == ["–", "–"] and by_label["begun"].endswith("| 1 × 2 |")
    assert by_label["late"].endswith("| 1 × 5 |") and by_label["same"].endswith("| 1 × 20 |")
    assert "| +0.0 [+0.0, +0.0] | holds |" in by_label["same"]
    assert "| 0.0 | 0.0 | -100.0 [-100.0, -100.0] | loses |" in by_label["lost"]
    assert by_label["half"].split(" | ")[6] == "loses"  # [−75, −25]: every bound below −10
    assert by_label["full"].endswith("| 1.0 | 1 × 20 |")


def test_the_server_default_is_the_cheapest_candidate_that_holds_later_turns_in_both_modes():
    """docs/leaderboard.md's rule for `kvbudget serve`'s default, on rows made by hand: a slow
    compression and a big cache are not candidates; of those that hold, the fewest bytes win; until
    every named candidate has its 20 samples the block says which are running."""
    _load()
    from claims import server_default as rule

    def rows_of(label, ratio, later, compress=0.1, mib=1.0):
        out = []
        for task in rule.TASKS:
            for r in _conversation_rows(label, ratio, later, task=task):
                r.update(
                    key=r["key"] + task, compress_s=compress, physical_bytes=int(mib * 2**20), prefill_s=4.0
                )
                out.append(r)
        return out

    full = rows_of("full", None, [1.0] * 20, compress=0.0, mib=10.0)
    slow = rows_of("slow", 0.5, [1.0] * 20, compress=2.0, mib=1.0)  # compress ÷ prefill 0.5: not a candidate
    big = rows_of("big", 0.5, [1.0] * 20, mib=6.0)  # 60% of the bytes: not a candidate
    mid = rows_of("mid", 0.75, [1.0] * 20, mib=3.0)  # holds
    small = rows_of("small", 0.875, [1.0] * 20, mib=2.0)  # holds, with fewer bytes than mid
    lossy = rows_of("lossy", 0.875, [0.0] * 20, mib=1.0)  # loses everything
    configs = rule.configurations(full + slow + big + mid + small + lossy)
    by_name = {c.name: c for c in configs}
    assert set(by_name) == {"slow r=0.5", "big r=0.5", "mid r=0.75", "small r=0.875", "lossy r=0.875"}
    assert by_name["slow r=0.5"].compress_share == pytest.approx(0.5) and not by_name["slow r=0.5"].eligible
    assert by_name["big r=0.5"].bytes_share == pytest.approx(0.6) and not by_name["big r=0.5"].eligible
    best, why = rule.choose(configs)
    assert best.name == "small r=0.875" and why.startswith("holds")
    # nothing holds: the highest lower bound wins
    best, why = rule.choose(
        rule.configurations(full + rows_of("a", 0.5, [0.0] * 20) + rows_of("b", 0.5, [0.5] * 20, mib=2.0))
    )
    assert best.name == "b r=0.5" and why.startswith("none holds")
    # the documents' default has no cost bound: the slow compression with the fewest bytes wins
    assert rule.choose(configs, document=True)[0].name == "slow r=0.5"
    # the named candidates have not run: the block waits
    table = rule.server_default_table(full + mid)
    assert "| mid r=0.75 | 0.30 |" in table[2] and table[2].endswith("| yes | yes |")
    assert table[-3].startswith("The conversations' default (`--method`): running (11 of 11 candidates")
    assert table[-1].startswith("The documents' default (`--document-method`): running (16 of 16")


def test_the_servers_defaults_are_what_the_rule_chose_from_the_committed_rows():
    """`kvbudget serve`'s defaults (kvbudget.serve.defaults) follow docs/leaderboard.md's rule on the
    rows in lab/results: SnapKV and KVzip under `memory=0.125` while a decision's candidates are
    running, its choice once they are complete (the rule's r is the share evicted, the server's ratio
    the share kept). Fails when new rows complete a decision that the defaults do not follow yet."""
    _load()
    from claims import server_default as rule

    from kvbudget.eval.store import load_rows
    from kvbudget.serve import defaults

    rows = load_rows(SCRIPT.parents[1] / "results" / "shared-context-agnostic" / "results.jsonl")
    chosen = rule.decisions(rule.configurations(rows))

    def served(config, interim: tuple[str, float | None]) -> tuple[str, float | None]:
        if config is None:
            return interim
        return config.label, None if config.ratio is None else 1 - config.ratio

    assert (defaults.METHOD, defaults.RATIO) == served(chosen["conversations"], ("snapkv", None))
    documents = served(chosen["documents"], ("kvzip:memory=0.125", None))
    assert defaults.DOCUMENT_METHOD == documents[0]
    assert documents[1] in (None, defaults.DOCUMENT_RATIO)


def test_equal_bytes_rule_ahead_behind_and_running_by_hand():
    """docs/leaderboard.md's equal-bytes rule on rows made by hand: the byte budget against eviction
    alone on later turns, paired per sample; a comparison without every sample says how far it is."""
    _load()
    from claims import equal_bytes as eb

    def rows_of(label, ratio, later, task, bytes_=2**20, n=20):
        out = []
        for r in _conversation_rows(label, ratio, later[:n], task=task):
            r.update(key=r["key"] + task, physical_bytes=bytes_, logical_bytes=8 * 2**20)
            out.append(r)
        return out

    rows = []
    for task in eb.SC_TASKS:
        rows += rows_of("full", None, [1.0] * 20, task, bytes_=8 * 2**20)
        rows += rows_of("kvzip:memory=0.125", None, [1.0] * 20, task)  # budget 100, eviction 0: ahead
        rows += rows_of("kvzip", 0.875, [0.0] * 20, task)
        rows += rows_of("snapkv:memory=0.125", None, [0.0] * 20, task)  # budget 0, eviction 100: behind
        rows += rows_of("snapkv", 0.875, [1.0] * 20, task)
        n = 20 if task != "sc_vt" else 7  # expected attention's budget still running on sc_vt
        rows += rows_of("expected-attention:memory=0.125", None, [1.0] * 20, task, n=n)
        rows += rows_of("expected-attention", 0.875, [1.0] * 20, task)
    table = eb.equal_bytes_table(rows, [], [])
    line = {(c[1], c[2]): c for c in ([x.strip() for x in row.strip("|").split("|")] for row in table[2:])}
    kvzip = line[("kvzip", "multi-turn")]
    assert kvzip[3] == "100.0, 12.5%" and kvzip[5] == "+100.0 [+100.0, +100.0]" and kvzip[6] == "ahead"
    assert kvzip[7] == "3 × 20"
    assert line[("snapkv", "multi-request")][6] == "behind"
    ea = line[("expected-attention", "multi-turn")]
    assert ea[3] == "running (sc_keys 20, sc_code 20, sc_vt 7 of 20)" and ea[6] == ""
    assert line[("kvzip", "one question")][3].startswith("running (needle 0,")


def test_the_small_byte_budget_is_compared_with_eviction_and_with_two_bit_quantization_by_hand():
    """The equal-bytes rule at 6.25% (docs/leaderboard.md, "At 6.25%"): ``M:memory=0.0625`` against
    ``M`` at r = 0.9375 and against the full cache at 2 bits, each its own line and verdict, the
    Bonferroni count over both kinds; one-question rows scored by their answer."""
    _load()
    from claims import equal_bytes as eb

    assert [f.comparisons for f in eb.SMALL_FAMILIES] == [8, 4, 2]

    def one_question(label, ratio, score, bytes_, n=20):
        return [
            {"key": f"{label}{task}{i}", "task": task, "sample": i, "label": label,
             "compression_ratio": ratio, "score": score, "error": None, "physical_bytes": bytes_,
             "logical_bytes": 16 * 2**20}
            for task in eb.CORE for i in range(n)
        ]  # fmt: skip

    aware = (
        one_question("full", None, 1.0, 16 * 2**20)
        + one_question("snapkv:memory=0.0625", None, 1.0, 2**20)
        + one_question("snapkv", 0.9375, 0.0, 2**20)  # eviction alone: 0 → ahead by 100
        + one_question("full:kv_bits=2", None, 1.0, 3 * 2**20)  # quantization alone: as good → level
    )
    table = eb.equal_bytes_table([], aware, [], families=eb.SMALL_FAMILIES)
    assert table[0].split("|")[4].strip() == "against"
    line = {(c[1], c[3]): c for c in ([x.strip() for x in row.strip("|").split("|")] for row in table[2:])}
    evict = line[("snapkv", "eviction r = 0.9375")]
    assert evict[4] == "100.0, 6.2%" and evict[5] == "0.0, 6.2%" and evict[7] == "ahead"
    two_bit = line[("snapkv", "2-bit, every entry")]
    assert two_bit[5] == "100.0, 18.8%" and two_bit[6] == "+0.0 [+0.0, +0.0]" and two_bit[7] == "level"
    assert line[("kvzip", "eviction r = 0.9375")][4].startswith("running (needle 0,")
    assert eb.equal_bytes_table([], aware, [])[2].split("|")[4].strip().startswith("running")  # 12.5%: none


def _summary_rows(label: str, score, ratio: float = 0.5, tasks=("niah_multikey_2", "vt"), n: int = 20,
                  answer: str = "a") -> list[dict]:  # fmt: skip
    return [{"label": label, "task": task, "length": 2048, "sample": i, "compression_ratio": ratio,
             "score": score(i) if callable(score) else score, "prediction": answer}
            for task in tasks for i in range(n)]  # fmt: skip


def test_the_summary_pairs_each_sides_best_with_the_other_librarys_version():
    """lab/scripts/leaderboard_summary.py: kvbudget's best is KVgrad, whose press has only the
    screen's samples: its line says "not run" and the note gives the screen's agreement; kvpress's
    best is SnapKV, paired with kvbudget's SnapKV on the same samples; once kvpress's KVgrad has run
    the tasks, KVgrad's line has both means and the difference."""
    summary = _load_summary()
    rows = _summary_rows("kvgrad", 0.9) + _summary_rows("snapkv", 0.5) + _summary_rows("kvpress:snapkv", 0.4)
    screened = _summary_rows("kvpress:kvgrad", 0.9, n=3)
    screened[0]["prediction"] = "b"  # one of the six screen samples answered differently
    text = "\n".join(summary.like_with_like([("question-agnostic", rows + screened)]))
    assert "| question-agnostic | 0.5 | kvgrad (kvbudget's) | 90.0 | not run | – | – | – |" in text
    assert "| question-agnostic | 0.5 | snapkv (kvpress's) | 50.0 | 40.0 | +10.0 [+10.0, +10.0] |" in text
    assert "the press gave kvbudget's answer on `kvpress:kvgrad` 5 of 6." in text
    assert "| question-agnostic | 0.75 | – | not run | not run |" in text
    text = "\n".join(
        summary.like_with_like([("question-agnostic", rows + _summary_rows("kvpress:kvgrad", 0.8))])
    )
    assert "| question-agnostic | 0.5 | kvgrad (kvbudget's) | 90.0 | 80.0 | +10.0 [+10.0, +10.0] |" in text
    assert "screen's samples" not in text


def test_a_press_run_on_the_first_three_samples_of_every_task_is_compared_there_and_marked():
    """kvpress's slow presses run a subsample (lab/scripts/kvpress_same_method.sh): once the press has
    the first 3 samples of each task, the line pairs both sides on them, marked ³ with a note; the
    screen's two tasks alone do not count as one."""
    summary = _load_summary()
    tasks = ("niah_single_2", "niah_multikey_1", "niah_multikey_2", "vt", "lcc")
    rows = _summary_rows("kvgrad", lambda i: 1.0 if i < 3 else 0.5, tasks=tasks)
    rows += _summary_rows("snapkv", 0.5, tasks=tasks) + _summary_rows("kvpress:snapkv", 0.4, tasks=tasks)
    screen = _summary_rows("kvpress:kvgrad", 0.9, tasks=("niah_multikey_2", "vt"), n=3)
    text = "\n".join(summary.like_with_like([("question-agnostic", rows + screen)]))
    assert "| question-agnostic | 0.5 | kvgrad (kvbudget's) | 57.5 | not run |" in text and "³" not in text
    sub = _summary_rows("kvpress:kvgrad", 0.9, tasks=tasks, n=3)
    text = "\n".join(summary.like_with_like([("question-agnostic", rows + sub)]))
    # kvbudget's 100.0 on the same three samples a task, not its 57.5 over all 20
    assert "| question-agnostic | 0.5 | kvgrad (kvbudget's) ³ | 100.0 | 90.0 | +10.0 [+10.0, +10.0] |" in text
    assert text.split("kvgrad (kvbudget's) ³")[1].split("\n")[0].endswith("| 5 × 3 |")
    assert "³ On a subsample: kvpress's press ran the first 3 samples of each task" in text


def test_what_kvpress_does_not_ship_is_picked_on_half_the_samples_and_scored_on_the_other():
    """LAQ (not shipped by kvpress) against kvpress's best press; KVgrad, which kvpress ships, does
    not compete there. "b" leads on the even samples only and "laq" on the odd ones: over all samples
    laq is picked, picked on the even samples "b" is, and its difference is measured on the odd."""
    from claims.like_with_like import shipped

    summary = _load_summary()
    assert shipped("kvgrad") and shipped("compactor:head_alloc=ada") and not shipped("laq")
    rows = _summary_rows("kvgrad", 1.0) + _summary_rows("kvpress:snapkv", 0.4)
    rows += _summary_rows("laq", lambda i: 1.0 if i % 2 else 0.7) + _summary_rows(
        "b", lambda i: 0.6 if i % 2 else 0.9
    )
    lines = summary.like_with_like([("question-agnostic", rows)])
    line = next(x for x in lines if x.startswith("| question-agnostic | 0.5 | laq 85.0"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "kvpress:snapkv 40.0" and cells[4].startswith("+45.0 [")
    assert cells[5] == "b vs kvpress:snapkv" and cells[6].startswith("+20.0 [+20.0, +20.0], p ")
