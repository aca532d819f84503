"""Boolean attention masks over a cache layer's stored positions (True = attend).

The ``kvbudget`` attention (:mod:`kvbudget.attention`) masks with them, and so does
:class:`~kvbudget.observation.Observation` when it recomputes the probabilities methods score
with: both see exactly the keys the model's attention sees, after compression too (causality,
invalid slots, a layer's sliding window).
"""

from __future__ import annotations

import torch


def causal_visibility(n_keys: int, q: int, device: torch.device) -> torch.Tensor:
    """``[q, n_keys]`` bool: old keys visible to every new query, new keys causally."""
    n_old = n_keys - q
    cols = torch.arange(n_keys, device=device)
    rows = torch.arange(q, device=device)
    return (cols[None, :] < n_old) | (cols[None, :] - n_old <= rows[:, None])


def in_window(keys: torch.Tensor, queries: torch.Tensor, window: int) -> torch.Tensor:
    """``[..., q, n]`` bool: True where key position ``keys[..., j]`` is ``> p − window`` for the
    query at position ``p = queries[..., i]`` (``keys: [..., n]``, ``queries: [..., q]``, leading
    dimensions broadcast). Queries need not be keys of the cache (LAQ's pseudo tokens, KVzip's
    reconstruction pass)."""
    return keys[..., None, :] > queries[..., :, None] - window


def window_visibility(positions: torch.Tensor, q: int, window: int) -> torch.Tensor:
    """Sliding-window visibility: ``[b, 1, q, n]`` (``positions: [b, n]``) or ``[b, h, q, n]``
    (``[b, h, n]``), True where the key's position is ``> p − window`` for the query at position
    ``p``; the queries are the tokens of the last ``q`` keys. Invalid (``-1``) queries see every key
    here (their rows are masked by validity elsewhere)."""
    keys = positions if positions.dim() == 3 else positions[:, None]
    queries = keys[..., -q:]
    return in_window(keys, queries, window) | (queries[..., :, None] < 0)


def attention_mask_for(
    positions: torch.Tensor, q: int, has_invalid: bool, window: int | None = None
) -> torch.Tensor | None:
    """Boolean attention mask for ``q`` new queries over keys whose positions are ``positions``.

    Args:
        positions: ``[b, n]`` or ``[b, h, n]`` logical positions of the keys (``-1`` = invalid);
            the last ``q`` keys are the new tokens.
        q: number of new queries.
        has_invalid: whether any key may be invalid.
        window: the layer's sliding window (``None`` = global attention): keys at positions
            ``≤ p − window`` are hidden from the query at position ``p``.

    Returns:
        ``None`` when no mask is needed, else a bool mask broadcastable to ``[b, heads, q, n]``
        (True = attend). Invalid queries attend to themselves only, avoiding empty rows.
    """
    n = positions.shape[-1]
    if not has_invalid and q == 1 and window is None:
        return None
    mask = causal_visibility(n, q, positions.device)
    if window is not None:
        mask = mask & window_visibility(positions, q, window)
    if has_invalid:
        valid = positions >= 0
        if valid.dim() == 2:
            valid = valid[:, None, None, :]
        else:
            valid = valid[:, :, None, :]
        diagonal = torch.zeros_like(mask)
        diagonal[..., n - q :] = torch.eye(q, dtype=torch.bool, device=mask.device)
        mask = (mask & valid) | diagonal
    return mask
