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

from kvbudget.errors import KVBudgetError, UnknownMethodError


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
    *,
    targets: torch.Tensor | None = None,
    weighting: str = "paper",
    decision: str = "paper",
    fixed_threshold: float = -1.0,
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

    Variants (defaults = the paper):

    * ``targets: [h, S]`` bool — only these kept entries can receive a merge (the nearest neighbour
      is searched among them; ``None`` = every kept entry, Eq. 9's ``K_c``). D2O uses it to keep
      the sinks and the recent window exact (``merge_targets="heavy"``).
    * ``weighting="authors"`` — the authors' code (AIoT-MLSys-Lab/d2o,
      ``LMEval_kv_token_merge/modeling_llama3_7b_13b_d2o.py``, ``D2O_LayerKVCache.__call__``):
      a scatter-mean of the kept key and the similarity-scaled evicted keys,
      ``k_j ← (k_j + Σ_{i∈E_j} u_ij·k_i) / (1 + |E_j|)`` (values the same with the same ``u_ij``);
      since ``u_ij < 1`` it shrinks the merged key (and value) towards zero.
    * ``decision="authors"`` — the same code's threshold: one ``τ`` for all heads (a per-layer
      scalar, returned repeated to ``[h]``), ``τ_0 = mean`` of ``best`` over heads and evicted
      entries, then once per call ``τ ← (1 − β)·τ + β·mean(best)``; evicted entry ``i`` (the
      ``i``-th of every head) is merged in every head iff ``mean_h best[h, i] ≥ τ``. (Their code
      uses α = β = 0.5 for the two EMA weights; pass ``beta=0.5`` for that.)
    * ``fixed_threshold`` — an evicted entry whose best similarity is below it is dropped whatever
      the EMA decides (−1, the default, drops nothing; above 1 nothing is merged). With
      ``threshold=False`` it is a fixed threshold alone.

    Args:
        kept_keys, kept_values: ``[h, S, d]``; evicted_keys, evicted_values: ``[h, E, d]`` (position
            order). tau: ``[h]`` the previous threshold, or ``None`` at the first eviction.
        beta: EMA smoothing constant β (paper 0.7).
        targets, weighting, decision, fixed_threshold: see above.
    """
    heads = kept_keys.shape[0]
    e_count = evicted_keys.shape[1]
    if e_count == 0:
        empty = torch.zeros((heads, 0), dtype=torch.bool, device=kept_keys.device)
        tau = tau if tau is not None else torch.zeros(heads, device=kept_keys.device)
        return D2OMerge(kept_keys, kept_values, tau, empty, empty.long(), empty.float())
    if weighting not in ("paper", "authors"):
        raise UnknownMethodError(f"d2o_merge: weighting must be paper or authors, got {weighting!r}")
    if decision not in ("paper", "authors"):
        raise UnknownMethodError(f"d2o_merge: decision must be paper or authors, got {decision!r}")
    kc = kept_keys.float()
    ke = evicted_keys.float()
    u = torch.nn.functional.normalize(ke, dim=-1) @ torch.nn.functional.normalize(kc, dim=-1).transpose(1, 2)
    if targets is not None:
        targets = targets.to(u.device)
        if not bool(targets.any(-1).all()):
            raise KVBudgetError("d2o_merge: every head needs at least one merge target")
        u = u.masked_fill(~targets[:, None, :], -math.inf)
    best, nearest = u.max(dim=-1)  # [h, E]
    if decision == "authors":
        tau, merged = _authors_decision(best, tau, beta)
    elif tau is None:
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
    if fixed_threshold > -1.0:
        merged = merged & (best >= fixed_threshold)
    fold = _merge_one if e_count == 1 else _merge_scatter  # one entry per head: a decode step
    keys, values = fold(
        kept_keys, kept_values, evicted_keys, evicted_values, best, nearest, merged, weighting
    )
    return D2OMerge(keys, values, tau, merged, nearest, best)


def _authors_decision(
    best: torch.Tensor, tau: torch.Tensor | None, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' code's merge decision: one ``τ`` over all heads, updated once per call, and a
    head-mean test shared by the heads. ``best: [h, E]``; returns ``τ`` repeated to ``[h]`` and
    ``merged: [h, E]``."""
    mean_best = best.mean()
    if tau is None:
        scalar = mean_best
    else:
        scalar = (1.0 - beta) * tau.to(best.device, torch.float32).mean() + beta * mean_best
    merged = (best.mean(0) >= scalar).expand_as(best).clone()  # [h, E]: the same in every head
    return scalar.expand(best.shape[0]).clone(), merged


def _fold_weights(
    best: torch.Tensor, merged: torch.Tensor, weighting: str
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """``(s, w, c)`` of ``k_j ← (s·k_j + Σ_i w_i·k_i) / (s + Σ_i c_i)`` over the entries merged into
    ``j``: Eq. 12 ``(e, exp(u)·m, exp(u)·m)``, the authors' scatter-mean ``(1, u·m, m)``."""
    if weighting == "authors":
        mask = merged.float()
        return 1.0, best * mask, mask
    weight = torch.exp(best) * merged  # [h, E]: exp(u_ij)·m_ij
    return math.e, weight, weight


def _merge_scatter(
    kept_keys: torch.Tensor,
    kept_values: torch.Tensor,
    evicted_keys: torch.Tensor,
    evicted_values: torch.Tensor,
    best: torch.Tensor,
    nearest: torch.Tensor,
    merged: torch.Tensor,
    weighting: str = "paper",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 12 (or the authors' scatter-mean, ``weighting="authors"``) for any number of evicted
    entries: every kept row's weighted sum by one scatter.

    ``kept_*: [h, S, d]``, ``evicted_*: [h, E, d]``; ``best, nearest, merged: [h, E]``. Kept rows
    that receive nothing are returned bit-identical.
    """
    kc = kept_keys.float()
    dim = kc.shape[-1]
    self_weight, weight, count = _fold_weights(best, merged, weighting)
    denominator = torch.full(kc.shape[:2], self_weight, dtype=torch.float32, device=kc.device)
    denominator.scatter_add_(1, nearest, count)
    index = nearest[..., None].expand(-1, -1, dim)
    new_k = (self_weight * kc).scatter_add_(1, index, weight[..., None] * evicted_keys.float())
    new_k = new_k / denominator[..., None]
    vdim = kept_values.shape[-1]
    v_index = nearest[..., None].expand(-1, -1, vdim)
    new_v = (self_weight * kept_values.float()).scatter_add_(
        1, v_index, weight[..., None] * evicted_values.float()
    ) / denominator[..., None]
    received = torch.zeros(kc.shape[:2], dtype=torch.int32, device=kc.device)
    received.scatter_add_(1, nearest, merged.to(torch.int32))
    touched = (received > 0)[..., None]
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
    weighting: str = "paper",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 12 for one evicted entry per head (``E = 1``): only each head's nearest kept row changes.

    The same arithmetic, in the same order, as :func:`_merge_scatter` restricted to that row —
    ``(s·k_j + w·k_i) / (s + c)``, ``(e, exp(u), exp(u))`` for Eq. 12 and ``(1, u, 1)`` for the
    authors' weighting — so the results are bit-identical to it; a head whose entry is dropped
    keeps its row untouched. ``best, nearest, merged: [h, 1]``.
    """
    self_weight, weight, count = _fold_weights(best, merged, weighting)  # [h, 1]
    denominator = self_weight + count  # [h, 1]
    out = []
    for kept, evicted in ((kept_keys, evicted_keys), (kept_values, evicted_values)):
        index = nearest[..., None].expand(-1, -1, kept.shape[-1])  # [h, 1, d]
        row = kept.gather(1, index)  # [h, 1, d]
        new_row = (self_weight * row.float() + weight[..., None] * evicted.float()) / denominator[..., None]
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
