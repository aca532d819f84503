"""Transformers-native use: a cache that compresses inside ``model.generate``, and several
questions answered from one compressed context.

:class:`CompressingCache` is a :class:`~kvbudget.cache.BudgetCache` made for one model and one
method. Passed to ``model.generate(**inputs, past_key_values=cache, ...)`` it compresses during the
first forward (the prefill: each layer right after its attention, as :func:`kvbudget.generate`
does) and lets decode-stage methods trim back to their budget after every later step. Streamers,
logits processors and stopping criteria of ``generate`` work unchanged: only the cache is kvbudget's.

``generate`` sends the prompt whole, so the cache compresses it question-aware (the papers'
setting, ``kvbudget.generate``'s default). For question-agnostic compression, prefill the context
alone first (:meth:`CompressingCache.copy`, :func:`answer`).

The cache tells the phases apart by what the model feeds it:

* its first forward is the prefill (``generate`` sends the whole prompt at once);
* a later forward of one token is a decode step;
* a later forward of several tokens is appended uncompressed and outside the budget — a question
  after a compressed context (see :meth:`CompressingCache.copy`), as kvbudget's question-agnostic
  mode appends it: decode-stage methods then hold what the prefill kept plus those tokens. A
  one-token question is taken for a decode step (decode-stage methods then trim after it too).

Attention: the constructor routes the model's attention through kvbudget (:func:`kvbudget.attach`:
the model's own ``config._attn_implementation`` becomes ``"kvbudget"`` and forward pre-hooks go on
its attention modules; transformers only gains a ``"kvbudget"`` entry in its attention registry,
nothing is patched). :meth:`CompressingCache.close`, or leaving a ``with CompressingCache(...) as
cache:`` block, restores the previous implementation once every cache that found the model
unattached is closed. A model left attached computes the same exact attention for any other cache.

Refused with a one-line :class:`~kvbudget.errors.UnsupportedMethodError`: prune-stage methods (they
run the decoder layers themselves and feed deeper layers only the tokens they select) and lookahead
methods (they pseudo-decode with the model once the prefill is done) — neither fits inside
``generate``'s forward. Both work through ``kvbudget.compress(model, ids[:, :-1], ...)`` followed
by ``model.generate(ids, past_key_values=cache)``.

:func:`answer` compresses one context once, question-agnostic, and answers each question from its
own copy of the compressed cache — the answers of ``kvbudget.generate(...,
compress_context_only=True)`` per question, with one compression.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvbudget.attention import attach, attached, check_supported, detach, is_attached
from kvbudget.cache import BudgetCache, BudgetLayer, check_kv_bits
from kvbudget.engine import (
    DEFAULT_BUDGET,
    Prompt,
    build_prompt,
    check_budget,
    check_ratio_budgets,
    decode_loop,
    model_max_context,
    prefill_inputs,
)
from kvbudget.errors import InputError, KVBudgetError, UnsupportedMethodError
from kvbudget.methods.base import Method
from kvbudget.methods.registry import resolve_method
from kvbudget.phases import Phase, Stage
from kvbudget.prefill.common import append_uncompressed, eos_ids, prefill_compressed_part, run_lookahead
from kvbudget.session import CompressionSession

#: attribute of a model held attached by open CompressingCaches (see :class:`_Hold`)
_HOLD = "_kvbudget_native_hold"


@dataclass
class _Hold:
    """Open caches of one model; ``owns``: they attached it, so the last one closed detaches it."""

    owns: bool
    open: int = 0


def _acquire_attention(model: PreTrainedModel) -> None:
    hold = getattr(model, _HOLD, None)
    if hold is None:
        hold = _Hold(owns=not is_attached(model))
        attach(model)
        setattr(model, _HOLD, hold)
    hold.open += 1


def _release_attention(model: PreTrainedModel) -> None:
    hold = getattr(model, _HOLD, None)
    if hold is None:
        return
    hold.open -= 1
    if hold.open <= 0:
        delattr(model, _HOLD)
        if hold.owns:
            detach(model)


def check_generate_compatible(method: Method) -> None:
    """Raise :class:`UnsupportedMethodError` for a method that cannot run inside ``model.generate``."""
    hint = "use kvbudget.compress(model, ids[:, :-1], ...) then model.generate(ids, past_key_values=cache)"
    if Stage.PRUNE in method.stages:
        raise UnsupportedMethodError(
            f"{method.name} cannot run inside model.generate: a prune-stage method runs the decoder layers "
            f"itself, feeding deeper layers only the tokens it selects; {hint}"
        )
    if Stage.LOOKAHEAD in method.stages:
        raise UnsupportedMethodError(
            f"{method.name} cannot run inside model.generate: a lookahead method pseudo-decodes with the "
            f"model after the prefill; {hint}"
        )


class _GenerateSession(CompressionSession):
    """A session whose phase follows the forwards ``model.generate`` makes (module docstring)."""

    def after_attention(
        self,
        layer_idx: int,
        query: torch.Tensor,
        layer: BudgetLayer,
        scaling: float,
        layers: list[BudgetLayer] | None = None,
    ) -> None:
        """``query: [b, q_heads, q, d]``: the prefill compresses, a later ``q > 1`` appends uncompressed."""
        if self.phase is Phase.PREFILL and layer_idx == 0 and self.ratio is not None:
            check_ratio_budgets(self.method, self.ratio, layer.head_lengths()[:, 0].tolist())
        if self.phase is Phase.DECODE and query.shape[2] > 1:
            if layer_idx == 0:  # outside the budget: decode-stage methods hold it too
                self.note_appended((layer.head(0)[2][:, -query.shape[2] :] >= 0).sum(-1).tolist())
            return
        super().after_attention(layer_idx, query, layer, scaling, layers)
        if self.phase is Phase.PREFILL and layer_idx == self.num_layers - 1:
            self.begin_decode()


class CompressingCache(BudgetCache):
    """A cache for ``model.generate`` that compresses the prompt with ``method`` as the model fills it.

    Args:
        model: the model it will be passed to (its attention is routed through kvbudget; see
            :meth:`close`).
        method: a registry name (``kvbudget.method_names()``) or a method object (``make_method``).
        budget: entries per KV head on average, window included (default 128); or
        ratio: fraction of each prompt to keep, in (0, 1].
        kv_bits: store what the prefill kept at 2, 4 or 8 bits (16 or ``None``: the model's dtype),
            as :func:`kvbudget.generate`'s ``kv_bits``.

    One cache serves one ``generate`` call (a batch of left-padded prompts included; each row is
    compressed on its own tokens); use :meth:`copy` to continue one compressed prompt several ways.
    Greedy decoding and sampling are supported; beam search reorders batch rows, which the per-row
    state of decode-stage methods does not follow.

    Raises:
        UnsupportedMethodError: prune-stage and lookahead methods (see the module docstring).
        BudgetError, UnknownMethodError, UnsupportedModelError: as :func:`kvbudget.generate`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        method: str | Method = "snapkv",
        budget: int | None = None,
        ratio: float | None = None,
        kv_bits: int | None = None,
    ) -> None:
        check_supported(model)
        bits = check_kv_bits(kv_bits)
        method_obj = resolve_method(method)
        check_generate_compatible(method_obj)
        if budget is None and ratio is None:
            budget = DEFAULT_BUDGET
        check_budget(method_obj, budget, ratio, model_max_context(model))
        layers = model.config.num_hidden_layers
        session = _GenerateSession(method_obj, layers, budget=budget, ratio=ratio, model=model, kv_bits=bits)
        super().__init__(layers, session)
        _acquire_attention(model)
        self._model = weakref.ref(model)
        self._holds_attention = True

    @property
    def method(self) -> Method:
        return self.session.method

    @property
    def kept(self) -> torch.Tensor | None:
        """``[batch, layers, kv_heads]`` entries kept per head after the prefill (``None`` before it)."""
        return self.session.kept

    def copy(self) -> CompressingCache:
        """An independent copy (entries, method state, phase): e.g. compress a context once with
        ``model(context_ids, past_key_values=cache)``, then ``model.generate(context_and_question_ids,
        past_key_values=cache.copy())`` per question. The copy shares the original's hold on the
        model's attention (closing it does nothing)."""
        copied = copy.deepcopy(self)
        copied._holds_attention = False
        return copied

    def close(self) -> None:
        """Release the model's attention: the last open cache that found the model unattached
        restores its previous attention implementation (:func:`kvbudget.detach`). Idempotent."""
        model = self._model()
        if self._holds_attention and model is not None:
            _release_attention(model)
        self._holds_attention = False

    def __enter__(self) -> CompressingCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@torch.inference_mode()
def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    questions: list[str],
    method: str | Method = "snapkv",
    budget: int | None = None,
    ratio: float | None = None,
    answer_prefix: str = "",
    max_new_tokens: int = 64,
    kv_bits: int | None = None,
) -> list[str]:
    """Compress ``context`` once (question-agnostic) and answer every question from its own copy.

    The prompt of each question is :func:`kvbudget.engine.build_prompt`'s (chat template when the
    tokenizer has one); the context part, the same tokens for every question, is prefilled and
    compressed once (a lookahead method runs its lookahead on it); each question is then appended
    uncompressed to a copy of that cache and answered greedily, decode-stage methods trimming as
    usual. ``budget``/``ratio`` as :func:`kvbudget.generate` (a ratio of the context's tokens).
    The model's attention is routed through kvbudget for the call only (unless it was attached).
    ``kv_bits``: the compressed context stored at 2, 4 or 8 bits before the questions are appended
    (as :func:`kvbudget.generate`'s).

    Returns:
        One answer per question (special tokens and the final EOS removed), equal to
        ``kvbudget.generate(model, tokenizer, context, question, answer_prefix, method=..., budget=...,
        compress_context_only=True).text`` for each question.

    Raises:
        UnsupportedMethodError: prune-stage methods (they prefill context and question in one run
            of their own layer loop).
        InputError: no questions, an empty context, a prompt longer than the model's context.
    """
    check_supported(model)
    if isinstance(questions, str) or not questions or not all(isinstance(q, str) for q in questions):
        raise InputError("questions must be a non-empty list of strings")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    bits = check_kv_bits(kv_bits)
    method_obj = resolve_method(method)
    if Stage.PRUNE in method_obj.stages:
        raise UnsupportedMethodError(
            f"{method_obj.name} cannot share one compressed context between questions: a prune-stage method "
            "prefills context and question in one run of its own layer loop; call "
            "kvbudget.generate(..., compress_context_only=True) per question"
        )
    if budget is None and ratio is None:
        budget = DEFAULT_BUDGET
    max_context = model_max_context(model)
    check_budget(method_obj, budget, ratio, max_context)
    prompts = [build_prompt(tokenizer, context, q, answer_prefix) for q in questions]
    for prompt in prompts:
        if len(prompt.ids) + max_new_tokens > max_context:
            raise InputError(
                f"prompt of {len(prompt.ids)} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"context of {max_context} tokens"
            )
    if any(p.context_ids != prompts[0].context_ids for p in prompts):
        raise KVBudgetError("the context tokenises differently before different questions: cannot share it")
    check_ratio_budgets(method_obj, ratio, [len(prompts[0].context_ids)])
    with attached(model):
        return _answer_each(model, tokenizer, prompts, method_obj, budget, ratio, max_new_tokens, bits)


def _answer_each(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    method: Method,
    budget: int | None,
    ratio: float | None,
    max_new_tokens: int,
    kv_bits: int | None = None,
) -> list[str]:
    """:func:`answer`'s work once its inputs are checked and the model is attached."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = eos_ids(model, tokenizer)
    inputs = [prefill_inputs([p], pad_id, compress_context_only=True) for p in prompts]
    num_layers = model.config.num_hidden_layers
    session = CompressionSession(method, num_layers, budget=budget, ratio=ratio, model=model, kv_bits=kv_bits)
    compressed = BudgetCache(num_layers, session)
    logits = prefill_compressed_part(model, inputs[0], compressed)
    run_lookahead(model, inputs[0], compressed, logits, eos)
    compressed.quantize()  # at the session's kv_bits, once for every question's copy

    answers = []
    for question in inputs:
        cache = copy.deepcopy(compressed)
        question_logits = append_uncompressed(model, question, cache)
        last = logits if question_logits is None else question_logits
        decoded = decode_loop(
            model, cache, last, question.mask, question.positions[:, -1], eos, max_new_tokens, trace=False
        )
        ids = decoded.generated[0]
        answers.append(tokenizer.decode(ids[:-1] if ids[-1] in eos else ids, skip_special_tokens=True))
    return answers
