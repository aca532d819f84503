"""Method: a named composition of scorer, allocator and selector, with the stages it acts in.

A method is a dataclass whose fields are its hyperparameters (the paper's defaults). Subclasses
override the parts that differ:

* :meth:`Method.score` — importance ``[b, kv_heads, n]`` of every entry of a layer (the scorer);
* :meth:`Method.layer_budget` — entries per head for a layer (the layer allocator);
* :meth:`Method.head_budgets` — per-head split of a layer's budget (the head allocator);
* :meth:`Method.window_for` / ``sinks`` — what the selector always keeps.

Allocators as options: a method whose allocators may be swapped declares the values it takes in
``layer_allocators`` / ``head_allocators`` and has the fields ``layer_alloc`` / ``head_alloc``
(:class:`~kvbudget.methods.composable.Composable` for the generic per-layer path; LAVa its own).
A parameter that belongs to one allocator (PyramidKV's ``beta``, AdaKV's ``floor_alpha``) is
listed in ``allocator_params``: it is reported by :meth:`Method.options` and may differ from its
default only while that allocator is chosen. Any other method refuses both options
(:meth:`Method.allocation_refusal` says why).

:meth:`Method.compress_layer` runs them on one layer; decode-stage methods also implement
:meth:`Method.decode_step`; post-prefill methods (D2O) :meth:`Method.record` and
:meth:`Method.post_prefill`; lookahead methods (LAQ) :meth:`Method.run_lookahead`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.errors import BudgetError, MethodOptionError
from kvbudget.observation import Observation
from kvbudget.selection import protected_mask, select_keep


@dataclass
class Method:
    """Base class of all methods.

    Args:
        window: recent entries always kept (the observation window of window scorers).
        sinks: first entries always kept.
    """

    name: ClassVar[str] = "base"
    paper: ClassVar[str] = ""
    stages: ClassVar[tuple[str, ...]] = ("prefill",)
    #: cascading methods re-evict earlier layers after each prefilled layer (:meth:`rebalance`)
    cascading: ClassVar[bool] = False
    #: values the ``layer_alloc`` / ``head_alloc`` options take (empty: the method refuses the option)
    layer_allocators: ClassVar[tuple[str, ...]] = ()
    head_allocators: ClassVar[tuple[str, ...]] = ()
    #: allocator parameter → (allocator option, value) it belongs to
    allocator_params: ClassVar[dict[str, tuple[str, str]]] = {}
    #: why the allocator options do not apply, when the stages do not say it (see :meth:`allocation_refusal`)
    fixed_allocation: ClassVar[str] = ""

    window: int = 32
    sinks: int = 0

    # ------------------------------------------------------------------ configuration
    @classmethod
    def named(cls, name: str, **options: Any) -> Method:
        """An object of this class registered under another ``name`` (a named combination: this
        class with ``options``); ``name`` is what its messages, results and tuned parameters use."""
        method = cls.__new__(cls)
        if name != cls.name:
            method.__dict__["name"] = name
        method.__init__(**options)
        return method

    @classmethod
    def allocation_refusal(cls, option: str) -> str:
        """Why ``option`` (``layer_alloc`` or ``head_alloc``) does not apply to this class."""
        if cls.fixed_allocation:
            return cls.fixed_allocation
        if "prune" in cls.stages:
            return "a prune-stage method keeps one token set for every layer after its cut"
        if "decode" in cls.stages:
            return "it evicts while decoding, every layer and head back to the uniform budget"
        return "its budgets are fixed by the method"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`~kvbudget.errors.MethodOptionError` naming a bad option (override to add checks)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("window", "sinks", "kernel") and (not isinstance(value, int) or value < 0):
                raise MethodOptionError(f"{self.name}: option {f.name} must be an integer ≥ 0, got {value!r}")
        if getattr(self, "pooling", "none") not in ("max", "avg", "none"):
            raise MethodOptionError(f"{self.name}: pooling must be max, avg or none, got {self.pooling!r}")
        kernel = getattr(self, "kernel", 1)
        if kernel % 2 == 0:
            raise MethodOptionError(
                f"{self.name}: kernel must be odd (the pooled length is preserved), got {kernel}"
            )
        self.validate_allocators()

    def validate_allocators(self) -> None:
        """The allocator options take one of the declared values; an allocator's parameter differs
        from its default only while that allocator is chosen."""
        for option, allowed in (("layer_alloc", self.layer_allocators), ("head_alloc", self.head_allocators)):
            value = getattr(self, option, None)
            if allowed and value not in allowed:
                raise MethodOptionError(
                    f"{self.name}: {option} must be {' or '.join(allowed)}, got {value!r}",
                    self.name,
                    option,
                    value,
                )
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for param, (option, owner) in self.allocator_params.items():
            value = getattr(self, param)
            if value != defaults[param] and getattr(self, option) != owner:
                raise MethodOptionError(
                    f"{self.name}: option {param}={value!r} belongs to {option}={owner}, "
                    f"but {option} is {getattr(self, option)!r}",
                    self.name, param, value,
                )  # fmt: skip

    def options(self) -> dict[str, Any]:
        """The method's hyperparameters and their values; the allocator options last, each with the
        parameters of the allocator it names (``beta`` only with ``layer_alloc="pyramid"``, ...)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        allocation = ("layer_alloc", "head_alloc", *self.allocator_params)
        own = {k: v for k, v in values.items() if k not in allocation}
        for option in ("layer_alloc", "head_alloc"):
            if option in values:
                own[option] = values[option]
        for param, (option, owner) in self.allocator_params.items():
            if values[option] == owner:
                own[param] = values[param]
        return own

    def min_budget(self) -> int:
        """Smallest budget the method accepts (it must exceed what is always kept)."""
        return self.window + self.sinks + 1

    def check_budget(self, budget: int) -> None:
        if budget < self.min_budget():
            raise BudgetError(
                f"budget must be ≥ {self.min_budget()} for {self.name} "
                f"(window {self.window} + sinks {self.sinks} + 1), got {budget}"
            )

    def prepare(self, model: Any) -> None:
        """Bind what the method needs from the model before a run (offline profiles); no-op by default.

        Called by :func:`kvbudget.engine.prefill`, :func:`kvbudget.engine.compress`,
        :func:`kvbudget.snapshot.derive` and the perplexity task before the first forward.
        """

    # ------------------------------------------------------------------ parts
    def window_for(self, budget: int) -> int:
        """Recent entries always kept when a row's budget is ``budget``."""
        return self.window

    def layer_budget(self, budget: int, length: int, layer_idx: int, num_layers: int) -> int:
        """Entries per head for layer ``layer_idx`` (uniform by default)."""
        return min(budget, length)

    def observe(self, obs: Observation) -> None:
        """Update per-entry state from a forward (called every time, even when nothing is evicted).

        Stateful scorers (H2O's accumulated attention) accumulate here; :meth:`score` reads it.
        """

    def score(self, obs: Observation) -> torch.Tensor:
        """Importance of each entry, ``[b, kv_heads, n]`` (higher = keep)."""
        raise NotImplementedError

    def head_budgets(
        self, scores: torch.Tensor, layer_budget: int, protected: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """Split a layer's budget over its heads for one batch row (uniform by default).

        Args:
            scores: ``[kv_heads, n]``; protected, valid: ``[kv_heads, n]`` bool.
        Returns:
            ``[kv_heads]`` entries per head, window included.
        """
        return torch.full((scores.shape[0],), layer_budget, dtype=torch.long)

    # ------------------------------------------------------------------ actions
    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        """Compress one layer in place.

        Args:
            obs: the layer after its prefill attention (rectangular layout).
            targets: per batch row, the budget, or ``None`` to keep the row whole.
        Returns:
            ``[b, kv_heads]`` entries kept per head.
        """
        self.observe(obs)
        lengths = obs.lengths
        heads = obs.num_kv_heads
        kept = lengths[:, None].expand(-1, heads).clone().cpu()
        if all(t is None for t in targets):
            return kept
        scores = self.score(obs)
        valid = obs.valid
        protected = torch.zeros_like(valid)
        for r, target in enumerate(targets):
            if target is None:
                continue
            length = int(lengths[r])
            protected[r] = protected_mask(obs.positions[r : r + 1], self.window_for(target), self.sinks)[0]
            layer_budget = self.layer_budget(target, length, obs.layer_idx, obs.num_layers)
            kept[r] = self.head_budgets(scores[r], layer_budget, protected[r], valid[r])
        obs.layer.keep(select_keep(scores, kept, valid, protected))
        return kept

    def rebalance(self, layers: list, targets: list[int | None]) -> None:
        """Cascading methods: after ``layers[-1]`` was compressed, re-evict ``layers[:-1]``.

        Layer budgets recomputed over the layers seen so far may only shrink; earlier layers are
        re-evicted from scores they stored as per-entry state (``layer.state``), so the full
        cache of an earlier layer is never needed again. Called in prefill order, in both the
        layer-wise and the shared-prefill path.
        """
        raise NotImplementedError(f"{self.name} is not a cascading method")

    @property
    def edits_earlier_layers(self) -> bool:
        """Whether the method may change layers other than the one just prefilled (cascading
        re-eviction, or a post-prefill stage acting on every layer after the last one)."""
        return self.cascading or "post_prefill" in self.stages

    def record(self, obs: Observation, targets: list[int | None]) -> None:
        """Post-prefill methods: note what a layer's prefill attention tells (nothing is evicted yet).

        Called for every layer during the prefill instead of :meth:`compress_layer`; ``targets`` as there.
        """
        raise NotImplementedError(f"{self.name} has no post-prefill stage")

    def post_prefill(self, layers: list, targets: list[int | None]) -> None:
        """Post-prefill methods: compress every layer once all of them were prefilled.

        ``layers``: every layer of the cache (rectangular prefill layout); ``targets`` as in
        :meth:`compress_layer`. The prefill holds the full cache until then (as the methods' papers do).
        """
        raise NotImplementedError(f"{self.name} has no post-prefill stage")

    def queries_to_record(self) -> int:
        """Post-RoPE queries per layer (the prompt's last ones) the session keeps during the prefill
        for :meth:`run_lookahead` (0 = none)."""
        return 0

    def run_lookahead(
        self,
        model: Any,
        cache: Any,
        logits: torch.Tensor,
        mask: torch.Tensor,
        last_pos: torch.Tensor,
        eos: set[int],
    ) -> None:
        """Lookahead methods: compress ``cache`` once the compressed part is prefilled.

        Args:
            model: the model (attached); cache: the full :class:`~kvbudget.cache.BudgetCache`,
                its session holding the resolved targets and the recorded queries.
            logits: ``[b, vocab]`` last-position logits of the prefilled part.
            mask: ``[b, T]`` its padding mask; last_pos: ``[b]`` position of each row's last token.
            eos: token ids that end an answer.
        """
        raise NotImplementedError(f"{self.name} has no lookahead stage")

    def set_appended(self, counts: list[int]) -> None:
        """Entries appended to each batch row after the compression, outside the budget (the
        question, question-agnostic; set by the session). Run state, not an option."""
        self.__dict__["_appended"] = list(counts)

    def appended(self, row: int) -> int:
        """Entries appended to ``row`` after the compression (0 if none): a method that holds a
        per-layer plan while decoding adds them to its plan's limit."""
        counts = self.__dict__.get("_appended") or []
        return counts[row] if row < len(counts) else 0

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        """Trim a layer back to ``row_budgets`` after a decode step (decode-stage methods); the
        budgets include what was appended after the compression (:meth:`appended`)."""
        raise NotImplementedError(f"{self.name} does not act while decoding")

    def trim_to(self, obs: Observation, row_budgets: list[int]) -> None:
        """Evict the lowest-scored entries of rows holding more than their budget.

        Decode-stage helper: :meth:`observe` runs every step (stateful scorers accumulate), then
        every row holding more than its budget keeps ``budget`` entries per head by :meth:`score`.
        """
        self.observe(obs)
        lengths = obs.layer.head_lengths()  # [b, h]
        if all(int(lengths[r].max()) <= b for r, b in enumerate(row_budgets)):
            return
        scores = self.score(obs)
        valid = obs.valid
        protected = torch.zeros_like(valid)
        budgets = lengths.clone()
        for r, budget in enumerate(row_budgets):
            if int(lengths[r].max()) > budget:
                protected[r] = protected_mask(obs.positions[r : r + 1], self.window_for(budget), self.sinks)[
                    0
                ]
                budgets[r] = budget
        obs.layer.keep(select_keep(scores, budgets, valid, protected))
