"""D2O and CaM: merge arithmetic, layer budgets (Eq. 5), eviction + merging against float64 references,
fixed-size decoding and the decode loop's cache trace.

References are computed here with numpy/explicit loops from the paper's formulas; they never call
kvbudget's scoring, allocation, selection or merging helpers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbudget
from conftest import seeded
from kvbudget.allocation import attention_variance, inverse_variance_layer_budgets
from kvbudget.cache import BudgetCache, BudgetLayer
from kvbudget.errors import MethodOptionError
from kvbudget.merging import d2o_merge
from kvbudget.methods.registry import make_method
from kvbudget.observation import Observation

H, G, N, D = 2, 2, 24, 8
HQ = H * G
SCALE = 1.0 / math.sqrt(D)
E = math.e


# ------------------------------------------------------------------------------ float64 references
def probs_row(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    logits = keys @ q * SCALE
    p = np.exp(logits - logits.max())
    return p / p.sum()


def prompt_column_sums(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``[HQ, N]``: attention each key received from every causal prompt query."""
    sums = np.zeros((HQ, N))
    for qh in range(HQ):
        for i in range(N):
            sums[qh, : i + 1] += probs_row(q[qh, i], k[qh // G, : i + 1])
    return sums


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def merge_reference(kc, vc, ke, ve, tau, beta):
    """Eq. 9–12 for one head with explicit loops. Returns new kc, vc, tau."""
    kc, vc = kc.copy(), vc.copy()
    best, nearest = [], []
    for i in range(len(ke)):
        sims = [cosine(ke[i], kc[j]) for j in range(len(kc))]
        nearest.append(int(np.argmax(sims)))
        best.append(max(sims))
    if tau is None:
        tau = sum(best) / len(best)
        merged = [b >= tau for b in best]
    else:
        merged = []
        for b in best:
            tau = beta * b + (1 - beta) * tau
            merged.append(b >= tau)
    out_k, out_v = kc.copy(), vc.copy()
    for j in range(len(kc)):
        members = [i for i in range(len(ke)) if merged[i] and nearest[i] == j]
        if not members:
            continue
        denominator = E + sum(math.exp(best[i]) for i in members)
        out_k[j] = (E * kc[j] + sum(math.exp(best[i]) * ke[i] for i in members)) / denominator
        out_v[j] = (E * vc[j] + sum(math.exp(best[i]) * ve[i] for i in members)) / denominator
    return out_k, out_v, tau


def fixture(seed: int):
    g = seeded(seed)
    k = torch.randn(1, H, N, D, generator=g)
    v = torch.randn(1, H, N, D, generator=g)
    q = 2.0 * torch.randn(1, HQ, N, D, generator=g)
    return k, v, q


def layer_of(k: torch.Tensor, v: torch.Tensor) -> BudgetLayer:
    layer = BudgetLayer()
    layer.update(k.clone(), v.clone())
    return layer


# ------------------------------------------------------------------------------ 1. merge arithmetic
def test_merge_arithmetic_on_a_hand_built_cache():
    """Two kept keys (1,0), (0,1); three evicted. Best similarities 3/√10, 4/√17, 1/√2 → τ_0 = their
    mean ≈ 0.875: the first two merge (into the first and second kept key), the third is dropped."""
    kept_k = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    kept_v = torch.tensor([[[1.0, 1.0], [-1.0, 2.0]]])
    ev_k = torch.tensor([[[3.0, 1.0], [1.0, 4.0], [1.0, -1.0]]])
    ev_v = torch.tensor([[[5.0, 0.0], [0.0, -3.0], [9.0, 9.0]]])
    out = d2o_merge(kept_k, kept_v, ev_k, ev_v, tau=None)
    u1, u2, u3 = 3 / math.sqrt(10), 4 / math.sqrt(17), 1 / math.sqrt(2)
    assert out.tau.item() == pytest.approx((u1 + u2 + u3) / 3, abs=1e-6)
    assert out.merged.tolist() == [[True, True, False]]
    assert out.nearest.tolist() == [[0, 1, 0]]
    w1, w2 = math.exp(u1), math.exp(u2)
    want_k = [
        [(E * 1 + w1 * 3) / (E + w1), (w1 * 1) / (E + w1)],
        [(w2 * 1) / (E + w2), (E * 1 + w2 * 4) / (E + w2)],
    ]
    want_v = [
        [(E * 1 + w1 * 5) / (E + w1), (E * 1) / (E + w1)],
        [(-E) / (E + w2), (E * 2 - w2 * 3) / (E + w2)],
    ]
    np.testing.assert_allclose(out.keys[0].numpy(), want_k, rtol=1e-6)
    np.testing.assert_allclose(out.values[0].numpy(), want_v, rtol=1e-6)
    # decode (on the original kept keys): one evicted entry, τ_1 = β·u + (1 − β)·τ_0, merged iff u ≥ τ_1
    tau0 = out.tau
    low = d2o_merge(kept_k, kept_v, torch.tensor([[[1.0, -1.0]]]), torch.ones(1, 1, 2), tau0, beta=0.7)
    assert low.tau.item() == pytest.approx(0.7 * u3 + 0.3 * tau0.item(), abs=1e-6)
    assert low.merged.tolist() == [[False]]  # u3 < τ_0, so u3 < τ_1
    assert torch.equal(low.keys, kept_k) and torch.equal(low.values, kept_v)  # dropped: bit-identical
    high = d2o_merge(kept_k, kept_v, torch.tensor([[[0.0, 2.0]]]), torch.ones(1, 1, 2), tau0, beta=0.7)
    assert high.tau.item() == pytest.approx(0.7 * 1.0 + 0.3 * tau0.item(), abs=1e-6)
    assert high.merged.tolist() == [[True]] and high.nearest.tolist() == [[1]]
    # u = 1, weight e, same as the kept key's: the plain average ((0, 1) + (0, 2)) / 2
    np.testing.assert_allclose(high.keys[0, 1].numpy(), [0.0, 1.5], atol=1e-7)
    np.testing.assert_allclose(high.values[0, 1].numpy(), [(-E + E) / (2 * E), (2 * E + E) / (2 * E)])
    assert torch.equal(high.keys[0, 0], kept_k[0, 0])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("threshold", [True, False])
def test_merge_matches_the_reference_on_random_tensors(seed, threshold):
    g = seeded(seed)
    kc, vc = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 4, generator=g)
    ke, ve = torch.randn(2, 9, 4, generator=g), torch.randn(2, 9, 4, generator=g)
    first = d2o_merge(kc, vc, ke, ve, None, threshold=threshold)
    ke2, ve2 = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    second = d2o_merge(first.keys, first.values, ke2, ve2, first.tau, beta=0.7, threshold=threshold)
    for h in range(2):
        rk, rv, tau = merge_reference(kc[h].double().numpy(), vc[h].double().numpy(), ke[h].double().numpy(),
                                      ve[h].double().numpy(), None, 0.7)  # fmt: skip
        if not threshold:  # every evicted entry merged: the reference with τ below every similarity
            nkc, nvc, nke, nve = (t[h].double().numpy() for t in (kc, vc, ke, ve))
            rk, rv, _ = merge_reference(nkc, nvc, nke, nve, -2.0, 0.0)
        np.testing.assert_allclose(first.keys[h].numpy(), rk, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(first.values[h].numpy(), rv, rtol=1e-5, atol=1e-6)
        assert first.tau[h].item() == pytest.approx(tau, abs=1e-6)
        rk2, rv2, tau2 = merge_reference(rk, rv, ke2[h].double().numpy(), ve2[h].double().numpy(), tau, 0.7)
        if threshold:
            np.testing.assert_allclose(second.keys[h].numpy(), rk2, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(second.values[h].numpy(), rv2, rtol=1e-5, atol=1e-6)
            assert second.tau[h].item() == pytest.approx(tau2, abs=1e-5)
    if threshold:
        assert 0 < int(first.merged.sum()) < first.merged.numel()  # the threshold really splits them


# ------------------------------------------------------------------------------ 3. layer budgets (Eq. 5)
@settings(max_examples=200, deadline=None)
@given(
    sigma=st.lists(st.floats(0.0, 1.0) | st.floats(0.0, 500.0), min_size=1, max_size=40),
    budget=st.integers(2, 500),
    length=st.integers(2, 4000),
)
def test_layer_budgets_follow_eq5_and_sum_to_the_total(sigma, budget, length):
    layers = len(sigma)
    budget = min(budget, length)
    total = budget * layers
    lower = min(max(math.ceil(0.01 * length), 2), budget)
    out = inverse_variance_layer_budgets(sigma, total, lower, length)
    assert int(out.sum()) == total
    assert int(out.min()) >= lower and int(out.max()) <= length
    weights = [math.exp(-(s - min(sigma))) for s in sigma]
    shares = [w / sum(weights) * total for w in weights]  # Eq. 5: softmax(−σ)·L·ρ·S
    if all(lower <= s <= length for s in shares):
        assert all(abs(int(b) - s) < 1 for b, s in zip(out, shares, strict=True))
    for i in range(layers):  # less variance never gets (more than rounding) less cache
        for j in range(layers):
            if sigma[i] < sigma[j]:
                assert int(out[i]) >= int(out[j]) - 1


def test_layer_budgets_with_raw_variances_far_apart_still_sum_to_the_total():
    # weights exp(−400) underflow: those layers sit at the floor, the total stays exact
    out = inverse_variance_layer_budgets([1.0, 3.0, 125.0, 400.0, 2.3], total=5 * 205, lower=11, upper=1024)
    assert int(out.sum()) == 5 * 205
    assert out.tolist()[2:4] == [11, 11]
    w = [math.exp(-0.0), math.exp(-2.0), math.exp(-1.3)]
    shares = [x / sum(w) * (5 * 205 - 22) for x in w]
    assert all(abs(b - s) < 1 for b, s in zip([out[0], out[1], out[4]], shares, strict=True))


def test_layer_budgets_clamp_and_share_the_excess_in_proportion():
    # raw variances: the softmax would give layer 0 nearly everything; it is capped at the prompt
    out = inverse_variance_layer_budgets([0.0, 5.0, 6.0], total=300, lower=10, upper=200)
    assert out.tolist()[0] == 200 and int(out.sum()) == 300
    # the other two share the remaining 100 above their floor in proportion exp(−5) : exp(−6), or sit at it
    rest = out.tolist()[1:]
    assert all(b >= 10 for b in rest)
    share1 = 100 * math.exp(-5) / (math.exp(-5) + math.exp(-6))
    assert abs(rest[0] - share1) < 1


def test_attention_variance_minmax_and_raw():
    sums = torch.tensor([[3.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 0.0, 0.0]])
    f = [np.var(row, ddof=1) for row in sums.numpy()]
    lo, hi = min(f), max(f)
    assert attention_variance(sums, "minmax") == pytest.approx(np.mean([(x - lo) / (hi - lo) for x in f]))
    assert attention_variance(sums, "raw") == pytest.approx(np.mean(f))


# ------------------------------------------------------------------------------ eviction + merging
def d2o_prefill(method, fixtures, budget, watcher=None):
    """Record every layer as the session does, then compress all of them; returns the layers and
    the run's state (its layer budgets and merge thresholds). ``watcher``: the run's merge watcher."""
    run = method.start()
    run.merge_watcher = watcher
    layers = []
    for i, (k, v, q) in enumerate(fixtures):
        layer = layer_of(k, v)
        method.record(Observation(i, len(fixtures), q, layer, SCALE, run=run), [budget])
        layers.append(layer)
    method.post_prefill(layers, [budget], run)
    return layers, run


@pytest.mark.parametrize("name", ["d2o", "d2o-nomerge", "d2o-uniform"])
def test_d2o_prefill_and_decode_match_the_reference(name):
    fixtures = [fixture(s) for s in (11, 12, 13)]
    method = make_method(name)
    budget = 12
    layers, run = d2o_prefill(method, fixtures, budget)
    # layer budgets: softmax of −σ (min-max normalised head variances of the column sums) · 3 · budget
    sums = [prompt_column_sums(q[0].double().numpy(), k[0].double().numpy()) for k, v, q in fixtures]
    sigma = []
    for s in sums:
        f = [np.var(row, ddof=1) for row in s]
        sigma.append(np.mean([(x - min(f)) / (max(f) - min(f)) for x in f]))
    weights = np.exp(-np.array(sigma))
    shares = weights / weights.sum() * 3 * budget
    planned = run.layer_budgets(0)
    if name == "d2o-uniform":
        assert planned == [budget] * 3
    else:
        assert sum(planned) == 3 * budget and np.all(np.abs(np.array(planned) - shares) < 1)
    beta = 0.7
    for li, ((k, v, _q), layer, s) in enumerate(zip(fixtures, layers, sums, strict=True)):
        size = planned[li]
        nk, nv = k[0].double().numpy(), v[0].double().numpy()
        rest = size - 4
        heavy = int(0.75 * rest)
        recent = rest - heavy
        for h in range(H):
            score = (s[2 * h] + s[2 * h + 1]) / 2  # GQA mean of the column sums
            middle = sorted(range(4, N - recent), key=lambda j: -score[j])
            assert score[middle[heavy - 1]] - score[middle[heavy]] > 1e-6  # no tie at the cut
            kept = sorted([0, 1, 2, 3, *middle[:heavy], *range(N - recent, N)])
            evicted = [j for j in range(N) if j not in kept]
            k_h, v_h, pos = layer.head(h)
            assert pos[0].tolist() == kept
            want_k, want_v = nk[h, kept], nv[h, kept]
            if name != "d2o-nomerge":
                ek, ev = nk[h, evicted], nv[h, evicted]
                want_k, want_v, _ = merge_reference(want_k, want_v, ek, ev, None, beta)
            np.testing.assert_allclose(k_h[0].double().numpy(), want_k, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(v_h[0].double().numpy(), want_v, rtol=1e-5, atol=1e-6)
            if name == "d2o-nomerge":  # unmerged entries are the original tensors, bit for bit
                np.testing.assert_array_equal(k_h[0].double().numpy(), nk[h, kept])
    # one decode step on layer 0: scores accumulate the new query's attention over the stored
    # (merged) keys; the lowest-scored non-protected entry is evicted and merged under τ_1
    g = seeded(5)
    k1, v1, q1 = (
        torch.randn(1, H, 1, D, generator=g),
        torch.randn(1, H, 1, D, generator=g),
        torch.randn(1, HQ, 1, D, generator=g),
    )
    layer = layers[0]
    before_k = [layer.head(h)[0][0].double().numpy() for h in range(H)]
    before_v = [layer.head(h)[1][0].double().numpy() for h in range(H)]
    before_s = layer.state["d2o_attention"][0].double().numpy()
    before_p = [layer.head(h)[2][0].tolist() for h in range(H)]
    taus = dict(run.tau.get(0, {}))
    layer.update(k1, v1)
    method.decode_step(Observation(0, 3, q1, layer, SCALE, run=run), [budget])
    size = planned[0]
    recent = (size - 4) - int(0.75 * (size - 4))
    for h in range(H):
        keys = np.concatenate([before_k[h], k1[0, h].double().numpy()])
        values = np.concatenate([before_v[h], v1[0, h].double().numpy()])
        score = np.concatenate([before_s[h], [0.0]])
        for qh in (2 * h, 2 * h + 1):
            score += probs_row(q1[0, qh, 0].double().numpy(), keys) / G
        candidates = list(range(4, len(keys) - recent))
        out = min(candidates, key=lambda j: score[j])
        stay = [j for j in range(len(keys)) if j != out]
        assert layer.head(h)[2][0].tolist() == [(before_p[h] + [N])[j] for j in stay]
        want_k, want_v = keys[stay], values[stay]
        if name != "d2o-nomerge":
            want_k, want_v, tau = merge_reference(want_k, want_v, keys[[out]], values[[out]],
                                                  float(taus[0][h]), beta)  # fmt: skip
            assert float(run.tau[0][0][h]) == pytest.approx(tau, abs=1e-6)
        np.testing.assert_allclose(layer.head(h)[0][0].double().numpy(), want_k, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer.head(h)[1][0].double().numpy(), want_v, rtol=1e-5, atol=1e-6)
        state = layer.state["d2o_attention"][0, h].double().numpy()
        np.testing.assert_allclose(state, score[stay], rtol=1e-5)


def test_cam_merges_evicted_values_into_the_next_entries():
    k, v, q = fixture(21)
    method = make_method("cam")
    layer = layer_of(k, v)
    budget, sinks = 10, 4
    method.compress_layer(Observation(0, 4, q, layer, SCALE), [budget])
    s = prompt_column_sums(q[0].double().numpy(), k[0].double().numpy())
    kept = [0, 1, 2, 3, *range(N - (budget - sinks), N)]
    evicted = [j for j in range(N) if j not in kept]
    draws = method.draws(0, evicted, H).double().numpy()  # the seeded draws (inputs, not arithmetic)
    span = budget - sinks
    merged_any = False
    for h in range(H):
        a = (s[2 * h] + s[2 * h + 1]) / 2
        values = v[0, h].double().numpy().copy()
        for i, e in enumerate(evicted):
            p = min(max(a[e] / a[kept].max(), 0.0), 1.0)
            if draws[h, i] < p:
                merged_any = True
                values[e + 1 : e + 1 + span] += values[e] / span
        k_h, v_h, pos = layer.head(h)
        assert pos[0].tolist() == kept
        np.testing.assert_array_equal(k_h[0].numpy(), k[0, h, kept].numpy())  # keys untouched
        np.testing.assert_allclose(v_h[0].double().numpy(), values[kept], rtol=1e-5, atol=1e-6)
    assert merged_any
    # decode steps: the oldest non-sink leaves; p from the attention accumulated so far (the new
    # query's over the stored entries added), the max over what stays; its value / 6 to the next 6
    g = seeded(3)
    held = [layer.head(h)[1][0].double().numpy() for h in range(H)]
    scores = [layer.state["cam_attention"][0, h].double().numpy() for h in range(H)]
    positions = list(kept)
    for step in range(3):
        k1, v1 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        q1 = 4.0 * torch.randn(1, HQ, 1, D, generator=g)
        keys_before = [layer.head(h)[0][0].double().numpy() for h in range(H)]
        layer.update(k1, v1)
        method.decode_step(Observation(0, 4, q1, layer, SCALE), [budget])
        positions.append(N + step)
        leaving = positions[sinks]
        stay = positions[:sinks] + positions[sinks + 1 :]
        (draw,) = method.draws(0, [leaving], H).double().numpy().T
        for h in range(H):
            keys = np.concatenate([keys_before[h], k1[0, h].double().numpy()])
            a = np.concatenate([scores[h], [0.0]])
            for qh in (2 * h, 2 * h + 1):
                a += probs_row(q1[0, qh, 0].double().numpy(), keys) / G
            values = np.concatenate([held[h], v1[0, h].double().numpy()])
            keep_idx = [i for i in range(len(positions)) if i != sinks]
            p = min(a[sinks] / a[keep_idx].max(), 1.0)
            if draw[h] < p:
                values[sinks + 1 : sinks + 1 + span] += values[sinks] / span
            held[h], scores[h] = values[keep_idx], a[keep_idx]
            assert layer.head(h)[2][0].tolist() == stay
            np.testing.assert_allclose(layer.head(h)[1][0].double().numpy(), held[h], rtol=1e-5, atol=1e-6)
        positions = stay


# ------------------------------------------------------------------------------ decoding
def test_cache_trace_is_flat_for_d2o_and_grows_for_the_full_cache(llama, chat_tokenizer):
    context = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
    d2o = kvbudget.generate(
        llama, chat_tokenizer, context, "What?", method="d2o", budget=30, max_new_tokens=20
    )
    assert len(d2o.cache_trace) == len(d2o.token_ids) - 1 > 5
    assert set(d2o.cache_trace) == {int(d2o.budgets.sum())}  # Σ_l S_l · kv_heads, every step
    assert int(d2o.budgets.sum()) == 30 * 4 * 2
    assert len(set(d2o.budgets.sum(1).tolist())) > 1  # layer budgets differ
    full = kvbudget.generate(llama, chat_tokenizer, context, "What?", method="full", max_new_tokens=20)
    per_step = 4 * 2  # layers × kv heads
    assert full.cache_trace == [(full.prompt_tokens + 1 + i) * per_step for i in range(len(full.cache_trace))]


def test_decode_loop_without_trace_decodes_the_same_tokens(llama, chat_tokenizer):
    """``trace=False`` (what the benchmarks time) only skips the per-step entry count."""
    from kvbudget.engine import build_prompt, decode_loop, prefill
    from kvbudget.session import CompressionSession

    prompt = build_prompt(chat_tokenizer, "The quick brown fox jumps over the lazy dog. " * 4, "What?")
    runs = []
    for trace in (True, False):
        session = CompressionSession(make_method("d2o"), llama.config.num_hidden_layers, budget=24)
        cache, logits, mask, last = prefill(llama, [prompt], session, chat_tokenizer.pad_token_id)
        runs.append(decode_loop(llama, cache, logits, mask, last, set(), 12, trace=trace))
    traced, untraced = runs
    assert untraced.generated == traced.generated and untraced.steps == traced.steps == 11
    assert len(traced.trace[0]) == 11 and untraced.trace == [[]]


@pytest.mark.integration
def test_d2o_holds_every_layer_at_its_budget_while_decoding_on_the_real_model(real_model):
    """Ratio 0.2, 40 greedy steps on smollm2 (the 512-step run is in docs/claims.md, D2O): after every
    step every layer's physical length equals its D2O budget, in every KV head."""
    from kvbudget.eval.tasks.perplexity import austen_ids

    model, tokenizer = real_model
    ids = torch.tensor([list(austen_ids(tokenizer)[1000:1400])])
    method = make_method("d2o")
    cache = kvbudget.compress(model, ids, method=method, ratio=0.2)
    planned = cache.session.run.layer_budgets(0)
    layers = model.config.num_hidden_layers
    assert len(planned) == layers and sum(planned) == layers * 80 and len(set(planned)) > 1
    size = cache.physical_bytes()
    token = ids[:, -1:]
    with torch.no_grad():
        for _ in range(40):
            token = model(token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
            for i, layer in enumerate(cache.layers):
                assert layer.physical_length == planned[i]
                assert layer.head_lengths()[0].tolist() == [planned[i]] * layer.num_heads
            assert cache.physical_bytes() == size
    assert isinstance(cache, BudgetCache) and cache.get_seq_length() == 400 + 40


def test_d2o_rejects_bad_options():
    with pytest.raises(MethodOptionError, match="beta"):
        make_method("d2o", beta=1.5)
    with pytest.raises(MethodOptionError, match="variance"):
        make_method("d2o", variance="entropy")


# ------------------------------------------------------------------------------ one-eviction fast path
def _layer_over_by_one(limit: int, scores: torch.Tensor, seed: int) -> BudgetLayer:
    g = seeded(seed)
    layer = BudgetLayer()
    layer.update(torch.randn(1, H, limit + 1, D, generator=g), torch.randn(1, H, limit + 1, D, generator=g))
    layer.state["d2o_attention"] = scores
    return layer


@pytest.mark.parametrize("name", ["d2o", "d2o-nomerge"])
@pytest.mark.parametrize("tied", [False, True])
def test_one_eviction_fast_path_equals_the_general_eviction(name: str, tied: bool) -> None:
    """The decode-step fast path evicts and merges exactly what the general top-k path does — also
    when unprotected scores tie (the latest tied slot leaves) — over several steps of τ updates."""
    limit = 14
    g = seeded(1)
    scores = torch.rand(1, H, limit + 1, generator=g)
    if tied:
        scores = (scores * 3).floor()  # many equal scores among the candidates
    fast_method, general_method = make_method(name), make_method(name)
    fast_run, general_run = fast_method.start(), general_method.start()
    for run in (fast_run, general_run):  # a τ from an earlier eviction
        run.tau[0] = {0: torch.full((H,), 0.1)}
    fast = _layer_over_by_one(limit, scores.clone(), seed=2)
    general = _layer_over_by_one(limit, scores.clone(), seed=2)
    for _ in range(3):
        assert fast_method._evict_one(fast_run, fast, 0, [limit])
        general_method.evict(general_run, general, 0, [limit])
        assert torch.equal(fast.positions, general.positions)
        assert torch.equal(fast.keys, general.keys) and torch.equal(fast.values, general.values)
        assert torch.equal(fast.state["d2o_attention"], general.state["d2o_attention"])
        if name == "d2o":
            assert torch.equal(fast_run.tau[0][0], general_run.tau[0][0])
        k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        new_score = torch.rand(1, H, 1, generator=g).floor() if tied else torch.rand(1, H, 1, generator=g)
        for layer in (fast, general):
            layer.update(k, v)
            layer.state["d2o_attention"] = torch.cat([layer.state["d2o_attention"][..., :-1], new_score], -1)
    # the fast path declines what it does not cover: two entries over, or an invalid entry
    assert not fast_method._evict_one(fast_run, fast, 0, [limit - 1])
    fast.positions = fast.positions.clone()
    fast.positions[0, 0, 3] = -1
    assert not fast_method._evict_one(fast_run, fast, 0, [limit])


def test_decoding_with_the_fast_path_equals_decoding_without_it(llama, chat_tokenizer, monkeypatch):
    context = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
    from kvbudget.methods.d2o import D2O

    original, calls = D2O._evict_one, {"fast": 0}

    def counting(self, *args):
        done = original(self, *args)
        calls["fast"] += done
        return done

    def run():
        return kvbudget.generate(
            llama, chat_tokenizer, context, "What?", method="d2o", budget=30, max_new_tokens=12,
            return_cache=True,
        )  # fmt: skip

    monkeypatch.setattr(D2O, "_evict_one", counting)
    fast = run()
    assert calls["fast"] >= 4 * (len(fast.token_ids) - 1) > 0  # every layer, every step
    monkeypatch.setattr(D2O, "_evict_one", lambda self, *args: False)
    general = run()
    assert fast.token_ids == general.token_ids
    for a, b in zip(fast.cache.layers, general.cache.layers, strict=True):
        assert torch.equal(a.positions, b.positions)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.state["d2o_attention"], b.state["d2o_attention"])


@pytest.mark.parametrize("weighting", ["paper", "authors"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_entry_merge_is_bit_identical_to_the_scatter_merge(dtype: torch.dtype, weighting: str) -> None:
    """A decode step's merge (one evicted entry per head) touches only the nearest kept row, with the
    general scatter's arithmetic: same bits, merged heads and dropped heads alike."""
    from kvbudget.merging import _merge_one, _merge_scatter

    g = seeded(4)
    for _ in range(5):
        kc, vc = torch.randn(4, 9, 6, generator=g).to(dtype), torch.randn(4, 9, 5, generator=g).to(dtype)
        ke, ve = torch.randn(4, 1, 6, generator=g).to(dtype), torch.randn(4, 1, 5, generator=g).to(dtype)
        best = torch.rand(4, 1, generator=g) * 2 - 1
        nearest = torch.randint(0, 9, (4, 1), generator=g)
        merged = torch.tensor([[True], [False], [True], [False]])
        one = _merge_one(kc, vc, ke, ve, best, nearest, merged, weighting)
        general = _merge_scatter(kc, vc, ke, ve, best, nearest, merged, weighting)
        for a, b, kept in zip(one, general, (kc, vc), strict=True):
            assert a.dtype == kept.dtype and torch.equal(a, b)
            changed = (a != kept).any(-1)  # [h, S]: only merged heads' nearest rows
            for h in range(4):
                rows = changed[h].nonzero().flatten().tolist()
                assert rows == ([int(nearest[h, 0])] if merged[h, 0] else [])


# ------------------------------------------------------------------------------ merge variants (issue #25)
def authors_merge_port(kc, vc, ke, ve, threshold, alpha=0.5, belta=0.5):
    """A small port of the merge step of the authors' ``D2O_LayerKVCache.__call__``
    (AIoT-MLSys-Lab/d2o, ``LMEval_kv_token_merge/modeling_llama3_7b_13b_d2o.py``) for one layer of
    one sequence: ``kc, vc: [h, S, d]`` kept, ``ke, ve: [h, E, d]`` evicted, ``threshold`` the
    layer's scalar (``None`` at the first eviction). Cosine nearest neighbour per head; one scalar
    threshold ``τ ← α·τ + β·mean(max sim)``; evicted entry ``i`` merged in every head iff its
    head-mean max similarity ≥ τ; ``torch.scatter_reduce(..., reduce="mean", include_self=True)``
    of ``sim·k_i`` into the kept keys (values alike). Returns new kc, vc, threshold (float64)."""
    kc, vc, ke, ve = (t.double() for t in (kc, vc, ke, ve))
    sim = (ke / ke.norm(dim=-1, keepdim=True)) @ (kc / kc.norm(dim=-1, keepdim=True)).transpose(-1, -2)
    max_values, max_indices = sim.max(dim=-1)  # [h, E]
    threshold = max_values.mean() if threshold is None else alpha * threshold + belta * max_values.mean()
    keep = max_values.mean(0) >= threshold  # [E]
    index = max_indices[:, keep][..., None].expand(-1, -1, kc.shape[-1])
    weight = max_values[:, keep][..., None]
    new_k = torch.scatter_reduce(kc, 1, index, weight * ke[:, keep], reduce="mean", include_self=True)
    new_v = torch.scatter_reduce(vc, 1, index, weight * ve[:, keep], reduce="mean", include_self=True)
    return new_k, new_v, threshold


def test_authors_weighting_is_a_scatter_mean_of_similarity_scaled_keys_by_hand():
    """The hand-built cache of the first test, every evicted entry merged (``threshold=False``):
    k_0 ← (k_0 + u1·k_e1 + u3·k_e3) / 3 and k_1 ← (k_1 + u2·k_e2) / 2 — no e, no exp."""
    kept_k = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    kept_v = torch.tensor([[[1.0, 1.0], [-1.0, 2.0]]])
    ev_k = torch.tensor([[[3.0, 1.0], [1.0, 4.0], [1.0, -1.0]]])
    ev_v = torch.tensor([[[5.0, 0.0], [0.0, -3.0], [9.0, 9.0]]])
    out = d2o_merge(kept_k, kept_v, ev_k, ev_v, tau=None, threshold=False, weighting="authors")
    u1, u2, u3 = 3 / math.sqrt(10), 4 / math.sqrt(17), 1 / math.sqrt(2)
    assert out.nearest.tolist() == [[0, 1, 0]] and out.merged.all()
    want_k = [[(1 + 3 * u1 + u3) / 3, (u1 - u3) / 3], [u2 / 2, (1 + 4 * u2) / 2]]
    want_v = [[(1 + 5 * u1 + 9 * u3) / 3, (1 + 9 * u3) / 3], [-1 / 2, (2 - 3 * u2) / 2]]
    np.testing.assert_allclose(out.keys[0].numpy(), want_k, rtol=1e-6)
    np.testing.assert_allclose(out.values[0].numpy(), want_v, rtol=1e-6)
    # one evicted entry, a decode step's path: unit keys at u = 0.8 → k_1 ← ((0, 1) + 0.8·(0.6, 0.8)) / 2
    # = (0.24, 0.82), shorter than either (‖·‖ ≈ 0.854): the scatter-mean shrinks keys
    one = d2o_merge(kept_k, kept_v, torch.tensor([[[0.6, 0.8]]]), torch.tensor([[[0.0, 0.0]]]), out.tau,
                    threshold=False, weighting="authors")  # fmt: skip
    assert one.nearest.tolist() == [[1]]
    np.testing.assert_allclose(one.keys[0].numpy(), [[1.0, 0.0], [0.24, 0.82]], rtol=1e-6)
    np.testing.assert_allclose(one.values[0, 1].numpy(), [-1 / 2, 2 / 2], rtol=1e-6)
    assert float(one.keys[0, 1].norm()) == pytest.approx(math.hypot(0.24, 0.82), rel=1e-6)
    assert torch.equal(one.keys[0, 0], kept_k[0, 0])  # untouched row: bit-identical


def test_authors_decision_is_one_threshold_per_layer_on_the_head_mean_similarity():
    """Two heads, kept keys e_x, e_y; evicted keys built with chosen best similarities
    head 0: (0.95, 0.25), head 1: (0.05, 0.85). τ_0 = 0.525 (mean of all four): head means 0.5 and
    0.55, so entry 0 is dropped and entry 1 merged *in both heads* — where the paper's per-head τ
    (0.6, 0.45) merges entry 0 of head 0 and entry 1 of head 1 only."""
    kept_k = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]] * 2)
    kept_v = torch.randn(2, 2, 3, generator=seeded(0))

    def evicted(*bests):  # best similarity b with e_x: (b, 0, √(1 − b²))
        return [[b, 0.0, math.sqrt(1 - b * b)] for b in bests]

    ev_k = torch.tensor([evicted(0.95, 0.25), evicted(0.05, 0.85)])
    ev_v = torch.ones(2, 2, 3)
    authors = d2o_merge(kept_k, kept_v, ev_k, ev_v, None, beta=0.5, decision="authors")
    assert authors.merged.tolist() == [[False, True], [False, True]]
    assert authors.tau.tolist() == pytest.approx([0.525, 0.525], abs=1e-6)
    paper = d2o_merge(kept_k, kept_v, ev_k, ev_v, None, decision="paper")
    assert paper.merged.tolist() == [[True, False], [False, True]]
    # next call, one entry per head with bests 0.8 / 0.3: τ_1 = 0.5·0.525 + 0.5·0.55 = 0.5375 ≤ 0.55,
    # merged in both heads (head 1's own 0.3 is far below τ)
    second = d2o_merge(kept_k, kept_v, torch.tensor([evicted(0.8), evicted(0.3)]), torch.ones(2, 1, 3),
                       authors.tau, beta=0.5, decision="authors")  # fmt: skip
    assert second.tau.tolist() == pytest.approx([0.5375, 0.5375], abs=1e-6)
    assert second.merged.tolist() == [[True], [True]]
    lower = d2o_merge(kept_k, kept_v, torch.tensor([evicted(0.7), evicted(0.3)]), torch.ones(2, 1, 3),
                      authors.tau, beta=0.5, decision="authors")  # fmt: skip
    assert lower.tau.tolist() == pytest.approx([0.5125, 0.5125], abs=1e-6)  # 0.5 < τ_1: dropped in both
    assert lower.merged.tolist() == [[False], [False]]
    assert torch.equal(lower.keys, kept_k) and torch.equal(lower.values, kept_v)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_authors_weighting_and_decision_match_a_port_of_the_authors_code(seed):
    g = seeded(seed)
    kc, vc = torch.randn(3, 7, 5, generator=g), torch.randn(3, 7, 5, generator=g)
    threshold = None
    for e_count in (12, 4, 1, 1):  # a prefill, a chunk, two decode steps
        ke, ve = torch.randn(3, e_count, 5, generator=g), torch.randn(3, e_count, 5, generator=g)
        tau = None if threshold is None else torch.full((3,), float(threshold))
        out = d2o_merge(kc, vc, ke, ve, tau, beta=0.5, weighting="authors", decision="authors")
        want_k, want_v, threshold = authors_merge_port(kc, vc, ke, ve, threshold)
        np.testing.assert_allclose(out.keys.double().numpy(), want_k.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.values.double().numpy(), want_v.numpy(), rtol=1e-5, atol=1e-6)
        assert out.tau.tolist() == pytest.approx([float(threshold)] * 3, abs=1e-6)
        kc, vc = out.keys, out.values
    assert not torch.equal(kc, vc)  # sanity: tensors were really carried through


def test_fixed_threshold_merges_exactly_the_entries_at_least_that_similar():
    g = seeded(3)
    kc, vc = torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)
    ke, ve = torch.randn(2, 20, 4, generator=g), torch.randn(2, 20, 4, generator=g)
    out = d2o_merge(kc, vc, ke, ve, None, threshold=False, fixed_threshold=0.5)
    for h in range(2):
        nk, nv, ek, ev = (t[h].double().numpy() for t in (kc, vc, ke, ve))
        best = [max(cosine(ek[i], nk[j]) for j in range(5)) for i in range(20)]
        assert out.merged[h].tolist() == [b >= 0.5 for b in best]
        take = [i for i in range(20) if best[i] >= 0.5]
        want_k, want_v, _ = merge_reference(nk, nv, ek[take], ev[take], -2.0, 0.0)  # τ below all: merge all
        np.testing.assert_allclose(out.keys[h].numpy(), want_k, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.values[h].numpy(), want_v, rtol=1e-5, atol=1e-6)
    assert 0 < int(out.merged.sum()) < out.merged.numel()


def _decode_steps(method, run, layers, budget, steps, seed=5):
    """``steps`` decode steps on layer 0 with random new entries; returns every key seen by position
    and head: ``{(h, position): key}``."""
    g = seeded(seed)
    added = {}
    for step in range(steps):
        k1, v1 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        q1 = torch.randn(1, HQ, 1, D, generator=g)
        for h in range(H):
            added[(h, N + step)] = k1[0, h, 0]
        layers[0].update(k1, v1)
        method.decode_step(Observation(0, 3, q1, layers[0], SCALE, run=run), [budget])
    return added


def test_heavy_targets_leave_sinks_and_recent_window_exact_and_match_the_reference():
    from kvbudget.methods.d2o import HEAVY, RECENT, SINK

    fixtures = [fixture(s) for s in (11, 12, 13)]
    budget = 12
    events = {"heavy": [], "all": []}
    heavy, every = make_method("d2o", merge_targets="heavy"), make_method("d2o")
    layers, heavy_run = d2o_prefill(heavy, fixtures, budget, watcher=events["heavy"].append)
    layers_all, every_run = d2o_prefill(every, fixtures, budget, watcher=events["all"].append)
    planned = heavy_run.layer_budgets(0)
    for li, ((k, v, _q), layer) in enumerate(zip(fixtures, layers, strict=True)):
        size = planned[li]
        recent = (size - 4) - int(0.75 * (size - 4))
        targets = list(range(4, size - recent))  # the heavy hitters' slots
        nk, nv = k[0].double().numpy(), v[0].double().numpy()
        for h in range(H):
            k_h, v_h, pos = layer.head(h)
            kept = pos[0].tolist()
            assert kept == layers_all[li].head(h)[2][0].tolist()  # merging never changes the kept set
            evicted = [j for j in range(N) if j not in kept]
            want_k, want_v, _ = merge_reference_targets(
                nk[h, kept], nv[h, kept], nk[h, evicted], nv[h, evicted], targets
            )
            np.testing.assert_allclose(k_h[0].double().numpy(), want_k, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(v_h[0].double().numpy(), want_v, rtol=1e-5, atol=1e-6)
            protected = [*range(4), *range(size - recent, size)]
            assert torch.equal(k_h[0, protected], k[0, h, [kept[j] for j in protected]])
            assert torch.equal(v_h[0, protected], v[0, h, [kept[j] for j in protected]])
            assert not torch.equal(k_h[0], k[0, h, kept])  # some heavy hitter received a merge
    # decode: the sinks and the recent window still hold their original keys, bit for bit
    added = _decode_steps(heavy, heavy_run, layers, budget, steps=6)
    _decode_steps(every, every_run, layers_all, budget, steps=6)
    size = planned[0]
    recent = (size - 4) - int(0.75 * (size - 4))
    for h in range(H):
        k_h, _, pos = layers[0].head(h)
        for slot in [*range(4), *range(size - recent, size)]:
            p = int(pos[0, slot])
            original = fixtures[0][0][0, h, p] if p < N else added[(h, p)]
            assert torch.equal(k_h[0, slot], original)
    # the hook saw every merge land on a heavy hitter; with every kept entry a target, some did not
    landed = {
        name: torch.cat([e.kinds.gather(1, e.result.nearest)[e.result.merged] for e in evs])
        for name, evs in events.items()
    }
    assert len(events["heavy"]) == 3 + 6 and bool((landed["heavy"] == HEAVY).all())
    assert all(e.evicted_keys.shape[:2] == e.result.merged.shape for e in events["heavy"])
    assert bool(((landed["all"] == SINK) | (landed["all"] == RECENT)).any())


def merge_reference_targets(kc, vc, ke, ve, targets):
    """Eq. 9–12 (first eviction, τ_0 = mean best) for one head with the nearest neighbour searched
    among the kept rows ``targets`` only."""
    best, nearest = [], []
    for i in range(len(ke)):
        sims = {j: cosine(ke[i], kc[j]) for j in targets}
        j = max(sims, key=sims.get)
        nearest.append(j)
        best.append(sims[j])
    tau = sum(best) / len(best)
    out_k, out_v = kc.copy(), vc.copy()
    for j in targets:
        members = [i for i in range(len(ke)) if best[i] >= tau and nearest[i] == j]
        if members:
            denominator = E + sum(math.exp(best[i]) for i in members)
            out_k[j] = (E * kc[j] + sum(math.exp(best[i]) * ke[i] for i in members)) / denominator
            out_v[j] = (E * vc[j] + sum(math.exp(best[i]) * ve[i] for i in members)) / denominator
    return out_k, out_v, tau


def test_fixed_threshold_above_one_keeps_exactly_what_no_merge_keeps():
    fixtures = [fixture(s) for s in (11, 12, 13)]
    budget = 12
    never, nomerge, d2o = (make_method("d2o", fixed_threshold=1.5), make_method("d2o-nomerge"),
                           make_method("d2o"))  # fmt: skip
    prefilled = [d2o_prefill(m, fixtures, budget) for m in (never, nomerge, d2o)]
    for method, (layers, run) in zip((never, nomerge, d2o), prefilled, strict=True):
        _decode_steps(method, run, layers, budget, steps=4)
    for a, b, c in zip(*(layers for layers, _ in prefilled), strict=True):
        assert torch.equal(a.positions, b.positions)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.state["d2o_attention"], b.state["d2o_attention"])
        assert not torch.equal(c.keys, b.keys)  # plain d2o does merge here


def test_d2o_rejects_bad_merge_options():
    with pytest.raises(MethodOptionError, match="merge_targets"):
        make_method("d2o", merge_targets="recent")
    with pytest.raises(MethodOptionError, match="weighting"):
        make_method("d2o", weighting="mean")
    with pytest.raises(MethodOptionError, match="decision"):
        make_method("d2o", decision="layer")
    with pytest.raises(MethodOptionError, match="fixed_threshold"):
        make_method("d2o", fixed_threshold=-2.0)
