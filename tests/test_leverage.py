"""Leverage (Compactor's approximate leverage scores, arXiv:2507.08143) against its formula.

The reference never calls kvbudget's helpers: the pre-RoPE keys come from the tiny model's own
projections (its input norm and ``k_proj`` on the layer's input hidden states, as kvpress computes
them), the sketch of layer ``l`` is the ``(l + 1)``-th ``torch.randn((1, kv_heads, d, k))`` of a CPU
generator seeded with ``seed``, times ``1/√k``; then float64 numpy loops centre the candidates' keys
and sketch them, and the ridge leverage comes from the SVD ``X = U S Vᵀ``:
``ℓ_i = Σ_j U_ij² S_j² / (S_j² + λ)`` — not the pseudo-inverse of ``XᵀX + λI`` the method uses.
kvpress's ``LeverageScorePress`` is the end-to-end oracle (``tests/test_kvpress_oracle.py``).

The prompts hold no repeated token: at layer 0 a repeated token's pre-RoPE keys are equal, so
its entries tie exactly.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvbudget
from conftest import seeded, tiny_model
from kvbudget.errors import KVBudgetError, MethodOptionError, UnsupportedModelError
from kvbudget.methods.leverage import Leverage
from kvbudget.methods.registry import make_method

N = 90  # distinct token ids of the tiny vocabulary (3 … 95)


def distinct_ids(seed: int) -> list[int]:
    return (torch.randperm(93, generator=seeded(seed)) + 3)[:N].tolist()


def reference_sketches(seed: int, layers: int, heads: int, d: int, k: int) -> list[np.ndarray]:
    """``Φ_l: [heads, d, k]`` for each layer, drawn one after the other from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    draws = [torch.randn((1, heads, d, k), generator=generator) * (1 / math.sqrt(k)) for _ in range(layers)]
    return [draw[0].double().numpy() for draw in draws]


def pre_rope_keys(model, ids: list[int]) -> list[np.ndarray]:
    """Per layer ``[kv_heads, n, d]``: ``k_proj(input_layernorm(h_l))``, the keys before RoPE."""
    cfg = model.config
    hk, d, n = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, len(ids)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        keys = []
        for layer_idx, layer in enumerate(model.model.layers):
            h = layer.input_layernorm(out.hidden_states[layer_idx][0])
            keys.append(layer.self_attn.k_proj(h).view(n, hk, d).transpose(0, 1).double().numpy())
    return keys


def post_rope_keys(model, ids: list[int]) -> list[np.ndarray]:
    """Per layer ``[kv_heads, n, d]``: the cached (post-RoPE) keys of a plain forward."""
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache)
    return [layer.keys[0].double().numpy() for layer in cache.layers]


def leverage_reference(keys: np.ndarray, sketch: np.ndarray, ridge: float, center: bool = True) -> np.ndarray:
    """``ℓ: [m]`` of one head's keys ``[m, d]`` on the sketch ``[d, k]``, by loops and an SVD."""
    m, d = keys.shape
    mean = [sum(keys[i, e] for i in range(m)) / m if center else 0.0 for e in range(d)]
    x = np.zeros((m, sketch.shape[1]))
    for i in range(m):
        for j in range(sketch.shape[1]):
            x[i, j] = sum((keys[i, e] - mean[e]) * sketch[e, j] for e in range(d))
    u, s, _ = np.linalg.svd(x, full_matrices=False)
    return np.array([max(0.0, sum(u[i, j] ** 2 * s[j] ** 2 / (s[j] ** 2 + ridge) for j in range(len(s))))
                     for i in range(m)])  # fmt: skip


def reference_keep(
    per_layer_keys: list[np.ndarray], options: dict, budget: int, check_ties: bool = True
) -> list[list[set[int]]]:
    """Per layer and head: the window and sinks, then the top leverage scores of the rest (with
    ``check_ties``, asserting that no near tie straddles the cut)."""
    method = Leverage(**options)
    heads, n, d = per_layer_keys[0].shape
    sketches = reference_sketches(method.seed, len(per_layer_keys), heads, d, method.sketch)
    protected = set(range(method.sinks)) | set(range(n - method.window, n))
    candidates = [i for i in range(n) if i not in protected]
    kept = []
    for keys, sketch in zip(per_layer_keys, sketches, strict=True):
        layer = []
        for h in range(heads):
            scores = leverage_reference(keys[h, candidates], sketch[h], method.ridge)
            order = sorted(range(len(candidates)), key=lambda c: -scores[c])
            cut = budget - len(protected)
            assert not check_ties or scores[order[cut - 1]] - scores[order[cut]] > 1e-5
            layer.append(protected | {candidates[c] for c in order[:cut]})
        kept.append(layer)
    return kept


def kept_sets(model, ids: list[int], method, budget: int) -> list[list[set[int]]]:
    cache = kvbudget.compress(model, torch.tensor([ids]), method=method, budget=budget)
    return [[set(layer.head(h)[2][0].tolist()) for h in range(layer.num_heads)] for layer in cache.layers]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize(
    ("options", "budget"),
    [
        ({}, 30),
        ({"sketch": 8}, 30),
        ({"sketch": 8, "seed": 5, "window": 4, "sinks": 2}, 24),
        ({"sketch": 6, "ridge": 0.0}, 40),
    ],
)  # fmt: skip
def test_leverage_keeps_the_formulas_top(kind: str, options: dict, budget: int) -> None:
    model = tiny_model(kind, seed=2)
    ids = distinct_ids(4)
    expected = reference_keep(pre_rope_keys(model, ids), options, budget)
    assert kept_sets(model, ids, make_method("leverage", **options), budget) == expected


def test_leverage_differs_from_its_plausible_variants() -> None:
    """With a sketch narrower than the head (k = 8 < d = 16) the draw matters: another seed keeps
    other entries, as do post-RoPE keys and uncentred keys. With k ≥ d (the default 48 here) the
    sketch spans the keys' space and any seed keeps the exact leverage's entries."""
    model = tiny_model("llama", seed=2)
    ids = distinct_ids(4)
    ours = kept_sets(model, ids, make_method("leverage", sketch=8), 30)
    assert ours != kept_sets(model, ids, make_method("leverage", sketch=8, seed=1), 30)
    assert ours != reference_keep(post_rope_keys(model, ids), {"sketch": 8}, 30, check_ties=False)
    keys = pre_rope_keys(model, ids)
    sketches = reference_sketches(0, len(keys), 2, 16, 8)
    uncentred = [
        [set(np.argsort(-leverage_reference(k[h], s[h], 0.01, center=False), kind="stable")[:30].tolist())
         for h in range(2)]
        for k, s in zip(keys, sketches, strict=True)
    ]  # fmt: skip
    assert ours != uncentred
    wide = kept_sets(model, ids, make_method("leverage"), 30)
    assert wide == kept_sets(model, ids, make_method("leverage", seed=7), 30)


def test_leverage_sketches_are_drawn_in_layer_order_on_the_cpu() -> None:
    method = Leverage(sketch=8, seed=3)
    run = method.start()
    third = method.sketch_of(run, 2, 2, 16)
    expected = reference_sketches(3, 3, 2, 16, 8)[2]
    np.testing.assert_array_equal(third.double().numpy(), expected)
    assert len(run.sketches) == 3 and third.device.type == "cpu"


def test_leverage_refuses_bad_options_and_models_without_rope() -> None:
    for options, words in [({"sketch": 0}, "sketch"), ({"ridge": -1.0}, "ridge"), ({"seed": 1.5}, "seed")]:
        with pytest.raises(MethodOptionError, match=words):
            make_method("leverage", **options)

    with pytest.raises(UnsupportedModelError, match="rotary"):
        Leverage().start(SimpleNamespace(model=SimpleNamespace()))
    from kvbudget.cache import BudgetLayer
    from kvbudget.observation import Observation

    layer = BudgetLayer()
    layer.update(torch.randn(1, 2, 10, 8, generator=seeded(0)), torch.randn(1, 2, 10, 8, generator=seeded(1)))
    obs = Observation(0, 1, query=torch.zeros(1, 4, 10, 8), layer=layer, scaling=1.0)
    with pytest.raises(KVBudgetError, match="start the run with the model"):
        Leverage().score(obs)
