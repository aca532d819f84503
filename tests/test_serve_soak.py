"""The soak of ``kvbudget serve`` (:mod:`kvbudget.bench.serve_soak`) on a tiny random model: concurrent
clients with random prompt lengths, methods, dropped streams, follow-ups and bad requests under a small
cap; nothing gets a 5xx or is lost, the server drains to its kept turns, and its memory returns to
where it was after warm-up."""

from __future__ import annotations

import pytest

from conftest import tiny_model, tiny_tokenizer
from kvbudget.bench.serve_soak import RSS_TOLERANCE, SoakConfig, run_soak, soak_markdown


@pytest.mark.slow
def test_a_soak_loses_nothing_and_gives_its_memory_back() -> None:
    model, tokenizer = tiny_model("llama"), tiny_tokenizer(chat_template=True)
    config = SoakConfig(
        methods=["full", "snapkv:window=8", "h2o", "streamingllm", "asl", "ada-snapkv:window=8"],
        budgets=(24, 48), min_words=1, max_words=60, max_tokens=12, clients=4, seconds=25.0,
        cap_bytes=2 << 20, max_body=16 << 10,
    )  # fmt: skip
    result = run_soak(model, tokenizer, config, progress=lambda line: None)
    statuses = result["statuses"]
    assert result["requests"] >= 100, result
    assert result["server_errors"] == 0 and result["lost"] == 0, result["problems"]
    assert int(statuses.get("200", 0)) > 0 and sum(n for s, n in statuses.items() if s.startswith("4")) > 0
    assert result["end_active"] == 0 and result["end_queued"] == 0
    assert result["end_held_bytes"] == result["kept_turn_bytes"]
    assert result["live_caches"] <= result["end_kept_turns"]
    assert 0 < result["peak_held_bytes"] <= config.cap_bytes
    assert result["reused_tokens"] > 0  # follow-ups took their kept turns over
    assert result["rss_end_bytes"] <= result["rss_warm_bytes"] * (1 + RSS_TOLERANCE)
    assert result["ok"]
    assert "0 5xx, 0 lost" in soak_markdown(result, "tiny", "pytest")
