"""BudgetCache: a transformers cache that stores fewer entries than it has seen.

Design (docs/architecture.md §3):

* **Logical vs physical length.** Each layer counts the tokens it has *seen* (``seen``) and stores
  fewer. ``get_seq_length()`` reports the logical length, so transformers gives new tokens their
  true RoPE positions without the caller passing ``position_ids``; ``get_mask_sizes()`` reports
  the physical one.
* **Two layouts.** A layer whose KV heads all keep the same number of entries stores plain
  rectangular tensors ``keys: [batch, kv_heads, n, head_dim]`` (exactly like ``DynamicLayer``, so
  even a plain sdpa attention reads it correctly when nothing is padded). A layer with per-head
  budgets stores one tensor per KV head, ``head_keys[h]: [batch, n_h, head_dim]``, so skewed
  budgets save real memory; the registered ``kvbudget`` attention attends per KV head.
* **Positions and validity.** ``positions`` holds each entry's logical index (``-1`` marks a pad
  token or an empty slot of a shorter batch row); the validity mask is ``positions >= 0``.
* **Per-entry state** (accumulated attention, merge counts, ...) lives in ``state`` with the same
  layout as ``positions`` and is gathered with the keys and values.
* **Sliding-window layers.** The ``kvbudget`` attention records a layer's window
  (``sliding_window``, from what the model passes it) and Gemma 2's ``softcap``. Entries at
  positions ``≤ seen − window`` can never be seen again (the next token is at ``seen``):
  :meth:`BudgetCache.update` drops them before appending, once at least ``min(32, window)`` have
  accumulated (so decoding copies a window layer once every few dozen steps, not every step), in
  the engine's phases (prefill, decode, off; a method's own extra pass leaves the layer as it is).
  A compression method acts on such a layer like on any other; entries it keeps outside the
  window leave at the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache

from kvbudget.cache_layer import BudgetLayer
from kvbudget.errors import KVBudgetError
from kvbudget.phases import Phase
from kvbudget.quantized_store import GROUP, check_storable

#: stale entries a sliding-window layer may hold before :meth:`BudgetCache.update` drops them
WINDOW_SLACK = 32
#: session phases whose forwards drop a sliding-window layer's stale entries (see ``BudgetCache.update``)
WINDOW_TRIM_PHASES = frozenset({Phase.PREFILL, Phase.DECODE, Phase.OFF})
#: session phases whose forwards find a cache with ``kv_bits`` quantized (the prefill's are done)
QUANTIZE_PHASES = frozenset({Phase.DECODE, Phase.OFF})
#: the precisions a cache stores entries at (16: the model's dtype, not quantized)
KV_BITS = (2, 4, 8, 16)


def check_kv_bits(kv_bits: int | None) -> int | None:
    """``kv_bits`` as the cache takes it (``None`` for 16 or none), or a one-line error."""
    if kv_bits is None or kv_bits == 16:
        return None
    if isinstance(kv_bits, bool) or kv_bits not in KV_BITS:
        raise KVBudgetError(f"kv_bits must be one of 2, 4, 8 or 16, got {kv_bits!r}")
    return int(kv_bits)


class CacheSession(Protocol):
    """What a :class:`BudgetCache` and the ``kvbudget`` attention ask of the session riding on the
    cache: :class:`kvbudget.session.CompressionSession` in the engine (the cache sits below it and
    knows it only through this)."""

    @property
    def phase(self) -> Phase:
        """What the next forward is (prefill, decode, record, off, or a method's own pass over a
        cache); read-only: only the session moves it (see :mod:`kvbudget.session`)."""
        ...

    @property
    def kv_bits(self) -> int | None:
        """Bits the run's cache stores an entry's values at once the prefill is done (``None``: the
        model's dtype)."""
        ...

    @property
    def compresses(self) -> bool:
        """Whether the session's method compresses at all (a layer's first fill is then dropped
        soon, so the cache gives it no room to decode into)."""
        ...

    @property
    def edits_earlier_layers(self) -> bool:
        """Whether compressing a layer may change earlier layers too (their sizes are re-counted)."""
        ...

    def after_attention(
        self,
        layer_idx: int,
        query: torch.Tensor,
        layer: BudgetLayer,
        scaling: float,
        layers: list[BudgetLayer] | None = None,
    ) -> None:
        """Called by the attention with the layer's post-RoPE queries ``[b, q_heads, q, d]`` once the
        layer's attention output is computed (``layers``: every layer of the cache)."""
        ...


@dataclass
class CacheStats:
    """Byte accounting of a cache.

    Attributes:
        logical_bytes: bytes of the kept (valid) entries: entries × (key + value) × dtype size, or
            for quantized layers their share of the allocated bytes (scales included).
        physical_bytes: bytes of the allocated key/value tensors (pads included).
        metadata_bytes: positions and per-entry method state (not part of the KV bytes).
        entries: kept entries ``[layers, kv_heads]``, summed over batch rows.
        seen_tokens: logical length (tokens seen, pads included).
    """

    logical_bytes: int
    physical_bytes: int
    metadata_bytes: int
    entries: torch.Tensor
    seen_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "logical_bytes": self.logical_bytes,
            "physical_bytes": self.physical_bytes,
            "metadata_bytes": self.metadata_bytes,
            "entries": self.entries.tolist(),
            "total_entries": int(self.entries.sum()),
            "seen_tokens": self.seen_tokens,
            **self.extra,
        }


class BudgetCache(Cache):
    """A ``transformers`` cache whose layers keep a budgeted subset of entries.

    Works with ``model.generate(past_key_values=cache)`` and a plain forward; compressed layers
    with per-head budgets need the ``kvbudget`` attention (``kvbudget.attach(model)``).

    Args:
        num_layers: decoder layers of the model (``config.num_hidden_layers``).
        session: the active compression session (a :class:`CacheSession`), or ``None`` for a cache
            that only stores.
        kv_bits: store entries at 2, 4 or 8 bits once the prefill is done (``None`` or 16: in the
            model's dtype, or what the session says); see :meth:`quantize`.
        group: KIVI's group ``G`` for quantized storage (tokens of a key group, channels of a value
            group, the full-precision tail's length before it is quantized).
    """

    def __init__(
        self,
        num_layers: int,
        session: CacheSession | None = None,
        kv_bits: int | None = None,
        group: int = GROUP,
    ) -> None:
        super().__init__(layers=[BudgetLayer() for _ in range(num_layers)])
        self.session = session
        self._kv_bits = check_kv_bits(kv_bits)
        self.group = group
        #: what the cache is of (model, method, token ids), for ``kvbudget.save_cache``: set by
        #: ``kvbudget.compress`` and ``kvbudget.load_cache`` (a ``kvbudget.cache_files.CacheSource``)
        self.source: Any = None
        #: what a byte budget chose (``kvbudget.byte_budget.apply_byte_budget``), once applied
        self.byte_budget: dict[str, Any] | None = None
        self.attention_attached = False
        #: set by the prune stage while a pruned sequence runs: (slots ``[b, q]``, logical length)
        self.pruned_slots: tuple[torch.Tensor, int] | None = None
        self.peak_physical_bytes = 0
        self._layer_bytes = [0] * num_layers
        self._total_bytes = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if layer_idx > 0 and self._quantize_early():  # the layer before is done: stored quantized now
            done = self.layers[layer_idx - 1]
            if done.quant is None and done.is_initialized:
                done.quantize(self.kv_bits, self.group)
                self.note_memory(layer_idx - 1)
        if layer.quant is None and self._may_quantize():
            if self._memory() is not None:
                self.quantize()  # every layer at once: the byte budget is over the whole cache
            elif self.kv_bits is not None:
                layer.quantize(self.kv_bits, self.group)
        if (layer.is_ragged or layer.quant is not None) and not self.attention_attached:
            raise KVBudgetError(
                "this BudgetCache holds per-head budgets or quantized entries, which only the kvbudget "
                "attention can read: call kvbudget.attach(model) first"
            )
        # room to decode into, unless the session is about to compress (and drop) this storage
        room = self.session is None or not self.session.compresses
        if layer.sliding_window is not None and self.pruned_slots is None and self._may_trim():
            layer.drop_outside_window(slack=min(WINDOW_SLACK, layer.sliding_window))
        if self.pruned_slots is None:
            out = layer.update(key_states, value_states, first_fill_room=room)
        else:
            slots, seen = self.pruned_slots
            out = layer.update(key_states, value_states, slots=slots, seen=seen, first_fill_room=room)
        self.note_memory(layer_idx)
        return out

    @property
    def kv_bits(self) -> int | None:
        """The precision entries are stored at once the prefill is done: the cache's own, else its
        session's (``None``: the model's dtype)."""
        if self._kv_bits is not None:
            return self._kv_bits
        return check_kv_bits(getattr(self.session, "kv_bits", None))

    #: quantize each layer as soon as its prefill is done, when the method allows (see
    #: :meth:`_quantize_early`); ``False`` keeps every layer in the model's dtype until the prefill ends
    quantize_early: bool = True

    def _quantize_early(self) -> bool:
        """Whether a layer whose prefill is done may be stored quantized before the prefill ends: a
        prefill at ``kv_bits`` (not a byte budget, which plans over every layer) by a method that
        never reads or changes a layer once the next one is prefilled (``quantizes_during_prefill``).
        The stored values are the same either way; the prefill's peak is then one layer in the
        model's dtype, the others quantized."""
        session = self.session
        if not self.quantize_early or session is None or getattr(session, "phase", None) != Phase.PREFILL:
            return False
        if self.kv_bits is None or self._memory() is not None:
            return False
        return bool(getattr(getattr(session, "method", None), "quantizes_during_prefill", False))

    def _memory(self) -> float | None:
        """The session's byte budget (``memory=``: a share of the full cache's bytes), if any."""
        return getattr(self.session, "memory", None)

    def _may_quantize(self) -> bool:
        """Whether this forward finds the layer's prefill done (no session: any forward after the
        first; else the engine's decode and uncompressed appends)."""
        return self.session is None or self.session.phase in QUANTIZE_PHASES

    def quantize(self, kv_bits: int | None = None, group: int | None = None) -> None:
        """Store every layer's entries at ``kv_bits`` (default: the cache's) from now on: what the
        prefill kept is quantized in KIVI groups now, and later tokens as they fill a group
        (:mod:`kvbudget.quantized_store`). ``kv_bits`` of 16 or ``None`` (with none set) does nothing."""
        if self._memory() is not None and all(layer.quant is None for layer in self.layers):
            from kvbudget.byte_budget import apply_byte_budget  # beside the cache, imported when used

            tokens = getattr(self.session, "memory_tokens", None)
            self.byte_budget = apply_byte_budget(self, self._memory(), prompt_tokens=tokens)
            self._kv_bits = self.byte_budget["tiers"][1]  # what appended tokens are stored at
            return
        bits = check_kv_bits(kv_bits) if kv_bits is not None else self.kv_bits
        if bits is None:
            return
        self._kv_bits, self.group = bits, group or self.group
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                check_storable(bits, layer.head(0)[0].shape[-1])
                layer.quantize(bits, self.group)
                self.note_memory(i)

    def _may_trim(self) -> bool:
        """Whether this forward may drop entries that left a sliding window: with no session or in
        the engine's own phases; a method's extra pass over a cache (another phase) sees it as it is."""
        return self.session is None or self.session.phase in WINDOW_TRIM_PHASES

    def note_memory(self, layer_idx: int) -> None:
        """Account layer ``layer_idx``'s current size and update ``peak_physical_bytes``."""
        size = self.layers[layer_idx].physical_bytes()
        self._total_bytes += size - self._layer_bytes[layer_idx]
        self._layer_bytes[layer_idx] = size
        self.peak_physical_bytes = max(self.peak_physical_bytes, self._total_bytes)

    def drop_outside_window(self, slack: int = 1) -> int:
        """Drop the entries no later query can see: those at positions ``≤ seen − sliding_window``
        (the next token is at position ``seen``), and invalid slots with them, once at least
        ``slack`` such entries exist in some head. Returns how many entries the fullest head lost
        (0: nothing done). A global layer (``sliding_window is None``) is left alone."""
        window = self.sliding_window
        if window is None or not self.is_initialized:
            return 0
        limit = self.seen - window
        heads = self.positions if self.is_ragged else list(self.positions.unbind(1))
        stale = max(int(((p >= 0) & (p <= limit)).sum(-1).max()) for p in heads)
        if stale < slack or stale == 0:
            return 0
        b = self.batch_size
        self.keep(
            [[(heads[h][r] > limit).nonzero().squeeze(-1) for h in range(len(heads))] for r in range(b)]
        )
        return stale

    def drop_last(self, count: int) -> None:
        """Forget the last ``count`` tokens in every layer (see :meth:`BudgetLayer.drop_last`)."""
        for i, layer in enumerate(self.layers):
            layer.drop_last(count)
            self.note_memory(i)

    def rewind(self, length: int) -> None:
        """Forget every token from logical position ``length`` on, in every layer
        (:meth:`BudgetLayer.rewind`): the cache a later request on the first ``length`` tokens
        starts from."""
        for i, layer in enumerate(self.layers):
            layer.rewind(length)
            self.note_memory(i)

    def physical_bytes(self) -> int:
        return sum(layer.physical_bytes() for layer in self.layers)

    def stats(self, row: int | None = None) -> CacheStats:
        """Byte accounting over all layers, for the whole batch or one batch ``row``.

        A row's physical bytes are its slice of the allocated tensors (its padding included).
        """
        layers = [layer for layer in self.layers if layer.is_initialized]
        if not layers:
            raise KVBudgetError("the cache is empty: nothing has been prefilled yet")
        if row is None:
            entries = torch.stack([layer.logical_entries() for layer in layers])
            physical = self.physical_bytes()
            metadata = sum(layer.metadata_bytes() for layer in layers)
            logical = sum(layer.stored_bytes() for layer in layers)
        else:
            entries = torch.stack([layer.head_lengths()[row] for layer in layers])
            batch = layers[0].batch_size
            physical = sum(layer.physical_bytes() for layer in layers) // batch
            metadata = sum(layer.metadata_bytes() for layer in layers) // batch
            share = entries.sum(-1) / torch.stack([layer.logical_entries() for layer in layers]).sum(
                -1
            ).clamp(min=1)
            logical = round(
                sum(float(s) * layer.stored_bytes() for s, layer in zip(share, layers, strict=True))
            )
        extra: dict[str, Any] = {"peak_physical_bytes": self.peak_physical_bytes}
        if self.kv_bits is not None:
            extra["kv_bits"] = self.kv_bits
        if self.byte_budget is not None:
            extra["byte_budget"] = self.byte_budget
        return CacheStats(
            logical_bytes=logical,
            physical_bytes=physical,
            metadata_bytes=metadata,
            entries=entries,
            seen_tokens=layers[0].seen,
            extra=extra,
        )


def model_entry_bytes(config: Any, dtype: torch.dtype) -> int:
    """Bytes of one cache entry (a key and a value of one token in one KV head) of a model with
    ``config`` run in ``dtype``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * head_dim * dtype.itemsize


def full_cache_stats(num_layers: int, num_kv_heads: int, length: int, entry_bytes: int) -> CacheStats:
    """What an uncompressed cache of ``length`` tokens holds (the "before" of a compression)."""
    entries = torch.full((num_layers, num_kv_heads), length, dtype=torch.long)
    size = num_layers * num_kv_heads * length * entry_bytes
    return CacheStats(size, size, 0, entries, length)
