"""Lookahead Q-Cache (laq, laq++, laq-ada, laq-lava): capture, re-selection, positions, equivalences.

Tiny random models (no download). The references are independent of kvbudget's lookahead code:
pseudo queries recomputed from each attention module's input with ``q_proj`` and the model's own
rotary embedding at positions counted here; pseudo tokens re-decoded on a SnapKV cache built by
``kvbudget.compress``; kept sets recomputed with explicit float64 loops.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvbudget
from conftest import TINY, seeded, tiny_model
from kvbudget.engine import build_prompt, prefill, prefill_inputs
from kvbudget.errors import BudgetError, MethodOptionError
from kvbudget.eval.runner import MethodSpec
from kvbudget.methods.lookahead import LookaheadObservation, QueryCapture, QueryHeadLayer
from kvbudget.methods.registry import make_method
from kvbudget.session import CompressionSession
from test_reference_selection import (
    BUDGET,
    HQ,
    LAYERS,
    SCALE,
    Choice,
    D,
    Fixture,
    G,
    H,
    N,
    assert_layer_holds,
    attention_row,
    pool,
    top_k,
)

CONTEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
QUESTION = "What does the fox do?"
PROMPT_IDS = torch.randint(3, 90, (1, 120), generator=seeded(11))


def _options(**extra):
    return {"kernel": 3, "lookahead_window": 4, "steps": 4, **extra}


# ---------------------------------------------------------------------------------- must-show 1
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_captured_pseudo_queries_are_q_proj_plus_rope_at_the_true_positions(kind):
    model = tiny_model(kind)
    inputs: list[torch.Tensor] = []  # each attention module's input, in call order

    def grab(module, args, kwargs):
        if kwargs["hidden_states"].shape[1] == 1:  # the lookahead's one-token forwards
            inputs.append((module.layer_idx, kwargs["hidden_states"].detach().clone()))

    handles = [
        layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers
    ]
    method = make_method("laq", **_options())
    try:
        cache = kvbudget.compress(model, PROMPT_IDS, method=method, budget=24)
    finally:
        for handle in handles:
            handle.remove()
    record = cache.session.run.lookahead
    length, steps, layers = PROMPT_IDS.shape[1], record.tokens.shape[1], model.config.num_hidden_layers
    assert steps == 4 and record.valid.all()
    assert record.positions[0].tolist() == list(range(length, length + steps))
    assert len(inputs) == steps * layers
    with torch.inference_mode():
        _assert_queries_recomputed(model, inputs, record, length, steps, layers)


def _assert_queries_recomputed(model, inputs, record, length: int, steps: int, layers: int) -> None:
    for step in range(steps):
        position = torch.tensor([[length + step]])
        for layer_idx in range(layers):
            idx, hidden = inputs[step * layers + layer_idx]
            assert idx == layer_idx
            attn = model.model.layers[layer_idx].self_attn
            q = attn.q_proj(hidden).view(1, 1, -1, attn.head_dim).transpose(1, 2)  # [1, hq, 1, d]
            cos, sin = model.model.rotary_emb(hidden, position)
            expected, _ = apply_rotary_pos_emb(q, q, cos, sin)
            got = record.queries[layer_idx][:, :, step : step + 1]
            assert torch.allclose(got, expected, atol=1e-5), (step, layer_idx, (got - expected).abs().max())


def test_pseudo_tokens_are_the_greedy_answer_of_the_snapkv_clone(llama):
    method = make_method("laq++", **_options())
    cache = kvbudget.compress(llama, PROMPT_IDS, method=method, budget=24)
    record = cache.session.run.lookahead
    # the clone, built independently: SnapKV (window 4) at the main budget, then greedy decoding
    clone = kvbudget.compress(llama, PROMPT_IDS, method=make_method("snapkv", window=4), budget=24)
    with torch.no_grad():
        full_logits = llama(PROMPT_IDS).logits[:, -1]
        token, tokens = full_logits.argmax(-1, keepdim=True), []
        for _ in range(4):
            tokens.append(int(token))
            token = llama(token, past_key_values=clone).logits[:, -1].argmax(-1, keepdim=True)
    assert record.tokens[0].tolist() == tokens


def test_lookahead_stops_at_eos(chat_tokenizer):
    model = tiny_model("llama")
    prompt = build_prompt(chat_tokenizer, CONTEXT, QUESTION)
    method = make_method("laq", **_options(steps=6))
    session = CompressionSession(method, model.config.num_hidden_layers, budget=30)
    prefill(model, [prompt], session, chat_tokenizer.pad_token_id)
    free = session.run.lookahead.tokens[0].tolist()
    assert len(free) == 6
    stop_at = next(i for i in range(1, 6) if free[i] not in free[:i])  # first step whose token is new
    method = make_method("laq", **_options(steps=6))
    session = CompressionSession(method, model.config.num_hidden_layers, budget=30)
    prefill(model, [prompt], session, chat_tokenizer.pad_token_id, eos={free[stop_at]})
    record = session.run.lookahead
    assert record.tokens[0].tolist() == free[:stop_at]  # the EOS token is never fed
    assert record.queries[0].shape[2] == stop_at


# ---------------------------------------------------------------------------------- must-show 2
def _masked_reference(kept: dict[int, list[torch.Tensor]]):
    """Eager attention over the full sequence; the LAST query sees only the kept keys (and itself)."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        group = query.shape[1] // key.shape[1]
        logits = query.float() @ key.repeat_interleave(group, 1).float().transpose(-1, -2) * scaling
        n = key.shape[2]
        allowed = torch.ones(query.shape[2], n, dtype=torch.bool).tril(n - query.shape[2])
        allowed = allowed.expand(query.shape[1], -1, -1).clone()
        for h in range(key.shape[1]):
            row = torch.zeros(n, dtype=torch.bool)
            row[kept[module.layer_idx][h]] = True
            row[n - 1] = True
            allowed[h * group : (h + 1) * group, -1] = row
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        out = probs @ value.repeat_interleave(group, 1).float()
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    return attention


@pytest.mark.parametrize("name", ["laq", "laq++"])
def test_final_cache_holds_the_budget_and_no_pseudo_token_and_decodes_at_the_true_position(name):
    model = tiny_model("qwen2")
    budget, length = 24, PROMPT_IDS.shape[1]
    method = make_method(name, **_options())
    cache = kvbudget.compress(model, PROMPT_IDS, method=method, budget=budget)
    assert cache.session.run.lookahead.tokens.shape[1] == 4  # the lookahead ran
    assert cache.get_seq_length() == length  # the pseudo tokens were never appended here
    stats = cache.stats()
    assert stats.entries.eq(budget).all()
    kept = {}
    for i, layer in enumerate(cache.layers):
        assert layer.seen == length
        heads = []
        for h in range(layer.num_heads):
            positions = layer.head(h)[2][0]
            assert positions.min() >= 0 and positions.max() < length  # prompt entries only
            assert positions.unique().numel() == budget
            if name == "laq++":  # the stage-2 window: the last w2 = 8 prompt tokens are kept
                assert set(range(length - 8, length)) <= set(positions.tolist())
            heads.append(positions)
        kept[i] = heads
    # the first real token: from the full-cache logits, decoded at position `length`
    first = cache.session.run.lookahead.tokens[:, :1]
    with torch.no_grad():
        logits = model(first, past_key_values=cache).logits[0, -1]
        kvbudget.detach(model)
        AttentionInterface.register("laq_reference", _masked_reference(kept))
        model.set_attn_implementation("laq_reference")
        reference = model(torch.cat([PROMPT_IDS, first], 1)).logits[0, -1]  # positions 0..length
        model.set_attn_implementation("sdpa")
    assert torch.allclose(logits, reference, atol=1e-4), (logits - reference).abs().max()
    assert cache.get_seq_length() == length + 1


# ---------------------------------------------------------------------------------- must-show 3
@pytest.mark.parametrize(
    ("name", "base", "extra"),
    [("laq++", "snapkv", {}), ("laq-ada", "ada-snapkv", {}), ("laq-lava", "lava", {})],
)
def test_without_lookahead_steps_laq_equals_its_base_method_with_the_same_window(
    name, base, extra, llama, chat_tokenizer
):
    """n = 0 and a lookahead budget covering the prompt: the observation is the last 8 prompt
    queries, so laq++ is SnapKV with window 8 (and laq-ada Ada-SnapKV, laq-lava LAVa)."""
    common = {"window": 8, "kernel": 7}
    laq = kvbudget.generate(
        llama, chat_tokenizer, CONTEXT, QUESTION, budget=40, max_new_tokens=12, return_cache=True,
        method=make_method(name, steps=0, lookahead_budget=10_000, **common, **extra),
    )  # fmt: skip
    ref = kvbudget.generate(
        llama, chat_tokenizer, CONTEXT, QUESTION, budget=40, max_new_tokens=12, return_cache=True,
        method=make_method(base, **common),
    )  # fmt: skip
    assert laq.prompt_tokens > 100  # the budget really evicts
    assert laq.token_ids == ref.token_ids
    assert torch.equal(laq.budgets, ref.budgets)
    for la, lb in zip(laq.cache.layers, ref.cache.layers, strict=True):
        for h in range(la.num_heads):
            assert torch.equal(la.head(h)[2], lb.head(h)[2])
            assert torch.equal(la.head(h)[0], lb.head(h)[0])


def test_lookahead_changes_the_selection(llama, chat_tokenizer):
    """The pseudo queries matter: with 8 steps laq++ keeps other entries than without any."""
    caches = [
        kvbudget.generate(
            llama, chat_tokenizer, CONTEXT, QUESTION, budget=40, max_new_tokens=1, return_cache=True,
            method=make_method("laq++", steps=steps, lookahead_window=8),
        ).cache
        for steps in (0, 8)
    ]  # fmt: skip
    differ = any(
        not torch.equal(a.head(h)[2], b.head(h)[2])
        for a, b in zip(caches[0].layers, caches[1].layers, strict=True)
        for h in range(a.num_heads)
    )
    assert differ


# ---------------------------------------------------------------------------------- reference
def lookahead_reference(
    fx: Fixture,
    pseudo: np.ndarray,
    w2: int,
    kernel: int,
    masked: bool = False,
    window: int | None = None,
    shift: int = 0,
):
    """Eq. 4–5 with SnapKV's reduction, written from the paper (arXiv:2505.20334): per KV head,
    the scores of the first ``N − w2`` keys. Window rows are causal; pseudo rows see all ``N`` prompt keys.
    ``window``: a sliding-window layer, where the row at position ``p`` (prompt token ``i`` at ``i``,
    pseudo step ``t`` at ``N + t + shift``) sees only the keys ``p − window < j``.

    ``masked`` (the authors' bug, only to show the fixture tells it apart): one causal mask over
    the last ``w2 + m`` keys for the whole ``[window; pseudo]`` block.
    """
    q, k = fx.nq, fx.nk
    m = pseudo.shape[1]
    out = []
    for h in range(H):
        per_query_head = []
        for qh in range(h * G, (h + 1) * G):
            rows = [q[qh, i] for i in range(N - w2, N)] + [pseudo[qh, t] for t in range(m)]
            cols = [0.0] * (N - w2)
            for r, query in enumerate(rows):
                if masked:
                    visible = N - (w2 + m) + r + 1
                else:
                    visible = N - w2 + r + 1 if r < w2 else N
                at = N - w2 + r + (shift if r >= w2 else 0)  # the row's position
                first = 0 if window is None else max(0, at - window + 1)
                if first >= visible:
                    continue  # its window holds no prompt key: the row scores nothing
                entries = list(range(first, visible))
                for j, p in zip(entries, attention_row(query, k[h], entries), strict=True):
                    if j < N - w2:
                        cols[j] += p
            per_query_head.append(cols)
        reduced = [sum(p[j] for p in per_query_head) / G for j in range(N - w2)]
        out.append(pool(reduced, kernel, "max"))
    return out


def _keep(scores, w2: int) -> list[Choice]:
    return [top_k(scores[h], BUDGET - w2) | set(range(N - w2, N)) for h in range(H)]


@pytest.mark.parametrize(
    ("name", "w2", "seed"), [("laq", 0, 11), ("laq", 0, 37), ("laq++", 4, 10), ("laq++", 4, 13)]
)
def test_reselection_matches_the_eq4_eq5_reference(name, w2, seed):
    fx = Fixture.make(seed)
    m = 3
    pseudo = 2.0 * torch.randn(1, HQ, m, D, generator=seeded(100 + seed))
    layer = fx.layer()
    valid = torch.ones(1, m, dtype=torch.bool)
    obs = LookaheadObservation(
        0, LAYERS, fx.q[:, :, N - w2 :], layer, SCALE, pseudo_query=pseudo, pseudo_valid=valid
    )
    method = make_method(name, window=w2, kernel=3)
    kept = method.compress_layer(obs, targets=[BUDGET])
    assert kept[0].tolist() == [BUDGET] * H
    ref = lookahead_reference(fx, pseudo[0].double().numpy(), w2, 3)
    expected = _keep(ref, w2)
    assert_layer_holds(layer, expected, fx.nk, fx.nv)
    lib = method.score(LookaheadObservation(
        0, LAYERS, fx.q[:, :, N - w2 :], fx.layer(), SCALE, pseudo_query=pseudo,
        pseudo_valid=torch.ones(1, m, dtype=bool),
    ))[0, :, : N - w2].double().numpy()  # fmt: skip
    np.testing.assert_allclose(lib, np.array(ref), rtol=1e-5, atol=1e-7)
    wrong = _keep(lookahead_reference(fx, pseudo[0].double().numpy(), w2, 3, masked=True), w2)
    assert any(not x.compatible(y) for x, y in zip(expected, wrong, strict=True)), "bug variant not rejected"


@pytest.mark.parametrize(("name", "w2"), [("laq", 0), ("laq++", 4)])
def test_pseudo_rows_see_only_their_window_on_a_sliding_window_layer(name, w2):
    """On a sliding-window layer the pseudo query at position ``N + t`` sees only the keys at
    positions ``> N + t − W``, as the model's attention would; the last step (``t = 2``, ``W = 2``)
    sees no prompt key at all and scores nothing."""
    fx = Fixture.make(11)
    m, window = 3, 6
    pseudo = 2.0 * torch.randn(1, HQ, m, D, generator=seeded(111))
    method = make_method(name, window=w2, kernel=3)

    def scores(window: int) -> np.ndarray:
        layer = fx.layer()
        layer.sliding_window = window
        obs = LookaheadObservation(
            0, LAYERS, fx.q[:, :, N - w2 :], layer, SCALE, pseudo_query=pseudo,
            pseudo_valid=torch.ones(1, m, dtype=torch.bool),
        )  # fmt: skip
        return method.score(obs)[0, :, : N - w2].double().numpy()

    for w in (window, 2):
        ref = lookahead_reference(fx, pseudo[0].double().numpy(), w2, 3, window=w)
        np.testing.assert_allclose(scores(w), np.array(ref), rtol=1e-5, atol=1e-7)
    # discriminating: pseudo rows that ignore the window score the early keys too
    unwindowed = lookahead_reference(fx, pseudo[0].double().numpy(), w2, 3)
    assert not np.allclose(scores(window), np.array(unwindowed), rtol=1e-3, atol=1e-5)
    # explicit positions (a row decoded from a later position) move the window with them
    layer = fx.layer()
    layer.sliding_window = window
    later = LookaheadObservation(
        0, LAYERS, fx.q[:, :, N - w2 :], layer, SCALE, pseudo_query=pseudo,
        pseudo_valid=torch.ones(1, m, dtype=torch.bool),
        pseudo_positions=torch.tensor([[N + 2, N + 3, N + 4]]),
    )  # fmt: skip
    shifted = lookahead_reference(fx, pseudo[0].double().numpy(), w2, 3, window=window, shift=2)
    np.testing.assert_allclose(
        method.score(later)[0, :, : N - w2].double().numpy(), np.array(shifted), rtol=1e-5, atol=1e-7
    )


def test_pseudo_rows_after_eos_count_for_nothing():
    fx = Fixture.make(3)
    pseudo = 2.0 * torch.randn(1, HQ, 3, D, generator=seeded(7))
    cut = LookaheadObservation(
        0, LAYERS, fx.q[:, :, N:], fx.layer(), SCALE, pseudo_query=pseudo[:, :, :2],
        pseudo_valid=torch.ones(1, 2, dtype=bool),
    )  # fmt: skip
    padded = LookaheadObservation(
        0, LAYERS, fx.q[:, :, N:], fx.layer(), SCALE, pseudo_query=pseudo,
        pseudo_valid=torch.tensor([[True, True, False]]),
    )  # fmt: skip
    method = make_method("laq", kernel=3)
    assert torch.allclose(method.score(cut), method.score(padded))


# ---------------------------------------------------------------------------------- plumbing
def test_timings_split_the_lookahead_and_the_reselection(llama, chat_tokenizer):
    laq = kvbudget.generate(
        llama, chat_tokenizer, CONTEXT, QUESTION, method=make_method("laq", **_options()), budget=40,
        max_new_tokens=4,
    )  # fmt: skip
    snap = kvbudget.generate(
        llama, chat_tokenizer, CONTEXT, QUESTION, method="snapkv", budget=40, max_new_tokens=4
    )
    for result in (laq, snap):
        assert {"prefill", "lookahead", "reselect", "decode"} <= set(result.timings)
    assert laq.timings["lookahead"] > 0 and laq.timings["reselect"] > 0
    assert laq.timings["compress"] >= laq.timings["lookahead"] + laq.timings["reselect"]
    assert snap.timings["lookahead"] == snap.timings["reselect"] == 0.0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"lookahead_method": "h2o"}, "lookahead_method"),
        ({"steps": 0}, "steps=0"),
        ({"steps": -1}, "steps"),
        ({"lookahead_budget": -5}, "lookahead_budget"),
        ({"budget_per": "kv"}, "budget_per must be one of kv-head, query-head, got 'kv'"),
    ],
)
def test_bad_options_are_named(options, match):
    with pytest.raises(MethodOptionError, match=match) as err:
        make_method("laq", **options)
    assert "\n" not in str(err.value)


def test_lookahead_budget_below_the_clone_method_minimum_is_refused(llama, chat_tokenizer):
    with pytest.raises(BudgetError, match="snapkv"):
        kvbudget.generate(llama, chat_tokenizer, CONTEXT, QUESTION, method="laq", budget=20, max_new_tokens=2)
    with pytest.raises(BudgetError, match="snapkv"):
        kvbudget.generate(
            llama, chat_tokenizer, CONTEXT, QUESTION, method=make_method("laq", lookahead_budget=16),
            budget=40, max_new_tokens=2,
        )  # fmt: skip


def test_question_agnostic_lookahead_runs_before_the_question(chat_tokenizer, llama):
    prompt = build_prompt(chat_tokenizer, CONTEXT, QUESTION)
    method = make_method("laq++", **_options())
    session = CompressionSession(method, llama.config.num_hidden_layers, budget=30)
    pad = chat_tokenizer.pad_token_id
    cache, _, _, _ = prefill(llama, [prompt], session, pad, compress_context_only=True)
    context = len(prompt.context_ids)
    assert session.run.lookahead.positions[0, 0] == context  # pseudo tokens follow the context
    assert cache.get_seq_length() == len(prompt.ids)
    entries = cache.stats().entries
    assert entries.eq(30 + len(prompt.question_ids)).all()  # the question is appended uncompressed
    inputs = prefill_inputs([prompt], chat_tokenizer.pad_token_id, compress_context_only=True)
    assert inputs.compressed_until == context


@pytest.mark.parametrize("lookahead_method", ["streamingllm", "full", "ada-pyramidkv"])
def test_every_lookahead_method_gives_a_budgeted_cache(lookahead_method, llama, chat_tokenizer):
    method = make_method("laq++", **_options(lookahead_method=lookahead_method))
    result = kvbudget.generate(
        llama,
        chat_tokenizer,
        CONTEXT,
        QUESTION,
        method=method,
        budget=30,
        max_new_tokens=3,
        return_cache=True,
    )
    assert result.cache.session.run.lookahead.tokens.shape[1] == 4
    assert result.cache_stats_after.entries.eq(30).all()


# ---------------------------------------------------------------------------------- budget_per
# The authors' granularity (budget_per="query-head"): noforit/Lookahead_Q-Cache repeats the KV heads
# to the query heads (repeat_kv) before caching, so the clone's SnapKV (update_kv) and the
# re-selection (update_kv_LAQ) take a top-B per query head over that head's own scores.
QH_OPTIONS = {"steps": 4, "lookahead_window": 4}  # kernel 7, max pooling: the authors' settings


def query_head_reference(fx: Fixture, pseudo: np.ndarray, w2: int, kernel: int) -> list[Choice]:
    """Eq. 4–5 per *query* head (no GQA reduction): query head ``qh`` scores the first ``N − w2``
    keys of KV head ``qh // G`` and keeps its own top ``BUDGET − w2`` plus the last ``w2``."""
    q, k = fx.nq, fx.nk
    out = []
    for qh in range(HQ):
        rows = [q[qh, i] for i in range(N - w2, N)] + [pseudo[qh, t] for t in range(pseudo.shape[1])]
        cols = [0.0] * (N - w2)
        for r, query in enumerate(rows):
            visible = N - w2 + r + 1 if r < w2 else N
            probs = attention_row(query, k[qh // G], list(range(visible)))
            for j in range(min(visible, N - w2)):
                cols[j] += probs[j]
        out.append(top_k(pool(cols, kernel, "max"), BUDGET - w2) | set(range(N - w2, N)))
    return out


@pytest.mark.parametrize(("name", "w2", "seed"), [("laq", 0, 11), ("laq", 0, 37), ("laq++", 4, 13)])
def test_query_head_layer_keeps_each_query_heads_own_top_b(name, w2, seed):
    fx = Fixture.make(seed)
    pseudo = 2.0 * torch.randn(1, HQ, 3, D, generator=seeded(100 + seed))
    layer = QueryHeadLayer.repeated(fx.layer(), G)
    assert layer.num_heads == HQ
    obs = LookaheadObservation(
        0, LAYERS, fx.q[:, :, N - w2 :], layer, SCALE, pseudo_query=pseudo,
        pseudo_valid=torch.ones(1, 3, dtype=torch.bool),
    )  # fmt: skip
    method = make_method(name, window=w2, kernel=3, budget_per="query-head")
    kept = method.compress_layer(obs, targets=[BUDGET])
    assert kept[0].tolist() == [BUDGET] * HQ
    expected = query_head_reference(fx, pseudo[0].double().numpy(), w2, 3)
    for qh in range(HQ):
        k, v, pos = layer.head(qh)
        held = pos[0].tolist()
        assert held == sorted(set(held)) and expected[qh].admits(set(held)), (qh, held, expected[qh])
        np.testing.assert_array_equal(k[0].double().numpy(), fx.nk[qh // G, held])
        np.testing.assert_array_equal(v[0].double().numpy(), fx.nv[qh // G, held])
    # the query heads of a group really keep different entries, and the kv-head scores would not
    assert any(not expected[2 * h].compatible(expected[2 * h + 1]) for h in range(H))
    averaged = lookahead_reference(fx, pseudo[0].double().numpy(), w2, 3)
    assert any(not expected[qh].compatible(_keep(averaged, w2)[qh // G]) for qh in range(HQ))


@contextmanager
def reference_attention(model, kept=None, start: int = 0, record: dict | None = None):
    """Run ``model`` (no cache, the whole sequence) with an eager float64 attention: causal before
    ``start``; the query of query head ``qh`` at a position ``p ≥ start`` sees only the prompt
    positions ``kept[layer][qh]`` and ``start .. p``. ``record[layer]``: the post-RoPE (query, key,
    value) of the layer's last call."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer, hq, q, n = module.layer_idx, query.shape[1], query.shape[2], key.shape[2]
        if record is not None:
            record[layer] = (query, key, value)
        group = hq // key.shape[1]
        logits = query.double() @ key.double().repeat_interleave(group, 1).transpose(-1, -2) * scaling
        allowed = torch.ones(q, n, dtype=torch.bool).tril(n - q).expand(hq, q, n).clone()
        if kept is not None:
            for qh in range(hq):
                row = torch.zeros(n, dtype=torch.bool)
                row[kept[layer][qh]] = True
                row[start:] = True
                allowed[qh, start - (n - q) :] &= row
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        out = probs @ value.double().repeat_interleave(group, 1)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    kvbudget.detach(model)
    AttentionInterface.register("laq_query_head_reference", attention)
    model.set_attn_implementation("laq_query_head_reference")
    try:
        with torch.no_grad():
            yield
    finally:
        model.set_attn_implementation("sdpa")


def snapkv_per_query_head(query: torch.Tensor, key: torch.Tensor, scale: float, window: int, budget: int):
    """The authors' ``SnapKVCluster.update_kv`` on repeated heads: per query head, the last ``window``
    queries' causal softmax over the keys of its KV head, summed over the rows, max-pooled (kernel 7)
    over the first ``n − window`` keys; top ``budget − window`` plus the window. ``query: [hq, n, d]``,
    ``key: [kv_heads, n, d]`` (float64)."""
    hq, n = query.shape[0], key.shape[1]
    group = hq // key.shape[0]
    out = []
    for qh in range(hq):
        cols = torch.zeros(n - window, dtype=torch.float64)
        for i in range(n - window, n):
            cols += torch.softmax(query[qh, i] @ key[qh // group, : i + 1].T * scale, dim=-1)[: n - window]
        pooled = F.max_pool1d(cols[None, None], 7, stride=1, padding=3)[0, 0]
        out.append(top_k(pooled.tolist(), budget - window) | set(range(n - window, n)))
    return out


def laq_per_query_head(pseudo: torch.Tensor, key: torch.Tensor, scale: float, budget: int, average=False):
    """The authors' ``update_kv_LAQ`` (window 0) on repeated heads: per query head, the softmax of
    the pseudo queries over the prompt keys of its KV head, summed over the rows, max-pooled (kernel
    7), top ``budget``; no GQA reduction. ``pseudo: [hq, m, d]``, ``key: [kv_heads, n, d]`` (float64).
    ``average`` (ours, kv-head: only to show the fixture tells them apart): mean over each group."""
    hq = pseudo.shape[0]
    group = hq // key.shape[0]
    scores = [torch.softmax(pseudo[qh] @ key[qh // group].T * scale, dim=-1).sum(0) for qh in range(hq)]
    if average:
        groups = [torch.stack(scores[h * group : (h + 1) * group]).mean(0) for h in range(hq // group)]
        scores = [groups[qh // group] for qh in range(hq)]
    return [top_k(F.max_pool1d(s[None, None], 7, stride=1, padding=3)[0, 0].tolist(), budget) for s in scores]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_query_head_laq_end_to_end_matches_the_authors_selection(kind, monkeypatch):
    """laq with budget_per="query-head" on a GQA model: the clone is SnapKV per query head, the pseudo
    tokens and queries are those of greedy decoding where each query head reads its own clone
    entries, and each query head of the final cache keeps its own top-B of the pseudo attention."""
    model = tiny_model(kind)
    n, budget = PROMPT_IDS.shape[1], 24
    config = model.config
    hq, kv = config.num_attention_heads, config.num_key_value_heads
    g, layers, scale = hq // kv, config.num_hidden_layers, model.model.layers[0].self_attn.scaling
    clone: dict[int, tuple[type, list[torch.Tensor]]] = {}  # each clone layer at the first pseudo step
    original = QueryCapture.after_attention

    def spy(self, layer_idx, query, layer, scaling, layers=None):
        if self.capturing and layer_idx not in clone:
            clone[layer_idx] = (type(layer), [layer.head(h)[2][0].clone() for h in range(layer.num_heads)])
        return original(self, layer_idx, query, layer, scaling, layers)

    monkeypatch.setattr(QueryCapture, "after_attention", spy)
    method = MethodSpec.parse("laq:budget_per=query-head,steps=4,lookahead_window=4").build()
    cache = kvbudget.compress(model, PROMPT_IDS, method=method, budget=budget)
    record = cache.session.run.lookahead
    prompt: dict = {}
    with reference_attention(model, record=prompt):
        full_logits = model(PROMPT_IDS).logits[0, -1]
    # 1. the clone: SnapKV (window 4) per query head, on the repeated full cache
    for i in range(layers):
        layer_type, heads = clone[i]
        assert layer_type is QueryHeadLayer and len(heads) == hq
        q, k, _ = prompt[i]
        expected = snapkv_per_query_head(q[0].double(), k[0].double(), scale, 4, budget)
        for qh in range(hq):
            assert expected[qh].admits(set(heads[qh][heads[qh] < n].tolist())), (i, qh)
    # 2. the pseudo tokens and their queries: each query head attends to its own clone entries
    kept_clone = {i: [p[p < n] for p in heads] for i, (_, heads) in clone.items()}
    tokens = [int(full_logits.argmax())]
    decoded: dict = {}
    with reference_attention(model, kept_clone, start=n, record=decoded):
        for _ in range(4):
            logits = model(torch.cat([PROMPT_IDS, torch.tensor([tokens])], 1)).logits[0, -1]
            tokens.append(int(logits.argmax()))
    assert record.tokens[0].tolist() == tokens[:4]
    for i in range(layers):
        torch.testing.assert_close(record.queries[i], decoded[i][0][:, :, n:], atol=1e-4, rtol=1e-4)
    # 3. the re-selection: each query head keeps its own top-B, with its KV head's keys and values
    tells_apart = False
    for i, layer in enumerate(cache.layers):
        assert isinstance(layer, QueryHeadLayer) and layer.num_heads == hq
        _, k, v = prompt[i]
        pseudo = record.queries[i][0].double()
        expected = laq_per_query_head(pseudo, k[0].double(), scale, budget)
        averaged = laq_per_query_head(pseudo, k[0].double(), scale, budget, average=True)
        tells_apart |= any(not a.compatible(b) for a, b in zip(expected, averaged, strict=True))
        for qh in range(hq):
            keys, values, pos = layer.head(qh)
            held = pos[0].tolist()
            assert held == sorted(set(held)) and expected[qh].admits(set(held)), (i, qh, held)
            # the prompt's keys and values come from another forward (the reference attention), whose
            # float noise reaches ~1e-5 in the deeper layers (an AVX2 CPU's fp32 kernels, here)
            torch.testing.assert_close(keys[0], k[0, qh // g, held], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(values[0], v[0, qh // g, held], atol=1e-4, rtol=1e-4)
    assert tells_apart, "the kv-head (group-averaged) selection is not told apart by this fixture"
    # 4. accounting: g·B entries per KV group; the kv-head default holds B
    stats = cache.stats()
    assert tuple(stats.entries.shape) == (layers, hq) and stats.entries.eq(budget).all()
    assert tuple(cache.session.kept.shape) == (1, layers, hq) and cache.session.kept.eq(budget).all()
    entry_bytes = 2 * model.model.layers[0].self_attn.head_dim * 4  # fp32 key + value
    assert stats.logical_bytes == layers * hq * budget * entry_bytes
    default = kvbudget.compress(model, PROMPT_IDS, method=make_method("laq", **QH_OPTIONS), budget=budget)
    assert tuple(default.stats().entries.shape) == (layers, kv)
    assert stats.logical_bytes == g * default.stats().logical_bytes
    assert stats.physical_bytes == g * default.stats().physical_bytes


@pytest.mark.parametrize("name", ["laq", "laq++", "laq-ada"])
def test_query_head_cache_decodes_each_query_head_over_its_own_entries(name):
    """Decode steps on a query-head cache (rectangular, or per head for laq-ada) append each new
    token to every query head, and each query head attends to exactly its own entries."""
    model = tiny_model("qwen2")
    n, hq = PROMPT_IDS.shape[1], model.config.num_attention_heads
    g = hq // model.config.num_key_value_heads
    method = make_method(name, budget_per="query-head", **QH_OPTIONS)
    cache = kvbudget.compress(model, PROMPT_IDS, method=method, budget=24)
    kept = {i: [layer.head(h)[2][0].clone() for h in range(hq)] for i, layer in enumerate(cache.layers)}
    if name == "laq-ada":  # per-head budgets: the per-head layout's append and attention
        assert any(layer.is_ragged for layer in cache.layers)
    before = cache.stats().entries.clone()
    tokens, got = cache.session.run.lookahead.tokens[:, :1], []
    with torch.no_grad():
        for _ in range(3):
            logits = model(tokens[:, -1:], past_key_values=cache).logits[0, -1]
            got.append(logits)
            tokens = torch.cat([tokens, logits.argmax().view(1, 1)], 1)
    assert cache.get_seq_length() == n + 3
    assert torch.equal(cache.stats().entries, before + 3)
    record: dict = {}
    with reference_attention(model, kept, start=n, record=record):
        for step in range(3):
            reference = model(torch.cat([PROMPT_IDS, tokens[:, : step + 1]], 1)).logits[0, -1]
            gap = (got[step] - reference).abs().max()
            assert torch.allclose(got[step], reference, atol=1e-4), (step, gap)
    for i, layer in enumerate(cache.layers):
        _, key, value = record[i]  # the reference's keys of positions n .. n + 2
        for qh in range(hq):
            k, v, pos = layer.head(qh)
            assert pos[0, -3:].tolist() == [n, n + 1, n + 2]
            torch.testing.assert_close(k[0, -3:], key[0, qh // g, n:])
            torch.testing.assert_close(v[0, -3:], value[0, qh // g, n:])


def test_query_head_counts_query_heads_for_prompts_that_fit(llama, chat_tokenizer):
    """A prompt within its budget is held per query head too (the authors' cache always is), alone
    or beside an evicted one; it answers as the default does (nothing is evicted)."""
    layers, hq = llama.config.num_hidden_layers, llama.config.num_attention_heads
    method = make_method("laq++", budget_per="query-head", **QH_OPTIONS)
    long, short = kvbudget.generate(
        llama, chat_tokenizer, [CONTEXT, "A cat."], QUESTION, method=method, budget=60, max_new_tokens=4
    )
    assert long.prompt_tokens > 60 >= short.prompt_tokens
    for result, entries in ((long, 60), (short, short.prompt_tokens)):
        assert tuple(result.cache_stats_after.entries.shape) == (layers, hq)
        assert result.cache_stats_after.entries.eq(entries).all()
        assert tuple(result.budgets.shape) == (layers, hq) and result.budgets.eq(entries).all()
    alone, default = (
        kvbudget.generate(
            llama, chat_tokenizer, "A cat.", QUESTION, budget=60, max_new_tokens=6,
            method=make_method("laq++", budget_per=per, **QH_OPTIONS),
        )
        for per in ("query-head", "kv-head")
    )  # fmt: skip
    assert alone.cache_stats_after.entries.eq(short.prompt_tokens).all()
    assert tuple(alone.cache_stats_after.entries.shape) == (layers, hq)
    assert tuple(default.cache_stats_after.entries.shape) == (layers, llama.config.num_key_value_heads)
    assert alone.cache_stats_after.logical_bytes == 2 * default.cache_stats_after.logical_bytes
    assert alone.token_ids == default.token_ids


def test_without_gqa_both_granularities_are_the_same(chat_tokenizer):
    torch.manual_seed(0)
    options = {**TINY, "num_key_value_heads": TINY["num_attention_heads"]}  # no GQA
    config = LlamaConfig(**options, initializer_range=0.2)
    model = LlamaForCausalLM(config).eval()
    kv, query = (
        kvbudget.generate(
            model, chat_tokenizer, CONTEXT, QUESTION, budget=30, max_new_tokens=8, return_cache=True,
            method=make_method("laq++", budget_per=per, **QH_OPTIONS),
        )
        for per in ("kv-head", "query-head")
    )  # fmt: skip
    assert kv.prompt_tokens > 30  # the budget really evicts
    assert kv.token_ids == query.token_ids
    assert torch.equal(kv.budgets, query.budgets)
    assert torch.equal(kv.cache_stats_after.entries, query.cache_stats_after.entries)
    for a, b in zip(kv.cache.layers, query.cache.layers, strict=True):
        assert a.num_heads == b.num_heads == config.num_attention_heads
        for h in range(a.num_heads):
            assert torch.equal(a.head(h)[2], b.head(h)[2])
            assert torch.equal(a.head(h)[0], b.head(h)[0])
