"""Benchmark plumbing: memory high-water mark, bandwidth bound, aggregation, targets, report, peer."""

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

from conftest import TINY, tiny_model, tiny_tokenizer
from kvbudget.bench import memory
from kvbudget.bench.bandwidth import decode_bound_s, measure_bandwidth, weight_bytes
from kvbudget.bench.grid import BenchConfig, aggregate, run_key, run_worker
from kvbudget.bench.measure import MeasureSpec
from kvbudget.bench.peer import (
    PEERS,
    PeerConfig,
    make_jobs,
    over_repeats,
    paired_ratio,
    pooled_wall,
    run_ours,
    run_pairs,
    summarise,
)
from kvbudget.bench.peer import markdown as peer_markdown
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
    result = runner.invoke(app, ["bench", "peer", "--peer-python", "/nonexistent/python"])
    assert result.exit_code == 2 and "make peer" in result.output
    result = runner.invoke(app, ["bench", "peer", "--methods", "lava"])
    assert result.exit_code == 2 and "no kvpress counterpart for lava" in result.output


def test_worker_reports_errors_as_rows() -> None:
    row = run_worker(MeasureSpec(model="/nonexistent/model", length=64, budget=64))
    assert "error" in row and "nonexistent" in row["error"]


def test_peer_runs_ours_with_compression_in_the_prefill_only() -> None:
    model = tiny_model("llama")
    context = list(range(3, 90)) * 2  # 174 tokens
    question = [5, 6, 7, 8]
    sample = {"id": "x", "context_ids": context, "question_ids": question, "eos_ids": [], "max_new_tokens": 6}
    row = run_ours(model, sample, "streamingllm", 40)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert row["kept_entries"] == row["allocated_entries"] == layers * heads * 40
    assert len(row["token_ids"]) == 6
    # the question and 5 decoded tokens stay: a decode-stage method does not trim here
    assert row["final_entries"] == layers * heads * (40 + len(question) + 5)
    assert row["wall_s"] == pytest.approx(row["prefill_s"] + row["decode_s"]) and row["prefill_s"] > 0
    assert len(row["step_s"]) == 5 and 0 < sum(row["step_s"]) <= row["decode_s"]  # one time per step


def test_peer_summary_scores_both_sides_with_our_metric() -> None:
    tok = tiny_tokenizer()
    samples = [{"id": f"s{i}", "task": "needle", "length": 300, "answers": ["4711"], "eos_ids": [1]}
               for i in range(3)]  # fmt: skip
    right, wrong = tok.encode("4711"), tok.encode("0000")
    ours = [
        {"sample": f"s{i}", "method": "snapkv", "budget": 64, "token_ids": ids + [1], "wall_s": 1.0,
         "prefill_s": 0.5, "decode_s": 0.5, "kept_entries": 10, "allocated_entries": 10}
        for i, ids in enumerate([right, right, wrong])
    ]  # fmt: skip
    theirs = [
        {**r, "token_ids": ids, "wall_s": 2.0, "prefill_s": 0.5, "decode_s": 1.5, "kept_entries": 10,
         "allocated_entries": 30}
        for r, ids in zip(ours, [right + [1], wrong, wrong + [1]], strict=True)
    ]  # fmt: skip
    (row,) = summarise(samples, ours, theirs, tok)
    assert row["ours_accuracy"] == pytest.approx(2 / 3) and row["kvpress_accuracy"] == pytest.approx(1 / 3)
    assert row["accuracy_diff_samples"] == 1
    assert row["same_answer"] == pytest.approx(2 / 3)
    assert row["wall_ratio"] == pytest.approx(0.5)
    assert row["prefill_ratio"] == pytest.approx(1.0) and row["decode_ratio"] == pytest.approx(1 / 3)
    assert row["kvpress_allocated_entries"] == 30
    assert row["press"] == PEERS["snapkv"][1]["press"]
    assert row["repeats"] == 1 and row["ours_deterministic"] and row["kvpress_deterministic"]


def test_our_runner_serves_the_rows_run_ours_makes(tmp_path: Path) -> None:
    """`bench peer`'s own side runs in a serving process (like kvpress's runner): its rows decode
    what `run_ours` decodes in this process and count the run's page faults."""
    from kvbudget.bench.peer import ours_server

    model_dir = tmp_path / "model"
    model = tiny_model("llama", seed=3)
    model.save_pretrained(model_dir)
    tiny_tokenizer(chat_template=True).save_pretrained(model_dir)
    sample = {"id": "x", "context_ids": list(range(3, 90)) * 2, "question_ids": [5, 6, 7, 8],
              "eos_ids": [], "max_new_tokens": 5}  # fmt: skip
    (tmp_path / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    jobs = make_jobs(PeerConfig(methods=["snapkv", "full"], budgets=[40]))
    server = ours_server(str(model_dir), tmp_path / "samples.jsonl", jobs, tmp_path / "ours.log", "float32")
    try:
        served = [server.run(0, j) for j in range(len(jobs))]
    finally:
        server.close()
    assert server.proc.returncode == 0
    for job, row in zip(jobs, served, strict=True):
        here = run_ours(model, sample, job["method"], job["budget"])
        assert row["token_ids"] == here["token_ids"] and row["kept_entries"] == here["kept_entries"]
        assert isinstance(row["minor_faults"], int) and row["minor_faults"] >= 0
        assert row["wall_s"] == pytest.approx(row["prefill_s"] + row["decode_s"])


def test_our_runner_that_cannot_start_raises_a_clear_error(tmp_path: Path) -> None:
    from kvbudget.bench.peer import ours_server

    (tmp_path / "samples.jsonl").write_text("")
    with pytest.raises(KVBudgetError, match="the kvbudget runner stopped") as failure:
        ours_server(str(tmp_path / "none"), tmp_path / "samples.jsonl", [], tmp_path / "ours.log", "float32")
    assert "none" in str(failure.value)  # the runner's own error names the missing model


def _timed_rows(side: str, rng: np.random.Generator, repeats: int) -> list[dict]:
    """Rows for 2 samples × (snapkv@64, full) × ``repeats`` with random times."""
    return [
        {"sample": f"s{i}", "method": method, "budget": budget, "repeat": rep, "token_ids": [5, 6, 1],
         "prefill_s": float(p), "decode_s": float(d), "wall_s": float(p + d), "kept_entries": 10,
         "allocated_entries": 10, "side": side, "minor_faults": int(f),
         "compress_s": float(c) if method == "snapkv" else 0.0}
        for rep in range(repeats) for i in range(2) for method, budget in (("snapkv", 64), ("full", None))
        for p, d, c, f in [(*rng.uniform(0.5, 3.0, 2), rng.uniform(0.01, 0.2), rng.integers(0, 90_000))]
    ]  # fmt: skip


def test_peer_repeats_aggregate_by_median_and_check_tokens() -> None:
    rng = np.random.default_rng(0)
    ours, theirs = _timed_rows("ours", rng, 3), _timed_rows("kvpress", rng, 3)
    theirs[-1]["token_ids"] = [5, 7, 1]  # kvpress's last repeat of s1/full decoded something else
    merged = over_repeats(ours)
    assert len(merged) == 4
    for (sample, method, budget), row in merged.items():
        runs = [r for r in ours if (r["sample"], r["method"], r["budget"]) == (sample, method, budget)]
        assert len(runs) == row["repeats"] == 3
        for t in ("wall_s", "prefill_s", "decode_s", "compress_s", "minor_faults"):
            assert row[t] == pytest.approx(np.median([r[t] for r in runs]))
        assert row["deterministic"]
    assert not over_repeats(theirs)[("s1", "full", None)]["deterministic"]

    samples = [{"id": f"s{i}", "task": "needle", "length": 300, "answers": ["x"], "eos_ids": [1]}
               for i in (0, 1)]  # fmt: skip
    rows = {r["method"]: r for r in summarise(samples, ours, theirs, tiny_tokenizer())}
    assert rows["full"]["budget"] is None and rows["full"]["press"] == "no press"
    assert rows["snapkv"]["kvpress_deterministic"] and not rows["full"]["kvpress_deterministic"]
    for method, row in rows.items():
        for phase in ("wall", "prefill", "decode"):
            mine, peer = (
                sum(np.median([r[f"{phase}_s"] for r in side if r["sample"] == s and r["method"] == method])
                    for s in ("s0", "s1"))
                for side in (ours, theirs)
            )  # fmt: skip
            assert row[f"ours_{phase}_s"] == pytest.approx(mine)
            assert row[f"kvpress_{phase}_s"] == pytest.approx(peer)
            assert row[f"{phase}_ratio"] == pytest.approx(mine / peer)
        for name, side in (("ours", ours), ("kvpress", theirs)):
            for measure in ("compress_s", "minor_faults"):
                total = sum(
                    np.median([r[measure] for r in side if r["sample"] == s and r["method"] == method])
                    for s in ("s0", "s1")
                )
                assert row[f"{name}_{measure}"] == pytest.approx(total)

    text = peer_markdown(PeerConfig(repeats=3), list(rows.values()), "versions")
    header = next(line for line in text.splitlines() if line.startswith("| task"))
    for column in ("prefill s ours / kvpress (ratio)", "decode s ours / kvpress (ratio)",
                   "wall s ours / kvpress (ratio)", "same tokens over repeats"):  # fmt: skip
        assert column in header
    full = next(line for line in text.splitlines() if line.startswith("| needle") and "no press" in line)
    cells = [c.strip() for c in full.strip("|").split("|")]
    assert cells[:6] == ["needle", "300", "`full`", "no press", "—", "2"]
    assert cells[9] == "yes / **NO**"
    assert len(cells) == len([c for c in header.strip("|").split("|")])
    r = rows["full"]
    assert cells[11].endswith(f"({r['wall_paired']['verdict']}, 6 runs)")  # wall, run by run
    assert cells[12] == f"{r['ours_prefill_s']:.1f} / {r['kvpress_prefill_s']:.1f} ({r['prefill_ratio']:.2f})"
    assert header.strip("|").split("|")[-1].strip() == "page faults ours / kvpress (k)"
    assert cells[-1] == f"{r['ours_minor_faults'] / 1000:.0f} / {r['kvpress_minor_faults'] / 1000:.0f}"
    assert cells[14] == "0.00 / 0.00"  # full compresses nothing on either side: no ratio
    snap = next(line for line in text.splitlines() if "| `snapkv" in line)
    s = rows["snapkv"]
    ratio = s["ours_compress_s"] / s["kvpress_compress_s"]
    assert f"| {s['ours_compress_s']:.2f} / {s['kvpress_compress_s']:.2f} ({ratio:.2f}) |" in snap
    assert "not deterministic across repeats** for: full@None (needle 300, kvpress)" in text
    # the reference comes first in its length block
    assert text.index("no press") < text.index(PEERS["snapkv"][1]["press"])


def test_peer_wall_ratio_run_by_run_has_an_error_and_a_verdict() -> None:
    rng = np.random.default_rng(1)
    ours, theirs = _timed_rows("ours", rng, 4), _timed_rows("kvpress", rng, 4)
    for r in theirs:  # kvpress ≈ 1.5 × slower on snapkv, the same on full (up to noise)
        if r["method"] == "snapkv":
            r["wall_s"] = (
                1.5
                * next(
                    o["wall_s"]
                    for o in ours
                    if (o["sample"], o["method"], o["repeat"]) == (r["sample"], r["method"], r["repeat"])
                )
                * rng.uniform(0.97, 1.03)
            )
        else:
            r["wall_s"] = next(
                o["wall_s"]
                for o in ours
                if (o["sample"], o["method"], o["repeat"]) == (r["sample"], r["method"], r["repeat"])
            ) * rng.uniform(0.9, 1.1)
    pairs = run_pairs(ours, theirs)
    assert set(pairs) == {(f"s{i}", m, b) for i in (0, 1) for m, b in (("full", None), ("snapkv", 64))}
    snap = [p for key, group in pairs.items() if key[1] == "snapkv" for p in group]
    logs = np.log([a["wall_s"] / b["wall_s"] for a, b in snap])
    stats = paired_ratio(snap)
    assert stats["n"] == 8 and stats["ratio"] == pytest.approx(np.exp(logs.mean()))
    assert stats["se_factor"] == pytest.approx(np.exp(logs.std(ddof=1) / np.sqrt(8)))
    assert stats["verdict"] == "faster" and 0.6 < stats["ratio"] < 0.7
    full = [p for key, group in pairs.items() if key[1] == "full" for p in group]
    assert paired_ratio(full)["verdict"] == "parity"
    assert paired_ratio([(theirs[0], ours[0])] * 2)["verdict"] in ("slower", "faster", "parity")
    assert paired_ratio(full[:1])["se_factor"] is None and paired_ratio([])["n"] == 0

    pooled = pooled_wall(ours, theirs)
    assert all(stats["n"] == 16 for stats in pooled.values())  # both pairs, 2 samples × 4 repeats each
    samples = [{"id": f"s{i}", "task": "needle", "length": 300, "answers": ["x"], "eos_ids": [1]}
               for i in (0, 1)]  # fmt: skip
    rows = summarise(samples, ours, theirs, tiny_tokenizer())
    assert {r["method"]: r["wall_paired"]["verdict"] for r in rows} == {"snapkv": "faster", "full": "parity"}
    text = peer_markdown(PeerConfig(repeats=4), rows, "versions", pooled)
    assert "(faster, 8 runs)" in text and "(parity, 8 runs)" in text
    assert "- every pair but h2o: " in text


def test_peer_jobs_run_full_once_without_a_budget_and_last() -> None:
    jobs = make_jobs(PeerConfig(methods=["full", "snapkv", "knorm"], budgets=[64, 128], question_aware=True))
    assert [(j["method"], j["budget"]) for j in jobs] == [
        ("snapkv", 64),
        ("snapkv", 128),
        ("knorm", 64),
        ("knorm", 128),
        ("full", None),
    ]
    assert jobs[-1]["press"] is None and all(j["question_aware"] for j in jobs)
    with pytest.raises(KVBudgetError, match="repeats"):
        PeerConfig(repeats=0).validate()


def test_peer_full_keeps_the_whole_prompt_and_splits_time() -> None:
    model = tiny_model("llama")
    context, question = list(range(3, 90)) * 2, [5, 6, 7, 8]
    sample = {"id": "x", "context_ids": context, "question_ids": question, "eos_ids": [], "max_new_tokens": 4}
    row = run_ours(model, sample, "full", None)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert row["kept_entries"] == layers * heads * len(context)
    assert row["allocated_entries"] >= row["kept_entries"]  # an uncompressed layer has room to append
    assert row["final_entries"] == layers * heads * (len(context) + len(question) + 3)
    assert row["wall_s"] == pytest.approx(row["prefill_s"] + row["decode_s"])
    assert row["prefill_s"] > 0 and row["decode_s"] > 0


def test_peer_config_rejects_methods_without_a_counterpart() -> None:
    with pytest.raises(KVBudgetError, match="no kvpress counterpart"):
        PeerConfig(methods=["cake"]).validate()


@pytest.mark.integration
def test_worker_measures_a_real_run() -> None:
    """One measurement in a fresh process: byte counts follow from the model's config."""
    from kvbudget.models import load_model

    row = run_worker(MeasureSpec(method="snapkv", length=256, budget=64, new_tokens=3), threads=1)
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
def test_worker_decodes_a_batch_with_every_row_compressed() -> None:
    """A batch of 2: every row holds its own budget, so the cache is twice one row's."""
    spec = MeasureSpec(method="snapkv", length=256, budget=64, new_tokens=3)
    single = run_worker(spec, threads=1)
    batched = run_worker(MeasureSpec(**{**asdict(spec), "batch": 2}), threads=1)
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


def test_peer_question_aware_compresses_the_question_too() -> None:
    model = tiny_model("llama")
    sample = {"id": "x", "context_ids": list(range(3, 90)) * 2, "question_ids": [5, 6, 7, 8], "eos_ids": [],
              "max_new_tokens": 6}  # fmt: skip
    row = run_ours(model, sample, "snapkv", 40, question_aware=True)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert row["kept_entries"] == row["allocated_entries"] == layers * heads * 40
    assert row["final_entries"] == layers * heads * (40 + 5)  # the question was compressed with the context


def test_kvpress_runner_refuses_presses_on_a_transformers_they_do_not_support(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make peer-same-transformers` forces our transformers (≥ 5.3) under kvpress 0.5.5: only the
    `full` pair may run there; a press job is refused in one line before the model loads."""
    import sys
    import types

    import transformers

    from kvbudget.bench import kvpress_runner

    assert tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 3)  # the main env's
    monkeypatch.setitem(sys.modules, "kvpress", types.ModuleType("kvpress"))
    jobs = make_jobs(PeerConfig(methods=["full", "snapkv"], budgets=[64]))
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "samples.jsonl").write_text("")
    args = ["--model", str(tmp_path / "no-model"), "--samples", str(tmp_path / "samples.jsonl")]
    code = kvpress_runner.main([*args, "--jobs", str(tmp_path / "jobs.json"), "--serve"])
    err = capsys.readouterr().err
    assert code == 2 and "need transformers < 5.3" in err and "snapkv" in err and "full" in err
