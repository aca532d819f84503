"""The server on Ray Serve: two replicas of a tiny random model (saved to a folder, which each replica
loads) on a local Ray cluster of 2 CPUs, behind Serve's HTTP proxy on 127.0.0.1 and a free port,
asked with OpenAI's own client. Answers, streamed or not, equal ``kvbudget.generate`` alone; both
replicas serve (each answer names its replica); each replica holds its own cap. Also the one-line
errors of a bad deployment, without Ray."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import ray
from ray import serve

import kvbudget
from conftest import tiny_model, tiny_tokenizer
from kvbudget.errors import KVBudgetError
from kvbudget.methods.spec import MethodSpec
from kvbudget.models import load_model
from kvbudget.serve.ray_deployment import REPLICA_HEADER, app_builder, deploy, replica_config

NAME = "tiny"
METHOD, BUDGET = "snapkv:window=8", 24
#: KV bytes per replica: the tiny model's KV is 1 KiB per token (float32), so 512 tokens at most
CAP = 512 << 10
PROMPTS = [
    "the quick brown fox jumps over the lazy dog and keeps running far away",
    "a tiny model on two replicas answers every question the same way",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(path)
    tiny_tokenizer(chat_template=True).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def base(tiny_dir: Path, tmp_path_factory) -> Iterator[str]:
    """Two replicas, one CPU each, serving the tiny model under a cap of :data:`CAP` each, writing
    their documents to one folder."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield deploy(
            str(tiny_dir), port=free_port(), replicas=2, cpus_per_replica=1, memory_cap=CAP,
            method=METHOD, budget=BUDGET, served_name=NAME, device="cpu", dtype="float32",
            cache_dir=str(tmp_path_factory.mktemp("documents")),
            document_method="expected-attention:kv_bits=4",
        )  # fmt: skip
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_dir: Path) -> dict[str, str]:
    """Each prompt's answer (8 tokens) by ``kvbudget.generate`` alone, on the same saved model."""
    model, tokenizer = load_model(tiny_dir, dtype="float32", device="cpu")
    method = MethodSpec.parse(METHOD).build()
    return {
        text: kvbudget.generate(model, tokenizer, text, method=method, budget=BUDGET, max_new_tokens=8).text
        for text in PROMPTS
    }


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(c: openai.OpenAI, text: str, max_tokens: int = 8, **extra):
    return c.chat.completions.with_raw_response.create(
        model=NAME, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, **extra
    )


@pytest.mark.slow
def test_both_replicas_answer_as_generate_alone(base: str, expected: dict[str, str]) -> None:
    c = client(base)
    replicas: set[str] = set()
    for i in range(24):  # Serve routes by load: the first requests may all reach one replica
        raw = ask(c, PROMPTS[i % 2])
        answer = raw.parse()
        assert answer.choices[0].message.content == expected[PROMPTS[i % 2]]
        assert answer.model == NAME and answer.usage.model_extra["kvbudget"]["method"] == METHOD
        replicas.add(raw.headers[REPLICA_HEADER])
        if len(replicas) == 2 and i >= 3:
            break
    assert len(replicas) == 2, f"24 requests all reached {replicas}"

    raw = ask(c, PROMPTS[0], stream=True)
    deltas = [chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices]
    assert "".join(deltas) == expected[PROMPTS[0]] and raw.headers[REPLICA_HEADER] in replicas


@pytest.mark.slow
@pytest.mark.slow
def test_replicas_find_each_others_documents(base: str) -> None:
    """A document one replica made is written to the shared folder; the other finds it there when a
    request names it."""
    made = httpx.post(base + "/v1/kvbudget/documents", json={"text": PROMPTS[1] * 3}, timeout=120)
    assert made.status_code == 200, made.text
    document = made.json()["id"]
    answered_by = set()
    for _ in range(30):
        response = ask(client(base), "what?", extra_body={"kvbudget": {"document": document}})
        assert response.parse().usage.model_extra["kvbudget"]["document"] == document
        answered_by.add(response.headers[REPLICA_HEADER])
        if len(answered_by) == 2:
            break
    assert len(answered_by) == 2 and made.headers[REPLICA_HEADER] in answered_by


def test_each_replica_holds_its_own_cap(base: str) -> None:
    health = httpx.get(base + "/health", timeout=60)
    assert health.json()["cap_bytes"] == CAP and health.headers[REPLICA_HEADER]
    with pytest.raises(openai.BadRequestError, match="more than the server's cap"):
        ask(client(base), "x" * 300, 300, extra_body={"kvbudget": {"method": "full"}})


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"replicas": "two"}, "replicas must be an integer, got 'two'"),
        ({"replicas": "0"}, "replicas must be an integer of at least 1, got 0"),
        ({"modle": "x"}, "unknown argument(s) modle"),
        ({"budget": "24", "ratio": "0.5"}, "either budget or ratio"),
        ({"ratio": "0.5"}, "ratio needs a method that evicts: full:kv_bits=4 keeps every entry"),
        ({"memory_cap": "lots"}, "expects a size such as 2GiB"),
        ({"dtype": "int8"}, "dtype must be one of float32, bfloat16, float16"),
        ({"method": "nope"}, "nope"),
        ({"method": "snapkv:memory=0.125", "ratio": "0.5"}, "give memory or budget/ratio, not both"),
    ],
)
def test_a_bad_deployment_fails_on_the_driver_with_one_line(args: dict[str, str], words: str) -> None:
    with pytest.raises(KVBudgetError) as err:
        app_builder(args)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_local_model_path_is_made_absolute_for_the_replicas(tiny_dir: Path, monkeypatch) -> None:
    monkeypatch.chdir(tiny_dir.parent)
    config = replica_config(tiny_dir.name, memory_cap="1MiB", method="snapkv", ratio=0.5)
    assert config.model == str(tiny_dir.resolve()) and config.served_name == tiny_dir.name
    assert config.memory_cap == 1 << 20 and config.default.ratio == 0.5
    byte_budget = replica_config(tiny_dir.name, method="snapkv:window=8,memory=0.125").default
    assert (byte_budget.method, byte_budget.memory, byte_budget.ratio) == ("snapkv:window=8", 0.125, None)
    assert replica_config(tiny_dir.name, method="full:kv_bits=4").default.kv_bits == 4
    with pytest.raises(KVBudgetError, match="served_name"):
        replica_config(lambda: (None, None))


def test_serve_run_arguments_build_the_application(tiny_dir: Path) -> None:
    """``serve run kvbudget.serve.ray_deployment:app_builder model=... replicas=3 ...``: strings in,
    a Serve application out (nothing starts until Serve runs it)."""
    args = {"model": str(tiny_dir), "replicas": "3", "memory_cap": "1MiB", "method": "snapkv"}
    args["ratio"] = "0.25"
    assert isinstance(app_builder({**args, "cpus_per_replica": "0.5"}), serve.Application)
