"""StreamingLLM: attention sinks plus a sliding window of recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.errors import MethodOptionError
from kvbudget.methods.base import Method
from kvbudget.observation import Observation
from kvbudget.phases import Stage


@dataclass(frozen=True)
class StreamingLLM(Method):
    """Keeps the first ``sinks`` tokens and the most recent ``budget − sinks``, at every step.

    Reference: Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
    ICLR 2024 (arXiv:2309.17453).

    Deviation: the original re-rotates cached keys to their cache positions; here keys keep their
    true RoPE positions (``rerotate`` is not implemented yet and must stay False).

    Args:
        sinks: first tokens always kept (default 4).
        rerotate: re-rotate keys to cache positions (not supported yet).
    """

    name: ClassVar[str] = "streamingllm"
    paper: ClassVar[str] = "arXiv:2309.17453"
    summary: ClassVar[str] = "4 sinks + recent window, at every step"
    kvpress: ClassVar[str] = "StreamingLLMPress"
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL, Stage.DECODE)
    window: int = 0
    sinks: int = 4
    rerotate: bool = False

    def validate(self) -> None:
        super().validate()
        if self.rerotate:
            raise MethodOptionError(
                "streamingllm: rerotate=True is not implemented; keys keep true positions"
            )

    def window_for(self, budget: int) -> int:
        return budget - self.sinks

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.positions.float()

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        self.trim_to(obs, row_budgets)
