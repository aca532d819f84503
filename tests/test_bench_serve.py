"""``kvbudget bench serve`` on a tiny random model: every request answered through the live server,
the cap held, a compressed method holding more sequences at once than the full cache."""

from __future__ import annotations

import json

from conftest import tiny_model, tiny_tokenizer
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
