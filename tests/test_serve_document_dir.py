"""Shared documents on disk (``kvbudget serve --cache-dir``), with OpenAI's own client against live
servers on 127.0.0.1 (a tiny random model): a document found again after a restart answers as
before, another model's server leaves it alone, a torn file is skipped and nothing else is lost, the
folder's cap deletes the least recently used, and a document squeezed out of memory comes back."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import tiny_model, tiny_tokenizer
from kvbudget.errors import InputError
from kvbudget.serve.app import create_app, serving
from kvbudget.serve.batcher import Compression
from kvbudget.serve.document_dir import DocumentDir
from kvbudget.serve.scheduler import Scheduler

NAME = "tiny"
DOCUMENT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 8
QUESTION = "What jumps over the dog?"


def _server(model, tokenizer, folder, cap=1 << 30):
    scheduler = Scheduler(
        model, tokenizer, memory_cap=64 << 20,
        document_default=Compression("expected-attention", ratio=0.5, kv_bits=4),
        document_dir=DocumentDir(folder, cap),
    )  # fmt: skip
    return scheduler, serving(create_app(scheduler, NAME))


def _ask(base: str, doc_id: str):
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    return c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTION}],
                                     max_tokens=8, extra_body={"kvbudget": {"document": doc_id}})  # fmt: skip


def _create(base: str, text: str = DOCUMENT) -> dict:
    response = httpx.post(base + "/v1/kvbudget/documents", json={"text": text}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_document_is_found_again_after_a_restart(tmp_path) -> None:
    model, tokenizer = tiny_model("llama"), tiny_tokenizer(chat_template=True)
    _, first = _server(model, tokenizer, tmp_path)
    with first as base:
        doc = _create(base)
        before = _ask(base, doc["id"]).choices[0].message.content
    assert doc["on_disk"] and sorted(p.name for p in tmp_path.iterdir()) == [
        f"{doc['id']}.json",
        f"{doc['id']}.safetensors",
    ]  # written whole, no temporary file left
    scheduler, second = _server(model, tokenizer, tmp_path)
    with second as base:
        listed = httpx.get(base + "/v1/kvbudget/documents", timeout=30).json()["data"]
        assert [(d["id"], d["in_memory"], d["on_disk"]) for d in listed] == [(doc["id"], False, True)]
        assert scheduler.stats()["document_bytes"] == 0  # not loaded until asked
        answer = _ask(base, doc["id"])
        assert answer.choices[0].message.content == before
        assert answer.usage.model_extra["kvbudget"]["reused_tokens"] == doc["tokens"]
        assert scheduler.stats()["document_bytes"] == doc["kv_bytes"]
        # squeezed out of memory (its file keeps it) once no conversation reads it (a kept turn does),
        # then asked again: loaded again, the same answer
        with scheduler._lock:
            scheduler._unload_documents(keep=None)
        assert scheduler.stats()["document_bytes"] == doc["kv_bytes"]
        scheduler.drop_kept_turns()
        with scheduler._lock:
            scheduler._unload_documents(keep=None)
        assert scheduler.stats()["document_bytes"] == 0
        assert _ask(base, doc["id"]).choices[0].message.content == before


def test_another_models_server_and_torn_files_leave_the_folder_alone(tmp_path) -> None:
    model, tokenizer = tiny_model("llama"), tiny_tokenizer(chat_template=True)
    _, server = _server(model, tokenizer, tmp_path)
    with server as base:
        kept, torn = _create(base), _create(base, DOCUMENT[: len(DOCUMENT) // 2])
    torn_file = tmp_path / f"{torn['id']}.safetensors"
    torn_file.write_bytes(torn_file.read_bytes()[:100])
    _, other = _server(tiny_model("qwen2"), tokenizer, tmp_path)
    with other as base:
        assert httpx.get(base + "/v1/kvbudget/documents", timeout=30).json()["data"] == []
        with pytest.raises(openai.NotFoundError):
            _ask(base, kept["id"])
    _, again = _server(model, tokenizer, tmp_path)
    with again as base:
        listed = [d["id"] for d in httpx.get(base + "/v1/kvbudget/documents", timeout=30).json()["data"]]
        assert listed == [kept["id"]]  # the torn one skipped, its files left as they were
        assert _ask(base, kept["id"]).choices[0].message.content
        for bad in ("doc-x", "../" + kept["id"]):
            assert httpx.get(base + f"/v1/kvbudget/documents/{bad}", timeout=30).status_code == 404
    assert torn_file.exists() and (tmp_path / f"{kept['id']}.json").exists()


def test_the_folder_cap_deletes_the_least_recently_used(tmp_path) -> None:
    model, tokenizer = tiny_model("llama"), tiny_tokenizer(chat_template=True)
    _, probe = _server(model, tokenizer, tmp_path / "probe")
    with probe as base:
        _create(base)
    one = sum(p.stat().st_size for p in (tmp_path / "probe").iterdir())
    folder = tmp_path / "capped"
    _, server = _server(model, tokenizer, folder, cap=one + one // 2)
    with server as base:
        first, second = _create(base), _create(base)
        assert sorted(p.stem for p in folder.glob("*.safetensors")) == [second["id"]]
        assert _ask(base, first["id"]).choices[0].message.content  # still in this server's memory
    with pytest.raises(InputError, match="must be positive"):
        DocumentDir(folder, 0)


def test_a_conversation_squeezed_out_of_memory_is_spilled_and_continued(tmp_path) -> None:
    """A kept turn that must make room is written to the cache directory, not forgotten: its
    follow-up reuses it (its tokens are not prefilled again) and answers as it would had the turn
    stayed in memory — also after a restart."""
    from kvbudget.engine import build_prompt
    from kvbudget.serve.batcher import make_sequence, prefill_peak_bytes

    model, tokenizer = tiny_model("llama"), tiny_tokenizer(chat_template=True)
    first = [{"role": "user", "content": DOCUMENT[:300] + " " + QUESTION}]
    big = DOCUMENT[:700]
    peak = prefill_peak_bytes(
        model, make_sequence(build_prompt(tokenizer, big).ids, 4, set(), Compression("full"))
    )

    def serve(folder, cap):
        scheduler = Scheduler(model, tokenizer, memory_cap=cap, default=Compression("snapkv:window=8", 24),
                              document_dir=DocumentDir(folder, 1 << 30))  # fmt: skip
        return scheduler, serving(create_app(scheduler, NAME))

    def chat(base, messages, **kvbudget):
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        return c.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                         extra_body={"kvbudget": kvbudget} if kvbudget else None)  # fmt: skip

    _, roomy = serve(tmp_path / "roomy", 64 << 20)
    with roomy as base:
        answer = chat(base, first).choices[0].message.content
        follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
        expected = chat(base, follow)
    assert expected.usage.model_extra["kvbudget"]["reused_tokens"] > 0
    folder = tmp_path / "tight"
    _, tight = serve(folder, peak + 2048)  # the big request fits only once the turn is out
    with tight as base:
        assert chat(base, first).choices[0].message.content == answer
        chat(base, [{"role": "user", "content": big}], method="full")
    assert len(list(folder.glob("turn-*.safetensors"))) == 1  # spilled, not forgotten
    _, restarted = serve(folder, peak + 2048)  # a new server finds it and continues the conversation
    with restarted as base:
        again = chat(base, follow)
    assert again.choices[0].message.content == expected.choices[0].message.content
    reused = again.usage.model_extra["kvbudget"]["reused_tokens"]
    assert reused == expected.usage.model_extra["kvbudget"]["reused_tokens"] > 0
    assert not list(folder.glob("turn-*"))  # taken over: its files deleted
