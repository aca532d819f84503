"""kvbudget's KIVI quantization against transformers' quantizer backend (optimum-quanto), where the
settings coincide.

transformers' ``QuantizedCache`` with the quanto backend quantizes a layer through
``QuantoQuantizedLayer._quantize``: quanto's ``MaxOptimizer`` (scale ``(max − min) / (2^b − 1)``,
shift ``−min``) and ``quantize_weight`` (codes ``round((x + shift) / scale)``, clamped). With KIVI's
axes (``axis_key=-1``: a key group is ``G`` tokens of one channel; ``axis_value=0``: a value group is
``G`` channels of one token), 2 or 4 bits, whole groups and fp32 tensors, that is KIVI's formula as
kvbudget computes it: the same codes, scales and minima, and the same values read back.

Where they cannot coincide, and so are not compared: 8 bits (quanto refuses a shift at 8 bits),
bf16 (quanto rounds in bf16, kvbudget rounds its stored scale up and its minimum down), a token
count that is not a multiple of ``G`` (quanto's groups then straddle heads or fail).

Quanto's packed codes are read by :func:`_quanto_unpack`, written from quanto's packing layout (its
own unpack is a C++ extension built at first use), and put back in the tensor's shape with its
``ungroup``: nothing of kvbudget's is on that side.
"""

from __future__ import annotations

import pytest
import torch
from optimum.quanto.tensor.grouped import ungroup
from transformers.cache_utils import QuantoQuantizedLayer

from kvbudget.quantization import quantize_keys, quantize_values, unpack
from kvbudget.quantized_store import GROUP, pack_all, value_group

HEADS, TOKENS, DIM = 2, 64, 64


def _kv(seed: int) -> torch.Tensor:
    """``[heads, tokens, dim]`` fp32 with a few outlier channels (keys have them, KIVI §3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(HEADS, TOKENS, DIM, generator=g)
    x[..., :: DIM // 4] *= 8.0
    return x


def _quanto_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto's ``pack_weights`` layout: the rows are cut into ``8 / bits`` consecutive chunks, chunk
    ``i`` in bits ``[i · bits, (i + 1) · bits)`` of the same packed rows."""
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * i)) & mask for i in range(8 // bits)])


def _quanto(x: torch.Tensor, bits: int, group: int, axis: int):
    """transformers' quanto backend on ``x``: (codes ``uint8`` in ``x``'s shape, the values it reads
    back (``code · scale − shift``, in ``x``'s shape), its quantized object)."""
    layer = QuantoQuantizedLayer(nbits=bits, axis_key=-1, axis_value=0, q_group_size=group)
    qt = layer._quantize(x, axis=axis)
    rows = qt._data._data.shape[0] * (8 // bits)
    grouped = _quanto_unpack(qt._data._data, bits)[:rows]
    read_back = ungroup(grouped.float() * qt._scale - qt._shift, axis, x.shape)
    return ungroup(grouped, axis, x.shape), read_back, qt


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("group", [32, 64])
def test_keys_per_channel_match_quanto(bits: int, group: int) -> None:
    x = _kv(bits * 100 + group)
    codes, read_back, qt = _quanto(x, bits, group, axis=-1)
    ours = quantize_keys(x, bits, group)
    assert torch.equal(unpack(ours.packed, bits), codes)
    # quanto's per-channel scale is [1, dim · groups], a column per (channel, group of G tokens)
    groups = HEADS * TOKENS // group
    as_ours = lambda t: t.reshape(DIM, groups).T.reshape(HEADS, TOKENS // group, DIM)  # noqa: E731
    assert torch.equal(ours.scale, as_ours(qt._scale))
    assert torch.equal(ours.minimum, as_ours(-qt._shift))
    assert torch.equal(ours.dequantize(torch.float32), read_back)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("group", [32, 64])
def test_values_per_token_match_quanto(bits: int, group: int) -> None:
    x = _kv(bits * 100 + group + 1)
    codes, read_back, qt = _quanto(x, bits, group, axis=0)
    ours = quantize_values(x, bits, group)
    assert torch.equal(unpack(ours.packed, bits), codes)
    # quanto's per-token scale is [tokens · dim / G, 1], a row per G consecutive channels
    as_ours = lambda t: t.reshape(HEADS, TOKENS, DIM // group)  # noqa: E731
    assert torch.equal(ours.scale, as_ours(qt._scale))
    assert torch.equal(ours.minimum, as_ours(-qt._shift))
    assert torch.equal(ours.dequantize(torch.float32), read_back)


@pytest.mark.parametrize("bits", [2, 4])
def test_cache_storage_matches_quanto(bits: int) -> None:
    """What the cache stores for one head (keys and values of whole groups, at the cache's group
    size) holds quanto's codes, scales and minima, and reads back quanto's values up to the rounding
    of one fp32 operation (the cache computes ``code · scale + minimum`` with one rounding,
    ``addcmul``; quanto with two)."""
    keys, values = _kv(7), _kv(8)
    head = pack_all(keys, values, bits, GROUP)
    assert head.quantized_entries == TOKENS
    key_codes, key_read_back, key_qt = _quanto(keys, bits, GROUP, axis=-1)
    value_codes, value_read_back, value_qt = _quanto(values, bits, value_group(DIM, GROUP), axis=0)
    assert torch.equal(unpack(head.key_codes, bits), key_codes)
    assert torch.equal(unpack(head.value_codes, bits), value_codes)
    key_groups = HEADS * TOKENS // GROUP
    per_channel = lambda t: t.reshape(DIM, key_groups).T.reshape(HEADS, TOKENS // GROUP, DIM)  # noqa: E731
    assert torch.equal(head.key_scale, per_channel(key_qt._scale))
    assert torch.equal(head.key_min, per_channel(-key_qt._shift))
    assert torch.equal(head.value_scale, value_qt._scale.reshape(HEADS, TOKENS, -1))
    assert torch.equal(head.value_min, -value_qt._shift.reshape(HEADS, TOKENS, -1))
    got_keys, got_values = head.dequantize(torch.float32)
    for got, theirs, x in ((got_keys, key_read_back, keys), (got_values, value_read_back, values)):
        one_rounding = 2 * torch.finfo(torch.float32).eps * x.abs().max().item()
        torch.testing.assert_close(got, theirs, rtol=0.0, atol=one_rounding)
