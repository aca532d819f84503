"""GemFilter: early layers find the relevant tokens; the whole model then runs on them alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.errors import MethodOptionError
from kvbudget.methods.prune_base import (
    PruneMethod,
    check_layer_fraction,
    context_slots,
    layer_at_fraction,
    top_slots,
    window_slots,
)
from kvbudget.observation import Observation
from kvbudget.scoring import pool_keys


def last_query_scores(obs: Observation, kernel: int) -> torch.Tensor:
    """GemFilter's score ``[b, n]``: raw ``q_last · k`` (no scaling, no softmax) summed over all query
    heads, average-pooled along the keys (kernel ``kernel``, zero padding)."""
    q = obs.query[:, :, -1].float()  # [b, hq, d]
    keys = obs.keys.repeat_interleave(obs.group_size, dim=1).float()  # [b, hq, n, d]
    dots = torch.einsum("bhd,bhnd->bn", q, keys)[:, None]  # summed over heads: [b, 1, n]
    return pool_keys(dots.masked_fill(~obs.valid[:, :1], 0.0), kernel, "avg")[:, 0]


@dataclass(frozen=True)
class GemFilter(PruneMethod):
    """GemFilter: select tokens at an early filter layer, then run the model on them only.

    Pass 1 runs layers ``0..filter_layer``; at the filter layer the score of each token is the raw
    dot product of the last query with its key, summed over all heads and average-pooled
    (:func:`last_query_scores`); the top ``budget`` tokens, sorted by position, are selected.
    Pass 2 runs the whole model on the selected tokens with re-indexed positions ``0..k−1``; its
    cache (``k`` per layer) is what decoding uses.

    Reference: Shi et al., "Discovering the Gems in Early Layers: Accelerating Long-Context LLMs
    with 1000x Input Token Reduction" (arXiv:2409.17422). Repo: SalesforceAIResearch/GemFilter.

    Args:
        filter_layer: -1 → ``filter_layer_fraction``, else ``round(0.4 · layers)`` (13 of 32, the
            paper's Llama 3.1 setting).
        filter_layer_fraction: the filter layer as a fraction ``f`` of the depth, layer
            ``floor(f · layers + 0.5)`` (at most the last); -1 (default) = unset. An explicit
            ``filter_layer`` ≥ 0 wins. ``gemfilter@asl`` sets 0.5 (ASL's 14 of 28 on Qwen2.5-7B).
        kernel: average-pooling kernel (5).
        window: last prompt tokens always kept (1). The authors' top-k runs over every token and
            usually contains the last one; keeping it always makes generation continue from the
            prompt's true end — a deliberate difference.
    """

    name: ClassVar[str] = "gemfilter"
    paper: ClassVar[str] = "arXiv:2409.17422"
    summary: ClassVar[str] = "last query's raw q·k at an early layer selects tokens; the model reruns on them"
    code: ClassVar[str] = "SalesforceAIResearch/GemFilter"
    small_options: ClassVar[dict[str, Any]] = {"kernel": 3}
    two_pass: ClassVar[bool] = True
    window: int = 1
    kernel: int = 5
    filter_layer: int = -1
    filter_layer_fraction: float = -1.0

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.filter_layer, int) or self.filter_layer < -1:
            raise MethodOptionError(
                f"{self.name}: filter_layer must be ≥ 0 (or -1 for 0.4·layers), got {self.filter_layer!r}"
            )
        check_layer_fraction(self.name, "filter_layer_fraction", self.filter_layer_fraction)

    def selection_layer_for(self, num_layers: int) -> int:
        """The filter layer of a ``num_layers``-layer model (``filter_layer``, the fraction, or 0.4)."""
        if self.filter_layer >= 0:
            return min(self.filter_layer, num_layers - 1)
        if self.filter_layer_fraction >= 0:
            return layer_at_fraction(self.filter_layer_fraction, num_layers)
        return min(round(0.4 * num_layers), num_layers - 1)

    def observe_layer(self, obs: Observation, targets: list[int | None]) -> None:
        if obs.layer_idx != self.selection_layer_for(obs.num_layers):
            return
        scores = last_query_scores(obs, self.kernel)
        for r, target in enumerate(targets):
            if target is None:
                continue
            context = context_slots(obs, r, self.window)
            keep = top_slots(scores[r, context], context, target - self.window)
            self.run_of(obs).request_cut(
                r, obs.layer_idx, torch.cat([keep, window_slots(obs, r, self.window)])
            )
