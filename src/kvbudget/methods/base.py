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

**Configuration and run state** (docs/architecture.md, "Configuration and run state"). A method
object is its configuration: a frozen dataclass whose fields name its result rows; setting an
attribute raises, so one object can serve many sequences at once. Everything a run learns — plans,
budgets chosen at the first layer, kept positions another layer reuses, per-row counters, data
bound from the model — lives in the :class:`RunState` that :meth:`Method.start` returns; the
compression session owns it for one sequence (or batch) and hands it to the method with each
observation (``obs.run``) or as the ``run`` argument of the stages that see whole caches
(:meth:`Method.rebalance`, :meth:`Method.post_prefill`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbudget.errors import BudgetError, MethodOptionError
from kvbudget.observation import Observation
from kvbudget.phases import Stage
from kvbudget.selection import protected_mask, record_ranks, select_keep

#: one batch row's selection at its budget, ``(row, budget) → (protected, entries per head)``:
#: the entries always kept ``[kv_heads, n]`` bool and how many each head keeps ``[kv_heads]``
#: (protected ones included; an ``int``: the same in every head)
RowSelection = Callable[[int, int], tuple[torch.Tensor, torch.Tensor | int]]


def held_entries(lengths: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, kv_heads]`` entries each of ``heads`` heads holds after a prefill attention, on the CPU:
    every head of a row holds the row's valid length (``lengths: [b]``, ``Observation.lengths``)."""
    return lengths[:, None].expand(-1, heads).clone().cpu()


def evict_rows(
    obs: Observation,
    scores: torch.Tensor,
    targets: Sequence[int | None],
    held: torch.Tensor,
    select_row: RowSelection,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer-compression loop, written once: scores → budgets → keep indices → gather.

    Every batch row with a budget in ``targets`` gets its protected entries and its entries per head
    from ``select_row(row, budget)``; a row whose target is ``None`` keeps the ``held`` entries it
    has. Per row and head the layer then keeps the protected entries and the best-``scores`` rest up
    to that count (:func:`~kvbudget.selection.select_keep`) and gathers them (``layer.keep``).
    :meth:`Method.compress_layer`, :meth:`Method.trim_to`, the profiled methods and the layer-wise
    ones (:mod:`kvbudget.methods.layerwise`, outside its rank fast path) all run it.

    Args:
        obs: the layer (its ``layer`` is edited in place).
        scores: ``[b, kv_heads, n]``, higher = keep.
        targets: per batch row, its budget, or ``None`` to leave the row as it is.
        held: ``[b, kv_heads]`` entries each head holds now.
        select_row: the row's protected entries and entries per head at its budget.
        valid: ``obs.valid`` ``[b, kv_heads, n]`` if the caller has it already (default: read it).
    Returns:
        ``[b, kv_heads]`` entries kept per head.
    """
    valid = obs.valid if valid is None else valid
    protected = torch.zeros_like(valid)
    kept = held.clone()
    for r, target in enumerate(targets):
        if target is not None:
            protected[r], kept[r] = select_row(r, target)
    record_ranks(obs.layer, scores, protected)
    obs.layer.keep(select_keep(scores, kept, valid, protected))
    return kept


@dataclass
class RunState:
    """What one run of a method learns, owned by the run's compression session (docs/architecture.md,
    "Configuration and run state").

    Methods that learn more subclass it (a dataclass with their own fields) and return it from
    :meth:`Method.start`.

    Attributes:
        appended: per batch row, entries appended after the compression, uncompressed and outside
            the budget (the question, question-agnostic; set by the session).
        lookahead: a lookahead method's last lookahead (its pseudo tokens and queries, a
            :class:`~kvbudget.methods.lookahead.Lookahead`), kept for inspection; else ``None``.
    """

    appended: list[int] = field(default_factory=list)
    lookahead: Any = None

    def appended_to(self, row: int) -> int:
        """Entries appended to ``row`` after the compression (0 if none): a method that holds a
        per-layer plan while decoding adds them to its plan's limit."""
        return self.appended[row] if row < len(self.appended) else 0


@dataclass(frozen=True)
class Method:
    """Base class of all methods.

    Args:
        window: recent entries always kept (the observation window of window scorers).
        sinks: first entries always kept.
    """

    # ---- what the method is: the registry, the generated docs and the generic tests read these
    #: registry name, lower case with hyphens
    name: ClassVar[str] = "base"
    #: the reference, e.g. ``"arXiv:2404.14469"`` (rendered as a link in README.md and docs/methods.md)
    paper: ClassVar[str] = ""
    #: one line on what the method keeps, for README.md's methods table (``scripts/methods_tables.py``);
    #: every registered class sets its own
    summary: ClassVar[str] = ""
    #: the authors' public code as GitHub ``owner/name`` (docs/methods.md's index), ``""`` if none
    code: ClassVar[str] = ""
    #: the kvpress 0.5.5 press (class name) that implements the same method, ``""`` if kvpress has
    #: none; ``tests/test_kvpress_oracle.py`` fails until such a method has an oracle on kept positions
    kvpress: ClassVar[str] = ""
    #: options that fit the tiny tests' prompts (~100–200 tokens; ``window + sinks`` below 24), used by
    #: every generic test (``tests/method_matrix.py``); empty when the defaults fit
    small_options: ClassVar[dict[str, Any]] = {}
    #: whether the cache holds more than the budget by design (a prune method that keeps the full
    #: cache below its cut); the budget checks of the tests and the leaderboard's ¹ mark read it
    exceeds_budget: ClassVar[bool] = False
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL,)
    #: cascading methods re-evict earlier layers after each prefilled layer (:meth:`rebalance`)
    cascading: ClassVar[bool] = False
    #: values the ``layer_alloc`` / ``head_alloc`` options take (empty: the method refuses the option)
    layer_allocators: ClassVar[tuple[str, ...]] = ()
    head_allocators: ClassVar[tuple[str, ...]] = ()
    #: allocator parameter → (allocator option, value) it belongs to
    allocator_params: ClassVar[dict[str, tuple[str, str]]] = {}
    #: why the allocator options do not apply, when the stages do not say it (see :meth:`allocation_refusal`)
    fixed_allocation: ClassVar[str] = ""
    #: whether :meth:`score` reads ``obs.attention_input`` (the attention modules' inputs, recorded
    #: during the prefill and kept in shared-prefill snapshots only for such methods: KVzap)
    wants_attention_inputs: ClassVar[bool] = False

    window: int = 32
    sinks: int = 0

    # ------------------------------------------------------------------ configuration
    @classmethod
    def named(cls, name: str, **options: Any) -> Method:
        """An object of this class registered under another ``name`` (a named combination: this
        class with ``options``); ``name`` is what its messages, results and tuned parameters use.
        The object's class is a subclass of this one that only renames it."""
        if name == cls.name:
            return cls(**options)
        return _renamed(cls, name)(**options)

    @classmethod
    def allocation_refusal(cls, option: str) -> str:
        """Why ``option`` (``layer_alloc`` or ``head_alloc``) does not apply to this class."""
        if cls.fixed_allocation:
            return cls.fixed_allocation
        if Stage.PRUNE in cls.stages:
            return "a prune-stage method keeps one token set for every layer after its cut"
        if Stage.DECODE in cls.stages:
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

    def start(self, model: Any = None) -> RunState:
        """A fresh run state for one run (one sequence or batch) of this method, with what it needs
        from ``model`` bound (offline profiles, filters); the session that owns the run calls it.

        Called through :class:`~kvbudget.session.CompressionSession` by :func:`kvbudget.engine.prefill`,
        :func:`kvbudget.engine.compress`, :func:`kvbudget.prefill.derived.derive` and the perplexity task
        before the first forward. ``model`` may be ``None`` for methods that need nothing from it.
        """
        return RunState()

    def run_of(self, obs: Observation) -> RunState:
        """The run state an observation carries (``obs.run``, set by the session); an observation made
        outside a session (a single-layer call: nothing to carry over) gets a fresh one."""
        if obs.run is None:
            obs.run = self.start()
        return obs.run

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
        held = held_entries(lengths, obs.num_kv_heads)
        if all(t is None for t in targets):
            return held
        scores = self.score(obs)
        valid = obs.valid

        def select_row(r: int, target: int) -> tuple[torch.Tensor, torch.Tensor]:
            protected = protected_mask(obs.positions[r : r + 1], self.window_for(target), self.sinks)[0]
            layer_budget = self.layer_budget(target, int(lengths[r]), obs.layer_idx, obs.num_layers)
            return protected, self.head_budgets(scores[r], layer_budget, protected, valid[r])

        return evict_rows(obs, scores, targets, held, select_row, valid)

    def rebalance(self, layers: list, targets: list[int | None], run: RunState) -> None:
        """Cascading methods: after ``layers[-1]`` was compressed, re-evict ``layers[:-1]``.

        Layer budgets recomputed over the layers seen so far may only shrink; earlier layers are
        re-evicted from scores they stored as per-entry state (``layer.state``), so the full
        cache of an earlier layer is never needed again. Called in prefill order, in both the
        layer-wise and the shared-prefill path.
        """
        raise NotImplementedError(f"{self.name} is not a cascading method")

    @property
    def merges(self) -> bool:
        """Whether evicted entries are folded into kept ones (kept keys/values change), with these
        options: a decode step then cannot equal attention over the kept entries alone."""
        return False

    #: the method reads an earlier layer's keys or values while a later one is prefilled (beyond what
    #: ``edits_earlier_layers`` and its stages say): its layers then stay unquantized until the end
    reads_earlier_layers: ClassVar[bool] = False

    @property
    def quantizes_during_prefill(self) -> bool:
        """Whether a ``kv_bits`` cache may store each layer quantized as soon as the next one is
        prefilled: the method never reads or changes a layer again after its own compression."""
        later = {Stage.POST_PREFILL, Stage.LOOKAHEAD, Stage.PRUNE} & set(self.stages)
        return not (later or self.edits_earlier_layers or self.reads_earlier_layers)

    @property
    def edits_earlier_layers(self) -> bool:
        """Whether the method may change layers other than the one just prefilled (cascading
        re-eviction, or a post-prefill stage acting on every layer after the last one)."""
        return self.cascading or Stage.POST_PREFILL in self.stages

    def record(self, obs: Observation, targets: list[int | None]) -> None:
        """Post-prefill methods: note what a layer's prefill attention tells (nothing is evicted yet).

        Called for every layer during the prefill instead of :meth:`compress_layer`; ``targets`` as there.
        """
        raise NotImplementedError(f"{self.name} has no post-prefill stage")

    def post_prefill(self, layers: list, targets: list[int | None], run: RunState) -> None:
        """Post-prefill methods: compress every layer once all of them were prefilled.

        ``layers``: every layer of the cache (rectangular prefill layout); ``targets`` as in
        :meth:`compress_layer`; ``run``: this run's state. The prefill holds the full cache until
        then (as the methods' papers do).
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
                its session holding the resolved targets, the recorded queries and the run state
                (``cache.session.run``).
            logits: ``[b, vocab]`` last-position logits of the prefilled part.
            mask: ``[b, T]`` its padding mask; last_pos: ``[b]`` position of each row's last token.
            eos: token ids that end an answer.
        """
        raise NotImplementedError(f"{self.name} has no lookahead stage")

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        """Trim a layer back to ``row_budgets`` after a decode step (decode-stage methods); the
        budgets include what was appended after the compression (:meth:`RunState.appended_to`)."""
        raise NotImplementedError(f"{self.name} does not act while decoding")

    def trim_to(self, obs: Observation, row_budgets: list[int]) -> None:
        """Evict the lowest-scored entries of rows holding more than their budget.

        Decode-stage helper: :meth:`observe` runs every step (stateful scorers accumulate), then
        every row holding more than its budget keeps ``budget`` entries per head by :meth:`score`.
        """
        self.observe(obs)
        lengths = obs.layer.head_lengths()  # [b, h]
        over = [b if int(lengths[r].max()) > b else None for r, b in enumerate(row_budgets)]
        if all(b is None for b in over):
            return
        scores = self.score(obs)

        def select_row(r: int, budget: int) -> tuple[torch.Tensor, int]:
            return protected_mask(obs.positions[r : r + 1], self.window_for(budget), self.sinks)[0], budget

        evict_rows(obs, scores, over, lengths, select_row)


_RENAMED: dict[tuple[type, str], type] = {}


def _renamed(cls: type[Method], name: str) -> type[Method]:
    """A subclass of ``cls`` whose ``name`` is ``name`` (one per pair, so objects compare equal)."""
    key = (cls, name)
    if key not in _RENAMED:

        def reduce(self: Method) -> tuple:  # pickles by (class, name, options), as Ray ships it
            options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            return _rebuild_renamed, (cls, name, options)

        namespace = {"name": name, "__module__": cls.__module__, "__reduce__": reduce, "renamed": True}
        _RENAMED[key] = type(cls.__name__, (cls,), namespace)
    return _RENAMED[key]


def _rebuild_renamed(cls: type[Method], name: str, options: dict[str, Any]) -> Method:
    return _renamed(cls, name)(**options)


def defined_classes() -> dict[str, type[Method]]:
    """Every method class defined so far (its module imported), by the name it declares; the
    classes :meth:`Method.named` makes to rename one are left out. The registry imports every
    method module; a method that composes another by name (ChunkKV) looks it up here."""
    found: dict[str, type[Method]] = {}
    stack: list[type] = [Method]
    while stack:
        for sub in stack.pop().__subclasses__():
            stack.append(sub)
            if "name" in vars(sub) and not vars(sub).get("renamed", False):
                found.setdefault(sub.name, sub)
    return found
