"""KIVI-style KV quantization: asymmetric min–max groups, 8/4/2-bit codes packed into bytes.

KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv
2402.02750, §3): a group of ``G`` values ``x`` is stored as integer codes
``c = clamp(round((x − m) / s), 0, 2^b − 1)`` with ``m = min(x)`` and ``s = (max(x) − m) / (2^b − 1)``,
and read back as ``c · s + m``; the error is at most ``s / 2``. Here ``s`` and ``m`` are stored in
the input's dtype, ``m`` rounded down and ``s`` up, and the codes are computed against the stored
pair: the bound holds for the stored ``s``. Keys are quantized **per channel**
(a group is ``G`` consecutive tokens of one channel: keys have outlier channels) and values **per
token** (a group is ``G`` consecutive channels of one token). A group of equal values has ``s = 0``:
its codes are 0 and it reads back exactly.

Codes are packed little-end first into ``uint8``: ``8 // b`` codes a byte (two 4-bit codes, four
2-bit ones) along the last axis, so the bytes really allocated are ``n · d · b / 8`` plus the
scales and minima, which are kept in the input's dtype (bf16 for a bf16 cache: KIVI keeps them in
fp16; bf16's 8-bit significand makes a stored step up to 0.8% wider than the exact one).
:attr:`Quantized.nbytes` counts all three.

Shapes: :func:`quantize_keys` takes ``[*lead, n, d]`` with ``n`` a multiple of ``G`` (the cache
quantizes full token groups only; the rest stays in full precision, KIVI's residual);
:func:`quantize_values` takes ``[*lead, n, d]`` with ``d`` a multiple of ``G``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbudget.errors import KVBudgetError

#: the bit widths a code may have (16 means not quantized)
BITS = (2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise KVBudgetError(f"quantized entries take 2, 4 or 8 bits, got {bits!r}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8`` codes ``[..., m]`` (each ``< 2^bits``) → ``[..., m · bits / 8]`` bytes, the first
    code in the lowest bits; ``m · bits`` must be a multiple of 8."""
    _check_bits(bits)
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise KVBudgetError(f"{codes.shape[-1]} codes do not fill whole bytes at {bits} bits")
    if per_byte == 1:
        return codes.to(torch.uint8)
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, per_byte)
    packed = grouped[..., 0].clone()
    for i in range(1, per_byte):
        packed |= grouped[..., i] << (bits * i)
    return packed


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack`: ``[..., k]`` bytes → ``[..., k · 8 / bits]`` ``uint8`` codes."""
    _check_bits(bits)
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    # one shift per code in a byte, stacked last (a broadcast shift by a tensor is 3x slower on CPU)
    codes = [packed & mask] + [(packed >> (bits * i)) & mask for i in range(1, per_byte)]
    return torch.stack(codes, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def _round(t: torch.Tensor, dtype: torch.dtype, down: bool) -> torch.Tensor:
    """``t`` (fp32) in ``dtype``, rounded down (or up) rather than to nearest."""
    rounded = t.to(dtype)
    wrong = rounded.float() > t if down else rounded.float() < t
    toward = torch.full_like(rounded, float("-inf") if down else float("inf"))
    return torch.where(wrong, torch.nextafter(rounded, toward), rounded)


def round_scale_and_minimum(
    low: torch.Tensor, high: torch.Tensor, levels: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's stored (scale, minimum) in ``dtype`` from its fp32 ``low`` and ``high``: the minimum
    rounded down and the scale ``(high − minimum) / levels`` up, so the stored grid spans the group."""
    minimum = _round(low, dtype, down=True)
    return _round((high - minimum.float()) / levels, dtype, down=False), minimum


def _quantize_groups(
    x: torch.Tensor, bits: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x: [..., G]`` → (codes ``uint8 [..., G]``, scale ``[..., 1]``, minimum ``[..., 1]``), the
    scale and minimum stored in ``dtype``: the minimum rounded down and the scale up, so the
    stored grid still spans the group and every value is within half a stored step."""
    levels = (1 << bits) - 1
    x32 = x.float()
    scale, low = round_scale_and_minimum(
        x32.amin(-1, keepdim=True), x32.amax(-1, keepdim=True), levels, dtype
    )
    step = scale.float()
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = ((x32 - low.float()) / safe).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, low


@dataclass
class Quantized:
    """Entries stored as packed codes with a scale and a minimum per group.

    Attributes:
        packed: ``uint8 [*lead, n, d · bits / 8]``: the codes of each entry's ``d`` values.
        scale, minimum: keys ``[*lead, n / G, d]`` (per channel, a group of ``G`` tokens),
            values ``[*lead, n, d / G]`` (per token, a group of ``G`` channels); the input's dtype.
        bits: 2, 4 or 8. group: ``G``. per_channel: keys (``True``) or values.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    bits: int
    group: int
    per_channel: bool

    @property
    def entries(self) -> int:
        return self.packed.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes allocated: codes, scales and minima."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.minimum))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[*lead, n, d]`` in ``dtype`` (default: the scales' dtype)."""
        codes = unpack(self.packed, self.bits).float()
        scale, minimum = self.scale.float(), self.minimum.float()
        if self.per_channel:  # scale [.., n/G, d] applies to G consecutive tokens
            *lead, n, d = codes.shape
            grouped = codes.view(*lead, n // self.group, self.group, d)
            out = grouped * scale.unsqueeze(-2) + minimum.unsqueeze(-2)
        else:  # scale [.., n, d/G] applies to G consecutive channels
            *lead, n, d = codes.shape
            grouped = codes.view(*lead, n, d // self.group, self.group)
            out = grouped * scale.unsqueeze(-1) + minimum.unsqueeze(-1)
        return out.reshape(*lead, n, d).to(dtype or self.scale.dtype)


def quantize_keys(keys: torch.Tensor, bits: int, group: int) -> Quantized:
    """Per-channel quantization of ``keys: [*lead, n, d]`` in groups of ``group`` tokens (``n`` a
    multiple of it)."""
    _check_bits(bits)
    *lead, n, d = keys.shape
    if n % group:
        raise KVBudgetError(f"{n} keys do not fill whole groups of {group} tokens")
    by_channel = keys.reshape(*lead, n // group, group, d).transpose(-1, -2)  # [.., n/G, d, G]
    codes, scale, low = _quantize_groups(by_channel, bits, keys.dtype)
    codes = codes.transpose(-1, -2).reshape(*lead, n, d)
    return Quantized(pack(codes, bits), scale.squeeze(-1), low.squeeze(-1), bits, group, True)


def quantize_values(values: torch.Tensor, bits: int, group: int) -> Quantized:
    """Per-token quantization of ``values: [*lead, n, d]`` in groups of ``group`` channels (``d`` a
    multiple of it)."""
    _check_bits(bits)
    *lead, n, d = values.shape
    if d % group:
        raise KVBudgetError(f"{d} channels do not fill whole groups of {group}")
    codes, scale, low = _quantize_groups(values.reshape(*lead, n, d // group, group), bits, values.dtype)
    return Quantized(
        pack(codes.reshape(*lead, n, d), bits), scale.squeeze(-1), low.squeeze(-1), bits, group, False
    )
