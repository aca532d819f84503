"""PyramidKV: SnapKV scores with budgets shrinking linearly from bottom to top layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbudget.allocation import pyramid_layer_budget
from kvbudget.methods.snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """PyramidKV: lower layers keep more, upper layers less (pyramidal information funnelling).

    Layer budgets per :func:`kvbudget.allocation.pyramid_layer_budget` (β = 20); scores as SnapKV.
    Short prompts (``budget ≥ length``) are kept whole, explicitly, not silently re-budgeted.

    Reference: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
    Information Funneling" (arXiv:2406.02069).

    Args:
        beta: ratio between the top and bottom layer budgets' floor (default 20); other options as SnapKV.
    """

    name: ClassVar[str] = "pyramidkv"
    paper: ClassVar[str] = "arXiv:2406.02069"
    beta: int = 20

    def layer_budget(self, budget: int, length: int, layer_idx: int, num_layers: int) -> int:
        return pyramid_layer_budget(budget, length, layer_idx, num_layers, self.window, self.beta)
