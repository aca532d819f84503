"""lab/scripts/leaderboard_run.py refuses, before any row, a kvzap whose model has no trained
surrogate (kvzap alone would fall back to one fitted on the bundled prompts, and the leaderboard's
rows would not say which)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from conftest import tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "lab" / "scripts" / "leaderboard_run.py"


def _load():
    spec = importlib.util.spec_from_file_location("leaderboard_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kvzap_rows_need_the_models_trained_surrogate(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVBUDGET_HOME", str(tmp_path / "home"))
    script, model = _load(), tiny_model("llama", seed=1)
    problem = script.missing_surrogate(["snapkv", "kvzap:kind=linear"], model)
    assert problem is not None and problem.startswith("kvzap:kind=linear: no trained linear KVzap surrogate")
    assert "\n" not in problem and "kvbudget train kvzap" in problem
    assert script.missing_surrogate(["snapkv", "kvzip+"], model) is None

    from kvbudget.methods.kvzap_surrogate import default_surrogate_path

    trained = default_surrogate_path(model, "linear")
    trained.parent.mkdir(parents=True)
    trained.write_bytes(b"")  # only its presence is checked here; kvzap loads and checks it
    assert script.missing_surrogate(["kvzap:kind=linear"], model) is None
    assert script.missing_surrogate(["kvzap"], model).startswith("kvzap: ")  # the MLP is still missing
    assert script.missing_surrogate([f"kvzap:surrogate={tmp_path / 'any.safetensors'}"], model) is None
