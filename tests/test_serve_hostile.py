"""``kvbudget serve`` under hostile and careless clients, on a live server on 127.0.0.1 (a free port, a
tiny random model): over 500 generated malformed and extreme requests (Hypothesis) never get a 5xx
nor a long body, each 4xx is one line in OpenAI's error format, and a good request sent meanwhile
gets ``kvbudget.generate``'s answer; the body and prompt limits bound the work before a refusal;
unsupported OpenAI parameters and unknown roles are refused by name; a failure in the model thread
answers that request alone with a 500 and a request id, in one log line; every request has its
access line; the metrics count requests by status, refusals by reason and reused tokens."""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import kvbudget
from conftest import tiny_model, tiny_tokenizer
from kvbudget.serve import batcher
from kvbudget.serve import scheduler as scheduler_module
from kvbudget.serve.app import create_app, serving
from kvbudget.serve.batcher import Compression
from kvbudget.serve.openai_api import APIError, parse_request
from kvbudget.serve.scheduler import Scheduler

NAME = "tiny"
MAX_BODY = 64 << 10
MAX_PROMPT_TOKENS = 600
#: bytes any answer to a generated request may have: errors are one short line, answers 2 tokens
BODY_BOUND = 2048
GOOD_TEXT = "the quick brown fox jumps over the lazy dog " * 3
DEFAULT = Compression("snapkv:window=8", 24)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("llama"), tiny_tokenizer(chat_template=True)


@pytest.fixture(scope="module")
def server(model_and_tokenizer) -> Iterator[tuple[str, Scheduler]]:
    model, tokenizer = model_and_tokenizer
    scheduler = Scheduler(model, tokenizer, memory_cap=32 << 20, default=DEFAULT)
    app = create_app(scheduler, NAME, max_body=MAX_BODY, max_prompt_tokens=MAX_PROMPT_TOKENS)
    with serving(app) as base:
        yield base, scheduler


def expected_answer(model_and_tokenizer, text: str, max_tokens: int) -> str:
    model, tokenizer = model_and_tokenizer
    method = kvbudget.make_method("snapkv", window=8)
    return kvbudget.generate(model, tokenizer, text, method=method, budget=24, max_new_tokens=max_tokens).text


def good_chat(base: str, text: str = GOOD_TEXT, max_tokens: int = 6) -> str:
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    answer = c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": text}], max_tokens=max_tokens
    )
    return answer.choices[0].message.content


# ---------------------------------------------------------------- generated requests
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-300, -0.0, 5e-324, 1e308, 0.5, 2.0000001]),
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec=None), max_size=20),  # surrogates and control characters
    st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "‮evil", "🦊" * 10, "x" * 5000]),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
#: fields of both endpoints, misspellings, OpenAI's unsupported ones and kvbudget's own
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "seed", "stop", "stream", "stream_options", "n", "user", "kvbudget", "logprobs", "top_logprobs",
    "tools", "tool_choice", "response_format", "logit_bias", "presence_penalty", "frequency_penalty",
    "echo", "suffix", "best_of", "functions", "modalities", "metadata", "store", "temprature",
    "max_token", "mesages", "kv_budget", "", "\ud800",
]  # fmt: skip
ROLES = st.sampled_from(["user", "system", "assistant", "developer", "tool", "function", "usr",
                         "User", "", "\u0000", "assistant "])  # fmt: skip
KVBUDGET_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "method": st.one_of(
            st.sampled_from(
                [
                    "snapkv",
                    "full",
                    "h2o",
                    "asl",
                    "lava",
                    "snapkv:window=8",
                    "nope",
                    "snapkv:window=-1",
                    "snapkv:window=1e9",
                    "snapkv@nope",
                    "a" * 300,
                ]
            ),  # fmt: skip
            JSON_SCALARS,
        ),
        "budget": st.one_of(st.integers(min_value=-5, max_value=2000), JSON_SCALARS),
        "ratio": st.one_of(st.floats(), JSON_SCALARS),
        "ignore_eos": JSON_SCALARS,
        "bits": JSON_SCALARS,
    },
)
#: extreme but well-formed compression: every method kind at sizes around its minimum
PLAUSIBLE_KVBUDGET = st.one_of(
    st.fixed_dictionaries({
        "method": st.sampled_from(["snapkv", "pyramidkv", "h2o", "asl", "fastkv", "lava", "cake", "tova",
                                   "streamingllm", "gemfilter", "chunkkv", "full", "snapkv:window=4"]),
        "ratio": st.floats(min_value=0.01, max_value=1.0),
    }),
    st.fixed_dictionaries({
        "method": st.sampled_from(["snapkv", "ada-snapkv", "h2o", "asl", "fastkv", "lava", "d2o", "tova"]),
        "budget": st.integers(min_value=1, max_value=120),
    }),
)  # fmt: skip
MESSAGES = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": ROLES, "content": st.one_of(st.text(max_size=60), JSON_VALUES)}),
        st.fixed_dictionaries(
            {
                "role": ROLES,
                "content": st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.sampled_from(["text", "image_url", "input_audio"]),
                            "text": st.text(max_size=20),
                        }
                    ),
                    max_size=3,
                ),
            },  # fmt: skip
            optional={"name": JSON_SCALARS, "tool_calls": JSON_VALUES},
        ),
        JSON_VALUES,
    ),
    max_size=4,
)


@st.composite
def mutated_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """An endpoint and a raw body: a good request with fields set, removed or broken."""
    endpoint = draw(st.sampled_from(["chat/completions", "completions"]))
    body: dict = {"model": NAME, "max_tokens": 2}
    if endpoint == "chat/completions":
        body["messages"] = [{"role": "user", "content": GOOD_TEXT[: draw(st.integers(1, 60))]}]
    else:
        body["prompt"] = GOOD_TEXT[: draw(st.integers(1, 60))]
    for _ in range(draw(st.integers(1, 4))):
        field = draw(st.sampled_from(FIELDS))
        kind = draw(st.sampled_from(["value", "delete", "messages", "kvbudget", "plausible", "plausible"]))
        if kind == "delete":
            body.pop(field, None)
        elif kind == "messages":
            body["messages"] = draw(MESSAGES)
        elif kind == "kvbudget":
            body["kvbudget"] = draw(KVBUDGET_OPTIONS)
        elif kind == "plausible":
            body["kvbudget"] = draw(PLAUSIBLE_KVBUDGET)
        else:
            body[field] = draw(JSON_VALUES)
    if body.get("max_tokens") is not None and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = (
            body["max_tokens"] if body["max_tokens"] <= 4 or body["max_tokens"] > 10**6 else 4
        )
    if isinstance(body.get("max_completion_tokens"), int) and 4 < body["max_completion_tokens"] <= 10**6:
        body["max_completion_tokens"] = 4  # answers stay short; huge values must still be refused
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    wreck = draw(st.sampled_from(["none"] * 6 + ["truncate", "nest", "bytes", "bignum", "array"]))
    if wreck == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif wreck == "nest":
        depth = draw(st.sampled_from([50, 500, 20000]))
        raw = b'{"model": "tiny", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    elif wreck == "bytes":
        raw = draw(st.binary(max_size=200))
    elif wreck == "bignum":
        raw = raw[:-1] + b', "seed": ' + b"9" * draw(st.sampled_from([20, 4301, 20000])) + b"}"
    elif wreck == "array":
        raw = b"[" + raw + b"]"
    return endpoint, raw


class Sent:
    count = 0
    statuses: dict[int, int] = {}


def check_answer(response: httpx.Response, stream: bool) -> None:
    assert response.status_code < 500, response.text[:300]
    assert len(response.content) <= BODY_BOUND or (stream and response.status_code == 200)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and 0 < len(error["message"]) <= 400
        assert "\n" not in error["message"]
    elif stream:
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_generated_hostile_requests_never_get_a_5xx_and_a_good_one_meanwhile_gets_its_answer(
    server, model_and_tokenizer
) -> None:
    base, scheduler = server
    expected = expected_answer(model_and_tokenizer, GOOD_TEXT, 6)
    stop = threading.Event()
    good: list[str] = []

    def keep_asking() -> None:
        while not stop.is_set():
            good.append(good_chat(base))

    meanwhile = threading.Thread(target=keep_asking)
    meanwhile.start()
    Sent.count, Sent.statuses = 0, {}
    with httpx.Client(base_url=base + "/v1", timeout=120) as http:

        @settings(max_examples=520, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(mutated_bodies())
        def send(case: tuple[str, bytes]) -> None:
            endpoint, raw = case
            response = http.post(endpoint, content=raw, headers={"content-type": "application/json"})
            Sent.count += 1
            Sent.statuses[response.status_code] = Sent.statuses.get(response.status_code, 0) + 1
            check_answer(response, b'"stream": true' in raw)

        try:
            send()
        finally:
            stop.set()
            meanwhile.join(120)
    assert Sent.count >= 500
    assert sum(n for status, n in Sent.statuses.items() if 400 <= status < 500) > Sent.count // 2
    assert good and all(answer == expected for answer in good)
    assert good_chat(base) == expected  # still serving
    assert httpx.get(base + "/health").json()["status"] == "ok"
    assert scheduler.stats()["active"] == 0 and scheduler.stats()["queued"] == 0


# ---------------------------------------------------------------- limits before work
def test_a_body_over_the_limit_gets_413_before_it_is_parsed(server) -> None:
    base, _ = server
    huge = b'{"model": "tiny", "prompt": "' + b"x" * (10 << 20) + b'"}'
    response = httpx.post(base + "/v1/completions", content=huge, timeout=60)
    assert response.status_code == 413
    assert "--max-body" in response.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused while reading
        for _ in range(200):
            yield b"x" * 4096

    response = httpx.post(base + "/v1/completions", content=chunks(), timeout=60)
    assert response.status_code == 413
    assert good_chat(base)


class CountingTokenizer:
    """The tiny tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, tokenizer) -> None:
        self.inner, self.characters = tokenizer, 0

    def __call__(self, text: str, **kwargs):
        self.characters += len(text)
        return self.inner(text, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_prompt_over_the_token_limit_is_refused_after_bounded_work(endpoint) -> None:
    tokenizer = CountingTokenizer(tiny_tokenizer(chat_template=True))
    text = "abcd " * 200_000  # a million characters: a million tokens of the character tokenizer
    body = {"model": NAME, "messages": [{"role": "user", "content": text}]} if endpoint == "chat" else {
        "model": NAME, "prompt": text}  # fmt: skip
    with pytest.raises(APIError) as refused:
        parse_request(endpoint, json.dumps(body).encode(), NAME, tokenizer, DEFAULT, MAX_PROMPT_TOKENS)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert f"more than {MAX_PROMPT_TOKENS} tokens" in refused.value.message
    assert tokenizer.characters < 20_000  # not the million


def test_error_messages_quote_little_of_the_input(server) -> None:
    base, _ = server
    long = "m" * 30_000  # under the body limit: the fields themselves are long
    for body in ({"model": long, "messages": [{"role": "user", "content": "x"}]},
                 {"model": NAME, "messages": [{"role": long, "content": "x"}]},
                 {"model": NAME, "messages": [{"role": "user", "content": "x"}], "stop": [long]},
                 {"model": NAME, "prompt": "x", "kvbudget": {"method": long[:200]}}):  # fmt: skip
        endpoint = "completions" if "prompt" in body else "chat/completions"
        response = httpx.post(f"{base}/v1/{endpoint}", json=body, timeout=60)
        assert response.status_code in (400, 404) and len(response.content) < 1000


# ---------------------------------------------------------------- refused by name, accepted as no-ops
@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "tool"),
        ({"messages": [{"role": "usr", "content": "x"}]}, "unknown role 'usr'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "image_url"),
        ({"temperatur": 0.5}, "unknown field temperatur"),
        ({"top_p": math.nan}, "top_p"),
        ({"temperature": math.inf}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"n": 2}, "n:"),
        ({"kvbudget": {"method": "snapkv", "bits": 4}}, "unknown field kvbudget.bits"),
    ],
)  # fmt: skip
def test_what_the_server_does_not_do_is_refused_by_name(server, extra, named) -> None:
    base, _ = server
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
    response = httpx.post(base + "/v1/chat/completions", content=json.dumps(body, allow_nan=True), timeout=60)
    assert response.status_code == 400
    assert named in response.json()["error"]["message"]


def test_no_op_values_of_unsupported_parameters_and_the_developer_role_are_served(server) -> None:
    base, _ = server
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    answer = c.chat.completions.create(
        model=NAME, max_tokens=3, logprobs=False, tools=[], presence_penalty=0, frequency_penalty=0,
        response_format={"type": "text"}, user="someone", temperature=1e-300,
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": GOOD_TEXT}],
    )  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------- usage, logs, metrics
def test_usage_reports_what_the_request_ran(server) -> None:
    base, _ = server
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": GOOD_TEXT}]

    def ran(**kvbudget_options):
        extra = {"extra_body": {"kvbudget": kvbudget_options}} if kvbudget_options else {}
        usage = c.chat.completions.create(model=NAME, messages=messages, max_tokens=2, **extra).usage
        info = usage.model_extra["kvbudget"]
        return info["method"], info["budget"], info["ratio"]

    assert ran() == ("snapkv:window=8", 24, None)
    assert ran(method="full") == ("full", None, None)
    assert ran(method="h2o", ratio=0.5) == ("h2o", None, 0.5)


def test_a_failure_in_the_model_thread_answers_that_request_alone_and_logs_one_line(
    server, model_and_tokenizer, monkeypatch, caplog
) -> None:
    base, _ = server
    expected = expected_answer(model_and_tokenizer, GOOD_TEXT, 6)
    sample = batcher.sample_token

    def failing_sample(seq, logits):
        if seq.seed == 666 and len(seq.generated) == 2:
            raise RuntimeError("boom\nsecond line")
        return sample(seq, logits)

    prefill = scheduler_module.prefill_sequence

    def failing_prefill(model, seq, pad_id, reuse=None):
        if seq.seed == 667:
            raise ValueError("broken prefill")
        return prefill(model, seq, pad_id, reuse)

    monkeypatch.setattr(batcher, "sample_token", failing_sample)
    monkeypatch.setattr(scheduler_module, "prefill_sequence", failing_prefill)
    caplog.set_level(logging.INFO, logger="kvbudget.serve")
    results: dict[str, object] = {}
    threads = [threading.Thread(target=lambda: results.update(good=good_chat(base)))]
    for seed in (666, 667):
        body = {"model": NAME, "messages": [{"role": "user", "content": GOOD_TEXT}], "max_tokens": 6,
                "seed": seed, "temperature": 0.7}  # fmt: skip
        threads.append(threading.Thread(target=lambda b=body, s=seed: results.update(
            {s: httpx.post(base + "/v1/chat/completions", json=b, timeout=120)})))  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["good"] == expected
    for seed, cause in ((666, "RuntimeError: boom second line"), (667, "ValueError: broken prefill")):
        response = results[seed]
        assert response.status_code == 500
        error = response.json()["error"]
        rid = response.headers["x-request-id"]
        assert error["type"] == "server_error" and rid in error["message"] and cause in error["message"]
        lines = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
        failures = [line for line in lines if "failed in the model thread" in line]
        assert failures == [f"request {rid} failed in the model thread: {cause}"]
        assert any(line.startswith("POST /v1/chat/completions 500 ") for line in lines)
    assert not any(r.exc_info for r in caplog.records if r.levelno >= logging.INFO)


def test_every_request_has_one_access_line_with_its_id(server, caplog) -> None:
    base, _ = server
    caplog.set_level(logging.INFO, logger="kvbudget.serve.access")
    ok = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": NAME, "messages": [{"role": "user", "content": GOOD_TEXT}], "max_tokens": 3})  # fmt: skip
    bad = httpx.post(base + "/v1/chat/completions", timeout=60, json={"model": NAME})
    missing = httpx.get(base + "/nowhere", timeout=60)
    lines = {r.getMessage() for r in caplog.records if r.name == "kvbudget.serve.access"}
    for response, start in ((ok, "POST /v1/chat/completions 200 in="), (bad, "POST /v1/chat/completions 400"),
                            (missing, "GET /nowhere 404")):  # fmt: skip
        rid = response.headers["x-request-id"]
        mine = [line for line in lines if line.endswith(f"id={rid}")]
        assert len(mine) == 1 and mine[0].startswith(start), mine
    (line,) = [line for line in lines if line.endswith(ok.headers["x-request-id"])]
    assert " out=" in line and " ttft=" in line and " kv=" in line
    assert not any(r.exc_info for r in caplog.records)


def test_metrics_count_requests_refusals_and_reused_tokens(server) -> None:
    base, _ = server

    def counts() -> dict[tuple, float]:
        text = httpx.get(base + "/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
        }  # fmt: skip

    before = counts()
    question = [{"role": "user", "content": GOOD_TEXT + " first?"}]
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    first = c.chat.completions.create(model=NAME, messages=question, max_tokens=3)
    follow = [*question, {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "and?"}]  # fmt: skip
    reused = c.chat.completions.create(model=NAME, messages=follow, max_tokens=3).usage.model_extra
    httpx.post(base + "/v1/chat/completions", json={"model": NAME, "messages": [], "logprobs": True})
    httpx.post(base + "/v1/completions", content=b"x" * (MAX_BODY + 1))
    after = counts()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("kvbudget_requests_total", route="/v1/chat/completions", status="200") == 2
    assert grew("kvbudget_requests_total", route="/v1/chat/completions", status="400") == 1
    assert grew("kvbudget_rejected_requests_total", reason="invalid_request") == 1
    assert grew("kvbudget_rejected_requests_total", reason="request_too_large") == 1
    assert grew("kvbudget_reused_prompt_tokens_total") == reused["kvbudget"]["reused_tokens"] > 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--log-level", "loud"], "--log-level must be one of critical, error, warning, info, debug"),
        (["--max-body", "0"], "--max-body must be positive"),
        (["--max-body", "lots"], "--max-body expects a size such as 2GiB"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be ≥ 1"),
    ],
)
def test_serve_refuses_bad_limits_in_one_line_before_loading_the_model(args, words) -> None:
    from typer.testing import CliRunner

    from kvbudget.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", "/nonexistent/model", *args])
    assert result.exit_code == 2 and words in result.output, result.output
    assert "Traceback" not in result.output and "/nonexistent/model" not in result.output
