"""The prune stage: the engine's own layer loop, and ASL / FastKV / GemFilter against independent
re-computations (numpy for the formulas, plain transformers modules for the forwards)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvbudget
from conftest import TINY, seeded, tiny_model, tiny_tokenizer
from kvbudget.cache import BudgetCache
from kvbudget.errors import UnsupportedModelError
from kvbudget.eval.report import write_report
from kvbudget.eval.runner import EvalConfig, Runner
from kvbudget.eval.store import load_rows
from kvbudget.methods.registry import make_method
from kvbudget.prefill.pruned import decoder_parts, run_layers

CONTEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3


def _ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 90, (batch, n), generator=seeded(seed))


# ---------------------------------------------------------------------- the manual layer loop
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_manual_layer_loop_reproduces_model_logits(kind):
    model = tiny_model(kind)
    ids = _ids(50, 0, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0  # row 1 left-padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        reference = model(ids, attention_mask=mask, position_ids=positions).logits
        cache = BudgetCache(model.config.num_hidden_layers)
        mine = run_layers(model, ids, mask, positions, cache, all_logits=True)
    valid = mask.bool()
    error = (mine[valid] - reference[valid]).abs().max()
    assert error < 1e-5, error
    assert cache.get_seq_length() == 50 and int(cache.stats().entries[0, 0]) == 50 + 37


def test_unsupported_architecture_is_a_clear_error():
    model = tiny_model("llama")
    model.config.model_type = "gpt2"
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'gpt2'"):
        decoder_parts(model)


# ---------------------------------------------------------------------- ASL formulas
def _eager_window_probs(model, ids, window):
    """Per layer, the softmax attention of the last ``window`` queries over all keys: [hq, w, n] (numpy)."""
    kvbudget.detach(model)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    model.set_attn_implementation("sdpa")
    return [a[0, :, -window:].double().numpy() for a in out.attentions]


def _avgpool(x: np.ndarray, kernel: int) -> np.ndarray:
    """Average pooling along the last axis, zero padding kernel // 2, divided by kernel."""
    pad = kernel // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)])
    return np.stack([padded[..., i : i + x.shape[-1]] for i in range(kernel)]).sum(0) / kernel


def _asl_reference(probs, window, kernel, budget, l_min, l_obs, tau):
    """ASL by the paper's formulas: relative variance per tested layer, selection layer, kept slots."""
    n = probs[0].shape[-1]
    ranks, rel, v0 = [], [], None
    for layer, p in enumerate(probs):
        if layer < l_min - l_obs + 1:
            continue
        scores = _avgpool(p.sum(1)[:, : n - window], kernel).sum(0)  # [n - w]
        order = np.argsort(-scores, kind="stable")
        r = np.empty(len(order))
        r[order] = np.arange(1, len(order) + 1)
        ranks = (ranks + [r])[-l_obs:]
        if layer < l_min:
            continue
        x = np.stack(ranks)
        k = budget - window
        union = np.unique(np.concatenate([np.argsort(row, kind="stable")[:k] for row in x]))
        var = float(np.mean(np.var(x[:, union], axis=0)))
        v0 = var if v0 is None else v0
        rel.append((layer, var / v0))
        if var / v0 < tau:
            keep = np.sort(np.concatenate([order[:k], np.arange(n - window, n)]))
            return rel, layer, keep
    return rel, None, None


@pytest.mark.parametrize(
    ("tau", "l_min", "l_obs", "expected"),
    [(0.9, 2, 2, 3), (1.5, 3, 3, 3), (0.5, 3, 3, None)],  # deeper than l_min, at l_min, nowhere
)
def test_asl_rank_variance_and_selection_equal_the_formulas(tau, l_min, l_obs, expected):
    model = _six_layer_model()
    ids = _ids(70, 6)
    window, kernel, budget = 4, 3, 20
    probs = _eager_window_probs(model, ids, window)
    rel, layer, keep = _asl_reference(probs, window, kernel, budget, l_min, l_obs, tau)
    method = make_method("asl-fullkv", window=window, kernel=kernel, tau=tau, l_min=l_min, l_obs=l_obs)
    cache = kvbudget.compress(model, ids, method=method, budget=budget)
    run = cache.session.run
    mine = run.relative_variances[0]
    assert [x[0] for x in mine] == [x[0] for x in rel]
    assert np.allclose([x[1] for x in mine], [x[1] for x in rel], rtol=1e-5)
    assert run.selection_layers[0] == layer == expected
    if layer is not None:
        assert run.selected[0].tolist() == keep.tolist()
        deeper = cache.layers[layer + 1]
        assert deeper.positions[0, 0].tolist() == keep.tolist()  # deeper caches hold the selected slots
        assert cache.get_seq_length() == 70
    else:
        assert int(cache.stats().entries.min()) == 70  # nothing pruned: the full cache stays


@settings(max_examples=8, deadline=None)
@given(st.floats(0.05, 2.0), st.floats(0.05, 2.0))
def test_larger_tau_never_selects_a_deeper_layer(tau_a, tau_b):
    model = _six_layer_model()
    ids = _ids(70, 6)
    layers = []
    for tau in sorted((tau_a, tau_b)):
        method = make_method("asl", window=4, kernel=3, tau=tau, l_min=2, l_obs=2)
        cache = kvbudget.compress(model, ids, method=method, budget=20)
        layers.append(cache.session.run.selection_layers[0])
    deep = [99 if x is None else x for x in layers]
    assert deep[1] <= deep[0]


@pytest.mark.parametrize("name", ["asl", "asl-2pass"])
def test_a_tau_no_layer_meets_still_ends_every_layer_at_the_budget(name):
    """τ = 1e-9: no selection layer, yet each layer holds the budget per head (or the whole prompt
    when it is shorter). One-pass ASL gets there through SnapKV, the 2-pass variant by selecting
    at the last layer (the authors' get_layer_context_asl)."""
    model = _six_layer_model()
    lengths, budget = [70, 15], 20
    ids = _ids(70, 11, batch=2)
    mask = torch.ones_like(ids)
    mask[1, : 70 - lengths[1]] = 0  # row 1: 15 tokens, left-padded, inside the budget
    method = make_method(name, window=4, kernel=3, tau=1e-9, l_min=2, l_obs=2)
    cache = kvbudget.compress(model, ids, method=method, budget=budget, attention_mask=mask)
    for row, n in enumerate(lengths):
        expected = budget if n > budget else n
        entries = cache.stats(row).entries  # [layers, kv_heads]
        assert entries.shape == (6, 2) and entries.eq(expected).all(), (row, entries)
    run = cache.session.run
    assert all(rel >= 1e-9 for _, rel in run.relative_variances[0])  # no layer met τ
    if name == "asl":
        assert run.selection_layers == [None, None]
    else:  # row 0 selected at the last layer; row 1 fits and is kept whole
        assert run.selection_layers == [5, None] and run.fallback_rows == {0}


def _authors_asl_2pass_fallback(probs: np.ndarray, window: int, kernel: int, budget: int, kv_heads: int):
    """A port of the authors' ASL_2pass selection when no layer met τ (TANIGUCHIREI/ASL):
    ``customized_cache.py`` ``sum_attn_cache`` gives the last layer's ranks (window rows' softmax
    summed, context columns avg-pooled, summed per GQA group and over the KV heads, ranked
    descending); ``gemfilter_utils.py`` ``get_layer_context_asl`` keeps the ``budget − window``
    smallest ranks plus the window indices, unique (sorted). ``probs: [hq, w, n]``."""
    attn = torch.from_numpy(probs)[None]  # [1, hq, w, n]
    n = attn.shape[-1]
    summed = attn[..., :-window].sum(dim=-2)  # [1, hq, n - w]
    pooled = torch.nn.functional.avg_pool1d(summed, kernel_size=kernel, padding=kernel // 2, stride=1)
    pooled = pooled.view(1, kv_heads, -1, n - window).sum(dim=-2).sum(dim=-2)  # [1, n - w]
    order = torch.argsort(pooled, dim=1, descending=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(1, n - window + 1)[None])
    seqlen = n - window
    k = budget - window if seqlen > budget - window else seqlen
    top = torch.topk(ranks.float(), k=k, dim=-1, largest=False)[1]
    return torch.cat([top[-1], torch.arange(seqlen, seqlen + window)]).unique()


def test_asl_2pass_fallback_keeps_the_authors_last_layer_top_k_and_runs_pass_2_on_it():
    model = tiny_model("llama")
    tok = tiny_tokenizer(True)
    window, kernel, budget = 8, 7, 40
    method = make_method("asl-2pass", window=window, kernel=kernel, tau=1e-9)
    result = kvbudget.generate(
        model, tok, CONTEXT, "What?", method=method, budget=budget, max_new_tokens=6, return_cache=True
    )
    run = result.cache.session.run
    ids = torch.tensor([kvbudget.engine.build_prompt(tok, CONTEXT, "What?").ids])
    probs = _eager_window_probs(model, ids, window)[-1]  # pass 1 ran every layer on every token
    keep = _authors_asl_2pass_fallback(probs, window, kernel, budget, kv_heads=2)
    assert ids.shape[1] > budget and keep.numel() == budget
    assert run.selected[0].tolist() == keep.tolist()
    assert result.selection_layer == 3 and run.fallback_rows == {0}
    assert result.budgets.eq(budget).all()
    with torch.no_grad():  # pass 2 = the model on the kept ids, positions 0..k-1, greedy
        reference = model.generate(ids[:, keep], max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert result.token_ids == reference[0, budget:].tolist()[: len(result.token_ids)]


_MODEL_CACHE: dict = {}


def _six_layer_model():
    if "six" not in _MODEL_CACHE:
        torch.manual_seed(3)
        config = LlamaConfig(**{**TINY, "num_hidden_layers": 6}, initializer_range=0.2)
        _MODEL_CACHE["six"] = LlamaForCausalLM(config).eval()
    return _MODEL_CACHE["six"]


def _maxpool(x: np.ndarray, kernel: int) -> np.ndarray:
    """Max pooling along the last axis, -inf padding kernel // 2."""
    pad = kernel // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], constant_values=-np.inf)
    return np.stack([padded[..., i : i + x.shape[-1]] for i in range(kernel)]).max(0)


def test_fastkv_selection_equals_the_formula():
    """At the TSP layer: SnapKV scores (sum over window, GQA mean, max-pool) summed over KV heads."""
    model = _six_layer_model()
    ids = _ids(80, 8)
    window, kernel, budget, tsp = 4, 3, 24, 2
    probs = _eager_window_probs(model, ids, window)[tsp]  # [hq, w, n]
    n = probs.shape[-1]
    per_query_head = probs.sum(1)[:, : n - window]
    per_kv_head = per_query_head.reshape(2, 2, -1).mean(1)  # 4 query heads, 2 KV heads
    scores = _maxpool(per_kv_head, kernel).sum(0)
    best = np.argsort(-scores, kind="stable")[: budget - window]
    expected = np.sort(np.concatenate([best, np.arange(n - window, n)]))
    method = make_method("fastkv", window=window, kernel=kernel, tsp_layer=tsp)
    cache = kvbudget.compress(model, ids, method=method, budget=budget)
    assert cache.session.run.selection_layers == [tsp]
    assert cache.session.run.selected[0].tolist() == expected.tolist()
    assert cache.layers[tsp + 1].positions[0, 0].tolist() == expected.tolist()


def test_pyramidinfer_first_cut_equals_the_formula():
    """Layer 1 (layer 0's ratio is 1): recent = 1 + int(0.2 n) queries, head mean, linspace weights."""
    model = _six_layer_model()
    ids = _ids(80, 9)
    n, decay, sinks = 80, 0.5, 4
    probs = _eager_window_probs(model, ids, 1 + int(0.2 * n))[1].mean(0)  # [recent, n]
    recent = probs.shape[0]
    context = n - recent
    weights = np.linspace(1.0, 1.2, recent)
    scores = (probs[:, :context] * weights[:, None]).mean(0)
    scores[:sinks] = np.inf
    ratio = (1 - decay) * (np.cos(np.pi * 1 / 6) + 1) / 2 + decay
    keep_len = max(int(ratio * context), 8)
    best = np.argsort(-scores, kind="stable")[:keep_len]
    expected = np.sort(np.concatenate([best, np.arange(context, n)]))
    method = make_method("pyramidinfer", decay=decay, min_context=8)
    cache = kvbudget.compress(model, ids, method=method, budget=20)
    assert cache.session.run.selection_layers == [1]
    assert cache.layers[2].positions[0, 0].tolist() == expected.tolist()
    assert cache.stats().entries[:, 0].tolist()[:2] == [80, 80]


# ---------------------------------------------------------------------- forwards, independently
def _plain_layers(model, hidden, positions, layers, cache=None):
    """Run ``model.model.layers[layers]`` on ``hidden: [1, q, d]`` at RoPE ``positions`` with sdpa."""
    base = model.model
    rotary = base.rotary_emb(hidden, positions)
    for i in layers:
        hidden = base.layers[i](
            hidden, attention_mask=None, position_ids=positions, past_key_values=cache,
            use_cache=cache is not None, position_embeddings=rotary,
        )  # fmt: skip
    return hidden


def test_fastkv_prunes_the_forward_at_true_positions():
    """Deeper layers run on the selected tokens only, with their original RoPE positions."""
    model = tiny_model("llama")
    ids = _ids(100, 7)
    method = make_method("fastkv", window=4, kernel=3, tsp_layer=1)
    with torch.no_grad():
        inputs = kvbudget.engine.PrefillInputs(ids, torch.ones_like(ids), torch.arange(100)[None], 100)
        session = kvbudget.session.CompressionSession(method, 4, budget=24)
        from kvbudget.prefill.pruned import prune_prefill

        cache, logits, _ = prune_prefill(model, inputs, session)
        kvbudget.detach(model)
        keep = session.run.selected[0]
        hidden = _plain_layers(model, model.model.embed_tokens(ids), torch.arange(100)[None], range(2))
        reference_cache = DynamicCache()
        deeper = _plain_layers(model, hidden[:, keep], keep[None], [2, 3], reference_cache)
        reference = model.lm_head(model.model.norm(deeper))[:, -1]
    assert session.run.selection_layers == [1] and keep.numel() == 24
    assert torch.allclose(logits, reference, atol=1e-5)
    layer2 = cache.layers[2]
    assert torch.allclose(layer2.keys, reference_cache.layers[2].keys, atol=1e-5)
    assert layer2.positions[0, 0].tolist() == keep.tolist() and cache.get_seq_length() == 100
    # SnapKV kept the budget in the layers before the cut; everything after holds the 24 tokens
    assert cache.stats().entries.eq(24).all()


def _gemfilter_reference_keep(model, ids, layer, budget, kernel):
    """GemFilter's selection by hand: raw q_last·k at ``layer`` summed over heads, avg-pooled, top-k."""
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[layer]  # input of `layer`
        attn = model.model.layers[layer].self_attn
        x = model.model.layers[layer].input_layernorm(hidden)
        n, d = ids.shape[1], attn.head_dim
        q = attn.q_proj(x).view(1, n, -1, d).transpose(1, 2)
        k = attn.k_proj(x).view(1, n, -1, d).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    dots = (q[0, :, -1:] @ k[0].transpose(-1, -2))[:, 0].sum(0).double().numpy()
    pooled = _avgpool(dots, kernel)[: n - 1]
    return np.sort(np.concatenate([np.argsort(-pooled, kind="stable")[: budget - 1], [n - 1]]))


def test_gemfilter_second_pass_is_the_model_on_the_selected_tokens():
    model = tiny_model("qwen2")
    tok = tiny_tokenizer(True)
    method = make_method("gemfilter", kernel=5)
    result = kvbudget.generate(
        model, tok, CONTEXT, "What?", method=method, budget=30, max_new_tokens=6, return_cache=True
    )
    prompt = kvbudget.engine.build_prompt(tok, CONTEXT, "What?")
    ids = torch.tensor([prompt.ids])
    kvbudget.detach(model)
    keep = _gemfilter_reference_keep(model, ids, 2, 30, 5)  # round(0.4 · 4 layers) = 2
    assert result.cache.session.run.selected[0].tolist() == keep.tolist() and result.selection_layer == 2
    with torch.no_grad():  # pass 2 = the model on the selected ids, positions 0..k-1, greedy
        reference = model.generate(ids[:, keep], max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert result.token_ids == reference[0, 30:].tolist()[: len(result.token_ids)]
    assert result.budgets.eq(30).all()


def test_prune_batch_with_a_row_inside_the_budget_equals_each_alone():
    model, tok = tiny_model("llama"), tiny_tokenizer(True)
    contexts, questions = [CONTEXT, "Short."], ["What does the fox do?", "What?"]
    for name in ("asl", "gemfilter"):
        opts = {"window": 4, "kernel": 3, "tau": 1.5} if name == "asl" else {"kernel": 3}
        batch = kvbudget.generate(
            model, tok, contexts, questions, method=make_method(name, **opts), budget=60, max_new_tokens=8
        )
        assert batch[0].selection_layer is not None and batch[1].selection_layer is None
        for r in range(2):
            alone = kvbudget.generate(model, tok, contexts[r], questions[r], method=make_method(name, **opts),
                                      budget=60, max_new_tokens=8)  # fmt: skip
            assert batch[r].token_ids == alone.token_ids and batch[r].budgets.equal(alone.budgets)


@pytest.mark.parametrize("name", ["asl", "gemfilter"])
def test_question_agnostic_prune_appends_the_question(name):
    model, tok = tiny_model("llama"), tiny_tokenizer(True)
    opts = {"window": 4, "kernel": 3, "tau": 1.5} if name == "asl" else {"kernel": 3}
    result = kvbudget.generate(
        model, tok, CONTEXT, "What does the fox do?", method=make_method(name, **opts), budget=40,
        max_new_tokens=4, compress_context_only=True, return_cache=True,
    )  # fmt: skip
    context_len = len(kvbudget.engine.build_prompt(tok, CONTEXT, "What does the fox do?").context_ids)
    question_len = result.prompt_tokens - context_len
    assert result.selection_layer is not None
    entries = result.cache.stats().entries
    assert entries[-1].eq(40 + question_len + len(result.token_ids) - 1).all()


def test_eval_rows_record_the_selection_layer(tmp_path):
    methods = ["full", "asl:window=4,kernel=3,tau=1.5", "gemfilter:kernel=3", "snapkv"]
    config = EvalConfig(
        model="tiny", tasks=["needle_filler"], lengths=[160], limit=1, budgets=[40], methods=methods
    )
    Runner(config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(True), progress=False).run()
    rows = {r["method"]: r for r in load_rows(tmp_path / "results.jsonl")}
    assert all(r["error"] is None for r in rows.values())
    assert rows["asl"]["selection_layer"] == 1 and rows["gemfilter"]["selection_layer"] == 2
    assert rows["snapkv"]["selection_layer"] is None
    assert rows["gemfilter"]["budgets"] == [[40, 40]] * 4
    text = write_report(tmp_path).read_text()
    assert "| asl:window=4,kernel=3,tau=1.5 | B=40 | needle_filler | 1: 1 | 1.0 |" in text
    assert "| gemfilter:kernel=3 | B=40 | needle_filler | 2: 1 | 2.0 |" in text
    assert (tmp_path / "selection_layers.png").stat().st_size > 1000
    assert "| snapkv | B=40 |" not in text.split("## Selection layers")[1].split("## Speed")[0]


@pytest.mark.integration
def test_manual_layer_loop_reproduces_the_real_model(real_model):
    model, tokenizer = real_model
    ids = torch.tensor([tokenizer("The quick brown fox jumps over the lazy dog. " * 30)["input_ids"]])
    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1])[None]
    kvbudget.detach(model)
    with torch.no_grad():
        reference = model(ids, position_ids=positions).logits
        cache = BudgetCache(model.config.num_hidden_layers)
        mine = run_layers(model, ids, mask, positions, cache, all_logits=True)
    error = (mine - reference).abs().max()
    assert error < 1e-5, error


@pytest.mark.integration
@pytest.mark.parametrize("name", ["asl", "asl-fullkv", "asl-2pass", "fastkv", "gemfilter", "pyramidinfer"])
def test_prune_methods_on_the_real_model(name, real_model):
    """Each prune method runs end to end on a 1K needle and cuts at a layer inside the model."""
    from kvbudget.eval.tasks.needle import needle_sample

    model, tokenizer = real_model
    sample = needle_sample(tokenizer, length=1000, depth=0.5, haystack="essays", seed=1)
    result = kvbudget.generate(
        model, tokenizer, sample.context, sample.question, sample.answer_prefix, method=name, budget=128,
        max_new_tokens=12,
    )  # fmt: skip
    layers = model.config.num_hidden_layers
    if name in ("fastkv", "gemfilter", "pyramidinfer", "asl-2pass"):  # asl-2pass: else the last layer
        assert result.selection_layer is not None
    if name == "pyramidinfer":  # a layer holds what it processed: fewer tokens deeper
        per_layer = result.budgets[:, 0]
        assert (per_layer[1:] <= per_layer[:-1]).all() and per_layer[-1] < per_layer[0]
    elif result.selection_layer is not None:
        assert 0 <= result.selection_layer < layers
        assert result.budgets[result.selection_layer + 1 :].eq(128).all()
        if name != "asl-fullkv":
            assert result.budgets.eq(128).all()
