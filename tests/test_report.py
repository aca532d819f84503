"""``kvbudget report``: intervals in every table and plot, ratio columns, ranks and means over tasks.

Rows are written by hand (no model). Scores are 0/1 or all-equal so every bound is known exactly:
a cell of all-equal scores has a zero-width interval; {0, 1, 0, 1} resamples to k/4 with
k ~ Binomial(4, 1/2), whose 2.5 % / 97.5 % quantiles are 0 and 4 (P(k = 0) = 1/16 > 2.5 %);
{a, b} resamples to a, (a+b)/2 or b, so its bounds are a and b.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbudget.eval import report as report_module
from kvbudget.eval.report import across_tasks, average_ranks, task_table, write_report

COMMON = {"ttft_s": 0.5, "compress_s": 0.01, "tpot_s": 0.02, "logical_bytes": 2**20, "physical_bytes": 2**20}


def _row(task, label, sample, score, budget=None, ratio=None, metric="string_match_all", **extra) -> dict:
    row = {
        "key": f"{task}-{label}-{sample}-{budget}-{ratio}", "model": "tiny", "dtype": "bfloat16",
        "task": task, "family": "ruler", "metric": metric, "length": 1024, "sample": sample,
        "method": label.partition(":")[0], "label": label, "options": {}, "budget": budget, "meta": {},
        "score": score, "full_score": 1.0, "agreement": score, "kl": 0.1, "selection_layer": None,
        "error": None, **COMMON, **extra,
    }  # fmt: skip
    if ratio is not None:
        row["compression_ratio"] = ratio
        row["budget"] = 100  # the entries the ratio left on this sample
    return row  # budget rows carry no compression_ratio, as rows written before ratios existed


def _grid() -> list[dict]:
    scores = {  # (task, label, column) → per-sample scores
        ("t1", "full", None): [1, 1, 1, 1],
        ("t1", "A", ("B", 64)): [1, 1, 1, 1],
        ("t1", "B", ("B", 64)): [0, 1, 0, 1],
        ("t1", "A", ("r", 0.5)): [1, 1, 1, 1],
        ("t1", "B", ("r", 0.5)): [0, 0, 0, 0],
        ("t1", "C", ("B", 64)): [1, 1, 1, 1],  # C never ran on t2: not ranked
        ("t2", "full", None): [1, 1, 1, 1],
        ("t2", "A", ("B", 64)): [0, 0, 0, 0],
        ("t2", "B", ("B", 64)): [1, 1, 1, 1],
        ("t2", "A", ("r", 0.5)): [0, 0, 0, 0],
        ("t2", "B", ("r", 0.5)): [0, 0, 0, 0],
    }
    rows = []
    for (task, label, column), values in scores.items():
        budget = column[1] if column and column[0] == "B" else None
        ratio = column[1] if column and column[0] == "r" else None
        rows += [_row(task, label, i, float(v), budget, ratio) for i, v in enumerate(values)]
    return rows


def _write(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_task_table_cells_carry_their_intervals():
    lines = task_table([r for r in _grid() if r["task"] == "t1"])
    assert lines[0] == "| method | B=64 | r=0.5 | n | retention | agreement | KL |"
    by_label = {line.split(" | ")[0].removeprefix("| "): line for line in lines[2:]}
    assert by_label["full"].startswith("| full | 100.0 [100.0, 100.0] | 100.0 [100.0, 100.0] | 4 |")
    assert by_label["A"].startswith("| A | 100.0 [100.0, 100.0] | 100.0 [100.0, 100.0] | 4 |")
    # B: {0,1,0,1} at B=64 → 50 [0, 100]; retention pools B=64 and r=0.5 per sample:
    # {0, .5, 0, .5} → 25 [0, 50]
    assert by_label["B"] == (
        "| B | 50.0 [0.0, 100.0] | 0.0 [0.0, 0.0] | 4 | 25.0 [0.0, 50.0] | 25.0 [0.0, 50.0] "
        "| 0.100 [0.100, 0.100] |"
    )


def test_ranks_and_means_over_tasks():
    summary = across_tasks(_grid())
    b64, r50 = ("B", 64), ("r", 0.5)
    assert summary.columns == [b64, r50]
    assert summary.tasks[b64] == ["t1", "t2"]
    # B=64: t1 A 1.0 > B 0.5, t2 B 1.0 > A 0.0 → both 1.5; r=0.5: t1 A > B, t2 tie (1.5 each)
    assert summary.ranks[b64] == {"A": 1.5, "B": 1.5}
    assert summary.ranks[r50] == {"A": 1.25, "B": 1.75}
    assert summary.left_out[b64] == ["C"]
    # B at B=64: t1 ∈ {0, .25, .5, .75, 1} (bounds 0, 1), t2 fixed at 1 → (0+1)/2 = .5 and (1+1)/2 = 1
    b = summary.scores[b64]["B"]
    assert (b.mean, b.low, b.high) == (0.75, 0.5, 1.0)
    a = summary.scores[r50]["A"]
    assert (a.mean, a.low, a.high) == (0.5, 0.5, 0.5)
    assert summary.reference["full"].mean == 1.0


def test_average_ranks_share_ties():
    assert average_ranks({"a": 0.9, "b": 0.5, "c": 0.5, "d": 0.1}) == {"a": 1, "b": 2.5, "c": 2.5, "d": 4}
    assert average_ranks({"x": 0.0, "y": 0.0, "z": 0.0}) == {"x": 2, "y": 2, "z": 2}


def test_report_writes_intervals_ranks_and_plots(tmp_path, monkeypatch):
    drawn: list[tuple] = []
    original = report_module._draw_score_lines

    def spy(lines, references, kind, title, path, bands=False):
        drawn.append((title, kind, lines, references, bands))
        original(lines, references, kind, title, path, bands)

    monkeypatch.setattr(report_module, "_draw_score_lines", spy)
    rows = _grid()
    rows += [_row("ppl", "full", i, 10.0, metric="perplexity") for i in range(2)]
    rows += [_row("ppl", "A", i, s, 64, metric="perplexity") for i, s in enumerate([12.0, 14.0])]
    rows.append({**_row("t1", "A", 0, None, ratio=0.75), "budget": None, "error": "RuntimeError: boom"})
    out = _write(tmp_path / "run", rows)
    text = write_report(out, resamples=4000).read_text()

    assert "## Across tasks" in text and "### Mean rank over tasks (1 = best)" in text
    assert "| A | 1.50 | 1.25 |\n| B | 1.50 | 1.75 |" in text
    assert "| full | 100.0 [100.0, 100.0] | 100.0 [100.0, 100.0] |" in text
    assert "| B | 75.0 [50.0, 100.0] | 0.0 [0.0, 0.0] |" in text  # mean over tasks, stratified interval
    assert "Not ranked where a task lacks their scores: C." in text
    assert "| B | 50.0 [0.0, 100.0] | 0.0 [0.0, 0.0] | 4 |" in text  # the t1 table
    assert "| A | 13.00 [12.00, 14.00] | 2 |" in text  # perplexity {12, 14}: bounds 12 and 14
    assert "- t1 #0 A r=0.75: RuntimeError: boom" in text
    assert "(bfloat16)" in text
    for name in ("score_vs_budget_mean", "score_vs_ratio_mean", "score_vs_budget_t1", "score_vs_ratio_t2"):
        assert (out / f"{name}.png").stat().st_size > 1000, name
        assert f"]({name}.png)" in text

    plots = {(title, kind): (lines, refs) for title, kind, lines, refs, _ in drawn}
    assert {title for title, *_, bands in drawn if bands} == {"mean over 2 tasks"}  # per task: error bars
    assert set(plots) == {("t1", "B"), ("t1", "r"), ("t2", "B"), ("t2", "r"), ("mean over 2 tasks", "B"),
                          ("mean over 2 tasks", "r")}  # fmt: skip
    lines, refs = plots[("t1", "B")]
    ((x, interval),) = lines["B"]
    assert (x, interval.mean, interval.low, interval.high) == (64, 0.5, 0.0, 1.0)  # error bar 0..100
    assert refs["full"].mean == 1.0
    lines, refs = plots[("mean over 2 tasks", "B")]
    assert set(lines) == {"A", "B"}  # one line per ranked method, C left out, full the reference band
    ((x, interval),) = lines["B"]
    assert (x, interval.low, interval.high) == (64, 0.5, 1.0)
    lines, _ = plots[("mean over 2 tasks", "r")]
    assert [(x, iv.mean) for x, iv in lines["A"]] == [(0.5, 0.5)]


def test_ratio_rows_group_by_ratio_not_by_their_entries():
    # two samples of different lengths: the same ratio leaves 100 and 300 entries; one column r=0.75
    rows = [
        {**_row("t1", "A", 0, 1.0, ratio=0.75), "budget": 100},
        {**_row("t1", "A", 1, 0.0, ratio=0.75), "budget": 300},
        _row("t1", "A", 0, 1.0, budget=100),
    ]
    lines = task_table(rows)
    assert lines[0].startswith("| method | B=100 | r=0.75 | n |")
    assert lines[2].startswith("| A | 100.0 [100.0, 100.0] | 50.0 [0.0, 100.0] | 1–2 |")


def test_report_without_results_is_a_one_line_error(tmp_path):
    from kvbudget.errors import KVBudgetError

    with pytest.raises(KVBudgetError, match="no results in"):
        write_report(tmp_path)


def test_columns_over_different_tasks_are_also_compared_on_the_shared_ones(tmp_path):
    rows = _grid() + [  # a third task run only at r=0.5, where A scores 1 and B 0
        _row("t3", label, i, score, ratio=0.5) for label, score in (("A", 1.0), ("B", 0.0)) for i in range(4)
    ] + [_row("t3", "full", i, 1.0) for i in range(4)]  # fmt: skip
    summary = across_tasks(rows)
    assert summary.tasks[("r", 0.5)] == ["t1", "t2", "t3"] and summary.tasks[("B", 64)] == ["t1", "t2"]
    assert report_module.common_tasks(summary) == ["t1", "t2"]
    assert report_module.common_tasks(across_tasks(_grid())) is None  # same tasks everywhere
    text = write_report(_write(tmp_path, rows), resamples=200).read_text()
    head, _, shared = text.partition("## Across the 2 tasks every column has (t1, t2)")
    assert shared, "the shared-task section is missing"
    # over t1..t3 A's r=0.5 mean is (1 + 0 + 1) / 3; over t1, t2 it is (1 + 0) / 2
    assert "| A | 50.0 [50.0, 50.0] | 66.7 [66.7, 66.7] |" in head
    assert "| A | 50.0 [50.0, 50.0] | 50.0 [50.0, 50.0] |" in shared.split("## t1")[0]


def test_report_header_states_what_the_weights_are(tmp_path):
    # a registry model: its quantization and GGUF header name, and what they mean for the scores;
    # a local folder: only where the weights came from
    rows = [{**_row("t1", "full", 0, 1.0), "model": "qwen2.5-coder-0.5b"}]
    rows.append({**_row("t1", "full", 0, 1.0), "model": "/data/my-model", "key": "local"})
    text = write_report(_write(tmp_path, rows), resamples=10).read_text()
    header = text.split("\n\n")[1]  # the paragraph after the title
    assert header.startswith("Model(s): /data/my-model, qwen2.5-coder-0.5b (bfloat16).")
    qwen = header.partition("Weights of `qwen2.5-coder-0.5b`: ")[2]
    assert qwen.startswith("4-bit GGUF Q4_K_M (file type MOSTLY_Q4_K_M;")
    assert "header name 'Qwen2.5 Coder 0.5B Instruct AWQ'" in qwen
    assert "not of the original bf16 checkpoint; every method runs on the same weights" in qwen
    assert "Weights of `/data/my-model`: weights as loaded from /data/my-model." in header
