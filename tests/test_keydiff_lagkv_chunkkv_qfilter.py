"""Reference tests for keydiff, lagkv, chunkkv and qfilter: the kept sets equal independent
computations written from the papers and the authors' code.

The references use float64 numpy copies of the raw tensors and explicit loops; they never call
kvbudget's scoring, allocation or selection helpers. Each case asserts a clear gap at the top-k cut
(``TOL``), so fp32 rounding cannot decide a membership, and the cases that could pass by accident
are checked to differ from a plausible wrong variant.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import seeded
from kvbudget.cache import BudgetLayer
from kvbudget.errors import MethodOptionError, ProfileError
from kvbudget.methods.registry import make_method
from kvbudget.observation import Observation

H, G, N, D = 2, 2, 48, 8  # KV heads, GQA group, prompt length, head dim
HQ = H * G
LAYERS = 4
SCALE = 1.0 / math.sqrt(D)
TOL = 1e-5


class Fixture:
    """Post-RoPE tensors of one layer (batch 1) and their float64 numpy copies."""

    def __init__(self, seed: int = 0, n: int = N) -> None:
        g = seeded(seed)
        self.k = torch.randn(1, H, n, D, generator=g)
        self.v = torch.randn(1, H, n, D, generator=g)
        self.q = 2.0 * torch.randn(1, HQ, n, D, generator=g)
        self.nk, self.nv, self.nq = (t[0].double().numpy() for t in (self.k, self.v, self.q))
        self.n = n

    def layer(self) -> BudgetLayer:
        layer = BudgetLayer()
        layer.update(self.k.clone(), self.v.clone())
        return layer

    def observation(self, layer: BudgetLayer, layer_idx: int = 0, run=None) -> Observation:
        return Observation(layer_idx, LAYERS, query=self.q, layer=layer, scaling=SCALE, run=run)

    def compress(self, method, budget: int, layer_idx: int = 0, run=None) -> BudgetLayer:
        """Compress a fresh copy of the layer; ``run``: a run state shared with other layers."""
        layer = self.layer()
        method.compress_layer(self.observation(layer, layer_idx, run), targets=[budget])
        return layer


def kept(layer: BudgetLayer) -> list[set[int]]:
    return [set(layer.head(h)[2][0].tolist()) for h in range(layer.num_heads)]


def top(scores: dict[int, float], k: int, exact_ties_to_earlier: bool = False) -> set[int]:
    """The ``k`` best entries, asserting a gap of ``TOL`` at the cut. ``exact_ties_to_earlier``:
    equal scores (max pooling copies one value to its neighbours) go to the earlier entry."""
    ranked = sorted(scores, key=lambda e: (-scores[e], e))
    if 0 < k < len(ranked):
        gap = scores[ranked[k - 1]] - scores[ranked[k]]
        assert gap > TOL or (exact_ties_to_earlier and gap == 0), f"tie at the cut ({gap}): pick another seed"
    return set(ranked[:k])


# ------------------------------------------------------------------------------------------ keydiff
def keydiff_reference(keys: np.ndarray, entries: list[int]) -> dict[int, float]:
    """−cos(k_i, mean of the unit keys) over ``entries`` of one head (arXiv:2504.15364)."""
    anchor = np.zeros(keys.shape[1])
    for e in entries:
        anchor += keys[e] / math.sqrt(sum(x * x for x in keys[e]))
    anchor /= len(entries)
    norm_a = math.sqrt(sum(x * x for x in anchor))
    return {e: -float(keys[e] @ anchor) / (math.sqrt(float(keys[e] @ keys[e])) * norm_a) for e in entries}


@pytest.mark.parametrize(("window", "sinks", "seed"), [(0, 0, 0), (4, 2, 1)])
def test_keydiff_keeps_keys_least_similar_to_the_mean_key(window: int, sinks: int, seed: int) -> None:
    fx = Fixture(seed)
    budget = 14
    layer = fx.compress(make_method("keydiff", window=window, sinks=sinks), budget)
    forced = set(range(sinks)) | set(range(N - window, N))
    for h in range(H):
        scores = keydiff_reference(fx.nk[h], list(range(N)))
        free = {e: s for e, s in scores.items() if e not in forced}
        want = forced | top(free, budget - len(forced))
        assert kept(layer)[h] == want
        # teeth: the raw dot product with the mean key (no normalisation) keeps another set
        mean = fx.nk[h].mean(0)
        assert top({e: -float(fx.nk[h][e] @ mean) for e in free}, budget - len(forced)) != want - forced


def test_keydiff_decode_recomputes_the_anchor_over_the_held_entries() -> None:
    fx = Fixture(2)
    budget = 12
    method = make_method("keydiff")
    layer = fx.compress(method, budget)
    held = kept(layer)
    keys = fx.nk
    g = seeded(9)
    for step in range(3):
        k1, v1 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        keys = np.concatenate([keys, k1[0].double().numpy()], axis=1)
        layer.update(k1, v1)
        obs = Observation(0, LAYERS, query=torch.randn(1, HQ, 1, D, generator=g), layer=layer, scaling=SCALE)
        method.decode_step(obs, row_budgets=[budget])
        for h in range(H):
            entries = sorted(held[h] | {N + step})
            held[h] = top(keydiff_reference(keys[h], entries), budget)
        assert kept(layer) == held


# -------------------------------------------------------------------------------------------- lagkv
def lag_partition_scores(states: np.ndarray, start: int, lag: int) -> list[float]:
    """Authors' ``_get_states_score`` for the partition at ``start`` of one head: each token's
    channels min-max normalised by the NEXT partition, std over channels (ddof 1), softmax."""
    ref = states[start + lag : start + 2 * lag]
    low, high = ref.min(0), ref.max(0)
    spread = []
    for t in range(start, start + lag):
        z = [(states[t, c] - low[c]) / (high[c] - low[c]) for c in range(states.shape[1])]
        mean = sum(z) / len(z)
        spread.append(math.sqrt(sum((x - mean) ** 2 for x in z) / (len(z) - 1)))
    top_s = max(spread)
    exps = [math.exp(s - top_s) for s in spread]
    return [e / sum(exps) for e in exps]


def lagkv_reference(fx: Fixture, h: int, budget: int, sinks: int, lag: int) -> set[int]:
    n = fx.n
    keep_sinks = set(range(min(sinks, n)))
    if n < sinks + 2 * lag:  # nothing to score: the most recent tokens
        return keep_sinks | set(range(n - (budget - len(keep_sinks)), n))
    partitions = (n - sinks) // lag - 1
    tail_start = sinks + partitions * lag
    tail = list(range(tail_start, n))
    if budget - sinks <= len(tail):
        return keep_sinks | set(tail[len(tail) - (budget - sinks) :])
    token: dict[int, float] = {}
    for p in range(partitions):
        start = sinks + p * lag
        ks = lag_partition_scores(fx.nk[h], start, lag)
        vs = lag_partition_scores(fx.nv[h], start, lag)
        for i in range(lag):
            token[start + i] = ks[i] + vs[i]
    rest = budget - sinks - len(tail)
    each, extra = divmod(rest, partitions)
    chosen: set[int] = set()
    next_best: dict[int, float] = {}
    for p in range(partitions):
        members = {e: token[e] for e in range(sinks + p * lag, sinks + (p + 1) * lag)}
        ranked = sorted(members, key=lambda e: -members[e])
        chosen |= top(members, each) if each else set()
        if extra:
            assert members[ranked[each]] - members[ranked[each + 1]] > TOL
            next_best[ranked[each]] = members[ranked[each]]
    if extra:  # the partitions whose next-best tokens score highest get one more
        chosen |= top(next_best, extra)
    return keep_sinks | set(tail) | chosen


@pytest.mark.parametrize(
    ("n", "budget", "seed"),
    [(48, 24, 0), (48, 26, 1), (48, 30, 2), (48, 10, 3), (16, 10, 4), (51, 25, 5)],
)
def test_lagkv_keeps_sinks_tail_and_an_even_share_of_each_partition(n: int, budget: int, seed: int) -> None:
    """Lag 8, 2 sinks. 48 tokens: 4 scored partitions and a tail of 14; budgets 24 (2 per
    partition), 26 and 30 (uneven splits), 10 (less than sinks + tail); 16 tokens: too short to
    score; 51 tokens: a tail of 17."""
    fx = Fixture(seed, n)
    layer = fx.compress(make_method("lagkv", sinks=2, lag_size=8), budget)
    for h in range(H):
        want = lagkv_reference(fx, h, budget, 2, 8)
        assert len(want) == budget
        assert kept(layer)[h] == want


def test_lagkv_reference_is_the_lagging_partition_not_the_own_one() -> None:
    """Teeth: normalising each partition by its own min/max keeps another set."""
    fx = Fixture(6)
    layer = fx.compress(make_method("lagkv", sinks=2, lag_size=8), 24)
    for h in range(H):  # shift the references onto the partitions themselves
        chosen = set()
        for p in range(4):
            start = 2 + p * 8
            shifted_k = np.concatenate([fx.nk[h][: start + 8], fx.nk[h][start : start + 8]])
            shifted_v = np.concatenate([fx.nv[h][: start + 8], fx.nv[h][start : start + 8]])
            ks, vs = lag_partition_scores(shifted_k, start, 8), lag_partition_scores(shifted_v, start, 8)
            chosen |= top({start + i: ks[i] + vs[i] for i in range(8)}, 2)
        assert kept(layer)[h] != {0, 1} | set(range(34, 48)) | chosen


def test_lagkv_rejects_a_lag_below_two() -> None:
    with pytest.raises(MethodOptionError, match="lag_size must be an integer ≥ 2"):
        make_method("lagkv", lag_size=1)


# ------------------------------------------------------------------------------------------ chunkkv
def snapkv_token_scores(fx: Fixture, w: int, kernel: int) -> list[list[float]]:
    """SnapKV's window score per KV head: the last ``w`` queries' softmax over their causal prefix,
    summed over the rows, GQA mean, max-pooled over the candidates ``[0, n − w)`` only."""
    n = fx.n
    out = []
    for h in range(H):
        per_head = [0.0] * (n - w)
        for qh in range(h * G, (h + 1) * G):
            for i in range(n - w, n):
                logits = [float(fx.nq[qh, i] @ fx.nk[h, j]) * SCALE for j in range(i + 1)]
                peak = max(logits)
                exps = [math.exp(x - peak) for x in logits]
                for j in range(n - w):
                    per_head[j] += exps[j] / sum(exps) / G
        r = kernel // 2
        out.append([max(per_head[max(0, j - r) : j + r + 1]) for j in range(n - w)])
    return out


def chunk_reference(token: list[float], chunk: int, rest: int) -> set[int]:
    """Whole chunks by summed score (a short last chunk by its mean × chunk), then the best tokens
    of the next chunk for what is left."""
    c = len(token)
    chunks = [list(range(s, min(s + chunk, c))) for s in range(0, c, chunk)]
    score = {i: sum(token[e] for e in members) / len(members) * chunk for i, members in enumerate(chunks)}
    chosen: set[int] = set()
    ranked = sorted(score, key=lambda i: -score[i])
    for pos, i in enumerate(ranked):
        left = rest - len(chosen)
        if left <= 0:
            break
        if pos + 1 < len(ranked):
            assert score[i] - score[ranked[pos + 1]] > TOL
        if len(chunks[i]) <= left:
            chosen |= set(chunks[i])
        else:
            chosen |= top({e: token[e] for e in chunks[i]}, left, exact_ties_to_earlier=True)
    return chosen


@pytest.mark.parametrize(("budget", "seed"), [(19, 0), (21, 1), (28, 2)])
def test_chunkkv_keeps_whole_chunks_of_layer_summed_snapkv_scores(budget: int, seed: int) -> None:
    """48 tokens, window 4, chunks of 5 (8 full and one of 4): budget 19 = 3 chunks, 21 = 3 chunks
    and the 2 best tokens of the 4th, 28 = 4 chunks and 4 tokens."""
    fx = Fixture(seed)
    w = 4
    layer = fx.compress(make_method("chunkkv", window=w, kernel=3, chunk_size=5), budget)
    per_head = snapkv_token_scores(fx, w, 3)
    token = [per_head[0][j] + per_head[1][j] for j in range(N - w)]
    want = chunk_reference(token, 5, budget - w) | set(range(N - w, N))
    assert kept(layer) == [want] * H
    # teeth: SnapKV's own per-head top-k keeps other entries
    snap = fx.compress(make_method("snapkv", window=w, kernel=3), budget)
    assert kept(snap) != kept(layer)


def test_chunkkv_over_keydiff_scores() -> None:
    fx = Fixture(3)
    layer = fx.compress(make_method("chunkkv", scorer="keydiff", window=4, chunk_size=6), 22)
    per_head = [keydiff_reference(fx.nk[h], list(range(N))) for h in range(H)]
    token = [per_head[0][j] + per_head[1][j] for j in range(N - 4)]
    assert kept(layer) == [chunk_reference(token, 6, 18) | set(range(N - 4, N))] * H


def test_chunkkv_reuse_shares_the_first_layer_of_each_group() -> None:
    method = make_method("chunkkv", window=4, kernel=3, chunk_size=5, reuse=2)
    fixtures = [Fixture(10 + layer_idx) for layer_idx in range(LAYERS)]
    run = method.start()  # one run over the layers: the reusing layers read what layer 0 / 2 kept
    layers = [fx.compress(method, 19, layer_idx, run) for layer_idx, fx in enumerate(fixtures)]
    own = []
    for fx in fixtures:
        per_head = snapkv_token_scores(fx, 4, 3)
        token = [per_head[0][j] + per_head[1][j] for j in range(N - 4)]
        own.append(chunk_reference(token, 5, 15) | set(range(N - 4, N)))
    assert [kept(layer)[0] for layer in layers] == [own[0], own[0], own[2], own[2]]
    assert own[1] != own[0] and own[3] != own[2]  # the reuse changed what layers 1 and 3 keep
    assert all(kept(layer)[0] == kept(layer)[1] for layer in layers)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scorer": "fastkv"}, "has no per-layer prefill score"),
        ({"scorer": "chunkkv"}, "scorer must be another scoring method"),
        ({"scorer": "keydiff", "kernel": 5}, "scorer 'keydiff' has no option kernel"),
        ({"chunk_size": 0}, "chunk_size must be an integer ≥ 1"),
        ({"scorer": "nope"}, "unknown method 'nope'"),
    ],
)
def test_chunkkv_refuses_bad_options(options: dict, message: str) -> None:
    with pytest.raises(MethodOptionError, match=message):
        make_method("chunkkv", **options)


# ------------------------------------------------------------------------------------------ qfilter
def filter_reference(queries: np.ndarray, kv_heads: int) -> np.ndarray:
    """The authors' ``make_filters.py`` in numpy: per query head the first right singular vector of
    the (uncentred) queries, its sign set by the majority sign of the first left singular vector;
    then the mean over each GQA group. Returned pointing WITH the queries (the authors store its
    negative and keep the smallest projections)."""
    hq, _, d = queries.shape
    out = np.zeros((hq, d))
    for h in range(hq):
        u, _, vh = np.linalg.svd(queries[h], full_matrices=False)
        out[h] = vh[0] if (u[:, 0] > 0).mean() > 0.5 else -vh[0]
    return out.reshape(kv_heads, hq // kv_heads, d).mean(1)


def test_query_directions_are_the_oriented_principal_query_direction_per_group() -> None:
    from kvbudget.profiles import query_directions

    g = seeded(0)
    offset = torch.randn(HQ, 1, D, generator=g) * 3.0  # queries concentrate along one direction
    queries = torch.randn(HQ, 40, D, generator=g) + offset
    got = query_directions(queries, H).numpy()
    want = filter_reference(queries.double().numpy(), H)
    np.testing.assert_allclose(got, want, atol=1e-9)
    # each direction points with the bulk of its queries
    for h in range(H):
        assert (queries[h * G].double().numpy() @ want[h] > 0).mean() > 0.5
    flipped = query_directions(-queries, H).numpy()
    np.testing.assert_allclose(flipped, -want, atol=1e-9)


def _recording_attention(store: dict):
    """A test-local attention function: records the query transformers hands to it (after the
    model's norms and RoPE) and computes exact causal attention."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        store[module.layer_idx] = query.detach().clone()
        group = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key.repeat_interleave(group, 1),
            value.repeat_interleave(group, 1),
            is_causal=True,
            scale=scaling,
        )
        return out.transpose(1, 2).contiguous(), None

    return attention


def _queries_seen_by_the_model(model, ids: list[int]) -> dict[int, torch.Tensor]:
    from transformers import AttentionInterface

    store: dict[int, torch.Tensor] = {}
    AttentionInterface.register("test_record_queries", _recording_attention(store))
    model.set_attn_implementation("test_record_queries")
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        model.set_attn_implementation("sdpa")
    return store


@pytest.fixture
def qfilter_profile(tmp_path, monkeypatch):
    """A tiny Llama, two folded prompts and the profile `kvbudget profile` would write for them."""
    from conftest import tiny_model
    from kvbudget.profile_prompts import BUILTIN_CODE, BUILTIN_TEXT
    from kvbudget.profiles import build_profile, folded_prompt, save_profile

    monkeypatch.setenv("KVBUDGET_HOME", str(tmp_path / "home"))
    model = tiny_model("llama", seed=1)
    prompts = [
        folded_prompt("text", BUILTIN_TEXT, "text", model.config.vocab_size, limit=120),
        folded_prompt("code", BUILTIN_CODE, "code", model.config.vocab_size, limit=80),
    ]
    path = save_profile(build_profile(model, prompts), tmp_path / "p.json")
    return model, prompts, path


def test_profile_filters_come_from_the_queries_the_model_uses(qfilter_profile) -> None:
    model, prompts, path = qfilter_profile
    seen = [_queries_seen_by_the_model(model, list(p.ids)) for p in prompts]
    data = json.loads(path.read_text())
    assert data["model"]["head_dim"] == 16
    stored = np.array(data["query_filters"])
    assert stored.shape == (LAYERS, 2, 16)
    for layer in range(LAYERS):
        queries = np.concatenate([s[layer][0].double().numpy() for s in seen], axis=1)  # [hq, T, d]
        np.testing.assert_allclose(stored[layer], filter_reference(queries, 2), atol=2e-6)
    # teeth: the pre-RoPE queries (q_proj's output) give other directions
    pre = {}
    attn = model.model.layers[1].self_attn
    handle = attn.q_proj.register_forward_hook(lambda m, a, out: pre.setdefault("q", out.detach()))
    with torch.no_grad():
        model(torch.tensor([list(prompts[0].ids)]))
    handle.remove()
    pre_q = pre["q"][0].reshape(-1, 4, 16).transpose(0, 1).double().numpy()
    post_q = seen[0][1][0].double().numpy()
    assert not np.allclose(filter_reference(pre_q, 2), filter_reference(post_q, 2), atol=1e-3)


def test_qfilter_keeps_the_window_and_the_largest_projections_then_decodes(qfilter_profile) -> None:
    import kvbudget

    model, _, path = qfilter_profile
    filters = np.array(json.loads(path.read_text())["query_filters"])
    ids = torch.randint(3, 90, (1, 61), generator=seeded(4))
    n, budget, window = 60, 20, 4
    full = kvbudget.compress(model, ids, method="full", budget=100)  # keys of all 61 tokens
    method = make_method("qfilter", window=window, profile=str(path))
    cache = kvbudget.compress(model, ids[:, :n], method=method, budget=budget)
    held = []
    for layer_idx in range(LAYERS):
        per_head = []
        for h in range(2):
            keys = full.layers[layer_idx].head(h)[0][0].double().numpy()
            proj = {e: float(keys[e] @ filters[layer_idx, h]) for e in range(n - window)}
            want = top(proj, budget - window) | set(range(n - window, n))
            assert set(cache.layers[layer_idx].head(h)[2][0].tolist()) == want
            # one decode step: the new token enters the window, the entry leaving it competes
            entries = want | {n}
            proj = {e: float(keys[e] @ filters[layer_idx, h]) for e in entries if e < n + 1 - window}
            per_head.append(top(proj, budget - window) | set(range(n + 1 - window, n + 1)))
        held.append(per_head)
    with torch.no_grad():
        model(ids[:, n:], past_key_values=cache)
    assert [[set(layer.head(h)[2][0].tolist()) for h in range(2)] for layer in cache.layers] == held
    # teeth: the opposite orientation (the authors' stored −f taken as is) keeps other entries
    keys = full.layers[0].head(0)[0][0].double().numpy()
    assert top({e: -float(keys[e] @ filters[0, 0]) for e in range(n - window)}, budget - window) != (
        set(cache.layers[0].head(0)[2][0].tolist()) - set(range(n - window, n + 1))
    )


def test_qfilter_profile_errors_name_the_command(qfilter_profile, tmp_path) -> None:
    import kvbudget

    model, _, path = qfilter_profile
    ids = torch.randint(3, 90, (1, 40), generator=seeded(5))
    missing = make_method("qfilter", window=4, profile=str(tmp_path / "none.json"))
    with pytest.raises(ProfileError, match=r"does not exist; run `kvbudget profile"):
        kvbudget.compress(model, ids, method=missing, budget=20)
    data = json.loads(path.read_text())
    del data["query_filters"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"has no query filters .*`kvbudget profile --model"):
        kvbudget.compress(model, ids, method=make_method("qfilter", window=4, profile=str(old)), budget=20)
    data = json.loads(path.read_text())
    data["query_filters"][0][1] = data["query_filters"][0][1][:-1]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"'query_filters' must be a list of shape \[4\]\[2\]\[16\]"):
        kvbudget.compress(model, ids, method=make_method("qfilter", window=4, profile=str(bad)), budget=20)
    data["query_filters"][0][1] = [2.0] * 16
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"holds 2.0, not a number in \[-1, 1\]"):
        kvbudget.compress(model, ids, method=make_method("qfilter", window=4, profile=str(bad)), budget=20)


def test_qfilter_without_a_profile_file_measures_the_bundled_prompts(qfilter_profile) -> None:
    """As BaKlaVa: no file → a profile of the two bundled prompts, built on the fly, with filters."""
    import kvbudget
    from kvbudget.profiles import builtin_profile

    model, _, _ = qfilter_profile
    ids = torch.randint(3, 90, (1, 40), generator=seeded(6))
    method = make_method("qfilter", window=4)
    cache = kvbudget.compress(model, ids, method=method, budget=20)
    assert torch.equal(cache.session.run.filters, builtin_profile(model).filters())
