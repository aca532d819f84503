"""Allocators: how many entries each layer and each KV head keeps.

Budgets count entries per KV head with the protected window included, as in the papers' tables.
"""

from __future__ import annotations

import torch


def uniform_layer_budget(budget: int, length: int, layer_idx: int, num_layers: int, window: int) -> int:
    """Every layer keeps ``budget`` entries per head (never more than the ``length`` it has)."""
    return min(budget, length)


def pyramid_layer_budget(
    budget: int, length: int, layer_idx: int, num_layers: int, window: int, beta: int = 20
) -> int:
    """PyramidKV: budgets decrease linearly from the bottom layer to the top one.

    With ``B' = budget − window``: ``min = B' // β``, ``max = 2B' − min``; if ``max ≥ length − window``
    then ``max = length − window`` and ``min = 2B' − max``; ``step = (max − min) // (layers − 1)``;
    layer ``l`` keeps ``max − l·step`` plus the window. The floored step makes the layers' total
    exceed ``layers · budget`` by ``ε·layers·(layers−1)/2`` entries per head, ``ε < 1`` the step's
    dropped fraction (as in the authors' code; a few percent at the papers' budgets).
    """
    if budget >= length:
        return length
    b_prime = budget - window
    low = b_prime // beta
    high = 2 * b_prime - low
    if high >= length - window:
        high = length - window
        low = 2 * b_prime - high
    step = (high - low) // max(num_layers - 1, 1)
    return min(high - layer_idx * step + window, length)


def largest_remainder_round(shares: torch.Tensor, total: int) -> torch.Tensor:
    """Round non-negative ``shares: [k]`` to integers that sum exactly to ``total``."""
    floor = shares.floor()
    result = floor.long()
    missing = int(total - int(result.sum()))
    if missing > 0:
        order = torch.argsort(shares - floor, descending=True, stable=True)
        result[order[:missing]] += 1
    elif missing < 0:
        order = torch.argsort(shares - floor, descending=False, stable=True)
        candidates = order[result[order] > 0]
        result[candidates[:-missing]] -= 1
    return result


def adaptive_head_budgets(
    scores: torch.Tensor, layer_budget: int, window: int, floor_alpha: float
) -> torch.Tensor:
    """AdaKV head budgets for one batch row of one layer.

    Args:
        scores: ``[kv_heads, m]`` candidate scores (window excluded; invalid = -inf).
        layer_budget: entries per head on average, window included.
        window: protected recent entries per head.
        floor_alpha: fraction of ``B' = layer_budget − window`` every head is guaranteed.

    Returns:
        ``[kv_heads]`` budgets (window included) summing exactly to ``kv_heads · layer_budget``:
        ``cap_h = n_h·(1−α) + B'·α`` with ``n_h`` the head's winners of one top-``H·B'`` over the
        flattened scores, rounded by largest remainder.
    """
    heads, m = scores.shape
    b_prime = layer_budget - window
    total = heads * b_prime
    # stable sort: exact ties go to the earlier (head, slot), independent of the sort kernel
    winners = torch.sort(scores.reshape(-1), descending=True, stable=True).indices[:total] // m
    counts = torch.bincount(winners, minlength=heads).float()
    shares = counts * (1 - floor_alpha) + b_prime * floor_alpha
    return largest_remainder_round(shares, total) + window
