"""OpenAI's API as the server speaks it: request bodies validated into a :class:`Request`, and the
response, chunk and error objects (plain dicts; no HTTP here).

Supported: ``/v1/chat/completions`` (``messages``) and ``/v1/completions`` (``prompt``, one string or
token ids), with ``model``, ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``,
``top_p``, ``seed``, ``stop``, ``stream`` and ``stream_options.include_usage``; ``n`` must be 1.
kvbudget's own field, ``kvbudget: {"method": ..., "budget": ... | "ratio": ...}`` (an OpenAI
client's ``extra_body``), sets the request's compression; the server's flags are the default. Its
``ignore_eos: true`` decodes ``max_tokens`` whatever is sampled (for benchmarks, as vLLM's).
Every problem is an :class:`APIError` with the HTTP status and one line naming it; the request
schema (types, ranges, lengths, roles, what is not supported) is :mod:`kvbudget.serve.schema`.
A prompt is counted against the server's token limit while it is tokenized, so a huge one is refused
after bounded work.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from kvbudget.engine import DEFAULT_BUDGET, build_prompt
from kvbudget.errors import KVBudgetError
from kvbudget.methods.spec import MethodSpec
from kvbudget.serve.batcher import Compression, full_cache_size_refusal
from kvbudget.serve.documents import Document, DocumentNotFound
from kvbudget.serve.logs import quote
from kvbudget.serve.schema import (
    ChatRequest,
    CompletionRequest,
    DocumentRequest,
    KVBudgetOptions,
    validation_message,
)

#: tokens of an answer when the request gives no limit
DEFAULT_MAX_TOKENS = 256
#: characters tokenized at a time while counting a prompt against the server's limit
TOKENIZE_PIECE_CHARS = 8192
#: characters of an error message at most (messages quote little of the input; this bounds the rest)
MAX_MESSAGE_CHARS = 400


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
        message = message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 1] + "…"
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def reason(self) -> str:
        """A short name of the refusal (its ``code``, else ``invalid_request``): the metrics' label."""
        return self.code or ("invalid_request" if self.kind == "invalid_request_error" else self.kind)

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
    #: the prompt's first ``shared_prefix`` ids are a long system prompt the server may share
    #: (:func:`system_prefix_ids`); 0: none
    shared_prefix: int = 0


def parse_request(
    endpoint: str,
    raw: bytes,
    model_name: str,
    tokenizer: PreTrainedTokenizerBase,
    default: Compression,
    max_prompt_tokens: int,
    documents: Callable[[str], Document] | None = None,
    share_prefix_tokens: int | None = None,
) -> Request:
    """Validate the raw body of ``endpoint`` (``"chat"`` or ``"completions"``) against the schema
    (:mod:`kvbudget.serve.schema`) and tokenize its prompt, refusing one of more than
    ``max_prompt_tokens`` tokens as soon as the count passes it (:func:`refuse_over_limit`).
    ``documents`` finds a document a request names (:class:`DocumentNotFound` when none): the
    prompt is then the document's tokens followed by the request's (:func:`document_prompt_ids`).
    ``share_prefix_tokens``: a chat whose leading system messages render to at least this many
    tokens, and whose rest is shorter, marks them as a prefix the server shares
    (:func:`system_prefix_ids`)."""
    schema = ChatRequest if endpoint == "chat" else CompletionRequest
    try:
        body = schema.model_validate_json(raw or b"null")
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise APIError(400, message, param) from None
    if body.model != model_name:
        message = f"the model {quote(body.model)} does not exist: this server serves '{model_name}'"
        raise APIError(404, message, "model", "model_not_found")
    document_id = body.kvbudget.document if body.kvbudget is not None else None
    shared = 0
    if document_id is not None:
        try:
            document = (documents or _no_documents)(document_id)
        except DocumentNotFound as exc:
            raise APIError(404, str(exc), "kvbudget.document", "document_not_found") from None
        compression = Compression(document.compression.method, document=document.id)
        ids = document_prompt_ids(endpoint, body, tokenizer, document, max_prompt_tokens)
    else:
        compression = resolve_compression(body.kvbudget, default)
        ids = (_chat_ids if endpoint == "chat" else _completion_ids)(body, tokenizer, max_prompt_tokens)
        options = body.kvbudget
        asked = options is not None and (options.method, options.budget, options.ratio, options.kv_bits,
                                         options.memory) != (None,) * 5  # fmt: skip
        if endpoint == "chat" and share_prefix_tokens and not asked:  # its own compression: as asked
            split = system_prefix_ids(body, tokenizer, share_prefix_tokens)
            if split is not None:
                ids, shared = check_prompt_tokens(split[0] + split[1], max_prompt_tokens, "the conversation",
                                                  "messages"), len(split[0])  # fmt: skip
    max_tokens = body.answer_limit() if endpoint == "chat" else body.max_tokens
    options = body.stream_options
    return Request(
        endpoint=endpoint, prompt_ids=ids,
        max_tokens=max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS,
        temperature=body.temperature if body.temperature is not None else 0.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        seed=body.seed if body.seed is not None else 0, stop=body.stops(), stream=bool(body.stream),
        include_usage=bool(options and options.include_usage), compression=compression,
        ignore_eos=bool(body.kvbudget and body.kvbudget.ignore_eos), shared_prefix=shared,
    )  # fmt: skip


def _no_documents(document_id: str) -> Document:
    raise DocumentNotFound(f"no document {document_id!r} on this server")


def document_prompt_ids(
    endpoint: str, body: Any, tokenizer: PreTrainedTokenizerBase, document: Document, limit: int
) -> list[int]:
    """A request's prompt on ``document``: its ids, then the request's own. A chat's first message
    is the user's, asking about the document: the conversation is rendered with the document's text
    opening that message (a blank line, then the message), as :func:`kvbudget.engine.build_prompt`
    renders a context and its question, and must begin with the document's tokens. A completion's
    prompt (text or ids) follows the document's tokens as it is."""
    if endpoint == "chat":
        if document.text is None:
            raise APIError(400, f"document {document.id} was given as token ids: ask it through "
                           "/v1/completions, whose prompt follows its ids", "kvbudget.document")  # fmt: skip
        if not tokenizer.chat_template:
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        refuse_over_limit(tokenizer, [m.text() for m in body.messages], limit, "the conversation", "messages")
        rendered = [{"role": m.template_role(), "content": m.text()} for m in body.messages]
        first = rendered[0]
        if first["role"] != "user":
            raise APIError(400, f"a conversation on document {document.id} begins with the user's message "
                           f"about it, not a {first['role']} message", "messages")  # fmt: skip
        rendered[0] = {"role": "user", "content": f"{document.text}\n\n{first['content']}"}
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
        cut = text.index(document.text) + len(document.text)
        if tuple(tokenizer(text[:cut], add_special_tokens=False)["input_ids"]) != document.ids:
            raise APIError(400, f"the conversation does not begin with document {document.id}'s tokens",
                           "messages")  # fmt: skip
        own = tokenizer(text[cut:], add_special_tokens=False)["input_ids"]
    else:
        prompt = body.prompt_value()
        if isinstance(prompt, str):
            refuse_over_limit(tokenizer, [prompt], limit, "the prompt", "prompt")
            own = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            own = _completion_ids(body, tokenizer, limit)
    return check_prompt_tokens([*document.ids, *own], limit, "the document and the prompt", "prompt")


def system_prefix_ids(
    body: ChatRequest, tokenizer: PreTrainedTokenizerBase, minimum: int
) -> tuple[list[int], list[int]] | None:
    """A chat's leading system messages as a shareable prefix: (their ids — the template rendered up
    to their end, tokenized alone —, the rest's ids), when they take at least ``minimum`` tokens and
    the rest fewer; else ``None`` (a long message after them is compressed with the prompt, as
    usual: only the rest of a shared prefix's prompt is kept as it is)."""
    rendered = [{"role": m.template_role(), "content": m.text()} for m in body.messages]
    k = next((i for i, m in enumerate(rendered) if m["role"] != "system"), len(rendered))
    if k == 0 or k == len(rendered) or not tokenizer.chat_template:
        return None
    head = tokenizer.apply_chat_template(rendered[:k], tokenize=False, add_generation_prompt=False)
    whole = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    if not whole.startswith(head):
        return None
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    rest_ids = tokenizer(whole[len(head) :], add_special_tokens=False)["input_ids"]
    if len(head_ids) < minimum or len(rest_ids) >= len(head_ids):
        return None
    return list(head_ids), list(rest_ids)


def parse_document_request(
    raw: bytes, model_name: str, tokenizer: PreTrainedTokenizerBase, default: Compression, limit: int
) -> tuple[list[int], str | None, Compression]:
    """A ``POST /v1/kvbudget/documents`` body: the document's token ids (its text rendered as a chat's
    first user message opens, :func:`kvbudget.engine.build_prompt`), its text, and its compression
    (the body's method and size, else the server's document compression ``default``)."""
    try:
        body = DocumentRequest.model_validate_json(raw or b"null")
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise APIError(400, message, param) from None
    if body.model is not None and body.model != model_name:
        message = f"the model {quote(body.model)} does not exist: this server serves '{model_name}'"
        raise APIError(404, message, "model", "model_not_found")
    if body.text is not None:
        refuse_over_limit(tokenizer, [body.text], limit, "the document", "text")
        ids = build_prompt(tokenizer, body.text).context_ids
    else:
        vocab = len(tokenizer)
        bad = next((t for t in body.token_ids if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token_ids must be in [0, {vocab}), got {bad}", "token_ids")
        ids = list(body.token_ids)
    ids = check_prompt_tokens(ids, limit, "the document", "text" if body.text is not None else "token_ids")
    return ids, body.text, _document_compression(body, default)


def _document_compression(body: DocumentRequest, default: Compression) -> Compression:
    method = body.method or default.method
    try:
        MethodSpec.parse(method)
    except KVBudgetError as exc:
        raise APIError(400, str(exc), "method") from None
    refusal = full_cache_size_refusal(method, body.budget, body.ratio, body.memory)
    if refusal is not None:
        raise APIError(400, refusal, "method")
    if body.memory is not None:
        return Compression(method, memory=body.memory)
    # the body's kv_bits (16: the model's dtype), else the server's (`--document-method full:kv_bits=4`)
    bits = default.kv_bits if body.kv_bits is None else None if body.kv_bits == 16 else body.kv_bits
    if method == "full":
        return Compression("full", kv_bits=bits)
    if body.budget is not None or body.ratio is not None:
        return Compression(method, body.budget, body.ratio, bits)
    if default.memory is not None:
        if bits is not None:
            raise APIError(400, "kv_bits needs a budget or ratio here: the server's document default is a "
                           "byte budget (memory)", "kv_bits")  # fmt: skip
        return Compression(method, memory=default.memory)
    size = (default.budget, default.ratio) if (default.budget, default.ratio) != (None, None) else (None, 0.5)
    return Compression(method, *size, bits)


def resolve_compression(options: KVBudgetOptions | None, default: Compression) -> Compression:
    """What the request runs: its method (else the server's), its budget or ratio (else the server's,
    else ``kvbudget.generate``'s default budget; the full cache has neither) and its ``kv_bits``
    (else the server's)."""
    method = options.method if options is not None and options.method is not None else default.method
    try:
        MethodSpec.parse(method)
    except KVBudgetError as exc:
        raise APIError(400, str(exc), "kvbudget.method") from None
    if options is not None:
        refusal = full_cache_size_refusal(method, options.budget, options.ratio, options.memory)
        if refusal is not None:
            raise APIError(400, refusal, "kvbudget.method")
    if options is not None and options.memory is not None:
        return Compression(method, None, None, None, options.memory)
    bits = options.kv_bits if options is not None and options.kv_bits is not None else default.kv_bits
    bits = None if bits == 16 else bits
    if method == "full":
        return Compression("full", None, None, bits)
    budget, ratio = (options.budget, options.ratio) if options is not None else (None, None)
    if budget is None and ratio is None and bits == default.kv_bits and default.memory is not None:
        return Compression(method, None, None, None, default.memory)  # the server's byte budget
    if budget is None and ratio is None:
        budget, ratio = default.budget, default.ratio
    if budget is None and ratio is None:
        budget = DEFAULT_BUDGET
    return Compression(method, budget, ratio, bits)


def refuse_over_limit(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], limit: int, what: str, param: str
) -> None:
    """Refuse ``texts`` once they hold clearly more than ``limit`` tokens, tokenizing at most a piece
    of :data:`TOKENIZE_PIECE_CHARS` characters past that point: the work before a refusal is bounded
    by ``limit``, not by the body. Pieces split words, so the count is approximate; the exact check
    follows on the whole prompt (:func:`check_prompt_tokens`)."""
    bound = limit + limit // 8 + 64
    count = 0
    for text in texts:
        for start in range(0, len(text), TOKENIZE_PIECE_CHARS):
            piece = text[start : start + TOKENIZE_PIECE_CHARS]
            count += len(tokenizer(piece, add_special_tokens=False)["input_ids"])
            if count > bound:
                raise APIError(
                    400, f"{what} has more than {limit} tokens, the server's limit (--max-prompt-tokens)",
                    param, "context_length_exceeded",
                )  # fmt: skip


def check_prompt_tokens(ids: list[int], limit: int, what: str, param: str) -> list[int]:
    if len(ids) > limit:
        raise APIError(
            400, f"{what} has {len(ids)} tokens, more than the server's limit of {limit} "
            "(--max-prompt-tokens)", param, "context_length_exceeded",
        )  # fmt: skip
    return ids


def _chat_ids(body: ChatRequest, tokenizer: PreTrainedTokenizerBase, limit: int) -> list[int]:
    if not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
    refuse_over_limit(tokenizer, [m.text() for m in body.messages], limit, "the conversation", "messages")
    rendered = [{"role": m.template_role(), "content": m.text()} for m in body.messages]
    ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return check_prompt_tokens(ids, limit, "the conversation", "messages")


def _completion_ids(body: CompletionRequest, tokenizer: PreTrainedTokenizerBase, limit: int) -> list[int]:
    prompt = body.prompt_value()
    if isinstance(prompt, str):
        refuse_over_limit(tokenizer, [prompt], limit, "the prompt", "prompt")
        return check_prompt_tokens(list(tokenizer(prompt)["input_ids"]), limit, "the prompt", "prompt")
    vocab = len(tokenizer)
    bad = next((t for t in prompt if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {bad}", "prompt")
    return check_prompt_tokens(list(prompt), limit, "the prompt", "prompt")


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
