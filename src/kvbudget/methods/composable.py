"""Composable: a scorer whose layer and head allocators are options.

A method on the generic per-layer path (:meth:`~kvbudget.methods.base.Method.compress_layer`: score →
layer budget → head split → per-head top-k) that subclasses :class:`Composable` takes two options:

* ``layer_alloc`` — entries per head each layer keeps:
  ``uniform`` (the budget ``B`` everywhere) or ``pyramid`` (PyramidKV's linear schedule,
  :func:`~kvbudget.allocation.pyramid_layer_budget`, parameter ``beta``);
* ``head_alloc`` — how a layer's budget is split over its KV heads:
  ``uniform`` (each head keeps the layer's budget) or ``ada`` (AdaKV: one top-``H·(B_l − w)`` over
  the layer's flattened candidate scores gives each head its winners ``n_h``, and
  ``cap_h = n_h(1 − α) + (B_l − w)α`` rounded by largest remainder so the layer's total is exact,
  :func:`~kvbudget.allocation.adaptive_head_budgets`, parameter ``floor_alpha``; heads are stored
  ragged, so skewed budgets save real memory).

``w`` is what the selector always keeps: the window in PyramidKV's formula (as PyramidKV's
authors write it; sinks count as candidates there), the window and the sinks in AdaKV's. The
named combinations ``pyramidkv``, ``ada-snapkv``, ``ada-pyramidkv`` and ``laq-ada``
(:mod:`kvbudget.methods.combinations`) are such methods with these options set.

References: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling" (arXiv:2406.02069); Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive
Budget Allocation for Efficient LLM Inference" (arXiv:2407.11550).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.allocation import adaptive_head_budgets, pyramid_layer_budget
from kvbudget.errors import MethodOptionError
from kvbudget.methods.base import Method


@dataclass(frozen=True)
class Composable(Method):
    """Base of scorers whose allocators are options (see the module docstring).

    Args:
        layer_alloc: ``uniform`` (default) or ``pyramid``.
        head_alloc: ``uniform`` (default) or ``ada``.
        beta: PyramidKV's ratio between the top and bottom layers' floor (20; ``pyramid`` only).
        floor_alpha: AdaKV's share of the per-head budget every head is guaranteed (0.2; ``ada`` only).
    """

    layer_allocators: ClassVar[tuple[str, ...]] = ("uniform", "pyramid")
    head_allocators: ClassVar[tuple[str, ...]] = ("uniform", "ada")
    allocator_params: ClassVar[dict[str, tuple[str, str]]] = {
        "beta": ("layer_alloc", "pyramid"),
        "floor_alpha": ("head_alloc", "ada"),
    }

    layer_alloc: str = "uniform"
    head_alloc: str = "uniform"
    beta: int = 20
    floor_alpha: float = 0.2

    def validate(self) -> None:
        super().validate()
        if isinstance(self.beta, bool) or not isinstance(self.beta, int) or self.beta < 1:
            raise MethodOptionError(
                f"{self.name}: beta must be an integer ≥ 1, got {self.beta!r}", self.name, "beta", self.beta
            )
        if not 0.0 <= self.floor_alpha <= 1.0:
            raise MethodOptionError(
                f"{self.name}: floor_alpha must be in [0, 1], got {self.floor_alpha}",
                self.name, "floor_alpha", self.floor_alpha,
            )  # fmt: skip

    def layer_budget(self, budget: int, length: int, layer_idx: int, num_layers: int) -> int:
        if self.layer_alloc == "pyramid":
            return pyramid_layer_budget(budget, length, layer_idx, num_layers, self.window, self.beta)
        return min(budget, length)

    def head_budgets(
        self, scores: torch.Tensor, layer_budget: int, protected: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        if self.head_alloc == "ada":
            candidates = scores.float().masked_fill(protected | ~valid, float("-inf"))
            window = int(protected[0].sum())
            return adaptive_head_budgets(candidates, layer_budget, window, self.floor_alpha)
        return torch.full((scores.shape[0],), layer_budget, dtype=torch.long)
