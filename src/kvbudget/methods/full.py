"""Full cache: keeps every entry (the reference every method is compared with)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.methods.base import Method
from kvbudget.observation import Observation
from kvbudget.phases import Stage


@dataclass(frozen=True)
class FullCache(Method):
    """No compression. Accepts any budget and ignores it."""

    name: ClassVar[str] = "full"
    paper: ClassVar[str] = "-"
    summary: ClassVar[str] = "keeps everything (reference)"
    stages: ClassVar[tuple[Stage, ...]] = ()
    fixed_allocation: ClassVar[str] = "the full cache keeps every entry"
    window: int = 0

    def min_budget(self) -> int:
        return 1

    def score(self, obs: Observation) -> torch.Tensor:
        return torch.zeros(obs.positions.shape, device=obs.positions.device)

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        """Keeps the layer whole whatever the targets; returns ``[b, kv_heads]`` lengths."""
        return obs.layer.head_lengths().cpu()
