"""JoinedCache: several sequences' caches decoded in one forward, each row its own BudgetCache.

Continuous batching (docs/architecture.md, "Serving") decodes every active sequence in one forward,
though each was prefilled and compressed on its own, with its own method, budget and ragged
per-head cache. Copying them into one padded batch cache would pad every row to the longest
sequence (a full-cache row next to compressed ones pads them all to its length) and copy the
whole cache at every join. A :class:`JoinedCache` instead holds the sequences' own
:class:`~kvbudget.cache.BudgetCache` objects, one per batch row: the model's projections and MLPs run
on the whole batch ``[rows, 1, hidden]``, and the ``kvbudget`` attention
(:func:`kvbudget.attention.kvbudget_attention`) attends each row over its own cache — exactly the
computation that row would make alone, its session (a decode-stage method's eviction) included.

Rows join and leave between steps (:meth:`JoinedCache.join`, :meth:`JoinedCache.leave`); nothing is
copied. Every row must be a single-sequence cache (batch size 1).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvbudget.cache import BudgetCache
from kvbudget.errors import KVBudgetError


class JoinedLayer(DynamicLayer):
    """Layer ``layer_idx`` of a :class:`JoinedCache`: appends each row's new keys and values to that
    row's own cache layer."""

    def __init__(self, joined: JoinedCache, layer_idx: int) -> None:
        super().__init__()
        self.joined, self.layer_idx = joined, layer_idx
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_states``/``value_states``: ``[rows, kv_heads, q, head_dim]``; row ``r`` goes to
        ``rows[r]``. Returns empty placeholders: only the ``kvbudget`` attention reads the rows."""
        rows = self.joined.rows
        if key_states.shape[0] != len(rows):
            raise KVBudgetError(f"a forward over {key_states.shape[0]} rows for a JoinedCache of {len(rows)}")
        for r, cache in enumerate(rows):
            cache.update(key_states[r : r + 1], value_states[r : r + 1], self.layer_idx)
        empty = key_states.new_empty((key_states.shape[0], key_states.shape[1], 0, key_states.shape[-1]))
        return empty, empty

    def get_seq_length(self) -> int:
        return max((cache.layers[self.layer_idx].seen for cache in self.joined.rows), default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        longest = max((cache.layers[self.layer_idx].physical_length for cache in self.joined.rows), default=0)
        return longest + query_length, 0

    def get_max_length(self) -> int:
        return -1


class JoinedCache(Cache):
    """The caches of the sequences decoded together, batch row ``r`` being ``rows[r]``.

    Args:
        num_layers: decoder layers of the model.
        rows: the sequences' caches (each of batch size 1), in batch order.
    """

    def __init__(self, num_layers: int, rows: list[BudgetCache] | None = None) -> None:
        super().__init__(layers=[])
        self.layers = [JoinedLayer(self, i) for i in range(num_layers)]
        self.rows: list[BudgetCache] = []
        for cache in rows or []:
            self.join(cache)

    def join(self, cache: BudgetCache) -> int:
        """Add ``cache`` as the last row; returns its row index."""
        if not isinstance(cache, BudgetCache):
            raise KVBudgetError(f"a JoinedCache row must be a BudgetCache, got {type(cache).__name__}")
        if len(cache.layers) != len(self.layers):
            raise KVBudgetError(f"a cache of {len(cache.layers)} layers joins one of {len(self.layers)}")
        if cache.layers[0].is_initialized and cache.layers[0].batch_size != 1:
            raise KVBudgetError(
                f"a JoinedCache row holds one sequence, got a batch of {cache.layers[0].batch_size}"
            )
        self.rows.append(cache)
        return len(self.rows) - 1

    def leave(self, row: int) -> BudgetCache:
        """Remove row ``row`` (later rows move up by one) and return its cache."""
        return self.rows.pop(row)

    def physical_bytes(self) -> int:
        """Bytes the rows' caches hold."""
        return sum(cache.physical_bytes() for cache in self.rows)

    def __len__(self) -> int:
        return len(self.layers)
