"""The recording prefill: a full prefill that keeps every layer's queries and compresses nothing.

The one place a full cache is recorded for later use: the shared prefill's snapshot
(:func:`kvbudget.prefill.derived.take_snapshot`) and KVzap's training pairs
(:func:`kvbudget.methods.kvzap_surrogate.kvzip_plus_pairs`) both call :func:`record_prefill`, and a
method that then runs its own pass over the recorded cache gets it through :func:`hand_over` (the
session moves between phases by its named transitions, never by hand).

It sits below the prefill strategies, with :mod:`kvbudget.prefill.common` in the methods' layer
(``tests/test_layering.py``): a method that records a prefill while it starts (KVzap fitting its
surrogate) imports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvbudget.attention import attach
from kvbudget.cache import BudgetCache
from kvbudget.methods.base import Method
from kvbudget.methods.full import FullCache
from kvbudget.prefill.common import forward_last_logits
from kvbudget.session import CompressionSession


@dataclass
class Recording:
    """A recorded full prefill.

    Attributes:
        cache: the uncompressed cache, its recording session still on it.
        queries: per layer, the post-RoPE queries ``[b, q_heads, n, d]``.
        scaling: the attention's softmax scale.
        logits: the last position's logits ``[b, vocab]``.
        seconds: wall time of the forward.
        attention_inputs: per layer, the attention module's input ``[b, n, hidden]`` (with
            ``attention_inputs=True``; else an empty dict).
    """

    cache: BudgetCache
    queries: dict[int, torch.Tensor]
    scaling: float | None
    logits: torch.Tensor
    seconds: float
    attention_inputs: dict[int, torch.Tensor]


def record_prefill(
    model: PreTrainedModel,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    attention_inputs: bool = False,
) -> Recording:
    """Prefill ``ids: [b, T]`` (``mask``, ``positions`` as :func:`forward_last_logits`) into a new
    full cache whose session records (``Phase.RECORD``): every layer's queries, and with
    ``attention_inputs`` every attention module's input."""
    attach(model)
    layers = model.config.num_hidden_layers
    recorder = CompressionSession(FullCache(), layers, budget=1)
    recorder.begin_record()
    recorder.record_attention_inputs = attention_inputs
    cache = BudgetCache(layers, recorder)
    start = time.perf_counter()
    logits = forward_last_logits(model, ids, mask, positions, cache)
    seconds = time.perf_counter() - start
    return Recording(
        cache, recorder.recorded_queries, recorder.scaling, logits, seconds, recorder.attention_inputs
    )


def hand_over(recording: Recording, method: Method, model: PreTrainedModel) -> BudgetCache:
    """The recorded cache with a session of ``method`` on it instead (its run started with
    ``model``), stopped: the method's own pass over the cache reads its run from the cache's session
    (KVzip+'s reconstruction its prompts) and compresses nothing."""
    session = CompressionSession(method, model.config.num_hidden_layers, budget=1, model=model)
    session.stop()
    recording.cache.session = session
    return recording.cache
