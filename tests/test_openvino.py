"""The OpenVINO GenAI anchor of ``bench serve`` without OpenVINO: the runner's sizing of the KV pool
and of its cache eviction, its argument checks, and the rows ``bench serve`` makes of its JSON.
(The runner itself runs only in ``.venv-ov``: ``make ov``; docs/serving.md has its figures.)"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys

import pytest

from kvbudget.bench.serve_load import ServeBenchConfig, markdown, openvino_rows
from kvbudget.errors import KVBudgetError
from kvbudget.peer.openvino import check_environment, runner_script


def _runner():
    spec = importlib.util.spec_from_file_location("openvino_runner", runner_script())
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_runner_imports_no_kvbudget_module_and_nothing_of_openvino_at_load() -> None:
    before = set(sys.modules)
    _runner()
    loaded = set(sys.modules) - before
    assert not {m for m in loaded if m.split(".")[0] in {"kvbudget", "openvino", "openvino_genai"}}
    imported = set()
    for node in ast.walk(ast.parse(runner_script().read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "kvbudget" not in imported and {"openvino", "openvino_genai"} <= imported


def test_kv_bytes_per_token_from_the_config(tmp_path) -> None:
    config = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "hidden_size": 896}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    runner = _runner()
    assert runner.kv_bytes_per_token(tmp_path, "bf16") == 2 * 24 * 2 * 64 * 2  # Qwen2.5-0.5B: 12 KiB
    assert runner.kv_bytes_per_token(tmp_path, "f32") == 2 * 24 * 2 * 64 * 4


def test_eviction_keeps_the_fraction_of_the_longest_prompt_in_whole_blocks() -> None:
    sizes = _runner().eviction_sizes
    # 0.125 of 2093 tokens is 261.6: the nearest whole number of 32-token blocks is 256
    assert sizes(0.125, 2093, 32, 32) == {"start_size": 32, "recent_size": 32, "snapkv_window_size": 32,
                                          "max_cache_size": 256}  # fmt: skip
    assert sizes(0.125, 8285, 32, 32)["max_cache_size"] == 1024
    assert sizes(0.125, 8285, 32, 64)["recent_size"] == 64
    # never below start + recent + one evictable block
    assert sizes(0.01, 1000, 32, 32)["max_cache_size"] == 96
    with pytest.raises(ValueError, match="--keep-fraction must be in \\(0, 1\\], got 0"):
        sizes(0.0, 1000, 32, 32)


def test_the_runner_refuses_an_unknown_mode_before_loading_openvino(capsys) -> None:
    with pytest.raises(SystemExit):
        _runner().main(["--model", "m", "--prompts", "p", "--cap-bytes", "1", "--modes", "full,snap"])
    assert "--modes takes full, eviction, got 'full,snap'" in capsys.readouterr().err


def _document() -> dict:
    """What the runner wrote for the pilot (two needle prompts), one request of the eviction run
    turned into one the pipeline ignored."""
    requests = [
        {"id": 0, "token_ids": [1, 2], "status": "FINISHED", "ttft_s": 14.0, "tpot_s": 1.5},
        {"id": 1, "token_ids": [3], "status": "FINISHED", "ttft_s": 27.0, "tpot_s": None},
    ]
    ignored = {"id": 1, "token_ids": [], "status": "IGNORED", "ttft_s": None, "tpot_s": None,
               "error": "the pipeline answered IGNORED (the KV pool could not hold it)"}  # fmt: skip
    common = {"num_kv_blocks": 139, "block_size": 32, "kv_bytes_per_token": 12288, "pool_bytes": 54657024,
              "steps": 26, "load_s": 2.0}  # fmt: skip
    eviction = {"start_size": 32, "recent_size": 32, "snapkv_window_size": 32, "max_cache_size": 256}
    return {
        "versions": {"openvino": "2026.4.1", "openvino_genai": "2026.4.1.0"}, "device": "CPU",
        "kv_precision": "bf16", "inference_precision": "bf16", "cap_bytes": 54951936,
        "runs": [
            {"mode": "full", **common, "cache_eviction": None, "aggregation": None, "requests": requests,
             "wall_s": 30.0, "tokens": 3, "held_at_once": 2, "peak_cache_usage": 95.0,
             "peak_kv_bytes": 51904511},
            {"mode": "eviction", **common, "cache_eviction": eviction, "aggregation": "NORM_SUM",
             "requests": [requests[0], ignored], "wall_s": 20.0, "tokens": 2, "held_at_once": 1,
             "peak_cache_usage": 58.0, "peak_kv_bytes": 31850495},
        ],
    }  # fmt: skip


def test_openvino_rows_score_what_finished_and_report_what_was_ignored() -> None:
    answers = {0: ["12"], 1: ["3"]}
    full, evicted = openvino_rows(
        _document(), answers, lambda ids: "".join(map(str, ids)), lambda text, ans: float(text in ans)
    )
    assert full["compression"] == "openvino (full)" and evicted["compression"] == "openvino (eviction)"
    assert full["answered"] == 2 and full["errors"] == [] and full["accuracy"] == 1.0
    assert full["tokens"] == 3 and full["tokens_per_s"] == pytest.approx(0.1)
    assert full["held_at_once"] == 2 and full["peak_kv_bytes"] == 51904511 and full["cap_bytes"] == 54951936
    assert full["ttft_p50_s"] == 14.0 and full["ttft_p99_s"] == 27.0 and full["tpot_p50_s"] == 1.5
    assert full["decode_tokens_per_s"] is None
    assert evicted["answered"] == 1 and evicted["accuracy"] == 1.0
    assert evicted["errors"] == ["the pipeline answered IGNORED (the KV pool could not hold it)"]
    assert "max_cache_size" not in full["note"]
    assert "keeping 256 tokens per sequence (start 32, recent 32), NORM_SUM" in evicted["note"]


def test_the_table_shows_the_openvino_rows_and_what_they_ran() -> None:
    rows = openvino_rows(_document(), {0: ["12"], 1: ["3"]}, lambda ids: "", lambda text, ans: 0.0)
    table = markdown(ServeBenchConfig(length=2048, requests=2, clients=2), 54951936, rows)
    assert "| openvino (full) | 2 |" in table and "| openvino (eviction) | 1 |" in table
    note = "openvino (full): OpenVINO GenAI 2026.4.1.0 ContinuousBatchingPipeline on CPU, KV pool of 139 "
    assert note in table


def test_check_environment_names_what_is_missing(tmp_path) -> None:
    with pytest.raises(KVBudgetError, match="no OpenVINO environment at .*: run `make ov` first"):
        check_environment(tmp_path / "python", tmp_path, "m")
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    with pytest.raises(KVBudgetError, match="--openvino-model is needed: m is not a registry model"):
        check_environment(python, None, "m")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(KVBudgetError, match="export openvino --model .*hf --task text-generation-with-past"):
        check_environment(python, tmp_path / "ir", str(hf))
