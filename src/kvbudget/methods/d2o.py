"""D2O: dynamic discriminative operations — variance-based layer budgets, eviction with merging."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvbudget.allocation import attention_variance, inverse_variance_layer_budgets
from kvbudget.cache import BudgetLayer
from kvbudget.errors import KVBudgetError, MethodOptionError
from kvbudget.merging import D2OMerge, d2o_merge
from kvbudget.methods.base import Method, RunState
from kvbudget.observation import Observation, reduce_group
from kvbudget.phases import Stage
from kvbudget.selection import keep_within_limits, protected_mask

#: kinds of kept entries (:attr:`MergeEvent.kinds`)
SINK, HEAVY, RECENT = 0, 1, 2


@dataclass
class MergeEvent:
    """One merge of one batch row of one layer, as :attr:`D2ORun.merge_watcher` receives it.

    Attributes:
        layer_idx, row: where it happened.
        kinds: ``[h, S]`` kind of each kept entry: ``SINK`` (0), ``HEAVY`` (1), ``RECENT`` (2), ``-1``
            an empty slot.
        keys, values: ``[h, S, d]`` the kept entries before the merge.
        result: the merge (``result.keys``/``values`` after it; ``merged``/``nearest``/``similarity``
            per evicted entry).
        evicted_keys, evicted_values: ``[h, E, d]`` the evicted entries (position order).
    """

    layer_idx: int
    row: int
    kinds: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    result: D2OMerge
    evicted_keys: torch.Tensor | None = None
    evicted_values: torch.Tensor | None = None


@dataclass
class D2ORun(RunState):
    """A D2O run: each layer's attention variance per row (``sigma[layer][row]``, from the
    prefill), the layer budgets per row after it (``None``: the row was not compressed), the merge
    thresholds ``τ`` per layer and row, and an optional ``merge_watcher`` called with a
    :class:`MergeEvent` after every merge (diagnostics, ``lab/scripts/d2o_merge_diagnostics.py``)."""

    sigma: dict[int, list[float]] = field(default_factory=dict)
    budgets: list[list[int] | None] = field(default_factory=list)
    tau: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    merge_watcher: Callable[[MergeEvent], None] | None = None

    def layer_budgets(self, row: int) -> list[int] | None:
        """Entries per head of every layer of batch ``row`` after the prefill, or ``None`` when the
        row was not compressed (it is then held at its uniform budget)."""
        return self.budgets[row] if row < len(self.budgets) else None


@dataclass(frozen=True)
class D2O(Method):
    """D2O: layer budgets from attention variance; heavy hitters + sinks + recent, evicted entries merged.

    **Layer budgets** (§4.1, Eq. 4–5, A.2). Each prompt layer's attention column sums ``c_h`` (one
    per query head, computed ``chunk`` queries at a time, never the full ``n × n`` matrix) give
    ``F_h = var(c_h)``; ``σ_l`` is their min-max normalised mean over the layer's heads
    (``variance="minmax"``, the authors' code, as docs/methods.md (D2O) records it; ``"raw"`` uses the mean
    of ``F_h`` as printed in Eq. 4). ``S_l = softmax_l(−σ_l) · layers · B`` entries per KV head
    (``B`` = the user budget, ``ρ·L`` in ratio form, so ``Σ S_l = layers · B``), clamped to
    ``[max(0.01·L, sinks + 2), L]`` with the excess shared in proportion, integerised to the exact
    total. Computed once all layers are prefilled (the full prompt cache exists until then, as in
    the paper); every KV head of a layer keeps ``S_l``.

    **Eviction** (§4.2.1, Eq. 6–8). Score = attention received: prompt column sums, then every
    decode query's attention added (GQA groups averaged). A layer keeps ``T = sinks`` first tokens,
    the ``M`` most recent and the top ``N`` of the rest, ``N = ⌊heavy_fraction·(S_l − T)⌋`` and
    ``M = S_l − T − N`` (``N : M = 3 : 1``).

    **Merging** (§4.2.2, Eq. 9–12, :func:`kvbudget.merging.d2o_merge`): every evicted entry is
    matched to its most cosine-similar kept key; with the EMA threshold (``τ_0`` = mean best
    similarity of the prefill's evicted entries, then ``τ_t = β·max U_t + (1 − β)·τ_{t−1}``)
    it is dropped or folded into that key and its value with the similarity weights of Eq. 12.
    ``τ`` is kept per batch row, layer and KV head. Every kept entry — sinks, heavy hitters and
    recent window — can receive a merge (Eq. 9 matches against all of ``K_c``; the authors' code
    does the same).

    **Merge variants** (options; defaults are the paper's): ``merge_targets="heavy"`` lets only the
    ``N`` heavy hitters receive merges (the sinks and the recent window stay exact; our choice, not
    in the paper or the authors' code); ``weighting="authors"`` and ``decision="authors"`` follow
    the authors' code (AIoT-MLSys-Lab/d2o, ``LLM_merge_new/LMEval_kv_token_merge/
    modeling_llama3_7b_13b_d2o.py``, ``D2O_LayerKVCache.__call__``): a scatter-mean of ``{k_j,
    u_ij·k_i}`` instead of Eq. 12's weights, and one ``τ`` per layer over all heads with a head-mean
    test (their EMA weights are 0.5 / 0.5: add ``beta=0.5``); ``fixed_threshold`` drops every
    evicted entry less similar than it (with ``threshold=False``: a fixed threshold instead of the
    EMA). See :func:`kvbudget.merging.d2o_merge`. Measured on smollm2-135m (``docs/claims.md``,
    D2O): merging raises perplexity over ``d2o-nomerge`` with every variant, through the merged keys.

    **Decoding**: after every step each layer is evicted (and merged) back to ``S_l``, so the cache
    holds ``Σ_l S_l`` entries per head at every step. A row whose prompt fits the budget was not
    compressed; it is held at the uniform budget ``B`` while decoding (no variance allocation), so
    a budget covering prompt and answer changes nothing.

    Differences from the authors' code (AIoT-MLSys-Lab/d2o; docs/methods.md, D2O, lists them): β = 0.7
    (the paper's §A.3 choice; the code uses 0.5 for both EMA constants); the ``T`` sinks are kept on
    top of ``N`` heavy hitters (Eq. 7; the code counts them inside the heavy budget); every layer is
    compressed (the code never compresses layers 0, 1 and the last); a merged entry keeps its own
    accumulated score (the paper does not say how merging changes scores); several evictions in one
    forward (chunked decoding) update the EMA once per evicted entry, in position order.

    Reference: Wan et al., "D2O: Dynamic Discriminative Operations for Efficient Long-Context
    Inference of Large Language Models", ICLR 2025 (arXiv:2406.13035).

    Args:
        sinks: first tokens always kept (``T``, 4).
        heavy_fraction: ``N / (N + M)`` (0.75, i.e. ``N : M = 3 : 1``).
        beta: EMA smoothing β (0.7). merge: fold evicted entries into kept ones (True).
        threshold: apply the EMA threshold (True; False merges every evicted entry).
        merge_targets: ``all`` (sinks, heavy hitters and recent window; default) or ``heavy``.
        weighting: ``paper`` (Eq. 12; default) or ``authors`` (scatter-mean of ``{k_j, u·k_i}``).
        decision: ``paper`` (EMA per KV head and evicted entry, Eq. 10; default) or ``authors``
            (one ``τ`` per layer, head-mean similarity).
        fixed_threshold: merge only evicted entries with best similarity ≥ it (−1 = off, default;
            above 1 nothing is merged).
        dynamic_layers: variance-based layer budgets (True; False = uniform ``B`` per layer: the
            paper's "w.o. Layer Operation" ablation, Table 6, registered as ``d2o-uniform``;
            ``d2o-nomerge`` is ``merge=False``).
        variance: ``minmax`` (default) or ``raw`` (see above). min_fraction: lower clamp (0.01 of L).
        chunk: query chunk of the prompt column sums.
    """

    name: ClassVar[str] = "d2o"
    paper: ClassVar[str] = "arXiv:2406.13035"
    summary: ClassVar[str] = (
        "layer budgets by inverse-variance softmax of prompt attention; sinks + heavy hitters + "
        "recent; evicted entries merged into their most similar kept key under an EMA threshold "
        "(`--opt threshold=false` merges every evicted entry), at every step"
    )
    code: ClassVar[str] = "AIoT-MLSys-Lab/d2o"
    stages: ClassVar[tuple[Stage, ...]] = (Stage.POST_PREFILL, Stage.DECODE)
    state_name: ClassVar[str] = "d2o_attention"
    fixed_allocation: ClassVar[str] = (
        "D2O's layer split is its dynamic_layers option (True: by attention variance; False: uniform)"
    )

    window: int = 0
    sinks: int = 4
    heavy_fraction: float = 0.75
    beta: float = 0.7
    merge: bool = True
    threshold: bool = True
    merge_targets: str = "all"
    weighting: str = "paper"
    decision: str = "paper"
    fixed_threshold: float = -1.0
    dynamic_layers: bool = True
    variance: str = "minmax"
    min_fraction: float = 0.01
    chunk: int = 512

    @property
    def merges(self) -> bool:
        """Evicted entries are merged into kept ones unless ``merge=False`` (``d2o-nomerge``)."""
        return self.merge

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.heavy_fraction < 1.0:
            raise MethodOptionError(
                f"{self.name}: heavy_fraction must be in [0, 1), got {self.heavy_fraction}"
            )
        if not 0.0 <= self.beta <= 1.0:
            raise MethodOptionError(f"{self.name}: beta must be in [0, 1], got {self.beta}")
        if self.merge_targets not in ("all", "heavy"):
            raise MethodOptionError(
                f"{self.name}: merge_targets must be all or heavy, got {self.merge_targets!r}"
            )
        for option in ("weighting", "decision"):
            if getattr(self, option) not in ("paper", "authors"):
                raise MethodOptionError(
                    f"{self.name}: {option} must be paper or authors, got {getattr(self, option)!r}"
                )
        if not isinstance(self.fixed_threshold, (int, float)) or not self.fixed_threshold >= -1.0:
            raise MethodOptionError(
                f"{self.name}: fixed_threshold must be a number ≥ -1 (-1 = off), got {self.fixed_threshold!r}"
            )
        if self.variance not in ("minmax", "raw"):
            raise MethodOptionError(f"{self.name}: variance must be minmax or raw, got {self.variance!r}")
        if not 0.0 <= self.min_fraction <= 1.0:
            raise MethodOptionError(f"{self.name}: min_fraction must be in [0, 1], got {self.min_fraction}")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise MethodOptionError(f"{self.name}: chunk must be a positive integer, got {self.chunk!r}")

    def min_budget(self) -> int:
        return self.sinks + 2  # at least one heavy hitter and one recent entry

    def recent_for(self, layer_budget: int) -> int:
        """``M`` of a layer holding ``layer_budget`` entries per head."""
        rest = max(layer_budget - self.sinks, 0)
        return rest - int(self.heavy_fraction * rest)

    # ------------------------------------------------------------------ per-run state
    def start(self, model: object = None) -> D2ORun:
        return D2ORun()

    def accumulate(self, obs: Observation) -> None:
        """Add the attention this forward's queries paid each entry (GQA mean) to its score."""
        obs.layer.init_state(self.state_name)
        received = reduce_group(obs.column_sums(self.chunk), obs.num_kv_heads, "mean")
        obs.layer.state[self.state_name] = obs.layer.state[self.state_name] + received

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.layer.state[self.state_name]

    # ------------------------------------------------------------------ prefill
    def record(self, obs: Observation, targets: list[int | None]) -> None:
        run = self.run_of(obs)
        if obs.layer_idx == 0:
            run.sigma.clear()
            run.budgets.clear()
            run.tau.clear()
        self.accumulate(obs)
        sums = obs.column_sums(self.chunk)  # [b, hq, n]
        valid = obs.valid[:, 0]
        run.sigma[obs.layer_idx] = [
            attention_variance(sums[r][:, valid[r]], self.variance) for r in range(sums.shape[0])
        ]

    def post_prefill(self, layers: list[BudgetLayer], targets: list[int | None], run: D2ORun) -> None:
        num_layers = len(layers)
        lengths = layers[0].head_lengths()[:, 0].tolist()
        run.budgets = []
        for r, target in enumerate(targets):
            if target is None:
                run.budgets.append(None)
                continue
            length = int(lengths[r])
            if self.dynamic_layers:
                lower = min(max(math.ceil(self.min_fraction * length), self.min_budget()), target)
                sigma = [run.sigma[i][r] for i in range(num_layers)]
                budgets = inverse_variance_layer_budgets(sigma, target * num_layers, lower, length)
                run.budgets.append([int(b) for b in budgets])
            else:
                run.budgets.append([min(target, length)] * num_layers)
        for i, layer in enumerate(layers):
            limits = [None if b is None else b[i] for b in run.budgets]
            self.evict(run, layer, i, limits)

    # ------------------------------------------------------------------ decode
    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        self.accumulate(obs)
        run = self.run_of(obs)
        limits = []
        for r, budget in enumerate(row_budgets):
            planned = run.layer_budgets(r)
            limits.append(budget if planned is None else planned[obs.layer_idx] + run.appended_to(r))
        if not self._evict_one(run, obs.layer, obs.layer_idx, limits):
            self.evict(run, obs.layer, obs.layer_idx, limits)

    # ------------------------------------------------------------------ eviction + merging
    def evict(self, run: D2ORun, layer: BudgetLayer, layer_idx: int, limits: list[int | None]) -> None:
        """Evict every row holding more than ``limits[r]`` entries per head (``None`` = leave it),
        merging the evicted entries into the kept ones."""
        if layer.is_ragged:
            raise KVBudgetError(
                f"{self.name} keeps every KV head of a layer at one size; got a per-head layout"
            )
        chosen = keep_within_limits(
            layer.positions, layer.head_lengths().cpu(), limits, layer.state[self.state_name],
            self.recent_for, self.sinks,
        )  # fmt: skip
        if chosen is None:
            return
        keep, over = chosen
        if not self.merge:
            layer.keep(keep)
            return
        valid = layer.positions >= 0
        evicted = {
            r: self._gather_evicted(layer, r, self._evicted_slots(keep[r], valid[r]))
            for r in range(len(limits)) if over[r]
        }  # fmt: skip
        layer.keep(keep)
        self._merge_rows(run, layer, layer_idx, evicted, limits)

    def _evict_one(self, run: D2ORun, layer: BudgetLayer, layer_idx: int, limits: list[int | None]) -> bool:
        """Fast path of :meth:`evict` for a decode step's steady state: one batch row, every entry
        valid, every head exactly one entry over its limit (the token just appended), sinks and
        window not covering the layer. The evicted entry of each head is then the lowest-scored
        unprotected one (on a tie the latest slot, as :func:`~kvbudget.selection.select_keep`'s
        stable sort leaves it) — the same choice and the same merge as :meth:`evict`, from a
        handful of tensor operations instead of a general top-k. Returns False (nothing done)
        when the case does not apply."""
        if layer.is_ragged or len(limits) != 1 or limits[0] is None:
            return False
        positions = layer.positions
        n = positions.shape[-1]
        limit = limits[0]
        recent = self.recent_for(limit)
        if n != limit + 1 or self.sinks + recent >= n or bool((positions < 0).any()):
            return False
        candidates = layer.state[self.state_name][0, :, self.sinks : n - recent]  # [h, c]
        last_min = candidates.shape[-1] - 1 - torch.argmin(candidates.flip(-1), dim=-1)  # [h]
        drop = (last_min + self.sinks).to(positions.device)
        slots = torch.arange(n - 1, device=positions.device).expand(positions.shape[1], -1)
        kept = slots + (slots >= drop[:, None])  # [h, n - 1] every slot but the dropped one, in order
        evicted = {0: self._gather_evicted(layer, 0, drop[:, None])} if self.merge else {}
        layer.keep([list(kept.unbind(0))])
        self._merge_rows(run, layer, layer_idx, evicted, limits)
        return True

    def _evicted_slots(self, keep: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
        """``[h, E]`` slots of one batch row's valid entries not in ``keep[h]``, in slot order."""
        kept_idx = torch.stack(keep).to(valid.device)  # [h, S]
        dropped = valid.clone()
        dropped.scatter_(1, kept_idx, False)
        counts = dropped.sum(-1)
        if bool((counts != counts[0]).any()):
            raise KVBudgetError(f"{self.name}: heads of one row evicted different numbers of entries")
        return dropped.nonzero()[:, 1].view(dropped.shape[0], -1)

    @staticmethod
    def _gather_evicted(
        layer: BudgetLayer, row: int, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[h, E, d]`` of batch ``row``'s ``slots: [h, E]`` (read before eviction)."""
        take = lambda t: t[row].gather(1, slots[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731
        return take(layer.keys), take(layer.values)

    def kept_kinds(self, layer: BudgetLayer, row: int, limit: int) -> torch.Tensor:
        """``[h, S]`` kind of each entry batch ``row`` of ``layer`` holds after an eviction to
        ``limit``: the first ``sinks`` valid entries ``SINK``, the last ``M`` ``RECENT``, the rest
        ``HEAVY``, empty slots ``-1``."""
        positions = layer.positions[row : row + 1]
        sinks = protected_mask(positions, 0, self.sinks)[0]
        recent = protected_mask(positions, self.recent_for(limit), 0)[0]
        kinds = torch.full(positions.shape[1:], HEAVY, dtype=torch.int8, device=positions.device)
        kinds = kinds.masked_fill(recent, RECENT).masked_fill(sinks, SINK)
        return kinds.masked_fill(positions[0] < 0, -1)

    def _merge_rows(
        self,
        run: D2ORun,
        layer: BudgetLayer,
        layer_idx: int,
        evicted: dict[int, tuple[torch.Tensor, torch.Tensor]],
        limits: list[int | None],
    ) -> None:
        """Merge each row's evicted keys and values ``evicted[r]: ([h, E, d], [h, E, d])`` into what
        ``layer`` kept (updating the row's ``τ``). The layer's kept keys and values are the merge's
        kept entries: ``layer.keep`` gathered them in slot order; ``limits[r]`` is the row's size."""
        taus = run.tau.setdefault(layer_idx, {})
        watcher = run.merge_watcher
        merged = {}
        for r, (ev_keys, ev_values) in evicted.items():
            limit = limits[r]
            assert limit is not None  # only rows over their limit evict
            kinds = self.kept_kinds(layer, r, limit) if watcher or self.merge_targets == "heavy" else None
            out = d2o_merge(
                layer.keys[r], layer.values[r], ev_keys, ev_values, taus.get(r), self.beta, self.threshold,
                targets=None if self.merge_targets == "all" or kinds is None else kinds == HEAVY,
                weighting=self.weighting, decision=self.decision, fixed_threshold=self.fixed_threshold,
            )  # fmt: skip
            if watcher is not None and kinds is not None:
                watcher(MergeEvent(layer_idx, r, kinds, layer.keys[r], layer.values[r], out,
                                   evicted_keys=ev_keys, evicted_values=ev_values))  # fmt: skip
            taus[r] = out.tau
            merged[r] = out.keys, out.values
        if not merged:
            return
        if len(merged) == layer.keys.shape[0]:  # every row merged: stack the rows, no copy of the layer
            layer.keys = torch.stack([merged[r][0] for r in range(len(merged))])
            layer.values = torch.stack([merged[r][1] for r in range(len(merged))])
            return
        new_keys, new_values = layer.keys.clone(), layer.values.clone()
        for r, (k, v) in merged.items():
            new_keys[r, :, : k.shape[1]] = k
            new_values[r, :, : v.shape[1]] = v
        layer.keys, layer.values = new_keys, new_values
