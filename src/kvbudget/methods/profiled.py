"""Methods whose budgets come from an offline profile (SqueezeAttention, BaKlaVa).

:class:`ProfiledMethod` binds the model's profile in :meth:`prepare` (called by the engine, the
shared-prefill ``derive`` and the perplexity task before a run), turns it into a budget per KV
cache — ``[layers, kv_heads]`` entries for a row of budget ``B`` whose prompt has ``N`` tokens —
and keeps each cache at its own budget: at the end of the prefill, and (StreamingLLM eviction) after
every decode step.

Budgets are integerised over all ``m = layers × kv_heads`` caches at once: the model's total
``B·m`` is exact, no cache exceeds the tokens seen (the excess is spread over the others in
proportion to their shares) and every cache keeps at least one entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.allocation import integer_budgets, squeeze_layer_weights
from kvbudget.errors import ProfileError, UnknownMethodError
from kvbudget.methods.base import Method
from kvbudget.observation import Observation
from kvbudget.profiles import Profile, resolve_profile
from kvbudget.selection import protected_mask, select_keep


@dataclass
class ProfiledMethod(Method):
    """Base of profile-driven methods: per-cache budgets from a profile, StreamingLLM eviction.

    Args:
        profile: path of a profile JSON (``kvbudget profile``); empty (default) = the model's
            default profile file if it exists, else a profile of the bundled prompts built on the fly.
        p: SqueezeAttention's share of the uniform budget kept by the most-similar layer cluster
            (negative = the value ``kvbudget tune --method squeezeattention`` stored, else 0.3).
        sinks: first tokens always kept (4). window: unused by StreamingLLM eviction (0).
    """

    stages: ClassVar[tuple[str, ...]] = ("prefill", "decode")
    #: how many entries each head keeps — "layer" (uniform inside a layer) or "cache" (per KV head)
    granularity: ClassVar[str] = "layer"
    default_p: ClassVar[float] = 0.3
    #: other methods whose tuned parameters apply when this one has none
    tuned_from: ClassVar[tuple[str, ...]] = ()

    window: int = 0
    sinks: int = 4
    profile: str = ""
    p: float = -1.0

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.profile, str):
            raise UnknownMethodError(f"{self.name}: profile must be a path string, got {self.profile!r}")
        if self.p >= 0 and not 0.0 < self.p <= 1.0:
            raise UnknownMethodError(f"{self.name}: p must be in (0, 1] (or negative = auto), got {self.p}")

    def min_budget(self) -> int:
        return 1

    # ------------------------------------------------------------------ profile
    def prepare(self, model: Any) -> None:
        """Load (or build) the model's profile and check it fits the model."""
        profile = resolve_profile(model, self.profile)
        layers = model.config.num_hidden_layers
        if profile.num_layers != layers:
            raise ProfileError(f"profile has {profile.num_layers} layers, the model {layers}")
        self.__dict__["_profile"] = profile
        self.__dict__["_plans"] = {}

    @property
    def bound_profile(self) -> Profile:
        profile = self.__dict__.get("_profile")
        if profile is None:
            raise ProfileError(
                f"{self.name} has no profile bound: call method.prepare(model) first "
                "(kvbudget.generate, compress, the eval runner and the perplexity task do)"
            )
        return profile

    def tuned(self, ratio: float, names: tuple[str, ...] | None = None) -> dict[str, float]:
        """Tuned parameters stored in the profile at the ratio nearest ``ratio``: the first of
        ``names`` (default: this method, then ``tuned_from``) that has a search."""
        for name in names or (self.name, *self.tuned_from):
            best = None
            for key, entry in self.bound_profile.tuned.get(name, {}).items():
                if not isinstance(entry, dict) or not isinstance(entry.get("best"), dict):
                    continue
                try:
                    distance = abs(float(key) - ratio)
                except ValueError:
                    continue
                if best is None or distance < best[0]:
                    best = (distance, entry["best"])
            if best:
                return dict(best[1])
        return {}

    def resolved_p(self, ratio: float) -> float:
        """``p``: the option, else this method's tuned ``p``, else SqueezeAttention's tuned ``p`` (the
        layer split BaKlaVa builds on), else 0.3."""
        if self.p >= 0:
            return self.p
        for names in (None, ("squeezeattention",)):
            value = self.tuned(ratio, names).get("p")
            if value is not None:
                return float(value)
        return self.default_p

    # ------------------------------------------------------------------ budgets
    def shares(self, ratio: float) -> torch.Tensor:
        """Relative budget of every cache, ``[layers, kv_heads]`` float64 (mean 1 for the layer split)."""
        profile = self.bound_profile
        p = self.resolved_p(ratio)
        memo = self.__dict__.setdefault("_layer_weights", {})
        if p not in memo:
            memo[p] = torch.tensor(squeeze_layer_weights(profile.layer_similarity, p), dtype=torch.float64)
        return memo[p][:, None].expand(-1, profile.num_kv_heads)

    def cache_budgets(self, budget: int, capacity: int, ratio: float | None = None) -> torch.Tensor:
        """Entries each cache keeps, ``[layers, kv_heads]`` int64, summing to ``budget·layers·kv_heads``
        (or everything, when that covers ``capacity`` tokens per cache). ``ratio`` picks the tuned
        parameters (default ``budget / capacity``)."""
        plans = self.__dict__.setdefault("_plans", {})
        ratio = budget / max(capacity, 1) if ratio is None else ratio
        key = (budget, capacity, ratio)
        if key not in plans:
            shares = self.shares(ratio)
            layers, heads = shares.shape
            if self.granularity == "layer":
                per_layer = integer_budgets(shares[:, 0], budget * layers, capacity)
                plans[key] = per_layer[:, None].expand(-1, heads).clone()
            else:
                flat = integer_budgets(shares.reshape(-1), budget * layers * heads, capacity)
                plans[key] = flat.reshape(layers, heads)
        return plans[key]

    def row_ratio(self, row: int, budget: int, capacity: int) -> float:
        """The compression ratio that picks a row's tuned parameters, fixed for the whole run:
        ``budget / prompt length`` at a compressing prefill, else ``budget / tokens seen`` at the
        first decode step (pass ``t``/``r``/``p`` explicitly to be independent of it)."""
        ratios = self.__dict__.setdefault("_ratios", {})
        if row not in ratios:
            ratios[row] = budget / max(capacity, 1)
        return ratios[row]

    def check_shape(self, obs: Observation) -> None:
        profile = self.bound_profile
        heads = obs.layer.num_heads
        if profile.num_kv_heads != heads or profile.num_layers != obs.num_layers:
            raise ProfileError(
                f"profile is for {profile.num_layers} layers × {profile.num_kv_heads} KV heads, "
                f"the model has {obs.num_layers} × {heads}"
            )

    # ------------------------------------------------------------------ eviction
    def head_window(self, head_budget: int) -> int:
        """Recent entries protected in a cache of ``head_budget`` (StreamingLLM: all but the sinks)."""
        return max(head_budget - self.sinks, 0)

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.positions.float()  # StreamingLLM: the most recent entries win

    def compress(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        self.observe(obs)
        lengths = obs.lengths
        heads = obs.num_kv_heads
        kept = lengths[:, None].expand(-1, heads).clone().cpu()
        if obs.layer_idx == 0:  # a new prefill: first valid position of each row (left padding)
            first = obs.positions[:, 0].masked_fill(~obs.valid[:, 0], 1 << 62).amin(-1)
            self.__dict__["_offsets"] = first.tolist()
            self.__dict__["_ratios"] = {
                r: t / int(obs.lengths[r]) for r, t in enumerate(targets) if t is not None
            }
        if all(t is None for t in targets):
            return kept
        self.check_shape(obs)
        scores = self.score(obs)
        valid = obs.valid
        protected = torch.zeros_like(valid)
        for r, target in enumerate(targets):
            if target is None:
                continue
            budgets = self.cache_budgets(target, int(lengths[r]), self.row_ratio(r, target, int(lengths[r])))
            budgets = budgets[obs.layer_idx]
            for h in range(heads):
                b = int(budgets[h])
                window = min(self.head_window(b), b)
                sinks = min(self.sinks, b - window)
                protected[r, h] = protected_mask(obs.positions[r : r + 1, h : h + 1], window, sinks)[0, 0]
            kept[r] = budgets
        obs.layer.keep(select_keep(scores, kept, valid, protected))
        return kept

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        """StreamingLLM eviction per cache: keep the first ``sinks`` and the most recent entries.

        Budgets are recomputed with the tokens each row has seen as the capacity, so they equal
        the prefill's until a cache could hold everything (then nothing is evicted).
        """
        self.observe(obs)
        layer = obs.layer
        lengths = layer.head_lengths().cpu()  # [b, h]
        heads = lengths.shape[1]
        positions = [layer.head(h)[2] for h in range(heads)]  # per head [b, n_h]
        offsets = self.__dict__.get("_offsets") or []
        limits = []
        for r, budget in enumerate(row_budgets):
            last = max(int(p[r].max()) for p in positions)
            first = offsets[r] if r < len(offsets) else min(int(p[r][p[r] >= 0].min()) for p in positions)
            capacity = last - first + 1
            plan = self.cache_budgets(budget, capacity, self.row_ratio(r, budget, capacity))
            limits.append(plan[obs.layer_idx])
        if all(bool((lengths[r] <= limits[r]).all()) for r in range(len(row_budgets))):
            return
        self.check_shape(obs)
        keep: list[list[torch.Tensor]] = []
        for r in range(len(row_budgets)):
            row = []
            for h in range(heads):
                slots = (positions[h][r] >= 0).nonzero().flatten()
                b = int(limits[r][h])
                if slots.numel() > b:
                    sinks = min(self.sinks, b)
                    slots = torch.cat([slots[:sinks], slots[slots.numel() - (b - sinks) :]])
                row.append(slots)
            keep.append(row)
        layer.keep(keep)


