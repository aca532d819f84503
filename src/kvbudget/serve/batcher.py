"""The server's torch side: prefill one request, then decode every active sequence in one forward.

A :class:`Sequence` is one request being served: its prompt ids, sampling settings, compression
(:class:`Compression`) and, once prefilled, its own :class:`~kvbudget.cache.BudgetCache` and
:class:`~kvbudget.session.CompressionSession`. :func:`prefill_sequence` runs the engine's layer-wise
prefill on it alone (batch 1, question-aware: the whole prompt is compressed, as ``kvbudget.generate``
does by default) and samples its first token; :func:`decode_step` then runs one forward over every
active sequence (``[rows, 1]`` ids, each row at its own RoPE position) through a
:class:`~kvbudget.joined_cache.JoinedCache`, so each row's attention reads only its own ragged cache
and its own session keeps a decode-stage method at budget. Each row's tokens are what
``kvbudget.generate`` would make for that request alone (``tests/test_serve_batcher.py``).

Memory (:func:`reserved_bytes`, :func:`prefill_peak_bytes`) is counted from the caches' own
physical bytes, so the scheduler's cap is what the process holds for KV.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from kvbudget.cache import BudgetCache, model_entry_bytes
from kvbudget.engine import DEFAULT_BUDGET, memory_budget, next_token, prefill
from kvbudget.errors import InputError
from kvbudget.joined_cache import JoinedCache
from kvbudget.methods.base import Method
from kvbudget.methods.spec import MethodSpec
from kvbudget.phases import Stage
from kvbudget.prefill.common import Prompt, forward_last_logits
from kvbudget.quantized_store import GROUP, quantized_entry_bytes
from kvbudget.serve import defaults
from kvbudget.session import CompressionSession

_ids = itertools.count()


def full_cache_size_refusal(
    method: str, budget: int | None, ratio: float | None, memory: float | None, prefix: str = ""
) -> str | None:
    """Why a size given with ``method`` is refused, in one line: the full cache (``full``, the
    server's default for conversations) keeps every entry, so a budget, ratio or byte budget would
    be silently ignored; ``None`` when there is nothing to refuse. ``prefix``: ``"--"`` names the
    CLI's flags."""
    if MethodSpec.parse(method).name != "full":
        return None
    given = [n for n, v in (("budget", budget), ("ratio", ratio), ("memory", memory)) if v is not None]
    if not given:
        return None
    return (
        f"{prefix}{given[0]} needs a method that evicts: {method} keeps every entry (name one, e.g. "
        f"{prefix}method snapkv or expected-attention)"
    )


@dataclass(frozen=True)
class Compression:
    """How a request's prompt is compressed: a method spec (``snapkv``, ``snapkv:window=16``, a
    preset ``name@preset``) and a budget (entries per KV head) or a ratio (fraction of the prompt
    kept), as ``kvbudget.generate`` takes them. ``method="full"`` keeps everything."""

    method: str
    budget: int | None = None
    ratio: float | None = None
    kv_bits: int | None = None  # stored at 2, 4 or 8 bits after the prefill; None: the model's dtype
    memory: float | None = None  # a byte budget instead of budget, ratio and kv_bits
    #: the shared document (its id) the prompt begins with: the document as it was compressed, the
    #: request's own tokens after it kept as they are (``kvbudget.serve.documents``)
    document: str | None = None

    @classmethod
    def from_spec(cls, spec: str, ratio: float | None = None, budget: int | None = None) -> Compression:
        """A method spec as a compression: ``full`` (``full:kv_bits=4``) keeps everything, a byte budget
        (``NAME:memory=f``) has no size of its own, any other method keeps ``ratio`` of the prompt
        (the fraction kept) or ``budget`` entries per KV head; ``:kv_bits=b`` stores what is kept at
        ``b`` bits."""
        parsed = MethodSpec.parse(spec)
        name = MethodSpec(parsed.name, parsed.options).label
        if parsed.memory is not None:
            return cls(name, memory=parsed.memory)
        if parsed.name == "full":
            return cls(name, kv_bits=parsed.kv_bits)
        return cls(name, budget=budget, ratio=ratio, kv_bits=parsed.kv_bits)

    @classmethod
    def server_default(cls) -> Compression:
        """``kvbudget serve``'s compression of a request that names none
        (:data:`~kvbudget.serve.defaults.METHOD` at :data:`~kvbudget.serve.defaults.RATIO`)."""
        return cls.from_spec(defaults.METHOD, ratio=defaults.RATIO)

    @classmethod
    def for_document(cls, spec: str) -> Compression:
        """A document method spec (``--document-method``) as a compression: a spec without a size keeps
        :data:`~kvbudget.serve.defaults.DOCUMENT_RATIO` of the document."""
        return cls.from_spec(spec, ratio=defaults.DOCUMENT_RATIO)

    def label(self) -> str:
        if self.document is not None:
            return f"document {self.document}"
        if self.memory is not None:
            return f"{self.method} (memory={self.memory:g})"
        size = f"ratio={self.ratio}" if self.ratio is not None else f"budget={self.budget or DEFAULT_BUDGET}"
        bits = f", {self.kv_bits}-bit" if self.kv_bits is not None else ""
        return f"{self.method}{bits}" if self.method == "full" else f"{self.method} ({size}{bits})"


@dataclass
class Sequence:
    """One request being served.

    Attributes:
        prompt_ids: the prompt's token ids (chat template applied).
        max_tokens: new tokens at most; ``eos``: ids that end the answer.
        temperature, top_p, seed: sampling (greedy when ``temperature == 0``).
        compression: the prompt's compression; ``method``: its configured (frozen) method object.
        cache, session: the sequence's own cache and run state, once prefilled.
        last_pos: RoPE position of the last token in the cache.
        pending: the sampled token not yet in the cache (fed by the next step).
        generated: every sampled token, ``pending`` included.
        reused_tokens: prompt tokens served from an earlier turn's cache.
        ignore_eos: decode ``max_tokens`` whatever is sampled (a benchmarking aid, as vLLM's).
    """

    prompt_ids: list[int]
    max_tokens: int
    eos: frozenset[int]
    compression: Compression
    method: Method
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    id: int = field(default_factory=lambda: next(_ids))
    cache: BudgetCache | None = None
    session: CompressionSession | None = None
    last_pos: int = -1
    pending: int | None = None
    generated: list[int] = field(default_factory=list)
    reused_tokens: int = 0
    ignore_eos: bool = False
    generator: torch.Generator | None = None

    @property
    def finished(self) -> bool:
        """EOS sampled or ``max_tokens`` reached."""
        done = bool(self.generated) and self.generated[-1] in self.eos and not self.ignore_eos
        return done or len(self.generated) >= self.max_tokens

    @property
    def cached_ids(self) -> list[int]:
        """The tokens whose keys and values the cache holds (the pending token is not yet in it)."""
        return self.prompt_ids + self.generated[:-1] if self.generated else list(self.prompt_ids)

    def turn(self) -> Turn:
        """This sequence's cache as a :class:`Turn` a follow-up may continue."""
        if self.cache is None:
            raise InputError("a sequence not yet prefilled has no turn to keep")
        return Turn(tuple(self.cached_ids), self.cache, self.last_pos)


@dataclass(frozen=True)
class Turn:
    """A finished sequence's cache, kept for a follow-up: it holds the keys and values of ``ids``
    (the prompt and the answer but its last token), the last of them at RoPE position ``last_pos``."""

    ids: tuple[int, ...]
    cache: BudgetCache
    last_pos: int

    def continues(self, prompt_ids: list[int]) -> bool:
        """Whether ``prompt_ids`` extends ``ids`` by at least one token."""
        n = len(self.ids)
        return len(prompt_ids) > n and tuple(prompt_ids[:n]) == self.ids


def make_sequence(
    prompt_ids: list[int],
    max_tokens: int,
    eos: set[int],
    compression: Compression,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    method: Method | None = None,
    ignore_eos: bool = False,
) -> Sequence:
    """A :class:`Sequence`, its method built from ``compression`` unless given (methods are frozen
    configurations: the scheduler shares one object between all requests with the same spec)."""
    if not prompt_ids:
        raise InputError("the prompt is empty")
    if max_tokens < 1:
        raise InputError(f"max_tokens must be ≥ 1, got {max_tokens}")
    method = method if method is not None else MethodSpec.parse(compression.method).build()
    return Sequence(
        prompt_ids=list(prompt_ids), max_tokens=max_tokens, eos=frozenset(eos), compression=compression,
        method=method, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=ignore_eos,
    )  # fmt: skip


def sample_token(seq: Sequence, logits: torch.Tensor) -> int:
    """Sample ``seq``'s next token from ``logits: [1, vocab]`` with its own generator."""
    if seq.generator is None:
        seq.generator = torch.Generator().manual_seed(seq.seed)
    token = int(next_token(logits, seq.temperature, seq.top_p, seq.generator)[0])
    seq.pending = token
    seq.generated.append(token)
    return token


def new_session(model: PreTrainedModel, seq: Sequence) -> CompressionSession:
    """The compression session of ``seq``'s prefill: its method at its budget, ratio, ``kv_bits``
    or byte budget (``kvbudget.generate``'s default budget when it names none)."""
    comp = seq.compression
    budget, ratio = comp.budget, comp.ratio
    if comp.memory is not None:
        budget = memory_budget(model, seq.method, comp.memory, len(seq.prompt_ids))
    elif budget is None and ratio is None:
        budget = DEFAULT_BUDGET  # kvbudget.generate's default
    session = CompressionSession(
        seq.method, model.config.num_hidden_layers, budget=budget, ratio=ratio, kv_bits=comp.kv_bits,
        memory=comp.memory,
    )  # fmt: skip
    session.memory_tokens = len(seq.prompt_ids)
    return session


@torch.inference_mode()
def prefill_sequence(model: PreTrainedModel, seq: Sequence, pad_id: int, reuse: Turn | None = None) -> int:
    """Prefill ``seq`` alone and sample its first token (returned).

    Without ``reuse``: the whole prompt is prefilled and compressed layer by layer with the
    sequence's method (question-aware, as ``kvbudget.generate``). With ``reuse``, an earlier turn
    whose ids the prompt extends (:meth:`Turn.continues`): its cache is taken over and only the
    new tokens are prefilled, appended uncompressed (the earlier method's session is off for them);
    decoding then continues under that method as before. The turn's cache must not be used again.
    """
    if reuse is None:
        seq.session = new_session(model, seq)
        cache, logits, _, last_pos = prefill(
            model, [Prompt(seq.prompt_ids, [])], seq.session, pad_id, False, set(seq.eos)
        )
        cache.quantize(seq.compression.kv_bits)
        seq.cache, seq.last_pos = cache, int(last_pos[0])
    else:
        if not reuse.continues(seq.prompt_ids):
            raise InputError("the prompt does not extend the turn it reuses")
        seq.cache, seq.reused_tokens, seq.last_pos = reuse.cache, len(reuse.ids), reuse.last_pos
        session = reuse.cache.session
        seq.session = session if isinstance(session, CompressionSession) else None
        new = seq.prompt_ids[len(reuse.ids) :]
        if seq.session is not None:
            seq.session.stop()
        ids = torch.tensor([new])
        positions = torch.arange(seq.last_pos + 1, seq.last_pos + 1 + len(new))[None]
        logits = forward_last_logits(model, ids, torch.ones_like(ids), positions, reuse.cache)
        seq.last_pos += len(new)
    if seq.session is not None:
        seq.session.begin_decode()
    return sample_token(seq, logits)


@torch.inference_mode()
def decode_step(model: PreTrainedModel, seqs: list[Sequence]) -> list[int | Exception]:
    """One forward over every sequence of ``seqs`` (each fed its pending token at its own position);
    samples and returns each one's next token, or the exception its sampling raised (that row alone
    fails; a failed forward raises for all)."""
    device = model.device
    ids = torch.tensor([[s.pending] for s in seqs], device=device)
    positions = torch.tensor([[s.last_pos + 1] for s in seqs], device=device)
    joined = JoinedCache(model.config.num_hidden_layers, [s.cache for s in seqs])
    out = model(
        input_ids=ids, position_ids=positions, past_key_values=joined, use_cache=True, logits_to_keep=1
    )
    logits = out.logits[:, -1]
    tokens: list[int | Exception] = []
    for r, s in enumerate(seqs):
        s.last_pos += 1
        try:
            tokens.append(sample_token(s, logits[r : r + 1]))
        except Exception as exc:  # noqa: BLE001 - handed to the scheduler, which ends this row
            tokens.append(exc)
    return tokens


def _with_room(n: int) -> int:
    """Slots a head's storage has once it holds ``n`` entries, at most (the cache grows storage by
    ``max(32, n / 16)`` slots: :meth:`kvbudget.cache_storage.Storage.append`)."""
    return n + max(32, n // 16)


def grown_bytes(cache: BudgetCache, tokens: int) -> int:
    """KV bytes ``cache`` may hold once every head has grown by ``tokens`` entries (with the cache's
    storage room), or its physical bytes now if more."""
    grown = 0
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if layer.quant is not None:  # quantized entries, a full-precision tail of under a group
            grown += sum(head.grown_nbytes(tokens) for head in layer.quant)
            continue
        lengths = layer.head_lengths()[0].tolist()
        grown += sum(_with_room(n + tokens) for n in lengths) * layer.entry_bytes()
    return max(cache.physical_bytes(), grown)


def reserved_bytes(model: PreTrainedModel, seq: Sequence) -> int:
    """KV bytes ``seq`` may hold before it finishes: its cache grown by the tokens it may still
    generate (:func:`grown_bytes`)."""
    if seq.cache is None:
        raise InputError("reserved_bytes needs a prefilled sequence")
    return grown_bytes(seq.cache, seq.max_tokens - len(seq.generated) + 1)  # + the pending token


def prefill_peak_bytes(model: PreTrainedModel, seq: Sequence) -> int:
    """An upper bound of the KV bytes ``seq`` holds from its prefill to its last token (what
    admission must find room for).

    A method held to its budget compresses each layer right after its attention, so at the peak one
    layer holds the whole prompt while all layers together hold at most the budget per KV head on
    average (layer and head budgets move entries around, not beyond the total). Methods that see
    every layer before compressing (post-prefill stage, lookahead, prune stage, cascading
    re-eviction), methods that may keep more than their budget, and the full cache hold the whole
    prompt. Each head's storage may then grow by the answer, with the cache's room. Quantized
    storage (``kv_bits``) of a method that never reads a layer again once the next is prefilled
    (``quantizes_during_prefill``) stores each layer quantized as soon as it is done: the bound is
    then the kept entries quantized, grown by the answer, plus one whole layer in the model's dtype;
    for other methods quantization begins once the prefill is done: the larger of the prefill's peak
    in the model's dtype and the kept entries quantized, grown by the answer.
    """
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    n, answer = len(seq.prompt_ids), seq.max_tokens
    per_entry = model_entry_bytes(config, model.dtype)
    whole_layer = heads * _with_room(n + answer)
    method, comp = seq.method, seq.compression
    early = comp.kv_bits is not None and comp.memory is None and method.quantizes_during_prefill
    holds_prompt = (
        method.name == "full"
        or {Stage.POST_PREFILL, Stage.LOOKAHEAD, Stage.PRUNE} & set(method.stages)
        or method.edits_earlier_layers
        or type(method).exceeds_budget
    )
    if early:  # every layer quantized once done: one whole layer in the model's dtype at a time
        kept = n if holds_prompt else min(n, max(_kept(comp, n), method.min_budget()))
        return _quantized_bytes(config, model.dtype, comp.kv_bits, kept, answer) + whole_layer * per_entry
    if holds_prompt:
        return layers * whole_layer * per_entry
    if comp.memory is not None:  # the prefill's peak in the model's dtype, then the bytes and the answer
        kept = min(n, max(memory_budget(model, method, comp.memory, n), method.min_budget()))
        in_prefill = (kept * layers * heads + whole_layer) * per_entry
        after = math.ceil(comp.memory * n * layers * heads * per_entry) + _quantized_bytes(
            config, model.dtype, 4, 0, answer
        )
        return max(in_prefill, after)
    kept = min(n, max(_kept(comp, n), method.min_budget()))
    slots = layers * heads  # every head of every layer
    if comp.kv_bits is not None:
        in_prefill = (kept * slots + whole_layer) * per_entry
        return max(in_prefill, _quantized_bytes(config, model.dtype, comp.kv_bits, kept, answer))
    kept_total = (kept + answer) * slots
    kept_with_room = kept_total + max(32 * slots, kept_total // 16)
    return (kept_with_room + whole_layer) * per_entry


def _kept(comp: Compression, n: int) -> int:
    """Entries a head keeps of an ``n``-token prompt at ``comp``'s budget or ratio."""
    return comp.budget if comp.budget is not None else math.ceil((comp.ratio or 1.0) * n)


def _quantized_bytes(config: Any, dtype: torch.dtype, bits: int, kept: int, answer: int) -> int:
    """KV bytes of ``kept`` entries a head, quantized, grown by ``answer`` tokens (every head of
    every layer; a full-precision tail of a group and a group's key scales each)."""
    head_dim = model_entry_bytes(config, dtype) // (2 * dtype.itemsize)
    per_entry = quantized_entry_bytes(head_dim, bits, GROUP, dtype.itemsize)
    per_head = (kept + answer) * per_entry + (GROUP + 1) * 2 * head_dim * dtype.itemsize
    return math.ceil(config.num_hidden_layers * config.num_key_value_heads * per_head)
