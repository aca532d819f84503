"""Mergers: fold evicted entries into kept ones instead of dropping them.

* :func:`d2o_merge` — D2O's EMA-threshold nearest-neighbour weighted merging of keys and values
  (Eq. 9–12);
* :func:`cam_merge` — CaM's probabilistic merging of evicted values into the following entries.

Both take one batch row of one layer with every KV head at once and return new tensors (nothing is
edited in place: a shared-prefill snapshot may hold the inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class D2OMerge:
    """Output of :func:`d2o_merge`.

    Attributes:
        keys, values: ``[h, S, d]`` the kept entries after merging (unmerged ones bit-identical).
        tau: ``[h]`` the EMA threshold after this eviction.
        merged: ``[h, E]`` bool, which evicted entries were merged (the others are dropped).
        nearest: ``[h, E]`` index of each evicted entry's most similar kept key.
        similarity: ``[h, E]`` that key's cosine similarity.
    """

    keys: torch.Tensor
    values: torch.Tensor
    tau: torch.Tensor
    merged: torch.Tensor
    nearest: torch.Tensor
    similarity: torch.Tensor


def d2o_merge(
    kept_keys: torch.Tensor,
    kept_values: torch.Tensor,
    evicted_keys: torch.Tensor,
    evicted_values: torch.Tensor,
    tau: torch.Tensor | None,
    beta: float = 0.7,
    threshold: bool = True,
) -> D2OMerge:
    """D2O's dynamic token merging (§4.2.2) for one batch row of one layer.

    1. **Nearest neighbour** (Eq. 9): ``u_ij = cos(k_i, k_j)`` between evicted key ``i`` and kept
       key ``j``; each evicted entry is matched to its most similar kept key (keys only; the values
       follow the match).
    2. **EMA threshold** (Eq. 10): at the first eviction (``tau is None``, the prefill)
       ``τ_0 = mean_i max_j u_ij``; afterwards, for each evicted entry in position order,
       ``τ_t = β·max_j u_tj + (1 − β)·τ_{t−1}``. An evicted entry whose best similarity is below the
       threshold is dropped; the others are merged. (With one eviction per decode step this is
       Eq. 10 exactly; several evictions in one step — chunked decoding — are treated as that many
       consecutive steps against the same kept set.) ``threshold=False`` merges every evicted
       entry (the paper's "w.o. EMA-Threshold" ablation; ``τ`` is still tracked).
    3. **Weighted merging** (Eq. 11–12), for each kept entry ``j`` with merged evicted set ``E_j``:
       ``k_j ← w_j·k_j + Σ_{i∈E_j} w_i·k_i`` with ``w_i = exp(u_ij) / (Σ_{i'∈E_j} exp(u_i'j) + e)``
       and ``w_j = e / (Σ exp(u_i'j) + e)`` — ``e = exp(1)`` is the kept key's self-similarity, so
       the weights sum to 1; values the same with the same weights. Kept entries that receive
       nothing are returned unchanged (bit-identical).

    Args:
        kept_keys, kept_values: ``[h, S, d]``; evicted_keys, evicted_values: ``[h, E, d]`` (position
            order). tau: ``[h]`` the previous threshold, or ``None`` at the first eviction.
        beta: EMA smoothing constant β (paper 0.7).
    """
    heads = kept_keys.shape[0]
    e_count = evicted_keys.shape[1]
    if e_count == 0:
        empty = torch.zeros((heads, 0), dtype=torch.bool, device=kept_keys.device)
        return D2OMerge(kept_keys, kept_values, tau if tau is not None else torch.zeros(heads),
                        empty, empty.long(), empty.float())  # fmt: skip
    kc = kept_keys.float()
    ke = evicted_keys.float()
    u = torch.nn.functional.normalize(ke, dim=-1) @ torch.nn.functional.normalize(kc, dim=-1).transpose(1, 2)
    best, nearest = u.max(dim=-1)  # [h, E]
    if tau is None:
        tau = best.mean(-1)
        merged = best >= tau[:, None]
    elif e_count == 1:
        tau = beta * best[:, 0] + (1.0 - beta) * tau.to(best.device, torch.float32)
        merged = best >= tau[:, None]
    else:
        tau = tau.to(best.device, torch.float32)
        merged = torch.zeros_like(best, dtype=torch.bool)
        for i in range(e_count):
            tau = beta * best[:, i] + (1.0 - beta) * tau
            merged[:, i] = best[:, i] >= tau
    if not threshold:
        merged = torch.ones_like(merged)
    fold = _merge_one if e_count == 1 else _merge_scatter  # one entry per head: a decode step
    keys, values = fold(kept_keys, kept_values, evicted_keys, evicted_values, best, nearest, merged)
    return D2OMerge(keys, values, tau, merged, nearest, best)


def _merge_scatter(
    kept_keys: torch.Tensor,
    kept_values: torch.Tensor,
    evicted_keys: torch.Tensor,
    evicted_values: torch.Tensor,
    best: torch.Tensor,
    nearest: torch.Tensor,
    merged: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 12 for any number of evicted entries: every kept row's weighted sum by one scatter.

    ``kept_*: [h, S, d]``, ``evicted_*: [h, E, d]``; ``best, nearest, merged: [h, E]``. Kept rows
    that receive nothing are returned bit-identical.
    """
    kc = kept_keys.float()
    dim = kc.shape[-1]
    weight = torch.exp(best) * merged  # [h, E]: exp(u_ij)·m_ij
    denominator = torch.full(kc.shape[:2], math.e, dtype=torch.float32, device=kc.device)
    denominator.scatter_add_(1, nearest, weight)
    index = nearest[..., None].expand(-1, -1, dim)
    new_k = (math.e * kc).scatter_add_(1, index, weight[..., None] * evicted_keys.float())
    new_k = new_k / denominator[..., None]
    vdim = kept_values.shape[-1]
    v_index = nearest[..., None].expand(-1, -1, vdim)
    new_v = (math.e * kept_values.float()).scatter_add_(
        1, v_index, weight[..., None] * evicted_values.float()
    ) / denominator[..., None]
    touched = (denominator > math.e)[..., None]
    keys = torch.where(touched, new_k.to(kept_keys.dtype), kept_keys)
    values = torch.where(touched, new_v.to(kept_values.dtype), kept_values)
    return keys, values


def _merge_one(
    kept_keys: torch.Tensor,
    kept_values: torch.Tensor,
    evicted_keys: torch.Tensor,
    evicted_values: torch.Tensor,
    best: torch.Tensor,
    nearest: torch.Tensor,
    merged: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 12 for one evicted entry per head (``E = 1``): only each head's nearest kept row changes.

    The same arithmetic, in the same order, as :func:`_merge_scatter` restricted to that row —
    ``(e·k_j + w·k_i) / (e + w)`` — so the results are bit-identical to it; a head whose entry is
    dropped keeps its row untouched. ``best, nearest, merged: [h, 1]``.
    """
    weight = torch.exp(best) * merged  # [h, 1]
    denominator = math.e + weight  # [h, 1]
    out = []
    for kept, evicted in ((kept_keys, evicted_keys), (kept_values, evicted_values)):
        index = nearest[..., None].expand(-1, -1, kept.shape[-1])  # [h, 1, d]
        row = kept.gather(1, index)  # [h, 1, d]
        new_row = (math.e * row.float() + weight[..., None] * evicted.float()) / denominator[..., None]
        new_row = torch.where(merged[..., None], new_row.to(kept.dtype), row)
        out.append(kept.clone().scatter_(1, index, new_row))
    return out[0], out[1]


def cam_merge(
    values: torch.Tensor,
    evicted: torch.Tensor,
    probability: torch.Tensor,
    draws: torch.Tensor,
    span: int,
) -> torch.Tensor:
    """CaM's value merging for one batch row of one layer (values only).

    Entries leave in slot (position) order; when entry ``e`` leaves, with probability ``p_e``
    (``draws < p``) its value — including whatever earlier evictions added to it — divided by
    ``span`` is added to the values of the next ``span`` entries after it (CaM's merge of the token
    leaving the recent window into the window's oldest ``m`` tokens).

    Args:
        values: ``[h, n, d]`` values of the layer's valid entries in slot order.
        evicted: ``[E]`` slot indices leaving, ascending (the same slots in every head).
        probability: ``[h, E]`` merge probabilities (already clamped to ``[0, 1]``).
        draws: ``[h, E]`` uniform draws in ``[0, 1)``.
        span: ``m``, entries receiving each merged value.
    Returns:
        ``[h, n, d]`` new values (evicted slots included; the caller drops them).
    """
    out = values.float().clone()
    n = out.shape[1]
    take = (draws < probability).float()  # [h, E]
    for i, slot in enumerate(evicted.tolist()):
        stop = min(slot + 1 + span, n)
        if stop <= slot + 1:
            continue
        out[:, slot + 1 : stop] += (take[:, i, None] * out[:, slot] / span)[:, None, :]
    return out.to(values.dtype)
