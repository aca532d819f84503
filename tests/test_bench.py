"""Benchmark plumbing: memory high-water mark, bandwidth bound, aggregation, targets, report."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from conftest import TINY, config_only_model
from kvbudget.bench import memory
from kvbudget.bench.bandwidth import decode_bound_s, measure_bandwidth, weight_bytes
from kvbudget.bench.grid import BenchConfig, aggregate, run_key, run_worker
from kvbudget.bench.measure import MeasureSpec, measure
from kvbudget.bench.report import bound_lines, markdown, targets, write_bench_report
from kvbudget.cli import app
from kvbudget.errors import KVBudgetError


@pytest.mark.skipif(not memory.reset_peak(), reason="peak RSS cannot be reset on this OS")
def test_peak_rss_reset_sees_only_later_allocations() -> None:
    big = np.ones(40_000_000)  # 320 MB, touched
    del big
    assert memory.reset_peak()
    before = memory.current_rss_bytes()
    assert memory.peak_rss_bytes() < before + 100_000_000  # the freed 320 MB no longer counts
    block = np.ones(20_000_000)  # 160 MB
    grown = memory.peak_rss_bytes() - before
    assert 150_000_000 < grown < 250_000_000
    del block


def test_weight_bytes_counts_a_tied_embedding_once() -> None:
    untied = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    tied = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    embedding = TINY["vocab_size"] * TINY["hidden_size"] * 4
    assert weight_bytes(untied) == sum(p.numel() * 4 for p in untied.state_dict().values())
    assert weight_bytes(tied) == weight_bytes(untied) - embedding


def test_bandwidth_is_measured_and_bounds_decode() -> None:
    bw = measure_bandwidth(size_bytes=32 << 20, repeats=2)
    assert bw.copy > 1e8 and bw.read > 1e8  # any machine moves more than 100 MB/s
    assert bw.size_bytes == 32 << 20 and bw.threads == torch.get_num_threads()
    assert decode_bound_s(600, 400, 1000.0) == pytest.approx(1.0)


def _run(method: str, length: int, budget: int, repeat: int, tpot: float, **extra) -> dict:
    row = {
        "method": method, "length": length, "budget": budget, "repeat": repeat, "prompt_tokens": length + 40,
        "ttft_s": 2.0 + repeat, "tpot_s": tpot, "compress_s": 0.01 * (repeat + 1), "prefill_s": 1.0,
        "peak_rss_bytes": 1000 + repeat, "kv_peak_bytes": 500, "logical_bytes": 100, "physical_bytes": 120,
        "decode_kv_bytes": 200, "weight_bytes": 800,
    }  # fmt: skip
    return {**row, **extra}


def test_aggregate_takes_medians_spreads_and_the_bound() -> None:
    runs = [_run("snapkv", 1024, 64, r, t) for r, t in enumerate([0.03, 0.01, 0.02])]
    runs += [_run("full", 1024, 64, r, 0.05) for r in range(2)]
    runs.append({"method": "snapkv", "length": 1024, "budget": 64, "error": "boom"})
    rows = {r["method"]: r for r in aggregate(runs, bandwidth=1e5)}
    snap = rows["snapkv"]
    assert snap["repeats"] == 3
    assert snap["tpot_s"] == 0.02 and snap["tpot_s_spread"] == [0.01, 0.03]
    assert snap["ttft_s"] == statistics.median([2.0, 3.0, 4.0])
    assert snap["compress_overhead"] == pytest.approx(0.02)
    assert snap["tpot_bound_s"] == pytest.approx((800 + 200) / 1e5)
    assert snap["peak_rss_bytes"] == 1001
    assert rows["full"]["budget"] is None and rows["full"]["repeats"] == 2


def test_targets_report_ratios_and_verdicts() -> None:
    runs = [
        _run("full", 8192, 256, 0, 0.10, peak_rss_bytes=2000, kv_peak_bytes=800),
        _run("snapkv", 8192, 256, 0, 0.05),
        _run("lava", 8192, 256, 0, 0.07, peak_rss_bytes=1500, kv_peak_bytes=100),
        _run("snapkv", 4096, 256, 0, 0.05, compress_s=0.05, prefill_s=1.0),
        _run("ada-snapkv", 4096, 256, 0, 0.05, compress_s=0.01, prefill_s=1.0),
    ]
    checks = {t: (m, v) for t, m, v in targets(aggregate(runs, bandwidth=None))}
    assert checks["compression ≤ 3% of prefill: snapkv @256, 4096 tokens"] == ("5.0%", "missed")
    assert checks["compression ≤ 3% of prefill: ada-snapkv @256, 4096 tokens"] == ("1.0%", "met")
    assert checks["TPOT ≤ 0.6 × full: snapkv @256, 8192 tokens"] == ("0.50", "met")
    assert checks["TPOT ≤ 0.6 × full: lava @256, 8192 tokens"] == ("0.70", "missed")
    measured, verdict = checks["peak memory below full: lava @256, 8192 tokens"]
    assert measured.startswith("RSS 0.750") and verdict == "met"


def test_batched_runs_aggregate_and_report_apart_from_single_rows() -> None:
    runs = [
        _run("full", 8192, 256, 0, 0.10),
        _run("snapkv", 8192, 256, 0, 0.07),
        {**_run("full", 8192, 256, 0, 0.40), "batch": 4},
        {**_run("snapkv", 8192, 256, 0, 0.12), "batch": 4},
    ]
    rows = aggregate(runs, bandwidth=None)
    assert sorted((r["method"], r["batch"], r["tpot_s"]) for r in rows) == [
        ("full", 1, 0.10), ("full", 4, 0.40), ("snapkv", 1, 0.07), ("snapkv", 4, 0.12),
    ]  # fmt: skip
    checks = {t: (m, v) for t, m, v in targets(rows)}
    assert checks["TPOT ≤ 0.6 × full: snapkv @256, 8192 tokens"] == ("0.70", "missed")
    assert checks["TPOT ≤ 0.6 × full: snapkv @256, 8192 tokens, batch 4"] == ("0.30", "met")
    bounded = aggregate(runs, bandwidth=1e5)
    series = {f"{r['method']} ×{r['batch']}": [r] for r in bounded}
    assert [(label, xs) for label, xs, _ in bound_lines(series)] == [
        ("full ×1: bandwidth bound", [8192]), ("full ×4: bandwidth bound", [8192]),
    ]  # fmt: skip
    one = asdict(MeasureSpec())
    del one["batch"]  # a run recorded before `batch` existed is a batch of 1
    assert run_key({**one, "batch": 4}) != run_key(one) == run_key(MeasureSpec())


def test_report_writes_a_table_and_two_plots(tmp_path: Path) -> None:
    runs = [_run(m, n, 64, 0, 0.01 * n / 1024) for m in ("full", "snapkv") for n in (1024, 2048)]
    result = {
        "machine": {"bandwidth": {"copy": 2e10, "read": 1e10, "size_bytes": 1 << 30, "threads": 1}},
        "config": {"model": "m", "dtype": "float32", "new_tokens": 64, "repeats": 1, "threads": 1},
        "rows": aggregate(runs, bandwidth=2e10),
    }
    text = markdown(result)
    assert "| snapkv @64 | 2048 |" in text and "| full | 1024 |" in text
    assert "copy 20.0 GB/s" in text
    write_bench_report(result, tmp_path)
    assert (tmp_path / "bench.md").read_text() == text
    for name in ("time_vs_length.png", "memory_vs_length.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_bench_config_measures_full_once_per_length_and_validates() -> None:
    config = BenchConfig(methods=["full", "snapkv"], budgets=[64, 128], lengths=[512, 1024], repeats=2)
    specs = config.specs()
    assert len(specs) == 2 * (2 + 2 * 2)
    assert {s.budget for s in specs if s.method == "full"} == {128}
    per_length = [[(s.repeat, s.method, s.budget) for s in specs if s.length == n] for n in (512, 1024)]
    assert [s.length for s in specs] == [512] * 6 + [1024] * 6
    for runs in per_length:  # repeat by repeat: each repeat measures every (method, budget) once
        assert [r for r, _, _ in runs] == [0] * 3 + [1] * 3
        assert runs[:3] == [(0, "full", 128), (0, "snapkv", 64), (0, "snapkv", 128)]
    assert {s.batch for s in BenchConfig(batch=3).specs()} == {3}
    bad_configs = [BenchConfig(budgets=[0]), BenchConfig(repeats=0), BenchConfig(methods=["nope"])]
    for bad in [*bad_configs, BenchConfig(batch=0)]:
        with pytest.raises(KVBudgetError):
            bad.validate()


def test_cli_bench_errors_are_one_line() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "--budgets", "x"])
    assert result.exit_code == 2 and "--budgets expects integers" in result.output


def test_worker_reports_errors_as_rows() -> None:
    row = run_worker(MeasureSpec(model="/nonexistent/model", length=64, budget=64))
    assert "error" in row and "nonexistent" in row["error"]


SNAPKV_RUN = MeasureSpec(method="snapkv", length=256, budget=64, new_tokens=3)


@pytest.fixture(scope="module")
def snapkv_row() -> dict:
    """One worker run on the real model, shared by the tests that read it."""
    return run_worker(SNAPKV_RUN, threads=1)


@pytest.mark.integration
def test_worker_measures_a_real_run(snapkv_row) -> None:
    """One measurement in a fresh process: byte counts follow from the model's config."""
    from kvbudget.models import load_model

    row = snapkv_row
    assert "error" not in row, row.get("error")
    model, _ = load_model("smollm2-135m")
    c = model.config
    per_token = c.num_hidden_layers * c.num_key_value_heads * 2 * (c.hidden_size // c.num_attention_heads) * 4
    assert row["logical_bytes"] == row["physical_bytes"] == 64 * per_token
    # two generated tokens are appended while decoding (snapkv evicts only in the prefill)
    assert row["decode_kv_bytes"] == row["logical_bytes"] + 2 * per_token
    assert row["decode_kv_allocated_bytes"] == row["logical_bytes"] + (2 + 32) * per_token  # room to append
    assert row["weight_bytes"] == weight_bytes(model)
    assert row["peak_rss_bytes"] > row["weight_bytes"]
    assert row["decode_steps"] == 2 and row["tpot_s"] > 0 and row["ttft_s"] > row["compress_s"] > 0
    assert 240 <= row["prompt_tokens"] <= 256
    json.dumps(row)


@pytest.mark.integration
def test_worker_decodes_a_batch_with_every_row_compressed(snapkv_row) -> None:
    """A batch of 2: every row holds its own budget, so the cache is twice one row's."""
    single = snapkv_row
    batched = run_worker(MeasureSpec(**{**asdict(SNAPKV_RUN), "batch": 2}), threads=1)
    assert "error" not in batched, batched.get("error")
    assert batched["batch"] == 2 and batched["decode_steps"] == 2
    assert batched["logical_bytes"] == batched["physical_bytes"] == 2 * single["logical_bytes"]
    assert batched["decode_kv_bytes"] == 2 * single["decode_kv_bytes"]


@pytest.mark.integration
def test_fit_prompt_hits_the_requested_total_length() -> None:
    from kvbudget.bench.measure import fit_prompt
    from kvbudget.models import load_model

    _, tokenizer = load_model("smollm2-135m")
    for length in (300, 1000):
        prompt = fit_prompt(tokenizer, "needle", length)
        assert length - 15 <= len(prompt.ids) <= length


def test_random_weights_build_a_model_from_its_config_alone(tmp_path: Path) -> None:
    from kvbudget.models import load_model

    source = config_only_model(tmp_path)
    model, tokenizer = load_model(source, dtype="bfloat16", random_weights=True)
    assert model.config.num_hidden_layers == TINY["num_hidden_layers"] and not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.q_proj.weight.float().std() > 0  # initialised, not empty
    assert tokenizer.pad_token == "[PAD]"
    with pytest.raises(OSError):  # without the flag the missing weights are an error
        load_model(source)


def test_worker_measures_a_random_weight_model_and_keys_it_apart(tmp_path: Path) -> None:
    source = str(config_only_model(tmp_path))
    spec = MeasureSpec(
        model=source, method="snapkv", length=256, budget=64, new_tokens=3, random_weights=True
    )
    row = run_worker(spec, threads=1)
    assert "error" not in row, row.get("error")
    per_token = TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * 2 * 16 * 4  # head dim 64 / 4
    assert row["logical_bytes"] == 64 * per_token and row["decode_steps"] == 2
    assert "gpu_peak_bytes" not in row  # a CPU run reports the process's memory only
    assert run_key(spec) != run_key(MeasureSpec(**{**asdict(spec), "random_weights": False}))
    assert run_key(MeasureSpec()) == run_key(
        {k: v for k, v in asdict(MeasureSpec()).items() if k != "random_weights"}
    )


def test_report_adds_the_gpu_peak_column_for_gpu_rows() -> None:
    runs = [
        {**_run(m, 1024, 64, 0, 0.01), "gpu_peak_bytes": peak}
        for m, peak in (("full", 3 << 20), ("snapkv", 1 << 20))
    ]
    rows = aggregate(runs, bandwidth=None)
    assert sorted(r["gpu_peak_bytes"] for r in rows) == [1 << 20, 3 << 20]
    text = markdown(
        {
            "machine": {},
            "config": {"model": "m", "dtype": "bfloat16", "new_tokens": 8, "repeats": 1, "threads": None},
            "rows": rows,
        }
    )
    assert "peak GPU MiB" in text and "| snapkv @64 | 1024 |" in text
    assert [line.count("|") for line in text.splitlines() if line.startswith("| full")] == [12]
    cpu_text = markdown(
        {
            "machine": {},
            "config": {"model": "m", "dtype": "float32", "new_tokens": 8, "repeats": 1, "threads": None},
            "rows": aggregate([_run("full", 1024, 64, 0, 0.01)], None),
        }
    )
    assert "peak GPU MiB" not in cpu_text


def test_random_model_dir_writes_a_config_and_a_tokenizer(tmp_path: Path) -> None:
    import subprocess
    import sys

    from transformers import AutoConfig

    from kvbudget.cli.checks import model_source

    tokenizer_dir = config_only_model(tmp_path / "tiny")
    script = Path(__file__).resolve().parents[1] / "scripts" / "random_model_dir.py"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)

    done = run(str(tmp_path / "big"), "--max-positions", "131072", "--tokenizer-from", str(tokenizer_dir))
    assert done.returncode == 0, done.stderr
    config = AutoConfig.from_pretrained(tmp_path / "big")
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("qwen2", 28, 4)
    assert config.max_position_embeddings == 131072 and config.hidden_size == 3584
    assert (tmp_path / "big" / "tokenizer.json").is_file() and not list(
        (tmp_path / "big").glob("*.safetensors")
    )
    model_source(str(tmp_path / "big"))  # a folder `kvbudget bench --model` accepts
    for bad, message in (
        (
            ["--max-positions", "0", "--tokenizer-from", str(tokenizer_dir)],
            "--max-positions must be positive",
        ),
        (["--tokenizer-from", str(tmp_path / "nowhere")], "unknown model"),
    ):
        failed = run(str(tmp_path / "other"), *bad)
        assert failed.returncode == 2 and message in failed.stderr and failed.stderr.count("\n") == 1


def test_report_shows_the_steady_tpot_when_a_graph_was_set_up() -> None:
    """Static rows carry the graph's one-off setup apart: the table adds the steady TPOT and the
    setup; rows written before those keys existed aggregate as eager rows (steady = TPOT)."""
    static = _run("snapkv", 1024, 64, 0, 0.02, tpot_steady_s=0.008, static_setup_s=0.4)
    rows = {r["method"]: r for r in aggregate([static, _run("full", 1024, 64, 0, 0.05)], bandwidth=None)}
    assert rows["snapkv"]["tpot_steady_s"] == 0.008 and rows["snapkv"]["static_setup_s"] == 0.4
    assert rows["full"]["tpot_steady_s"] == 0.05 and rows["full"]["static_setup_s"] == 0.0
    config = {"model": "m", "dtype": "bfloat16", "new_tokens": 8, "repeats": 1, "threads": None}
    text = markdown({"machine": {}, "config": config, "rows": list(rows.values())})
    assert "steady TPOT ms | graph setup s" in text
    assert "| 20.0 (20.0–20.0) | 8.0 | 0.40 |" in text
    header, rule = [
        line for line in text.splitlines() if line.startswith("| method") or line.startswith("|---")
    ][:2]
    assert header.count("|") == rule.count("|")
    eager = markdown({"machine": {}, "config": config, "rows": [rows["full"]]})
    assert "steady TPOT" not in eager


def test_worker_decodes_statically_when_asked_and_keys_it_apart(tmp_path: Path) -> None:
    """``decode="static"``: the row says which path ran (eager, with the reason, for a method that
    evicts while decoding); eager rows keep the keys they had before the option existed."""
    source = str(config_only_model(tmp_path))
    base = dict(model=source, length=256, budget=64, new_tokens=3, random_weights=True, decode="static")
    row = run_worker(MeasureSpec(method="snapkv", **base), threads=1)
    assert "error" not in row, row.get("error")
    assert row["decode_path"] == "static" and row["decode_steps"] == 2
    assert row["static_setup_s"] > 0  # the move into static buffers (no graph on the CPU)
    assert row["tpot_steady_s"] == pytest.approx((2 * row["tpot_s"] - row["static_setup_s"]) / 2)
    h2o = measure(MeasureSpec(method="h2o", **base))  # in this process: the worker path ran above
    assert h2o["decode_path"] == "eager" and "evicts while decoding" in h2o["static_refusal"]
    static = MeasureSpec(decode="static")
    assert len({run_key(static), run_key(MeasureSpec()), run_key(MeasureSpec(decode="static-compiled"))}) == 3
    assert run_key(MeasureSpec()) == run_key(
        {k: v for k, v in asdict(MeasureSpec()).items() if k != "decode"}
    )
    with pytest.raises(
        KVBudgetError, match="^decode must be one of eager, static, static-compiled, got 'graph'$"
    ):
        BenchConfig(decode="graph").validate()
