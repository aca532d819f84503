"""Shared documents in ``kvbudget serve``, through OpenAI's own client and plain HTTP against a live
server on 127.0.0.1 (a tiny random model): a document compressed once, concurrent questions on it
each answered as ``kvbudget.generate`` answers it alone question-agnostically
(``compress_context_only``), the document's bytes counted once on ``/metrics``, requests without it
untouched, and bad ids and bodies refused in one line. Every server here stops itself."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvbudget
from conftest import tiny_model, tiny_tokenizer
from kvbudget.serve.app import create_app, serving
from kvbudget.serve.batcher import Compression
from kvbudget.serve.scheduler import Scheduler

NAME = "tiny"
DOCUMENT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 8
QUESTIONS = ["What jumps over the dog?", "What goes in the box?", "How many jugs?"]
TOKENS = 8


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("llama"), tiny_tokenizer(chat_template=True)


@pytest.fixture(scope="module")
def server(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    scheduler = Scheduler(
        model, tokenizer, memory_cap=64 << 20, default=Compression("snapkv:window=8", 24),
        document_default=Compression("expected-attention", ratio=0.5, kv_bits=4),
    )  # fmt: skip
    with serving(create_app(scheduler, NAME)) as base:
        yield base, scheduler


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def _create(base: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/kvbudget/documents", json=body, timeout=120)


def _gauge(base: str, name: str) -> float:
    families = text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text)
    return next(s.value for f in families for s in f.samples if s.name == name)


def test_questions_on_one_document_answer_as_generate_alone_and_share_its_bytes(server, model_and_tokenizer):
    base, scheduler = server
    model, tokenizer = model_and_tokenizer
    created = _create(base, text=DOCUMENT)
    assert created.status_code == 200, created.text
    doc = created.json()
    assert doc["object"] == "kvbudget.document" and doc["method"] == "expected-attention"
    assert doc["ratio"] == 0.5 and doc["kv_bits"] == 4 and doc["kv_bytes"] > 0
    c = _client(base)
    answers: dict[int, object] = {}

    def ask(i: int) -> None:
        answers[i] = c.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": QUESTIONS[i]}], max_tokens=TOKENS,
            extra_body={"kvbudget": {"document": doc["id"]}},
        )  # fmt: skip

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, question in enumerate(QUESTIONS):
        expected = kvbudget.generate(
            model, tokenizer, DOCUMENT, question, method="expected-attention", ratio=0.5, kv_bits=4,
            compress_context_only=True, max_new_tokens=TOKENS,
        ).text  # fmt: skip
        answer = answers[i]
        assert answer.choices[0].message.content == expected
        usage = answer.usage.model_extra["kvbudget"]
        assert usage["document"] == doc["id"] and usage["reused_tokens"] == doc["tokens"]
        assert usage["kv_bytes"] < doc["kv_bytes"]  # its own tokens only
    # the document once, then each kept conversation's own tokens
    held = _gauge(base, "kvbudget_kv_bytes_held")
    kept = scheduler.kept_turn_bytes()
    assert _gauge(base, "kvbudget_kv_bytes_documents") == doc["kv_bytes"]
    assert held == doc["kv_bytes"] + kept and kept < doc["kv_bytes"]
    listed = httpx.get(base + "/v1/kvbudget/documents", timeout=30).json()["data"]
    assert [d["id"] for d in listed] == [doc["id"]]
    # deleted: gone from the list, its bytes and its kept turns freed, its id a one-line 404
    deleted = httpx.delete(base + f"/v1/kvbudget/documents/{doc['id']}", timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert _gauge(base, "kvbudget_kv_bytes_documents") == 0
    with pytest.raises(openai.NotFoundError) as missing:
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  extra_body={"kvbudget": {"document": doc["id"]}})  # fmt: skip
    assert missing.value.body["code"] == "document_not_found" and "\n" not in missing.value.body["message"]
    assert httpx.get(base + f"/v1/kvbudget/documents/{doc['id']}", timeout=30).status_code == 404


def test_a_request_without_the_document_never_reuses_it(server) -> None:
    base, _ = server
    doc = _create(base, text=DOCUMENT, method="snapkv:window=8", budget=16).json()
    c = _client(base)
    plain = c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": f"{DOCUMENT}\n\n{QUESTIONS[0]}"}], max_tokens=2
    )
    assert plain.usage.model_extra["kvbudget"]["reused_tokens"] == 0
    assert plain.usage.model_extra["kvbudget"]["document"] is None
    on_doc = c.completions.create(model=NAME, prompt=" and then?", max_tokens=2,
                                  extra_body={"kvbudget": {"document": doc["id"]}})  # fmt: skip
    assert on_doc.usage.model_extra["kvbudget"]["reused_tokens"] == doc["tokens"]
    assert on_doc.usage.prompt_tokens > doc["tokens"]
    httpx.delete(base + f"/v1/kvbudget/documents/{doc['id']}", timeout=30)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({}, 400, "give the document's text or its token_ids"),
        ({"text": "x", "token_ids": [1]}, 400, "give the document's text or its token_ids"),
        ({"text": "x", "method": "h2o", "budget": 8}, 400, "compresses while decoding"),
        ({"text": "x", "method": "nope"}, 400, "nope"),
        ({"text": "x", "model": "other"}, 404, "does not exist"),
        ({"token_ids": [10**9]}, 400, "token_ids must be in"),
        ({"text": "x", "memory": 0.2, "ratio": 0.5}, 400, "give memory or budget/ratio/kv_bits"),
        (
            {"text": "x", "method": "kvzip:memory=0.2", "ratio": 0.5},
            400,
            "give memory or budget/ratio/kv_bits",
        ),
        ({"text": "x", "method": "full:kv_bits=4", "kv_bits": 8}, 400, "kv_bits is given twice"),
    ],
)
def test_bad_documents_are_refused_in_one_line(server, body, status, message) -> None:
    base, _ = server
    response = _create(base, **body)
    assert response.status_code == status, response.text
    error = response.json()["error"]["message"]
    assert message in error and "\n" not in error


def test_bad_requests_on_documents_are_refused_in_one_line(server) -> None:
    base, _ = server
    c = _client(base)
    with pytest.raises(openai.NotFoundError) as unknown:
        c.completions.create(
            model=NAME, prompt="x", max_tokens=2, extra_body={"kvbudget": {"document": "doc-x"}}
        )
    assert "no document 'doc-x'" in unknown.value.body["message"]
    with pytest.raises(openai.BadRequestError) as both:
        c.completions.create(model=NAME, prompt="x", max_tokens=2,
                             extra_body={"kvbudget": {"document": "doc-x", "method": "full"}})  # fmt: skip
    assert "runs the document's compression" in both.value.body["message"]
    ids_doc = _create(base, token_ids=list(range(5, 80))).json()
    with pytest.raises(openai.BadRequestError) as chat_on_ids:
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  extra_body={"kvbudget": {"document": ids_doc["id"]}})  # fmt: skip
    assert "was given as token ids" in chat_on_ids.value.body["message"]
    short = _create(base, text="abc", method="full").json()["id"]
    with pytest.raises(openai.BadRequestError) as system_first:
        c.chat.completions.create(
            model=NAME, max_tokens=2, extra_body={"kvbudget": {"document": short}},
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        )  # fmt: skip
    assert "begins with the user's message" in system_first.value.body["message"]
    assert httpx.delete(base + "/v1/kvbudget/documents/doc-none", timeout=30).status_code == 404


SYSTEM = "You answer questions about this manual. " + DOCUMENT[:300]


def test_requests_with_one_long_system_prompt_share_it_compressed_once(model_and_tokenizer) -> None:
    """A long system prompt followed by a short question: compressed once with the server's document
    method, shared by every request beginning with it; the answers are the full cache's when the
    document method is ``full``, and a request whose rest is longer than its system prompt is served
    as usual."""
    model, tokenizer = model_and_tokenizer

    def serve(share):
        scheduler = Scheduler(model, tokenizer, 64 << 20, default=Compression("full"),
                              document_default=Compression("full"))  # fmt: skip
        return scheduler, serving(create_app(scheduler, NAME, share_prefix_tokens=share))

    def ask(base, question):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return _client(base).chat.completions.create(model=NAME, messages=messages, max_tokens=TOKENS)

    _, plain = serve(None)
    with plain as base:
        expected = {q: ask(base, q).choices[0].message.content for q in QUESTIONS}
    scheduler, shared = serve(64)
    with shared as base:
        answers: dict[str, object] = {}
        threads = [
            threading.Thread(target=lambda q=q: answers.__setitem__(q, ask(base, q))) for q in QUESTIONS
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        (doc,) = httpx.get(base + "/v1/kvbudget/documents", timeout=30).json()["data"]
        assert doc["tokens"] >= 64 and not doc["pending"]
        for q in QUESTIONS:
            usage = answers[q].usage.model_extra["kvbudget"]
            assert answers[q].choices[0].message.content == expected[q]
            assert usage["document"] == doc["id"] and usage["reused_tokens"] == doc["tokens"]
        assert _gauge(base, "kvbudget_kv_bytes_documents") == doc["kv_bytes"]
        long_rest = ask(base, DOCUMENT[:420])  # longer than the system prompt: not shared
        assert long_rest.usage.model_extra["kvbudget"]["document"] is None
        own = _client(base).chat.completions.create(  # its own compression asked for: not shared
            model=NAME,
            max_tokens=2,
            extra_body={"kvbudget": {"method": "snapkv:window=8", "budget": 64}},
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}],
        )
        assert own.usage.model_extra["kvbudget"]["document"] is None


def test_the_servers_document_precision_applies_to_a_full_document_unless_the_body_says(
    model_and_tokenizer,
) -> None:
    """`--document-method full:kv_bits=4`: a document posted without a method is stored at 4 bits
    (fewer bytes than the same document in the model's dtype); one asking for `kv_bits: 16`, or
    naming its own precision, gets that."""
    model, tokenizer = model_and_tokenizer
    scheduler = Scheduler(model, tokenizer, 64 << 20, default=Compression("full"),
                          document_default=Compression.from_spec("full:kv_bits=4"))  # fmt: skip
    with serving(create_app(scheduler, NAME)) as base:
        by_default = _create(base, text=DOCUMENT).json()
        in_dtype = _create(base, text=DOCUMENT, kv_bits=16).json()
        at_two = _create(base, text=DOCUMENT, method="full", kv_bits=2).json()
        spec_form = _create(base, text=DOCUMENT, method="full:kv_bits=2").json()  # as --document-method
        spec16 = _create(base, text=DOCUMENT, method="full:kv_bits=16").json()
    assert (by_default["method"], by_default["kv_bits"]) == ("full", 4)
    assert in_dtype["kv_bits"] is None and at_two["kv_bits"] == 2  # None: the model's dtype
    assert (spec_form["method"], spec_form["kv_bits"], spec_form["kv_bytes"]) == (
        "full",
        2,
        at_two["kv_bytes"],
    )
    assert spec16["kv_bits"] is None and spec16["kv_bytes"] == in_dtype["kv_bytes"]
    assert at_two["kv_bytes"] < by_default["kv_bytes"] < in_dtype["kv_bytes"] / 2
