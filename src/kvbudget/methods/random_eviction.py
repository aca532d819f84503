"""Random eviction: the sanity floor every method must beat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.methods.composable import Composable
from kvbudget.observation import Observation


@dataclass(frozen=True)
class RandomEviction(Composable):
    """Keeps a uniformly random subset of entries per head (plus the optional window and sinks).

    Args:
        window: recent entries always kept (default 0: a pure floor).
        seed: seeds a generator per layer (``seed + layer_idx``), so runs are reproducible.
        layer_alloc, head_alloc, beta, floor_alpha: the allocators (uniform by default;
            :class:`~kvbudget.methods.composable.Composable`).

    Each batch row draws its scores over its own valid entries in order, so a prompt gets the
    same selection alone or in a batch.
    """

    name: ClassVar[str] = "random"
    paper: ClassVar[str] = "sanity baseline"
    summary: ClassVar[str] = "random entries (sanity floor)"
    kvpress: ClassVar[str] = "RandomPress"
    #: a small window: the AdaKV grid of tests/test_composition.py has protected entries
    small_options: ClassVar[dict[str, Any]] = {"window": 2}
    window: int = 0
    seed: int = 0

    def score(self, obs: Observation) -> torch.Tensor:
        scores = torch.zeros(obs.positions.shape, device="cpu")  # drawn on the CPU: the same on every device
        valid = obs.valid.cpu()
        for r in range(scores.shape[0]):
            generator = torch.Generator().manual_seed(self.seed + obs.layer_idx)
            row = torch.rand((scores.shape[1], int(valid[r, 0].sum())), generator=generator, device="cpu")
            scores[r][valid[r]] = row.reshape(-1)
        return scores.to(obs.positions.device)
