"""PyramidInfer: every layer passes on a decaying share of the context (layer-wise pruning)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbudget.errors import MethodOptionError
from kvbudget.methods.prune_base import PruneMethod, PruneRun, context_slots, top_slots, window_slots
from kvbudget.observation import Observation


def decay_ratio(layer_idx: int, num_layers: int, decay: float) -> float:
    """The cosine schedule ``ratio_l = (1 − r)(cos(π l / L) + 1) / 2 + r``: 1 at layer 0, → r at the top."""
    return (1.0 - decay) * (math.cos(math.pi * layer_idx / num_layers) + 1.0) / 2.0 + decay


@dataclass
class PyramidInferRun(PruneRun):
    """A PyramidInfer run: per batch row its recent window (set from its prompt's length)."""

    recent: list[int | None] = field(default_factory=list)


@dataclass(frozen=True)
class PyramidInfer(PruneMethod):
    """PyramidInfer: keep each layer's pivotal context, fewer tokens in deeper layers.

    After every layer, the context (all but the most recent ``1 + int(recent_ratio · n)`` tokens,
    ``n`` the prompt length) is scored by the head-averaged attention of those recent queries,
    weighted by ``linspace(1, distance_weight)`` over the queries and averaged; the first ``sinks``
    tokens always win. The layer passes on its top ``int(ratio_l · context)`` context tokens
    (sorted) plus the recent ones, with ``ratio_l`` from :func:`decay_ratio`; deeper layers run on
    those only, at their original positions. Each layer's cache holds the tokens it processed.

    Reference: Yang et al., "PyramidInfer: Pyramid KV Cache Compression for High-throughput LLM
    Inference", Findings of ACL 2024 (arXiv:2405.12532). Repo: mutonix/pyramidinfer.

    Args:
        decay: r of the schedule (0.9). recent_ratio: share of the prompt in the recent window (0.2).
        min_context: context tokens never pruned below (64). sinks: always kept (4).
        distance_weight: weight of the last recent query relative to the first (1.2).

    Budget: PyramidInfer has no budget of its own — its cache follows from the schedule. Here the
    budget is a floor: a layer never passes on fewer than ``budget`` tokens (the context floor is
    ``max(min_context, budget − recent)``, clamped rather than the authors' "stop pruning"), and a
    prompt within the budget is not pruned. Layer 0 keeps the whole prompt, so the cache is larger
    than ``budget × layers``; compare it by its bytes, not its budget.
    """

    name: ClassVar[str] = "pyramidinfer"
    paper: ClassVar[str] = "arXiv:2405.12532"
    summary: ClassVar[str] = "every layer passes on a cosine-decaying share of its context"
    code: ClassVar[str] = "mutonix/pyramidinfer"
    small_options: ClassVar[dict[str, Any]] = {"min_context": 8, "decay": 0.5}
    exceeds_budget: ClassVar[bool] = True
    compress_cache: ClassVar[bool] = False
    window: int = 0
    sinks: int = 4
    decay: float = 0.9
    recent_ratio: float = 0.2
    min_context: int = 64
    distance_weight: float = 1.2

    def validate(self) -> None:
        super().validate()
        for name in ("decay", "recent_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
                raise MethodOptionError(f"{self.name}: {name} must be in [0, 1), got {value!r}")
        if not isinstance(self.min_context, int) or self.min_context < 0:
            raise MethodOptionError(
                f"{self.name}: min_context must be an integer ≥ 0, got {self.min_context!r}"
            )

    def start(self, model: object = None) -> PyramidInferRun:
        return PyramidInferRun()

    def begin_prune(self, run: PyramidInferRun, batch_size: int, num_layers: int) -> None:
        super().begin_prune(run, batch_size, num_layers)
        run.recent = [None] * batch_size

    def observe_layer(self, obs: Observation, targets: list[int | None]) -> None:
        run = self.run_of(obs)
        lengths = obs.lengths.tolist()
        for r, target in enumerate(targets):
            if target is not None and run.recent[r] is None:
                run.recent[r] = 1 + int(self.recent_ratio * lengths[r])  # from the prompt's length
        rows = [r for r, t in enumerate(targets) if t is not None]
        if not rows:
            return
        width = max(run.recent[r] for r in rows)
        probs = obs.window_probs(width).mean(1)  # [b, w, n], head-averaged
        ratio = decay_ratio(obs.layer_idx, obs.num_layers, self.decay)
        for r in rows:
            recent = run.recent[r]
            context = context_slots(obs, r, recent)
            floor = max(self.min_context, targets[r] - recent)
            keep_len = max(int(ratio * context.numel()), floor)
            if keep_len >= context.numel():
                continue
            rows_r = probs[r, -recent:][:, context]  # [recent, ctx]
            weights = torch.linspace(1.0, self.distance_weight, recent, device=rows_r.device)
            scores = (rows_r * weights[:, None]).mean(0)
            scores[: self.sinks] = float("inf")
            keep = top_slots(scores, context, keep_len)
            run.request_cut(r, obs.layer_idx, torch.cat([keep, window_slots(obs, r, recent)]))
