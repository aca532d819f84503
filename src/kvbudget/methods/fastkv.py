"""FastKV: SnapKV up to the token-selection layer, then only the selected tokens propagate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.errors import UnknownMethodError
from kvbudget.methods.prune_base import PruneMethod, context_slots, top_slots, window_slots
from kvbudget.observation import Observation
from kvbudget.scoring import window_scores


@dataclass
class FastKV(PruneMethod):
    """FastKV: token-selective propagation (TSP) at a fixed layer.

    Every layer whose cache exceeds the budget is compressed with SnapKV (window ``window``,
    max pooling ``kernel``, per-head top-k). At the TSP layer the global score is the SnapKV score
    summed over the KV heads; the top ``tsp_len − window`` context tokens plus the window are kept
    (sorted) and, after the layer's attention and MLP, deeper layers run on those tokens only, at
    their original positions.

    Reference: Jo et al., "FastKV: KV Cache Compression for Fast Long-Context Processing with
    Token-Selective Propagation" (arXiv:2502.01068). Repo: dongwonjo/FastKV.

    Args:
        tsp_layer: the token-selection layer (-1 → ``(layers − 1) // 2``, e.g. 15 of 32 as the
            paper's Llama setting). tsp_len: tokens propagated (0 → the budget, as the ASL paper
            compares them). window: observation window (8). kernel: max-pooling kernel (7).
    """

    name: ClassVar[str] = "fastkv"
    paper: ClassVar[str] = "arXiv:2502.01068"
    window: int = 8
    kernel: int = 7
    tsp_layer: int = -1
    tsp_len: int = 0

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.tsp_layer, int) or self.tsp_layer < -1:
            raise UnknownMethodError(
                f"{self.name}: tsp_layer must be ≥ 0 (or -1 for the middle), got {self.tsp_layer!r}"
            )
        if not isinstance(self.tsp_len, int) or self.tsp_len < 0 or 0 < self.tsp_len <= self.window:
            raise UnknownMethodError(
                f"{self.name}: tsp_len must be 0 (the budget) or > window ({self.window}), "
                f"got {self.tsp_len!r}"
            )

    def selection_layer_for(self, num_layers: int) -> int:
        return min((num_layers - 1) // 2 if self.tsp_layer < 0 else self.tsp_layer, num_layers - 1)

    def score(self, obs: Observation) -> torch.Tensor:
        return window_scores(obs, self.window, self.kernel, "max", "sum", "mean")

    def observe_layer(self, obs: Observation, targets: list[int | None]) -> None:
        if obs.layer_idx != self.selection_layer_for(obs.num_layers):
            return
        scores = self.score(obs).sum(1)  # [b, n]: summed over KV heads
        for r, target in enumerate(targets):
            if target is None:
                continue
            length = int(obs.lengths[r])
            keep_len = self.tsp_len or target
            if keep_len >= length:
                continue
            context = context_slots(obs, r, self.window)
            keep = top_slots(scores[r, context], context, keep_len - self.window)
            self.request_cut(r, obs.layer_idx, torch.cat([keep, window_slots(obs, r, self.window)]))
