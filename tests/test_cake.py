"""CAKE: preference budgets (property tests), kept sets and decode trimming against a reference.

The reference recomputes CAKE from the paper's formulas (docs/methods.md, CAKE) with float64 numpy
copies and explicit loops: the window attention by a hand-written softmax over each causal prefix,
the preference ``H^(1/τ1)·V^(1/τ2)`` (entropy and unbiased variance over the window rows), the eviction score
``mean + γ·var`` with average pooling by explicit windows (zero padding, divided by the kernel),
the GQA mean, the cascading budgets and the decode-time trimming by the current query. Helpers
shared with ``tests/test_lava.py`` (softmax, water-filling) are that file's reference code. The
authors' per-model τ (``authors_tau``) are checked against their ``model2tau.json`` written out here.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbudget
from conftest import seeded, tiny_model
from kvbudget.allocation import cake_preference
from kvbudget.cache import BudgetLayer
from kvbudget.errors import MethodOptionError, UnknownMethodError
from kvbudget.methods.cake import authors_checkpoint
from kvbudget.methods.layerwise import RowPlan
from kvbudget.methods.registry import make_method
from kvbudget.observation import Observation
from kvbudget.session import CompressionSession
from test_lava import (
    BUDGET,
    HQ,
    LAYERS,
    SCALE,
    TOL,
    D,
    G,
    H,
    N,
    W,
    check_cut,
    make_inputs,
    ref_cascade,
    ref_probs,
    run_library,
    softmax,
)

KERNEL = 5
GAMMA = 200.0
OPTIONS = {"window": W}


# ------------------------------------------------------------------------------ property tests
@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 40),
    length=st.integers(8, 200),
    data=st.data(),
)
def test_cascading_preference_budgets_sum_to_the_total_and_never_grow(layers, length, data):
    """``T = (B − w)·layers`` per head: exact after the last layer, capped at ``L − w``, never growing."""
    window = data.draw(st.integers(2, min(32, length - 2)))
    budget = data.draw(st.integers(window + 1, length - 1))
    tau1 = data.draw(st.sampled_from([0.2, 0.5, 1.0, 2.0]))
    tau2 = data.draw(st.sampled_from([0.2, 0.5, 1.0, 2.0]))
    g = seeded(data.draw(st.integers(0, 2**31 - 1)))
    capacity = length - window
    total = (budget - window) * layers
    plan = RowPlan(total, window)
    previous: list[int] = []
    for layer in range(layers):
        sharp = float(torch.rand(1, generator=g)) * 20
        probs = torch.softmax(sharp * torch.randn(3, window, length, generator=g), dim=-1)[..., :capacity]
        plan.step(layer, cake_preference(probs, tau1, tau2), capacity)
        now = [plan.budgets[i] for i in range(layer + 1)]
        assert sum(now) == min(total, capacity * (layer + 1))
        assert all(0 <= b <= capacity for b in now)
        assert all(b <= old for b, old in zip(now, previous, strict=False))
        previous = now
    assert sum(previous) == total


def test_cake_preference_formula():
    probs = torch.softmax(torch.randn(4, 5, 9, generator=seeded(0)), dim=-1)
    a = probs.double().numpy()
    entropy = -(a * np.log(a + 1e-10)).sum()
    variance = a.var(axis=1, ddof=1).sum()
    assert cake_preference(probs, 1.0, 1.0) == pytest.approx(entropy * variance, rel=1e-9)
    assert cake_preference(probs, 0.5, 2.0) == pytest.approx(entropy**2 * variance**0.5, rel=1e-9)


def test_cake_options_are_checked():
    for bad in ({"window": 1}, {"gamma": -1.0}, {"tau1": 0.0}):
        with pytest.raises(MethodOptionError):
            make_method("cake", **bad)


# ------------------------------------------------------------------------------ reference
def avg_pool(xs: list[float], kernel: int) -> list[float]:
    r = kernel // 2
    return [sum(xs[i] for i in range(j - r, j + r + 1) if 0 <= i < len(xs)) / kernel for j in range(len(xs))]


def ref_cake_layer(inputs_l, gamma: float = GAMMA, gqa: str = "mean") -> tuple[list[list[float]], float]:
    """Eviction scores per KV head over the ``N − W`` candidates, and the layer preference (τ = 1)."""
    q, k, _ = (t[0].double().numpy() for t in inputs_l)
    m = N - W
    entropy = variance = 0.0
    scores = []
    for h in range(H):
        per_query = []
        for qh in range(h * G, (h + 1) * G):
            rows = []
            for i in range(N - W, N):
                row = ref_probs(q, k, qh, i)
                rows.append(row + [0.0] * (N - len(row)))
            stat = []
            for j in range(m):
                col = [rows[r][j] for r in range(W)]
                mean = sum(col) / W
                var = sum((x - mean) ** 2 for x in col) / (W - 1)
                entropy -= sum(x * math.log(x + 1e-10) for x in col)
                variance += var
                stat.append(mean + gamma * var)
            per_query.append(avg_pool(stat, KERNEL))
        if gqa == "mean":
            scores.append([sum(p[j] for p in per_query) / G for j in range(m)])
        else:
            scores.append([max(p[j] for p in per_query) for j in range(m)])
    return scores, entropy * variance


def ref_top(scores: list[float], count: int) -> set[int]:
    order = sorted(range(len(scores)), key=lambda j: -scores[j])
    check_cut([scores[j] for j in order], count)
    return set(order[:count])


def ref_cake(inputs, budget: int = BUDGET, **variant):
    layers = [ref_cake_layer(x, **variant) for x in inputs]
    steps = ref_cascade([p for _, p in layers], (budget - W) * LAYERS, N - W)
    kept = [
        [ref_top(layers[i][0][h], steps[-1][i]) | set(range(N - W, N)) for h in range(H)]
        for i in range(LAYERS)
    ]
    return steps, kept, layers


SEEDS = [2, 11]


@pytest.mark.parametrize("seed", SEEDS)
def test_cake_kept_sets_equal_reference(seed):
    inputs = make_inputs(seed)
    layers, session, steps = run_library("cake", OPTIONS, inputs)
    ref_steps, ref_kept, _ = ref_cake(inputs)
    for layer_idx, step in enumerate(steps):  # the cascade, step by step: every head of a layer alike
        assert step == [[b + W] * H for b in ref_steps[layer_idx]], layer_idx
    for layer_idx, layer in enumerate(layers):
        for h in range(H):
            k_h, v_h, pos = layer.head(h)
            pos = pos[0].tolist()
            assert pos == sorted(ref_kept[layer_idx][h]), (layer_idx, h)
            _, k, v = inputs[layer_idx]
            assert torch.equal(k_h[0], k[0, h, pos]) and torch.equal(v_h[0], v[0, h, pos])
    assert sum(ref_steps[-1]) == (BUDGET - W) * LAYERS
    assert len(set(ref_steps[-1])) > 1  # discriminating: dynamic layer budgets
    assert session.kept[0].tolist() == [[b + W] * H for b in ref_steps[-1]]
    assert all("cake_score" not in layer.state for layer in layers)


@pytest.mark.parametrize("seed", SEEDS)
def test_cake_reference_rejects_wrong_variants(seed):
    inputs = make_inputs(seed)
    _, kept, _ = ref_cake(inputs)
    for variant in ({"gamma": 0.0}, {"gqa": "max"}):
        _, wrong, _ = ref_cake(inputs, **variant)  # the seed is unambiguous under the variant too
        assert wrong != kept, variant


def test_cake_score_values_match_reference():
    inputs = make_inputs(SEEDS[0])
    q, k, v = inputs[2]
    layer = BudgetLayer()
    layer.update(k.clone(), v.clone())
    lib = make_method("cake", **OPTIONS).score(Observation(2, LAYERS, q, layer, SCALE))
    ref, _ = ref_cake_layer(inputs[2])
    np.testing.assert_allclose(lib[0, :, : N - W].double().numpy(), np.array(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_cake_decode_trims_each_layer_to_its_budget_by_the_current_query(seed):
    inputs = make_inputs(seed)
    layers, session, _ = run_library("cake", OPTIONS, inputs)
    ref_steps, ref_kept, _ = ref_cake(inputs)
    session.begin_decode()
    g = seeded(100 + seed)
    keys = [x[1][0].double().numpy() for x in inputs]
    values = [x[2][0].double().numpy() for x in inputs]
    entries = [[sorted(ref_kept[i][h]) for h in range(H)] for i in range(LAYERS)]
    for step in range(3):
        new = N + step
        for layer_idx, layer in enumerate(layers):
            k1, v1 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
            q1 = 2.0 * torch.randn(1, HQ, 1, D, generator=g)
            keys[layer_idx] = np.concatenate([keys[layer_idx], k1[0].double().numpy()], axis=1)
            values[layer_idx] = np.concatenate([values[layer_idx], v1[0].double().numpy()], axis=1)
            layer.update(k1, v1)
            session.after_attention(layer_idx, q1, layer, SCALE, layers)
            budget = ref_steps[-1][layer_idx]
            nq = q1[0, :, 0].double().numpy()
            for h in range(H):
                held = entries[layer_idx][h] + [new]
                candidates = held[: len(held) - W]
                per_query = []
                for qh in range(h * G, (h + 1) * G):
                    logits = [float(np.dot(nq[qh], keys[layer_idx][h, e])) * SCALE for e in held]
                    probs = dict(zip(held, softmax(logits), strict=True))
                    per_query.append(avg_pool([probs[e] for e in candidates], KERNEL))
                score = [sum(p[j] for p in per_query) / G for j in range(len(candidates))]
                keep = ref_top(score, budget)
                entries[layer_idx][h] = sorted({candidates[j] for j in keep} | set(held[len(held) - W :]))
                k_h, v_h, pos = layer.head(h)
                assert pos[0].tolist() == entries[layer_idx][h], (step, layer_idx, h)
                np.testing.assert_array_equal(
                    k_h[0].double().numpy(), keys[layer_idx][h, entries[layer_idx][h]]
                )
                np.testing.assert_array_equal(
                    v_h[0].double().numpy(), values[layer_idx][h, entries[layer_idx][h]]
                )
            assert layer.head_lengths()[0].tolist() == [budget + W] * H
    assert TOL > 0


# ------------------------------------------------------------------------------ the authors' τ
#: antgroup/cakekv experiments/LongBench/config/model2tau.json, written out again (their keys:
#: model2path.json's folder names; budgets: their --cache_size, window included)
MODEL2TAU = {
    "Qwen2.5-7B-Instruct": {128: (0.4, 0.6), 1024: (1.5, 0.6)},
    "Meta-Llama-3.1-8B-Instruct": {128: (1.6, 0.6), 1024: (1.6, 0.4)},
    "Llama-2-7b-chat-hf": {128: (0.9, 2.3), 1024: (1.9, 1.8)},
    "Llama-2-13b-chat-hf": {128: (1.8, 2.0), 1024: (0.5, 0.4)},
    "Mistral-7B-Instruct-v0.3": {128: (1.0, 0.8), 1024: (0.8, 0.5)},
}


def named_model(name: str) -> SimpleNamespace:
    """What ``prepare`` reads of a model: ``config._name_or_path``."""
    return SimpleNamespace(config=SimpleNamespace(_name_or_path=name))


@pytest.mark.parametrize(
    ("name", "checkpoint"),
    [
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B-Instruct"),
        ("qwen/qwen2.5-7b-instruct", "Qwen2.5-7B-Instruct"),
        ("/models/Llama-2-7b-chat-hf", "Llama-2-7b-chat-hf"),
        ("/models/Llama-2-13b-chat-hf/", "Llama-2-13b-chat-hf"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "Meta-Llama-3.1-8B-Instruct"),
        ("meta-llama/Llama-3.1-8B-Instruct", "Meta-Llama-3.1-8B-Instruct"),  # the hub's new name
        (
            "/root/.cache/huggingface/hub/models--mistralai--Mistral-7B-Instruct-v0.3",
            "Mistral-7B-Instruct-v0.3",
        ),
        ("/hf/hub/models--Qwen--Qwen2.5-7B-Instruct/snapshots/a09a3545", "Qwen2.5-7B-Instruct"),
        # not theirs: our models, other sizes and versions, base models, derived names
        ("HuggingFaceTB/SmolLM2-135M-Instruct", None),
        ("smollm2-135m", None),
        ("qwen2.5-coder-0.5b", None),
        ("qwen2.5-coder-1.5b", None),
        ("Qwen/Qwen2.5-Coder-0.5B-Instruct", None),
        ("Qwen/Qwen2.5-7B", None),
        ("Qwen/Qwen2.5-14B-Instruct", None),
        ("mistralai/Mistral-7B-Instruct-v0.2", None),
        ("Qwen/Qwen2.5-7B-Instruct-AWQ", None),
        ("", None),
    ],
)
def test_authors_checkpoint_names_only_their_models(name, checkpoint):
    assert authors_checkpoint(name) == checkpoint


def test_authors_taus_by_model_and_budget():
    for checkpoint, table in MODEL2TAU.items():
        cake = make_method("cake", authors_tau=True)
        run = cake.start(named_model(f"org/{checkpoint}"))
        assert cake.taus(run, 128) == table[128] and cake.taus(run, 1024) == table[1024], checkpoint
        # budgets they did not tune
        assert cake.taus(run, 256) == (1.0, 1.0) and cake.taus(run, 127) == (1.0, 1.0)
    unlisted = make_method("cake", authors_tau=True)
    run = unlisted.start(named_model("HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert unlisted.taus(run, 128) == (1.0, 1.0) and unlisted.taus(run, 1024) == (1.0, 1.0)
    own = make_method("cake", authors_tau=True, tau1=0.5, tau2=2.0)  # elsewhere the options stay
    run = own.start(named_model("Qwen/Qwen2.5-7B-Instruct"))
    assert own.taus(run, 128) == (0.4, 0.6) and own.taus(run, 512) == (0.5, 2.0)
    plain = make_method("cake", tau1=0.5, tau2=2.0)  # without authors_tau the table is not used
    assert plain.taus(plain.start(named_model("Qwen/Qwen2.5-7B-Instruct")), 128) == (0.5, 2.0)


def test_authors_tau_without_a_model_is_a_clear_error():
    cake = make_method("cake", authors_tau=True, window=W)
    with pytest.raises(UnknownMethodError) as info:
        cake.taus(cake.start(), 128)
    assert "method.start(model)" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UnknownMethodError, match=r"start\(model\)"):  # also when it compresses
        run_method(make_method("cake", authors_tau=True, window=W), make_long_inputs(0, 40), 20)
    plain = make_method("cake")
    assert plain.taus(plain.start(), 128) == (1.0, 1.0)  # no table needed without authors_tau


def make_long_inputs(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``q [1, HQ, n, D]``, ``k, v [1, H, n, D]``, each layer's queries of another sharpness."""
    g = seeded(seed)
    out = []
    for layer in range(LAYERS):
        k = torch.randn(1, H, n, D, generator=g)
        v = torch.randn(1, H, n, D, generator=g)
        q = (0.5, 1.5, 3.0, 5.0)[layer] * torch.randn(1, HQ, n, D, generator=g)
        out.append((q, k, v))
    return out


def run_method(method, inputs, budget: int, model=None) -> list[list[list[int]]]:
    """Prefill layer by layer through a session (its run started with ``model``, if any); per step,
    every layer's head lengths."""
    session = CompressionSession(method, LAYERS, budget=budget, model=model)
    layers: list[BudgetLayer] = []
    steps = []
    for layer_idx, (q, k, v) in enumerate(inputs):
        layer = BudgetLayer()
        layer.update(k.clone(), v.clone())
        layers.append(layer)
        session.after_attention(layer_idx, q, layer, SCALE, layers)
        steps.append([lay.head_lengths()[0].tolist() for lay in layers])
    return steps


def ref_preference(inputs_l, tau1: float, tau2: float) -> float:
    """CAKE Eq. (layer preference): ``(−Σ A log A)^(1/τ1) · (Σ var_rows A)^(1/τ2)`` over the window
    rows and the non-window keys of every query head, the window attention by hand."""
    q, k, _ = (t[0].double().numpy() for t in inputs_l)
    n = q.shape[1]
    entropy = variance = 0.0
    for qh in range(HQ):
        rows = [ref_probs(q, k, qh, i)[: n - W] for i in range(n - W, n)]
        for j in range(n - W):
            col = [row[j] for row in rows]
            mean = sum(col) / W
            variance += sum((x - mean) ** 2 for x in col) / (W - 1)
            entropy -= sum(x * math.log(x + 1e-10) for x in col)
    return entropy ** (1.0 / tau1) * variance ** (1.0 / tau2)


def test_cake_with_authors_tau_uses_their_preference():
    """Qwen2.5-7B-Instruct at budget 128: the cascade's layer budgets are those of the preference
    with the authors' ``(τ1, τ2) = (0.4, 0.6)``, not those of ``(1, 1)``."""
    n, budget = 200, 128
    inputs = make_long_inputs(1, n)
    cake = make_method("cake", authors_tau=True, window=W)
    steps = run_method(cake, inputs, budget, model=named_model("Qwen/Qwen2.5-7B-Instruct"))
    total, capacity = (budget - W) * LAYERS, n - W
    theirs = ref_cascade([ref_preference(x, 0.4, 0.6) for x in inputs], total, capacity)
    ours = ref_cascade([ref_preference(x, 1.0, 1.0) for x in inputs], total, capacity)
    for layer_idx, step in enumerate(steps):
        assert step == [[b + W] * H for b in theirs[layer_idx]], layer_idx
    assert theirs[-1] != ours[-1]  # discriminating: the temperatures change the layer budgets
    # at a budget they did not tune, τ = (1, 1)
    cake = make_method("cake", authors_tau=True, window=W)
    steps = run_method(cake, inputs, 100, model=named_model("Qwen/Qwen2.5-7B-Instruct"))
    plain = ref_cascade([ref_preference(x, 1.0, 1.0) for x in inputs], (100 - W) * LAYERS, capacity)
    assert steps[-1] == [[b + W] * H for b in plain[-1]]


def test_cake_authors_tau_on_a_named_tiny_model():
    """The engine binds the model's name: a tiny random Qwen2 named ``Qwen/Qwen2.5-7B-Instruct``
    gets the budgets of ``tau1 = 0.4, tau2 = 0.6`` at B = 128; unnamed, those of (1, 1)."""
    model = tiny_model("qwen2")
    ids = torch.randint(3, 90, (1, 300), generator=seeded(4))

    def budgets(method) -> torch.Tensor:
        return kvbudget.compress(model, ids, method=method, budget=128).session.kept[0]

    unnamed = budgets(make_method("cake", authors_tau=True, window=8))
    assert torch.equal(unnamed, budgets(make_method("cake", window=8)))
    model.config._name_or_path = "Qwen/Qwen2.5-7B-Instruct"
    named = budgets(make_method("cake", authors_tau=True, window=8))
    assert torch.equal(named, budgets(make_method("cake", window=8, tau1=0.4, tau2=0.6)))
    assert not torch.equal(named, unnamed)  # discriminating
    assert int(named.sum()) == int(unnamed.sum()) == 128 * model.config.num_hidden_layers * 2
