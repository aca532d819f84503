"""H2O: heavy hitters (most attention received so far) plus recent tokens, at every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.errors import MethodOptionError
from kvbudget.methods.base import Method
from kvbudget.observation import Observation, reduce_group
from kvbudget.phases import Stage


@dataclass(frozen=True)
class H2O(Method):
    """H2O: keep the heavy hitters and a recent window; evict one entry per decode step.

    Score: attention each entry received, summed over all prompt queries (column sums, computed
    in query chunks) and then over every generated step; GQA groups averaged. Of a budget ``B``,
    ``B − ⌊heavy_fraction·B⌋`` recent entries are always kept and the rest are the top scores —
    heavy = recent = 10% of the prompt at ``ratio=0.2``, the paper's setting.

    Reference: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
    Large Language Models", NeurIPS 2023 (arXiv:2306.14048).

    Args:
        heavy_fraction: share of the budget for heavy hitters (default 0.5).
        chunk: query chunk for the column sums (memory O(n·chunk)).
    """

    name: ClassVar[str] = "h2o"
    paper: ClassVar[str] = "arXiv:2306.14048"
    summary: ClassVar[str] = "accumulated attention (heavy hitters) + recent, one eviction per step"
    code: ClassVar[str] = "FMInference/H2O"
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL, Stage.DECODE)
    window: int = 0
    heavy_fraction: float = 0.5
    chunk: int = 512

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.heavy_fraction <= 1.0:
            raise MethodOptionError(f"h2o: heavy_fraction must be in [0, 1], got {self.heavy_fraction}")

    def min_budget(self) -> int:
        return 2

    def window_for(self, budget: int) -> int:
        return budget - int(self.heavy_fraction * budget)

    def observe(self, obs: Observation) -> None:
        obs.layer.init_state("attention_received")
        received = reduce_group(obs.column_sums(self.chunk), obs.num_kv_heads, "mean")
        obs.layer.state["attention_received"] += received

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.layer.state["attention_received"]

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        self.trim_to(obs, row_budgets)
