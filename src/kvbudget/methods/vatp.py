"""VATP: value-aware token pruning — attention times value norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.methods.composable import Composable
from kvbudget.observation import Observation, reduce_group
from kvbudget.scoring import value_norms


@dataclass(frozen=True)
class VATP(Composable):
    """VATP: score = accumulated attention × ``‖v_j‖₁``.

    The accumulated attention is that of the observation window (the last ``window`` prompt
    queries, summed over rows), averaged over each GQA group — the window form that lets VATP
    run in the prefill stage like SnapKV (the stages column of README's method table). Attention
    sinks have tiny value norms, so the paper keeps them: ``sinks`` (default 4) are always kept.

    Reference: Guo et al., "Attention Score is not All You Need for Token Importance Indicator in
    KV Cache Reduction: Value Also Matters", EMNLP 2024 (arXiv:2406.12335).

    Args:
        window: observation window, always kept (32). sinks: first tokens always kept (4).
        layer_alloc, head_alloc, beta, floor_alpha: the allocators (uniform by default;
            :class:`~kvbudget.methods.composable.Composable`).
    """

    name: ClassVar[str] = "vatp"
    paper: ClassVar[str] = "arXiv:2406.12335"
    summary: ClassVar[str] = "window attention × value L1 norm, sinks kept"
    small_options: ClassVar[dict[str, Any]] = {"window": 4, "sinks": 2}
    window: int = 32
    sinks: int = 4

    def score(self, obs: Observation) -> torch.Tensor:
        attention = reduce_group(obs.window_probs(self.window).sum(2), obs.num_kv_heads, "mean")
        return attention * value_norms(obs, p=1)
