"""Append-in-place storage behind :class:`kvbudget.cache_layer.BudgetLayer`'s key and value views,
its byte accounting, and the entry gather every keep uses."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: keys ``[*lead, n, d]``, values ``[*lead, n, d]`` and positions ``[*lead, n]`` of one layout
Views = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


@dataclass
class Storage:
    """Storage with room to append in place along the entry axis: ``keys/values: [*lead, capacity, d]``,
    ``positions: [*lead, capacity]`` (``lead`` is ``[b, h]`` for a rectangular layer, ``[b]`` for
    one KV head of a per-head layer); ``owner`` is the only layer that may write to it."""

    owner: object
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    last_views: Views | None = None

    @classmethod
    def like(cls, owner: object, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> Storage:
        lead = keys.shape[:-2]
        return cls(
            owner,
            keys.new_empty((*lead, capacity, keys.shape[-1])),
            values.new_empty((*lead, capacity, values.shape[-1])),
            torch.empty((*lead, capacity), dtype=torch.long, device=keys.device),
        )

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]

    def backs(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> bool:
        """The tensors are leading views of this storage (not replaced since)."""
        last = self.last_views
        if last is not None and keys is last[0] and values is last[1] and positions is last[2]:
            return True  # the views the last append returned (the decode loop's case)
        pairs = (keys, self.keys, 2), (values, self.values, 2), (positions, self.positions, 1)
        return all(
            t.data_ptr() == own.data_ptr() and t.shape[:-k] == own.shape[:-k] and t.stride() == own.stride()
            for t, own, k in pairs
        )

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        q = keys.shape[-2]
        self.keys.narrow(-2, start, q).copy_(keys)
        self.values.narrow(-2, start, q).copy_(values)
        self.positions.narrow(-1, start, q).copy_(positions)

    def view(self, n: int) -> Views:
        views = self.keys.narrow(-2, 0, n), self.values.narrow(-2, 0, n), self.positions.narrow(-1, 0, n)
        self.last_views = views
        return views

    def owned_by(self, layer: object, views: Views) -> bool:
        return self.owner is layer and self.backs(*views)

    @staticmethod
    def append(
        layer: object,
        storage: Storage | None,
        old: Views,
        new: Views,
        first_fill_room: bool = True,
    ) -> tuple[Storage, Views]:
        """Append ``new`` (keys, values, positions) after ``old`` (views ``layer`` holds), in place
        when ``storage`` is ``layer``'s own and has room; returns the storage and the new views.

        An append that does not fit storage the layer filled itself grows it by ``max(32, n / 16)``
        slots of room, so decoding copies only every few dozen tokens; so does a layer's first fill
        (the prefill) when ``first_fill_room``, so that an uncompressed layer's first decode step
        does not copy the whole prompt (the cache turns it off while a session compresses in the
        prefill: that storage is dropped right after). The first append after a compression
        replaced the tensors is sized exactly (the copy is of the kept entries only). Storage
        allocated under ``torch.inference_mode`` is read-only outside it (``kvbudget.compress``
        prefills in inference mode; a caller may decode under ``no_grad``): such an append copies.
        """
        n, q = old[0].shape[-2], new[0].shape[-2]
        ours = storage is not None and storage.owned_by(layer, old)
        writable = ours and (torch.is_inference_mode_enabled() or not storage.keys.is_inference())
        if not (writable and n + q <= storage.capacity):
            room = max(32, (n + q) // 16) if ours or (n == 0 and first_fill_room) else 0
            storage_ = Storage.like(layer, new[0], new[1], n + q + room)
            storage_.write(0, *old)
            storage = storage_
        storage.write(n, *new)
        return storage, storage.view(n + q)


def allocated_bytes(storage: Storage | None, layer: object, views: Views) -> int:
    """Key and value bytes behind ``views`` (keys, values, positions): their storage's capacity
    when ``layer`` owns it, else the tensors' own bytes."""
    if storage is not None and storage.owned_by(layer, views):
        return tensor_bytes(storage.keys) + tensor_bytes(storage.values)
    return tensor_bytes(views[0]) + tensor_bytes(views[1])


def take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Entries ``idx`` along the axis after ``idx``'s leading dims: ``t: [*lead, n, *tail]``,
    ``idx: [*lead, k]`` → ``[*lead, k, *tail]``.

    The same values as ``t.gather`` with ``idx`` expanded over ``tail``, as ``index_select`` (an
    expanded gather index is over ten times slower on CPU): one call over the flattened leading
    dims when ``t`` is contiguous, else one per leading row (no copy of ``t``).
    """
    lead = idx.shape[:-1]
    n, tail = t.shape[len(lead)], t.shape[len(lead) + 1 :]
    rows, k = math.prod(lead), idx.shape[-1]
    if rows == 1:  # one batch row of one head: a plain index_select
        return t.index_select(len(lead), idx.reshape(-1)).view(*lead, k, *tail)
    if not t.is_contiguous():
        per_row, flat_idx = t.reshape(rows, n, *tail), idx.reshape(rows, k)
        taken = [per_row[i].index_select(0, flat_idx[i]) for i in range(rows)]
        return torch.stack(taken).view(*lead, k, *tail)
    offsets = (torch.arange(rows, device=idx.device) * n).view(*lead, 1)
    flat = t.reshape(rows * n, *tail)
    return flat.index_select(0, (idx + offsets).reshape(-1)).view(*lead, k, *tail)
