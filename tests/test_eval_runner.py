"""The evaluation runner: shared prefill equals per-run prefill, resume, kill-safety, error rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_model, tiny_tokenizer
from kvbudget.eval.report import write_report
from kvbudget.eval.runner import EvalConfig, Runner
from kvbudget.eval.store import ResultStore, load_rows
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
    original = SnapKV.compress

    def flaky(self, obs, targets):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom in layer 0")
        return original(self, obs, targets)

    monkeypatch.setattr(SnapKV, "compress", flaky)
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
