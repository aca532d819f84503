"""The prefill steps the engine, the prune stage and the shared prefill have in common.

A prompt batch is left-padded into :class:`PrefillInputs`; its compressed part is prefilled into a
:class:`~kvbudget.cache.BudgetCache` (:func:`prefill_compressed_part`), a lookahead method then
compresses it (:func:`run_lookahead`), and in question-agnostic mode the question is appended
uncompressed (:func:`append_uncompressed`). :mod:`kvbudget.engine` runs these steps layer-wise,
:mod:`kvbudget.prune` with its own layer loop, :mod:`kvbudget.snapshot` from a :class:`Snapshot`
of a full prefill (which prune-stage methods derive from too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvbudget.cache import BudgetCache
from kvbudget.session import Phase


@dataclass
class PrefillInputs:
    """A left-padded batch ready to prefill.

    Attributes:
        ids, mask, positions: ``[b, T]`` token ids, padding mask and RoPE positions.
        compressed_until: the prefill's first chunk ``ids[:, :compressed_until]`` is the part
            compressed; the rest (the question, question-agnostic mode) is appended uncompressed.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    compressed_until: int


@dataclass
class Snapshot:
    """A full prefill of the compressed part of a prompt batch (:func:`kvbudget.snapshot.take_snapshot`).

    Attributes:
        inputs: the padded batch (see :class:`PrefillInputs`).
        cache: the uncompressed cache after the compressed part.
        queries: per layer, the post-RoPE queries ``[b, q_heads, n, d]`` of that part.
        scaling: the attention's softmax scale.
        logits: last-position logits ``[b, vocab]`` of the compressed part.
        seconds: wall time of the prefill.
        hidden: per layer, its output hidden states ``[b, n, hidden]`` (with ``hidden_states=True``
            only: prune-stage methods derive from them).
        memos: per layer, the prefill observation memo shared by every derived run.
    """

    inputs: PrefillInputs
    cache: BudgetCache
    queries: dict[int, torch.Tensor]
    scaling: float
    logits: torch.Tensor
    seconds: float
    hidden: list[torch.Tensor] | None = None
    memos: dict[int, dict] = field(default_factory=dict)

    @property
    def agnostic(self) -> bool:
        return self.inputs.compressed_until < self.inputs.ids.shape[1]


def model_eos_ids(model: PreTrainedModel) -> set[int]:
    """End-of-answer ids the model's generation config declares."""
    return eos_ids(model, None)


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """End-of-answer ids: the model's generation config's and the tokenizer's (when given)."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    tokenizer_eos = tokenizer.eos_token_id if tokenizer is not None else None
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer_eos):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    return ids


def forward_last_logits(
    model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: BudgetCache
) -> torch.Tensor:
    """One forward over ``ids: [b, q]``; returns the last position's logits ``[b, vocab]``."""
    out = model(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        position_ids=positions.to(model.device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1]


def prefill_compressed_part(
    model: PreTrainedModel, inputs: PrefillInputs, cache: BudgetCache
) -> torch.Tensor:
    """Prefill ``inputs.ids[:, :compressed_until]`` into ``cache``; its last logits ``[b, vocab]``."""
    cut = inputs.compressed_until
    return forward_last_logits(
        model, inputs.ids[:, :cut], inputs.mask[:, :cut], inputs.positions[:, :cut], cache
    )


def run_lookahead(
    model: PreTrainedModel,
    inputs: PrefillInputs,
    cache: BudgetCache,
    logits: torch.Tensor,
    eos: set[int] | None = None,
) -> None:
    """Let a lookahead method compress ``cache`` after the compressed part was prefilled.

    ``logits: [b, vocab]`` are the compressed part's last logits; ``eos`` the ids ending an answer
    (default: the model's). No-op for other methods.
    """
    session = cache.session
    if session is None or "lookahead" not in session.method.stages:
        return
    cut = inputs.compressed_until
    if eos is None:
        eos = model_eos_ids(model)
    mask, last_pos = inputs.mask[:, :cut], inputs.positions[:, cut - 1]
    session.prompt_ids = inputs.ids[:, :cut]
    session.method.run_lookahead(model, cache, logits, mask, last_pos, eos)


def append_uncompressed(
    model: PreTrainedModel, inputs: PrefillInputs, cache: BudgetCache
) -> torch.Tensor | None:
    """Prefill the part after ``compressed_until`` with the session off; its last logits, or None.

    The appended tokens are outside the budget (:meth:`CompressionSession.note_appended`): a method
    that holds its budget while decoding keeps them, as kvpress's question-agnostic mode does,
    rather than evicting the question at the first decode step.
    """
    if inputs.compressed_until == inputs.ids.shape[1]:
        return None
    session = cache.session
    if session is not None:
        session.phase = Phase.OFF
    cut = inputs.compressed_until
    logits = forward_last_logits(model, inputs.ids[:, cut:], inputs.mask, inputs.positions[:, cut:], cache)
    if session is not None:
        session.note_appended(inputs.mask[:, cut:].sum(-1).tolist())
    return logits
