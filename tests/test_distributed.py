"""Distributed evaluation on a local Ray cluster (2 CPUs; a tiny random model saved to a folder so
the worker processes can load it): the Ray run's rows equal the local runner's and each resumes the
other's file; a worker killed mid-run, a driver killed mid-run, a sample that always fails; the
one-line error when Ray is missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from typer.testing import CliRunner

from conftest import tiny_model, tiny_tokenizer
from kvbudget.cli import app
from kvbudget.errors import KVBudgetError
from kvbudget.eval.distributed import RayEval, RayOptions, require_ray, run_eval_distributed
from kvbudget.eval.runner import EvalConfig, Runner, run_eval
from kvbudget.eval.store import load_rows
from kvbudget.models import load_model

METHODS = ["full", "snapkv:window=4,kernel=3", "tova", "h2o"]
RUNS_PER_SAMPLE = 1 + 3 * 2  # full once, three methods at two budgets
#: fields that are wall times (they differ between any two runs)
TIMINGS = {"ttft_s", "prefill_s", "compress_s", "lookahead_s", "reselect_s", "tpot_s", "time"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(path)
    tiny_tokenizer(True).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs for the module; its address lets a separate driver join it."""
    info = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield info.address_info["address"]
    ray.shutdown()


def _config(tiny_dir: Path, limit: int, length: int = 160) -> EvalConfig:
    return EvalConfig(
        model=str(tiny_dir), tasks=["needle_filler"], lengths=[length], methods=METHODS, budgets=[24, 48],
        limit=limit,
    )  # fmt: skip


def _by_key(path: Path) -> dict[str, dict]:
    rows = load_rows(path / "results.jsonl")
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)), "a row was written twice"
    return {r["key"]: r for r in rows}


def _same_rows(ours: dict[str, dict], theirs: dict[str, dict]) -> None:
    """Equal rows, timings aside (the KL to 1e-6: the actors run one torch thread, the test two)."""
    assert ours.keys() == theirs.keys()
    for key, row in ours.items():
        other = theirs[key]
        assert row.keys() == other.keys()
        for field, value in row.items():
            if field in TIMINGS:
                continue
            if field == "kl" and value is not None:
                assert value == pytest.approx(other[field], abs=1e-6), (row["label"], field)
            else:
                assert value == other[field], (row["label"], row["budget"], field)


def test_ray_rows_equal_the_local_runner_and_each_resumes_the_other(tmp_path, tiny_dir, cluster):
    local = tmp_path / "local"
    run_eval(_config(tiny_dir, limit=4), local, progress=False)
    distributed = tmp_path / "ray"
    run_eval_distributed(_config(tiny_dir, limit=4), distributed, RayOptions(workers=2), progress=False)
    ours, theirs = _by_key(distributed), _by_key(local)
    assert len(ours) == 4 * RUNS_PER_SAMPLE and all(r["error"] is None for r in ours.values())
    _same_rows(ours, theirs)
    assert {r["prediction"] for r in ours.values()} != {""}  # the tiny model does answer something

    # a local file with one budget, grown to two by Ray (only the new budget's rows are added),
    # then rerun locally: nothing is left to add
    mixed = tmp_path / "mixed"
    one_budget = _config(tiny_dir, limit=4)
    one_budget.budgets = [24]
    run_eval(one_budget, mixed, progress=False)
    first = load_rows(mixed / "results.jsonl")
    run_eval_distributed(_config(tiny_dir, limit=4), mixed, RayOptions(workers=2), progress=False)
    grown = load_rows(mixed / "results.jsonl")
    assert grown[: len(first)] == first and len(grown) == len(first) + 4 * 3
    assert {r["budget"] for r in grown[len(first) :]} == {48}
    run_eval(_config(tiny_dir, limit=4), mixed, progress=False)
    assert load_rows(mixed / "results.jsonl") == grown
    _same_rows(_by_key(mixed), theirs)


@pytest.mark.slow  # a kill mid-run and a resume (soak-style): `-m "not slow"` leaves it out
def test_a_worker_killed_mid_run_gives_every_row_exactly_once(tmp_path, tiny_dir, cluster):
    out = tmp_path / "run"
    evaluation = RayEval(_config(tiny_dir, limit=8), out, RayOptions(workers=2), progress=False)
    failure: list[BaseException] = []

    def drive() -> None:
        try:
            evaluation.run()
        except BaseException as err:  # reported by the assertion below
            failure.append(err)

    thread = threading.Thread(target=drive)
    thread.start()
    results = out / "results.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not results.exists() or not results.read_text()):
        time.sleep(0.01)
    written = len(load_rows(results))
    victim = evaluation.workers[0]
    ray.kill(victim)  # mid-run: the queue still holds samples, so it had one in flight or next
    thread.join(timeout=180)
    assert not thread.is_alive() and not failure, failure
    assert 0 < written < 8 * RUNS_PER_SAMPLE, "the worker must be killed mid-grid"
    assert evaluation.retried >= 1 and evaluation.replaced >= 1
    rows = _by_key(out)
    assert len(rows) == 8 * RUNS_PER_SAMPLE
    assert all(r["error"] is None for r in rows.values())
    assert sorted({r["sample"] for r in rows.values()}) == list(range(8))


@pytest.mark.slow  # a kill mid-run and a resume (soak-style): `-m "not slow"` leaves it out
def test_a_killed_driver_resumes_without_duplicates(tmp_path, tiny_dir, cluster):
    """A separate driver joins the cluster (``--ray-address``); it is killed once rows arrive and
    the same command, rerun, adds exactly the missing rows."""
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "kvbudget.cli", "eval", "--model", str(tiny_dir), "--out", str(out),
        "--tasks", "needle_filler", "--lengths", "320", "--budgets", "24,48", "--limit", "5",
        "--methods", ",".join(METHODS), "--no-report", "--ray-address", cluster, "--workers", "2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = out / "results.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not results.exists() or not results.read_text()):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = load_rows(results)
    assert 0 < len(partial) < 5 * RUNS_PER_SAMPLE, "the driver must be killed mid-grid"
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    rows = load_rows(results)
    assert rows[: len(partial)] == partial
    assert len(rows) == len({r["key"] for r in rows}) == 5 * RUNS_PER_SAMPLE
    assert json.loads((out / "config.json").read_text())["limit"] == 5


def test_a_sample_that_always_fails_gives_error_rows_and_the_run_goes_on(
    tmp_path, tiny_dir, cluster, monkeypatch
):
    original = Runner.samples

    def one_broken(self):  # sample 1 has no text: its prompt cannot be built, wherever it runs
        for task, length, index, sample in original(self):
            if index == 1:
                sample.context = ""
            yield task, length, index, sample

    monkeypatch.setattr(Runner, "samples", one_broken)
    evaluation = RayEval(_config(tiny_dir, limit=3), tmp_path / "ray", RayOptions(workers=2), progress=False)
    evaluation.run()
    run_eval(_config(tiny_dir, limit=3), tmp_path / "local", progress=False)
    rows = _by_key(tmp_path / "ray")
    assert len(rows) == 3 * RUNS_PER_SAMPLE
    broken = [r for r in rows.values() if r["sample"] == 1]
    assert len(broken) == RUNS_PER_SAMPLE
    assert all("InputError: context is empty" in r["error"] and r["score"] is None for r in broken)
    assert all(r["error"] is None for r in rows.values() if r["sample"] != 1)
    assert evaluation.retried == 0  # a sample's own failure is not a worker fault
    _same_rows(rows, _by_key(tmp_path / "local"))  # the same error rows as the local runner's


def test_workers_without_ray_is_a_one_line_error(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(KVBudgetError, match=r"kvbudget\[ray\]"):
        require_ray()
    args = ["eval", "--model", str(tiny_dir), "--out", str(tmp_path / "run"), "--workers", "2", "--no-report"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "pip install 'kvbudget[ray]'" in lines[0]
    assert not (tmp_path / "run" / "results.jsonl").exists()
    code = "import sys; sys.modules['ray'] = None; import kvbudget, kvbudget.cli, kvbudget.eval.distributed"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_bad_ray_options_are_one_line_errors():
    for options, message in [
        (RayOptions(workers=0), "--workers must be at least 1"),
        (RayOptions(threads_per_worker=0), "--threads-per-worker must be at least 1"),
        (RayOptions(gpus_per_worker=-1), "--gpus-per-worker must be 0 or more"),
        (RayOptions(device="cuda"), "--device cuda needs --gpus-per-worker"),
    ]:
        with pytest.raises(KVBudgetError, match=message):
            options.validate()


def test_load_model_device_auto_follows_the_machine(tiny_dir):
    model, _ = load_model(tiny_dir, device="auto")
    assert model.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(KVBudgetError, match="device"):
        load_model(tiny_dir, device="tpu-please")
