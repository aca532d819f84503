"""Layer-wise prefill: one forward of the model, each layer compressing its cache right after its
attention (:mod:`kvbudget.prefill` lists the other strategies)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from kvbudget.attention import attach
from kvbudget.cache import BudgetCache
from kvbudget.phases import Stage
from kvbudget.prefill.common import (
    PrefillInputs,
    Prompt,
    append_uncompressed,
    forward_last_logits,
    prefill_compressed_part,
    prefill_inputs,
    run_lookahead,
)
from kvbudget.prefill.pruned import prune_prefill
from kvbudget.session import CompressionSession


def prefill_batch(
    model: PreTrainedModel, inputs: PrefillInputs, session: CompressionSession, eos: set[int] | None = None
) -> tuple[BudgetCache, torch.Tensor, PrefillInputs]:
    """Prefill ``inputs`` into a new BudgetCache with ``session``'s method (attached model, prepared
    method): prune-stage methods through :func:`kvbudget.prefill.pruned.prune_prefill` (the engine's own layer
    loop, deeper layers on selected tokens); the others layer by layer, then a lookahead method's
    lookahead (``eos`` ends it; default: the model's). The uncompressed question of a
    question-agnostic batch is appended last.

    Returns the cache, the last position's logits ``[b, vocab]`` and the inputs the cache describes
    (``inputs`` itself, or a two-pass method's selected tokens with re-indexed positions).
    """
    if Stage.PRUNE in session.method.stages:
        return prune_prefill(model, inputs, session)
    cache = BudgetCache(model.config.num_hidden_layers, session)
    session.begin_prefill()
    logits = prefill_compressed_part(model, inputs, cache)
    run_lookahead(model, inputs, cache, logits, eos)
    question_logits = append_uncompressed(model, inputs, cache)
    return cache, logits if question_logits is None else question_logits, inputs


def prefill_for_decoding(
    model: PreTrainedModel, ids: torch.Tensor, session: CompressionSession
) -> tuple[BudgetCache, torch.Tensor]:
    """A decode-stage method's running cache: ``ids: [b, T]`` (no padding; positions ``0..T−1``)
    prefilled into a new BudgetCache with ``session``, each layer compressed right after its
    attention, and the session left decoding (it trims after every later forward).

    Returns the cache and the last position's logits ``[b, vocab]``. The chunked perplexity's
    decode-stage runs use it (:mod:`kvbudget.eval.tasks.perplexity`).
    """
    cache = BudgetCache(model.config.num_hidden_layers, session)
    session.begin_prefill()
    logits = forward_last_logits(model, ids, None, None, cache)
    session.begin_decode()
    return cache, logits


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    prompts: list[Prompt],
    session: CompressionSession,
    pad_id: int,
    compress_context_only: bool = False,
    eos: set[int] | None = None,
) -> tuple[BudgetCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill ``prompts`` (left-padded batch) into a new BudgetCache, compressing layer by layer
    (lookahead methods: right after the compressed part; ``eos`` ends their lookahead; prune-stage
    methods in the engine's own layer loop): see :func:`prefill_batch`.

    Returns the cache, the last position's logits ``[b, vocab]``, the 2-D attention mask
    ``[b, T]`` and the position of each row's last token ``[b]`` — what decoding continues from
    (for two-pass methods: the selected tokens, re-indexed).
    """
    attach(model)
    session.bind(model)
    inputs = prefill_inputs(prompts, pad_id, compress_context_only)
    cache, logits, inputs = prefill_batch(model, inputs, session, eos)
    return cache, logits, inputs.mask, inputs.positions[:, -1]
