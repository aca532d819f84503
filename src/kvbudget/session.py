"""CompressionSession: what the attention hook calls after each layer's attention.

The engine creates one per run and puts it on the :class:`~kvbudget.cache.BudgetCache`; it owns
the method's run state (``run``, from :meth:`~kvbudget.methods.base.Method.start`), so one method
object serves many sessions at once. Its ``phase`` (a :class:`~kvbudget.phases.Phase`) says what
the next forward is: ``PREFILL`` (compress each layer right after its attention, so peak memory
stays near one full layer plus the compressed rest; post-prefill methods only record each layer
and compress all of them after the last one), ``DECODE`` (decode-stage methods trim each layer back
to budget after every step), ``RECORD`` (keep each layer's queries and compress nothing: the shared
prefill of :mod:`kvbudget.prefill.derived`) or ``OFF``.

**One owner for phase changes.** The session is the only place that moves between phases, through
its named transitions — :meth:`CompressionSession.begin_prefill`, :meth:`~CompressionSession.begin_decode`,
:meth:`~CompressionSession.begin_record`, :meth:`~CompressionSession.stop` and
:meth:`~CompressionSession.begin_reconstruct` (KVzip's pass) — each of which checks the phase it
leaves (:data:`LEGAL_FROM`) and raises :class:`~kvbudget.phases.PhaseError` on an illegal one;
``phase`` is read-only. :meth:`CompressionSession.after_attention` hands each layer to the handler
of the current phase (:attr:`CompressionSession.layer_handlers`).

Lookahead methods (``Stage.LOOKAHEAD`` in ``Method.stages``, :mod:`kvbudget.methods.lookahead`)
compress nothing during the prefill; the session keeps the last ``method.queries_to_record()``
post-RoPE queries of every layer for them, and the engine calls ``method.run_lookahead`` once the
prefill is done.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from kvbudget.byte_budget import RANK_STATE
from kvbudget.observation import Observation
from kvbudget.phases import COMPRESS_AT_PREFILL, Phase, PhaseError, Stage

if TYPE_CHECKING:
    from torch import nn

    from kvbudget.cache import BudgetCache, BudgetLayer


class SessionMethod(Protocol):
    """What a session needs of a method (:class:`kvbudget.methods.base.Method` implements it): the
    session sits below the methods, which run sessions of their own (a lookahead's clone, KVzip's
    reconstruction pass)."""

    stages: tuple[Stage, ...]
    cascading: bool
    wants_attention_inputs: bool

    @property
    def edits_earlier_layers(self) -> bool: ...

    def start(self, model: Any = None) -> Any: ...

    def queries_to_record(self) -> int: ...

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor: ...

    def rebalance(self, layers: list, targets: list[int | None], run: Any) -> None: ...

    def record(self, obs: Observation, targets: list[int | None]) -> None: ...

    def post_prefill(self, layers: list, targets: list[int | None], run: Any) -> None: ...

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None: ...


#: per phase, the phases a session may move to it from (its named transitions check them)
LEGAL_FROM: dict[Phase, frozenset[Phase]] = {
    # a fresh session starts in PREFILL; a two-pass prune method's second pass prefills again
    Phase.PREFILL: frozenset({Phase.PREFILL}),
    # after the prefill, after an uncompressed append, or again (a consumed cache decoded once more)
    Phase.DECODE: frozenset({Phase.PREFILL, Phase.OFF, Phase.DECODE}),
    # a fresh session recording a full prefill (a snapshot, KVzap's training pairs)
    Phase.RECORD: frozenset({Phase.PREFILL}),
    # an uncompressed append after any forward (the question; a later turn of a served chat)
    Phase.OFF: frozenset({Phase.PREFILL, Phase.RECORD, Phase.DECODE, Phase.OFF}),
    # KVzip's reconstruction session, right after it is made
    Phase.RECONSTRUCT: frozenset({Phase.PREFILL}),
}


class CompressionSession:
    """Budget bookkeeping for one run of one method.

    Args:
        method: the method (its configuration; may serve other sessions at the same time).
        num_layers: decoder layers.
        budget: entries per KV head on average, window included, or ``None`` with ``ratio``.
        ratio: fraction of each prompt to keep, or ``None`` with ``budget``.
        model: the model the run uses, for what the method binds from it (profiles, filters);
            ``None`` for a method that needs nothing from it.
        run: the run state to use (default: ``method.start(model)``, a fresh one).
        kv_bits: the precision the run's cache stores entries at once the prefill is done (2, 4 or
            8; ``None``: the model's dtype); the cache reads it (``BudgetCache.kv_bits``).
        memory: a byte budget (:mod:`kvbudget.byte_budget`): the share of the full cache's bytes the
            compressed prompt may take, in two precisions; the cache applies it once the prefill is
            done. While it is set, each layer notes the method's ranking of its entries.

    Attributes:
        run: the method's :class:`~kvbudget.methods.base.RunState` for this run.
        phase: the :class:`Phase` of the next forward.
        kept: ``[batch, layers, kv_heads]`` entries kept per head after the prefill (filled as
            layers are compressed; an uncompressed row keeps its whole length).
        row_budgets: per batch row, the resolved budget in entries per head.
        targets: per batch row, the budget for the prefill (``None`` = the prompt fits, keep it).
        compress_seconds: time spent compressing the prompt (scoring and selecting during the
            prefill, plus a lookahead method's lookahead and re-selection).
        lookahead_seconds, reselect_seconds: a lookahead method's lookahead (clone, compress,
            pseudo decoding) and re-selection time (both included in ``compress_seconds``).
        decode_seconds: time spent trimming during decoding.
        synchronize: when True, every one of these timers waits for the device's queued work
            before it reads the clock (:meth:`clock`), so on a GPU they count the method's own work
            and not the attention queued before it. Off by default: it stalls the host once per
            layer. ``kvbudget bench`` turns it on.
        recorded_queries: per layer, post-RoPE queries ``[b, q_heads, m, d]`` (all of them in
            ``RECORD`` phase; the last ``method.queries_to_record()`` in ``PREFILL`` phase).
        observation_memos: per layer, the memo of the prefill :class:`Observation` (window
            probabilities, column sums), shared with other sessions that observe the very same
            queries and uncompressed layer — the runs :func:`kvbudget.prefill.derived.derive` makes from
            one snapshot. ``None`` (the default): each observation starts empty.
        prompt_ids: ``[b, T]`` token ids of the compressed part (left-padded), set by the engine
            right before a lookahead method's ``run_lookahead`` (KVzip feeds the context again).
        lookahead_memo: what a lookahead method computed from the uncompressed cache that does
            not depend on the budget (KVzip's reconstruction scores, keyed by method and row),
            shared by the runs :func:`kvbudget.prefill.derived.derive` makes from one snapshot.
            ``None`` (the default): nothing is shared.
    """

    def __init__(
        self,
        method: SessionMethod,
        num_layers: int,
        budget: int | None = None,
        ratio: float | None = None,
        model: Any = None,
        run: Any = None,
        kv_bits: int | None = None,
        memory: float | None = None,
    ):
        self.method = method
        self.num_layers = num_layers
        self.budget = budget
        self.ratio = ratio
        self.kv_bits = kv_bits
        self.memory = memory
        #: the prompt tokens ``memory`` is a share of (set by the engine; default: what the cache saw)
        self.memory_tokens: int | None = None
        self.run = method.start(model) if run is None else run
        self._bound_to = model  # the model the run was started with
        self._phase = Phase.PREFILL
        self.kept: torch.Tensor | None = None
        self.row_budgets: list[int] | None = None
        self.targets: list[int | None] | None = None
        self.compress_seconds = 0.0
        self.decode_seconds = 0.0
        self.lookahead_seconds = 0.0
        self.reselect_seconds = 0.0
        self.synchronize = False
        self.recorded_queries: dict[int, torch.Tensor] = {}
        self.scaling: float | None = None
        self.observation_memos: dict[int, dict] | None = None
        self.prompt_ids: torch.Tensor | None = None
        self.lookahead_memo: dict | None = None
        self.attention_inputs: dict[int, torch.Tensor] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> CompressionSession:
        """A copy of the run's state that shares the model it is bound to: copying a cache (a
        context compressed once, then one copy per question) must not copy the model's weights."""
        if self._bound_to is not None:
            memo.setdefault(id(self._bound_to), self._bound_to)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            copied.__dict__[name] = copy.deepcopy(value, memo)
        return copied

    # ------------------------------------------------------------------ phases
    @property
    def phase(self) -> Phase:
        """What the next forward is (read-only: the named transitions below move it)."""
        return self._phase

    def _move_to(self, phase: Phase) -> None:
        if self._phase not in LEGAL_FROM[phase]:
            legal = ", ".join(sorted(LEGAL_FROM[phase]))
            raise PhaseError(
                f"{type(self).__name__} of {getattr(self.method, 'name', self.method)!r}: no transition "
                f"from {self._phase.value} to {phase.value} (only from {legal})"
            )
        self._phase = phase

    def begin_prefill(self) -> None:
        """The next forwards are the compressed part's prefill: each layer compressed (or recorded,
        for post-prefill and lookahead methods) right after its attention."""
        self._move_to(Phase.PREFILL)

    def begin_decode(self) -> None:
        """The next forwards decode: a decode-stage method trims each layer after every step."""
        self._move_to(Phase.DECODE)

    def begin_record(self) -> None:
        """The next forward is a full prefill that keeps every layer's queries and compresses nothing."""
        self._move_to(Phase.RECORD)

    def stop(self) -> None:
        """The next forwards append to the cache uncompressed (the session sees nothing of them)."""
        self._move_to(Phase.OFF)

    def begin_reconstruct(self) -> None:
        """KVzip's reconstruction pass: the session scores what the pass attends to
        (:class:`kvbudget.methods.kvzip.ReconstructionScores` handles its layers itself)."""
        self._move_to(Phase.RECONSTRUCT)

    # ------------------------------------------------------------------ run state
    def bind(self, model: Any) -> None:
        """Make sure the run is bound to ``model`` (what the method needs from it: profiles,
        filters), as a prefill does before its first forward: a run started without it (or with
        another model) is started afresh."""
        if self._bound_to is not model:
            self.run = self.method.start(model)
            self._bound_to = model

    def clock(self, device: torch.device) -> float:
        """``time.perf_counter()``, after ``device``'s queued work when :attr:`synchronize` is on."""
        if self.synchronize and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    @property
    def compresses(self) -> bool:
        """Whether the method compresses at any stage (what the cache asks, see ``CacheSession``)."""
        return bool(self.method.stages)

    @property
    def edits_earlier_layers(self) -> bool:
        """Whether compressing a layer may change earlier ones (``Method.edits_earlier_layers``)."""
        return self.method.edits_earlier_layers

    def _prefill_observation(
        self, layer_idx: int, query: torch.Tensor, layer: BudgetLayer, scaling: float
    ) -> Observation:
        memos = self.observation_memos
        memo = {} if memos is None else memos.setdefault(layer_idx, {})
        inputs = self.attention_inputs.pop(layer_idx, None) if self._phase is Phase.PREFILL else None
        return Observation(layer_idx, self.num_layers, query, layer, scaling, memo, run=self.run,
                           attention_input=inputs)  # fmt: skip

    def resolve(self, lengths: torch.Tensor) -> None:
        """Set ``row_budgets`` and ``targets`` from the valid prompt ``lengths: [b]``."""
        self.row_budgets = [
            self.budget if self.budget is not None else max(1, round(self.ratio * length))
            for length in lengths.tolist()
        ]
        self.targets = [
            None if b >= n else b for b, n in zip(self.row_budgets, lengths.tolist(), strict=True)
        ]

    def note_appended(self, counts: list[int]) -> None:
        """Add ``counts[r]`` entries appended to row ``r`` after the compression, uncompressed
        and outside the budget (the question, question-agnostic): decoding holds them too, rather
        than evicting the question back to the budget at its first step."""
        run = self.run
        run.appended = [run.appended_to(r) + int(n) for r, n in enumerate(counts)]

    def forget_appended(self) -> None:
        """Forget what was appended after the compression (the cache was rewound to the compressed
        part, :meth:`BudgetCache.rewind`): the next request's own tokens are noted afresh."""
        self.run.appended = []

    def decode_budgets(self) -> list[int]:
        """Per row, the entries per head a decode-stage method holds: the budget plus what was
        appended uncompressed after the compression (``run.appended_to(r)``; a method with a
        per-layer plan adds it to each layer's limit)."""
        assert self.row_budgets is not None
        return [b + self.run.appended_to(r) for r, b in enumerate(self.row_budgets)]

    #: record every layer's attention input in ``RECORD`` phase (a snapshot for methods that read it)
    record_attention_inputs: bool = False

    @property
    def wants_attention_inputs(self) -> bool:
        """Whether :meth:`before_attention` wants each attention module's input (off: no cost): the
        method reads it (``Method.wants_attention_inputs``), or a snapshot records it."""
        return self.record_attention_inputs or self.method.wants_attention_inputs

    def before_attention(self, module: nn.Module, hidden_states: torch.Tensor) -> None:
        """Called before an attention module runs, when :attr:`wants_attention_inputs` is set, with
        the module (its ``layer_idx``, its projections) and its input ``[b, q, hidden]``: kept in
        :attr:`attention_inputs` for the layer's prefill observation (or the snapshot), and for its
        decode observation when the method acts while decoding (KVzap's decoding variant)."""
        if self._phase in (Phase.PREFILL, Phase.RECORD) or (
            self._phase is Phase.DECODE and Stage.DECODE in self.method.stages
        ):
            self.attention_inputs[int(module.layer_idx)] = hidden_states

    #: the method that handles a layer after its attention, per phase (no entry: nothing to do)
    layer_handlers: ClassVar[dict[Phase, str]] = {
        Phase.RECORD: "_record_layer",
        Phase.PREFILL: "_prefill_layer",
        Phase.DECODE: "_decode_layer",
    }

    def after_attention(
        self,
        layer_idx: int,
        query: torch.Tensor,
        layer: BudgetLayer,
        scaling: float,
        layers: list[BudgetLayer] | None = None,
    ) -> None:
        """Called by the attention hook once the layer's attention output is computed: the handler
        of the current phase (:attr:`layer_handlers`) gets the layer.

        ``query``: the layer's post-RoPE queries ``[b, q_heads, q, d]``; ``layers``: all layers of
        the cache, for cascading methods that re-evict earlier layers after each prefilled one
        (``Method.cascading``) and post-prefill methods that compress them after the last.
        """
        handler = self.layer_handlers.get(self._phase)
        if handler is not None:
            getattr(self, handler)(layer_idx, query, layer, scaling, layers)

    def _record_layer(
        self, layer_idx: int, query: torch.Tensor, layer: BudgetLayer, scaling: float, layers: Any
    ) -> None:
        """``RECORD``: keep the layer's queries (all of them), compress nothing."""
        self.recorded_queries[layer_idx] = query
        self.scaling = scaling

    def _prefill_layer(
        self,
        layer_idx: int,
        query: torch.Tensor,
        layer: BudgetLayer,
        scaling: float,
        layers: list[BudgetLayer] | None,
    ) -> None:
        """``PREFILL``: keep the queries a lookahead wants, then compress the layer now (prefill and
        prune stages) or record it for after the last layer (post-prefill); count what it kept."""
        start = self.clock(query.device)
        if self.memory is not None and not layer.is_ragged and RANK_STATE not in layer.state:
            layer.state[RANK_STATE] = layer.positions.float()  # recency, unless the method scores them
        keep_queries = self.method.queries_to_record()
        if keep_queries:
            self.recorded_queries[layer_idx] = query[:, :, max(0, query.shape[2] - keep_queries) :]
            self.scaling = scaling
        stages = self.method.stages
        if COMPRESS_AT_PREFILL.intersection(stages):
            kept = self._compress_now(layer_idx, query, layer, scaling, layers)
        else:
            if self.targets is None:
                self.resolve(layer.head_lengths()[:, 0])
            if Stage.POST_PREFILL in stages:
                self.method.record(self._prefill_observation(layer_idx, query, layer, scaling), self.targets)
            kept = layer.head_lengths().cpu()
        if self.kept is None:
            self.kept = torch.zeros((kept.shape[0], self.num_layers, kept.shape[1]), dtype=torch.long)
        self.kept[:, layer_idx] = kept
        if Stage.POST_PREFILL in stages and layers is not None and layer_idx == self.num_layers - 1:
            self.method.post_prefill(layers, self.targets, self.run)
            for i, compressed in enumerate(layers):
                self.kept[:, i] = compressed.head_lengths().cpu()
        self.compress_seconds += self.clock(query.device) - start

    def _compress_now(
        self,
        layer_idx: int,
        query: torch.Tensor,
        layer: BudgetLayer,
        scaling: float,
        layers: list[BudgetLayer] | None,
    ) -> torch.Tensor:
        """Compress the layer right after its attention (a cascading method then re-evicts the
        earlier ones); its ``[b, kv_heads]`` kept entries."""
        obs = self._prefill_observation(layer_idx, query, layer, scaling)
        if self.targets is None:
            self.resolve(obs.lengths)
        kept = self.method.compress_layer(obs, self.targets)
        if self.method.cascading and layers is not None:
            self.method.rebalance(layers[: layer_idx + 1], self.targets, self.run)
            for earlier in range(layer_idx):
                self.kept[:, earlier] = layers[earlier].head_lengths().cpu()
        return kept

    def _decode_layer(
        self, layer_idx: int, query: torch.Tensor, layer: BudgetLayer, scaling: float, layers: Any
    ) -> None:
        """``DECODE``: a decode-stage method trims the layer back to its budgets."""
        if Stage.DECODE not in self.method.stages or self.row_budgets is None:
            return
        start = self.clock(query.device)
        inputs = self.attention_inputs.pop(layer_idx, None)
        obs = Observation(
            layer_idx, self.num_layers, query, layer, scaling, run=self.run, attention_input=inputs
        )
        self.method.decode_step(obs, self.decode_budgets())
        self.decode_seconds += self.clock(query.device) - start


def replay_prefill(
    cache: BudgetCache,
    full_layers: Sequence[BudgetLayer],
    queries: Mapping[int, torch.Tensor],
    scaling: float,
    copy: Callable[[BudgetLayer], BudgetLayer] | None = None,
    attention_inputs: Mapping[int, torch.Tensor] | None = None,
) -> Iterator[int]:
    """Compress ``cache`` as a layer-wise prefill would have, from the layers of a full cache.

    Layer by layer, a copy of ``full_layers[i]`` (``layer.shallow_copy()``, sharing its tensors, or
    ``copy(layer)``) goes into ``cache`` and the cache's session (a :class:`CompressionSession`)
    gets the layer's post-RoPE ``queries[i]: [b, q_heads, n, d]`` and ``scaling`` through
    ``after_attention``, in ``PREFILL`` phase (:meth:`CompressionSession.begin_prefill`), as the
    attention hook hands them over during a prefill (and, for a session that wants them, the layer's
    ``attention_inputs[i]: [b, n, hidden]`` first, as :meth:`CompressionSession.before_attention`
    would); the layers the session changed are re-counted in the cache's memory. Yields each layer
    index once the session has seen that layer, so a caller may stop early (the deeper layers of
    ``cache`` then stay empty).
    """
    session = cache.session
    cache.attention_attached = True
    session.begin_prefill()
    for layer_idx, full in enumerate(full_layers):
        cache.layers[layer_idx] = full.shallow_copy() if copy is None else copy(full)
        if attention_inputs is not None and session.wants_attention_inputs:
            session.attention_inputs[layer_idx] = attention_inputs[layer_idx]
        session.after_attention(layer_idx, queries[layer_idx], cache.layers[layer_idx], scaling, cache.layers)
        for noted in range(layer_idx + 1) if session.edits_earlier_layers else (layer_idx,):
            cache.note_memory(noted)  # a cascading or post-prefill method also edited earlier layers
        yield layer_idx
