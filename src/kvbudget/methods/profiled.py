"""Methods whose budgets come from an offline profile (SqueezeAttention, BaKlaVa).

:class:`ProfiledMethod` binds the model's profile to each run in :meth:`~ProfiledMethod.start`
(a :class:`ProfiledRun`, started by the engine, the shared-prefill ``derive`` and the perplexity
task), turns it into a budget per KV
cache — ``[layers, kv_heads]`` entries for a row of budget ``B`` whose prompt has ``N`` tokens —
and keeps each cache at its own budget: at the end of the prefill, and (StreamingLLM eviction) after
every decode step.

Budgets are integerised in two steps (:func:`bounded_budgets`): first the layer split — ``layers``
integer budgets per head summing exactly to ``B·layers``, proportional to the split's shares,
none above the tokens seen and none below one entry (what a bound takes from or gives to a layer
is shared by the others in proportion to their shares) — then, for a method with per-cache
budgets, each layer's total ``b_l·kv_heads`` over its own heads by their shares within the layer
(same rules). A layer's total is therefore always what the split gave it.

The compression ratio that picks tuned parameters is ``budget / prompt length`` of each row unless
the run's pin fixed it (:meth:`ProfiledRun.pin`; the tuning grid search pins the ratio it tunes for).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbudget.allocation import largest_remainder_round, squeeze_layer_weights
from kvbudget.errors import BudgetError, MethodOptionError, ProfileError
from kvbudget.methods.base import Method, RunState, evict_rows, held_entries
from kvbudget.observation import Observation
from kvbudget.phases import Stage
from kvbudget.profiles import Profile, resolve_profile
from kvbudget.selection import protected_mask


def bounded_budgets(shares: torch.Tensor, total: int, capacity: int) -> torch.Tensor:
    """Integers in ``[1, capacity]`` proportional to ``shares: [m]``, summing to ``min(total, m·capacity)``
    (at least ``m``; ``capacity < 1`` gives zeros).

    The real-valued budgets are ``x_i = clamp(λ·s_i, 1, capacity)`` with the one ``λ`` that makes
    them sum to ``total`` (exact: ``Σ clamp`` is piecewise linear in ``λ``, solved on the segment
    between its knots ``1/s_i``, ``capacity/s_i`` that crosses ``total``); then largest-remainder
    rounding (ties to the earlier item). With no bound active this is ``total·s_i / Σ s`` rounded, so
    integer shares of the total come out exactly (``B·w_l`` for a layer, ``b_l·s_h`` for a head).
    All-zero shares count as equal; zero shares get more than one entry only when every positive
    share is at the capacity.
    """
    s = shares.double().reshape(-1)
    m = s.numel()
    lo, hi = min(1, capacity), max(capacity, 0)
    if total >= m * hi:
        return torch.full((m,), hi, dtype=torch.long)
    if total <= m * lo:
        return torch.full((m,), lo, dtype=torch.long)
    if float(s.sum()) <= 0.0:
        s = torch.ones_like(s)
    pos = s[s > 0]
    knots = torch.cat([lo / pos, hi / pos]).unique()  # sorted
    sums = (knots[:, None] * s[None]).clamp(lo, hi).sum(-1)  # Σ clamp at each knot, non-decreasing
    i = int(torch.searchsorted(sums, torch.tensor([float(total)], dtype=torch.float64)))
    if i == knots.numel():  # every positive share is at the capacity: zero shares take the rest equally
        zero = s <= 0
        rest = (total - hi * int((~zero).sum())) / int(zero.sum())
        return largest_remainder_round(torch.where(zero, rest, float(hi)), total)
    mid = (float(knots[i - 1]) + float(knots[i])) / 2  # i ≥ 1: Σ clamp at the first knot is m·lo < total
    at_hi, at_lo = mid * s >= hi, mid * s <= lo
    free = ~(at_hi | at_lo)
    lam = (total - hi * int(at_hi.sum()) - lo * int(at_lo.sum())) / float(s[free].sum())
    return largest_remainder_round((lam * s).clamp(lo, hi), total)


@dataclass
class ProfiledRun(RunState):
    """A run of a :class:`ProfiledMethod`: the model's profile (``None``: no model bound), plans and
    layer weights memoised for it, the pinned ratio, and per row the ratio, first position and
    prompt length the prefill's plan was made for (held through the decode)."""

    bound: Profile | None = None
    plans: dict[tuple, torch.Tensor] = field(default_factory=dict)
    layer_weights: dict[float, torch.Tensor] = field(default_factory=dict)
    pinned_ratio: float | None = None
    ratios: dict[int, float] = field(default_factory=dict)
    offsets: list[int] = field(default_factory=list)
    capacities: dict[int, int] = field(default_factory=dict)

    @property
    def profile(self) -> Profile:
        if self.bound is None:
            raise ProfileError(
                "this run has no profile bound: start it with the model, method.start(model) "
                "(kvbudget.generate, compress, the eval runner and the perplexity task do)"
            )
        return self.bound

    def pin(self, ratio: float | None) -> float | None:
        """Fix the compression ratio that picks tuned parameters for every row until unpinned
        (``None`` = derive it from each row, :meth:`ProfiledMethod.row_ratio`); returns the previous
        pin. Used by the chunked perplexity (``kvbudget tune``), whose prefills of ``budget`` tokens
        would otherwise look up ``budget / (budget + chunk)`` instead of the passage's ratio."""
        valid = isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0.0 < ratio <= 1.0
        if ratio is not None and not valid:
            raise BudgetError(f"a pinned compression ratio must be in (0, 1], got {ratio!r}")
        previous = self.pinned_ratio
        self.pinned_ratio = None if ratio is None else float(ratio)
        return previous


@dataclass(frozen=True)
class ProfiledMethod(Method):
    """Base of profile-driven methods: per-cache budgets from a profile, StreamingLLM eviction.

    Args:
        profile: path of a profile JSON (``kvbudget profile``); empty (default) = the model's
            default profile file if it exists, else a profile of the bundled prompts built on the fly.
        p: SqueezeAttention's share of the uniform budget kept by the most-similar layer cluster
            (negative = the value ``kvbudget tune --method squeezeattention`` stored, else 0.3).
        sinks: first tokens always kept (4). window: unused by StreamingLLM eviction (0).
    """

    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL, Stage.DECODE)
    #: how many entries each head keeps — "layer" (uniform inside a layer) or "cache" (per KV head)
    granularity: ClassVar[str] = "layer"
    fixed_allocation: ClassVar[str] = "its budgets per layer and head come from the offline profile"
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
            raise MethodOptionError(f"{self.name}: profile must be a path string, got {self.profile!r}")
        if self.p >= 0 and not 0.0 < self.p <= 1.0:
            raise MethodOptionError(f"{self.name}: p must be in (0, 1] (or negative = auto), got {self.p}")

    def min_budget(self) -> int:
        return 1

    # ------------------------------------------------------------------ profile
    def start(self, model: Any = None) -> ProfiledRun:
        """A run with the model's profile loaded (or built) and checked to fit the model."""
        if model is None:
            return ProfiledRun()
        profile = resolve_profile(model, self.profile)
        layers = model.config.num_hidden_layers
        if profile.num_layers != layers:
            raise ProfileError(f"profile has {profile.num_layers} layers, the model {layers}")
        return ProfiledRun(bound=profile)

    def tuned(self, run: ProfiledRun, ratio: float, names: tuple[str, ...] | None = None) -> dict[str, float]:
        """Tuned parameters stored in the run's profile at the ratio nearest ``ratio``: the first of
        ``names`` (default: this method, then ``tuned_from``) that has a search."""
        for name in names or (self.name, *self.tuned_from):
            best = None
            for key, entry in run.profile.tuned.get(name, {}).items():
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

    def resolved_p(self, run: ProfiledRun, ratio: float) -> float:
        """``p``: the option, else this method's tuned ``p``, else SqueezeAttention's tuned ``p`` (the
        layer split BaKlaVa builds on), else 0.3."""
        if self.p >= 0:
            return self.p
        for names in (None, ("squeezeattention",)):
            value = self.tuned(run, ratio, names).get("p")
            if value is not None:
                return float(value)
        return self.default_p

    # ------------------------------------------------------------------ budgets
    def layer_shares(self, run: ProfiledRun, ratio: float) -> torch.Tensor:
        """SqueezeAttention's layer split, ``[layers]`` float64 relative budgets (mean 1)."""
        p = self.resolved_p(run, ratio)
        memo = run.layer_weights
        if p not in memo:
            weights = squeeze_layer_weights(run.profile.layer_similarity, p)
            memo[p] = torch.tensor(weights, dtype=torch.float64)
        return memo[p]

    def head_shares(self, run: ProfiledRun, ratio: float) -> torch.Tensor:
        """Relative budget of each cache within its layer, ``[layers, kv_heads]`` float64 (uniform
        here; only the ratios within a row matter). Used when ``granularity == "cache"``."""
        profile = run.profile
        return torch.ones(profile.num_layers, profile.num_kv_heads, dtype=torch.float64)

    def cache_budgets(
        self, run: ProfiledRun, budget: int, capacity: int, ratio: float | None = None
    ) -> torch.Tensor:
        """Entries each cache keeps, ``[layers, kv_heads]`` int64, summing to ``budget·layers·kv_heads``
        (or everything, when that covers ``capacity`` tokens per cache). ``ratio`` picks the tuned
        parameters (default ``budget / capacity``).

        Layer ``l`` gets ``b_l`` entries per head from the split (:func:`bounded_budgets` of
        :meth:`layer_shares`: ``Σ b_l = budget·layers``, each in ``[1, capacity]``); a
        ``"cache"``-granularity method then splits ``b_l·kv_heads`` over the layer's heads in
        proportion to :meth:`head_shares` (each in ``[1, capacity]``), so every layer keeps exactly
        ``b_l·kv_heads`` entries.
        """
        plans = run.plans
        ratio = budget / max(capacity, 1) if ratio is None else ratio
        key = (budget, capacity, ratio)
        if key not in plans:
            profile = run.profile
            layers, heads = profile.num_layers, profile.num_kv_heads
            per_layer = bounded_budgets(self.layer_shares(run, ratio), budget * layers, capacity)
            if self.granularity == "layer":
                plans[key] = per_layer[:, None].expand(-1, heads).clone()
            else:
                within = self.head_shares(run, ratio)
                plans[key] = torch.stack(
                    [bounded_budgets(within[i], int(per_layer[i]) * heads, capacity) for i in range(layers)]
                )
        return plans[key]

    def row_ratio(self, run: ProfiledRun, row: int, budget: int, capacity: int) -> float:
        """The compression ratio that picks a row's tuned parameters, fixed for the whole run: the
        pinned ratio (:meth:`ProfiledRun.pin`) if any, else ``budget / prompt length`` at a
        compressing prefill, else ``budget / tokens seen`` at the first decode step (pass
        ``t``/``r``/``p`` explicitly to be independent of it)."""
        if run.pinned_ratio is not None:
            return run.pinned_ratio
        if row not in run.ratios:
            run.ratios[row] = budget / max(capacity, 1)
        return run.ratios[row]

    def check_shape(self, run: ProfiledRun, obs: Observation) -> None:
        profile = run.profile
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

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        self.observe(obs)
        lengths = obs.lengths
        held = held_entries(lengths, obs.num_kv_heads)
        run = self.run_of(obs)
        if obs.layer_idx == 0:  # a new prefill: first valid position of each row (left padding)
            first = obs.positions[:, 0].masked_fill(~obs.valid[:, 0], 1 << 62).amin(-1)
            run.offsets = first.tolist()
            run.ratios = {r: t / int(obs.lengths[r]) for r, t in enumerate(targets) if t is not None}
            # the prompt length each compressed row's plan was made for, held through the decode
            run.capacities = {r: int(obs.lengths[r]) for r, t in enumerate(targets) if t is not None}
        if all(t is None for t in targets):
            return held
        self.check_shape(run, obs)
        scores = self.score(obs)
        valid = obs.valid

        def select_row(r: int, target: int) -> tuple[torch.Tensor, torch.Tensor]:
            """Each cache's budget from the plan; its sinks and most recent entries protected."""
            length = int(lengths[r])
            budgets = self.cache_budgets(run, target, length, self.row_ratio(run, r, target, length))
            budgets = budgets[obs.layer_idx]
            protected = torch.zeros_like(valid[r])
            for h in range(budgets.shape[0]):
                b = int(budgets[h])
                window = min(self.head_window(b), b)
                sinks = min(self.sinks, b - window)
                protected[h] = protected_mask(obs.positions[r : r + 1, h : h + 1], window, sinks)[0, 0]
            return protected, budgets

        return evict_rows(obs, scores, targets, held, select_row, valid)

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        """StreamingLLM eviction per cache: keep the first ``sinks`` and the most recent entries.

        A row compressed at the prefill keeps the prefill's plan (made for its prompt length) at
        every step: a cache capped at the prompt length stays at it, its layer's other caches keep
        what the cap gave them. A row the prefill left whole gets the plan for the tokens it has
        seen, so nothing is evicted until its caches outgrow the budget.
        """
        self.observe(obs)
        layer = obs.layer
        lengths = layer.head_lengths().cpu()  # [b, h]
        heads = lengths.shape[1]
        positions = [layer.head(h)[2] for h in range(heads)]  # per head [b, n_h]
        run = self.run_of(obs)
        offsets, prefill_capacity = run.offsets, run.capacities
        limits = []
        for r, budget in enumerate(row_budgets):
            last = max(int(p[r].max()) for p in positions)
            first = offsets[r] if r < len(offsets) else min(int(p[r][p[r] >= 0].min()) for p in positions)
            capacity = prefill_capacity.get(r, last - first + 1)
            base = budget - run.appended_to(r)  # the prefill's plan; what was appended is kept on top
            plan = self.cache_budgets(run, base, capacity, self.row_ratio(run, r, base, capacity))
            limits.append(plan[obs.layer_idx] + run.appended_to(r))
        if all(bool((lengths[r] <= limits[r]).all()) for r in range(len(row_budgets))):
            return
        self.check_shape(run, obs)
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
