"""The prune stage: the engine runs the decoder layers itself so a method can shrink the sequence.

``run_layers`` is a manual forward — embed → per layer (rotary + mask + decoder layer) → norm →
head — built from the model's own modules (``embed_tokens``, ``rotary_emb``, ``layers[i]``,
``norm``, ``lm_head``) and the ``kvbudget`` attention, so the :class:`~kvbudget.cache.BudgetCache`
is filled exactly as in ``model(...)``. With no pruning it reproduces ``model(...)``'s logits
(tested to 1e-5 on Llama, Qwen2 and the real model; to 1e-4 on Qwen3, Gemma 2, Gemma 3 and Phi-3 in
tests/test_architectures.py).

After each layer a prune-stage method (:class:`~kvbudget.methods.prune_base.PruneMethod`) may cut
rows of the batch to selected tokens: their hidden states are gathered and keep their true RoPE
positions; the cache of every deeper layer then holds only those tokens, at their prompt slots, and
its logical length stays the prompt's. Rows keep their own selections (a batch is re-left-padded
to its longest row after a cut), so a batch equals each prompt alone.

``prune_prefill`` runs one-pass methods in one loop and two-pass methods (GemFilter, ASL 2-pass)
as a scouting pass that stops once every row has selected, then the whole model on the selected
tokens with re-indexed positions ``0..k−1``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from kvbudget.attention import PaddingInfo, attach, check_supported
from kvbudget.cache import BudgetCache
from kvbudget.errors import UnsupportedModelError
from kvbudget.methods.prune_base import PruneMethod
from kvbudget.prefill.common import PrefillInputs, Snapshot, append_uncompressed
from kvbudget.session import CompressionSession, replay_prefill


@dataclass
class DecoderParts:
    """The modules a manual forward needs, taken from the model itself.

    ``layer_types``: each layer's type when the rotary embedding differs per type (Gemma 3's local
    and global RoPE bases), else ``None``; ``final_softcap``: the model's final logit soft-capping
    (Gemma 2), else ``None``.
    """

    embed: nn.Module
    rotary: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    head: nn.Module
    layer_types: list[str] | None = None
    final_softcap: float | None = None

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> list:
        """Each layer's ``(cos, sin)`` for tokens at RoPE ``positions: [b, q]``."""
        if self.layer_types is None:
            shared = self.rotary(hidden, positions)
            return [shared] * len(self.layers)
        per_type = {t: self.rotary(hidden, positions, t) for t in set(self.layer_types)}
        return [per_type[t] for t in self.layer_types]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over the final-normed ``hidden``, soft-capped as the model's own forward."""
        logits = self.head(self.norm(hidden))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def decoder_parts(model: PreTrainedModel) -> DecoderParts:
    """The model's embedding, rotary embedding, decoder layers, final norm and LM head.

    Raises :class:`UnsupportedModelError` for architectures outside ``SUPPORTED_MODEL_TYPES`` or
    without the Llama-like module layout.
    """
    check_supported(model)
    base = getattr(model, "model", None)
    missing = [n for n in ("embed_tokens", "rotary_emb", "layers", "norm") if not hasattr(base, n)]
    if base is None or missing or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(
            f"{type(model).__name__} lacks the Llama-like layout the prune stage runs layer by layer "
            "(model.embed_tokens/rotary_emb/layers/norm and lm_head; "
            f"missing: {', '.join(missing) or 'lm_head'})"
        )
    per_type = "layer_type" in inspect.signature(base.rotary_emb.forward).parameters
    return DecoderParts(
        base.embed_tokens, base.rotary_emb, base.layers, base.norm, model.lm_head,
        list(model.config.layer_types) if per_type else None,
        getattr(model.config, "final_logit_softcapping", None),
    )  # fmt: skip


@dataclass
class _Sequence:
    """The tokens a layer runs on: ``hidden: [b, q, d]``, RoPE ``rope: [b, q]``, prompt ``slots: [b, q]``
    (``-1`` = pad) and ``valid: [b, q]``."""

    hidden: torch.Tensor
    rope: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor

    def cut(self, cuts: dict[int, torch.Tensor]) -> _Sequence:
        """Rows in ``cuts`` keep the given columns, the others all their valid ones; re-left-padded."""
        keep = [cuts.get(r, self.valid[r].nonzero().squeeze(-1)) for r in range(self.hidden.shape[0])]
        width = max(int(k.numel()) for k in keep)
        idx = torch.zeros((len(keep), width), dtype=torch.long, device=self.hidden.device)
        ok = torch.zeros((len(keep), width), dtype=torch.bool, device=self.hidden.device)
        for r, k in enumerate(keep):
            idx[r, width - k.numel() :] = k.to(idx.device)
            ok[r, width - k.numel() :] = True
        hidden = self.hidden.gather(1, idx[..., None].expand(-1, -1, self.hidden.shape[-1]))
        return _Sequence(
            hidden,
            self.rope.gather(1, idx).masked_fill(~ok, 0),
            self.slots.gather(1, idx).masked_fill(~ok, -1),
            ok,
        )


def run_layers(
    model: PreTrainedModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    cache: BudgetCache,
    method: PruneMethod | None = None,
    all_logits: bool = False,
) -> torch.Tensor | None:
    """A manual forward of ``ids: [b, T]`` (padding ``mask``, RoPE ``positions``) into ``cache``.

    With ``method``, the method's requested cuts are applied after each layer (one-pass), or the
    loop stops as soon as a two-pass method's scouting is done (returns ``None`` then).

    Returns the logits ``[b, T, vocab]`` with ``all_logits`` (only meaningful without cuts), else
    the last position's ``[b, vocab]``.
    """
    parts = decoder_parts(model)
    attach(model)
    device = parts.embed.weight.device
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    seen = cache.get_seq_length()
    valid = mask.to(torch.bool)
    slots = torch.arange(seen, seen + ids.shape[1], device=device).expand_as(ids).masked_fill(~valid, -1)
    seq = _Sequence(parts.embed(ids), positions, slots, valid)
    return _run_from(parts, seq, 0, cache, method, seen + ids.shape[1], False, all_logits)


def _run_from(
    parts: DecoderParts,
    seq: _Sequence,
    start: int,
    cache: BudgetCache,
    method: PruneMethod | None,
    total: int,
    pruned: bool,
    all_logits: bool = False,
) -> torch.Tensor | None:
    """Run ``seq`` through layers ``start..`` into ``cache`` (whose logical length becomes ``total``);
    ``pruned``: ``seq`` already lost tokens. See :func:`run_layers` for ``method`` and the result."""
    rotary = parts.rope(seq.hidden, seq.rope)
    targets = cache.session.targets if cache.session is not None else None
    run = cache.session.run if method is not None else None
    try:
        for index, layer in enumerate(parts.layers[start:], start):
            cache.pruned_slots = (seq.slots, total) if pruned else None
            info = PaddingInfo(None if bool(seq.valid.all()) else seq.valid, seq.hidden.shape[1])
            out = layer(
                seq.hidden, attention_mask=info, position_ids=seq.rope, past_key_values=cache,
                use_cache=True, position_embeddings=rotary[index],
            )  # fmt: skip
            seq.hidden = out[0] if isinstance(out, tuple) else out
            if method is None:
                continue
            if method.two_pass:
                targets = targets if targets is not None else cache.session.targets
                if run.scouting and run.selected and run.scouting_done(targets):
                    return None
                continue
            if not run.cuts:  # read in place: the run is asked for its cuts only when there are some
                continue
            seq = seq.cut(run.take_cuts())
            rotary = parts.rope(seq.hidden, seq.rope)
            pruned = True
    finally:
        cache.pruned_slots = None
    logits = parts.logits(seq.hidden if all_logits else seq.hidden[:, -1:])
    return logits if all_logits else logits[:, -1]


def _second_pass_inputs(inputs: PrefillInputs, selected: dict[int, torch.Tensor]) -> PrefillInputs:
    """The selected tokens of each row (all valid ones for unselected rows), left-padded, positions
    re-indexed ``0..k−1``; in question-agnostic mode the question follows uncompressed."""
    cut = inputs.compressed_until
    ids, mask = inputs.ids[:, :cut], inputs.mask[:, :cut]
    keep = [selected.get(r, mask[r].nonzero().squeeze(-1)).cpu() for r in range(ids.shape[0])]
    width = max(int(k.numel()) for k in keep)
    new_ids = torch.zeros((ids.shape[0], width), dtype=ids.dtype, device="cpu")
    new_mask = torch.zeros((ids.shape[0], width), dtype=mask.dtype, device="cpu")
    for r, k in enumerate(keep):
        new_ids[r, width - k.numel() :] = ids[r].cpu()[k]
        new_mask[r, width - k.numel() :] = 1
    all_ids = torch.cat([new_ids, inputs.ids[:, cut:].cpu()], 1)
    all_mask = torch.cat([new_mask, inputs.mask[:, cut:].cpu()], 1)
    return PrefillInputs(all_ids, all_mask, (all_mask.cumsum(-1) - 1).clamp(min=0), width)


@torch.inference_mode()
def prune_prefill(
    model: PreTrainedModel, inputs: PrefillInputs, session: CompressionSession
) -> tuple[BudgetCache, torch.Tensor, PrefillInputs]:
    """Prefill ``inputs`` with a prune-stage method (``session.method``).

    Returns the cache, the last position's logits ``[b, vocab]`` and the inputs the cache now
    describes (for two-pass methods: the selected tokens with re-indexed positions; decode from
    their mask and last positions).
    """
    method = _prune_method(session)
    num_layers = model.config.num_hidden_layers
    method.begin_prune(session.run, inputs.ids.shape[0], num_layers)
    cache = BudgetCache(num_layers, session)
    session.begin_prefill()
    cut = inputs.compressed_until
    logits = run_layers(
        model, inputs.ids[:, :cut], inputs.mask[:, :cut], inputs.positions[:, :cut], cache, method
    )
    return _finish(model, inputs, session, cache, logits)


@torch.inference_mode()
def derive_pruned(
    model: PreTrainedModel, snapshot: Snapshot, session: CompressionSession
) -> tuple[BudgetCache, torch.Tensor, PrefillInputs]:
    """What :func:`prune_prefill` returns, from a snapshot taken with ``hidden_states=True``.

    Up to and including the layer where a one-pass method cuts, every token runs exactly as in
    the full prefill, so those layers replay the snapshot (its queries and uncompressed layers go
    to the method as the attention hook would give them); the kept tokens' hidden states after
    that layer come from the snapshot and only the deeper layers run. A two-pass method scouts on
    the snapshot and runs its second pass as usual. A method that never cuts runs no forward.
    """
    method = _prune_method(session)
    run = session.run
    inputs = snapshot.inputs
    num_layers = model.config.num_hidden_layers
    method.begin_prune(run, inputs.ids.shape[0], num_layers)
    cache = BudgetCache(num_layers, session)
    logits: torch.Tensor | None = snapshot.logits
    for layer_idx in replay_prefill(cache, snapshot.cache.layers, snapshot.queries, snapshot.scaling):
        if method.two_pass:
            if run.selected and run.scouting_done(session.targets):
                logits = None
                break
            continue
        if run.cuts:
            cuts = run.take_cuts()
            session.observation_memos = None  # deeper layers see only the kept tokens
            parts = decoder_parts(model)
            cut = inputs.compressed_until
            device = parts.embed.weight.device
            valid = inputs.mask[:, :cut].to(device, torch.bool)
            slots = torch.arange(cut, device=device).expand_as(valid).masked_fill(~valid, -1)
            rope = inputs.positions[:, :cut].to(device)
            seq = _Sequence(snapshot.hidden[layer_idx], rope, slots, valid).cut(cuts)
            logits = _run_from(parts, seq, layer_idx + 1, cache, method, cut, True)
            break
    session.observation_memos = None
    return _finish(model, inputs, session, cache, logits)


def _prune_method(session: CompressionSession) -> PruneMethod:
    method = session.method
    if not isinstance(method, PruneMethod):
        raise TypeError(f"{method.name} is not a prune-stage method")
    return method


def _finish(
    model: PreTrainedModel,
    inputs: PrefillInputs,
    session: CompressionSession,
    cache: BudgetCache,
    logits: torch.Tensor | None,
) -> tuple[BudgetCache, torch.Tensor, PrefillInputs]:
    """After the first pass: a two-pass method runs its second pass over the selected tokens; then
    the uncompressed question is appended.

    A two-pass method selects for every row that exceeds its budget (GemFilter at its filter layer;
    ASL 2-pass at its selection layer, else at the last layer, see
    :class:`~kvbudget.methods.asl.ASL2Pass`), so every layer ends at the budget. Only when every
    row fits its budget does pass 1 (every layer on every token) stay the prefill. A row left
    unselected otherwise is a method bug: a ``RuntimeError``, not a silently full cache.
    """
    method = _prune_method(session)
    run = session.run
    num_layers = model.config.num_hidden_layers
    targets = session.targets
    if method.two_pass and targets is not None and not run.scouting_done(targets):
        rows = [r for r, t in enumerate(targets) if t is not None and r not in run.selected]
        raise RuntimeError(f"{method.name}: pass 1 selected no tokens for rows {rows} over the budget")
    if method.two_pass and run.selected:
        inputs = _second_pass_inputs(inputs, run.selected)
        run.scouting = False  # the second pass runs the selected tokens only
        session.kept = None
        cache = BudgetCache(num_layers, session)
        session.begin_prefill()
        cut = inputs.compressed_until
        logits = run_layers(
            model, inputs.ids[:, :cut], inputs.mask[:, :cut], inputs.positions[:, :cut], cache, method
        )
    question_logits = append_uncompressed(model, inputs, cache)
    return cache, logits if question_logits is None else question_logits, inputs
