"""Ada-SnapKV: SnapKV scores with AdaKV's head-adaptive budgets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.allocation import adaptive_head_budgets
from kvbudget.errors import UnknownMethodError
from kvbudget.methods.snapkv import SnapKV


@dataclass
class AdaSnapKV(SnapKV):
    """Ada-SnapKV: one top-k over all heads of a layer decides how many entries each head keeps.

    Scores: window attention averaged over the window rows and each GQA group, maxpool 7, w 32.
    Per layer: the top ``H·(B − w)`` candidate scores over the flattened heads give each head's
    winners ``n_h``; ``cap_h = n_h(1 − α) + (B − w)α`` (floor α = 0.2), rounded so the layer's total
    is exact; each head keeps its top ``cap_h`` plus the window. Heads are stored ragged, so
    skewed budgets save real memory.

    Reference: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
    for Efficient LLM Inference" (arXiv:2407.11550).

    Args:
        floor_alpha: share of the per-head budget every head is guaranteed (default 0.2).
        other options as SnapKV (here ``reduce_rows="mean"``).
    """

    name: ClassVar[str] = "ada-snapkv"
    paper: ClassVar[str] = "arXiv:2407.11550"
    reduce_rows: str = "mean"
    floor_alpha: float = 0.2

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.floor_alpha <= 1.0:
            raise UnknownMethodError(f"{self.name}: floor_alpha must be in [0, 1], got {self.floor_alpha}")

    def head_budgets(
        self, scores: torch.Tensor, layer_budget: int, protected: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        candidates = scores.float().masked_fill(protected | ~valid, float("-inf"))
        window = int(protected[0].sum())
        return adaptive_head_budgets(candidates, layer_budget, window, self.floor_alpha)
