"""CAKE: cascading and adaptive KV-cache eviction with layer preferences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.allocation import cake_preference
from kvbudget.errors import UnknownMethodError
from kvbudget.methods.cascade import LayerwiseMethod, pool_candidates
from kvbudget.observation import Observation, reduce_group
from kvbudget.scoring import pool_keys
from kvbudget.selection import protected_mask, select_keep


@dataclass
class CAKE(LayerwiseMethod):
    """CAKE: layer budgets from each layer's attention dispersion and shift, decided while prefilling.

    With ``A`` the window attention (last ``w`` prompt queries, softmax over all keys, all query
    heads) on the ``L − w`` non-window keys:

    * **Preference** ``P_l = H_l^(1/τ1) · V_l^(1/τ2)``, ``H_l = −Σ A log(A + 1e-10)`` summed over
      heads, rows and columns, ``V_l = Σ_{heads, columns} var_rows(A)`` (unbiased).
    * **Eviction score** per key: ``mean_rows(A) + γ·var_rows(A)`` per query head, avgpool 5 over the
      non-window keys, mean over each GQA group; each head keeps its top ``B_l`` plus the window.
    * **Cascading budgets**: after each prefilled layer ``l``, ``B_i = P_i / Σ_{j≤l} P_j · T`` for all
      ``i ≤ l`` with ``T = (B − w)·layers`` entries per head, capped at ``L − w`` with the excess
      spread over the uncapped layers, integerised by largest remainder so they sum to exactly
      ``T``, never above a layer's previous budget; earlier layers are re-evicted from their stored
      scores, so at most one layer holds its full cache.
    * **Decode**: after every generated token each layer is trimmed back to ``B_l + w`` by the
      current query's attention (avgpool 5 over the non-window entries, GQA mean); the last ``w``
      entries are kept. Rows whose prompt fitted the budget are trimmed to the budget.

    Differences from the authors' code (antgroup/cakekv): budgets are rounded by largest remainder
    within the caps (the code truncates, spreads the excess evenly and fixes the sum on the first
    layers); scores are computed in fp32 whatever the model dtype; a prompt is compressed whenever
    it is longer than the budget (the code skips prompts up to ``B + w`` long); entropy and variance
    are per batch row (the code sums them over the batch); pooling at decode runs over each row's
    candidates only (identical for a batch of one).

    Reference: Qin et al., "CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences",
    ICLR 2025 (openreview EQgEMAD4kv).

    Args:
        window: observation window, always kept (32; at least 2 for the variance).
        kernel: pooling kernel (5). pooling: ``avg`` (default) or ``max``.
        gamma: weight of the variance in the eviction score (200).
        tau1, tau2: temperatures of the entropy and the variance in the preference (1, 1).
    """

    name: ClassVar[str] = "cake"
    paper: ClassVar[str] = "ICLR 2025, openreview EQgEMAD4kv"
    stages: ClassVar[tuple[str, ...]] = ("prefill", "decode")
    cascading: ClassVar[bool] = True
    state_name = "cake_score"

    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    gamma: float = 200.0
    tau1: float = 1.0
    tau2: float = 1.0

    def validate(self) -> None:
        super().validate()
        if self.window < 2:
            raise UnknownMethodError(
                f"cake: window must be ≥ 2 (variance over the window rows), got {self.window}"
            )
        if not self.gamma >= 0.0:
            raise UnknownMethodError(f"cake: gamma must be ≥ 0, got {self.gamma}")
        for name in ("tau1", "tau2"):
            if not getattr(self, name) > 0.0:
                raise UnknownMethodError(f"cake: {name} must be > 0, got {getattr(self, name)}")

    def score(self, obs: Observation) -> torch.Tensor:
        probs = obs.window_probs(self.window)  # [b, hq, rows, n]
        w, n = obs.window_keys(self.window), probs.shape[3]
        stat = probs.mean(2) + self.gamma * probs.var(2, unbiased=True)
        pooled = torch.zeros_like(stat)
        pooled[..., : n - w] = pool_keys(stat[..., : n - w], self.kernel, self.pooling)
        return reduce_group(pooled, obs.num_kv_heads, "mean")

    # ------------------------------------------------------------------ budgets
    def model_total(self, target: int, protected: int, num_layers: int, num_heads: int) -> int:
        return (target - protected) * num_layers

    def layer_capacity(self, candidates: torch.Tensor) -> int:
        return int(candidates.sum(-1).min())

    def layer_weight(
        self, obs: Observation, scores: torch.Tensor, row: int, candidates: torch.Tensor
    ) -> float:
        columns = candidates[0].nonzero().flatten()  # the prefill layout: the same keys in every head
        probs = obs.window_probs(self.window)[row][:, :, columns]  # [hq, w, L − w]
        return cake_preference(probs, self.tau1, self.tau2)

    def selection_order(self) -> str | None:
        return "head"  # every head keeps its own top ``total``: a prefix of its order

    def split(
        self, scores: torch.Tensor, candidates: torch.Tensor, total: int, bounds: torch.Tensor
    ) -> torch.Tensor:
        return torch.clamp(bounds.long(), max=int(total))

    # ------------------------------------------------------------------ decode
    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        lengths = obs.layer.head_lengths().cpu()  # [b, h]
        limits = []
        for r, budget in enumerate(row_budgets):
            planned = self.row_budget(r, obs.layer_idx)
            limits.append(budget if planned is None else planned)
        if all(int(lengths[r].max()) <= limit for r, limit in enumerate(limits)):
            return
        valid = obs.valid
        protected = torch.zeros_like(valid)
        budgets = lengths.clone()
        for r, limit in enumerate(limits):
            if int(lengths[r].max()) > limit:
                protected[r] = protected_mask(obs.positions[r : r + 1], self.window, self.sinks)[0]
                budgets[r] = limit
        candidates = (valid & ~protected).repeat_interleave(obs.group_size, dim=1)
        pooled = pool_candidates(obs.last_row_probs(), candidates, self.kernel, self.pooling)
        scores = reduce_group(pooled, obs.num_kv_heads, "mean")
        obs.layer.keep(select_keep(scores, budgets, valid, protected))
