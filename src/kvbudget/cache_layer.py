"""BudgetLayer: one decoder layer's compressed KV store, rectangular or per KV head, at full or
reduced precision (the layouts: :mod:`kvbudget.cache`'s docstring; docs/architecture.md §3)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvbudget.cache_storage import Storage, allocated_bytes, take, tensor_bytes
from kvbudget.errors import KVBudgetError
from kvbudget.quantized_store import GROUP, QuantizedHead


class BudgetLayer(DynamicLayer):
    """One decoder layer's compressed KV store (see the module docstring for the layouts).

    Attributes:
        seen: tokens this layer has seen (logical length, left pads included).
        keys, values: ``[batch, kv_heads, n, head_dim]`` in the rectangular layout, else ``None``.
        head_keys, head_values: lists of ``[batch, n_h, head_dim]`` in the per-head layout, else ``None``.
        positions: ``[batch, kv_heads, n]`` (rectangular) or a list of ``[batch, n_h]`` (per head);
            logical index of each entry, ``-1`` for invalid slots.
        state: per-entry method state, same layout as ``positions`` (float or integer tensors).
        quant: per KV head, the entries stored at reduced precision (:class:`QuantizedHead`), or
            ``None``. A quantized layer keeps its positions and state as before (rectangular while
            every head holds as many entries); its ``keys``/``values``/``head_keys``/``head_values``
            and :meth:`head` then read dequantized copies made on each access, and assigning them
            (a decode-time merge) re-quantizes only the entries that changed.
    """

    def __init__(self) -> None:
        self.quant: list[QuantizedHead] | None = None
        self._head_keys: list[torch.Tensor] | None = None
        self._head_values: list[torch.Tensor] | None = None
        super().__init__()
        self.seen = 0
        self.positions: torch.Tensor | list[torch.Tensor] | None = None
        self.state: dict[str, Any] = {}
        self.has_invalid = False
        #: the layer's sliding window (``None`` = global attention) and attention logit soft-cap, as
        #: the model passed them to the ``kvbudget`` attention
        self.sliding_window: int | None = None
        self.softcap: float | None = None
        self._storage: Storage | None = None
        self._head_storage: list[Storage] | None = None

    # ------------------------------------------------------------------ key and value views
    def rectangular(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, kv_heads, n, head_dim]`` of a rectangular layer: its tensors, or
        a quantized layer's dequantized into one pair of tensors (what attention reads at once)."""
        if self.quant is None:
            return self._keys, self._values
        first = self.quant[0]
        b, n, h = first.batch_size, first.length, len(self.quant)
        keys = first.tail_keys.new_empty((b, h, n, first.tail_keys.shape[-1]))
        values = first.tail_values.new_empty((b, h, n, first.tail_values.shape[-1]))
        for i, head in enumerate(self.quant):
            head.dequantize(out=(keys[:, i], values[:, i]))
        return keys, values

    @property
    def keys(self) -> torch.Tensor | None:
        """``[batch, kv_heads, n, head_dim]`` in the rectangular layout, else ``None``."""
        if self.quant is None:
            return self._keys
        return None if self.is_ragged else self.rectangular()[0]

    @keys.setter
    def keys(self, keys: torch.Tensor | None) -> None:
        if self.quant is None:
            self._keys = keys
        else:
            self._replace_quantized(list(keys.unbind(1)), None)

    @property
    def values(self) -> torch.Tensor | None:
        if self.quant is None:
            return self._values
        return None if self.is_ragged else self.rectangular()[1]

    @values.setter
    def values(self, values: torch.Tensor | None) -> None:
        if self.quant is None:
            self._values = values
        else:
            self._replace_quantized(None, list(values.unbind(1)))

    @property
    def head_keys(self) -> list[torch.Tensor] | None:
        """Per KV head ``[batch, n_h, head_dim]`` in the per-head layout, else ``None``."""
        if self.quant is None:
            return self._head_keys
        return [h.dequantize()[0] for h in self.quant] if self.is_ragged else None

    @head_keys.setter
    def head_keys(self, keys: list[torch.Tensor] | None) -> None:
        if self.quant is None:
            self._head_keys = keys
        else:
            self._replace_quantized(keys, None)

    @property
    def head_values(self) -> list[torch.Tensor] | None:
        if self.quant is None:
            return self._head_values
        return [h.dequantize()[1] for h in self.quant] if self.is_ragged else None

    @head_values.setter
    def head_values(self, values: list[torch.Tensor] | None) -> None:
        if self.quant is None:
            self._head_values = values
        else:
            self._replace_quantized(None, values)

    def _replace_quantized(self, keys: list[torch.Tensor] | None, values: list[torch.Tensor] | None) -> None:
        """Store per-head ``keys``/``values`` ``[b, n_h, d]`` (``None``: unchanged) in a quantized
        layer, re-quantizing the entries that differ from what is stored."""
        heads = []
        for h, stored in enumerate(self.quant):
            old_k, old_v = stored.dequantize()
            heads.append(
                stored.replaced(old_k if keys is None else keys[h], old_v if values is None else values[h])
            )
        self.quant = heads

    def quantize(self, bits: int, group: int = GROUP) -> None:
        """Store the layer's entries at ``bits`` bits from now on (KIVI groups of ``group``; see
        :mod:`kvbudget.quantized_store`): every whole group quantized, the rest a full-precision
        tail that decode steps fill. Positions and state stay as they are. A no-op if already
        quantized (at any precision) or empty."""
        if self.quant is not None or not self.is_initialized:
            return
        heads = []
        for h in range(self.num_heads):
            k, v, _ = self.head(h)
            heads.append(QuantizedHead.from_full(k, v, bits, group))
        self.install_quantized(heads)

    def install_quantized(self, heads: list[Any]) -> None:
        """Store the layer's entries as ``heads`` (one quantized store per KV head, holding the entries
        the layer holds now, in its order): its full-precision tensors are released."""
        self._keys = self._values = self._head_keys = self._head_values = None
        self._release_storage()
        self.quant = heads

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.keys = key_states.new_empty((b, h, 0, d))
        self.values = value_states.new_empty((b, h, 0, value_states.shape[-1]))
        self.positions = torch.empty((b, h, 0), dtype=torch.long, device=self.device)
        self._release_storage()
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[batch, kv_heads, q, head_dim]`` (post-RoPE).

        New entries get positions ``seen .. seen + q − 1``, unless the prune stage passes
        ``slots=[batch, q]`` (the tokens' slots in the prompt, ``-1`` for pads) and ``seen`` (the
        logical length after them): deeper layers of a pruned prefill see fewer tokens than the prompt.
        ``first_fill_room=False`` stores a first fill exactly (see :meth:`Storage.append`).

        Returns the rectangular keys and values (what any attention function expects). In the
        per-head layout there is no rectangular tensor: empty placeholders are returned, and only
        the ``kvbudget`` attention (which reads the layer itself) can serve the layer.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        slots = kwargs.get("slots")
        if slots is None:
            new_pos = torch.arange(self.seen, self.seen + q, device=key_states.device).expand(b, q)
            self.seen += q
        else:  # a pruned prefill: the tokens' own slots in the prompt, which this layer saw whole
            new_pos = slots.to(key_states.device)
            self.seen = int(kwargs["seen"])
            self.has_invalid = self.has_invalid or bool((new_pos < 0).any())
        if self.quant is not None:
            self._append_quantized(key_states, value_states, new_pos)
            empty = key_states.new_empty((b, h, 0, key_states.shape[-1]))
            return empty, empty
        if self.is_ragged:
            self._append_per_head(key_states, value_states, new_pos)
            for name, per_head in self.state.items():
                self.state[name] = [torch.cat([s, s.new_zeros(b, q)], dim=1) for s in per_head]
            empty = key_states.new_empty((b, h, 0, key_states.shape[-1]))
            return empty, empty
        positions = new_pos[:, None, :].expand(b, h, q)
        self._append_rectangular(key_states, value_states, positions, kwargs.get("first_fill_room", True))
        for name, s in self.state.items():
            self.state[name] = torch.cat([s, s.new_zeros(b, h, q)], dim=-1)
        return self.keys, self.values

    def _append_rectangular(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, first_fill_room: bool = True
    ) -> None:
        """Append ``[b, h, q, d]`` keys/values and ``[b, h, q]`` positions to the rectangular layout.

        The layer's tensors are views of storage it owns (:class:`Storage`) with room to append in
        place: a decode step writes one slot instead of copying the whole layer (``torch.cat`` of a
        long cache costs a full copy plus fresh pages every step). Storage shared with a
        :meth:`shallow_copy` is never written: the copy allocates its own on its first append.
        """
        old = (self.keys, self.values, self.positions)
        self._storage, (self.keys, self.values, self.positions) = Storage.append(
            self, self._storage, old, (keys, values, positions), first_fill_room
        )

    def _append_quantized(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Append ``[b, h, q, d]`` keys/values and ``[b, q]`` positions to a quantized layer: each
        head's full-precision tail takes them (and quantizes whole groups); positions and state
        grow as in the layer's layout."""
        b, h, q, _ = keys.shape
        self.quant = [head.append(keys[:, i], values[:, i]) for i, head in enumerate(self.quant)]
        if self.is_ragged:
            self.positions = [torch.cat([p, positions], dim=1) for p in self.positions]
            self.state = {
                n: [torch.cat([s, s.new_zeros(b, q)], dim=1) for s in v] for n, v in self.state.items()
            }
        else:
            self.positions = torch.cat([self.positions, positions[:, None, :].expand(b, h, q)], dim=-1)
            self.state = {n: torch.cat([s, s.new_zeros(b, h, q)], dim=-1) for n, s in self.state.items()}

    def _append_per_head(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Append ``[b, h, q, d]`` keys/values and ``[b, q]`` positions to every KV head of the
        per-head layout, each head in place in storage of its own (as :meth:`_append_rectangular`).

        New lists are built: a :meth:`shallow_copy` shares the old ones.
        """
        h = len(self.head_keys)
        storages = self._head_storage if self._head_storage is not None else [None] * h
        new_storages, head_keys, head_values, head_positions = [], [], [], []
        for i in range(h):
            old = (self.head_keys[i], self.head_values[i], self.positions[i])
            new = (keys[:, i], values[:, i], positions)
            storage, (k, v, p) = Storage.append(self, storages[i], old, new)
            new_storages.append(storage)
            head_keys.append(k)
            head_values.append(v)
            head_positions.append(p)
        self._head_storage = new_storages
        self.head_keys, self.head_values, self.positions = head_keys, head_values, head_positions

    def get_seq_length(self) -> int:
        """Logical length: tokens seen, not tokens stored."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Physical key length after appending ``query_length`` tokens, and the logical offset."""
        kv_length = self.physical_length + query_length
        return kv_length, self.seen - self.physical_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.quant = None
        self.keys = self.values = None
        self.head_keys = self.head_values = None
        self.positions = None
        self.state = {}
        self.seen = 0
        self.has_invalid = False
        self.is_initialized = False
        self._release_storage()

    def crop(self, tokens_to_remove: int) -> None:
        raise KVBudgetError("BudgetCache layers cannot be cropped: their entries are not a contiguous prefix")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    # ------------------------------------------------------------------ layout helpers
    @property
    def is_ragged(self) -> bool:
        if self.quant is not None:
            return isinstance(self.positions, list)
        return self._head_keys is not None

    @property
    def num_heads(self) -> int:
        if self.quant is not None:
            return len(self.quant)
        return len(self._head_keys) if self.is_ragged else self._keys.shape[1]

    @property
    def batch_size(self) -> int:
        if self.quant is not None:
            return self.quant[0].batch_size
        return self._head_keys[0].shape[0] if self.is_ragged else self._keys.shape[0]

    @property
    def physical_length(self) -> int:
        """Longest stored head (the per-head layout's heads may be shorter)."""
        if not self.is_initialized:
            return 0
        if self.quant is not None:
            return max(head.length for head in self.quant)
        if self.is_ragged:
            return max(k.shape[1] for k in self._head_keys)
        return self._keys.shape[-2]

    def shallow_copy(self) -> BudgetLayer:
        """A layer sharing this layer's tensors (compression never edits tensors in place)."""
        layer = BudgetLayer()
        layer.__dict__.update(self.__dict__)
        layer.state = dict(self.state)
        return layer

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys ``[b, n_h, d]``, values ``[b, n_h, d]`` and positions ``[b, n_h]`` of KV head ``h``
        (a quantized layer's dequantized)."""
        if self.quant is not None:
            keys, values = self.quant[h].dequantize()
            return keys, values, self.positions[h] if self.is_ragged else self.positions[:, h]
        if self.is_ragged:
            return self.head_keys[h], self.head_values[h], self.positions[h]
        return self.keys[:, h], self.values[:, h], self.positions[:, h]

    def head_state(self, name: str, h: int) -> torch.Tensor:
        s = self.state[name]
        return s[h] if self.is_ragged else s[:, h]

    def head_lengths(self) -> torch.Tensor:
        """Valid entries per batch row and KV head: ``[batch, kv_heads]`` (int64)."""
        if not self.has_invalid:  # every slot is valid: the lengths are the shapes
            if self.is_ragged:
                lengths = [[p.shape[1] for p in self.positions]] * self.batch_size
                return torch.tensor(lengths, dtype=torch.long, device=self.positions[0].device)
            b, h, n = self.positions.shape
            return torch.full((b, h), n, dtype=torch.long, device=self.positions.device)
        if self.is_ragged:
            return torch.stack([(p >= 0).sum(-1) for p in self.positions], dim=1)
        return (self.positions >= 0).sum(-1)

    def _release_storage(self) -> None:
        """Forget the append storage: called whenever the layer's tensors are replaced, so the old
        (often much longer) storage is freed with them."""
        self._storage = self._head_storage = None

    def _map_batch(self, fn: Any) -> None:
        if not self.is_initialized:
            return
        self._release_storage()
        if self.quant is not None:
            self.quant = [head.map_batch(fn) for head in self.quant]
            if self.is_ragged:
                self.positions = [fn(p) for p in self.positions]
                self.state = {k: [fn(t) for t in v] for k, v in self.state.items()}
            else:
                self.positions, self.state = fn(self.positions), {k: fn(v) for k, v in self.state.items()}
        elif self.is_ragged:
            self._map_heads(fn)
        else:
            self.keys, self.values, self.positions = fn(self.keys), fn(self.values), fn(self.positions)
            self.state = {k: fn(v) for k, v in self.state.items()}

    def _index_batch(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t.index_select(0, indices.to(t.device)))

    # ------------------------------------------------------------------ editing
    def init_state(self, name: str) -> None:
        """Create a zero-filled per-entry state tensor ``name`` (no-op if it exists)."""
        if name in self.state:
            return
        if self.is_ragged:
            self.state[name] = [
                torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.positions
            ]
        else:
            self.state[name] = torch.zeros(
                self.positions.shape, dtype=torch.float32, device=self.positions.device
            )

    def invalidate_new_tokens(self, new_token_valid: torch.Tensor) -> None:
        """Mark the last ``q`` appended tokens invalid where ``new_token_valid: [batch, q]`` is False."""
        q = new_token_valid.shape[1]
        invalid = ~new_token_valid.to(torch.bool)
        if not bool(invalid.any()):
            return
        self.has_invalid = True
        if self.is_ragged:
            for p in self.positions:
                p[:, -q:].masked_fill_(invalid, -1)
        else:
            self.positions[:, :, -q:].masked_fill_(invalid[:, None, :], -1)

    def drop_outside_window(self, slack: int = 1) -> int:
        """Drop entries no later query can see: those at positions ``≤ seen − sliding_window`` (the
        next token is at position ``seen``), invalid slots with them.

        Entries are stored in position order, so the droppable ones lead each head. The layout is
        kept: every head (of every batch row) drops the same number of leading entries — the fewest
        any head of the layer can drop (per head in the per-head layout) — so a rectangular layer
        stays rectangular for the methods that need it. Nothing happens before ``slack`` entries can
        go. Returns the entries the fullest-dropping head lost (0: nothing done). A global layer
        (``sliding_window is None``) is left alone.
        """
        window = self.sliding_window
        if window is None or not self.is_initialized or self.seen - window < 0:
            return 0
        limit = self.seen - window
        heads = self.positions if self.is_ragged else list(self.positions.unbind(1))
        # leading run of droppable slots per row, then the fewest over rows: [heads]
        leads = [int((p <= limit).long().cumprod(-1).sum(-1).min()) for p in heads]
        drop = leads if self.is_ragged else [min(leads)] * len(heads)
        if max(drop) < slack or max(drop) == 0:
            return 0
        b = self.batch_size
        device = heads[0].device
        kept = [torch.arange(d, p.shape[-1], device=device) for d, p in zip(drop, heads, strict=True)]
        self.keep([kept for _ in range(b)])
        return max(drop)

    def drop_last(self, count: int) -> None:
        """Forget the last ``count`` appended tokens (undo decode steps nothing has trimmed since).

        Only trailing slots can go: every head's last ``count`` slots must hold the logical
        positions ``seen - count … seen - 1`` (or be invalid), otherwise ``KVBudgetError``.
        """
        if count <= 0 or not self.is_initialized:
            return
        heads = self.positions if self.is_ragged else list(self.positions.unbind(1))
        expected = torch.arange(self.seen - count, self.seen, device=heads[0].device)
        for p in heads:
            tail = p[:, -count:]
            if tail.shape[1] < count or not bool(((tail == expected) | (tail < 0)).all()):
                raise KVBudgetError(
                    f"cannot drop the last {count} tokens: they are no longer the layer's trailing entries"
                )
        if self.quant is not None:
            seen = self.seen
            self.keep([[torch.arange(p.shape[1] - count, device=p.device) for p in heads]] * self.batch_size)
            self.seen = seen - count
            return
        if self.is_ragged:
            self._map_heads(lambda t: t[:, :-count])
        else:
            self.keys, self.values = self.keys[:, :, :-count], self.values[:, :, :-count]
            self.positions = self.positions[:, :, :-count]
            self.state = {name: s[:, :, :-count] for name, s in self.state.items()}
        self.seen -= count

    def rewind(self, length: int) -> None:
        """Forget every token from logical position ``length`` on: entries at positions ``≥ length``
        leave (wherever a method kept them), and ``seen`` becomes ``length``.

        What a later request on the same prefix starts from: e.g. a context compressed while its
        first question was in view, without that question. Entries are stored in position order,
        so each head keeps a leading run. ``length`` must be in ``[0, seen]``.
        """
        if not 0 <= length <= self.seen:
            raise KVBudgetError(f"cannot rewind to {length} tokens: the layer has seen {self.seen}")
        if not self.is_initialized or length == self.seen:
            return
        heads = self.positions if self.is_ragged else list(self.positions.unbind(1))
        b = self.batch_size
        self.keep([[(heads[h][r] >= 0).logical_and(heads[h][r] < length).nonzero().squeeze(-1)
                    for h in range(len(heads))] for r in range(b)])  # fmt: skip
        self.seen = length

    def _map_heads(self, fn: Any) -> None:
        """Apply ``fn`` to every per-head tensor of the per-head layout."""
        self.head_keys = [fn(t) for t in self.head_keys]
        self.head_values = [fn(t) for t in self.head_values]
        self.positions = [fn(t) for t in self.positions]
        self.state = {k: [fn(t) for t in v] for k, v in self.state.items()}

    def keep(self, keep_indices: list[list[torch.Tensor]]) -> None:
        """Keep only the given entries.

        Args:
            keep_indices: ``keep_indices[row][h]`` is a 1-D int64 tensor of slot indices into head
                ``h`` of batch row ``row``, in the order to store them (callers sort by position).

        Heads of equal length over all rows are stored rectangular; otherwise one tensor per head,
        each padded across batch rows to its longest row (pads get position ``-1``).
        """
        b, h = len(keep_indices), self.num_heads
        counts = [[int(keep_indices[r][i].numel()) for i in range(h)] for r in range(b)]
        if self.quant is None and not self.is_ragged and len({c for row in counts for c in row}) == 1:
            self._keep_rectangular(torch.stack([torch.stack(row) for row in keep_indices]))
            return
        head_len = [max(counts[r][i] for r in range(b)) for i in range(h)]
        new_k, new_v, new_p = [], [], []
        new_state: dict[str, list[torch.Tensor]] = {name: [] for name in self.state}
        padded = False
        new_quant: list[QuantizedHead] = []
        for i in range(h):
            p_i = self.positions[i] if self.is_ragged else self.positions[:, i]
            device = p_i.device
            n = head_len[i]
            if b == 1:  # nothing to pad
                idx, ok = keep_indices[0][i].to(device).view(1, n), None
            else:
                idx = torch.zeros((b, n), dtype=torch.long, device=device)
                ok = torch.zeros((b, n), dtype=torch.bool, device=device)
                for r in range(b):
                    c = counts[r][i]
                    idx[r, :c] = keep_indices[r][i].to(device)
                    ok[r, :c] = True
                padded = padded or not bool(ok.all())
            if self.quant is not None:
                new_quant.append(self.quant[i].take(idx))
            else:
                k_i, v_i, _ = self.head(i)
                new_k.append(take(k_i, idx))
                new_v.append(take(v_i, idx))
            kept_positions = take(p_i, idx)
            new_p.append(kept_positions if ok is None else kept_positions.masked_fill(~ok, -1))
            for name in self.state:
                new_state[name].append(take(self.head_state(name, i), idx))
        if self.quant is not None:
            self._store_quantized(new_quant, new_p, new_state)
        else:
            self._store(new_k, new_v, new_p, new_state)
        self.has_invalid = padded or any(bool((p < 0).any()) for p in new_p)

    def _keep_rectangular(self, idx: torch.Tensor) -> None:
        """Fast path of :meth:`keep`: every row and head keeps as many entries; ``idx: [b, h, k]``."""
        idx = idx.to(self.keys.device)
        self._release_storage()
        self.keys = take(self.keys, idx)
        self.values = take(self.values, idx)
        self.positions = take(self.positions, idx)
        self.state = {name: take(s, idx) for name, s in self.state.items()}
        self.has_invalid = bool((self.positions < 0).any())

    def _store(
        self,
        head_keys: list[torch.Tensor],
        head_values: list[torch.Tensor],
        head_positions: list[torch.Tensor],
        head_state: dict[str, list[torch.Tensor]],
    ) -> None:
        """Store per-head tensors, rectangular when every head has the same length."""
        self._release_storage()
        if len({k.shape[1] for k in head_keys}) == 1:
            self.keys = torch.stack(head_keys, dim=1)
            self.values = torch.stack(head_values, dim=1)
            self.positions = torch.stack(head_positions, dim=1)
            self.state = {name: torch.stack(v, dim=1) for name, v in head_state.items()}
            self.head_keys = self.head_values = None
        else:
            self.keys = self.values = None
            self.head_keys, self.head_values = head_keys, head_values
            self.positions = head_positions
            self.state = head_state

    def _store_quantized(
        self,
        heads: list[QuantizedHead],
        head_positions: list[torch.Tensor],
        head_state: dict[str, list[torch.Tensor]],
    ) -> None:
        """Store quantized heads with their positions and state, rectangular when every head has the
        same length."""
        self.quant = heads
        if len({p.shape[1] for p in head_positions}) == 1:
            self.positions = torch.stack(head_positions, dim=1)
            self.state = {name: torch.stack(v, dim=1) for name, v in head_state.items()}
        else:
            self.positions, self.state = head_positions, head_state

    # ------------------------------------------------------------------ accounting
    def logical_entries(self) -> torch.Tensor:
        """Valid entries per KV head summed over the batch: ``[kv_heads]``."""
        return self.head_lengths().sum(0)

    def physical_bytes(self) -> int:
        """Bytes allocated for this layer's keys and values (with the unused room of storage it owns)."""
        if not self.is_initialized:
            return 0
        if self.quant is not None:
            return sum(head.nbytes for head in self.quant)
        if not self.is_ragged:
            return allocated_bytes(self._storage, self, (self.keys, self.values, self.positions))
        storages = self._head_storage or [None] * len(self.head_keys)
        heads = zip(self.head_keys, self.head_values, self.positions, strict=True)
        return sum(
            allocated_bytes(storage, self, views) for storage, views in zip(storages, heads, strict=True)
        )

    def held_bytes(self) -> int:
        """Bytes of the key/value entries the layer holds (pads included): what attention reads."""
        if not self.is_initialized:
            return 0
        if self.quant is not None:
            return sum(head.nbytes for head in self.quant)
        if self.is_ragged:
            return sum(
                tensor_bytes(k) + tensor_bytes(v)
                for k, v in zip(self.head_keys, self.head_values, strict=True)
            )
        return tensor_bytes(self.keys) + tensor_bytes(self.values)

    def metadata_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        tensors = list(self.positions) if self.is_ragged else [self.positions]
        for s in self.state.values():
            tensors += list(s) if isinstance(s, list) else [s]
        return sum(tensor_bytes(t) for t in tensors)

    def entry_bytes(self) -> int:
        """Bytes of one full-precision entry (key + value of one token in one head)."""
        if self.quant is not None:
            head = self.quant[0]
            return (head.tail_keys.shape[-1] + head.tail_values.shape[-1]) * head.tail_keys.element_size()
        k = self._head_keys[0] if self.is_ragged else self._keys
        v = self._head_values[0] if self.is_ragged else self._values
        return (k.shape[-1] + v.shape[-1]) * k.element_size()

    def stored_bytes(self) -> int:
        """Bytes of the valid entries at the precision they are stored in: entries × full-precision
        entry bytes, or a quantized layer's allocated bytes (scales included) times the share of its
        slots that are valid."""
        entries = int(self.logical_entries().sum())
        if self.quant is None:
            return entries * self.entry_bytes()
        slots = sum(head.length for head in self.quant) * self.batch_size
        return round(self.physical_bytes() * entries / max(1, slots))
