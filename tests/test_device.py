"""Every registered method on ``--device`` (a GPU) against the same run on the CPU.

Runs only when pytest is given ``--device`` other than ``cpu`` (conftest deselects it otherwise):
``pytest --device cuda tests/test_device.py``. docs/gpu.md records the last run on a GPU.

The run on the device happens under ``torch.device("cpu")`` as the default device, although the
model is on the device: a tensor the library makes without naming the model's device lands on the
CPU, and the run fails there instead of passing by accident.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import kvbudget
from conftest import tiny_model, tiny_tokenizer
from method_matrix import ALL_METHODS, COMPRESSING_METHODS, small

pytestmark = pytest.mark.device

CONTEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
QUESTION = "What does the fox do?"


@pytest.fixture(scope="module")
def target(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.config.getoption("--device"))


@pytest.fixture(scope="module")
def models(target: torch.device):
    """The same tiny fp32 Llama twice: on the CPU and on the device."""
    with torch.device("cpu"):
        return tiny_model("llama"), tiny_model("llama").to(target)


def _kept_positions(cache) -> list[list[int]]:
    """Every layer's kept positions, per head, sorted (the per-head layout flattened)."""
    out = []
    for layer in cache.layers:
        heads = layer.positions if isinstance(layer.positions, list) else list(layer.positions.unbind(1))
        out += [sorted(p.reshape(-1).tolist()) for p in heads]
    return out


@pytest.mark.parametrize("name", ALL_METHODS)
def test_generation_on_the_device_equals_the_cpu(name, models) -> None:
    cpu_model, device_model = models
    tokenizer = tiny_tokenizer(chat_template=True)
    with torch.device("cpu"):
        reference = kvbudget.generate(
            cpu_model, tokenizer, CONTEXT, QUESTION, method=small(name), budget=40, max_new_tokens=12
        )
        result = kvbudget.generate(
            device_model, tokenizer, CONTEXT, QUESTION, method=small(name), budget=40, max_new_tokens=12
        )
    assert result.token_ids == reference.token_ids
    assert result.budgets.cpu().equal(reference.budgets.cpu())
    assert result.cache_stats_after.entries.cpu().equal(reference.cache_stats_after.entries.cpu())


@pytest.mark.parametrize("name", ["full", "snapkv"])
def test_sampling_on_the_device_equals_the_cpu(name, models) -> None:
    """Sampling draws from the CPU generator the seed makes, so the device samples the same tokens."""
    cpu_model, device_model = models
    tokenizer = tiny_tokenizer(chat_template=True)
    options = dict(method=small(name), budget=40, max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)
    with torch.device("cpu"):
        reference = kvbudget.generate(cpu_model, tokenizer, CONTEXT, QUESTION, **options)
        result = kvbudget.generate(device_model, tokenizer, CONTEXT, QUESTION, **options)
    assert result.token_ids == reference.token_ids


@pytest.mark.parametrize("name", COMPRESSING_METHODS)
def test_compression_on_the_device_keeps_the_cpu_entries(name, models, target) -> None:
    cpu_model, device_model = models
    with torch.device("cpu"):
        ids = torch.randint(3, 90, (2, 120), generator=torch.Generator().manual_seed(1))
        reference = kvbudget.compress(cpu_model, ids, method=small(name), budget=24)
        cache = kvbudget.compress(device_model, ids.to(target), method=small(name), budget=24)
    assert {layer.device.type for layer in cache.layers} == {target.type}
    kept, expected = _kept_positions(cache), _kept_positions(reference)
    assert [len(k) for k in kept] == [len(k) for k in expected]  # every head keeps the same count
    # the same entries, but for near-ties the two devices' float sums order differently (Knorm's
    # key norms swapped one entry of 48 on an H200): at most one entry in fifty may differ
    same = sum(sum((Counter(k) & Counter(e)).values()) for k, e in zip(kept, expected, strict=True))
    assert same >= 0.98 * sum(len(e) for e in expected)


@pytest.mark.parametrize(("name", "calls_per_layer"), [("full", 1), ("ada-snapkv", 2)])
def test_decoding_on_the_device_leaves_cudnn_attention_out(
    name, calls_per_layer, models, target, monkeypatch
):
    """Every decode step's attention runs with cuDNN's SDPA backend off, in the rectangular (full)
    and the per-head layout (ada-snapkv: one call per KV head): cuDNN rebuilds a graph for each
    new key length, every decode step (docs/gpu.md)."""
    if target.type != "cuda":
        pytest.skip("cuDNN's SDPA backend is CUDA's")
    _, device_model = models
    calls: list[tuple[int, int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        calls.append((query.shape[2], key.shape[2], torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    tokenizer = tiny_tokenizer(chat_template=True)
    with torch.device("cpu"):
        result = kvbudget.generate(
            device_model, tokenizer, CONTEXT, QUESTION, method=small(name), budget=40, max_new_tokens=6
        )
    steps = len(result.token_ids) - 1  # the first token comes from the prefill
    layers = device_model.config.num_hidden_layers
    over_cache = [enabled for q, n, enabled in calls if q < n]
    assert steps >= 1 and len(over_cache) >= steps * layers * calls_per_layer
    assert not any(over_cache)
