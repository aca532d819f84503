"""``kvbudget bench serve`` on a tiny random model: every request answered through the live server,
the cap held, a compressed method holding more sequences at once than the full cache."""

from __future__ import annotations

import json
import sys

import torch

from conftest import config_only_model, tiny_model, tiny_tokenizer
from kvbudget.bench.serve_load import ServeBenchConfig, run_serve_bench


def test_bench_serve_holds_more_compressed_sequences_under_the_same_cap(tmp_path) -> None:
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    config = ServeBenchConfig(
        model="tiny", dtype="float32", task="needle", length=400, methods=["full", "snapkv:window=8"],
        ratio=0.875, clients=4, requests=4, max_tokens=8, time_limit_s=300,
    )  # fmt: skip
    report = run_serve_bench(config, tmp_path, model=model, tokenizer=tokenizer, progress=lambda _: None)
    record = json.loads((tmp_path / "serve.json").read_text())
    full, snap = record["rows"]
    for row in (full, snap):
        assert row["answered"] == 4 and not row["errors"]
        assert 0 < row["peak_kv_bytes"] <= record["cap_bytes"]
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and row["ttft_p50_s"] > 0
        assert 0.0 <= row["accuracy"] <= 1.0
    assert full["held_at_once"] <= 2  # the default cap: two full-cache conversations
    assert snap["held_at_once"] > full["held_at_once"]
    assert "| snapkv:window=8 (ratio=0.125) |" in report.read_text()


def test_bench_serve_with_random_weights_holds_and_times_but_scores_nothing(tmp_path) -> None:
    """``random_weights``: a model built from ``config.json`` alone (the 7B-on-a-GPU path, here a
    tiny one on the CPU). Every request decodes ``max_tokens`` (EOS ignored) and no accuracy is
    claimed for answers that mean nothing."""
    source = config_only_model(tmp_path / "tiny")
    config = ServeBenchConfig(
        model=str(source), dtype="float32", task="needle", length=300, methods=["full", "snapkv:window=8"],
        ratio=0.75, clients=3, requests=3, max_tokens=5, time_limit_s=300, random_weights=True, device="auto",
    )  # fmt: skip
    report = run_serve_bench(config, tmp_path / "out", progress=lambda _: None)
    record = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert record["config"]["random_weights"] and record["config"]["device"] in ("cpu", "cuda:0")
    for row in record["rows"]:
        assert row["answered"] == 3 and not row["errors"]
        assert row["tokens"] == 3 * 5  # EOS ignored: every answer is max_tokens long
        assert row["accuracy"] is None
        assert 0 < row["peak_kv_bytes"] <= record["cap_bytes"]
    text = report.read_text()
    assert "random weights: no accuracy" in text and "| — |" in text


def test_bench_serve_cli_refuses_what_cannot_run_in_one_line(tmp_path) -> None:
    from typer.testing import CliRunner

    from kvbudget.cli import app

    source = str(config_only_model(tmp_path / "tiny"))
    runner = CliRunner()
    both = runner.invoke(app, ["bench", "serve", "--model", source, "--random-weights", "--openvino",
                               sys.executable, "--out", str(tmp_path / "a")])  # fmt: skip
    assert both.exit_code != 0 and "--random-weights with --openvino" in both.output
    assert len(both.output.strip().splitlines()) == 1
    if not torch.cuda.is_available():
        cuda = runner.invoke(app, ["bench", "serve", "--model", source, "--device", "cuda", "--out",
                                   str(tmp_path / "b")])  # fmt: skip
        assert cuda.exit_code != 0 and "CUDA is not available" in cuda.output
        assert len(cuda.output.strip().splitlines()) == 1


def test_bench_serve_takes_stored_precisions_and_byte_budgets(tmp_path) -> None:
    """``full:kv_bits=4`` stores the whole cache at 4 bits, ``NAME:memory=f`` is a byte budget: both
    served under the cap, labelled as the server labels them."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    config = ServeBenchConfig(
        model="tiny", dtype="float32", task="needle", length=400,
        methods=["full", "full:kv_bits=4", "snapkv:window=8,memory=0.25"], ratio=0.875, clients=2,
        requests=2, max_tokens=4, time_limit_s=300,
    )  # fmt: skip
    report = run_serve_bench(config, tmp_path, model=model, tokenizer=tokenizer, progress=lambda _: None)
    full, four_bit, byte_budget = json.loads((tmp_path / "serve.json").read_text())["rows"]
    assert [r["answered"] for r in (full, four_bit, byte_budget)] == [2, 2, 2]
    assert (
        four_bit["compression"] == "full, 4-bit"
        and byte_budget["compression"] == "snapkv:window=8 (memory=0.25)"
    )
    assert four_bit["peak_kv_bytes"] < full["peak_kv_bytes"]
    assert "| full, 4-bit |" in report.read_text()


def test_bench_serve_refuses_bad_specs_and_a_missing_llama_server_in_one_line(tmp_path) -> None:
    from typer.testing import CliRunner

    from kvbudget.cli import app

    source = str(config_only_model(tmp_path / "tiny"))
    runner = CliRunner()
    for extra, message in (
        (["--methods", "snapkv:kv_bits=3"], "kv_bits must be one of 2, 4, 8 or 16"),
        (["--llama-server", str(tmp_path / "none")], "no llama-server at"),
        (["--llama-server", sys.executable, "--llama-cache-types", "q5_1"], "q8_0, q4_0; got q5_1"),
    ):
        result = runner.invoke(
            app, ["bench", "serve", "--model", source, "--out", str(tmp_path / "o"), *extra]
        )
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
