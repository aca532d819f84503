"""Layer-wise compression with dynamic layer budgets, shared by LAVa and CAKE.

:class:`LayerwiseMethod` compresses a layer right after its prefill attention in three steps
that subclasses fill in: a score per entry (:meth:`~kvbudget.methods.base.Method.score`), the
layer's candidate budget for one batch row (:meth:`LayerwiseMethod.layer_total`) and its split
over the KV heads (:meth:`LayerwiseMethod.split`). The window (and sinks) are always kept on top.

Cascading subclasses (``cascading = True``) give each layer a weight (entropy, preference) and
budgets ``B_i ∝ weight_i`` over the layers prefilled so far against the model's full total ``T``
(:func:`kvbudget.allocation.cascade_layer_budgets`); after each layer the session calls
:meth:`LayerwiseMethod.rebalance`, which re-evicts the earlier layers to their new, smaller
budgets from the scores they stored as per-entry state — an earlier layer's full cache is never
needed again, so the cache holds about ``T`` entries plus one full layer at any time. The stored
scores are dropped once the last layer is prefilled (the budgets are final then).

The per-run plan (weights and budgets per batch row and layer) lives in the run's state
(:class:`LayerwiseRun`, ``obs.run``), which the compression session owns; it is reset whenever
layer 0 is compressed.

**Rank fast path.** When a method's selection at any budget is a prefix of one fixed order of the
layer's candidates (:meth:`LayerwiseMethod.selection_order`: LAVa's plain flattened top-k, CAKE's
per-head top-k), :meth:`LayerwiseMethod.compress_layer` sorts the candidates once and stores each
entry's rank (protected entries ``-1``) instead of its score; keeping a budget is then "rank below
it", and a re-eviction needs no sort and no head split. It keeps exactly the entries the generic
path (:meth:`LayerwiseMethod.split` + :func:`~kvbudget.selection.select_keep`) keeps, at every
step (``tests/test_cascade_fast_path.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvbudget.allocation import cascade_layer_budgets
from kvbudget.cache import BudgetLayer
from kvbudget.methods.base import Method, RunState, evict_rows, held_entries
from kvbudget.observation import Observation
from kvbudget.scoring import pool_keys
from kvbudget.selection import protected_mask, record_ranks, select_keep


@dataclass
class RowPlan:
    """Cascading budgets of one batch row.

    Attributes:
        total: candidate entries the whole model keeps (``T``, in the subclass's unit).
        protected: entries per head always kept on top (window + sinks).
        weights, budgets: per layer seen, its weight and its current candidate budget.
    """

    total: int
    protected: int
    weights: dict[int, float] = field(default_factory=dict)
    budgets: dict[int, int] = field(default_factory=dict)

    def step(self, layer_idx: int, weight: float, capacity: int) -> int:
        """Add layer ``layer_idx``; recompute every seen layer's budget; return the new layer's."""
        self.weights[layer_idx] = weight
        earlier = sorted(k for k in self.budgets if k != layer_idx)
        new = cascade_layer_budgets(
            [self.weights[k] for k in earlier] + [weight],
            self.total,
            [self.budgets[k] for k in earlier],
            capacity,
        )
        for k, b in zip([*earlier, layer_idx], new.tolist(), strict=True):
            self.budgets[k] = int(b)
        return self.budgets[layer_idx]


@dataclass
class CascadePlan:
    """Per-run state of a cascading method: one :class:`RowPlan` per compressed batch row."""

    rows: list[RowPlan | None]
    last_layer: int = -1


@dataclass
class LayerwiseRun(RunState):
    """What a run of a :class:`LayerwiseMethod` learns: the cascade's plan (``None`` until a
    cascading method compresses layer 0) and the model's layer count (seen at the first layer)."""

    plan: CascadePlan | None = None
    num_layers: int = 1 << 30


#: rank of an entry that is never kept (invalid slots, pads)
NEVER = torch.iinfo(torch.int32).max


def padded_view(layer: BudgetLayer, name: str, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """State ``name`` and positions of ``layer`` as ``[b, kv_heads, n]`` tensors.

    A per-head (ragged) layer is padded at the end of each head (state ``fill``, position ``-1``),
    so a slot index of the view is the slot index in the head's own storage.
    """
    if not layer.is_ragged:
        return layer.state[name], layer.positions
    n = layer.physical_length
    state = torch.stack([F.pad(s, (0, n - s.shape[1]), value=fill) for s in layer.state[name]], dim=1)
    positions = torch.stack([F.pad(p, (0, n - p.shape[1]), value=-1) for p in layer.positions], dim=1)
    return state, positions


def pool_candidates(
    scores: torch.Tensor, candidates: torch.Tensor, kernel: int, pooling: str
) -> torch.Tensor:
    """Pool ``scores: [b, h, n]`` along the keys over each row's and head's candidate entries only.

    The candidates (``candidates: [b, h, n]`` bool) are gathered in slot order, pooled as one
    contiguous sequence (padding ``kernel // 2``: -inf for max, zeros for avg, divided by
    ``kernel``), and scattered back; other slots get 0. Pads or protected entries between
    candidates therefore never enter a pooling window — a batch row pools exactly as it would alone.
    """
    out = torch.zeros_like(scores)
    for r in range(scores.shape[0]):
        if bool((candidates[r] == candidates[r, :1]).all()):  # the same slots in every head: one call
            cols = candidates[r, 0].nonzero().flatten()
            if cols.numel():
                out[r][:, cols] = pool_keys(scores[r][:, cols][None], kernel, pooling)[0]
            continue
        for h in range(scores.shape[1]):
            cols = candidates[r, h].nonzero().flatten()
            if cols.numel():
                out[r, h, cols] = pool_keys(scores[r, h, cols][None, None], kernel, pooling)[0, 0]
    return out


def candidate_ranks(
    scores: torch.Tensor, candidates: torch.Tensor, protected: torch.Tensor, order: str
) -> torch.Tensor:
    """Each entry's place in the keep order of one batch row of a layer: ``[kv_heads, n]`` int32.

    Args:
        scores: ``[kv_heads, n]`` finite on the candidates; candidates, protected: ``[kv_heads, n]`` bool.
        order: ``"flat"`` — one order over all heads' candidates (score descending, exact ties to
            the earlier head, then the earlier slot: the stable sort of the flattened scores, as
            :func:`~kvbudget.allocation.flattened_head_budgets`); ``"head"`` — per head (score
            descending, ties to the earlier slot, as :func:`~kvbudget.selection.select_keep`).
    Returns:
        ranks from 0 on the candidates, ``-1`` on protected entries, :data:`NEVER` elsewhere. A
        layer budget ``T`` (``"flat"``) or head budget ``T`` (``"head"``) keeps exactly the entries
        of rank ``< T``.
    """
    heads, n = scores.shape
    masked = scores.float().masked_fill(~candidates, float("-inf"))
    if order == "flat":
        idx = torch.sort(masked.reshape(-1), descending=True, stable=True).indices
        rank = torch.empty_like(idx)
        rank[idx] = torch.arange(idx.numel(), device=idx.device)
        rank = rank.view(heads, n)
    elif order == "head":
        idx = torch.sort(masked, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(idx).scatter_(-1, idx, torch.arange(n, device=idx.device).expand(heads, n))
    else:
        raise ValueError(f"unknown selection order '{order}': expected flat or head")
    rank = torch.where(candidates, rank.int(), NEVER)
    return rank.masked_fill(protected, -1)


def below(ranks: torch.Tensor, thresholds: list[int]) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Entries of ``ranks: [b, kv_heads, n]`` below each row's threshold: the slot indices per row
    and head (sorted, as :meth:`~kvbudget.cache.BudgetLayer.keep` takes them) and their counts
    ``[b, kv_heads]``."""
    mask = ranks < torch.tensor(thresholds, dtype=ranks.dtype, device=ranks.device).view(-1, 1, 1)
    keep = [[mask[r, h].nonzero().flatten() for h in range(mask.shape[1])] for r in range(mask.shape[0])]
    return keep, mask.sum(-1).cpu()


@dataclass(frozen=True)
class LayerwiseMethod(Method):
    """Base of LAVa and CAKE: layer-wise compression with (optionally cascading) layer budgets."""

    #: per-entry state holding the scores a cascading method re-evicts from
    state_name = "layerwise_score"
    #: rank fast path: an earlier layer is re-evicted once it holds more than this times its budget
    reevict_slack: ClassVar[float] = 1.5

    # ------------------------------------------------------------------ parts for subclasses
    def model_total(self, target: int, protected: int, num_layers: int, num_heads: int) -> int:
        """``T`` for a row of budget ``target``: candidate units the whole model keeps."""
        raise NotImplementedError

    def layer_weight(
        self, obs: Observation, scores: torch.Tensor, row: int, candidates: torch.Tensor
    ) -> float:
        """Cascading methods: the layer's weight for batch row ``row`` (entropy, preference)."""
        raise NotImplementedError

    def layer_capacity(self, candidates: torch.Tensor) -> int:
        """Most units a layer can keep, from its ``candidates: [kv_heads, n]`` of one row."""
        raise NotImplementedError

    def static_total(self, target: int, length: int, protected: int, obs: Observation) -> int:
        """Non-cascading methods: the layer's candidate budget for one row."""
        raise NotImplementedError

    def split(
        self, scores: torch.Tensor, candidates: torch.Tensor, total: int, bounds: torch.Tensor
    ) -> torch.Tensor:
        """Per-head candidate counts ``[kv_heads]`` of a layer budget ``total`` for one row.

        Args:
            scores: ``[kv_heads, n]``; candidates: ``[kv_heads, n]`` bool (valid, not protected);
            bounds: ``[kv_heads]`` most entries each head may keep (its current candidates).
        """
        raise NotImplementedError

    def split_for(
        self,
        run: LayerwiseRun,
        row: int,
        layer_idx: int,
        target: int,
        scores: torch.Tensor,
        candidates: torch.Tensor,
        total: int,
        bounds: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`split` for batch row ``row`` of layer ``layer_idx`` whose budget is ``target``
        (entries per head, window included) in ``run``: what :meth:`compress_layer` and
        :meth:`rebalance` call.
        Override it when the split depends on more than the scores — LAVa's floor keeps the layer's
        first order and takes its size from ``target``. Same arguments and result as :meth:`split`."""
        return self.split(scores, candidates, total, bounds)

    def selection_order(self) -> str | None:
        """``"flat"`` or ``"head"`` if what :meth:`split` and :func:`~kvbudget.selection.select_keep`
        keep at a candidate budget is always the first ``total`` of one fixed order of the layer's
        candidates (see :func:`candidate_ranks`), for the rank fast path; ``None`` (default) if not
        — e.g. a floor or an even split, whose heads' shares do not nest as the budget shrinks."""
        return None

    # ------------------------------------------------------------------ plan
    def start(self, model: object = None) -> LayerwiseRun:
        return LayerwiseRun()

    def _start(self, run: LayerwiseRun, layer_idx: int, rows: int) -> CascadePlan:
        plan = run.plan
        if layer_idx == 0 or plan is None or len(plan.rows) != rows or layer_idx <= plan.last_layer:
            plan = CascadePlan([None] * rows)
            run.plan = plan
        plan.last_layer = layer_idx
        return plan

    def row_budget(self, run: LayerwiseRun, row: int, layer_idx: int) -> int | None:
        """Entries per head layer ``layer_idx`` of batch row ``row`` keeps after the prefill
        (window included), or ``None`` if the row was not compressed by a cascade."""
        plan = run.plan
        if plan is None or row >= len(plan.rows) or plan.rows[row] is None:
            return None
        rp = plan.rows[row]
        return rp.budgets[layer_idx] + rp.protected if layer_idx in rp.budgets else None

    # ------------------------------------------------------------------ actions
    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        """Compress one layer: each row's candidate budget (the cascade's step, or
        :meth:`static_total`) split over the heads, through the shared loop
        (:func:`~kvbudget.methods.base.evict_rows`) or the rank fast path (:meth:`_keep_by_rank`)."""
        self.observe(obs)
        lengths = obs.lengths
        held = held_entries(lengths, obs.num_kv_heads)
        run = self.run_of(obs)
        plan = self._start(run, obs.layer_idx, len(targets)) if self.cascading else None
        run.num_layers = obs.num_layers
        if all(t is None for t in targets):
            return held
        scores = self.score(obs).float()
        valid = obs.valid
        order = self.selection_order()
        if order is not None and not bool(torch.isfinite(scores[valid]).all()):
            order = None  # the generic path's tie order for ±inf / nan is not a rank order

        def row_total(r: int, target: int) -> tuple[torch.Tensor, torch.Tensor, int]:
            """Row ``r``'s protected entries and candidates ``[kv_heads, n]`` and its candidate budget."""
            protected = protected_mask(obs.positions[r : r + 1], self.window_for(target), self.sinks)[0]
            candidates = valid[r] & ~protected
            n_protected = int(protected[0].sum())
            if plan is None:
                return protected, candidates, self.static_total(target, int(lengths[r]), n_protected, obs)
            if plan.rows[r] is None:
                total = self.model_total(target, n_protected, obs.num_layers, obs.num_kv_heads)
                plan.rows[r] = RowPlan(total, n_protected)
            weight = self.layer_weight(obs, scores, r, candidates)
            total = plan.rows[r].step(obs.layer_idx, weight, self.layer_capacity(candidates))
            return protected, candidates, total

        if order is not None:
            return self._keep_by_rank(obs, scores, valid, targets, order, row_total, plan is not None)

        def select_row(r: int, target: int) -> tuple[torch.Tensor, torch.Tensor]:
            protected, candidates, total = row_total(r, target)
            bounds = candidates.sum(-1).cpu()
            counts = self.split_for(run, r, obs.layer_idx, target, scores[r], candidates, total, bounds)
            return protected, counts.cpu() + protected.sum(-1).cpu()

        if plan is not None:  # the scores a later rebalance re-evicts from, gathered with the layer
            obs.layer.state[self.state_name] = scores
        return evict_rows(obs, scores, targets, held, select_row, valid)

    def _keep_by_rank(
        self,
        obs: Observation,
        scores: torch.Tensor,
        valid: torch.Tensor,
        targets: list[int | None],
        order: str,
        row_total: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, int]],
        store: bool,
    ) -> torch.Tensor:
        """The rank fast path of :meth:`compress_layer`: each row's entries ranked in the fixed
        ``order`` (:func:`candidate_ranks`), kept below the row's candidate budget; ``store`` keeps
        the ranks as per-entry state for :meth:`rebalance`; ``valid``: ``obs.valid``. Returns
        ``[b, kv_heads]`` kept entries."""
        ranks = torch.full(scores.shape, NEVER, dtype=torch.int32, device=scores.device)
        thresholds = [0] * len(targets)
        for r, target in enumerate(targets):
            if target is None:  # keep the whole row
                ranks[r] = torch.where(valid[r], -1, NEVER)
                continue
            protected, candidates, thresholds[r] = row_total(r, target)
            ranks[r] = candidate_ranks(scores[r], candidates, protected, order)
        keep, kept = below(ranks, thresholds)
        if store:
            obs.layer.state[self.state_name] = ranks
        obs.layer.keep(keep)
        return kept

    def rebalance(self, layers: list, targets: list[int | None], run: LayerwiseRun) -> None:
        """Re-evict ``layers[:-1]`` to the budgets the last :meth:`compress_layer` recomputed.

        Each layer keeps the top of the scores it stored (``state[state_name]``) among its current
        entries: the new budgets are never larger than the old ones, and the same stable order is
        used, so the new kept set is a subset of the old one. On the rank fast path the layer
        stored ranks instead, and keeps the entries of rank below its budget. After the last
        layer the stored state is dropped.
        """
        plan = run.plan
        if plan is None:
            return
        final = len(layers) >= run.num_layers
        for i, layer in enumerate(layers[:-1]):
            if self.state_name not in layer.state:
                continue
            stored = layer.state[self.state_name]
            if (stored[0] if isinstance(stored, list) else stored).dtype == torch.int32:
                self._reevict_ranks(plan, i, layer, targets, final)
                continue
            scores, positions = padded_view(layer, self.state_name)
            valid = positions >= 0
            protected = torch.zeros_like(valid)
            kept = layer.head_lengths().cpu()
            changed = False
            for r, target in enumerate(targets):
                rp = plan.rows[r] if r < len(plan.rows) else None
                if target is None or rp is None or i not in rp.budgets:
                    continue
                protected[r] = protected_mask(positions[r : r + 1], self.window_for(target), self.sinks)[0]
                candidates = valid[r] & ~protected[r]
                have = candidates.sum(-1).cpu()
                counts = self.split_for(run, r, i, target, scores[r], candidates, rp.budgets[i], have)
                if not torch.equal(counts.cpu(), have):
                    changed = True
                kept[r] = counts.cpu() + protected[r].sum(-1).cpu()
            if changed:
                record_ranks(layer, scores, protected)
                layer.keep(select_keep(scores, kept, valid, protected))
        if final:
            for layer in layers:
                layer.state.pop(self.state_name, None)

    def held_candidates(self, layer: BudgetLayer, rows: list[RowPlan | None]) -> list[int]:
        """Candidates ``layer`` holds per batch row, in the unit of the row's budget: the sum over
        heads for the ``flat`` order, the largest head for the ``head`` order (0 for rows without
        a plan)."""
        per_head = layer.head_lengths().cpu()
        reduce = torch.sum if self.selection_order() == "flat" else torch.amax
        return [
            0 if rp is None else int(reduce(per_head[r] - rp.protected, dim=-1)) for r, rp in enumerate(rows)
        ]

    def _reevict_ranks(
        self, plan: CascadePlan, i: int, layer: BudgetLayer, targets: list[int | None], final: bool
    ) -> None:
        """Rank fast path of :meth:`rebalance` for layer ``i``: keep the entries of rank below each
        row's budget (rows without a cascade budget keep what they hold). Works head by head on
        the stored layout (no padding); edits the layer only if some entry goes.

        Lazily: before the ``final`` call (after the last layer) a layer is only re-evicted once
        some row holds more than :attr:`reevict_slack` times its new candidate budget. The kept
        sets nest (rank below a threshold that only shrinks), so the final cache is the same as
        re-evicting after every layer (Alg. 2); only the cache held mid-prefill is up to that
        factor above the cascade's total, and a layer is rewritten a few times instead of once
        per later layer."""
        rows = len(targets)
        thresholds = []
        for r, target in enumerate(targets):
            rp = plan.rows[r] if r < len(plan.rows) else None
            missing = target is None or rp is None or i not in rp.budgets
            thresholds.append(NEVER if missing else rp.budgets[i])
        if not final:
            planned = [plan.rows[r] if t != NEVER else None for r, t in enumerate(thresholds)]
            held = self.held_candidates(layer, planned)
            if all(t == NEVER or held[r] <= self.reevict_slack * t for r, t in enumerate(thresholds)):
                return
        stored, positions = layer.state[self.state_name], layer.positions
        heads = stored if isinstance(stored, list) else list(stored.unbind(1))
        positions = positions if isinstance(positions, list) else list(positions.unbind(1))
        limit = torch.tensor(thresholds, dtype=torch.int32, device=heads[0].device).view(rows, 1)
        lengths = layer.head_lengths().tolist()
        keep: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        changed = False
        for h, ranks in enumerate(heads):  # [b, n_h]
            mask = ranks < limit
            if layer.has_invalid:  # pads of a batched per-head layer carry a copied rank
                mask &= positions[h] >= 0
            for r in range(rows):
                keep[r].append(mask[r].nonzero().flatten())
                changed = changed or keep[r][h].numel() != lengths[r][h]
        if changed:
            layer.keep(keep)
