"""Observed attention: the mean attention each prompt token receives from the queries that see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.errors import MethodOptionError
from kvbudget.methods.composable import Composable
from kvbudget.observation import Observation, reduce_group


def queries_seeing(obs: Observation) -> torch.Tensor:
    """How many valid queries of this forward attend to each entry: ``[b, kv_heads, n]`` (int64).

    The query at position ``p`` sees the key at position ``p_j`` when ``p_j ≤ p`` and, on a
    sliding-window layer of window ``W``, ``p − p_j < W`` (:func:`kvbudget.masks.window_visibility`).
    Counted by binary search over each row's sorted query positions, so no ``q × n`` mask is built.
    Invalid entries get a count too; their scores are never used.
    """
    n, q = obs.keys.shape[2], obs.query.shape[2]
    positions = obs.positions
    b = positions.shape[0]
    query_positions = positions[:, 0, n - q :]  # the queries are the tokens of the last q keys
    beyond = torch.iinfo(query_positions.dtype).max  # invalid queries sort last and are never counted
    ordered = torch.where(query_positions >= 0, query_positions, beyond).sort(dim=-1).values.contiguous()
    keys = positions.reshape(b, -1).contiguous()
    earlier = torch.searchsorted(ordered, keys, side="left")  # queries before the key
    window = obs.layer.sliding_window
    if window is None:
        seeing = (query_positions >= 0).sum(-1, keepdim=True) - earlier
    else:
        seeing = torch.searchsorted(ordered, keys + window, side="left") - earlier
    return seeing.view_as(positions)


@dataclass(frozen=True)
class ObservedAttention(Composable):
    """Observed attention: keep the entries the prompt's queries attend to most, on average.

    Score of entry ``j`` in KV head ``h``: for each query head ``g`` of the GQA group of ``h``, the
    attention ``A_g[i, j]`` (softmax over each query's causal prefix, fp32) summed over the prompt
    queries ``i`` that see ``j`` and divided by their number (``n − j`` for a full-attention prompt
    of ``n`` tokens); then the mean over the group's query heads. ``scores: [b, kv_heads, n]``.
    Each head keeps its top ``budget`` entries (no window, no sinks by default). The column sums
    are computed ``chunk`` queries at a time (:meth:`~kvbudget.observation.Observation.column_sums`),
    never as an ``n × n`` matrix. Prefill only; ``layer_alloc`` and ``head_alloc`` swap the
    allocators (:mod:`kvbudget.methods.composable`).

    This is NVIDIA kvpress's ``ObservedAttentionPress`` (kvpress 0.5.5,
    ``presses/observed_attention_press.py``: column sums of the eager attention divided by
    ``n − j``, then the mean over each GQA group, top-k per KV head), on its leaderboard as
    ``observed_attention``. With the defaults, and a prompt prefilled in one forward as kvpress does,
    it keeps kvpress's entries (``tests/test_kvpress_oracle.py``).

    How it differs from ``h2o`` (:class:`~kvbudget.methods.h2o.H2O`): H2O *sums* the attention
    each entry received, so an entry seen by more queries scores higher and early tokens are
    favoured; this *averages* over the queries that see the entry, which removes that advantage
    and favours late tokens relatively. H2O also always keeps ``B − ⌊heavy_fraction·B⌋`` recent
    entries, evicts one entry per decode step with the generated queries' attention added, and its
    budgets are fixed; this keeps no recent window, acts in the prefill only (the cache grows while
    decoding, as kvpress's presses) and takes the allocator options. It is not a named
    combination or an option of ``h2o``: a combination only sets options its base already has, no
    ``h2o`` option changes the sum into a mean, and its decode stage is a property of the class
    (``stages``), not an option.

    Reference: the score is H2O's accumulated attention, the heavy-hitter score (Zhang et al.,
    "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
    NeurIPS 2023, arXiv:2306.14048), with kvpress's normalisation by the number of queries that
    see each entry (kvpress's code; the H2O paper sums).

    Departures from kvpress (ours): on a sliding-window layer the mean is over the queries whose
    window holds the entry (kvpress divides by ``n − j`` whatever the window); a batch row's pad
    queries see nothing and are not counted (kvpress compresses one prompt at a time); the
    attention is recomputed from the post-RoPE queries in fp32, with no eager attention.

    Args:
        window: recent entries always kept (default 0, as kvpress). sinks: first entries always
            kept (0).
        chunk: query chunk for the column sums (512; memory ``O(n·chunk)``).
        layer_alloc, head_alloc, beta, floor_alpha: the allocators (uniform by default;
            :class:`~kvbudget.methods.composable.Composable`).
    """

    name: ClassVar[str] = "observed-attention"
    paper: ClassVar[str] = "arXiv:2306.14048"
    summary: ClassVar[str] = (
        "attention each token receives, averaged over the prompt queries that see it (kvpress's "
        "ObservedAttention); no window"
    )
    code: ClassVar[str] = "NVIDIA/kvpress"
    kvpress: ClassVar[str] = "ObservedAttentionPress"
    window: int = 0
    chunk: int = 512

    def validate(self) -> None:
        super().validate()
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            message = f"{self.name}: chunk must be an integer ≥ 1, got {self.chunk!r}"
            raise MethodOptionError(message, self.name, "chunk", self.chunk)

    def score(self, obs: Observation) -> torch.Tensor:
        received = obs.column_sums(self.chunk)  # [b, q_heads, n]
        seeing = queries_seeing(obs).clamp(min=1).repeat_interleave(obs.group_size, dim=1)
        return reduce_group(received / seeing, obs.num_kv_heads, "mean")
