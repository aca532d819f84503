"""OpenAI's API as the server speaks it: request bodies validated into a :class:`Request`, and the
response, chunk and error objects (plain dicts; no HTTP here).

Supported: ``/v1/chat/completions`` (``messages``) and ``/v1/completions`` (``prompt``, one string or
token ids), with ``model``, ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``,
``top_p``, ``seed``, ``stop``, ``stream`` and ``stream_options.include_usage``; ``n`` must be 1.
kvbudget's own field, ``kvbudget: {"method": ..., "budget": ... | "ratio": ...}`` (an OpenAI
client's ``extra_body``), sets the request's compression; the server's flags are the default. Its
``ignore_eos: true`` decodes ``max_tokens`` whatever is sampled (for benchmarks, as vLLM's).
Every problem is an :class:`APIError` with the HTTP status and one line naming it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvbudget.errors import KVBudgetError
from kvbudget.methods.spec import MethodSpec
from kvbudget.serve.batcher import Compression

#: tokens of an answer when the request gives no limit
DEFAULT_MAX_TOKENS = 256


class APIError(Exception):
    """A request the server refuses: ``status`` (4xx), one-line ``message``, OpenAI's ``type`` and
    ``code``, the offending ``param`` when there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """A validated request: what :meth:`kvbudget.serve.scheduler.Scheduler.submit` takes, plus how to
    answer it."""

    endpoint: str  # "chat" or "completions"
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    compression: Compression
    ignore_eos: bool = False


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"{name} must be a number, got {value!r}", name)
    if value > high or value < low or (low_open and value == low):
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise APIError(400, f"{name} must be in {interval}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer, got {value!r}", name)
    return value


def parse_compression(body: dict, default: Compression) -> Compression:
    """The ``kvbudget`` field (``method``, and ``budget`` or ``ratio``), else ``default``."""
    spec = body.get("kvbudget")
    if spec is None:
        return default
    if not isinstance(spec, dict):
        raise APIError(
            400, 'kvbudget must be an object such as {"method": "snapkv", "ratio": 0.2}', "kvbudget"
        )
    unknown = sorted(set(spec) - {"method", "budget", "ratio", "ignore_eos"})
    if unknown:
        expected = "method, budget, ratio, ignore_eos"
        raise APIError(
            400, f"unknown kvbudget field(s) {', '.join(unknown)}: expected {expected}", "kvbudget"
        )
    method = spec.get("method", default.method)
    if not isinstance(method, str) or not method:
        raise APIError(400, f"kvbudget.method must be a method name, got {method!r}", "kvbudget.method")
    try:
        MethodSpec.parse(method)
    except KVBudgetError as exc:
        raise APIError(400, str(exc), "kvbudget.method") from None
    budget, ratio = spec.get("budget"), spec.get("ratio")
    if budget is not None and ratio is not None:
        raise APIError(400, "give kvbudget.budget or kvbudget.ratio, not both", "kvbudget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        message = f"kvbudget.budget must be a positive integer (entries per KV head), got {budget!r}"
        raise APIError(400, message, "kvbudget.budget")
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0
    ):
        raise APIError(400, f"kvbudget.ratio must be in (0, 1], got {ratio!r}", "kvbudget.ratio")
    if budget is None and ratio is None:
        budget, ratio = default.budget, default.ratio
    return Compression(method, budget, None if ratio is None else float(ratio))


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise APIError(400, "stop must be a non-empty string or a list of up to 4 of them", "stop")
    return tuple(stops)


def _chat_ids(body: dict, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a role and a content", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text parts are supported
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", "messages")
        rendered.append({"role": m["role"], "content": content})
    if not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
    ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _completion_ids(body: dict, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        return list(tokenizer(prompt)["input_ids"])
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        vocab = len(tokenizer)
        if any(t < 0 or t >= vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(prompt)
    raise APIError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def parse_request(
    endpoint: str, body: dict, model_name: str, tokenizer: PreTrainedTokenizerBase, default: Compression
) -> Request:
    """Validate ``body`` for ``endpoint`` (``"chat"`` or ``"completions"``) into a :class:`Request`."""
    model = body.get("model")
    if model is None:
        raise APIError(400, "model is required", "model")
    if model != model_name:
        raise APIError(404, f"the model '{model}' does not exist: this server serves '{model_name}'", "model",
                       "model_not_found")  # fmt: skip
    if _integer(body, "n", 1) != 1:
        raise APIError(400, "n must be 1: one answer per request", "n")
    max_tokens = _integer(body, "max_completion_tokens", None) if endpoint == "chat" else None
    max_tokens = max_tokens if max_tokens is not None else _integer(body, "max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens <= 0:
        raise APIError(400, f"max_tokens must be ≥ 1, got {max_tokens}", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    ids = _chat_ids(body, tokenizer) if endpoint == "chat" else _completion_ids(body, tokenizer)
    extension = body.get("kvbudget") if isinstance(body.get("kvbudget"), dict) else {}
    ignore_eos = extension.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(400, "kvbudget.ignore_eos must be true or false", "kvbudget.ignore_eos")
    return Request(
        endpoint=endpoint, prompt_ids=ids, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=_integer(body, "seed", 0), stop=_stop(body), stream=stream,
        include_usage=bool(options.get("include_usage", False)), compression=parse_compression(body, default),
        ignore_eos=ignore_eos,
    )  # fmt: skip


def response_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def completion_body(
    request: Request, rid: str, model: str, text: str, finish: str, usage: dict[str, Any]
) -> dict[str, Any]:
    """The whole answer, as ``chat.completion`` or ``text_completion``."""
    created = int(time.time())
    if request.endpoint == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}  # fmt: skip
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage}  # fmt: skip
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage}  # fmt: skip


def chunk_body(
    request: Request, rid: str, model: str, text: str | None, finish: str | None, first: bool = False
) -> dict[str, Any]:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``)."""
    created = int(time.time())
    if request.endpoint == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}  # fmt: skip
    choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(request: Request, rid: str, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    """The last streamed chunk when ``stream_options.include_usage``: no choices, the usage."""
    kind = "chat.completion.chunk" if request.endpoint == "chat" else "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage,
    }
