"""TOVA: keep the entries the current query attends to most, one set per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.methods.base import Method
from kvbudget.observation import Observation
from kvbudget.phases import Stage


@dataclass(frozen=True)
class TOVA(Method):
    """TOVA: Token Omission Via Attention.

    Score: the last query's attention averaged over all query heads — one index set per layer,
    shared by its KV heads; at every step the top ``budget`` entries stay (no forced window or
    sinks).

    Reference: Oren et al., "Transformers are Multi-State RNNs" (arXiv:2401.06104).
    """

    name: ClassVar[str] = "tova"
    paper: ClassVar[str] = "arXiv:2401.06104"
    summary: ClassVar[str] = "last query's head-averaged attention, one set per layer"
    code: ClassVar[str] = "schwartz-lab-NLP/TOVA"
    kvpress: ClassVar[str] = "TOVAPress"
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL, Stage.DECODE)
    window: int = 0

    def score(self, obs: Observation) -> torch.Tensor:
        layer_scores = obs.last_row_probs().mean(1, keepdim=True)  # [b, 1, n]
        return layer_scores.expand(-1, obs.num_kv_heads, -1)

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        self.trim_to(obs, row_budgets)
