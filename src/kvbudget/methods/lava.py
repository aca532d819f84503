"""LAVa: layer-wise KV-cache eviction with dynamic head and layer budgets, and its ablations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbudget.allocation import (
    even_head_budgets,
    flattened_head_budgets,
    normalized_entropy,
    pyramid_layer_budget,
)
from kvbudget.errors import MethodOptionError
from kvbudget.methods.layerwise import LayerwiseMethod, LayerwiseRun
from kvbudget.observation import Observation, reduce_group
from kvbudget.scoring import max_l1_value_norm, pool_keys


@dataclass
class LAVaRun(LayerwiseRun):
    """A LAVa run: the cascade's plan, and per (row, layer) the layer's first flattened order and
    its candidate count, which the floored head split of a re-eviction counts in."""

    first_orders: dict[tuple[int, int], tuple[torch.Tensor, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class LAVa(LayerwiseMethod):
    """LAVa: one score comparable across heads and layers decides every head's and layer's budget.

    **Score** (Eq. 6, §4.3): for query head ``q`` of KV head ``h``,
    ``s_q[i] = maxpool_7(mean_{window rows} A_q[·, i]) · V̄_h`` with ``V̄_h = max_k ‖V_h[k]‖₁``
    over all of the layer's valid entries; the KV head's score is the **max** over its GQA group
    (an entry is kept if any query head needs it). Attention is the softmax of the last ``w``
    prompt queries over all keys (window keys in the normaliser); pooling runs over the ``L − w``
    non-window columns only.

    **Head budgets** (Alg. 1): one top-``B_l`` over the flattened candidate scores of all heads of
    the layer; each head keeps its winners plus the window (stored per head, ragged).

    **Layer budgets** (Eq. 7–8, Alg. 2): the layer's candidate scores normalised into one
    distribution, entropy ``e_l`` divided by ``log N`` (``N = H·(L − w)`` candidates — the paper
    writes ``H × N``, the authors' code ``log N``; we follow the code, and since ``N`` is the same
    for every layer it does not change the budgets). After each prefilled layer ``l``:
    ``B_i = e_i / Σ_{j≤l} e_j · T`` for all ``i ≤ l`` with ``T = (B − w)·layers·H`` candidate
    entries (``B`` = the user budget per KV head, window included), each capped at the layer's
    ``H·(L − w)`` candidates with the excess spread over the others, integerised so the sum is
    exactly ``T`` (largest remainder), and never above the layer's previous budget. Earlier layers
    are re-evicted from their stored scores (cascading): a layer's full cache is only held while it
    is the one being prefilled. Without a floor the kept set at any budget is a prefix of one
    order (score descending, ties to the earlier head, then the earlier token), so the layer
    stores each entry's rank in it and re-evicts by a threshold (``selection_order``, the rank
    fast path of :mod:`kvbudget.methods.layerwise`; same entries as re-running Alg. 1). Final
    budgets are proportional to the entropies (up to caps and rounding).

    **Floor** (``floor_alpha = α > 0``; not in the paper, default 0): the authors' code
    (MGDDestiny/Lava, ``adaptive_snapkv/monkeypatch/snapkv_utils.py``, ``LavaKVCluster``,
    ``update_kv_gqa`` / ``re_update_kv_gqa``; ``--floor_alpha`` defaults to 0.2 in
    ``experiments/LongBench/pred.py``) gives each head AdaKV's floor on top of its share of the
    flattened top-k: with ``n_h`` the head's winners among the first ``B_l`` of the layer's
    flattened order (all of its candidates, scored once), the head keeps its top
    ``cap_h = round(n_h·(1 − α) + ⌊α·B⌋)`` candidates (half to even) plus the window, where ``B`` is
    the *configured* budget per head, window included — the code's layer loop assigns the
    per-layer floor to a misspelt attribute, so the floor computed at construction from the
    configured budget is the one used. ``Σ_h cap_h`` is not ``B_l``: the cache's total drifts from
    ``T`` (larger for low-entropy layers, smaller for high ones). Re-eviction recounts ``n_h`` in
    the layer's first order at the new ``B_l`` and keeps ``min(cap_h, held)``; a layer whose
    budget reaches its candidates keeps them all (the code skips a layer whose per-head budget
    exceeds ``L − w``). Applies with the flattened head split (``head_alloc="flat"``, not
    ``"uniform"``); selection then takes the generic path.

    **Allocators as options** (the paper's ablations, §5): ``layer_alloc`` is ``entropy`` (the
    cascading budgets above, default), ``uniform`` (every layer ``H·(B − w)`` candidates, not
    cascading; registered as ``lava-uniform``) or ``pyramid`` (PyramidKV's fixed linear schedule,
    :func:`~kvbudget.allocation.pyramid_layer_budget` with ``beta``, not cascading;
    ``lava-pyramid``); ``head_alloc`` is ``flat`` (Alg. 1, default) or ``uniform`` (each layer's
    ``B_l`` split evenly, ``B_l / H`` with the remainder to the first heads, each head keeping its
    own top by the LAVa score; ``lava-nohead``).

    Other differences from the authors' code: ``V̄_h`` runs over all entries as in Eq. 6 (the code
    skips the window's values); layer budgets are integerised over all ``H·layers`` entries by
    largest remainder with exact total (the code truncates each layer's per-head share, losing up
    to ``H`` entries per layer); exact score ties go to the earlier head, then the earlier token
    (the code's ``topk`` leaves them unspecified).

    Reference: Shen et al., "LAVa: Layer-wise KV Cache Eviction with Dynamic Budget Allocation"
    (arXiv:2509.09754).

    Args:
        window: observation window, always kept (32). kernel: pooling kernel (7).
        pooling: ``max`` (default) or ``avg``.
        floor_alpha: the authors' code's per-head floor ``α`` (default 0 = the paper; their
            code runs 0.2).
        layer_alloc: ``entropy`` (default), ``uniform`` or ``pyramid``. head_alloc: ``flat``
            (default) or ``uniform``. beta: PyramidKV's β (20; ``layer_alloc="pyramid"`` only).
    """

    name: ClassVar[str] = "lava"
    paper: ClassVar[str] = "arXiv:2509.09754"
    summary: ClassVar[str] = (
        "window attention × value norm compared across heads; layer budgets from score entropy, "
        "earlier layers re-evicted as the prefill goes"
    )
    code: ClassVar[str] = "MGDDestiny/Lava"
    small_options: ClassVar[dict[str, Any]] = {"window": 4, "kernel": 3}
    layer_allocators: ClassVar[tuple[str, ...]] = ("entropy", "uniform", "pyramid")
    head_allocators: ClassVar[tuple[str, ...]] = ("flat", "uniform")
    allocator_params: ClassVar[dict[str, tuple[str, str]]] = {"beta": ("layer_alloc", "pyramid")}
    state_name = "lava_score"

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    floor_alpha: float = 0.0
    layer_alloc: str = "entropy"
    head_alloc: str = "flat"
    beta: int = 20

    @property
    def cascading(self) -> bool:  # type: ignore[override]
        """Entropy layer budgets are cascading; fixed (uniform, pyramid) ones are not."""
        return self.layer_alloc == "entropy"

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.floor_alpha <= 1.0:
            raise MethodOptionError(
                f"{self.name}: floor_alpha must be in [0, 1], got {self.floor_alpha}",
                self.name, "floor_alpha", self.floor_alpha,
            )  # fmt: skip
        if isinstance(self.beta, bool) or not isinstance(self.beta, int) or self.beta < 1:
            raise MethodOptionError(
                f"{self.name}: beta must be an integer ≥ 1, got {self.beta!r}", self.name, "beta", self.beta
            )
        if self.floor_alpha > 0.0 and self.head_alloc != "flat":
            raise MethodOptionError(
                f"{self.name}: floor_alpha applies to the flattened head split only (head_alloc="
                f"{self.head_alloc!r} splits each layer evenly), got {self.floor_alpha}",
                self.name, "floor_alpha", self.floor_alpha,
            )  # fmt: skip

    def score(self, obs: Observation) -> torch.Tensor:
        probs = obs.window_probs(self.window)  # [b, hq, rows, n]
        w, n = obs.window_keys(self.window), probs.shape[3]
        rows = probs.mean(2)
        pooled = torch.zeros_like(rows)
        pooled[..., : n - w] = pool_keys(rows[..., : n - w], self.kernel, self.pooling)
        v_bar = max_l1_value_norm(obs).repeat_interleave(obs.group_size, dim=1)  # [b, hq]
        return reduce_group(pooled * v_bar[..., None], obs.num_kv_heads, "max")

    # ------------------------------------------------------------------ budgets
    def model_total(self, target: int, protected: int, num_layers: int, num_heads: int) -> int:
        return (target - protected) * num_layers * num_heads

    def layer_capacity(self, candidates: torch.Tensor) -> int:
        return int(candidates.sum())

    def layer_weight(
        self, obs: Observation, scores: torch.Tensor, row: int, candidates: torch.Tensor
    ) -> float:
        return normalized_entropy(scores[row][candidates])

    def static_total(self, target: int, length: int, protected: int, obs: Observation) -> int:
        """Fixed layer budgets (``layer_alloc`` ``uniform`` or ``pyramid``): the layer's candidates."""
        if self.layer_alloc == "pyramid":
            cap = pyramid_layer_budget(target, length, obs.layer_idx, obs.num_layers, self.window, self.beta)
        else:
            cap = self.layer_budget(target, length, obs.layer_idx, obs.num_layers)
        return (cap - protected) * obs.num_kv_heads

    def selection_order(self) -> str | None:
        # the plain flattened top-k keeps a prefix of one order; a floor or an even split does not
        return "flat" if self.head_alloc == "flat" and self.floor_alpha == 0.0 else None

    def split(
        self, scores: torch.Tensor, candidates: torch.Tensor, total: int, bounds: torch.Tensor
    ) -> torch.Tensor:
        if self.head_alloc == "uniform":
            return even_head_budgets(total, bounds)
        masked = scores.float().masked_fill(~candidates, float("-inf"))
        return flattened_head_budgets(masked, total, 0.0, bounds)

    # ------------------------------------------------------------------ the authors' floor
    def start(self, model: object = None) -> LAVaRun:
        return LAVaRun()

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        if obs.layer_idx == 0:
            self.run_of(obs).first_orders.clear()
        return super().compress_layer(obs, targets)

    def rebalance(self, layers: list, targets: list[int | None], run: LAVaRun) -> None:
        super().rebalance(layers, targets, run)
        if len(layers) >= run.num_layers:
            run.first_orders.clear()

    def split_for(
        self,
        run: LAVaRun,
        row: int,
        layer_idx: int,
        target: int,
        scores: torch.Tensor,
        candidates: torch.Tensor,
        total: int,
        bounds: torch.Tensor,
    ) -> torch.Tensor:
        if self.floor_alpha == 0.0:
            return self.split(scores, candidates, total, bounds)
        orders = run.first_orders
        key = (row, layer_idx)
        # the layer's own prefill orders its candidates; a re-eviction recounts in that first order
        order, capacity = orders[key] if key in orders else first_flat_order(scores, candidates)
        counts = floored_head_budgets(order, capacity, total, target, self.floor_alpha, bounds)
        if self.cascading:  # kept for the re-evictions; budgets only shrink from here
            orders[key] = (order[: min(total, capacity)], capacity)
        return counts


def first_flat_order(scores: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A layer's candidates in LAVa's flattened order, as head indices, and how many there are.

    Args:
        scores: ``[kv_heads, n]`` one batch row's scores; candidates: ``[kv_heads, n]`` bool.
    Returns:
        ``[c]`` int16 head index of each candidate, score descending (exact ties to the earlier
        head, then the earlier slot), and ``c``: the first ``k`` of it are the flattened top-``k``.
    """
    n = scores.shape[1]
    masked = scores.float().masked_fill(~candidates, float("-inf"))
    capacity = int(candidates.sum())
    order = torch.sort(masked.reshape(-1), descending=True, stable=True).indices[:capacity]
    return (order // n).to(torch.int16).cpu(), capacity


def floored_head_budgets(
    order: torch.Tensor, capacity: int, total: int, budget: int, alpha: float, bounds: torch.Tensor
) -> torch.Tensor:
    """The authors' floored head split of one layer of one batch row (MGDDestiny/Lava).

    Args:
        order: ``[≥ min(total, capacity)]`` head index of the layer's candidates in their first
            flattened order (:func:`first_flat_order`); capacity: how many candidates the layer had.
        total: the layer's candidate budget ``B_l`` (entries over all heads, window excluded).
        budget: the configured budget per head ``B`` (window included); the floor is ``⌊α·B⌋``.
        alpha: the floor share ``α``. bounds: ``[kv_heads]`` candidates each head holds now.
    Returns:
        ``[kv_heads]`` int64 candidates each head keeps: ``min(round(n_h·(1 − α) + ⌊α·B⌋), bound_h)``
        (round half to even, in float32 as the code computes it) with ``n_h`` the head's count among
        the first ``total`` of ``order``; all it holds once ``total`` reaches ``capacity``.
    """
    bounds = bounds.long().cpu()
    if total >= capacity:
        return bounds.clone()
    winners = torch.bincount(order[:total].long(), minlength=bounds.numel())
    caps = torch.round(winners.float() * (1.0 - alpha) + int(alpha * budget)).long()
    return torch.minimum(caps, bounds)
