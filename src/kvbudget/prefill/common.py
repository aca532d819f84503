"""The steps every prefill strategy shares (:mod:`kvbudget.prefill` lists the strategies).

A tokenised :class:`Prompt` batch is left-padded into :class:`PrefillInputs` (:func:`prefill_inputs`);
its compressed part is prefilled into a :class:`~kvbudget.cache.BudgetCache`
(:func:`prefill_compressed_part`), a lookahead method then compresses it (:func:`run_lookahead`), and
in question-agnostic mode the question is appended uncompressed (:func:`append_uncompressed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvbudget.cache import BudgetCache
from kvbudget.phases import Stage


@dataclass
class Prompt:
    """A tokenised prompt split where the context ends (for question-agnostic compression).

    ``marked``: positions of the tokens covering the ``mark`` text given to :func:`build_prompt`.
    """

    context_ids: list[int]
    question_ids: list[int]
    marked: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.context_ids + self.question_ids


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
    """A full prefill of the compressed part of a prompt batch
    (:func:`kvbudget.prefill.derived.take_snapshot`).

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
        lookahead_memo: what lookahead methods share across derived runs (KVzip's scores).
        attention_inputs: per layer, the attention module's input ``[b, n, hidden]`` (with
            ``attention_inputs=True`` only: methods that score from it, KVzap, derive from them).
    """

    inputs: PrefillInputs
    cache: BudgetCache
    queries: dict[int, torch.Tensor]
    scaling: float
    logits: torch.Tensor
    seconds: float
    hidden: list[torch.Tensor] | None = None
    memos: dict[int, dict] = field(default_factory=dict)
    lookahead_memo: dict = field(default_factory=dict)
    attention_inputs: dict[int, torch.Tensor] | None = None

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
    model: PreTrainedModel,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    cache: BudgetCache,
) -> torch.Tensor:
    """One forward over ``ids: [b, q]`` into ``cache`` (padding ``mask`` and RoPE ``positions``
    ``[b, q]``, or ``None``: no padding, positions from the cache's length); returns the last
    position's logits ``[b, vocab]``."""
    out = model(
        input_ids=ids.to(model.device),
        attention_mask=None if mask is None else mask.to(model.device),
        position_ids=None if positions is None else positions.to(model.device),
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
    if session is None or Stage.LOOKAHEAD not in session.method.stages:
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
        session.stop()
    cut = inputs.compressed_until
    logits = forward_last_logits(model, inputs.ids[:, cut:], inputs.mask, inputs.positions[:, cut:], cache)
    if session is not None:
        session.note_appended(inputs.mask[:, cut:].sum(-1).tolist())
    return logits


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, T]`` ids and mask, shorter sequences padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        if s:
            ids[r, width - len(s) :] = torch.tensor(s)
            mask[r, width - len(s) :] = 1
    return ids, mask


def prefill_inputs(prompts: list[Prompt], pad_id: int, compress_context_only: bool = False) -> PrefillInputs:
    """Left-pad ``prompts``; in question-agnostic mode the context and question are padded apart."""
    if compress_context_only:
        ctx_ids, ctx_mask = _left_pad([p.context_ids for p in prompts], pad_id)
        q_ids, q_mask = _left_pad([p.question_ids or [pad_id] for p in prompts], pad_id)
        for r, p in enumerate(prompts):
            if not p.question_ids:
                q_mask[r] = 0
        ids, mask = torch.cat([ctx_ids, q_ids], 1), torch.cat([ctx_mask, q_mask], 1)
        cut = ctx_ids.shape[1]
    else:
        ids, mask = _left_pad([p.ids for p in prompts], pad_id)
        cut = ids.shape[1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return PrefillInputs(ids, mask, positions, cut)
