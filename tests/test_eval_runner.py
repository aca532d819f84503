"""The evaluation runner: shared prefill equals per-run prefill, resume, kill-safety, error rows;
compression ratios, ``all`` methods, the leaderboard suite, the demo's dtype."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from conftest import tiny_model, tiny_tokenizer
from kvbudget import demo
from kvbudget.cli import app
from kvbudget.errors import BudgetError, KVBudgetError
from kvbudget.eval.report import write_report
from kvbudget.eval.runner import EvalConfig, Runner, ratio_budget
from kvbudget.eval.store import ResultStore, load_rows
from kvbudget.eval.suites import LEADERBOARD_CORE_TASKS, LEADERBOARD_PLAN, suite
from kvbudget.eval.tasks import get_task
from kvbudget.methods.registry import REGISTRY
from kvbudget.methods.snapkv import SnapKV

SMALL = ["full", "snapkv:window=4,kernel=3", "ada-snapkv:window=4,kernel=3", "h2o", "streamingllm", "tova"]


def _config(**kw) -> EvalConfig:
    base = dict(tasks=["needle_filler"], lengths=[160], methods=SMALL, budgets=[24, 48], limit=2)
    base["model"] = "tiny"
    return EvalConfig(**{**base, **kw})


def _run(out: Path, **kw) -> list[dict]:
    Runner(_config(**kw), out, model=tiny_model(), tokenizer=tiny_tokenizer(True), progress=False).run()
    return load_rows(out / "results.jsonl")


def test_shared_prefill_predictions_are_bit_identical(tmp_path):
    shared = _run(tmp_path / "shared", shared=True)
    alone = _run(tmp_path / "alone", shared=False)
    assert len(shared) == len(alone) == 2 * (1 + 5 * 2)
    assert all(r["error"] is None for r in shared + alone)
    by_key = {r["key"]: r for r in alone}
    for row in shared:
        other = by_key[row["key"]]
        assert row["prediction"] == other["prediction"], row["label"]
        assert row["budgets"] == other["budgets"]
        assert row["kl"] == pytest.approx(other["kl"], abs=1e-6)
    full = [r for r in shared if r["method"] == "full"]
    assert all(r["agreement"] == 1.0 and r["kl"] == pytest.approx(0, abs=1e-7) for r in full)


def test_shared_prefill_is_bit_identical_for_every_stage(tmp_path):
    """Lookahead (laq++), post-prefill + decode with merging (d2o), prune (one-pass asl and two-pass
    gemfilter: derived from the snapshot's hidden states when shared), profiled (baklava) and
    cascading (lava) methods, plus draft decoding across them."""
    methods = [
        "full", "laq++:window=4,kernel=3,steps=3,lookahead_window=4", "d2o", "asl:window=4,kernel=3,tau=1.5",
        "gemfilter:kernel=3", "baklava", "lava:window=4,kernel=3",
    ]  # fmt: skip
    shared = _run(tmp_path / "shared", shared=True, methods=methods, budgets=[24], limit=2)
    alone = _run(tmp_path / "alone", shared=False, methods=methods, budgets=[24], limit=2)
    assert len(shared) == len(alone) == 2 * len(methods)
    assert all(r["error"] is None for r in shared + alone)
    by_key = {r["key"]: r for r in alone}
    for row in shared:
        other = by_key[row["key"]]
        assert (row["prediction"], row["budgets"]) == (other["prediction"], other["budgets"]), row["label"]
        assert row["kl"] == pytest.approx(other["kl"], abs=1e-6)
    assert {r["selection_layer"] for r in shared if r["method"] == "asl"} == {1}  # tau > 1: cut at l_min
    assert all(r["selection_layer"] is not None for r in shared if r["method"] == "gemfilter")


def test_rerun_skips_finished_rows_and_report_renders(tmp_path):
    first = _run(tmp_path, budgets=[24])
    again = _run(tmp_path, budgets=[24])  # nothing new to do
    second = _run(tmp_path, budgets=[24, 48])  # one more budget: only its rows are new
    assert len(first) == len(again) == 2 * (1 + 5) and len(second) == 22
    assert len({r["key"] for r in second}) == 22
    report = write_report(tmp_path)
    text = report.read_text()
    assert "## needle_filler" in text and "| snapkv:window=4,kernel=3 |" in text
    assert (tmp_path / "needle_heatmaps.png").stat().st_size > 1000
    assert (tmp_path / "score_vs_budget_needle_filler.png").is_file()
    assert (tmp_path / "budget_maps.png").is_file()


def test_a_crashing_run_becomes_an_error_row_and_the_grid_goes_on(tmp_path, monkeypatch):
    calls = {"n": 0}
    original = SnapKV.compress_layer

    def flaky(self, obs, targets):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom in layer 0")
        return original(self, obs, targets)

    monkeypatch.setattr(SnapKV, "compress_layer", flaky)
    rows = _run(tmp_path, methods=["full", "snapkv:window=4,kernel=3"], budgets=[24], limit=2)
    errors = [r for r in rows if r["error"]]
    assert len(rows) == 4 and len(errors) == 1
    assert "RuntimeError: boom in layer 0" in errors[0]["error"]
    assert "Errors" in write_report(tmp_path).read_text()


def test_store_truncates_a_partial_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"key": "a"}) + "\n" + '{"key": "b", "predic')
    store = ResultStore(path)
    assert store.keys == {"a"}
    store.append({"key": "b"})
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()] == ["a", "b"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(path)
    tiny_tokenizer(True).save_pretrained(path)
    return path


@pytest.mark.slow  # a kill mid-run and a resume (soak-style): `-m "not slow"` leaves it out
def test_killed_eval_resumes_with_every_row_exactly_once(tmp_path, tiny_dir):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "kvbudget.cli", "eval", "--model", str(tiny_dir), "--out", str(out),
        "--tasks", "needle_filler", "--lengths", "160", "--budgets", "24,48", "--limit", "3", "--no-report",
        "--methods", "full,snapkv:window=4,kernel=3,tova,h2o",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = out / "results.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not results.exists() or len(results.read_text().splitlines()) < 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = len(load_rows(results))
    assert 4 <= partial < 21, "the run must be killed mid-grid"
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    rows = load_rows(results)
    assert len(rows) == 3 * (1 + 3 * 2) == 21
    assert len({r["key"] for r in rows}) == 21


# ------------------------------------------------------------------ compression ratios, `all`, suites, dtype


def test_ratio_budget_is_kvpress_formula_on_hand_values():
    # kvpress ScorerPress keeps max(1, int(k_len * (1 - compression_ratio))) tokens
    assert ratio_budget(0.75, 1000) == 250
    assert ratio_budget(0.875, 2049) == 256  # int(256.125)
    assert ratio_budget(0.25, 10) == 7  # int(7.5)
    assert ratio_budget(0.5, 3) == 1
    assert ratio_budget(0.9, 5) == 1  # int(0.4999…) = 0 → at least one entry
    assert ratio_budget(0.0, 17) == 17


def _old_budget_key(config: EvalConfig, task: str, sample, method: str, options: dict, budget) -> str:
    """The row key as written before ratios existed (hash of the same fields, by hand)."""

    def sha(obj) -> str:
        blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    return sha(
        {
            "model": config.model, "task": task, "context": sha({"c": sample.context}),
            "question": sample.question, "prefix": sample.answer_prefix, "max_new": sample.max_new_tokens,
            "method": method,
            "options": tuple(options.items()), "budget": budget, "agnostic": config.compress_context_only,
            "dtype": config.dtype,
        }
    )  # fmt: skip


def test_ratio_rows_resume_and_a_new_ratio_adds_only_its_rows(tmp_path):
    methods = ["full", "snapkv:window=4,kernel=3", "tova"]
    first = _run(tmp_path, methods=methods, budgets=[], compression_ratios=[0.5])
    again = _run(tmp_path, methods=methods, budgets=[], compression_ratios=[0.5])
    assert len(first) == len(again) == 2 * (1 + 2)
    more = _run(tmp_path, methods=methods, budgets=[], compression_ratios=[0.5, 0.75])
    assert len(more) == 2 * (1 + 2 * 2) and len({r["key"] for r in more}) == 10
    assert [r["key"] for r in more[:6]] == [r["key"] for r in first]  # the first rows untouched
    ratio_rows = [r for r in more if r["method"] != "full"]
    assert {r["compression_ratio"] for r in ratio_rows} == {0.5, 0.75}
    for row in ratio_rows:
        assert row["error"] is None
        assert row["budget"] == max(1, int(row["prompt_tokens"] * (1 - row["compression_ratio"])))
    snap = [r for r in ratio_rows if r["method"] == "snapkv"]
    assert all({n for layer in r["budgets"] for n in layer} == {r["budget"]} for r in snap)
    full = [r for r in more if r["method"] == "full"]
    assert all(r["compression_ratio"] is None and r["budget"] is None for r in full)

    # budgets beside the ratios: only the budget rows are new, keyed as before ratios existed
    both = _run(tmp_path, methods=methods, budgets=[24], compression_ratios=[0.5, 0.75])
    budget_rows = [r for r in both if r["compression_ratio"] is None and r["method"] != "full"]
    assert len(both) == 10 + 2 * 2 and len(budget_rows) == 4
    config = _config(methods=methods, budgets=[24])
    runner = Runner(config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(True), progress=False)
    samples = {index: sample for _, _, index, sample in runner.samples()}
    for row in budget_rows:
        expected = _old_budget_key(
            config, row["task"], samples[row["sample"]], row["method"], row["options"], 24
        )
        assert row["key"] == expected
    text = write_report(tmp_path).read_text()
    assert "| B=24 | r=0.5 | r=0.75 |" in text


@pytest.mark.parametrize("ratio", [1.0, 1.5, -0.25])
def test_a_bad_ratio_is_a_one_line_error(ratio, tmp_path):
    with pytest.raises(BudgetError) as info:
        Runner(_config(compression_ratios=[ratio]), tmp_path, progress=False)  # before any model loads
    assert "compression ratio must be in [0, 1)" in str(info.value) and "\n" not in str(info.value)
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path), "--compression-ratios", f"0.5,{ratio}"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"error: {info.value}"]


def test_cli_ratio_parsing_and_missing_budgets_are_one_line_errors(tmp_path):
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path), "--compression-ratios", "half"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["error: --compression-ratios expects numbers, got ['half']"]
    with pytest.raises(BudgetError, match="no budgets"):
        Runner(_config(budgets=[], compression_ratios=[]), tmp_path, progress=False)


def test_methods_all_expands_to_every_registered_method(tmp_path):
    runner = Runner(
        _config(methods=["full", "all", "snapkv:window=4,kernel=3"]), tmp_path, model=tiny_model(),
        tokenizer=tiny_tokenizer(True), progress=False,
    )  # fmt: skip
    assert runner.config.methods == [*REGISTRY, "snapkv:window=4,kernel=3"]  # full once, in registry order
    assert [s.label for s in runner.specs] == runner.config.methods
    assert len(runner.runs()) == 1 + (len(REGISTRY) - 1 + 1) * 2  # full once; the rest at both budgets


def test_leaderboard_suite_is_the_issue_grid():
    config = suite("leaderboard")
    assert (config.model, config.dtype, config.limit) == ("qwen2.5-coder-0.5b", "bfloat16", 20)
    assert config.lengths == [2048] and config.methods == ["all"]
    assert sorted(config.compression_ratios) == [0.25, 0.5, 0.75, 0.875] and config.budgets == []
    assert set(LEADERBOARD_CORE_TASKS) < set(config.tasks)
    planned = [r for ratios, _ in LEADERBOARD_PLAN for r in ratios]  # each ratio once, 0.875 first
    assert planned[0] == 0.875 and sorted(planned) == sorted(config.compression_ratios)
    assert LEADERBOARD_PLAN[0][1] is None  # 0.875 on every task
    for _, tasks in LEADERBOARD_PLAN[1:]:
        assert tasks and set(tasks) <= set(LEADERBOARD_CORE_TASKS)
    families = {get_task(t).family for t in config.tasks}  # every task is registered
    assert families == {"needle", "ruler", "infinitebench", "code"}
    ruler = {"niah_single_1", "niah_multikey_2", "niah_multivalue", "vt", "fwe"}
    assert {"needle", "kv_retrieval", "passkey", "lcc"} | ruler <= set(config.tasks)
    config.budgets.append(512)  # a fresh grid each call
    assert suite("leaderboard").budgets == []
    with pytest.raises(KVBudgetError, match="expected one of smoke, demo, standard, leaderboard"):
        suite("huge")


def test_demo_runs_in_the_dtype_asked(tmp_path, monkeypatch):
    seen = {}

    def fake_load(name, dtype="float32"):
        seen["dtype"] = dtype
        return tiny_model().to(getattr(torch, dtype)), tiny_tokenizer(True)

    monkeypatch.setattr(demo, "load_model", fake_load)
    report = demo.run_demo(model="tiny", length=300, out=tmp_path, console=Console(quiet=True), dtype="bf16")
    assert seen["dtype"] == "bfloat16"
    assert "`tiny` (bfloat16)" in report.read_text() and "--dtype bfloat16" in report.read_text()
    result = CliRunner().invoke(app, ["demo", "--dtype", "float8", "--out", str(tmp_path)])
    assert result.exit_code == 2 and result.stderr.strip().startswith("error: unsupported dtype 'float8'")
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_committed_gzip_archive_is_read_and_resumed(tmp_path):
    import gzip

    from kvbudget.eval.store import ResultStore, load_rows

    rows = [{"key": "a", "score": 1.0}, {"key": "b", "score": 0.0}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "results.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert load_rows(tmp_path / "results.jsonl") == rows
    store = ResultStore(tmp_path / "results.jsonl")
    assert store.keys == {"a", "b"}
    store.append({"key": "c", "score": 0.5})
    assert [r["key"] for r in load_rows(tmp_path / "results.jsonl")] == ["a", "b", "c"]


def test_the_sample_guard_wraps_each_sample_and_nothing_else(tmp_path):
    events: list[str] = []

    @contextlib.contextmanager
    def guard():
        events.append("enter")
        yield
        events.append("exit")

    runner = Runner(
        _config(limit=3), tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(True), progress=False,
        sample_guard=guard,
    )  # fmt: skip
    runner.run()
    assert events == ["enter", "exit"] * 3  # one turn per sample
    events.clear()
    Runner(
        _config(limit=3), tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(True), progress=False,
        sample_guard=guard,
    ).run()  # fmt: skip
    assert events == []  # a finished sample is skipped without taking a turn
