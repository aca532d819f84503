"""Shared prefill: prefill once, derive every (method, budget) cache from the snapshot.

Every method that acts after a layer's attention compresses a layer from that layer's post-RoPE
queries, keys and values, which do not depend on how earlier layers were compressed (each layer's
attention output is computed on its full cache first). So the compressed cache is the same whether
compression runs inside the prefill or later from a snapshot of the full prefill — and the
prompt's last logits are the full cache's in both cases. The evaluation runner prefills each sample
once and calls :func:`derive` per (method, budget).

Prune-stage methods change the forward only after the layer where they cut: up to and including
that layer every token runs, exactly as in the full prefill. A snapshot taken with
``hidden_states=True`` also keeps each layer's output hidden states, so :func:`derive` replays a
prune method over the snapshot's layers until it cuts, then runs only the deeper layers on the
kept tokens (:func:`kvbudget.prefill.pruned.derive_pruned`); a method that never cuts costs no forward.

Derived runs share the snapshot's per-layer observation memo (window probabilities, attention
column sums): they observe the same queries and uncompressed layers, so each is computed once per
snapshot instead of once per (method, budget); so do KVzip's reconstruction scores (its passes
read the full cache, whatever the budget), each run still counting the pass's time.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from kvbudget.cache import BudgetCache
from kvbudget.errors import KVBudgetError
from kvbudget.methods.base import Method
from kvbudget.phases import Stage
from kvbudget.prefill.common import (
    PrefillInputs,
    Snapshot,
    append_uncompressed,
    run_lookahead,
)
from kvbudget.prefill.pruned import decoder_parts, derive_pruned
from kvbudget.prefill.record import record_prefill
from kvbudget.session import CompressionSession, replay_prefill


@torch.inference_mode()
def take_snapshot(
    model: PreTrainedModel, inputs: PrefillInputs, hidden_states: bool = False, attention_inputs: bool = False
) -> Snapshot:
    """Prefill ``inputs``' compressed part with the full cache, recording every layer's queries.

    ``hidden_states``: also keep each decoder layer's output (``layers × n × hidden`` floats more),
    so prune-stage methods can derive from the snapshot too. ``attention_inputs``: also keep each
    attention module's input (as many floats), for methods that score from it (KVzap).
    """
    hidden: list[torch.Tensor] = []
    hooks = []
    if hidden_states:
        for layer in decoder_parts(model).layers:  # removed below: the model is left as it was
            hooks.append(layer.register_forward_hook(lambda _m, _a, out: hidden.append(_first(out))))
    cut = inputs.compressed_until
    try:
        recording = record_prefill(
            model, inputs.ids[:, :cut], inputs.mask[:, :cut], inputs.positions[:, :cut], attention_inputs
        )
    finally:
        for hook in hooks:
            hook.remove()
    cache = recording.cache
    cache.session = None
    return Snapshot(
        inputs, cache, recording.queries, recording.scaling, recording.logits, recording.seconds,
        hidden if hidden_states else None,
        attention_inputs=recording.attention_inputs if attention_inputs else None,
    )  # fmt: skip


def _first(out: torch.Tensor | tuple) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@torch.inference_mode()
def derive(
    model: PreTrainedModel,
    snapshot: Snapshot,
    method: Method,
    budget: int | None = None,
    ratio: float | None = None,
    eos: set[int] | None = None,
    kv_bits: int | None = None,
    memory: float | None = None,
    memory_tokens: int | None = None,
) -> tuple[BudgetCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cache ``method`` would have built during the prefill, from ``snapshot`` (stored at
    ``kv_bits`` once compressed, before a question-agnostic snapshot's question is appended).

    Prune-stage methods need a snapshot taken with ``hidden_states=True``; a two-pass method that
    selects decodes from re-indexed positions (see :func:`kvbudget.prefill.pruned.derive_pruned`).

    Post-prefill methods (the lookahead) then run on the derived full cache exactly as after a
    layer-wise prefill; ``eos`` (default: the model's) ends their lookahead — pass the same set as
    the layer-wise run (``generate`` uses the model's and the tokenizer's).

    Returns, like :func:`kvbudget.engine.prefill`, the compressed cache (its session in decode
    phase; for question-agnostic snapshots the question has been appended uncompressed), the
    last-position logits ``[b, vocab]``, the attention mask ``[b, T]`` and each row's last
    position ``[b]`` to decode from (for a two-pass method that selected: its re-indexed tokens').
    """
    num_layers = model.config.num_hidden_layers
    session = CompressionSession(
        method, num_layers, budget=budget, ratio=ratio, model=model, kv_bits=kv_bits, memory=memory
    )
    session.memory_tokens = memory_tokens
    session.observation_memos = snapshot.memos
    session.lookahead_memo = snapshot.lookahead_memo
    if Stage.PRUNE in method.stages:
        if snapshot.hidden is None:
            raise KVBudgetError(
                f"{method.name} is a prune-stage method: it changes the prefill forward after the layer "
                "where it cuts, so it derives from a snapshot only with the layers' hidden states — "
                "take it with take_snapshot(..., hidden_states=True)"
            )
        cache, logits, inputs = derive_pruned(model, snapshot, session)
        session.begin_decode()
        return cache, logits, inputs.mask, inputs.positions[:, -1]
    if getattr(method, "wants_attention_inputs", False) and snapshot.attention_inputs is None:
        raise KVBudgetError(
            f"{method.name} scores from the attention modules' inputs, so it derives from a snapshot "
            "only with them — take it with take_snapshot(..., attention_inputs=True)"
        )
    cache = BudgetCache(num_layers, session)
    replayed = replay_prefill(
        cache,
        snapshot.cache.layers,
        snapshot.queries,
        snapshot.scaling,
        attention_inputs=snapshot.attention_inputs,
    )
    for _ in replayed:
        pass  # every layer
    run_lookahead(model, snapshot.inputs, cache, snapshot.logits, eos)
    logits = append_uncompressed(model, snapshot.inputs, cache)
    session.begin_decode()
    inputs = snapshot.inputs
    return cache, snapshot.logits if logits is None else logits, inputs.mask, inputs.positions[:, -1]
