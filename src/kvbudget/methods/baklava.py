"""BaKlaVa: per-KV-cache budgets from an offline head-importance profile (+ a SnapKV variant)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.allocation import baklava_reallocate
from kvbudget.errors import MethodOptionError
from kvbudget.methods.profiled import ProfiledMethod, ProfiledRun, bounded_budgets
from kvbudget.observation import Observation
from kvbudget.phases import Stage
from kvbudget.scoring import window_scores


@dataclass(frozen=True)
class BaKlaVa(ProfiledMethod):
    """BaKlaVa: KV caches of unimportant heads give memory to the most important ones.

    **Profile** (Alg. 1, :mod:`kvbudget.profiles`): per query head, the token-mean cosine
    similarity between its value input ``V`` and output ``softmax(QKᵀ)V``, mapped to ``[0, 1]``;
    per KV cache the GQA group's mean, importance ``I = 1 − similarity``. Layer similarity is
    SqueezeAttention's.

    **Budgets** (§3.1.4: head importances allocate memory "within a single layer", the layer
    split is SqueezeAttention's): the split (3 clusters, share ``p``) gives layer ``l`` an integer
    ``b_l`` entries per head, ``Σ b_l = B·layers``, each in ``[1, prompt]``. Then Algorithm 2 runs
    inside each layer over its ``m = kv_heads`` caches, each starting at ``b_l``: caches with
    ``I < t`` give up ``r·b_l``, and the ``n`` freed parts go in equal shares ``Δr = n·r·b_l/k`` to
    the ``k = min(n, m − n)`` most important caches of that layer (ties to the earlier head;
    nothing changes in a layer where no cache or every cache is below ``t`` — always so with one KV
    head per layer). Each layer's ``b_l·kv_heads`` is then integerised over its heads in proportion
    to these allocations (:func:`~kvbudget.methods.profiled.bounded_budgets`: exact total, none
    above the prompt — the excess goes to the layer's other heads —, each cache at least one
    entry); so every layer keeps exactly what the split gave it. Budgets are stored per head
    (ragged: the memory is really saved).

    **Eviction** inside each cache: StreamingLLM (4 sinks + most recent), at the prefill and every
    decode step, as in the paper. ``baklava-snapkv`` uses SnapKV's scores instead.

    ``t`` and ``r`` default to the values ``kvbudget tune`` (Alg. 3, perplexity grid search) stored
    in the profile for the compression ratio nearest the run's (``budget / prompt length``); an
    untuned profile uses ``t`` = the median importance and ``r = 0.5`` (our choice; the paper tunes
    both per model and ratio; ``t`` is one threshold for all caches of the model, as in the paper).
    The paper has no public code; where it is silent we chose: several profiling prompts are
    averaged with equal weight; the layer totals are integerised before the heads.

    **Scope** (``scope="model"``, our own variant, not the paper's): Algorithm 2 over all
    ``layers × kv_heads`` caches at once, each starting at its layer's share, integerised over all
    caches (exact model total ``B·layers·kv_heads``): important heads may take memory from other
    layers, so the layer split is not kept. On smollm2-135m perplexity (8 Austen passages of 1024
    tokens, bf16, untuned profile) it was 2.8 lower at B = 64 (paired 95% interval [2.3, 3.3]) and
    0.6 lower at B = 128 ([0.3, 1.1]) than the paper's per-layer scope; ``docs/methods.md`` has the
    command.

    Reference: Gulhan et al., "BaKlaVa — Budgeted Allocation of KV cache for Long-context
    Inference" (arXiv:2502.13176).

    Args:
        t: importance threshold (negative = tuned, else the median importance).
        r: fraction of the budget a low-importance cache loses, in [0, 1] (negative = tuned, else 0.5).
        scope: ``layer`` (default, the paper: Algorithm 2 inside each layer) or ``model`` (ours:
            over all caches of the model).
        p, profile, sinks: as ``squeezeattention``.
    """

    name: ClassVar[str] = "baklava"
    paper: ClassVar[str] = "arXiv:2502.13176"
    summary: ClassVar[str] = (
        "per-KV-cache budgets from an offline head-importance profile (Alg. 2 on top of the layer "
        "split); StreamingLLM inside each cache"
    )
    granularity: ClassVar[str] = "cache"
    default_r: ClassVar[float] = 0.5

    t: float = -1.0
    r: float = -1.0
    scope: str = "layer"

    def validate(self) -> None:
        super().validate()
        if self.scope not in ("layer", "model"):
            raise MethodOptionError(f"{self.name}: scope must be layer or model, got {self.scope!r}")
        if self.r >= 0 and self.r > 1.0:
            raise MethodOptionError(f"{self.name}: r must be in [0, 1] (or negative = auto), got {self.r}")

    def resolved_tr(self, run: ProfiledRun, ratio: float) -> tuple[float, float]:
        """``(t, r)`` for a run at compression ``ratio``: the options, else tuned, else the defaults."""
        tuned = self.tuned(run, ratio)
        t = self.t if self.t >= 0 else tuned.get("t")
        if t is None:
            t = float(run.profile.importance().reshape(-1).median())
        r = self.r if self.r >= 0 else float(tuned.get("r", self.default_r))
        return float(t), r

    def head_shares(self, run: ProfiledRun, ratio: float) -> torch.Tensor:
        """Algorithm 2 inside each layer: ``[layers, kv_heads]`` float64, every cache starting at 1
        (each row sums to ``kv_heads``)."""
        t, r = self.resolved_tr(run, ratio)
        importance = run.profile.importance()
        equal = torch.ones(importance.shape[1], dtype=torch.float64)
        return torch.stack([baklava_reallocate(row, equal, t, r) for row in importance])

    def cache_budgets(
        self, run: ProfiledRun, budget: int, capacity: int, ratio: float | None = None
    ) -> torch.Tensor:
        """``[layers, kv_heads]`` int64 entries per cache; ``scope="model"`` reallocates over the
        whole model (see the class docstring), else as :meth:`ProfiledMethod.cache_budgets`."""
        if self.scope == "layer":
            return super().cache_budgets(run, budget, capacity, ratio)
        plans = run.plans
        ratio = budget / max(capacity, 1) if ratio is None else ratio
        key = (budget, capacity, ratio, "model")
        if key not in plans:
            t, r = self.resolved_tr(run, ratio)
            importance = run.profile.importance()  # [layers, kv_heads]
            base = self.layer_shares(run, ratio)[:, None].expand_as(importance)
            shares = baklava_reallocate(importance.reshape(-1), base.reshape(-1), t, r)
            flat = bounded_budgets(shares, budget * importance.numel(), capacity)
            plans[key] = flat.reshape(importance.shape)
        return plans[key]


@dataclass(frozen=True)
class BaKlaVaSnapKV(BaKlaVa):
    """BaKlaVa's per-cache budgets with SnapKV eviction inside each cache (new combination).

    Each cache keeps its top ``b_h − w`` entries by SnapKV's window score (w 32, maxpool 7, sum over
    the window rows, GQA mean) plus its last ``w`` tokens (a cache with ``b_h ≤ w`` keeps its last
    ``b_h``). Prefill stage only, like SnapKV. Tuned parameters: this method's own, else ``baklava``'s.

    Args:
        window, kernel, pooling, reduce_rows, reduce_heads: as ``snapkv``; t, r, p, profile: as ``baklava``.
    """

    name: ClassVar[str] = "baklava-snapkv"
    summary: ClassVar[str] = (
        "BaKlaVa's per-cache budgets with SnapKV eviction inside each cache (new combination)"
    )
    small_options: ClassVar[dict[str, Any]] = {"window": 4, "kernel": 3}
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL,)
    tuned_from: ClassVar[tuple[str, ...]] = ("baklava",)

    window: int = 32
    sinks: int = 0
    kernel: int = 7
    pooling: str = "max"
    reduce_rows: str = "sum"
    reduce_heads: str = "mean"

    def head_window(self, head_budget: int) -> int:
        return min(self.window, head_budget)

    def score(self, obs: Observation) -> torch.Tensor:
        return window_scores(obs, self.window, self.kernel, self.pooling, self.reduce_rows, self.reduce_heads)
