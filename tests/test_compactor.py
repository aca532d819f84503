"""Compactor (arXiv:2507.08143, as kvpress's ``CompactorPress``) against its formula, with loops.

``score = β·z(L) + z(A)`` over the candidates (neither the first ``sinks`` nor the last ``window``):
``L`` the ridge leverage of the centred, sketched pre-RoPE keys (the reference of
``tests/test_leverage.py``), ``A`` the non-causal attention each key receives within its chunk of
candidates (unscaled ``q·k``, every query of the chunk seeing every key of it; a short last chunk's
missing queries add ``1/chunk`` each), averaged over the GQA group, times ``‖v‖``, averaged with its
two neighbours (zeros beyond the ends, divided by 3); ``z`` the z-score over heads and candidates
(unbiased std); ``β`` the eviction fraction ``1 − B/n`` by default. The references take the
queries, keys and values from the tiny model's own projections and rotate them with explicit RoPE
matrices; softmax, z-scores and pooling are written out. kvpress's ``CompactorPress`` is the
end-to-end oracle (``tests/test_kvpress_oracle.py``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvbudget
from conftest import seeded, tiny_model
from kvbudget.cache import BudgetLayer
from kvbudget.errors import BudgetError, KVBudgetError, MethodOptionError
from kvbudget.methods.compactor import Compactor
from kvbudget.methods.registry import make_method
from kvbudget.observation import Observation
from test_leverage import distinct_ids, leverage_reference, reference_sketches

N = 90


def projections(model, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per layer: pre-RoPE keys ``[kv_heads, n, d]``, post-RoPE queries ``[q_heads, n, d]`` and keys, and
    values ``[kv_heads, n, d]``, from the layer's input norm and projections and explicit rotations."""
    cfg = model.config
    hq, hk, n = cfg.num_attention_heads, cfg.num_key_value_heads, len(ids)
    d = cfg.hidden_size // hq
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(n)[None])
        per_layer = []
        for layer_idx, layer in enumerate(model.model.layers):
            h = layer.input_layernorm(out.hidden_states[layer_idx][0])
            attn = layer.self_attn
            q = attn.q_proj(h).view(n, hq, d).transpose(0, 1).double().numpy()
            k = attn.k_proj(h).view(n, hk, d).transpose(0, 1).double().numpy()
            v = attn.v_proj(h).view(n, hk, d).transpose(0, 1).double().numpy()
            per_layer.append((k, rotate(q, cos[0], sin[0]), rotate(k, cos[0], sin[0]), v))
    return per_layer


def rotate(x: np.ndarray, cos: torch.Tensor, sin: torch.Tensor) -> np.ndarray:
    """RoPE of ``x: [heads, n, d]`` at positions 0 … n−1, one coordinate at a time:
    ``y_i = x_i cos_i − x_{i+d/2} sin_i`` (first half), ``y_i = x_i cos_i + x_{i−d/2} sin_i`` (second)."""
    heads, n, d = x.shape
    c, s = cos.double().numpy(), sin.double().numpy()
    y = np.zeros_like(x)
    for h in range(heads):
        for t in range(n):
            for i in range(d):
                partner = -x[h, t, i + d // 2] if i < d // 2 else x[h, t, i - d // 2]
                y[h, t, i] = x[h, t, i] * c[t, i] + partner * s[t, i]
    return y


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(z - top) for z in logits]
    return [e / sum(exps) for e in exps]


def zscores(rows: list[list[float]]) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    return [[(x - mean) / max(std, 1e-6) for x in row] for row in rows]


def attention_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, cand: list[int], chunk: int, variant: str = ""
) -> list[list[float]]:
    """``A`` per KV head over the candidates (before the z-score). ``variant``: ``"no-filler"`` (a short
    chunk's missing queries add nothing), ``"scaled"`` (logits over √d), ``"causal"`` (each query sees
    only the chunk's keys up to itself), ``"no-vnorm"``."""
    hq, hk, d, m = q.shape[0], k.shape[0], q.shape[2], len(cand)
    group = hq // hk
    per_q = [[0.0] * m for _ in range(hq)]
    for qh in range(hq):
        h = qh // group
        for start in range(0, m, chunk):
            members = list(range(start, min(start + chunk, m)))
            for t in members:
                seen = [j for j in members if variant != "causal" or j <= t]
                scale = 1 / math.sqrt(d) if variant == "scaled" else 1.0
                logits = [float(q[qh, cand[t]] @ k[h, cand[j]]) * scale for j in seen]
                for j, p in zip(seen, softmax(logits), strict=True):
                    per_q[qh][j] += p
            if variant != "no-filler":
                for j in members:
                    per_q[qh][j] += (chunk - len(members)) / chunk
    pooled = []
    for h in range(hk):
        a = [sum(per_q[h * group + g][i] for g in range(group)) / group for i in range(m)]
        if variant != "no-vnorm":
            a = [a[i] * float(np.linalg.norm(v[h, cand[i]])) for i in range(m)]
        padded = [0.0, *a, 0.0]
        pooled.append([(padded[i] + padded[i + 1] + padded[i + 2]) / 3 for i in range(m)])
    return pooled


def compactor_keep(
    model, ids: list[int], options: dict, budget: int, variant: str = ""
) -> list[list[set[int]]]:
    """Per layer and head: the sinks and window, then the top blended scores of the candidates."""
    method = Compactor(**options)
    n = len(ids)
    cand = list(range(method.sinks, n - method.window))
    protected = set(range(n)) - set(cand)
    layers = projections(model, ids)
    heads, _, d = layers[0][0].shape
    sketches = reference_sketches(method.seed, len(layers), heads, d, method.sketch)
    beta = method.blending if method.blending >= 0 else 1 - budget / n
    kept = []
    for (k_pre, q_rot, k_rot, v), sketch in zip(layers, sketches, strict=True):
        lev = zscores(
            [leverage_reference(k_pre[h, cand], sketch[h], method.ridge).tolist() for h in range(heads)]
        )
        att = zscores(attention_reference(q_rot, k_rot, v, cand, method.chunk, variant))
        layer = []
        for h in range(heads):
            score = [beta * lev[h][i] + att[h][i] for i in range(len(cand))]
            order = sorted(range(len(cand)), key=lambda i: -score[i])
            cut = budget - len(protected)
            if not variant:
                assert score[order[cut - 1]] - score[order[cut]] > 1e-4  # no near tie at the cut
            layer.append(protected | {cand[i] for i in order[:cut]})
        kept.append(layer)
    return kept


def kept_sets(model, ids: list[int], options: dict, budget: int) -> list[list[set[int]]]:
    cache = kvbudget.compress(
        model, torch.tensor([ids]), method=make_method("compactor", **options), budget=budget
    )
    return [[set(layer.head(h)[2][0].tolist()) for h in range(layer.num_heads)] for layer in cache.layers]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize(
    ("options", "budget"),
    [
        ({"chunk": 32}, 30),  # 78 candidates: chunks of 32, 32 and a short 14
        ({"chunk": 26, "sketch": 8}, 40),  # three whole chunks; a sketch narrower than the head
        ({"chunk": 256, "blending": 2.0, "seed": 3, "sketch": 8}, 30),  # one short chunk
        ({"chunk": 20, "sinks": 2, "window": 6, "ridge": 0.0, "sketch": 8}, 24),
    ],
)  # fmt: skip
def test_compactor_keeps_the_formulas_top(kind: str, options: dict, budget: int) -> None:
    model = tiny_model(kind, seed=2)
    ids = distinct_ids(4)
    assert kept_sets(model, ids, options, budget) == compactor_keep(model, ids, options, budget)


@pytest.mark.parametrize("variant", ["no-filler", "scaled", "causal", "no-vnorm"])
def test_compactor_fixture_tells_the_plausible_variants_apart(variant: str) -> None:
    """A short chunk's missing queries left out, logits scaled by 1/√d, causal chunks, no ‖v‖: each
    keeps other entries on this fixture, so the formula test cannot pass by accident."""
    model = tiny_model("llama", seed=2)
    ids = distinct_ids(4)
    options = {"chunk": 32}
    assert kept_sets(model, ids, options, 30) != compactor_keep(model, ids, options, 30, variant)


def test_compactor_blending_follows_the_eviction_fraction() -> None:
    """The default ``β`` is ``1 − B/n`` of the row: the same as giving it explicitly, and other entries
    than another ``β``."""
    model = tiny_model("llama", seed=2)
    ids = distinct_ids(4)
    default = kept_sets(model, ids, {"chunk": 32, "sketch": 8}, 30)
    assert default == kept_sets(model, ids, {"chunk": 32, "sketch": 8, "blending": 1 - 30 / N}, 30)
    assert default != kept_sets(model, ids, {"chunk": 32, "sketch": 8, "blending": 0.0}, 30)


def test_compactor_refuses_a_pyramid_layer_below_its_sinks_and_window() -> None:
    """PyramidKV's schedule floors at the window; at a budget of 24 over 4 layers its top layer keeps 7
    per head, fewer than compactor's 8 sinks and window of 4: refused in one line, not overspent."""
    method = make_method("compactor", layer_alloc="pyramid")
    ids = torch.tensor([distinct_ids(4)])
    with pytest.raises(BudgetError, match=r"gives layer 3 7 entries per head, below the 13 it always keeps"):
        kvbudget.compress(tiny_model("llama", seed=2), ids, method=method, budget=24)
    kvbudget.compress(
        tiny_model("llama", seed=2), ids, method=make_method("compactor", layer_alloc="pyramid"), budget=64
    )


def test_compactor_refuses_bad_options_and_partial_prefills() -> None:
    for options, words in [({"chunk": 0}, "chunk"), ({"blending": "x"}, "blending")]:
        with pytest.raises(MethodOptionError, match=words):
            make_method("compactor", **options)
    layer = BudgetLayer()
    layer.update(torch.randn(1, 2, 30, 8, generator=seeded(0)), torch.randn(1, 2, 30, 8, generator=seeded(1)))
    obs = Observation(0, 1, query=torch.zeros(1, 4, 1, 8), layer=layer, scaling=1.0)
    with pytest.raises(KVBudgetError, match="a query for every entry"):
        Compactor().score(obs)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    full = Observation(0, 1, query=torch.zeros(1, 4, 30, 8), layer=layer, scaling=1.0)
    full.run = Compactor().start()
    full.run.inv_freq = inv_freq
    with pytest.raises(KVBudgetError, match="blending follows the layer's eviction fraction"):
        Compactor().score(full)
    assert Compactor(blending=0.5).score(full).shape == (1, 2, 30)
