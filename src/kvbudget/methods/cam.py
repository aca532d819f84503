"""CaM: cache merging — values of tokens leaving the recent window are merged into the next ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.cache import BudgetLayer
from kvbudget.errors import KVBudgetError, MethodOptionError
from kvbudget.merging import cam_merge
from kvbudget.methods.base import Method
from kvbudget.observation import Observation, reduce_group
from kvbudget.phases import Stage
from kvbudget.selection import keep_within_limits


@dataclass(frozen=True)
class CaM(Method):
    """CaM: StreamingLLM eviction (sinks + recent window) whose evicted values are merged, not dropped.

    Eviction keeps the first ``sinks`` tokens and the most recent ``B − sinks`` (at the prefill and
    after every decode step). When entry ``e`` leaves the recent window, with probability
    ``p_e = clamp(a_e / max_{j kept} a_j, 0, 1)`` — ``a`` = attention received so far (prompt column
    sums plus decode queries, GQA mean), the max over the sinks and the window — its value divided
    by ``m`` is added to the values of the ``m`` entries after it (the window's oldest); keys are
    never changed (:func:`kvbudget.merging.cam_merge`). Entries leaving together (the prefill
    eviction, chunked decoding) merge one after the other in position order, so a value merged into
    an entry that leaves later travels on with it, as in the authors' sequential loop.

    Randomness: the Bernoulli draw of an entry depends only on ``seed``, the layer and the entry's
    position counted from the row's first token — reproducible, and a batch row draws as it would
    alone.

    Differences from the authors' code (zyxxmu/cam, ``local_cam_mask``): ``m`` defaults to the whole
    recent window as there (``merge_span=0``); probabilities at the prefill use the column sums of
    all prompt queries (the code uses the queries up to the moment each token leaves the window);
    keys keep their true RoPE positions (no re-rotation).

    Reference: Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024.

    Args:
        sinks: first tokens always kept (4). merge_span: ``m`` (0 = the recent window, ``B − sinks``).
        seed: seed of the Bernoulli draws. chunk: query chunk of the prompt column sums.
    """

    name: ClassVar[str] = "cam"
    paper: ClassVar[str] = "Zhang et al., ICML 2024, proceedings.mlr.press/v235/zhang24n"
    summary: ClassVar[str] = (
        "sinks + recent window; values of evicted tokens merged into the next ones with probability ∝ "
        "their attention"
    )
    code: ClassVar[str] = "zyxxmu/cam"
    kvpress: ClassVar[str] = "CAMPress"
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL, Stage.DECODE)
    state_name: ClassVar[str] = "cam_attention"

    window: int = 0
    sinks: int = 4
    merge_span: int = 0
    seed: int = 0
    chunk: int = 512

    @property
    def merges(self) -> bool:
        """Evicted values are always merged into the next ones."""
        return True

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.merge_span, int) or self.merge_span < 0:
            raise MethodOptionError(f"cam: merge_span must be an integer ≥ 0, got {self.merge_span!r}")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise MethodOptionError(f"cam: chunk must be a positive integer, got {self.chunk!r}")

    def min_budget(self) -> int:
        return self.sinks + 1

    def window_for(self, budget: int) -> int:
        return budget - self.sinks

    def observe(self, obs: Observation) -> None:
        obs.layer.init_state(self.state_name)
        received = reduce_group(obs.column_sums(self.chunk), obs.num_kv_heads, "mean")
        obs.layer.state[self.state_name] = obs.layer.state[self.state_name] + received

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.positions.float()

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        self.observe(obs)
        self.evict(obs.layer, obs.layer_idx, targets)
        return obs.layer.head_lengths().cpu()

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        self.observe(obs)
        self.evict(obs.layer, obs.layer_idx, list(row_budgets))

    def draws(self, layer_idx: int, offsets: list[int], heads: int) -> torch.Tensor:
        """Uniform draws ``[heads, E]`` for entries at ``offsets`` from their row's first token."""
        columns = []
        for offset in offsets:
            g = torch.Generator().manual_seed(self.seed * 2**40 + layer_idx * 2**24 + offset)
            columns.append(torch.rand(heads, generator=g, device="cpu"))
        return torch.stack(columns, dim=1) if columns else torch.zeros(heads, 0, device="cpu")

    def evict(self, layer: BudgetLayer, layer_idx: int, limits: list[int | None]) -> None:
        """Keep sinks + recent in rows holding more than ``limits[r]`` per head, merging the values."""
        if layer.is_ragged:
            raise KVBudgetError("cam keeps every KV head of a layer at one size; got a per-head layout")
        chosen = keep_within_limits(
            layer.positions, layer.head_lengths().cpu(), limits, layer.positions.float(), self.window_for,
            self.sinks,
        )  # fmt: skip
        if chosen is None:
            return
        keep, over = chosen
        new_values = {
            r: self._merged_values(layer, layer_idx, r, keep[r], limit)
            for r, limit in enumerate(limits)
            if over[r]
        }
        layer.keep(keep)
        values = layer.values.clone()
        for r, v in new_values.items():
            values[r, :, : v.shape[1]] = v
        layer.values = values

    def _merged_values(
        self, layer: BudgetLayer, layer_idx: int, row: int, keep: list[torch.Tensor], limit: int
    ) -> torch.Tensor:
        """The kept entries' values ``[h, S, d]`` of batch ``row`` after merging the evicted ones."""
        slots = (layer.positions[row, 0] >= 0).nonzero().flatten()  # valid slots, same in every head
        kept_idx = torch.stack(keep)  # [h, S] slot indices
        if not bool((kept_idx == kept_idx[:1]).all()):
            raise KVBudgetError("cam: heads of one row kept different entries")
        device = slots.device
        compact = torch.full((layer.positions.shape[-1],), -1, dtype=torch.long, device=device)
        compact[slots] = torch.arange(slots.numel(), device=device)
        kept_c = compact[kept_idx[0].to(device)]
        is_kept = torch.zeros(slots.numel(), dtype=torch.bool, device=device)
        is_kept[kept_c] = True
        evicted_c = (~is_kept).nonzero().flatten()
        values = layer.values[row][:, slots]  # [h, n_valid, d]
        attention = layer.state[self.state_name][row][:, slots]  # [h, n_valid]
        peak = attention[:, kept_c].amax(-1, keepdim=True)
        probability = torch.nan_to_num(attention[:, evicted_c] / peak, nan=0.0, posinf=1.0).clamp(0.0, 1.0)
        first = int(layer.positions[row, 0, slots[0]])
        offsets = [int(layer.positions[row, 0, slots[i]]) - first for i in evicted_c.tolist()]
        draws = self.draws(layer_idx, offsets, values.shape[0]).to(values.device)
        span = self.merge_span or self.window_for(limit)
        merged = cam_merge(values, evicted_c, probability, draws, span)
        return merged[:, kept_c]
