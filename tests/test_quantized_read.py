"""The fused quantized read (kvbudget.quantized_read): one decode step's attention straight from
the stored codes, against attention in float64 over the numbers the store holds, decoded here by
loops from the packed bytes (the layout written in kvbudget.quantization: ``8 / bits`` codes a
byte, the first in the lowest bits; a key's scale row is its key group's, a value's scales its
own). Then: the same bits however a head's entries are split into segments (a shared document),
the decode step of a model taking it, and the fallback where no kernel can be built.
"""

from __future__ import annotations

import logging

import pytest
import torch

import kvbudget
from conftest import seeded, tiny_model
from kvbudget import attention, quantized_read
from kvbudget.quantized_store import QuantizedHead, TieredHead, pack_all
from kvbudget.shared_prefix import SharedHead


def _codes(packed: torch.Tensor, bits: int) -> list[list[int]]:
    """``packed: [m, w]`` bytes → ``m`` lists of ``w · 8 / bits`` codes, by loops."""
    per, mask = 8 // bits, (1 << bits) - 1
    return [[(int(byte) >> (bits * k)) & mask for byte in row for k in range(per)] for row in packed]


def _stored(head, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch row ``r`` of ``head`` as float64 keys and values ``[n, d]``, in slot order."""
    if isinstance(head, TieredHead):
        parts = [_stored(head.high, r), _stored(head.low, r)]
    elif isinstance(head, SharedHead):
        parts = [_stored(head.prefix, r), _stored(head.own, r)]
    else:
        keys, values = [], []
        for i, (kc, vc) in enumerate(zip(_codes(head.key_codes[r], head.bits),
                                         _codes(head.value_codes[r], head.bits), strict=True)):  # fmt: skip
            g = int(head.key_group[r, i])
            scale, low = head.key_scale[r, g], head.key_min[r, g]
            keys.append([c * float(scale[j]) + float(low[j]) for j, c in enumerate(kc)])
            width = len(vc) // head.value_scale.shape[-1]
            scale, low = head.value_scale[r, i], head.value_min[r, i]
            values.append([c * float(scale[j // width]) + float(low[j // width]) for j, c in enumerate(vc)])
        d, dv = head.tail_keys.shape[-1], head.tail_values.shape[-1]
        keys_t = torch.tensor(keys, dtype=torch.float64).reshape(-1, d)
        values_t = torch.tensor(values, dtype=torch.float64).reshape(-1, dv)
        parts = [(keys_t, values_t), (head.tail_keys[r].double(), head.tail_values[r].double())]
    return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])


def _reference(query: torch.Tensor, heads: list, scaling: float) -> torch.Tensor:
    """``query: [b, q_heads, 1, d]`` → float64 ``[b, q_heads, 1, dv]``: softmax(q·kᵀ·scaling)·v."""
    b, q_heads, _, _ = query.shape
    group = q_heads // len(heads)
    out = []
    for r in range(b):
        rows = []
        for qh in range(q_heads):
            k, v = _stored(heads[qh // group], r)
            p = torch.softmax((k @ query[r, qh, 0].double()) * scaling, 0)
            rows.append(p @ v)
        out.append(torch.stack(rows))
    return torch.stack(out)[:, :, None]


def _random(b: int, n: int, d: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn((b, n, d), generator=seeded(seed)) * torch.linspace(0.5, 3.0, d)).to(dtype)


def _head(b: int, n: int, d: int, bits: int, seed: int, dtype=torch.float32) -> QuantizedHead:
    return QuantizedHead.from_full(_random(b, n, d, seed, dtype), _random(b, n, d, seed + 1, dtype), bits)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("d", [64, 24])  # 64: the kernel's fixed-width path; 24: its general one
def test_the_read_equals_attention_over_the_stored_numbers(bits, d):
    heads = [_head(2, 70, d, bits, seed) for seed in (0, 10)]  # 64 quantized entries, a tail of 6
    query = _random(2, 6, d, 20).reshape(2, 6, 1, d)
    out = quantized_read.fused_decode(query, heads, d**-0.5)
    assert out is not None and out.shape == (2, 6, 1, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(query, heads, d**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scales_and_tails_in_the_models_dtype(dtype):
    heads = [_head(1, 100, 64, 4, seed, dtype) for seed in (1, 11)]
    query = _random(1, 4, 64, 21, dtype).reshape(1, 4, 1, 64)
    out = quantized_read.fused_decode(query, heads, 0.125)
    assert out.dtype == dtype  # computed in fp32, rounded once at the end
    torch.testing.assert_close(out.double(), _reference(query, heads, 0.125), atol=1e-2, rtol=1e-2)


def test_gathered_tiered_and_shared_heads():
    full = _head(1, 96, 64, 4, 2)
    gathered = full.take(torch.tensor([[0, 3, 5, 40, 41, 70, 90, 95]]))  # key groups no longer whole
    keys, values = _random(1, 50, 64, 3), _random(1, 50, 64, 4)
    tiered = TieredHead(pack_all(keys[:, :18], values[:, :18], 8),
                        QuantizedHead.from_full(keys[:, 18:], values[:, 18:], 2))  # fmt: skip
    shared = SharedHead(_head(1, 64, 64, 4, 5), _head(1, 9, 64, 4, 6))
    for heads in ([gathered, gathered], [tiered, tiered], [shared, shared]):
        query = _random(1, 4, 64, 22).reshape(1, 4, 1, 64)
        out = quantized_read.fused_decode(query, heads, 0.125)
        torch.testing.assert_close(out.double(), _reference(query, heads, 0.125), atol=2e-6, rtol=1e-5)


def test_a_shared_prefix_reads_the_same_bits_as_one_store():
    """A conversation on a shared document reads the document's segment, then its own: the same
    entries in the same order as one store of them all, so the same bits (tests/test_shared_prefix.py
    relies on it)."""
    keys, values = _random(1, 101, 64, 7, torch.bfloat16), _random(1, 101, 64, 8, torch.bfloat16)
    one = QuantizedHead.from_full(keys, values, 4)
    split = SharedHead(QuantizedHead.from_full(keys[:, :64], values[:, :64], 4),
                       QuantizedHead.from_full(keys[:, 64:], values[:, 64:], 4))  # fmt: skip
    query = _random(1, 2, 64, 9, torch.bfloat16).reshape(1, 2, 1, 64)
    whole = quantized_read.fused_decode(query, [one], 0.125)
    assert whole.equal(quantized_read.fused_decode(query, [split], 0.125))


def _decode_logits(model, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    cache = kvbudget.BudgetCache(model.config.num_hidden_layers, kv_bits=4)
    logits = []
    with kvbudget.attached(model), torch.no_grad():
        out = model(prompt, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(token, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
    return logits


def test_a_decode_step_reads_quantized_layers_through_it(monkeypatch):
    model = tiny_model("qwen2")
    prompt = torch.randint(3, 90, (1, 80), generator=seeded(12))
    calls = []

    def counted(*args):
        calls.append(1)
        return quantized_read.fused_decode(*args)

    monkeypatch.setattr(attention, "fused_decode", counted)
    fused = _decode_logits(model, prompt, 5)
    assert len(calls) == 5 * model.config.num_hidden_layers  # every layer of every step
    monkeypatch.setenv(quantized_read.ENV_SWITCH, "0")  # the layer dequantized, then SDPA
    dequantized = _decode_logits(model, prompt, 5)
    for a, b in zip(fused, dequantized, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_without_a_kernel_attention_dequantizes_after_one_warning(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(quantized_read, "_module", None)
    monkeypatch.setattr(quantized_read, "_failed", None)
    monkeypatch.setattr(quantized_read, "_build", no_compiler)
    model = tiny_model("qwen2")
    prompt = torch.randint(3, 90, (1, 40), generator=seeded(13))
    with caplog.at_level(logging.WARNING, logger="kvbudget.quantized_read"):
        without = _decode_logits(model, prompt, 3)
    warnings = [r for r in caplog.records if "could not be built" in r.getMessage()]
    assert len(warnings) == 1 and "No such file" in warnings[0].getMessage()
    monkeypatch.setenv(quantized_read.ENV_SWITCH, "0")
    for a, b in zip(without, _decode_logits(model, prompt, 3), strict=True):
        assert a.equal(b)


def test_a_killed_build_does_not_make_later_builds_wait_forever(monkeypatch, tmp_path):
    """torch's ``lock`` file left in the build directory by a build killed midway is cleared under
    kvbudget's own lock; the build directory is one per interpreter (virtual environments on one
    machine do not rebuild each other's copy)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen = {}

    def fake_load(**kwargs):
        directory = kwargs["build_directory"]
        seen.update(kwargs, stale_lock_present=(tmp_path / kwargs["name"] / "lock").exists())
        return directory

    name = quantized_read._build_name(quantized_read._flags())
    (tmp_path / name).mkdir()
    (tmp_path / name / "lock").touch()  # the baton of a build killed midway
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    built = quantized_read._build()
    assert seen["stale_lock_present"] is False
    assert seen["name"] == name and built == str(tmp_path / name)
    monkeypatch.setattr(quantized_read.sys, "executable", "/another/venv/bin/python")
    assert quantized_read._build_name(quantized_read._flags()) != name
