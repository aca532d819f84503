"""SnapKV: window attention, pooled, selects what the prompt's end attends to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.methods.composable import Composable
from kvbudget.observation import Observation
from kvbudget.scoring import window_scores


@dataclass(frozen=True)
class SnapKV(Composable):
    """SnapKV: keep the entries the observation window attends to most.

    Score: attention of the last ``window`` prompt queries (softmax over all keys), summed over
    the window rows, averaged over each GQA group, pooled along keys; each head keeps its top
    ``budget − window`` plus the window. Uniform budgets by default; ``layer_alloc`` and
    ``head_alloc`` swap the allocators (:mod:`kvbudget.methods.composable`): ``pyramidkv``,
    ``ada-snapkv`` and ``ada-pyramidkv`` are SnapKV with them set.

    Reference: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
    NeurIPS 2024 (arXiv:2404.14469).

    Args:
        window: observation window (default 32). kernel: pooling kernel (7).
        pooling: ``max`` (default) or ``avg``. reduce_rows: ``sum`` (default) or ``mean``.
        reduce_heads: GQA reduction, ``mean`` (default) or ``max``.
        layer_alloc, head_alloc, beta, floor_alpha: the allocators
            (:class:`~kvbudget.methods.composable.Composable`; uniform by default).
    """

    name: ClassVar[str] = "snapkv"
    paper: ClassVar[str] = "arXiv:2404.14469"
    summary: ClassVar[str] = "pooled attention of the last 32 prompt queries"
    code: ClassVar[str] = "FasterDecoding/SnapKV"
    kvpress: ClassVar[str] = "SnapKVPress"
    small_options: ClassVar[dict[str, Any]] = {"window": 4, "kernel": 3}
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    reduce_rows: str = "sum"
    reduce_heads: str = "mean"

    def score(self, obs: Observation) -> torch.Tensor:
        return window_scores(obs, self.window, self.kernel, self.pooling, self.reduce_rows, self.reduce_heads)
