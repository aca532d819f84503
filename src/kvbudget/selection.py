"""Selector: per-head top-k of scores with protected entries always kept."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from kvbudget.byte_budget import RANK_STATE


def protected_mask(positions: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Entries always kept: the last ``window`` and first ``sinks`` valid entries of each row and head.

    Args:
        positions: ``[b, kv_heads, n]`` slot positions (``-1`` = invalid slot, anywhere in the row).
    Returns:
        ``[b, kv_heads, n]`` bool.
    """
    valid = positions >= 0
    counts = valid.long()
    protect = torch.zeros_like(valid)
    if window > 0:
        rank_from_end = counts.flip(-1).cumsum(-1).flip(-1)  # 1 for the last valid entry
        protect |= valid & (rank_from_end <= window)
    if sinks > 0:
        protect |= valid & (counts.cumsum(-1) <= sinks)
    return protect


def record_ranks(layer: Any, scores: torch.Tensor, protected: torch.Tensor) -> None:
    """Note ``scores: [b, kv_heads, n]`` on the layer's entries as their ranking (protected ones first)
    when a byte budget asks for it (the layer holds a ``RANK_STATE`` state of the scores' shape), so
    that the entries kept next carry it: :mod:`kvbudget.byte_budget` stores the highest-ranked ones
    at the higher precision."""
    state = layer.state.get(RANK_STATE)
    if isinstance(state, torch.Tensor) and state.shape == scores.shape:
        layer.state[RANK_STATE] = torch.where(protected, torch.full_like(state, math.inf), scores.float())


def select_keep(
    scores: torch.Tensor, budgets: torch.Tensor, valid: torch.Tensor, protected: torch.Tensor
) -> list[list[torch.Tensor]]:
    """Indices to keep: per row and head, the top ``budgets[r, h]`` entries, protected ones first.

    Args:
        scores: ``[b, kv_heads, n]``; budgets: ``[b, kv_heads]`` (clamped to the valid count);
        valid, protected: ``[b, kv_heads, n]`` bool.
    Returns:
        ``keep[r][h]``: sorted 1-D int64 slot indices.

    Exact ties (max pooling copies one value to its neighbours) go to the earlier slot, so the
    choice does not depend on padding or on the sort kernel: the kept set is what a stable
    descending sort's first ``budgets[r, h]`` would be, found without sorting all ``n`` entries —
    ``topk`` gives each head's threshold (its ``budgets[r, h]``-th best score), every entry above it
    is kept and the earliest entries equal to it fill the rest (cheaper than sorting every entry,
    which decode-stage methods would pay every step). NaN scores fall back to the stable sort.
    """
    s = scores.float().masked_fill(protected, float("inf")).masked_fill(~valid, float("-inf"))
    counts = torch.minimum(budgets.long().to(valid.device), valid.sum(-1))  # budgets may sit on the CPU
    keep: list[list[torch.Tensor]] = []
    for r in range(s.shape[0]):
        k_max = int(counts[r].max())
        if k_max == 0:
            keep.append([s.new_empty(0, dtype=torch.long) for _ in range(s.shape[1])])
        elif bool(s[r].isnan().any()):
            top = torch.sort(s[r], dim=-1, descending=True, stable=True).indices[:, :k_max]  # best first
            keep.append([top[h, : int(counts[r, h])].sort().values for h in range(s.shape[1])])
        else:
            keep.append(_top_by_threshold(s[r], counts[r], k_max))
    return keep


def _top_by_threshold(s: torch.Tensor, counts: torch.Tensor, k_max: int) -> list[torch.Tensor]:
    """Per head of ``s: [kv_heads, n]`` (no NaN) the ascending slots of its ``counts[h]`` best
    entries, ties to the earlier slot; ``1 ≤ k_max = counts.max() ≤ n``."""
    best = torch.topk(s, k_max, dim=-1).values  # [kv_heads, k_max], descending
    threshold = best.gather(-1, (counts - 1).clamp(min=0)[:, None])
    above = s > threshold
    tied = s == threshold
    room = (counts - above.sum(-1))[:, None]  # how many of the tied entries fit
    mask = above | (tied & (tied.cumsum(-1) <= room))  # a head with count 0: nothing above, room 0
    return [mask[h].nonzero().flatten() for h in range(s.shape[0])]


def keep_within_limits(
    positions: torch.Tensor,
    lengths: torch.Tensor,
    limits: list[int | None],
    scores: torch.Tensor,
    window_of: Callable[[int], int],
    sinks: int,
) -> tuple[list[list[torch.Tensor]], list[bool]] | None:
    """What a rectangular layer keeps when rows hold more than ``limits[r]`` entries per head.

    Args:
        positions: ``[b, h, n]`` (``-1`` invalid); lengths: ``[b, h]`` valid entries per head.
        limits: per row the entries per head to keep (``None`` = leave the row as it is).
        scores: ``[b, h, n]``; the window (``window_of(limit)`` last entries) and ``sinks`` are kept.
    Returns:
        ``(keep_indices, over)`` as :func:`select_keep` gives them and which rows exceeded their
        limit, or ``None`` when no row did.
    """
    over = [lim is not None and int(lengths[r].max()) > lim for r, lim in enumerate(limits)]
    if not any(over):
        return None
    valid = positions >= 0
    protected = torch.zeros_like(valid)
    budgets = lengths.clone()
    for r, limit in enumerate(limits):
        if over[r]:
            protected[r] = protected_mask(positions[r : r + 1], window_of(limit), sinks)[0]
            budgets[r] = limit
    return select_keep(scores, budgets, valid, protected), over
