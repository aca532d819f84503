"""FastKV: SnapKV up to the token-selection layer, then only the selected tokens propagate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.errors import MethodOptionError
from kvbudget.methods.prune_base import (
    PruneMethod,
    check_layer_fraction,
    context_slots,
    layer_at_fraction,
    top_slots,
    window_slots,
)
from kvbudget.observation import Observation
from kvbudget.scoring import window_scores


@dataclass(frozen=True)
class FastKV(PruneMethod):
    """FastKV: token-selective propagation (TSP) at a fixed layer.

    Every layer whose cache exceeds the budget is compressed with SnapKV (window ``window``,
    pooling ``pooling`` with kernel ``kernel``, GQA reduction ``reduce_heads``, per-head top-k). At
    the TSP layer the global score is that SnapKV score summed over the KV heads
    (``scores: [b, kv_heads, n]`` → ``[b, n]``); the top ``tsp_len − window`` context tokens plus
    the window are kept (sorted) and, after the layer's attention and MLP, deeper layers run on
    those tokens only, at their original positions.

    Reference: Jo et al., "FastKV: KV Cache Compression for Fast Long-Context Processing with
    Token-Selective Propagation" (arXiv:2502.01068). Repo: dongwonjo/FastKV.

    Args:
        tsp_layer: the token-selection layer (-1 → ``tsp_layer_fraction``, else
            ``(layers − 1) // 2``, e.g. 15 of 32 as the paper's Llama setting).
        tsp_layer_fraction: the TSP layer as a fraction ``f`` of the depth, layer
            ``floor(f · layers + 0.5)`` (at most the last); -1 (default) = unset. An explicit
            ``tsp_layer`` ≥ 0 wins. ``fastkv@asl`` sets 0.483 (ASL's 15 of 32 on Llama-3.1-8B and
            14 of 28 on Qwen2.5-7B).
        tsp_len: tokens propagated (0 → the budget, as the ASL paper compares them).
        window: observation window (8). kernel: pooling kernel (7). pooling: ``max`` (default,
            FastKV's) or ``avg`` (ASL's comparison). reduce_heads: GQA reduction, ``mean``
            (default), ``sum`` (ASL's comparison; the same ranking per head and after the sum
            over KV heads) or ``max``.
    """

    name: ClassVar[str] = "fastkv"
    paper: ClassVar[str] = "arXiv:2502.01068"
    summary: ClassVar[str] = "SnapKV up to a fixed token-selection layer, only the selected tokens propagate"
    code: ClassVar[str] = "dongwonjo/FastKV"
    small_options: ClassVar[dict[str, Any]] = {"window": 4, "kernel": 3}
    window: int = 8
    kernel: int = 7
    pooling: str = "max"
    reduce_heads: str = "mean"
    tsp_layer: int = -1
    tsp_layer_fraction: float = -1.0
    tsp_len: int = 0

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.tsp_layer, int) or self.tsp_layer < -1:
            raise MethodOptionError(
                f"{self.name}: tsp_layer must be ≥ 0 (or -1 for the middle), got {self.tsp_layer!r}"
            )
        check_layer_fraction(self.name, "tsp_layer_fraction", self.tsp_layer_fraction)
        if self.pooling not in ("max", "avg"):
            raise MethodOptionError(f"{self.name}: pooling must be max or avg, got {self.pooling!r}")
        if self.reduce_heads not in ("mean", "sum", "max"):
            raise MethodOptionError(
                f"{self.name}: reduce_heads must be mean, sum or max, got {self.reduce_heads!r}"
            )
        if not isinstance(self.tsp_len, int) or self.tsp_len < 0 or 0 < self.tsp_len <= self.window:
            raise MethodOptionError(
                f"{self.name}: tsp_len must be 0 (the budget) or > window ({self.window}), "
                f"got {self.tsp_len!r}"
            )

    def selection_layer_for(self, num_layers: int) -> int:
        """The TSP layer of a ``num_layers``-layer model (``tsp_layer``, the fraction, or the middle)."""
        if self.tsp_layer >= 0:
            return min(self.tsp_layer, num_layers - 1)
        if self.tsp_layer_fraction >= 0:
            return layer_at_fraction(self.tsp_layer_fraction, num_layers)
        return (num_layers - 1) // 2

    def score(self, obs: Observation) -> torch.Tensor:
        """SnapKV's window score: ``[b, kv_heads, n]``."""
        return window_scores(obs, self.window, self.kernel, self.pooling, "sum", self.reduce_heads)

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
            self.run_of(obs).request_cut(
                r, obs.layer_idx, torch.cat([keep, window_slots(obs, r, self.window)])
            )
