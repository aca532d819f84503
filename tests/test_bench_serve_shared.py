"""``kvbudget bench serve --workload shared|multiturn`` on a tiny random model: one document's
questions served as a shared compressed document, a shared full one and per request, through live
servers; every request answered, the document counted once, the table written."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY, tiny_tokenizer
from kvbudget.bench.serve_shared import SharedBenchConfig, run_shared_bench
from kvbudget.errors import InputError


def _long_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(**{**TINY, "max_position_embeddings": 8192}, initializer_range=0.2)
    ).eval()


def test_one_documents_questions_served_three_ways(tmp_path) -> None:
    model, tokenizer = _long_model(), tiny_tokenizer(chat_template=True)
    config = SharedBenchConfig(
        model="tiny", dtype="float32", workload="shared", task="sc_keys", length=6000, clients=1,
        document_method="expected-attention:kv_bits=4", per_request_method="snapkv:window=8", ratio=0.75,
        modes=["document", "document:full", "per-request", "document:reload"],
    )  # fmt: skip
    report = run_shared_bench(config, tmp_path, model=model, tokenizer=tokenizer, progress=lambda _: None)
    rows = {r["mode"]: r for r in json.loads((tmp_path / "serve-shared.json").read_text())["rows"]}
    assert list(rows) == ["document", "document:full", "per-request", "document:reload"]
    for r in rows.values():
        assert r["requests"] == 4 and r["answered"] == 4 and not r["errors"]  # 1 client x 4 questions
        assert r["first_s"] > 0 and r["ttft_p50_s"] > 0 and 0.0 <= r["accuracy_later_questions"] <= 1.0
    doc, full, per_request = rows["document"], rows["document:full"], rows["per-request"]
    assert 0 < doc["document_bytes"] < full["document_bytes"] and per_request["document_bytes"] == 0
    # the document once, then each request's own tokens: far less than a copy of it per request
    for r in (doc, full):
        assert r["document_bytes"] <= r["peak_kv_bytes"] < 2 * r["document_bytes"]
    assert full["later_vs_full"] == (1.0 if full["accuracy_later_questions"] else None)  # none of a 0
    reload = rows["document:reload"]  # loaded from disk by a new server: the same document, answers
    assert reload["document_bytes"] == doc["document_bytes"]
    assert reload["accuracy_later_questions"] == doc["accuracy_later_questions"]
    text = report.read_text()
    assert "shared document, expected-attention:kv_bits=4" in text and "snapkv:window=8 per request" in text


def test_multiturn_conversations_on_a_document_reuse_their_turns(tmp_path) -> None:
    model, tokenizer = _long_model(), tiny_tokenizer(chat_template=True)
    config = SharedBenchConfig(
        model="tiny", dtype="float32", workload="multiturn", task="sc_keys", length=6000, clients=2,
        modes=["document"], document_method="expected-attention:kv_bits=4", sample=1,
    )  # fmt: skip
    report = run_shared_bench(config, tmp_path, model=model, tokenizer=tokenizer, progress=lambda _: None)
    saved = json.loads((tmp_path / "serve-shared.json").read_text())
    (row,) = saved["rows"]
    assert saved["config"]["sample"] == 1 and "sc_keys sample 1" in report.read_text()
    assert row["answered"] == row["requests"] == 8 and not row["errors"]
    assert row["document_bytes"] <= row["peak_kv_bytes"] < 2 * row["document_bytes"]
    # every answer kept; "later" in conversations is by turn: the first request, client 0's three
    # questions after it (a new conversation) and client 1's four
    answers = row["answers"]
    assert sorted((-1 if a["client"] is None else a["client"], a["turn"]) for a in answers) == [
        (-1, 0), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3)
    ]  # fmt: skip
    later = [a["score"] for a in answers if a["turn"] > 0]
    assert row["accuracy_later_turns"] == pytest.approx(sum(later) / len(later))
    assert "| first turn | later turns |" in report.read_text()


def test_a_task_without_follow_ups_or_a_bad_mode_is_refused(tmp_path) -> None:
    model, tokenizer = _long_model(), tiny_tokenizer(chat_template=True)
    with pytest.raises(InputError, match="needs a shared-context task"):
        run_shared_bench(SharedBenchConfig(task="needle", length=300), tmp_path, model, tokenizer)
    with pytest.raises(InputError, match="modes are"):
        run_shared_bench(SharedBenchConfig(modes=["docs"]), tmp_path, model, tokenizer)
