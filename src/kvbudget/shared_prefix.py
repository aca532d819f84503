"""A compressed cache shared as a read-only prefix: one document compressed once, many conversations
reading it, each holding only its own entries after it.

:func:`share` makes a new :class:`~kvbudget.cache.BudgetCache` whose every KV head is a
:class:`SharedHead`: the document's head store (read-only, referenced, not copied) followed by the
conversation's own entries. Attention reads a row as it reads a quantized one (the layer's ``quant``
heads, :mod:`kvbudget.quantized_store`): the prefix's entries, then the conversation's own, written
into one pair of tensors — so a conversation on a shared document answers exactly as one on its own
copy of the document's cache (``tests/test_shared_prefix.py``). The document's entries are counted
once, by whoever holds the document: a :class:`SharedHead`'s ``nbytes`` is its own entries'.

A conversation's own entries are stored as the document's are: at its ``kv_bits`` (a
:class:`~kvbudget.quantized_store.QuantizedHead` that starts with a copy of the document's
full-precision tail, under one key group, so its groups fill as in one cache) or in the model's
dtype (:class:`PlainHead`). An eviction or a merge that touches the prefix's entries makes them the
conversation's own (copied, counted in its bytes); the document is never written.

Shapes: a head store holds ``keys [b, n, d]`` and ``values [b, n, dv]`` (``b`` rows of one KV head);
the document's caches here have one row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvbudget.cache import BudgetCache, BudgetLayer
from kvbudget.errors import KVBudgetError
from kvbudget.quantized_store import GROUP, QuantizedHead, TieredHead


@dataclass(frozen=True)
class PlainHead:
    """Entries of one KV head in the model's dtype, behind the quantized stores' interface (never
    written in place: every change makes a new store)."""

    keys: torch.Tensor
    values: torch.Tensor
    group: int = GROUP
    bits: int = 16
    whole_groups: bool = True

    @property
    def quantized_entries(self) -> int:
        return 0

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def tail_keys(self) -> torch.Tensor:
        """Entries in full precision: all of them."""
        return self.keys

    @property
    def tail_values(self) -> torch.Tensor:
        return self.values

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def dequantize(
        self, dtype: torch.dtype | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values (in ``dtype``), or written into ``out``."""
        if out is not None:
            out[0].copy_(self.keys)
            out[1].copy_(self.values)
            return out
        dtype = dtype or self.keys.dtype
        return self.keys.to(dtype, copy=True), self.values.to(dtype, copy=True)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> PlainHead:
        return replace(self, keys=torch.cat([self.keys, keys], 1), values=torch.cat([self.values, values], 1))

    def flush(self) -> PlainHead:
        return self

    def take(self, idx: torch.Tensor) -> PlainHead:
        """The entries ``idx: [b, k]`` of each row."""
        gather = idx.unsqueeze(-1)
        keys = self.keys.gather(1, gather.expand(-1, -1, self.keys.shape[-1]))
        values = self.values.gather(1, gather.expand(-1, -1, self.values.shape[-1]))
        return replace(self, keys=keys, values=values)

    def replaced(self, keys: torch.Tensor, values: torch.Tensor) -> PlainHead:
        return replace(self, keys=keys.clone(), values=values.clone())

    def grown_nbytes(self, tokens: int) -> int:
        per_entry = (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()
        return (self.length + tokens) * self.batch_size * per_entry

    def map_batch(self, fn: Any) -> PlainHead:
        return replace(self, keys=fn(self.keys), values=fn(self.values))


@dataclass(frozen=True)
class SharedHead:
    """One KV head of a conversation on a shared prefix: ``prefix`` (the document's store, read
    only) then ``own`` (the conversation's entries). ``shared``: the prefix is the document's, not
    counted here; after an eviction or merge touched it, it is a private copy (``False``)."""

    prefix: Any
    own: Any
    shared: bool = True

    @property
    def bits(self) -> int:
        return self.own.bits

    @property
    def group(self) -> int:
        return self.own.group

    @property
    def whole_groups(self) -> bool:
        return False

    @property
    def quantized_entries(self) -> int:
        return self.prefix.quantized_entries + self.own.quantized_entries

    @property
    def length(self) -> int:
        return self.prefix.length + self.own.length

    @property
    def batch_size(self) -> int:
        return self.own.batch_size

    @property
    def tail_keys(self) -> torch.Tensor:
        """The conversation's latest entries in full precision (dtype and shape as the layer's)."""
        return self.own.tail_keys

    @property
    def tail_values(self) -> torch.Tensor:
        return self.own.tail_values

    @property
    def nbytes(self) -> int:
        """Bytes this conversation holds: its own entries (and the prefix once it is a private copy)."""
        return self.own.nbytes + (0 if self.shared else self.prefix.nbytes)

    def dequantize(
        self, dtype: torch.dtype | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[b, p + m, d]`` and values (``p`` the prefix's entries first), or written into ``out``."""
        p = self.prefix.length
        if out is None:
            own_keys, own_values = self.own.dequantize(dtype)
            dtype = own_keys.dtype
            b, m = own_keys.shape[:2]
            out = (
                own_keys.new_empty((b, p + m, own_keys.shape[-1]), dtype=dtype),
                own_values.new_empty((b, p + m, own_values.shape[-1]), dtype=dtype),
            )
        keys, values = out
        self.prefix.dequantize(out=(keys[:, :p], values[:, :p]))
        self.own.dequantize(out=(keys[:, p:], values[:, p:]))
        return keys, values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> SharedHead:
        return replace(self, own=self.own.append(keys, values))

    def flush(self) -> SharedHead:
        return replace(self, own=self.own.flush())

    def take(self, idx: torch.Tensor) -> SharedHead:
        """Keep entries ``idx: [b, k]`` (sorted, of the whole row): the prefix's kept entries become
        a private copy unless all of them are kept."""
        p = self.prefix.length
        in_prefix = idx < p
        counts = in_prefix.sum(1)
        if bool((counts != counts[0]).any()):
            raise KVBudgetError("rows of a shared prefix keep the same number of its entries")
        k = int(counts[0])
        prefix_idx, own_idx = idx[:, :k], idx[:, k:] - p
        own = self.own.take(own_idx)
        if k == p and self.shared:
            return replace(self, own=own)
        return SharedHead(self.prefix.take(prefix_idx), own, shared=False)

    def replaced(self, keys: torch.Tensor, values: torch.Tensor) -> SharedHead:
        """Store ``keys``/``values`` ``[b, p + m, d]`` (a merge's rewrite): the prefix stays shared
        when its entries are unchanged."""
        p = self.prefix.length
        old_keys, old_values = self.prefix.dequantize()
        own = self.own.replaced(keys[:, p:], values[:, p:])
        if torch.equal(old_keys, keys[:, :p]) and torch.equal(old_values, values[:, :p]):
            return replace(self, own=own)
        return SharedHead(self.prefix.replaced(keys[:, :p], values[:, :p]), own, shared=False)

    def grown_nbytes(self, tokens: int) -> int:
        return self.own.grown_nbytes(tokens) + (0 if self.shared else self.prefix.nbytes)

    def map_batch(self, fn: Any) -> SharedHead:
        if self.shared:
            raise KVBudgetError("a conversation on a shared prefix is one row: it cannot be split or joined")
        return SharedHead(self.prefix.map_batch(fn), self.own.map_batch(fn), shared=False)


def _prefix_store(layer: BudgetLayer, h: int) -> Any:
    """Head ``h`` of a document's ``layer`` as a read-only store: its quantized store, else its
    entries in the model's dtype (views: the document is never written)."""
    if layer.quant is not None:
        return layer.quant[h]
    keys, values, _ = layer.head(h)
    return PlainHead(keys, values)


def _split(head: Any) -> tuple[Any, Any]:
    """A document's head store as (the shared prefix, the conversation's first own store). A
    quantized store's full-precision tail (its last, unfilled key group) is copied into the
    conversation's store, so the tokens it appends fill that group as they would in one cache."""
    if isinstance(head, PlainHead):
        return head, PlainHead(head.keys[:, :0].clone(), head.values[:, :0].clone(), head.group)
    low = head.low if isinstance(head, TieredHead) else head
    own = QuantizedHead.empty_like(low.tail_keys.clone(), low.tail_values.clone(), low.bits, low.group)
    low = replace(low, tail_keys=low.tail_keys[:, :0], tail_values=low.tail_values[:, :0])
    return (TieredHead(head.high, low) if isinstance(head, TieredHead) else low), own


def share(document: BudgetCache) -> BudgetCache:
    """A cache for one conversation on ``document`` (a compressed, batch-1 cache no forward will
    write again): its positions and method state copied, its keys and values read from the
    document's heads (:class:`SharedHead`), no session (what the conversation appends is kept as is).
    """
    layers = [layer for layer in document.layers if layer.is_initialized]
    if not layers:
        raise KVBudgetError("the document's cache is empty")
    if layers[0].batch_size != 1:
        raise KVBudgetError("a shared document is one sequence (batch 1)")
    out = BudgetCache(len(document.layers), session=None, group=document.group)
    out.attention_attached = document.attention_attached
    out.source = document.source
    for mine, theirs in zip(out.layers, document.layers, strict=True):
        if not theirs.is_initialized:
            continue
        heads = [_split(_prefix_store(theirs, h)) for h in range(theirs.num_heads)]
        for name, value in vars(theirs).items():
            if name in ("quant", "keys", "values", "_keys", "_values", "_head_keys", "_head_values",
                        "_storage", "_head_storage"):  # fmt: skip
                continue
            setattr(mine, name, copy.deepcopy(value))
        mine.install_quantized([SharedHead(prefix, own) for prefix, own in heads])
    return out
