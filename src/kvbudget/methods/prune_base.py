"""PruneMethod: the base of prune-stage methods (ASL, FastKV, GemFilter, PyramidInfer).

A prune-stage method changes the prefill forward itself: after some layer, deeper layers process
only selected tokens (docs/architecture.md, "Prune stage"). The engine (:mod:`kvbudget.prefill.pruned`) runs
the decoder layers one by one; after each layer's attention the compression session calls
:meth:`PruneMethod.compress_layer` (as for prefill-stage methods), where the method scores the layer,
may request a cut with :meth:`PruneRun.request_cut` on the run's state, and may compress the layer's
cache (``compress_cache``). After the layer's MLP the engine takes the requested cuts
(:meth:`PruneRun.take_cuts`) and gathers the hidden states of the kept tokens, which keep their true
position ids (one-pass methods). Two-pass methods (``two_pass``)
only scout in the first pass; the engine then runs the whole model again on the selected tokens
with re-indexed positions ``0..k−1`` (GemFilter's second pass).

Cut indices are slot indices into the layer's current sequence (the columns of the hidden states,
left pads included): the engine always prefills a prune-stage method from an empty cache, so the
layer's cache slots and the hidden-state columns coincide when the method is called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbudget.errors import InputError, MethodOptionError
from kvbudget.methods.base import Method, RunState
from kvbudget.observation import Observation
from kvbudget.phases import Stage


@dataclass
class PruneRun(RunState):
    """A prune-stage run: per batch row the layer after which it was cut (``None``: not cut) and
    the slots it kept, the cuts requested since the engine last took them, and whether a two-pass
    method is still scouting. :meth:`PruneMethod.begin_prune` resets it before each prefill
    (``selection_layers`` stays ``None`` until then)."""

    num_layers: int = 0
    selection_layers: list[int | None] | None = None
    scouting: bool = False
    cuts: dict[int, torch.Tensor] = field(default_factory=dict)
    selected: dict[int, torch.Tensor] = field(default_factory=dict)

    def request_cut(self, row: int, layer_idx: int, slots: torch.Tensor) -> None:
        """After layer ``layer_idx``, row ``row`` keeps only ``slots`` (sorted 1-D int64 slot indices)."""
        assert self.selection_layers is not None
        slots = slots.sort().values
        self.cuts[row] = slots
        self.selected[row] = slots
        if self.selection_layers[row] is None:
            self.selection_layers[row] = layer_idx

    def take_cuts(self) -> dict[int, torch.Tensor]:
        """The cuts requested since the last call (row → kept slots); one-pass methods only."""
        cuts, self.cuts = self.cuts, {}
        return cuts

    def scouting_done(self, targets: list[int | None]) -> bool:
        """Two-pass: every row that needs pruning has selected its tokens (pass 1 may stop)."""
        return all(t is None or r in self.selected for r, t in enumerate(targets))


@dataclass(frozen=True)
class PruneMethod(Method):
    """Base class of prune-stage methods.

    Class attributes:
        two_pass: the first pass only selects tokens; a second pass runs the whole model on them.
        compress_cache: layers holding more than the budget are compressed with :meth:`score`
            (SnapKV-like) after their attention, as prefill-stage methods do.
    """

    stages: ClassVar[tuple[Stage, ...]] = (Stage.PRUNE,)
    two_pass: ClassVar[bool] = False
    compress_cache: ClassVar[bool] = True

    # ------------------------------------------------------------------ per-run state
    def start(self, model: Any = None) -> PruneRun:
        return PruneRun()

    def begin_prune(self, run: PruneRun, batch_size: int, num_layers: int) -> None:
        """Reset ``run`` before a prefill of ``batch_size`` rows (called by the engine)."""
        run.num_layers = num_layers
        run.selection_layers = [None] * batch_size
        run.scouting = self.two_pass
        run.cuts = {}
        run.selected = {}

    # ------------------------------------------------------------------ the hook
    def observe_layer(self, obs: Observation, targets: list[int | None]) -> None:
        """Score the layer and call :meth:`request_cut` where the method cuts (override)."""
        raise NotImplementedError

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        """Called after each prefilled layer's attention: select (maybe cut), then compress the cache.

        Returns ``[b, kv_heads]`` entries kept per head.
        """
        if obs.keys.shape[2] != obs.query.shape[2]:
            raise InputError(f"{self.name} is a prune-stage method: it prefills from an empty cache only")
        run = self.run_of(obs)
        if not isinstance(run, PruneRun) or run.selection_layers is None:
            raise InputError(f"{self.name} changes the prefill forward: run it through kvbudget's engine")
        if run.scouting or not self.two_pass:  # a second pass only runs the selected tokens
            self.observe_layer(obs, targets)
        lengths = obs.lengths
        if (
            run.scouting
            or not self.compress_cache
            or all(t is None or int(n) <= t for t, n in zip(targets, lengths.tolist(), strict=True))
        ):
            return obs.layer.head_lengths().cpu()
        return super().compress_layer(obs, targets)


def layer_at_fraction(fraction: float, num_layers: int) -> int:
    """The layer index a depth fraction names: ``fraction · num_layers`` rounded half up, at most the
    last layer (0.5 → 14 of 28 and 16 of 32; 0.4 → 13 of 32)."""
    return min(math.floor(fraction * num_layers + 0.5), num_layers - 1)


def check_layer_fraction(method: str, option: str, value: object) -> None:
    """A layer-fraction option is -1 (unset) or a number in [0, 1]; else
    :class:`~kvbudget.errors.MethodOptionError`."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (value == -1 or 0 <= value <= 1):
        raise MethodOptionError(
            f"{method}: {option} must be in [0, 1] (a fraction of the layers) or -1 (unset), got {value!r}"
        )


def context_slots(obs: Observation, row: int, window: int) -> torch.Tensor:
    """Slots of row ``row``'s valid tokens before its last ``window`` ones: 1-D int64."""
    valid = obs.valid[row, 0].nonzero().squeeze(-1)
    return valid[: max(0, valid.numel() - window)]


def window_slots(obs: Observation, row: int, window: int) -> torch.Tensor:
    """Slots of row ``row``'s last ``window`` valid tokens: 1-D int64."""
    valid = obs.valid[row, 0].nonzero().squeeze(-1)
    return valid[max(0, valid.numel() - window) :]


def top_slots(scores: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best of ``slots`` by ``scores`` (same length), ties to the earlier slot."""
    order = torch.sort(scores.float(), descending=True, stable=True).indices[:k]
    return slots[order]
