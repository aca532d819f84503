"""``kvbudget tune`` on a local Ray cluster (2 CPUs; a tiny random model saved to a folder so the
worker processes can load it): the stored grid and best point equal a local search's on the same
grid, a Ray search resumes a local one's entry, and ``--workers`` without Ray is a one-line error."""

from __future__ import annotations

import shutil
import sys

import pytest
import ray
import torch
from typer.testing import CliRunner

from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.cli import app
from kvbudget.eval.distributed import RayOptions
from kvbudget.models import load_model
from kvbudget.profiles import build_profile, load_profile, prompt_from_spec, save_profile
from kvbudget.tuning import tune

LENGTH, RATIO, CHUNK = 96, 0.25, 16


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBUDGET_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(path)
    tiny_tokenizer(True).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _texts() -> list[torch.Tensor]:
    return [torch.randint(3, 90, (1, LENGTH), generator=seeded(s)) for s in (5, 6)]


def _local(model, path, grid) -> dict:
    """A local search on one torch thread (the workers' count), so the sums run the same way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tune(
            model, None, path, "baklava", RATIO, length=LENGTH, grid=grid, texts=_texts(), chunk=CHUNK,
            progress=False,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _on_ray(model, tiny_dir, path, grid) -> dict:
    return tune(
        model, None, path, "baklava", RATIO, length=LENGTH, grid=grid, texts=_texts(), chunk=CHUNK,
        progress=False, distributed=RayOptions(workers=2), model_source=str(tiny_dir),
    )  # fmt: skip


def test_a_ray_tune_stores_the_local_tunes_grid_and_best_point_and_resumes_it(tmp_path, tiny_dir, cluster):
    model, tokenizer = load_model(tiny_dir)
    profile = build_profile(model, [prompt_from_spec("builtin-text:120", tokenizer)])
    profile.tuned = {"squeezeattention": {"0.25": {"best": {"p": 0.7}}}}  # BaKlaVa's layer split
    local_path = save_profile(profile, tmp_path / "local.json")
    importance = profile.importance().reshape(-1)  # thresholds inside the model's range: points differ
    ts = [round(float(torch.quantile(importance, q)), 6) for q in (0.25, 0.75)]
    grid = {"t": ts, "r": [0.2, 0.8]}
    ray_path = tmp_path / "ray.json"
    shutil.copy(local_path, ray_path)
    half_path = tmp_path / "half.json"
    shutil.copy(local_path, half_path)

    local = _local(model, local_path, grid)
    distributed = _on_ray(model, tiny_dir, ray_path, grid)
    assert local["complete"] and len(local["grid"]) == 4
    assert len({row["nll"] for row in local["grid"]}) > 1, "the grid points must differ for the test to bite"
    stored_local = load_profile(local_path, model).tuned["baklava"]["0.25"]
    stored_ray = load_profile(ray_path, model).tuned["baklava"]["0.25"]
    assert stored_ray == stored_local == distributed
    expected = [{"t": t, "r": r} for t in grid["t"] for r in grid["r"]]
    assert [{k: row[k] for k in ("t", "r")} for row in stored_ray["grid"]] == expected  # grid order

    # a local search of half the grid, finished on Ray: only the missing points are measured (a
    # marker put on a stored point survives), and the entry is the whole local search's
    _local(model, half_path, {"t": ts[:1], "r": grid["r"]})
    half = load_profile(half_path, model)
    assert len(half.tuned["baklava"]["0.25"]["grid"]) == 2
    half.tuned["baklava"]["0.25"]["grid"][0]["perplexity"] = -1.0
    save_profile(half, half_path)
    resumed = _on_ray(model, tiny_dir, half_path, grid)
    assert resumed["grid"][0]["perplexity"] == -1.0
    resumed["grid"][0]["perplexity"] = stored_local["grid"][0]["perplexity"]  # best may be this row
    assert resumed == stored_local


def test_tune_workers_without_ray_is_a_one_line_error(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    args = ["tune", "--ratio", "0.25", "--model", str(tiny_dir), "--workers", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "pip install 'kvbudget[ray]'" in lines[0]
    assert not (tmp_path / "home" / "profiles").exists()  # stopped before any model or profile


def test_a_tuning_workers_profile_file_is_gone_when_its_run_returns(tmp_path, tiny_dir, monkeypatch):
    """A Ray actor killed by ``ray.kill`` runs no finalizer: the worker's copy of the profile must not
    outlive the run that needs it (folders of it had piled up in /tmp)."""
    from kvbudget.tuning import PerplexityWorker

    model, tokenizer = load_model(tiny_dir)
    profile = build_profile(model, [prompt_from_spec("builtin-text:120", tokenizer)])
    profile.tuned = {"squeezeattention": {"0.25": {"best": {"p": 0.7}}}}
    profile_json = save_profile(profile, tmp_path / "p.json").read_text(encoding="utf-8")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    worker = PerplexityWorker(str(tiny_dir), "float32", "cpu", 1, profile_json)
    assert list(scratch.iterdir()) == []  # nothing written before a run
    config = {"method": "baklava", "budget": None, "chunk": CHUNK, "ratio": RATIO}
    nll, tokens = worker.run(config, {"t": 0.0, "r": 0.5}, _texts()[0][0].tolist())
    assert tokens > 0 and torch.isfinite(torch.tensor(nll))
    assert list(scratch.iterdir()) == []
