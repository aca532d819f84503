"""``kvbudget serve`` with OpenAI's own client against a live server on 127.0.0.1 (a free port, a
tiny random model): chat and completions, streaming, per-request compression, concurrent requests
equal to ``kvbudget.generate`` alone, the memory cap and the queue, follow-up reuse, disconnects,
bad requests, the API key and the metrics. Every server here stops itself."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvbudget
from conftest import tiny_model, tiny_tokenizer
from kvbudget.methods.spec import MethodSpec
from kvbudget.serve.app import create_app, serving
from kvbudget.serve.batcher import Compression, make_sequence, prefill_peak_bytes
from kvbudget.serve.scheduler import Metrics, Scheduler

NAME = "tiny"
HI = [{"role": "user", "content": "hi"}]
CONTEXT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 2
#: (method spec, budget, ratio) of four concurrent requests
MIXED = [
    ("snapkv:window=8", 24, None),
    ("full", None, None),
    ("h2o", 32, None),
    ("ada-snapkv:window=8", None, 0.5),
]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model = tiny_model("llama")
    tokenizer = tiny_tokenizer(chat_template=True)
    return model, tokenizer


def live(scheduler: Scheduler, api_key: str | None = None):
    """Serve ``scheduler`` on a free port of 127.0.0.1 (a context manager yielding the base URL)."""
    return serving(create_app(scheduler, NAME, None, api_key))


def client(base: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def chat(c: openai.OpenAI, text: str, max_tokens: int = 12, **extra):
    return c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, **extra
    )


def alone(model, tokenizer, text: str, spec: str, budget, ratio, max_tokens: int) -> str:
    sizes = {"budget": budget, "ratio": ratio} if spec != "full" else {}
    method = MethodSpec.parse(spec).build()
    return kvbudget.generate(model, tokenizer, text, method=method, max_new_tokens=max_tokens, **sizes).text


@pytest.fixture(scope="module")
def server(model_and_tokenizer) -> Iterator[tuple[str, Scheduler]]:
    model, tokenizer = model_and_tokenizer
    scheduler = Scheduler(model, tokenizer, memory_cap=64 << 20, default=Compression("snapkv:window=8", 24))
    with live(scheduler) as base:
        yield base, scheduler


def test_chat_and_completions_answer_with_openai_shapes(server, model_and_tokenizer) -> None:
    base, _ = server
    model, tokenizer = model_and_tokenizer
    c = client(base)
    answer = chat(c, CONTEXT)
    assert answer.object == "chat.completion" and answer.model == NAME
    assert answer.choices[0].message.content == alone(
        model, tokenizer, CONTEXT, "snapkv:window=8", 24, None, 12
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    usage = answer.usage
    assert (
        usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and usage.completion_tokens >= 1
    )
    extra = usage.model_extra["kvbudget"]
    assert extra["method"] == "snapkv:window=8" and 0 < extra["kept_entries"] and extra["kv_bytes"] > 0
    completion = c.completions.create(model=NAME, prompt=CONTEXT, max_tokens=5)
    assert completion.object == "text_completion" and completion.usage.completion_tokens <= 5
    assert [m.id for m in c.models.list().data] == [NAME]
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_streaming_gives_the_same_answer_in_chunks(server) -> None:
    base, _ = server
    c = client(base)
    whole = chat(c, CONTEXT, 10).choices[0].message.content
    chunks = list(chat(c, CONTEXT, 10, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_four_concurrent_requests_with_their_own_methods_equal_generate_alone(
    server, model_and_tokenizer
) -> None:
    base, scheduler = server
    model, tokenizer = model_and_tokenizer
    texts = [CONTEXT[i:] + f" question {i}?" for i in range(len(MIXED))]
    expected = [alone(model, tokenizer, t, s, b, r, 16) for t, (s, b, r) in zip(texts, MIXED, strict=True)]
    scheduler.peak_active = 0
    got: dict[int, tuple[str, str]] = {}

    def ask(i: int) -> None:
        spec, budget, ratio = MIXED[i]
        body = {
            "method": spec,
            **({"budget": budget} if budget else {}),
            **({"ratio": ratio} if ratio else {}),
        }
        answer = chat(client(base), texts[i], 16, extra_body={"kvbudget": body})
        got[i] = (answer.choices[0].message.content, answer.usage.model_extra["kvbudget"]["method"])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(MIXED))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i][0] for i in range(len(MIXED))] == expected
    assert [got[i][1] for i in range(len(MIXED))] == [m for m, _, _ in MIXED]
    assert scheduler.peak_active >= 2  # they were decoded together


def test_requests_at_other_precisions_decode_together_and_equal_generate_alone(
    server, model_and_tokenizer
) -> None:
    base, scheduler = server
    model, tokenizer = model_and_tokenizer
    runs = [("snapkv:window=8", 60, 4), ("full", None, 8), ("h2o", 60, 2)]
    texts = [CONTEXT[i:] + f" and {i}?" for i in range(len(runs))]
    expected = []
    for text, (spec, budget, bits) in zip(texts, runs, strict=True):
        sizes = {"budget": budget} if budget else {}
        expected.append(kvbudget.generate(model, tokenizer, text, method=MethodSpec.parse(spec).build(),
                                          max_new_tokens=12, kv_bits=bits, **sizes).text)  # fmt: skip
    scheduler.peak_active = 0
    got: dict[int, tuple[str, dict]] = {}

    def ask(i: int) -> None:
        spec, budget, bits = runs[i]
        body = {"method": spec, "kv_bits": bits, **({"budget": budget} if budget else {})}
        answer = chat(client(base), texts[i], 12, extra_body={"kvbudget": body})
        got[i] = (answer.choices[0].message.content, answer.usage.model_extra["kvbudget"])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i][0] for i in range(len(runs))] == expected
    assert [got[i][1]["kv_bits"] for i in range(len(runs))] == [4, 8, 2]
    assert scheduler.peak_active >= 2


@pytest.mark.parametrize("bits", [3, 32, "4", True])
def test_other_kv_bits_get_a_400_in_one_line(server, bits) -> None:
    base, _ = server
    response = httpx.post(
        base + "/v1/chat/completions",
        json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "kvbudget": {"kv_bits": bits}},
    )
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "kv_bits" in message and "\n" not in message


class HoldFirstPrefill(Metrics):
    """Holds the worker after the first request's prefill until :attr:`release` is set, so the test
    arranges the queue while that request is active (however fast the machine decodes)."""

    def __init__(self) -> None:
        self.holding, self.release = threading.Event(), threading.Event()

    def ttft(self, seconds: float) -> None:
        if not self.holding.is_set():
            self.holding.set()
            self.release.wait(120)


def test_the_cap_is_never_exceeded_requests_queue_and_a_full_queue_gets_429(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": CONTEXT}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    comp = Compression("full")
    one = prefill_peak_bytes(
        model, make_sequence(ids, 40, {1}, comp, method=MethodSpec.parse("full").build())
    )
    gate = HoldFirstPrefill()
    scheduler = Scheduler(
        model, tokenizer, memory_cap=int(one * 1.5), default=comp, max_queue=1, keep_turns=False,
        metrics=gate,
    )  # fmt: skip
    with live(scheduler) as base:
        results: dict[int, object] = {}

        def ask(i: int) -> None:
            try:
                results[i] = chat(client(base), CONTEXT, 40).usage.completion_tokens
            except openai.RateLimitError as exc:
                results[i] = exc

        first = threading.Thread(target=ask, args=(0,))
        first.start()
        try:
            assert gate.holding.wait(120)  # the first request is active, its prefill done
            assert scheduler.stats()["active"] == 1
            second = threading.Thread(target=ask, args=(1,))
            second.start()
            deadline = time.monotonic() + 120
            while scheduler.stats()["queued"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert scheduler.stats()["queued"] == 1  # no room beside the first: it waits
            ask(2)  # the queue (one place) is taken: refused at once
        finally:
            gate.release.set()
        first.join(120)
        second.join(120)
    assert isinstance(results[2], openai.RateLimitError)
    assert results[2].response.headers["retry-after"] == "1"
    assert "queue is full" in results[2].message
    assert isinstance(results[0], int) and isinstance(results[1], int)  # queued, then served
    assert scheduler.peak_active == 1 and 0 < scheduler.peak_held_bytes <= scheduler.memory_cap


def test_a_follow_up_reuses_its_conversation_cache(server) -> None:
    base, scheduler = server
    c = client(base)
    question = [{"role": "user", "content": CONTEXT + " first?"}]
    first = c.chat.completions.create(model=NAME, messages=question, max_tokens=8)
    follow = [*question, {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "and then?"}]  # fmt: skip
    second = c.chat.completions.create(model=NAME, messages=follow, max_tokens=8)
    reused = second.usage.model_extra["kvbudget"]["reused_tokens"]
    assert reused >= first.usage.prompt_tokens
    other = c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "unrelated"}], max_tokens=4
    )
    assert other.usage.model_extra["kvbudget"]["reused_tokens"] == 0  # no prefix of another conversation


def test_a_client_that_disconnects_frees_its_cache(server) -> None:
    base, scheduler = server
    scheduler.keep_turns = False
    try:
        before = scheduler.stats()["held_bytes"]
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": CONTEXT}],
            "max_tokens": 400,
            "stream": True,
        }
        with httpx.stream("POST", base + "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            assert scheduler.stats()["active"] == 1
        deadline = time.monotonic() + 30
        while scheduler.stats()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.stats()["active"] == 0 and scheduler.stats()["held_bytes"] == before
    finally:
        scheduler.keep_turns = True


def test_a_whole_answer_whose_request_is_cancelled_stops_decoding(model_and_tokenizer) -> None:
    """A server that cancels a request's task (Ray Serve does when the client leaves) stops its
    sequence at the next step, long before ``max_tokens``: the non-streamed path cancels the job."""
    model, tokenizer = model_and_tokenizer

    released = threading.Event()

    class CountTokens(Metrics):
        """Counts tokens; after the first few the scheduler waits here until the request has been
        cancelled, so a fast model cannot finish the answer before the cancel lands."""

        generated = 0

        def tokens(self, count: int) -> None:
            self.generated += count
            if self.generated >= 3:
                released.wait(30)

    metrics = CountTokens()
    scheduler = Scheduler(model, tokenizer, memory_cap=64 << 20, default=Compression("full"),
                          keep_turns=False, metrics=metrics)  # fmt: skip
    app = create_app(scheduler, NAME)  # ASGITransport runs no lifespan: the scheduler is started here
    body = {"model": NAME, "messages": HI, "max_tokens": 900, "kvbudget": {"ignore_eos": True}}

    async def ask_then_cancel() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvbudget") as http:
            request = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            deadline = time.monotonic() + 60
            while scheduler.stats()["active"] == 0 and not request.done():
                assert time.monotonic() < deadline, "the request never became active"
                await asyncio.sleep(0.001)
            assert not request.done(), request.result().text  # answered before it was cancelled
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            released.set()
            deadline = time.monotonic() + 30  # the loop lives on, as a server's does
            while scheduler.stats()["active"] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)

    scheduler.start()
    try:
        asyncio.run(ask_then_cancel())
        assert scheduler.stats()["active"] == 0 and metrics.generated < 450  # of 899 decode steps
    finally:
        released.set()
        scheduler.stop()


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": "gpt-9", "messages": HI}, 404, "does not exist"),
        ({"model": NAME, "messages": [{"role": "user", "content": "x" * 1100}]}, 400, "limit of 1024"),
        ({"model": NAME, "messages": HI, "kvbudget": {"method": "nope"}}, 400, "unknown method"),
        ({"model": NAME, "messages": HI, "kvbudget": {"budget": 0}}, 400, "kvbudget.budget: input"),
        ({"model": NAME, "messages": HI, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": NAME, "messages": []}, 400, "messages"),
    ],
)  # fmt: skip
def test_bad_requests_get_a_4xx_with_one_line_while_others_are_served(server, body, status, words) -> None:
    base, _ = server
    good: dict[str, str] = {}
    thread = threading.Thread(
        target=lambda: good.update(text=chat(client(base), CONTEXT, 6).choices[0].message.content)
    )
    thread.start()
    raw = {"content": body, "headers": {"content-type": "application/json"}}
    kwargs = raw if isinstance(body, bytes) else {"json": body}
    response = httpx.post(base + "/v1/chat/completions", timeout=60, **kwargs)
    thread.join(120)
    assert response.status_code == status
    message = response.json()["error"]["message"]
    assert words in message and "\n" not in message
    assert good["text"] is not None  # the concurrent good request completed


def test_a_wrong_or_missing_key_gets_401(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    scheduler = Scheduler(model, tokenizer, memory_cap=16 << 20, default=Compression("full"))
    with live(scheduler, api_key="sesame") as base:
        with pytest.raises(openai.AuthenticationError):
            chat(client(base, "wrong"), "hi", 2)
        assert httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "hi"}).status_code == 401
        assert httpx.get(base + "/metrics").status_code == 401
        assert chat(client(base, "sesame"), "hi", 2).usage.completion_tokens >= 1


def test_metrics_parse_as_prometheus_text(server) -> None:
    base, scheduler = server
    chat(client(base), CONTEXT, 3)
    text = httpx.get(base + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["kvbudget_kv_bytes_cap"].samples[0].value == scheduler.memory_cap
    for name in ("kvbudget_active_sequences", "kvbudget_queued_requests", "kvbudget_kv_bytes_held"):
        assert name in families


@pytest.mark.integration
def test_the_real_model_reuses_a_conversation_and_answers_the_follow_up_sooner(real_model) -> None:
    """smollm2-135m (Q4_1 GGUF weights, dequantized to float32): a follow-up that extends the first
    turn prefills only its new tokens, so its first token comes sooner than the first turn's."""
    model, tokenizer = real_model
    scheduler = Scheduler(model, tokenizer, memory_cap=256 << 20, default=Compression("snapkv", 128))
    context = " ".join(f"Item {i} is stored in box {i * 7 % 31}." for i in range(150))
    with live(scheduler) as base:
        c = client(base)

        def first_token_seconds(messages: list[dict]) -> tuple[float, str, dict]:
            start, first, text, usage = time.perf_counter(), None, [], {}
            stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, stream=True,
                                               stream_options={"include_usage": True})  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first if first is not None else time.perf_counter() - start
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage:
                    usage = chunk.usage.model_extra["kvbudget"]
            return first, "".join(text), usage

        turn = [{"role": "user", "content": context + "\nWhere is item 12?"}]
        ttft_first, answer, first_usage = first_token_seconds(turn)
        follow = [
            *turn,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And item 13?"},
        ]
        ttft_follow, _, usage = first_token_seconds(follow)
    assert first_usage["reused_tokens"] == 0 and usage["reused_tokens"] > 1000
    assert ttft_follow < ttft_first


def test_a_byte_budget_request_equals_generate_alone(server, model_and_tokenizer) -> None:
    base, _ = server
    model, tokenizer = model_and_tokenizer
    text = CONTEXT + " and the byte budget?"
    expected = kvbudget.generate(model, tokenizer, text, method=MethodSpec.parse("snapkv:window=8").build(),
                                 max_new_tokens=12, memory=0.3).text  # fmt: skip
    body = {"method": "snapkv:window=8", "memory": 0.3}
    answer = chat(client(base), text, 12, extra_body={"kvbudget": body})
    assert answer.choices[0].message.content == expected
    assert answer.usage.model_extra["kvbudget"]["memory"] == 0.3
    # the spec form `--document-method` and `kvbudget eval` take: the same request
    spec_form = chat(
        client(base), text, 12, extra_body={"kvbudget": {"method": "snapkv:window=8,memory=0.3"}}
    )
    assert spec_form.choices[0].message.content == expected
    assert spec_form.usage.model_extra["kvbudget"]["memory"] == 0.3
    for bad in (
        {"memory": 0.3, "budget": 40}, {"memory": 0}, {"memory": 0.3, "kv_bits": 4},
        {"method": "snapkv:memory=0.3", "memory": 0.2}, {"method": "snapkv:memory=0.3", "ratio": 0.5},
    ):  # fmt: skip
        response = httpx.post(
            base + "/v1/chat/completions",
            json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "kvbudget": bad},
        )
        assert response.status_code == 400 and "memory" in response.json()["error"]["message"]
    twice = httpx.post(base + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}],
        "kvbudget": {"method": "snapkv:kv_bits=4", "kv_bits": 8},
    })  # fmt: skip
    assert twice.status_code == 400
    assert twice.json()["error"]["message"] == (
        "kvbudget: kv_bits is given twice: in the method 'snapkv:kv_bits=4' and as its own field"
    )


def test_the_servers_own_default_stores_every_entry_at_four_bits_and_refuses_a_size_it_would_ignore(
    model_and_tokenizer,
) -> None:
    """A scheduler built without a default runs kvbudget.serve.defaults' (the full cache stored at 4
    bits, chosen by docs/leaderboard.md's rule): a plain request gets `kvbudget.generate`'s answer at
    kv_bits=4; a request that names another method keeps the server's precision unless it gives its
    own; a budget, ratio or byte budget with the full cache would be ignored, so it is a one-line 400."""
    model, tokenizer = model_and_tokenizer
    scheduler = Scheduler(model, tokenizer, memory_cap=64 << 20)
    text = CONTEXT + " where does the fox run?"
    expected = kvbudget.generate(model, tokenizer, text, method="full", kv_bits=4, max_new_tokens=12).text
    with live(scheduler) as base:
        answer = chat(client(base), text, 12)
        assert answer.choices[0].message.content == expected
        used = answer.usage.model_extra["kvbudget"]
        assert (used["method"], used["kv_bits"], used["budget"], used["ratio"]) == ("full", 4, None, None)
        snapkv = {"method": "snapkv:window=8", "budget": 24}
        named = chat(client(base), text, 4, extra_body={"kvbudget": snapkv})
        assert named.usage.model_extra["kvbudget"]["kv_bits"] == 4
        own = chat(client(base), text, 4, extra_body={"kvbudget": {"kv_bits": 16}})
        assert own.usage.model_extra["kvbudget"]["kv_bits"] == 16
        for size, word in (({"ratio": 0.5}, "ratio"), ({"method": "full", "budget": 32}, "budget"),
                           ({"method": "full:memory=0.2"}, "memory")):  # fmt: skip
            response = httpx.post(
                base + "/v1/chat/completions", json={"model": NAME, "messages": HI, "kvbudget": size}
            )
            message = response.json()["error"]["message"]
            assert response.status_code == 400 and "\n" not in message
            assert f"{word} needs a method that evicts" in message and "keeps every entry" in message
