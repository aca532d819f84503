"""The request schema of the OpenAI-compatible server: one pydantic model per endpoint, parsed from
the raw body in one pass (pydantic's JSON parser: depth-limited, exact about Unicode, no NaN).

Everything a request may carry is declared here, with its type, range and length; nothing outside
it passes. OpenAI parameters the server does not implement (``logprobs``, ``tools``,
``response_format``, penalties, …) are accepted only at the value that asks for nothing (``null``,
``false``, ``0``, an empty list or object, ``{"type": "text"}``) and otherwise refused by name, as an
OpenAI-compatible server refuses what it does not do. Unknown fields and roles are refused too.

:func:`validation_message` turns the first problem into one line (field path, what is wrong, at most
:data:`~kvbudget.serve.logs.QUOTE_CHARS` characters of the offending value), the ``message`` of a 400.

Limits: :data:`MAX_MESSAGES` messages, :data:`MAX_STOPS` stop strings of at most
:data:`MAX_STOP_CHARS` characters, names of at most :data:`MAX_NAME_CHARS`; a seed is a 64-bit
integer; ``max_tokens`` at most :data:`MAX_TOKENS_BOUND` here (the scheduler then holds prompt plus
answer to the model's context).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvbudget.serve.logs import quote

MAX_MESSAGES = 4096
MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_NAME_CHARS = 256
MAX_TOKENS_BOUND = 1 << 31
#: roles a chat message may have (``developer`` is rendered as ``system``, as OpenAI documents)
ROLES = ("system", "developer", "user", "assistant")

Finite = Annotated[float, Field(allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)]


def _unsupported(name: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"{name} is not supported by this server")


#: OpenAI parameters not implemented, each with the values that ask for nothing (accepted, ignored)
_NO_OP: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
}
_COMPLETION_NO_OP: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


def _refuse_unsupported(values: Any, no_op: dict[str, tuple[Any, ...]], prefix: str = "") -> Any:
    if isinstance(values, dict):
        for name, allowed in no_op.items():
            if name in values and not any(_same(values[name], a) for a in allowed):
                raise _unsupported(prefix + name)
    return values


def _same(value: Any, allowed: Any) -> bool:
    """JSON equality that keeps ``false`` apart from ``0`` and ``1.0`` equal to ``1``."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    return value == allowed


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class _Sized(_Strict):
    """A body that names a compression: a method spec's own ``:kv_bits=`` / ``:memory=`` become its
    fields (:func:`_lift_storage`) before they are checked."""

    @model_validator(mode="before")
    @classmethod
    def _storage_in_method(cls, values: Any) -> Any:
        return _lift_storage(values)


class KVBudgetOptions(_Sized):
    """kvbudget's own field (an OpenAI client's ``extra_body={"kvbudget": {...}}``): the method spec
    (``snapkv``, ``snapkv:window=16``, ``name@preset``), and entries per KV head (``budget``) or the
    fraction of the prompt kept (``ratio``), the bits a stored number takes after the prefill
    (``kv_bits``: 2, 4, 8, or 16 for the model's dtype) — or a byte budget instead of all three
    (``memory``: the share of the full cache's bytes, :mod:`kvbudget.byte_budget`); ``ignore_eos``
    decodes ``max_tokens`` whatever is sampled (for benchmarks, as vLLM's)."""

    method: Name | None = None
    budget: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    ratio: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    kv_bits: Literal[2, 4, 8, 16] | None = None
    memory: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    ignore_eos: bool = False
    #: a document's id (``POST /v1/kvbudget/documents``): the prompt begins with it, as it was compressed
    document: Name | None = None

    @model_validator(mode="after")
    def _one_size(self) -> KVBudgetOptions:
        _check_size(self)
        sized = (self.method, self.budget, self.ratio, self.kv_bits, self.memory)
        if self.document is not None and sized != (None,) * 5:
            raise PydanticCustomError(
                "document_alone", "a request on a document runs the document's compression: give no method, "
                "budget, ratio, kv_bits or memory with it",
            )  # fmt: skip
        return self


def _lift_storage(values: Any) -> Any:
    """A method spec's own ``:kv_bits=b`` or ``:memory=f`` (the form ``--document-method`` and
    ``kvbudget eval`` take) moved to the request's fields, the method left without it; given both
    ways, refused. A spec that does not parse is left as it is, for the method's own error."""
    method = values.get("method") if isinstance(values, dict) else None
    if not isinstance(method, str) or ("kv_bits=" not in method and "memory=" not in method):
        return values
    from kvbudget.errors import KVBudgetError
    from kvbudget.methods.spec import split_storage

    try:
        name, bits, memory = split_storage(method)
    except KVBudgetError:
        return values
    lifted = {**values, "method": name}
    for field, value in (("kv_bits", bits), ("memory", memory)):
        if value is not None:
            if values.get(field) is not None:
                raise PydanticCustomError(
                    "given_twice",
                    f"{field} is given twice: in the method {quote(method)} and as its own field",
                )
            lifted[field] = value
    return lifted


def _check_size(options: Any) -> None:
    if options.budget is not None and options.ratio is not None:
        raise PydanticCustomError("budget_and_ratio", "give budget or ratio, not both")
    if options.memory is not None and (options.budget, options.ratio, options.kv_bits) != (None, None, None):
        raise PydanticCustomError("memory_alone", "give memory or budget/ratio/kv_bits, not both")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


#: message fields OpenAI defines that the server does not implement, refused unless null
_MESSAGE_UNSUPPORTED = ("name", "tool_calls", "tool_call_id", "function_call", "audio", "refusal")


class Message(_Strict):
    """One chat message: a role and text (a string or text parts)."""

    role: str
    content: str | list[TextPart]
    name: None = None
    tool_calls: None = None
    tool_call_id: None = None
    function_call: None = None
    audio: None = None
    refusal: None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for name in _MESSAGE_UNSUPPORTED:
                if values.get(name) is not None:
                    raise _unsupported(f"a message's {name}")
            role = values.get("role")
            if role in ("tool", "function"):
                message = f"the role '{role}' is not supported (tools are not)"
                raise PydanticCustomError("unsupported", message)
            if isinstance(role, str) and role not in ROLES:
                raise PydanticCustomError(
                    "unknown_role", f"unknown role {quote(role)}: expected one of {', '.join(ROLES)}"
                )
            content = values.get("content")
            if isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") != "text":
                        kind = quote(part.get("type"))
                        raise PydanticCustomError(
                            "unsupported", f"only text content parts are supported, got type {kind}"
                        )
        return values

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class _Common(_Strict):
    """Fields both endpoints take."""

    model: Name
    max_tokens: MaxTokens | None = None
    temperature: Annotated[Finite, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: (
        Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOPS),
        ]
        | None
    ) = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    user: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    kvbudget: KVBudgetOptions | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None
    safety_identifier: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    # not implemented: accepted only at their no-op values (checked before the types)
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, values: Any) -> Any:
        return _refuse_unsupported(values, _NO_OP)

    def answer_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt, as a string or token ids (a list of one of either is
    taken as that one)."""

    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    )
    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, values: Any) -> Any:
        return _refuse_unsupported(values, _COMPLETION_NO_OP)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise PydanticCustomError("one_prompt", "one prompt per request (n must be 1)")
        if prompt == "":
            raise PydanticCustomError("empty_prompt", "the prompt is empty")
        return prompt

    def prompt_value(self) -> str | list[int]:
        """The prompt: its text, or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt[0]  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]


class DocumentRequest(_Sized):
    """``POST /v1/kvbudget/documents``: a document's ``text`` (tokenized as a chat's first user message
    opens, so chat requests can name it) or its ``token_ids`` (completions only), and how to compress
    it — a method spec and a size as a request's ``kvbudget`` field takes them (default: the server's
    document method). ``model``, if given, must be the server's."""

    model: Name | None = None
    text: Annotated[str, Field(min_length=1)] | None = None
    token_ids: TokenIds | None = None
    method: Name | None = None
    budget: Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    ratio: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    kv_bits: Literal[2, 4, 8, 16] | None = None
    memory: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> DocumentRequest:
        if (self.text is None) == (self.token_ids is None):
            raise PydanticCustomError("one_source", "give the document's text or its token_ids (one of them)")
        _check_size(self)
        return self


def _path(loc: tuple[Any, ...]) -> str:
    """``("messages", 0, "role")`` → ``messages[0].role`` (pydantic's union branch names dropped)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and not _is_branch(part):
            path += ("." if path else "") + part
    return path


def _is_branch(part: str) -> bool:
    """A union member's tag in an error location (``str``, ``constrained-str``, ``list[int]``): the
    schema's own field names have no brackets or hyphens."""
    return any(c in part for c in "[]()-") or part in {"str", "int", "float", "bool", "list", "dict", "none"}


#: what a field whose type has several forms takes, for a value of none of them
_FORMS = {
    "stop": f"a string or a list of up to {MAX_STOPS} strings",
    "prompt": "a string or a list of token ids",
    "content": "a string or a list of text parts",
}


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """One line naming the first problem of ``error``, and the field it is in (OpenAI's ``param``)."""
    problems = error.errors(include_url=False)
    if not problems:
        return "the request is not valid", None
    # a union reports one problem per form it tried; the one reached deepest names the field best
    first = max(problems, key=lambda p: len(_path(tuple(p["loc"]))))
    kind, param = first["type"], _path(tuple(first["loc"])) or None
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}", None
    if kind == "model_type" and param is None:
        return "the request body must be a JSON object", None
    if kind == "extra_forbidden":
        return f"unknown field {param}", param
    if kind == "missing":
        return f"{param} is required", param
    field = param.rsplit(".", 1)[-1] if param else None
    if field in _FORMS and kind.endswith("_type"):
        return f"{param} must be {_FORMS[field]}, got {quote(first.get('input'))}", param
    message = first["msg"]
    if kind not in {
        "unsupported",
        "unknown_role",
        "one_prompt",
        "empty_prompt",
        "budget_and_ratio",
        "memory_alone",
        "document_alone",
        "one_source",
        "given_twice",
    }:
        message = f"{message[:1].lower()}{message[1:]}, got {quote(first.get('input'))}"
    return (f"{param}: {message}" if param else message), param
