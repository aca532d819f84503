"""One KV head's entries stored at reduced precision: a quantized prefix and a full-precision tail.

The cache's quantized storage (``BudgetCache(kv_bits=...)``, docs/architecture.md "Quantized
storage"). KIVI (Liu et al., arXiv 2402.02750, §3.2–3.3): keys are quantized per channel over groups
of ``G`` tokens, values per token over groups of ``G`` channels (:mod:`kvbudget.quantization` holds
the formulas), and the most recent tokens stay in full precision until they fill a group: a decode
step appends to the tail, and once the tail holds ``G`` entries they are quantized as one group.

What differs from KIVI, and why: a compression method evicts entries after they are quantized
(decode-stage methods, a sliding window, a rewind), so a key group may lose members. Each quantized
entry therefore records the group its key scale belongs to (``key_group``, ``int16``), and a gather
keeps every kept entry's codes and group; a group's scale row stays while any entry uses it and the
rows no entry uses are dropped once they are half of them. KIVI's groups are always whole because
it never evicts.

All tensors lead with the batch axis ``[b]`` (one KV head of every batch row); entries are in the
layer's order, quantized ones first (the oldest: the tail holds the latest tokens). Objects are never
edited in place: every operation returns a new :class:`QuantizedHead` (a cache's shallow copy shares
them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvbudget.errors import KVBudgetError
from kvbudget.quantization import BITS, pack, quantize_values, round_scale_and_minimum, unpack

#: the default group ``G`` (tokens of a key group, channels of a value group): KIVI's 32
GROUP = 32


def value_group(head_dim: int, group: int) -> int:
    """Channels of a value group: ``group`` when it divides ``head_dim``, else the whole entry."""
    return group if head_dim % group == 0 else head_dim


def check_storable(bits: int, head_dim: int) -> None:
    """One-line error unless entries of ``head_dim`` channels can be stored at ``bits`` bits."""
    if bits not in BITS:
        raise KVBudgetError(f"kv_bits must be one of 2, 4, 8 or 16, got {bits!r}")
    if head_dim % (8 // bits):
        raise KVBudgetError(
            f"heads of {head_dim} channels cannot be packed {8 // bits} codes a byte at {bits} bits"
        )


def quantized_entry_bytes(head_dim: int, bits: int, group: int, scale_bytes: int) -> float:
    """Bytes one quantized entry (a key and a value of ``head_dim`` channels) takes on average: its
    codes, its value group scales and minima, its key group index (``int16``) and its share of its
    key group's scale and minimum rows (``scale_bytes``: the cache dtype's size)."""
    value_groups = head_dim // value_group(head_dim, group)
    return 2 * head_dim * bits / 8 + 2 * value_groups * scale_bytes + 2 + 2 * head_dim * scale_bytes / group


def _group_dtype(groups: int) -> torch.dtype:
    return torch.int16 if groups <= torch.iinfo(torch.int16).max else torch.int32


def _rows_take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t: [b, n, *tail]``, ``idx: [b, k]`` → ``[b, k, *tail]`` by one ``index_select``."""
    b, n = t.shape[:2]
    offsets = (torch.arange(b, device=idx.device) * n).view(b, 1)
    return (
        t.reshape(b * n, *t.shape[2:])
        .index_select(0, (idx + offsets).reshape(-1))
        .view(*idx.shape, *t.shape[2:])
    )


def quantize_key_groups(
    keys: torch.Tensor, group_ids: torch.Tensor, groups: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel quantization of ``keys: [b, n, d]`` whose entry ``i`` of row ``r`` belongs to group
    ``group_ids[r, i]`` (``< groups``), groups of any size: (codes ``uint8 [b, n, d]``, scale and
    minimum ``[b, groups, d]`` in the keys' dtype; a group no entry uses gets 0 and 0)."""
    b, n, d = keys.shape
    levels = (1 << bits) - 1
    x = keys.float()
    index = group_ids.long().unsqueeze(-1).expand(b, n, d)
    low = x.new_full((b, groups, d), math.inf).scatter_reduce(1, index, x, "amin")
    high = x.new_full((b, groups, d), -math.inf).scatter_reduce(1, index, x, "amax")
    unused = torch.isinf(low)
    low, high = low.masked_fill(unused, 0.0), high.masked_fill(unused, 0.0)
    scale, minimum = round_scale_and_minimum(low, high, levels, keys.dtype)
    step = _rows_take(scale.float(), group_ids.long())
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = ((x - _rows_take(minimum.float(), group_ids.long())) / safe).round_().clamp_(0, levels)
    return codes.to(torch.uint8), scale, minimum


@dataclass(frozen=True)
class QuantizedHead:
    """One KV head (every batch row) at ``bits`` bits: ``m`` quantized entries, then ``t`` in full
    precision.

    Attributes:
        key_codes, value_codes: ``uint8 [b, m, d · bits / 8]`` packed codes.
        key_scale, key_min: ``[b, g, d]``, one row per key group (per channel).
        key_group: ``int16 [b, m]`` (``int32`` past 32,767 groups): each entry's key group.
        value_scale, value_min: ``[b, m, d / Gv]``, per token (``Gv``: :func:`value_group`).
        tail_keys, tail_values: ``[b, t, d]`` full-precision entries, ``t < group`` after a flush
            (more only after a gather moved quantized entries of some rows there).
        bits: 2, 4 or 8. group: ``G``.
        whole_groups: every key group holds ``G`` consecutive entries (entry ``i`` in group
            ``i // G``): true until a gather drops entries.
    """

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_min: torch.Tensor
    key_group: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_min: torch.Tensor
    tail_keys: torch.Tensor
    tail_values: torch.Tensor
    bits: int
    group: int
    whole_groups: bool = True

    # ------------------------------------------------------------------ building
    @classmethod
    def empty_like(cls, keys: torch.Tensor, values: torch.Tensor, bits: int, group: int) -> QuantizedHead:
        """No quantized entries, ``keys/values: [b, t, d]`` as the tail."""
        b, _, d = keys.shape
        dv = values.shape[-1]
        check_storable(bits, d)
        check_storable(bits, dv)
        u8 = dict(dtype=torch.uint8, device=keys.device)
        return cls(
            key_codes=torch.empty((b, 0, d * bits // 8), **u8),
            key_scale=keys.new_empty((b, 0, d)),
            key_min=keys.new_empty((b, 0, d)),
            key_group=torch.empty((b, 0), dtype=torch.int16, device=keys.device),
            value_codes=torch.empty((b, 0, dv * bits // 8), **u8),
            value_scale=values.new_empty((b, 0, dv // value_group(dv, group))),
            value_min=values.new_empty((b, 0, dv // value_group(dv, group))),
            tail_keys=keys,
            tail_values=values,
            bits=bits,
            group=group,
        )

    @classmethod
    def from_full(
        cls, keys: torch.Tensor, values: torch.Tensor, bits: int, group: int = GROUP
    ) -> QuantizedHead:
        """``keys/values: [b, n, d]`` stored with every whole group of ``group`` entries quantized and
        the last ``n mod group`` in full precision."""
        return cls.empty_like(keys, values, bits, group).flush()

    # ------------------------------------------------------------------ sizes
    @property
    def quantized_entries(self) -> int:
        return self.key_codes.shape[1]

    @property
    def length(self) -> int:
        return self.quantized_entries + self.tail_keys.shape[1]

    @property
    def batch_size(self) -> int:
        return self.key_codes.shape[0]

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.key_codes, self.key_scale, self.key_min, self.key_group,
            self.value_codes, self.value_scale, self.value_min, self.tail_keys, self.tail_values,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes allocated: codes, scales, minima, key groups and the full-precision tail."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    # ------------------------------------------------------------------ reading
    def dequantize(
        self, dtype: torch.dtype | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[b, n, d]`` and values ``[b, n, dv]`` in ``dtype`` (default: the tail's; ``out``'s
        when given: tensors of those shapes to write into), the quantized entries first.

        Each number is ``code · scale + minimum`` rounded once to ``dtype`` (``addcmul``), written
        straight into the output beside the tail (no concatenation); whole key groups (nothing
        evicted from them) broadcast their scale rows instead of gathering one per entry.
        """
        b, m = self.key_codes.shape[:2]
        t = self.tail_keys.shape[1]
        if out is None:
            dtype = dtype or self.tail_keys.dtype
            keys = self.tail_keys.new_empty((b, m + t, self.tail_keys.shape[-1]), dtype=dtype)
            values = self.tail_values.new_empty((b, m + t, self.tail_values.shape[-1]), dtype=dtype)
        else:
            keys, values = out
            dtype = keys.dtype
        if m:
            self._dequantize_keys(keys[:, :m], dtype)
            self._dequantize_values(values[:, :m], dtype)
        if t:
            keys[:, m:].copy_(self.tail_keys)
            values[:, m:].copy_(self.tail_values)
        return keys, values

    def _dequantize_keys(self, out: torch.Tensor, dtype: torch.dtype) -> None:
        b, m, d = out.shape
        codes = unpack(self.key_codes, self.bits).to(dtype)  # [b, m, d]
        scale, minimum = self.key_scale.to(dtype), self.key_min.to(dtype)
        g = scale.shape[1]
        if g * self.group == m and self.whole_groups:  # entry i in group i // G: broadcast
            shape = (b, g, self.group, d)
            torch.addcmul(minimum.unsqueeze(2), codes.view(shape), scale.unsqueeze(2), out=out.view(shape))
        else:
            groups = self.key_group.long()
            torch.addcmul(_rows_take(minimum, groups), codes, _rows_take(scale, groups), out=out)

    def _dequantize_values(self, out: torch.Tensor, dtype: torch.dtype) -> None:
        b, m, dv = out.shape
        groups_v = self.value_scale.shape[-1]
        shape = (b, m, groups_v, dv // groups_v)
        codes = unpack(self.value_codes, self.bits).to(dtype).view(shape)
        scale, minimum = self.value_scale.to(dtype).unsqueeze(-1), self.value_min.to(dtype).unsqueeze(-1)
        torch.addcmul(minimum, codes, scale, out=out.view(shape))

    def _dequantize_prefix(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantized entries only: keys ``[b, m, d]``, values ``[b, m, dv]``."""
        b, m = self.key_codes.shape[:2]
        keys = self.tail_keys.new_empty((b, m, self.tail_keys.shape[-1]), dtype=dtype)
        values = self.tail_values.new_empty((b, m, self.tail_values.shape[-1]), dtype=dtype)
        self._dequantize_keys(keys, dtype)
        self._dequantize_values(values, dtype)
        return keys, values

    # ------------------------------------------------------------------ editing (each returns a new head)
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> QuantizedHead:
        """``keys/values: [b, q, d]`` appended to the tail, then whole groups quantized."""
        tail_k = torch.cat([self.tail_keys, keys.to(self.tail_keys.dtype)], dim=1)
        tail_v = torch.cat([self.tail_values, values.to(self.tail_values.dtype)], dim=1)
        return replace(self, tail_keys=tail_k, tail_values=tail_v).flush()

    def flush(self) -> QuantizedHead:
        """Quantize the tail's leading whole groups of ``group`` entries (new key groups)."""
        t = self.tail_keys.shape[1]
        whole = t // self.group * self.group
        if whole == 0:
            return self
        k, v = self.tail_keys[:, :whole], self.tail_values[:, :whole]
        b = k.shape[0]
        first = self.key_scale.shape[1]
        local = (torch.arange(whole, device=k.device) // self.group).expand(b, whole)
        codes, scale, minimum = quantize_key_groups(k, local, whole // self.group, self.bits)
        quantized_values = quantize_values(v, self.bits, value_group(v.shape[-1], self.group))
        groups = first + whole // self.group
        key_group = torch.cat(
            [self.key_group.to(_group_dtype(groups)), (local + first).to(_group_dtype(groups))], 1
        )
        return replace(
            self,
            key_codes=torch.cat([self.key_codes, pack(codes, self.bits)], dim=1),
            key_scale=torch.cat([self.key_scale, scale], dim=1),
            key_min=torch.cat([self.key_min, minimum], dim=1),
            key_group=key_group,
            value_codes=torch.cat([self.value_codes, quantized_values.packed], dim=1),
            value_scale=torch.cat([self.value_scale, quantized_values.scale], dim=1),
            value_min=torch.cat([self.value_min, quantized_values.minimum], dim=1),
            tail_keys=self.tail_keys[:, whole:],
            tail_values=self.tail_values[:, whole:],
        )

    def take(self, idx: torch.Tensor) -> QuantizedHead:
        """Entries ``idx: [b, k]`` (int64 indices into each row, quantized entries first then tail
        ones: the order positions keep) as a new head.

        The first ``k'`` columns, where every row names a quantized entry, stay quantized (codes and
        key groups gathered, nothing re-quantized); the rest go to the tail in full precision
        (a row's later quantized entries dequantized: no precision is lost). Key scale rows that no
        entry uses any more are dropped once they are at least half of them.
        """
        m = self.quantized_entries
        b, k = idx.shape
        quantized = (idx < m).long().cumprod(-1).sum(-1)  # leading quantized columns per row
        lead = int(quantized.min()) if b else 0
        head_idx, rest = idx[:, :lead], idx[:, lead:]
        taken = replace(
            self,
            key_codes=_rows_take(self.key_codes, head_idx),
            key_group=_rows_take(self.key_group, head_idx),
            value_codes=_rows_take(self.value_codes, head_idx),
            value_scale=_rows_take(self.value_scale, head_idx),
            value_min=_rows_take(self.value_min, head_idx),
            whole_groups=self.whole_groups
            and bool((head_idx == torch.arange(lead, device=idx.device)).all()),
        )
        if rest.shape[1] == 0:
            tail_k, tail_v = self.tail_keys[:, :0], self.tail_values[:, :0]
        elif bool((rest >= m).all()):
            tail_k, tail_v = _rows_take(self.tail_keys, rest - m), _rows_take(self.tail_values, rest - m)
        else:  # some rows keep later quantized entries: read them back into the tail
            keys, values = self.dequantize()
            tail_k, tail_v = _rows_take(keys, rest), _rows_take(values, rest)
        return replace(taken, tail_keys=tail_k, tail_values=tail_v).compact()

    def compact(self) -> QuantizedHead:
        """Drop key scale rows no entry uses once they are at least half of the rows."""
        g = self.key_scale.shape[1]
        if g == 0:
            return self
        used = torch.zeros((self.batch_size, g), dtype=torch.bool, device=self.key_group.device)
        used.scatter_(1, self.key_group.long(), True)
        if int(used.sum(-1).max()) * 2 > g:
            return self
        keep = int(used.sum(-1).max())
        order = torch.argsort((~used).to(torch.int8), dim=1, stable=True)[:, :keep]  # used rows first
        new_id = torch.full_like(used, 0, dtype=torch.long)
        new_id.scatter_(1, order, torch.arange(keep, device=order.device).expand_as(order))
        return replace(
            self,
            key_scale=_rows_take(self.key_scale, order),
            key_min=_rows_take(self.key_min, order),
            key_group=_rows_take(new_id, self.key_group.long()).to(_group_dtype(keep)),
            whole_groups=False,
        )

    def replaced(self, keys: torch.Tensor, values: torch.Tensor) -> QuantizedHead:
        """The head holding ``keys/values: [b, n, d]`` (a method rewrote some entries: a merge).

        Entries equal to what :meth:`dequantize` gives keep their codes; a changed value is
        re-quantized with its own token's groups, a changed key with the key groups it belongs to
        (every member of such a group gets codes against the group's new range); tail entries are
        taken as they are.
        """
        m = self.quantized_entries
        if keys.shape[:2] != (self.batch_size, self.length):
            raise KVBudgetError(f"cannot store {keys.shape[1]} entries in a quantized head of {self.length}")
        old_k, old_v = self._dequantize_prefix(keys.dtype)
        new_k, new_v = keys[:, :m], values[:, :m]
        head = replace(self, tail_keys=keys[:, m:], tail_values=values[:, m:])
        changed_v = (new_v != old_v).any(-1)  # [b, m]
        if bool(changed_v.any()):
            requantized = quantize_values(new_v, self.bits, value_group(new_v.shape[-1], self.group))
            pick = changed_v.unsqueeze(-1)
            head = replace(
                head,
                value_codes=torch.where(pick, requantized.packed, self.value_codes),
                value_scale=torch.where(pick, requantized.scale, self.value_scale),
                value_min=torch.where(pick, requantized.minimum, self.value_min),
            )
        changed_k = (new_k != old_k).any(-1)
        if bool(changed_k.any()):
            g = self.key_scale.shape[1]
            groups = self.key_group.long()
            counts = torch.zeros((self.batch_size, g), dtype=torch.long, device=groups.device)
            touched = counts.scatter_add_(1, groups, changed_k.long()) > 0  # [b, g]: groups to re-quantize
            codes, scale, minimum = quantize_key_groups(new_k, groups, g, self.bits)
            member = _rows_take(touched.unsqueeze(-1), groups)  # [b, m, 1]
            head = replace(
                head,
                key_codes=torch.where(member, pack(codes, self.bits), self.key_codes),
                key_scale=torch.where(touched.unsqueeze(-1), scale, self.key_scale),
                key_min=torch.where(touched.unsqueeze(-1), minimum, self.key_min),
            )
        return head

    def grown_nbytes(self, tokens: int) -> int:
        """An upper bound of :attr:`nbytes` once ``tokens`` more entries are appended: each at its
        quantized size, a whole group's key scale rows extra, and a full tail."""
        b, d = self.batch_size, self.tail_keys.shape[-1]
        elt = self.tail_keys.element_size()
        per_entry = quantized_entry_bytes(d, self.bits, self.group, elt)
        extra = b * (tokens * per_entry + 2 * d * elt + self.group * 2 * d * elt)
        return self.nbytes + math.ceil(extra)

    def map_batch(self, fn: Any) -> QuantizedHead:
        """Apply ``fn`` (a batch-axis operation: select, reorder, repeat) to every tensor."""
        names = ("key_codes", "key_scale", "key_min", "key_group", "value_codes", "value_scale",
                 "value_min", "tail_keys", "tail_values")  # fmt: skip
        return replace(self, **{name: fn(getattr(self, name)) for name in names})


def pack_all(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int = GROUP) -> QuantizedHead:
    """``keys/values: [b, n, d]`` all quantized (the last key group may hold fewer than ``group``
    entries), no tail: a byte budget's tier, whose bytes are :func:`segment_bytes`."""
    head = QuantizedHead.empty_like(keys, values, bits, group)
    b, n, _ = keys.shape
    if n == 0:
        return head
    local = (torch.arange(n, device=keys.device) // group).expand(b, n)
    groups = -(-n // group)
    codes, scale, minimum = quantize_key_groups(keys, local, groups, bits)
    quantized_values = quantize_values(values, bits, value_group(values.shape[-1], group))
    return replace(
        head,
        key_codes=pack(codes, bits),
        key_scale=scale,
        key_min=minimum,
        key_group=local.to(_group_dtype(groups)),
        value_codes=quantized_values.packed,
        value_scale=quantized_values.scale,
        value_min=quantized_values.minimum,
        tail_keys=keys[:, :0],
        tail_values=values[:, :0],
        whole_groups=n % group == 0,
    )


def segment_bytes(n: int, bits: int, head_dim: int, group: int, scale_bytes: int) -> int:
    """Bytes of :func:`pack_all` over ``n`` entries of one batch row: codes, value scales and minima,
    key group indices and ``⌈n / group⌉`` key scale and minimum rows."""
    value_groups = head_dim // value_group(head_dim, group)
    per_entry = 2 * head_dim * bits // 8 + 2 * value_groups * scale_bytes + 2
    return n * per_entry + -(-n // group) * 2 * head_dim * scale_bytes


@dataclass(frozen=True)
class TieredHead:
    """One KV head (one batch row) at two precisions: ``high`` (the method's highest-ranked kept
    entries, all quantized at ``high.bits``), then ``low`` (the rest at ``low.bits``, its tail the
    full-precision latest tokens). The same interface as :class:`QuantizedHead`; entries are in
    slot order, ``high``'s first."""

    high: QuantizedHead
    low: QuantizedHead

    @property
    def bits(self) -> int:
        return self.low.bits

    @property
    def group(self) -> int:
        return self.low.group

    @property
    def length(self) -> int:
        return self.high.length + self.low.length

    @property
    def quantized_entries(self) -> int:
        return self.high.length + self.low.quantized_entries

    @property
    def batch_size(self) -> int:
        return self.low.batch_size

    @property
    def tail_keys(self) -> torch.Tensor:
        return self.low.tail_keys

    @property
    def tail_values(self) -> torch.Tensor:
        return self.low.tail_values

    @property
    def nbytes(self) -> int:
        return self.high.nbytes + self.low.nbytes

    def dequantize(
        self, dtype: torch.dtype | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if out is None:
            b, d, dv = self.batch_size, self.tail_keys.shape[-1], self.tail_values.shape[-1]
            dtype = dtype or self.tail_keys.dtype
            out = (self.tail_keys.new_empty((b, self.length, d), dtype=dtype),
                   self.tail_values.new_empty((b, self.length, dv), dtype=dtype))  # fmt: skip
        m = self.high.length
        self.high.dequantize(out=(out[0][:, :m], out[1][:, :m]))
        self.low.dequantize(out=(out[0][:, m:], out[1][:, m:]))
        return out

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> TieredHead:
        return replace(self, low=self.low.append(keys, values))

    def take(self, idx: torch.Tensor) -> TieredHead:
        """``idx: [1, k]`` sorted slot indices (one batch row: a byte budget serves one sequence)."""
        m = self.high.length
        split = int((idx < m).sum())
        return TieredHead(self.high.take(idx[:, :split]), self.low.take(idx[:, split:] - m))

    def replaced(self, keys: torch.Tensor, values: torch.Tensor) -> TieredHead:
        m = self.high.length
        return TieredHead(
            self.high.replaced(keys[:, :m], values[:, :m]), self.low.replaced(keys[:, m:], values[:, m:])
        )

    def grown_nbytes(self, tokens: int) -> int:
        return self.high.nbytes + self.low.grown_nbytes(tokens)

    def map_batch(self, fn: Any) -> TieredHead:
        return TieredHead(self.high.map_batch(fn), self.low.map_batch(fn))
