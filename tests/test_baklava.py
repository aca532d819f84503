"""BaKlaVa / SqueezeAttention: profiles, Algorithm 2, the layer split, errors, tuning (tiny models)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import kvbudget
from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.allocation import baklava_reallocate, kmeans_1d, squeeze_layer_weights
from kvbudget.cli import app
from kvbudget.errors import BudgetError, MethodOptionError, ProfileError
from kvbudget.methods.profiled import ProfiledRun, bounded_budgets
from kvbudget.methods.registry import make_method
from kvbudget.profiles import (
    Profile,
    build_profile,
    builtin_profile,
    config_hash,
    kv_importance,
    load_profile,
    measure,
    prompt_from_spec,
    save_profile,
)
from kvbudget.tuning import tune


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """No default profile from the user's $KVBUDGET_HOME leaks into these tests."""
    monkeypatch.setenv("KVBUDGET_HOME", str(tmp_path / "home"))


def _profile(model, tok=None):
    tok = tok or tiny_tokenizer()
    return build_profile(
        model, [prompt_from_spec("builtin-text:200", tok), prompt_from_spec("builtin-code:150", tok)]
    )


# ---------------------------------------------------------------------------- Algorithm 2
def test_algorithm_2_on_hand_built_importances():
    # 6 caches with equal budgets 100; t = 0.3 → caches 0, 2 and 5 are low (n = 3), k = min(3, 3) = 3
    importance = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.4, 0.05])
    out = baklava_reallocate(importance, torch.full((6,), 100.0), t=0.3, r=0.5)
    # each low cache loses 50; Δr = n·r/k = 3·50/3 = 50 to each of the 3 high ones
    assert out.tolist() == [50.0, 150.0, 50.0, 150.0, 150.0, 50.0]
    # t = 0.45: 4 low caches (n = 4), k = min(4, 2) = 2 → the two high ones get 4·25/2 = 50 each
    out = baklava_reallocate(importance, torch.full((6,), 100.0), t=0.45, r=0.25)
    assert out.tolist() == [75.0, 150.0, 75.0, 150.0, 75.0, 75.0]
    # t = 0.15: n = 2 low (0.1, 0.05), k = 2 → the two most important (0.9, 0.5) get 2·80/2 = 80 each
    out = baklava_reallocate(importance, torch.full((6,), 100.0), t=0.15, r=0.8)
    assert out.tolist() == pytest.approx([20.0, 180.0, 100.0, 180.0, 100.0, 20.0])


def test_algorithm_2_leaves_allocations_unchanged_when_all_or_none_are_low():
    importance = torch.tensor([0.1, 0.2, 0.3])
    base = torch.tensor([10.0, 20.0, 30.0])
    assert baklava_reallocate(importance, base, t=0.5, r=0.5).tolist() == base.tolist()  # all low
    assert baklava_reallocate(importance, base, t=0.05, r=0.5).tolist() == base.tolist()  # none low


def test_algorithm_2_inside_one_layer_by_hand():
    """Paper Alg. 2 on one layer of 4 caches, base b: low heads give r·b, k receivers get n·r·b/k."""
    # importances [0.9, 0.1, 0.5, 0.05], t = 0.3 → low L = {1, 3}, n = 2, k = min(2, 4 − 2) = 2:
    # receivers are the 2 most important, heads 0 (0.9) and 2 (0.5); r = 0.5
    importance = torch.tensor([0.9, 0.1, 0.5, 0.05])
    out = baklava_reallocate(importance, torch.full((4,), 32.0), t=0.3, r=0.5)
    # low: 32 − 0.5·32 = 16; receivers: 32 + 2·0.5·32/2 = 48
    assert out.tolist() == [48.0, 16.0, 48.0, 16.0]
    # n = 3 low (t = 0.6), k = min(3, 1) = 1: head 0 alone gets 3·0.25·32 = 24
    out = baklava_reallocate(importance, torch.full((4,), 32.0), t=0.6, r=0.25)
    assert out.tolist() == [56.0, 24.0, 24.0, 24.0]


def _clamped_reference(shares: list[float], total: int, capacity: int) -> list[float]:
    """Real-valued ``clamp(λ·s, 1, capacity)`` summing to ``total``, λ by plain bisection."""
    lo_l, hi_l = 0.0, 1.0
    f = lambda lam: sum(min(max(lam * s, 1.0), capacity) for s in shares)  # noqa: E731
    while f(hi_l) < total:  # every share is positive: f reaches m·capacity
        hi_l *= 2
    for _ in range(200):
        mid = (lo_l + hi_l) / 2
        lo_l, hi_l = (mid, hi_l) if f(mid) < total else (lo_l, mid)
    return [min(max(hi_l * s, 1.0), capacity) for s in shares]


@settings(max_examples=200, deadline=None)
@given(
    importance=st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=16),
    t=st.floats(0, 1),
    r=st.floats(0, 1),
    budget=st.integers(1, 300),
    capacity=st.integers(1, 400),
)
def test_one_layers_budgets_sum_to_its_total_within_bounds(importance, t, r, budget, capacity):
    imp = torch.tensor(importance, dtype=torch.float64)
    m = imp.numel()
    alloc = baklava_reallocate(imp, torch.ones(m, dtype=torch.float64), t, r)
    assert float(alloc.sum()) == pytest.approx(m, rel=1e-9)
    assert bool((alloc >= 0).all())
    b = min(budget, capacity)  # the split never gives a layer more than the tokens seen
    budgets = bounded_budgets(alloc, b * m, capacity)
    assert int(budgets.sum()) == b * m
    assert int(budgets.max()) <= capacity and int(budgets.min()) >= 1
    if bool((alloc > 0).all()):  # proportional up to the bounds: within one entry of the real split
        ref = _clamped_reference(alloc.tolist(), b * m, capacity)
        assert all(abs(x - y) < 1 + 1e-6 for x, y in zip(budgets.tolist(), ref, strict=True))


@settings(max_examples=100, deadline=None)
@given(
    sims=st.lists(st.floats(-1, 1, allow_nan=False), min_size=1, max_size=12),
    p=st.floats(0.05, 1.0),
)
def test_squeeze_split_keeps_the_mean_and_kmeans_is_optimal(sims, p):
    weights = squeeze_layer_weights(sims, p)
    assert sum(weights) == pytest.approx(len(sims))
    if len(sims) >= 3:
        labels = kmeans_1d(sims, 3)
        # brute force over every labelling into 3 contiguous runs of the sorted values
        xs = sorted(sims)

        def sse(run):
            mean = sum(run) / len(run)
            return sum((x - mean) ** 2 for x in run)

        best = min(
            sse(xs[:i]) + sse(xs[i:j]) + sse(xs[j:])
            for i in range(1, len(xs) - 1)
            for j in range(i + 1, len(xs))
        )
        got = sum(sse([s for s, lab in zip(sims, labels, strict=True) if lab == c]) for c in range(3))
        assert got == pytest.approx(best, abs=1e-9)


def test_squeeze_split_by_hand():
    sims = [0.5, 0.9, 0.91, 0.2, 0.52, 0.89]
    assert kmeans_1d(sims, 3) == [1, 2, 2, 0, 1, 2]
    weights = squeeze_layer_weights(sims, 0.4)
    # 3 layers keep 0.4, the other 3 share (6 − 1.2) / 3 = 1.6
    assert weights == pytest.approx([1.6, 0.4, 0.4, 1.6, 1.6, 0.4])


# ---------------------------------------------------------------------------- profiles
def test_head_similarity_matches_an_independent_computation():
    model = tiny_model("qwen2")
    ids = list(range(3, 60))
    head_sim, layer_sim = measure(model, ids)
    # recompute layer 1 by hand: eager attention on the layer's own q/k/v projections
    captured = {}
    layer = model.model.layers[1]
    handle = layer.register_forward_pre_hook(
        lambda m, a, k: captured.__setitem__("x", (a[0] if a else k["hidden_states"]).detach()),
        with_kwargs=True,
    )
    with torch.no_grad():
        model(torch.tensor([ids]))
        handle.remove()
        x = captured["x"][0]
        h = layer.input_layernorm(x)
        attn = layer.self_attn
        t, d = h.shape[0], 16
        q = attn.q_proj(h).view(t, 4, d).transpose(0, 1)
        k = attn.k_proj(h).view(t, 2, d).transpose(0, 1)
        v = attn.v_proj(h).view(t, 2, d).transpose(0, 1)
        cos, sin = model.model.rotary_emb(h[None], torch.arange(t)[None])
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, vv = k[0].repeat_interleave(2, 0), v.repeat_interleave(2, 0)
        logits = q[0] @ k.transpose(-1, -2) / d**0.5
        logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        out = torch.softmax(logits, -1) @ vv  # [hq, t, d]
        expected = (torch.nn.functional.cosine_similarity(vv, out, dim=-1).mean(-1) + 1) / 2
        a = attn.o_proj(out.transpose(0, 1).reshape(t, -1))
        expected_layer = torch.nn.functional.cosine_similarity(x, x + a, dim=-1).mean()
    assert torch.allclose(head_sim[1].float(), expected, atol=1e-5)
    assert float(layer_sim[1]) == pytest.approx(float(expected_layer), abs=1e-5)
    assert kv_importance(head_sim, 2)[1].tolist() == pytest.approx(
        [1 - float(expected[:2].mean()), 1 - float(expected[2:].mean())], abs=1e-5
    )


def test_profiling_is_deterministic_and_plain_json(tmp_path):
    model = tiny_model()
    a = save_profile(_profile(model), tmp_path / "a.json")
    b = save_profile(_profile(tiny_model()), tmp_path / "b.json")
    assert a.read_bytes() == b.read_bytes()
    data = json.loads(a.read_text())
    assert data["model"]["config_hash"] == config_hash(model.config)
    assert [p["kind"] for p in data["prompts"]] == ["text", "code"]
    assert data["prompts"][1]["tokens"] == 150
    assert data["kvbudget_version"] == kvbudget.__version__
    assert len(data["per_prompt"]) == 2 and len(data["kv_importance"]) == 4
    assert load_profile(a, model).kv_importance == data["kv_importance"]


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda text: text[: len(text) // 2], "is not valid JSON"),
        (lambda text: "[1, 2, 3]", "is not a kvbudget profile"),
        (lambda text: text.replace('"format_version": 1', '"format_version": 9'), "format version 9"),
        (
            lambda text: _edit(text, lambda d: d["kv_importance"].pop()),
            "'kv_importance' must be a list of shape [4][2]",
        ),
        (lambda text: _edit(text, lambda d: d["head_similarity"][0].__setitem__(0, "x")), "non-numeric"),
        (lambda text: _edit(text, lambda d: d["layer_similarity"].__setitem__(2, 7.5)), "outside [0, 1]"),
        (lambda text: _edit(text, lambda d: d["model"].pop("num_kv_heads")), "'model' must give"),
        (lambda text: "\x00\xff garbage", "not valid JSON"),
    ],
)
def test_a_corrupted_profile_is_a_clear_error(tmp_path, mutate, words):
    model = tiny_model()
    path = save_profile(_profile(model), tmp_path / "p.json")
    path.write_text(mutate(path.read_text()))
    with pytest.raises(ProfileError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_profile(path, model)
    # and through the public API: an error before any forward, never deep in torch
    with pytest.raises(ProfileError):
        kvbudget.compress(
            model, torch.randint(3, 90, (1, 50)), method=make_method("baklava", profile=str(path))
        )


def _edit(text, fn):
    data = json.loads(text)
    fn(data)
    return json.dumps(data)


def test_a_profile_of_another_model_is_refused(tmp_path):
    llama, qwen = tiny_model("llama"), tiny_model("qwen2")
    path = save_profile(_profile(llama), tmp_path / "llama.json")
    with pytest.raises(ProfileError, match="was made for model .* not for"):
        load_profile(path, qwen)
    with pytest.raises(ProfileError, match="config hash"):
        kvbudget.compress(
            qwen, torch.randint(3, 90, (1, 50)), method=make_method("baklava", profile=str(path))
        )
    with pytest.raises(ProfileError, match="does not exist"):
        kvbudget.compress(
            qwen,
            torch.randint(3, 90, (1, 50)),
            method=make_method("squeezeattention", profile="/no/such.json"),
        )


def test_cli_profile_errors_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = CliRunner().invoke(app, ["tune", "--ratio", "0.3", "--model", str(tmp_path / "nomodel")])
    assert result.exit_code == 2
    result = CliRunner().invoke(app, ["tune", "--ratio", "0.3", "--method", "snapkv"])
    assert result.exit_code == 2 and "cannot tune 'snapkv'" in result.output


# ---------------------------------------------------------------------------- methods
# The tiny model's 4 layers, set by hand: layer similarities [0.5, 0.9, 0.2, 0.88] cluster (exact
# 1-D k-means, sorted 0.2 | 0.5 | 0.88, 0.9) with layers 1 and 3 in the most-similar cluster.
TINY_LAYER_SIMS = [0.5, 0.9, 0.2, 0.88]
TINY_IMPORTANCE = [[0.1, 0.6], [0.7, 0.2], [0.1, 0.2], [0.4, 0.5]]


def _tiny_hand_profile(model, tmp_path):
    """The model's measured profile with hand-set KV importances and layer similarities, saved."""
    profile = _profile(model)
    profile.kv_importance = [row[:] for row in TINY_IMPORTANCE]
    profile.layer_similarity = list(TINY_LAYER_SIMS)
    return save_profile(profile, tmp_path / "hand.json")


def test_baklava_budgets_follow_the_profile(tmp_path):
    model = tiny_model()
    path = _tiny_hand_profile(model, tmp_path)
    ids = torch.randint(3, 90, (1, 120), generator=seeded(1))
    method = make_method("baklava", profile=str(path), t=0.3, r=0.5, p=0.5)
    cache = kvbudget.compress(model, ids, method=method, budget=24)
    # split, p = 0.5: layers 1, 3 keep 0.5·24 = 12, layers 0, 2 get 24·(4 − 2·0.5)/2 = 36 per head
    # Alg. 2 per layer (t 0.3, r 0.5): layer 0 [0.1, 0.6] → head 0 gives 18 to head 1: [18, 54];
    # layer 1 [0.7, 0.2] → [18, 6]; layer 2 [0.1, 0.2] all low → [36, 36]; layer 3 none low → [12, 12]
    expected = [[18, 54], [18, 6], [36, 36], [12, 12]]
    assert cache.stats().entries.long().tolist() == expected
    # StreamingLLM inside each cache: the first 4 and the most recent entries
    for i, layer in enumerate(cache.layers):
        for h in range(2):
            pos = layer.head(h)[2][0]
            b = expected[i][h]
            assert pos.tolist() == list(range(4)) + list(range(120 - (b - 4), 120))


def test_a_cache_capped_at_the_prompt_keeps_the_prefills_plan_while_decoding(tmp_path):
    model = tiny_model()
    path = _tiny_hand_profile(model, tmp_path)
    ids = torch.randint(3, 90, (1, 60), generator=seeded(4))
    cache = kvbudget.compress(
        model, ids, method=make_method("baklava", profile=str(path), t=0.3, r=0.5, p=0.5), budget=36
    )
    # split: [54, 18, 54, 18]; layer 0 wants [27, 81] but head 1 stops at the 60 prompt tokens and
    # head 0 takes the 108 − 60 = 48 left; layer 1 [27, 9]; layer 2 all low, layer 3 none low
    expected = [[48, 60], [27, 9], [54, 54], [18, 18]]
    assert cache.stats().entries.long().tolist() == expected
    with torch.no_grad():
        token = ids[:, -1:]
        for step in range(5):
            token = model(token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
            assert cache.stats().entries.long().tolist() == expected, step
    pos = cache.layers[0].head(1)[2][0].tolist()
    assert pos == list(range(4)) + list(range(65 - 56, 65))  # sinks + the 56 most recent of 65


def test_squeezeattention_keeps_heads_of_a_layer_equal_and_uses_p(tmp_path):
    model = tiny_model()
    path = _tiny_hand_profile(model, tmp_path)
    ids = torch.randint(3, 90, (1, 100), generator=seeded(2))
    cache = kvbudget.compress(
        model, ids, method=make_method("squeezeattention", profile=str(path), p=0.25), budget=20
    )
    # layers 1, 3 keep 0.25·20 = 5; layers 0, 2 get 20·(4 − 2·0.25)/2 = 35; the head importances
    # play no part
    assert cache.stats().entries.long().tolist() == [[35, 35], [5, 5], [35, 35], [5, 5]]


def _six_layer_profile(heads: int, importance: list[list[float]] | None = None) -> Profile:
    """6 layers whose similarities [0.5, 0.9, 0.91, 0.2, 0.52, 0.89] cluster (sorted: 0.2 | 0.5,
    0.52 | 0.89, 0.9, 0.91) with layers 1, 2, 5 the most similar."""
    importance = importance or [[0.5] * heads for _ in range(6)]
    return Profile(
        model={"name": "hand", "config_hash": "x", "num_layers": 6, "num_attention_heads": 2 * heads,
               "num_kv_heads": heads},
        prompts=[], head_similarity=[[1 - x for x in row for _ in range(2)] for row in importance],
        kv_importance=importance, layer_similarity=[0.5, 0.9, 0.91, 0.2, 0.52, 0.89], per_prompt=[],
    )  # fmt: skip


# per layer, chosen so Algorithm 2 meets each case: 2 low / 2 receivers, 1 low, 3 low with one
# receiver, none low, all low, and the paper's example
SIX_IMPORTANCE = [
    [0.1, 0.9, 0.2, 0.4],
    [0.05, 0.5, 0.6, 0.7],
    [0.1, 0.2, 0.25, 0.8],
    [0.5, 0.6, 0.7, 0.8],
    [0.1, 0.1, 0.2, 0.2],
    [0.9, 0.1, 0.5, 0.05],
]


class _Bound:
    """A profiled method and a run holding ``profile``: the method's calls that read the run's
    profile take that run (``bound.cache_budgets(64, 400, 0.16)``)."""

    TAKE_RUN = (
        "cache_budgets",
        "layer_shares",
        "head_shares",
        "resolved_p",
        "resolved_tr",
        "tuned",
        "row_ratio",
    )

    def __init__(self, method, profile: Profile):
        self.method, self.run = method, ProfiledRun(bound=profile)

    def __getattr__(self, name: str):
        attr = getattr(self.method, name)
        return functools.partial(attr, self.run) if name in self.TAKE_RUN else attr


def _bound(name: str, profile: Profile, **options) -> _Bound:
    return _Bound(make_method(name, **options), profile)


def test_baklava_moves_memory_only_inside_each_layer():
    """Issue #25: Alg. 2 over all layers × heads had moved memory between layers (per-layer means
    [96, 33, 33, 95, 95, 32] → [48, 17, 17, 122, 121, 59]); inside each layer the split holds."""
    method = _bound("baklava", _six_layer_profile(4, SIX_IMPORTANCE), t=0.3, r=0.5, p=0.5)
    budgets = method.cache_budgets(64, 400, 0.16)
    # split, p = 0.5: layers 1, 2, 5 keep 0.5·64 = 32; layers 0, 3, 4 get 64·(6 − 1.5)/3 = 96
    split = [96, 32, 32, 96, 96, 32]
    assert (budgets.sum(-1) / 4).tolist() == split
    # Alg. 2 (t 0.3, r 0.5) inside each layer, base b_l:
    assert budgets.tolist() == [
        [48, 144, 48, 144],  # L = {0, 2}: each gives 48; k = 2 receivers (0.9, 0.4) get 2·48/2 = 48
        [16, 32, 32, 48],  # L = {0}: gives 16 to the single most important head (0.7)
        [16, 16, 16, 80],  # L = {0, 1, 2}: k = min(3, 1) = 1, head 3 gets 3·16 = 48
        [96, 96, 96, 96],  # no head below t: unchanged
        [96, 96, 96, 96],  # every head below t: unchanged
        [48, 16, 48, 16],  # L = {1, 3}: receivers heads 0 and 2, 2·16/2 = 16 each
    ]
    # the same split for SqueezeAttention, every head of a layer equal
    squeeze = _bound("squeezeattention", _six_layer_profile(4, SIX_IMPORTANCE), p=0.5)
    assert squeeze.cache_budgets(64, 400, 0.16).tolist() == [[b] * 4 for b in split]


def test_baklava_model_scope_reallocates_over_every_cache_of_the_model():
    """``scope="model"`` (our own variant): Alg. 2 over all 24 caches, each starting at its layer's
    split share; important heads take memory from other layers."""
    method = _bound("baklava", _six_layer_profile(4, SIX_IMPORTANCE), t=0.3, r=0.5, p=0.5, scope="model")
    budgets = method.cache_budgets(64, 400, 0.16)
    # base [96, 32, 32, 96, 96, 32] per layer; 12 caches have I < 0.3 and give up half their base:
    # 2·48 + 16 + 3·16 + 4·48 + 2·16 = 384; k = min(12, 12) = 12 receivers (every cache with
    # I ≥ 0.3) get 384 / 12 = 32 each
    assert budgets.tolist() == [
        [48, 128, 48, 128],
        [16, 64, 64, 64],
        [16, 16, 16, 64],
        [128, 128, 128, 128],
        [48, 48, 48, 48],
        [64, 16, 64, 16],
    ]
    assert int(budgets.sum()) == 64 * 24  # the model total is exact; the layer totals moved
    with pytest.raises(MethodOptionError, match="scope must be layer or model, got 'all'"):
        make_method("baklava", scope="all")


def test_baklava_caps_a_cache_at_the_prompt_and_gives_the_rest_to_its_layer():
    method = _bound("baklava", _six_layer_profile(4, SIX_IMPORTANCE), t=0.3, r=0.5, p=0.5)
    budgets = method.cache_budgets(64, 120, 64 / 120)
    # layer 0 wants [48, 144, 48, 144]: heads 1, 3 stop at 120, the 48 left over goes to heads
    # 0 and 2 in proportion to their shares (equal): 72 each; the layer total stays 4·96
    assert budgets[0].tolist() == [72, 120, 72, 120]
    assert budgets.sum(-1).tolist() == [4 * b for b in [96, 32, 32, 96, 96, 32]]
    # r = 1: low caches would keep nothing; each keeps one entry, taken from the receivers, unless
    # the receivers are at the prompt length (layer 0: [0, 192, 0, 192] → 120 each, 72 left each)
    budgets = _bound("baklava", _six_layer_profile(4, SIX_IMPORTANCE), t=0.3, r=1.0, p=0.5).cache_budgets(
        64, 120, 64 / 120
    )
    assert budgets[0].tolist() == [72, 120, 72, 120]
    assert budgets[5].tolist() == [63, 1, 63, 1]  # [64, 0, 64, 0] → 1 each for heads 1, 3


def test_baklava_with_one_kv_head_per_layer_is_the_layer_split():
    importance = [[0.05], [0.9], [0.1], [0.7], [0.2], [0.6]]
    method = _bound("baklava", _six_layer_profile(1, importance), t=0.3, r=0.9, p=0.25)
    # p = 0.25: layers 1, 2, 5 keep 0.25·40 = 10, the others 40·(6 − 0.75)/3 = 70
    assert method.cache_budgets(40, 500, 0.08).flatten().tolist() == [70, 10, 10, 70, 70, 10]


def test_pin_fixes_the_ratio_and_refuses_bad_values():
    method = _bound("baklava", _six_layer_profile(4, SIX_IMPORTANCE))
    assert method.row_ratio(0, 24, 40) == 0.6
    assert method.run.pin(0.25) is None
    assert method.row_ratio(1, 24, 40) == 0.25 and method.row_ratio(0, 24, 40) == 0.25
    assert method.run.pin(None) == 0.25
    for bad in (0, 0.0, -0.5, 1.5, float("nan"), "0.3", True):
        with pytest.raises(BudgetError, match=r"pinned compression ratio must be in \(0, 1\], got") as err:
            method.run.pin(bad)
        assert "\n" not in str(err.value)


def test_default_profile_is_built_on_the_fly_and_a_saved_default_wins(tmp_path):
    model = tiny_model()
    method = make_method("baklava")
    run = method.start(model)
    assert run.profile is builtin_profile(model)
    assert [p["name"] for p in run.profile.prompts] == ["builtin-text-folded", "builtin-code-folded"]
    from kvbudget.profiles import default_profile_path

    saved = _profile(model)
    save_profile(saved, default_profile_path(model))
    assert method.start(model).profile.prompts == saved.prompts


def test_tuned_parameters_are_used_when_no_option_is_given(tmp_path):
    model = tiny_model()
    profile = _profile(model)
    profile.tuned = {
        "baklava": {"0.2": {"best": {"t": 0.5, "r": 0.9}}, "0.6": {"best": {"t": 0.01, "r": 0.1}}}
    }
    path = save_profile(profile, tmp_path / "p.json")
    method = make_method("baklava", profile=str(path))
    run = method.start(model)
    assert method.resolved_tr(run, 0.25) == (0.5, 0.9)
    assert method.resolved_tr(run, 0.5) == (0.01, 0.1)
    snap = make_method("baklava-snapkv", profile=str(path))
    assert snap.resolved_tr(snap.start(model), 0.1) == (0.5, 0.9)  # falls back to baklava's search
    assert method.resolved_p(run, 0.25) == 0.3  # nothing tuned for p: the default
    profile.tuned["squeezeattention"] = {"0.3": {"best": {"p": 0.8}}}
    save_profile(profile, path)
    run = method.start(model)
    assert method.resolved_p(run, 0.25) == 0.8  # BaKlaVa's layer split uses SqueezeAttention's tuned p
    explicit = make_method("baklava", profile=str(path), t=0.3, r=0.2)
    assert explicit.resolved_tr(explicit.start(model), 0.25) == (0.3, 0.2)


def test_tune_finds_the_grid_minimum_and_resumes(tmp_path, monkeypatch):
    model = tiny_model()
    path = save_profile(_profile(model), tmp_path / "p.json")
    texts = [torch.randint(3, 90, (1, 96), generator=seeded(s)) for s in (5, 6)]
    grid = {"t": [0.0, 1.0], "r": [0.3, 0.9]}
    entry = tune(
        model, None, path, "baklava", 0.25, length=96, grid=grid, texts=texts, chunk=16, progress=False
    )
    assert len(entry["grid"]) == 4 and entry["complete"]
    assert entry["best"] == min(entry["grid"], key=lambda row: row["nll"])
    # t = 0 and t = 1 leave budgets unchanged (no cache / every cache below t): same perplexity
    nlls = {(row["t"], row["r"]): row["nll"] for row in entry["grid"]}
    assert nlls[(0.0, 0.3)] == nlls[(1.0, 0.9)]
    stored = load_profile(path, model).tuned["baklava"]["0.25"]
    assert stored["best"] == entry["best"]
    # resume: nothing is recomputed for a finished grid; a bigger grid adds only the new points
    calls = []
    import kvbudget.tuning as tuning

    real = tuning.chunked_perplexity
    monkeypatch.setattr(tuning, "chunked_perplexity", lambda *a, **k: calls.append(1) or real(*a, **k))
    tune(model, None, path, "baklava", 0.25, length=96, grid=grid, texts=texts, chunk=16, progress=False)
    assert calls == []
    bigger = {"t": [0.0, 1.0], "r": [0.3, 0.9, 0.5]}
    entry = tune(
        model, None, path, "baklava", 0.25, length=96, grid=bigger, texts=texts, chunk=16, progress=False
    )
    assert len(calls) == 2 * len(texts) and len(entry["grid"]) == 6


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = torch.argsort(torch.argsort(a.reshape(-1))).double()
    rb = torch.argsort(torch.argsort(b.reshape(-1))).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


@pytest.mark.integration
def test_real_model_head_ranks_agree_between_text_and_code(real_model):
    """BaKlaVa §3.1.2: importance ranks are consistent across prompts of different kinds."""
    model, _ = real_model
    profile = builtin_profile(model)  # the bundled prose and code prompts, real tokens
    assert [p["kind"] for p in profile.prompts] == ["text", "code"]
    assert not profile.prompts[0]["name"].endswith("folded")
    text, code = (torch.tensor(p["head_similarity"]) for p in profile.per_prompt)
    rho = _spearman(kv_importance(text, 3), kv_importance(code, 3))
    assert rho > 0.7, rho


def _hand_profile(layers: int, heads: int) -> Profile:
    importance = [[0.1 + 0.2 * ((i * heads + h) % 4) for h in range(heads)] for i in range(layers)]
    sims = [[1 - x for x in row for _ in range(2)] for row in importance]
    return Profile(
        model={"name": "hand", "config_hash": "x", "num_layers": layers, "num_attention_heads": 2 * heads,
               "num_kv_heads": heads},
        prompts=[], head_similarity=sims, kv_importance=importance,
        layer_similarity=[0.5, 0.9, 0.91, 0.2][:layers], per_prompt=[],
    )  # fmt: skip


def test_baklava_snapkv_keeps_snapkv_choice_at_each_caches_own_budget():
    """Each cache keeps exactly what SnapKV keeps at that cache's budget (window capped at it)."""
    from kvbudget.cache import BudgetLayer
    from kvbudget.observation import Observation

    g = seeded(3)
    k, v, q = (
        torch.randn(1, 2, 40, 8, generator=g),
        torch.randn(1, 2, 40, 8, generator=g),
        torch.randn(1, 4, 40, 8, generator=g),
    )

    def layer():
        out = BudgetLayer()
        out.update(k.clone(), v.clone())
        return out

    method = make_method("baklava-snapkv", window=4, kernel=3, t=0.2, r=0.75, p=0.5)
    run = ProfiledRun(bound=_hand_profile(4, 2))
    budgets = method.cache_budgets(run, 10, 40, 0.25)
    assert int(budgets.sum()) == 80 and len(set(budgets.flatten().tolist())) > 2
    for layer_idx in range(4):
        mine = layer()
        method.compress_layer(Observation(layer_idx, 4, q, mine, 8**-0.5, run=run), [10])
        for h in range(2):
            b = int(budgets[layer_idx, h])
            ref_layer = layer()
            ref = make_method("snapkv", window=min(4, b), kernel=3)
            ref.compress_layer(Observation(layer_idx, 4, q, ref_layer, 8**-0.5), [b])
            assert mine.head(h)[2][0].tolist() == ref_layer.head(h)[2][0].tolist(), (layer_idx, h, b)


@pytest.mark.parametrize("pad", [0, 9])
def test_baklava_decode_steps_keep_sinks_and_the_most_recent_entries(tmp_path, pad):
    """After decode steps every cache still holds its first 4 and its most recent entries, at its
    budget — unpadded (the all-valid path) and as the shorter row of a left-padded batch."""
    model = tiny_model()
    path = save_profile(_profile(model), tmp_path / "p.json")
    g = seeded(2)
    ids = torch.randint(3, 90, (2, 100), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    method = make_method("baklava", profile=str(path), t=0.5, r=0.5, p=0.5)
    cache = kvbudget.compress(model, ids, method=method, budget=20, attention_mask=mask)
    planned = [[layer.head_lengths()[r].tolist() for layer in cache.layers] for r in range(2)]
    steps = 5
    with torch.no_grad():
        token = ids[:, -1:]
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], 1)
            out = model(token, attention_mask=mask, past_key_values=cache)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
    seen = 100 + steps
    for r, first in ((0, 0), (1, pad)):
        for i, layer in enumerate(cache.layers):
            for h in range(2):
                pos = layer.head(h)[2][r]
                pos = pos[pos >= 0].tolist()
                b = planned[r][i][h]
                assert len(pos) == b
                sinks = min(4, b)
                want = list(range(first, first + sinks)) + list(range(seen - (b - sinks), seen))
                assert pos == want, (r, i, h)
