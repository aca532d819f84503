"""Shared prefill: prefill once, derive every (method, budget) cache from the snapshot.

Every method that acts after a layer's attention (all but the prune stage, which :func:`derive`
refuses) compresses a layer
from that layer's post-RoPE queries, keys and values, which do not depend on how earlier layers
were compressed (each layer's attention output is computed on its full cache first). So the
compressed cache is the same whether compression runs inside the prefill or later from a
snapshot of the full prefill — and the prompt's last logits are the full cache's in both cases.
The evaluation runner prefills each sample once and calls :func:`derive` per (method, budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvbudget.attention import attach
from kvbudget.cache import BudgetCache, BudgetLayer
from kvbudget.engine import PrefillInputs, append_uncompressed, prefill_compressed_part, run_lookahead
from kvbudget.errors import KVBudgetError
from kvbudget.methods.base import Method
from kvbudget.methods.full import FullCache
from kvbudget.session import CompressionSession


@dataclass
class Snapshot:
    """A full prefill of the compressed part of a prompt batch.

    Attributes:
        inputs: the padded batch (see :class:`~kvbudget.engine.PrefillInputs`).
        cache: the uncompressed cache after the compressed part.
        queries: per layer, the post-RoPE queries ``[b, q_heads, n, d]`` of that part.
        scaling: the attention's softmax scale.
        logits: last-position logits ``[b, vocab]`` of the compressed part.
        seconds: wall time of the prefill.
    """

    inputs: PrefillInputs
    cache: BudgetCache
    queries: dict[int, torch.Tensor]
    scaling: float
    logits: torch.Tensor
    seconds: float

    @property
    def agnostic(self) -> bool:
        return self.inputs.compressed_until < self.inputs.ids.shape[1]


@torch.inference_mode()
def take_snapshot(model: PreTrainedModel, inputs: PrefillInputs) -> Snapshot:
    """Prefill ``inputs``' compressed part with the full cache, recording every layer's queries."""
    attach(model)
    recorder = CompressionSession(FullCache(), model.config.num_hidden_layers, budget=1)
    recorder.phase = "record"
    cache = BudgetCache(model.config.num_hidden_layers, recorder)
    start = time.perf_counter()
    logits = prefill_compressed_part(model, inputs, cache)
    seconds = time.perf_counter() - start
    cache.session = None
    return Snapshot(inputs, cache, recorder.recorded_queries, recorder.scaling, logits, seconds)


def shallow_copy(source: BudgetLayer) -> BudgetLayer:
    """A layer sharing ``source``'s tensors (compression never edits tensors in place)."""
    layer = BudgetLayer()
    layer.__dict__.update(source.__dict__)
    layer.state = dict(source.state)
    return layer


@torch.inference_mode()
def derive(
    model: PreTrainedModel,
    snapshot: Snapshot,
    method: Method,
    budget: int | None = None,
    ratio: float | None = None,
    eos: set[int] | None = None,
) -> tuple[BudgetCache, torch.Tensor]:
    """The cache ``method`` would have built during the prefill, from ``snapshot``.

    Post-prefill methods (the lookahead) then run on the derived full cache exactly as after a
    layer-wise prefill; ``eos`` (default: the model's) ends their lookahead — pass the same set as
    the layer-wise run (``generate`` uses the model's and the tokenizer's).

    Returns the compressed cache (its session in decode phase; for question-agnostic snapshots
    the question has been appended uncompressed) and the last-position logits to decode from.
    """
    if "prune" in method.stages:
        raise KVBudgetError(
            f"{method.name} is a prune-stage method: it changes the prefill forward, so it cannot be "
            "derived from a snapshot of the full prefill; prefill with it (kvbudget.engine.prefill)"
        )
    num_layers = model.config.num_hidden_layers
    method.prepare(model)
    session = CompressionSession(method, num_layers, budget=budget, ratio=ratio)
    cache = BudgetCache(num_layers, session)
    cache.attention_attached = True
    cache.layers = [shallow_copy(layer) for layer in snapshot.cache.layers]
    session.phase = "prefill"
    for layer_idx, layer in enumerate(cache.layers):
        session.after_attention(layer_idx, snapshot.queries[layer_idx], layer, snapshot.scaling, cache.layers)
        for noted in range(layer_idx + 1) if method.edits_earlier_layers else (layer_idx,):
            cache.note_memory(noted)  # a cascading or post-prefill method also edited earlier layers
    run_lookahead(model, snapshot.inputs, cache, snapshot.logits, eos)
    logits = append_uncompressed(model, snapshot.inputs, cache)
    session.phase = "decode"
    return cache, snapshot.logits if logits is None else logits
