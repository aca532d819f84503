"""Ada-PyramidKV: PyramidKV layer budgets with AdaKV's head-adaptive split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbudget.allocation import pyramid_layer_budget
from kvbudget.methods.ada_snapkv import AdaSnapKV


@dataclass
class AdaPyramidKV(AdaSnapKV):
    """Ada-PyramidKV: pyramid layer budgets (β = 20), then AdaKV heads within each layer.

    Reference: Feng et al., Ada-KV (arXiv:2407.11550), on top of PyramidKV (arXiv:2406.02069).
    """

    name: ClassVar[str] = "ada-pyramidkv"
    paper: ClassVar[str] = "arXiv:2407.11550"
    beta: int = 20

    def layer_budget(self, budget: int, length: int, layer_idx: int, num_layers: int) -> int:
        return pyramid_layer_budget(budget, length, layer_idx, num_layers, self.window, self.beta)
