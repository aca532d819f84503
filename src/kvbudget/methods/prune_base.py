"""PruneMethod: the base of prune-stage methods (ASL, FastKV, GemFilter, PyramidInfer).

A prune-stage method changes the prefill forward itself: after some layer, deeper layers process
only selected tokens (docs/architecture.md, "Prune stage"). The engine (:mod:`kvbudget.prune`) runs
the decoder layers one by one; after each layer's attention the compression session calls
:meth:`PruneMethod.compress_layer` (as for prefill-stage methods), where the method scores the layer,
may request a cut with :meth:`request_cut`, and may compress the layer's cache (``compress_cache``).
After the layer's MLP
the engine takes the requested cuts (:meth:`take_cuts`) and gathers the hidden states of the kept
tokens, which keep their true position ids (one-pass methods). Two-pass methods (``two_pass``)
only scout in the first pass; the engine then runs the whole model again on the selected tokens
with re-indexed positions ``0..k−1`` (GemFilter's second pass).

Cut indices are slot indices into the layer's current sequence (the columns of the hidden states,
left pads included): the engine always prefills a prune-stage method from an empty cache, so the
layer's cache slots and the hidden-state columns coincide when the method is called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbudget.errors import InputError, MethodOptionError
from kvbudget.methods.base import Method
from kvbudget.observation import Observation


@dataclass
class PruneMethod(Method):
    """Base class of prune-stage methods.

    Class attributes:
        two_pass: the first pass only selects tokens; a second pass runs the whole model on them.
        compress_cache: layers holding more than the budget are compressed with :meth:`score`
            (SnapKV-like) after their attention, as prefill-stage methods do.
    """

    stages: ClassVar[tuple[str, ...]] = ("prune",)
    two_pass: ClassVar[bool] = False
    compress_cache: ClassVar[bool] = True

    # ------------------------------------------------------------------ per-run state
    def begin_prune(self, batch_size: int, num_layers: int) -> None:
        """Reset the run state before a prefill of ``batch_size`` rows (called by the engine)."""
        self.num_layers = num_layers
        self.selection_layers: list[int | None] = [None] * batch_size
        self.scouting = self.two_pass
        self._cuts: dict[int, torch.Tensor] = {}
        self.selected: dict[int, torch.Tensor] = {}

    def begin_second_pass(self) -> None:
        """Two-pass methods: the engine starts the second pass over the selected tokens."""
        self.scouting = False

    def request_cut(self, row: int, layer_idx: int, slots: torch.Tensor) -> None:
        """After layer ``layer_idx``, row ``row`` keeps only ``slots`` (sorted 1-D int64 slot indices)."""
        slots = slots.sort().values
        self._cuts[row] = slots
        self.selected[row] = slots
        if self.selection_layers[row] is None:
            self.selection_layers[row] = layer_idx

    def take_cuts(self) -> dict[int, torch.Tensor]:
        """The cuts requested since the last call (row → kept slots); one-pass methods only."""
        cuts, self._cuts = self._cuts, {}
        return cuts

    def scouting_done(self, targets: list[int | None]) -> bool:
        """Two-pass: every row that needs pruning has selected its tokens (pass 1 may stop)."""
        return all(t is None or r in self.selected for r, t in enumerate(targets))

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
        if not hasattr(self, "selection_layers"):
            raise InputError(f"{self.name} changes the prefill forward: run it through kvbudget's engine")
        if self.scouting or not self.two_pass:  # a second pass only runs the selected tokens
            self.observe_layer(obs, targets)
        lengths = obs.lengths
        if (
            self.scouting
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
