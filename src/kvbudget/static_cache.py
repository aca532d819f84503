"""A static compressed cache: buffers sized once, lengths on the device, entries written in place.

After compression a sequence's cache size is known in advance — its kept entries plus the tokens
still to generate — so each layer's keys and values can live in one buffer allocated once:

* ``keys[l], values[l]: [batch, kv_heads, capacity_l, head_dim]``; each (row, KV head) holds its
  valid entries at the front, ``lengths[l]: [batch, kv_heads]`` (int64, on the device) of them;
* ``positions[l]: [batch, kv_heads, capacity_l]`` (int32): each entry's logical token index, for
  sliding windows;
* ``seen: [batch]`` (int64, on the device): tokens each row has seen, left pads included (the
  logical index of its next token); ``rope: [batch]``: the RoPE position of its next token (``seen``
  less the row's left pads).

A decode step writes its new key and value at ``lengths`` with a scatter and increments the
lengths on the device, so the step has fixed shapes and no host syncs: it can be captured as a
CUDA graph (:mod:`kvbudget.static_decode`). Attention then needs one call per layer, masked by
the lengths (:func:`kvbudget.attention.attend_static`).

Ragged per-head budgets are padded to the layer's longest (row, head): the buffer is
``kv_heads · max_h(n_h + new_tokens)`` entries wide where the per-head layout of
:class:`~kvbudget.cache.BudgetCache` holds ``Σ_h n_h`` — :meth:`StaticBudgetCache.padding_bytes`
reports the difference. This layout is for decoding; compression happens in the BudgetCache first
and :meth:`StaticBudgetCache.from_budget_cache` converts it.
"""

from __future__ import annotations

from typing import Any

import torch

from kvbudget.cache import BudgetCache
from kvbudget.errors import KVBudgetError

#: Buffers are this many entries wide at least and a multiple of it (aligned for attention kernels).
ALIGN = 64


class CacheFullError(KVBudgetError):
    """A static cache was asked to hold more tokens than it was sized for."""


def _aligned(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


class StaticBudgetCache:
    """Per-layer static buffers for decoding (see the module docstring for the layout).

    Args:
        keys, values: per layer ``[batch, kv_heads, capacity_l, head_dim]``.
        positions: per layer ``[batch, kv_heads, capacity_l]`` (int32; free slots hold ``-1``).
        lengths: per layer ``[batch, kv_heads]`` valid entries (int64).
        seen: ``[batch]`` tokens each row has seen (int64).
        rope: ``[batch]`` RoPE position of each row's next token (int64).
        room: tokens that can still be appended to every (row, head) (checked on the host).
    """

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        positions: list[torch.Tensor],
        lengths: list[torch.Tensor],
        seen: torch.Tensor,
        rope: torch.Tensor,
        room: int,
    ) -> None:
        self.keys, self.values, self.positions, self.lengths = keys, values, positions, lengths
        self.seen, self.rope = seen, rope
        self.room = room
        self._slots = [torch.arange(k.shape[2], device=k.device) for k in keys]

    # ------------------------------------------------------------------ construction
    @classmethod
    def allocate(
        cls,
        lengths: list[torch.Tensor],
        head_dim: int,
        new_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        seen: torch.Tensor | int | None = None,
        value_dim: int | None = None,
        rope: torch.Tensor | None = None,
    ) -> StaticBudgetCache:
        """Empty buffers for per-layer ``lengths: [batch, kv_heads]`` entries plus ``new_tokens``.

        The buffers' contents are uninitialised (zeros); a caller fills them (a benchmark with
        random entries, :meth:`from_budget_cache` with kept ones). ``seen`` defaults to each row's
        longest head in layer 0, ``rope`` to ``seen``.
        """
        device = torch.device(device)
        keys, values, positions, lens = [], [], [], []
        for n in lengths:
            n = n.to(device=device, dtype=torch.long)
            b, h = n.shape
            capacity = _aligned(int(n.max()) + new_tokens)
            keys.append(torch.zeros((b, h, capacity, head_dim), dtype=dtype, device=device))
            values.append(torch.zeros((b, h, capacity, value_dim or head_dim), dtype=dtype, device=device))
            slot = torch.arange(capacity, device=device, dtype=torch.int32)
            positions.append(torch.where(slot < n[..., None], slot, -1).to(torch.int32))
            lens.append(n.clone())
        if seen is None:
            seen = lens[0].max(dim=1).values
        elif isinstance(seen, int):
            seen = torch.full((lens[0].shape[0],), seen, dtype=torch.long, device=device)
        seen = seen.to(device=device, dtype=torch.long)
        rope = seen.clone() if rope is None else rope.to(device=device, dtype=torch.long).clone()
        return cls(keys, values, positions, lens, seen, rope, new_tokens)

    @classmethod
    def from_budget_cache(
        cls, cache: BudgetCache, new_tokens: int, rope: torch.Tensor | None = None
    ) -> StaticBudgetCache:
        """The kept entries of a compressed :class:`BudgetCache`, with room for ``new_tokens``.

        ``rope: [batch]``: the RoPE position of each row's next token (default: the tokens seen,
        right for rows without left padding).

        Each (row, KV head)'s valid entries (position ≥ 0) move to the front of its slots in the
        order the cache stores them; attention does not depend on that order. Per-entry method
        state (H2O's accumulated scores, D2O's merge counts) is not carried: the static layout
        serves methods that do not evict while decoding.
        """
        if new_tokens < 0:
            raise ValueError(f"new_tokens must be ≥ 0, got {new_tokens}")
        first = cache.layers[0]
        device, dtype = first.device, first.dtype
        lengths = [layer.head_lengths() for layer in cache.layers]
        k0, v0, _ = first.head(0)
        static = cls.allocate(
            lengths, k0.shape[-1], new_tokens, dtype, device,
            seen=torch.full((first.batch_size,), first.seen, dtype=torch.long, device=device),
            value_dim=v0.shape[-1], rope=rope,
        )  # fmt: skip
        for index, layer in enumerate(cache.layers):
            capacity = static.capacity(index)
            for h in range(layer.num_heads):
                k, v, pos = layer.head(h)  # [b, n_h, d], [b, n_h, d], [b, n_h]
                # every row's valid entries first, in stored order (a stable sort of the invalid flag);
                # the valid ones never exceed the capacity, so what is cut off is padding
                order = torch.argsort((pos < 0).to(torch.int8), dim=-1, stable=True)[:, :capacity]
                m = order.shape[1]
                static.keys[index][:, h, :m] = k.gather(1, order[..., None].expand(-1, -1, k.shape[-1]))
                static.values[index][:, h, :m] = v.gather(1, order[..., None].expand(-1, -1, v.shape[-1]))
                static.positions[index][:, h, :m] = pos.gather(1, order).to(torch.int32)
        return static

    # ------------------------------------------------------------------ decoding
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states``/``value_states`` ``[batch, kv_heads, q, d]`` at each (row, head)'s
        length, in place, and advance the lengths (on the device). Returns the layer's buffers.

        The room left is not checked here (that would be a host sync): :meth:`reserve` does it
        once per step, before the forward.
        """
        q = key_states.shape[2]
        slots = self.lengths[layer_idx][..., None] + torch.arange(q, device=key_states.device)  # [b, h, q]
        self.keys[layer_idx].scatter_(2, slots[..., None].expand_as(key_states), key_states)
        self.values[layer_idx].scatter_(2, slots[..., None].expand_as(value_states), value_states)
        new_positions = (self.seen[:, None, None] + torch.arange(q, device=key_states.device)).to(torch.int32)
        self.positions[layer_idx].scatter_(2, slots, new_positions.expand_as(slots).contiguous())
        self.lengths[layer_idx].add_(q)
        return self.keys[layer_idx], self.values[layer_idx]

    def reserve(self, q: int = 1) -> None:
        """Account for a forward of ``q`` tokens on the host; raise :class:`CacheFullError` if the
        buffers lack the room (they were sized for ``new_tokens`` more)."""
        if q > self.room:
            raise CacheFullError(
                f"the static cache has room for {self.room} more token(s), asked for {q}: "
                "size it with a larger new_tokens"
            )
        self.room -= q

    def advance(self, q: int = 1) -> None:
        """After a forward of ``q`` tokens: every row has seen ``q`` more (on the device)."""
        self.seen.add_(q)
        self.rope.add_(q)

    # ------------------------------------------------------------------ accounting
    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by the longest row (a host sync; not for use inside a captured step)."""
        return int(self.seen.max())

    def capacity(self, layer_idx: int) -> int:
        return self.keys[layer_idx].shape[2]

    def physical_bytes(self) -> int:
        """Bytes of the key and value buffers (positions and lengths not counted)."""
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size()
            for k, v in zip(self.keys, self.values, strict=True)
        )

    def logical_bytes(self) -> int:
        """Bytes the valid entries occupy (a host sync)."""
        total = 0
        for k, v, n in zip(self.keys, self.values, self.lengths, strict=True):
            per_entry = k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size()
            total += int(n.sum()) * per_entry
        return total

    def padding_bytes(self) -> int:
        """What the padded layout costs beyond holding each head's entries and room exactly."""
        total = 0
        for k, v, n in zip(self.keys, self.values, self.lengths, strict=True):
            per_entry = k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size()
            used = int((n + self.room).clamp(max=k.shape[2]).sum())
            total += (k.shape[0] * k.shape[1] * k.shape[2] - used) * per_entry
        return total
