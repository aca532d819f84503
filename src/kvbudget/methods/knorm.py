"""KNorm: keep the keys with the smallest L2 norm (a cheap, attention-free reference)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.methods.composable import Composable
from kvbudget.observation import Observation


@dataclass(frozen=True)
class KNorm(Composable):
    """Score = −‖k_j‖₂ per head: low-norm keys tend to draw high attention.

    Reference: Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression", EMNLP 2024 (arXiv:2406.11430).

    Args:
        window: recent entries always kept (default 0, as the paper).
        layer_alloc, head_alloc, beta, floor_alpha: the allocators (uniform by default;
            :class:`~kvbudget.methods.composable.Composable`).
    """

    name: ClassVar[str] = "knorm"
    paper: ClassVar[str] = "arXiv:2406.11430"
    summary: ClassVar[str] = "smallest key L2 norms"
    kvpress: ClassVar[str] = "KnormPress"
    window: int = 0

    def score(self, obs: Observation) -> torch.Tensor:
        return -obs.keys.float().norm(dim=-1)
