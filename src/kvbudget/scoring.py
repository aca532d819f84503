"""Scorers: importance of every cached entry of a layer, ``[batch, kv_heads, n]``.

Higher is more important. Entries the selector protects (window, sinks) or that are invalid may
get any score: the selector overrides them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbudget.observation import Observation, reduce_group


def pool_keys(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """1-D pooling along the key axis of ``scores: [b, h, n]``, stride 1, padding ``kernel // 2``.

    ``max`` pads with -inf; ``avg`` pads with zeros and divides by ``kernel`` (PyTorch's
    ``count_include_pad``), as SnapKV does. ``kernel`` must be odd (the length is preserved);
    ``pooling="none"`` or ``kernel=1`` returns the scores unchanged.
    """
    b, h, n = scores.shape
    if pooling == "none" or kernel <= 1 or n == 0:  # n == 0: every key is in the window (a short prompt)
        return scores
    flat = scores.reshape(b * h, 1, n)
    if pooling == "max":
        pooled = F.max_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    elif pooling == "avg":
        pooled = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"unknown pooling '{pooling}': expected max, avg or none")
    return pooled.reshape(b, h, n)


def window_scores(
    obs: Observation,
    window: int,
    kernel: int,
    pooling: str,
    reduce_rows: str = "sum",
    reduce_heads: str = "mean",
) -> torch.Tensor:
    """The common window score WS(w, kernel, pool, reduce) (docs/architecture.md, "Window score").

    Attention of the last ``window`` queries (softmax over all keys) on the keys before the
    window, reduced over the window rows (``sum``/``mean``), over each GQA group
    (``mean``/``max``/``sum``; ``sum`` is ASL's and FastKV's), then pooled along the keys.
    Returns ``[b, kv_heads, n]``; the window's own columns are 0 (the selector keeps them anyway).
    """
    probs = obs.window_probs(window)  # [b, hq, rows, n]
    w = obs.window_keys(window)
    rows = probs.sum(2) if reduce_rows == "sum" else probs.mean(2)
    per_head = reduce_group(rows, obs.num_kv_heads, reduce_heads)
    n = per_head.shape[-1]
    scores = torch.zeros_like(per_head)
    scores[..., : n - w] = pool_keys(per_head[..., : n - w], kernel, pooling)
    return scores


def value_norms(obs: Observation, p: int = 1) -> torch.Tensor:
    """Per-entry value norm ``||v_j||_p``: ``[b, kv_heads, n]``."""
    return obs.values.float().norm(p=p, dim=-1)


def max_l1_value_norm(obs: Observation) -> torch.Tensor:
    """``max`` of ``‖v_j‖₁`` over each batch row's and KV head's valid entries: ``[b, kv_heads]``
    (0 where a head has none).

    The same numbers as ``value_norms(obs, 1).masked_fill(~obs.valid, 0).amax(-1)``, about three
    times faster: ``abs().sum`` (another summation order, so within a relative ``d·2⁻²⁴`` of the
    norm torch computes) finds the entries within 0.1 % of the largest, and only those get torch's
    own ``norm`` — the exact maximum is always among them (0.1 % is far above twice the rounding
    bound). Non-finite values fall back to the direct computation.
    """
    values, valid = obs.values.float(), obs.valid
    approx = values.abs().sum(-1).masked_fill(~valid, 0.0)  # [b, kv, n]
    top = approx.amax(-1, keepdim=True)
    if not bool(torch.isfinite(top).all()):
        return value_norms(obs, p=1).masked_fill(~valid, 0.0).amax(-1)
    rows, heads, slots = ((approx >= top * (1.0 - 1e-3)) & valid).nonzero(as_tuple=True)
    exact = values[rows, heads, slots].norm(p=1, dim=-1)
    out = torch.zeros(top.shape[:-1], dtype=exact.dtype, device=exact.device)
    out.view(-1).scatter_reduce_(0, rows * top.shape[1] + heads, exact, "amax")
    return out
