"""Random eviction: the sanity floor every method must beat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.methods.base import Method
from kvbudget.observation import Observation


@dataclass
class RandomEviction(Method):
    """Keeps a uniformly random subset of entries per head (plus the optional window and sinks).

    Args:
        window: recent entries always kept (default 0: a pure floor).
        seed: seeds a generator per layer (``seed + layer_idx``), so runs are reproducible.
    """

    name: ClassVar[str] = "random"
    paper: ClassVar[str] = "sanity baseline"
    window: int = 0
    seed: int = 0

    def score(self, obs: Observation) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + obs.layer_idx)
        return torch.rand(obs.positions.shape, generator=generator)
