"""A byte budget (``memory=``): how many entries each KV head keeps, and at which precision.

``kvbudget.generate(..., method=M, memory=f)``: the prompt's compressed cache may take ``f`` times
the bytes of the full cache in the model's dtype, scales included. Two precisions share the bytes:
the method keeps entries as usual (its own layer and head allocation, at a budget this module
derives from ``f``), then in every head the highest-ranked quarter of its kept entries
(``HIGH_SHARE``) is stored at the high precision (8 bits by default) and the rest at the low one
(4 bits), and the counts are adjusted over all heads so that the stored bytes meet ``f`` exactly —
at most, and short of it by less than one more entry in each head of one layer. What the
ranking is: the method's own scores where it selects through :func:`~kvbudget.selection.select_keep`
(:func:`~kvbudget.selection.record_ranks`; the protected window and sinks first), else recency (the
latest entries high, as KIVI keeps its latest tokens in full precision). Evicting to meet the bytes
drops the lowest-ranked low-precision entries first.

This module reads and edits the cache's layers through their methods only; it is imported by the
cache lazily (it sits in the cache's layer).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvbudget.errors import KVBudgetError
from kvbudget.quantized_store import GROUP, TieredHead, check_storable, pack_all, segment_bytes

#: (high, low) bits of the two precisions
DEFAULT_TIERS = (8, 4)
#: the share of each head's kept entries the method's budget assumes at the high precision
HIGH_SHARE = 0.25
#: the per-entry state name holding the method's ranking (:func:`kvbudget.selection.record_ranks`)
RANK_STATE = "rank"


def check_memory(memory: float | None, budget: int | None, ratio: float | None, kv_bits: int | None) -> None:
    """One-line errors for ``memory``: in (0, 1], and alone (it sets how many entries and how many bits)."""
    if memory is None:
        return
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0 < memory <= 1:
        raise KVBudgetError(f"memory must be a fraction of the full cache's bytes in (0, 1], got {memory!r}")
    if budget is not None or ratio is not None:
        raise KVBudgetError(
            "give memory or a budget/ratio, not both: memory decides how many entries to keep"
        )
    if kv_bits is not None:
        raise KVBudgetError("give memory or kv_bits, not both: memory decides the precision of each entry")


def _entry_cost(bits: int, head_dim: int, scale_bytes: int) -> float:
    """Average bytes of one entry in a long tier (its share of key scale rows included)."""
    return segment_bytes(GROUP, bits, head_dim, GROUP, scale_bytes) / GROUP


def method_budget(memory: float, prompt_tokens: int, head_dim: int, scale_bytes: int,
                  tiers: tuple[int, int] = DEFAULT_TIERS) -> int:  # fmt: skip
    """Entries per KV head the method keeps on average: ``memory`` × the full cache's bytes over the
    average bytes of an entry when ``HIGH_SHARE`` of them are at the high precision."""
    full = prompt_tokens * 2 * head_dim * scale_bytes
    per_entry = HIGH_SHARE * _entry_cost(tiers[0], head_dim, scale_bytes) + (1 - HIGH_SHARE) * _entry_cost(
        tiers[1], head_dim, scale_bytes
    )
    return max(1, min(prompt_tokens, math.floor(memory * full / per_entry)))


def plan(
    kept: list[int], target: int, tiers: tuple[int, int], head_dim: int, scale_bytes: int,
    units: list[list[int]] | None = None,
) -> list[tuple[int, int]]:  # fmt: skip
    """Per head (high, low) entry counts from ``kept`` entries a head, meeting ``target`` bytes: at
    most, and short of it by less than one more entry in each head of one unit, unless every kept
    entry is already at the high precision. ``units``: groups of heads whose counts move together
    (a layer whose heads all hold as many entries stays so: decode-stage methods read it as one
    tensor); default: each head alone."""
    hi_bits, lo_bits = tiers
    units = units if units is not None else [[i] for i in range(len(kept))]

    def cost(counts: list[tuple[int, int]]) -> int:
        return sum(
            segment_bytes(h, hi_bits, head_dim, GROUP, scale_bytes)
            + segment_bytes(lo, lo_bits, head_dim, GROUP, scale_bytes)
            for h, lo in counts
        )

    base = [(min(n, round(HIGH_SHARE * n)), n - min(n, round(HIGH_SHARE * n))) for n in kept]
    if cost(base) > target:  # evict low entries, then high ones, in proportion: the largest α that fits

        def scaled(alpha: float) -> list[tuple[int, int]]:
            return [
                (math.floor(min(1.0, 2 * alpha) * h), math.floor(max(0.0, 2 * alpha - 1) * lo))
                for h, lo in base
            ]

        counts = scaled(_largest_fitting(lambda a: cost(scaled(a)) <= target))
        return _step(counts, target, cost, units, lambda h, lo, i: (h + 1, lo) if h < base[i][0] else
                     (h, lo + 1) if lo < base[i][1] else None)  # fmt: skip

    def promoted(beta: float) -> list[tuple[int, int]]:  # promote low entries to high in proportion
        return [(h + math.floor(beta * lo), lo - math.floor(beta * lo)) for h, lo in base]

    counts = promoted(_largest_fitting(lambda b: cost(promoted(b)) <= target))
    return _step(counts, target, cost, units, lambda h, lo, i: (h + 1, lo - 1) if lo > 0 else None)


def _largest_fitting(fits: Any) -> float:
    """The largest x in [0, 1] (to 2^-40) with ``fits(x)``, for ``fits`` monotone and true at 0."""
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return 1.0 if fits(1.0) else low


def _step(
    counts: list[tuple[int, int]], target: int, cost: Any, units: list[list[int]], move: Any
) -> list[tuple[int, int]]:
    """Apply ``move(high, low, head)`` (one entry more, or one promoted; ``None``: none left) to every
    head of a unit at once, unit after unit, while the bytes fit."""
    counts = list(counts)
    moved = True
    while moved:
        moved = False
        for unit in units:
            steps = [move(*counts[i], i) for i in unit]
            if any(step is None for step in steps):
                continue
            trial = list(counts)
            for i, step in zip(unit, steps, strict=True):
                trial[i] = step
            if cost(trial) <= target:
                counts, moved = trial, True
    return counts


def apply_byte_budget(
    cache: Any, memory: float, tiers: tuple[int, int] = DEFAULT_TIERS, prompt_tokens: int | None = None
) -> dict[str, Any]:
    """Store every layer of ``cache`` (one sequence, every layer compressed, nothing appended after
    the prompt yet) in two precisions meeting ``memory`` × the full cache's bytes of the prompt's
    ``prompt_tokens`` (default: what the first layer has seen; a two-pass method re-indexes the
    tokens it selected, so the engine passes the prompt's length); returns what was chosen (entries
    per precision per layer, the byte target and what is stored)."""
    layers = cache.layers
    if layers[0].batch_size != 1:
        raise KVBudgetError("memory= stores one sequence at a time; compress each prompt on its own")
    first = layers[0].head(0)[0]
    head_dim, scale_bytes = first.shape[-1], first.element_size()
    for bits in tiers:
        check_storable(bits, head_dim)
    prompt_tokens = prompt_tokens if prompt_tokens is not None else layers[0].seen
    heads = layers[0].num_heads
    target = math.floor(memory * prompt_tokens * len(layers) * heads * 2 * head_dim * scale_bytes)
    kept = [int(n) for layer in layers for n in layer.head_lengths()[0].tolist()]
    units = [
        [li * heads + h for h in range(heads)] if not layer.is_ragged else [li * heads + h]
        for li, layer in enumerate(layers)
        for h in (range(1) if not layer.is_ragged else range(heads))
    ]
    counts = plan(kept, target, tiers, head_dim, scale_bytes, units)
    chosen: dict[str, Any] = {"target_bytes": target, "tiers": list(tiers), "high": [], "low": []}
    for li, layer in enumerate(layers):
        mine = counts[li * heads : (li + 1) * heads]
        order = [_tier_order(layer, h, n_hi, n_lo) for h, (n_hi, n_lo) in enumerate(mine)]
        layer.keep([order])
        layer.state.pop(RANK_STATE, None)
        tiered = []
        for h, (n_hi, _) in enumerate(mine):
            keys, values, _ = layer.head(h)
            tiered.append(
                TieredHead(
                    pack_all(keys[:, :n_hi], values[:, :n_hi], tiers[0]),
                    pack_all(keys[:, n_hi:], values[:, n_hi:], tiers[1]),
                )
            )
        layer.install_quantized(tiered)
        cache.note_memory(li)
        chosen["high"].append(sum(h for h, _ in mine))
        chosen["low"].append(sum(lo for _, lo in mine))
    chosen["stored_bytes"] = cache.physical_bytes()
    return chosen


def _tier_order(layer: Any, h: int, n_hi: int, n_lo: int) -> torch.Tensor:
    """Slot indices of head ``h`` (one row): its ``n_hi`` highest-ranked entries, then the next
    ``n_lo``, each part in slot order; the rest left out."""
    positions = layer.head(h)[2][0]  # [n]
    rank = layer.head_state(RANK_STATE, h)[0] if RANK_STATE in layer.state else positions.float()
    rank = torch.where(positions >= 0, rank.float(), torch.full_like(rank.float(), -math.inf))
    best = torch.sort(rank, descending=True, stable=True).indices
    high = best[:n_hi].sort().values
    low = best[n_hi : n_hi + n_lo].sort().values
    return torch.cat([high, low])
