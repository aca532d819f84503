"""Q-Filters: project keys on each head's principal query direction, taken from an offline profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.errors import MethodOptionError, ProfileError
from kvbudget.methods.base import Method, RunState
from kvbudget.observation import Observation
from kvbudget.phases import Stage
from kvbudget.profiles import resolve_profile


@dataclass
class QFilterRun(RunState):
    """A Q-Filters run: the model's filters ``[layers, kv_heads, head_dim]`` (``None``: no model)."""

    filters: torch.Tensor | None = None


@dataclass(frozen=True)
class QFilter(Method):
    """Q-Filters: keep the keys with the largest projection on their head's query direction.

    Score: ``s_j = ⟨k_j, f_{l,h}⟩`` for the post-RoPE key ``k_j`` of KV head ``h`` in layer ``l``
    (``[b, kv_heads, n, d]`` → ``[b, kv_heads, n]``), with ``f_{l,h}`` the Q-Filter: the first
    right singular vector of the layer's post-RoPE queries, oriented so that most queries project
    positively on it, averaged over the head's GQA group
    (:func:`kvbudget.profiles.query_directions`). Since queries concentrate along that direction,
    ``⟨k, f⟩`` estimates the attention logit a key gets without any attention being computed.
    The window is always kept; each head keeps its top ``B − window`` others, at the prefill and
    after every decode step (the authors' cache compresses while generating).

    The filters come from the model's profile (``kvbudget profile``, JSON with ``query_filters``
    ``[layers][kv_heads][head_dim]``): ``profile=PATH``, else the model's default profile file,
    else one measured on the fly from the two bundled prompts (as BaKlaVa's). A named file that
    does not exist, or a profile made before the filters existed, is a one-line error naming the
    command that makes one.

    Reference: Godey et al., "Q-Filters: Leveraging Query-Key Geometry for Efficient Key-Value
    Cache Compression" (arXiv:2503.02812); authors' code NathanGodey/qfilters (``make_filters.py``
    for the filters, ``QFiltersCache`` for the selection). The authors store ``−f`` and keep the
    smallest ``⟨k, −f⟩``, the same set.

    Deviations: the authors compute the filters from 3000 randomly sampled tokens of 2048-token
    web texts; kvbudget uses every token of the profile's prompts (deterministic).

    Args:
        window: recent entries always kept (default 64, the authors' ``window_length``).
        sinks: first entries always kept (default 0).
        profile: path of a profile JSON; empty = the model's default profile or the bundled prompts.
    """

    name: ClassVar[str] = "qfilter"
    paper: ClassVar[str] = "arXiv:2503.02812"
    summary: ClassVar[str] = (
        "keys' projection on each head's principal query direction (offline profile), window 64"
    )
    code: ClassVar[str] = "NathanGodey/qfilters"
    kvpress: ClassVar[str] = "QFilterPress"
    small_options: ClassVar[dict[str, Any]] = {"window": 4}
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL, Stage.DECODE)
    window: int = 64
    profile: str = ""

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.profile, str):
            raise MethodOptionError(f"qfilter: profile must be a path string, got {self.profile!r}")

    def start(self, model: Any = None) -> QFilterRun:
        """A run with the model's profile filters loaded (``[layers, kv_heads, head_dim]``)."""
        if model is None:
            return QFilterRun()
        source = f"profile {self.profile}" if self.profile else "the model's profile"
        filters = resolve_profile(model, self.profile).filters(source)
        layers = model.config.num_hidden_layers
        if filters.shape[0] != layers:
            raise ProfileError(f"{source} has filters for {filters.shape[0]} layers, the model {layers}")
        return QFilterRun(filters=filters)

    def filters(self, obs: Observation) -> torch.Tensor:
        """The layer's filters ``[kv_heads, d]`` on the keys' device, fp32."""
        filters = self.run_of(obs).filters
        if filters is None:
            raise ProfileError(
                "qfilter has no filters bound: start the run with the model, method.start(model) "
                "(kvbudget.generate, compress, the eval runner and the perplexity task do)"
            )
        layer = filters[obs.layer_idx]
        if tuple(layer.shape) != (obs.num_kv_heads, obs.keys.shape[-1]):
            raise ProfileError(
                f"profile filters are {tuple(layer.shape)} per layer, the model's keys "
                f"{(obs.num_kv_heads, obs.keys.shape[-1])}"
            )
        return layer.to(device=obs.keys.device, dtype=torch.float32)

    def score(self, obs: Observation) -> torch.Tensor:
        return torch.einsum("bhnd,hd->bhn", obs.keys.float(), self.filters(obs))

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        self.trim_to(obs, row_budgets)
