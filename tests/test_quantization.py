"""KIVI-style quantization (kvbudget.quantization) against a reference written from KIVI's formulas
with plain loops (arXiv 2402.02750, §3: per-channel keys, per-token values, asymmetric min–max),
packing by hand, the error bound, and the bytes really allocated."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbudget.errors import KVBudgetError
from kvbudget.quantization import pack, quantize_keys, quantize_values, unpack


def _reference_group(values: list[float], bits: int) -> tuple[list[int], float, float]:
    """One group: m = min, s = (max − m) / (2^b − 1), c = clamp(round((x − m) / s)) — fp32 stored."""
    levels = 2**bits - 1
    low, high = min(values), max(values)
    scale = (high - low) / levels
    codes = [0 if scale == 0 else min(levels, max(0, round((x - low) / scale))) for x in values]
    return codes, scale, low


def _reference_keys(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per channel: for each channel c and each run of `group` tokens, one (scale, min)."""
    n, d = x.shape
    out = torch.empty(n, d)
    for c in range(d):
        for start in range(0, n, group):
            chunk = [float(x[t, c]) for t in range(start, start + group)]
            codes, scale, low = _reference_group(chunk, bits)
            for i, code in enumerate(codes):
                out[start + i, c] = code * scale + low
    return out


def _reference_values(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per token: for each token t and each run of `group` channels, one (scale, min)."""
    n, d = x.shape
    out = torch.empty(n, d)
    for t in range(n):
        for start in range(0, d, group):
            chunk = [float(x[t, c]) for c in range(start, start + group)]
            codes, scale, low = _reference_group(chunk, bits)
            for i, code in enumerate(codes):
                out[t, start + i] = code * scale + low
    return out


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_fp32_keys_and_values_match_the_loop_reference(bits):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(bits)) * 3
    x[:, 2] += 40  # an outlier channel, as keys have
    keys = quantize_keys(x, bits, group=4).dequantize()
    values = quantize_values(x, bits, group=4).dequantize()
    # fp32 scales and minima: the same grid as the reference up to float rounding of the step
    torch.testing.assert_close(keys, _reference_keys(x, bits, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(values, _reference_values(x, bits, 4), atol=1e-4, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    groups=st.integers(1, 3),
    group=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 10_000),
    spread=st.floats(1e-3, 1e3),
    offset=st.floats(-1e3, 1e3),
)
def test_every_value_is_within_half_a_stored_step(bits, dtype, groups, group, seed, spread, offset):
    x = (
        torch.randn(groups * group, 2 * group, generator=torch.Generator().manual_seed(seed)) * spread
        + offset
    )
    x = x.to(dtype)
    for quantized, per_channel in (
        (quantize_keys(x, bits, group), True),
        (quantize_values(x, bits, group), False),
    ):
        error = (quantized.dequantize(torch.float32) - x.float()).abs()
        step = quantized.scale.float()
        # each value's own group's step: keys [n/G, d] repeat over G tokens, values [n, d/G] over G channels
        bound = step.repeat_interleave(group, dim=0) if per_channel else step.repeat_interleave(group, dim=1)
        assert bool((error <= bound / 2 * (1 + 1e-5) + 1e-6 * x.float().abs().max()).all())


def test_a_constant_group_reads_back_exactly():
    x = torch.full((8, 4), 2.5, dtype=torch.bfloat16)
    assert torch.equal(quantize_keys(x, 2, 4).dequantize(), x)
    assert torch.equal(quantize_values(x, 2, 4).dequantize(), x)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packing_by_hand_and_round_trip(bits):
    codes = torch.tensor([[1, 2, 3, 0, 3, 2, 1, 0]], dtype=torch.uint8)  # every width holds 0..3
    packed = pack(codes, bits)
    expected = []
    per_byte = 8 // bits
    for start in range(0, 8, per_byte):
        byte = 0
        for i in range(per_byte):
            byte |= int(codes[0, start + i]) << (bits * i)
        expected.append(byte)
    assert packed.tolist() == [expected] and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize(("bits", "group"), [(8, 32), (4, 32), (2, 32), (4, 64)])
def test_bytes_are_codes_plus_scales_and_minima(bits, group):
    keys = torch.randn(1, 256, 64, dtype=torch.bfloat16)
    quantized = quantize_keys(keys, bits, group)
    codes = 256 * 64 * bits // 8
    params = 2 * (256 // group) * 64 * 2  # scale and minimum, bf16, per (token group, channel)
    assert quantized.nbytes == codes + params
    assert quantized.packed.shape == (1, 256, 64 * bits // 8)
    values = quantize_values(keys, bits, group)
    assert values.nbytes == codes + 2 * 256 * (64 // group) * 2


def test_bad_widths_and_shapes_are_one_line_errors():
    with pytest.raises(KVBudgetError, match="2, 4 or 8 bits, got 3"):
        quantize_keys(torch.zeros(4, 4), 3, 2)
    with pytest.raises(KVBudgetError, match="do not fill whole groups of 4 tokens"):
        quantize_keys(torch.zeros(6, 4), 4, 4)
    with pytest.raises(KVBudgetError, match="do not fill whole groups of 8"):
        quantize_values(torch.zeros(4, 4), 4, 8)
