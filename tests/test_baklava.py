"""BaKlaVa / SqueezeAttention: profiles, Algorithm 2, the layer split, errors, tuning (tiny models)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import kvbudget
from conftest import tiny_model, tiny_tokenizer
from kvbudget.allocation import baklava_reallocate, integer_budgets, kmeans_1d, squeeze_layer_weights
from kvbudget.cli import app
from kvbudget.errors import ProfileError
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


def test_algorithm_2_with_a_layer_split_base_gives_freed_memory_equally():
    importance = torch.tensor([0.1, 0.9, 0.2, 0.8])
    base = torch.tensor([40.0, 40.0, 160.0, 160.0])  # two layers of 2 caches, unequal layer budgets
    out = baklava_reallocate(importance, base, t=0.5, r=0.5)
    # freed 20 + 80 = 100, split equally over the top-2 (0.9, 0.8)
    assert out.tolist() == [20.0, 90.0, 80.0, 210.0]


@settings(max_examples=150, deadline=None)
@given(
    importance=st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=40),
    t=st.floats(0, 1),
    r=st.floats(0, 1),
    budget=st.integers(1, 300),
    capacity=st.integers(1, 400),
    seed=st.integers(0, 10),
)
def test_budgets_always_sum_to_the_total(importance, t, r, budget, capacity, seed):
    imp = torch.tensor(importance, dtype=torch.float64)
    m = imp.numel()
    base = torch.rand(m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1
    alloc = baklava_reallocate(imp, base, t, r)
    assert float(alloc.sum()) == pytest.approx(float(base.sum()), rel=1e-9)
    assert bool((alloc >= 0).all())
    budgets = integer_budgets(alloc, budget * m, capacity)
    assert int(budgets.sum()) == min(budget * m, capacity * m)
    assert int(budgets.max()) <= capacity and int(budgets.min()) >= min(1, capacity)


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
def test_baklava_budgets_follow_the_profile(tmp_path):
    model = tiny_model()
    profile = _profile(model)
    path = save_profile(profile, tmp_path / "p.json")
    ids = torch.randint(3, 90, (1, 120), generator=torch.Generator().manual_seed(1))
    importance = profile.importance().reshape(-1)
    t = float(importance.median()) + 1e-9
    cache = kvbudget.compress(
        model, ids, method=make_method("baklava", profile=str(path), t=t, r=0.5, p=0.5), budget=24
    )
    entries = cache.stats().entries.double()
    # independent expectation: layer split → Algorithm 2 → exact integer budgets
    weights = torch.tensor(squeeze_layer_weights(profile.layer_similarity, 0.5), dtype=torch.float64)
    base = weights[:, None].expand(4, 2).reshape(-1)
    shares = baklava_reallocate(importance, base, t, 0.5)
    expected = integer_budgets(shares, 24 * 8, 120).reshape(4, 2)
    assert entries.long().equal(expected)
    assert int(entries.sum()) == 24 * 8
    low = (importance < t).reshape(4, 2)
    assert bool(low.any()) and bool((~low).any())
    # StreamingLLM inside each cache: the first 4 and the most recent entries
    for i, layer in enumerate(cache.layers):
        for h in range(2):
            pos = layer.head(h)[2][0]
            b = int(expected[i, h])
            assert pos.tolist() == list(range(4)) + list(range(120 - (b - 4), 120))


def test_squeezeattention_keeps_heads_of_a_layer_equal_and_uses_p(tmp_path):
    model = tiny_model()
    profile = _profile(model)
    path = save_profile(profile, tmp_path / "p.json")
    ids = torch.randint(3, 90, (1, 100), generator=torch.Generator().manual_seed(2))
    cache = kvbudget.compress(
        model, ids, method=make_method("squeezeattention", profile=str(path), p=0.25), budget=20
    )
    entries = cache.stats().entries
    assert entries.eq(entries[:, :1]).all()
    weights = squeeze_layer_weights(profile.layer_similarity, 0.25)
    expected = integer_budgets(torch.tensor(weights, dtype=torch.float64), 20 * 4, 100)
    assert entries[:, 0].tolist() == expected.tolist()


def test_default_profile_is_built_on_the_fly_and_a_saved_default_wins(tmp_path):
    model = tiny_model()
    method = make_method("baklava")
    method.prepare(model)
    assert method.bound_profile is builtin_profile(model)
    assert [p["name"] for p in method.bound_profile.prompts] == ["builtin-text-folded", "builtin-code-folded"]
    from kvbudget.profiles import default_profile_path

    saved = _profile(model)
    save_profile(saved, default_profile_path(model))
    method.prepare(model)
    assert method.bound_profile.prompts == saved.prompts


def test_tuned_parameters_are_used_when_no_option_is_given(tmp_path):
    model = tiny_model()
    profile = _profile(model)
    profile.tuned = {
        "baklava": {"0.2": {"best": {"t": 0.5, "r": 0.9}}, "0.6": {"best": {"t": 0.01, "r": 0.1}}}
    }
    path = save_profile(profile, tmp_path / "p.json")
    method = make_method("baklava", profile=str(path))
    method.prepare(model)
    assert method.resolved_tr(0.25) == (0.5, 0.9)
    assert method.resolved_tr(0.5) == (0.01, 0.1)
    snap = make_method("baklava-snapkv", profile=str(path))
    snap.prepare(model)
    assert snap.resolved_tr(0.1) == (0.5, 0.9)  # falls back to baklava's search
    assert method.resolved_p(0.25) == 0.3  # nothing tuned for p: the default
    profile.tuned["squeezeattention"] = {"0.3": {"best": {"p": 0.8}}}
    save_profile(profile, path)
    method.prepare(model)
    assert method.resolved_p(0.25) == 0.8  # BaKlaVa's layer split uses SqueezeAttention's tuned p
    explicit = make_method("baklava", profile=str(path), t=0.3, r=0.2)
    explicit.prepare(model)
    assert explicit.resolved_tr(0.25) == (0.3, 0.2)


def test_tune_finds_the_grid_minimum_and_resumes(tmp_path, monkeypatch):
    model = tiny_model()
    path = save_profile(_profile(model), tmp_path / "p.json")
    texts = [torch.randint(3, 90, (1, 96), generator=torch.Generator().manual_seed(s)) for s in (5, 6)]
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

    g = torch.Generator().manual_seed(3)
    k, v, q = (
        torch.randn(1, 2, 40, 8, generator=g),
        torch.randn(1, 2, 40, 8, generator=g),
        torch.randn(1, 4, 40, 8, generator=g),
    )

    def layer():
        out = BudgetLayer()
        out.update(k.clone(), v.clone())
        return out

    method = make_method("baklava-snapkv", window=4, kernel=3, t=0.4, r=0.75, p=0.5)
    method.__dict__["_profile"] = _hand_profile(4, 2)
    budgets = method.cache_budgets(10, 40, 0.25)
    assert int(budgets.sum()) == 80 and len(set(budgets.flatten().tolist())) > 2
    for layer_idx in range(4):
        mine = layer()
        method.compress(Observation(layer_idx, 4, q, mine, 8**-0.5), [10])
        for h in range(2):
            b = int(budgets[layer_idx, h])
            ref_layer = layer()
            ref = make_method("snapkv", window=min(4, b), kernel=3)
            ref.compress(Observation(layer_idx, 4, q, ref_layer, 8**-0.5), [b])
            assert mine.head(h)[2][0].tolist() == ref_layer.head(h)[2][0].tolist(), (layer_idx, h, b)


@pytest.mark.parametrize("pad", [0, 9])
def test_baklava_decode_steps_keep_sinks_and_the_most_recent_entries(tmp_path, pad):
    """After decode steps every cache still holds its first 4 and its most recent entries, at its
    budget — unpadded (the all-valid path) and as the shorter row of a left-padded batch."""
    model = tiny_model()
    path = save_profile(_profile(model), tmp_path / "p.json")
    g = torch.Generator().manual_seed(2)
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
