"""References for kvzip, expected-attention and r-kv: what each keeps equals an independent computation.

The references never call kvbudget's scoring, allocation or selection helpers:

* **kvzip**: the tiny model's own eager attention (transformers, ``output_attentions``) over the
  context followed by the reconstruction input, renormalised over the keys the paper's Algorithm 1
  keeps in the score's softmax, maxed over the pass's queries and the GQA group; the kept set is a
  sort of every ``(score, layer, head, slot)`` triple.
* **expected-attention**: pre-RoPE queries recomputed from the model's hidden states (its input
  norm, ``q_proj``), their mean and covariance rotated by the average of explicit RoPE matrices
  over the future positions, the closed-form expected logits, softmax, value norms; the keys and
  values from a plain ``DynamicCache`` forward.
* **r-kv**: float64 loops over heads and tokens of the authors' formulas (window attention with
  the GQA max of the logits, max pooling, the key cosine-similarity redundancy with the most
  recent similar token spared), on a layer driven through the prefill and decode steps by hand.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import kvbudget
from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.methods.registry import make_method

REPEAT = "\n\nRepeat the previous context exactly."
CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with "


# ---------------------------------------------------------------------------------------- kvzip
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny Llama saved with a chat-template tokenizer (KVzip tokenises its requests with it),
    loaded twice: one copy for kvbudget, one left on transformers' eager attention."""
    path = tmp_path_factory.mktemp("kvzip") / "model"
    tiny_model("llama", seed=5).save_pretrained(path)
    tok = tiny_tokenizer(chat_template=True)
    tok.save_pretrained(path)
    ours = AutoModelForCausalLM.from_pretrained(path).eval()
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return {"path": path, "tok": tok, "ours": ours, "reference": reference}


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def kvzip_reference_scores(
    model, tok, ids: list[int], prefix: int, sinks: int, chunk: int, suffix_text: str
) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, n]``: the most attention each context entry receives in its chunk's pass
    (``suffix_text``: what the chat template puts after a user message)."""
    n = len(ids)
    cfg = model.config
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    scores = [torch.zeros(hk, n, dtype=torch.float64) for _ in range(cfg.num_hidden_layers)]
    suffix = _encode(tok, suffix_text)
    for start in range(prefix, n, chunk):
        end = min(start + chunk, n)
        if start == prefix:
            request = _encode(tok, REPEAT)
        else:
            request = _encode(tok, CONTINUE) + ids[max(prefix, start - 8) : start]
        feed = request + suffix + ids[start:end]
        q = len(feed)
        with torch.no_grad():
            out = model(torch.tensor([ids + feed]), output_attentions=True)
        lead = min(max(prefix, sinks), start)
        columns = list(range(lead)) + list(range(start, end)) + list(range(n, n + q))
        for layer, attn in enumerate(out.attentions):
            probs = attn[0, :, n:, :].double()[:, :, columns]  # [hq, q, |columns|]
            probs = probs / probs.sum(-1, keepdim=True)  # the softmax restricted to those keys
            chunk_probs = probs[:, :, lead : lead + end - start]
            per_query_head = chunk_probs.amax(1)  # [hq, m]
            for h in range(hk):
                group = per_query_head[h * (hq // hk) : (h + 1) * (hq // hk)]
                scores[layer][h, start:end] = group.amax(0)
    return scores


def reference_keep(
    scores: list[torch.Tensor], always: int, total_per_layer: int, level: str
) -> list[list[set]]:
    """Kept slots per layer and head: ``always`` first entries, then the best by score at ``level``."""
    layers, heads, n = len(scores), scores[0].shape[0], scores[0].shape[1]
    keep = [[set(range(always)) for _ in range(heads)] for _ in range(layers)]
    if level == "head":
        for layer in range(layers):
            for h in range(heads):
                rest = sorted(range(always, n), key=lambda i: -float(scores[layer][h, i]))
                keep[layer][h] |= set(rest[: total_per_layer // heads - always])
        return keep
    groups = [list(range(layers))] if level == "pair" else [[layer] for layer in range(layers)]
    for group in groups:
        triples = [
            (float(scores[la][h, i]), la, h, i)
            for la in group
            for h in range(heads)
            for i in range(always, n)
        ]
        triples.sort(key=lambda t: -t[0])
        room = total_per_layer * len(group) - always * heads * len(group)
        gap = triples[room - 1][0] - triples[room][0]
        assert gap > 1e-6, "the fixture has a near tie at the cut"
        for _, la, h, i in triples[:room]:
            keep[la][h].add(i)
    return keep


def _kept(cache) -> list[list[set]]:
    return [[set(layer.head(h)[2][0].tolist()) for h in range(layer.num_heads)] for layer in cache.layers]


@pytest.mark.parametrize(
    ("level", "chunk", "budget"), [("pair", 2048, 40), ("pair", 45, 30), ("layer", 45, 40), ("head", 60, 32)]
)
def test_kvzip_keeps_the_reconstruction_pass_top(saved: dict, level: str, chunk: int, budget: int) -> None:
    """Template prefix ``<user>`` kept whole and never reconstructed; one pass (chunk 2048) or
    several (chunk 45: later passes quote the previous chunk's last 8 tokens)."""
    tok = saved["tok"]
    text = "Alice keeps 7 red keys in a box; Bob counts 12 blue stones by the river, then sleeps."
    ids = _encode(tok, "<user>" + text)
    prefix = len(_encode(tok, "<user>"))
    method = make_method("kvzip", level=level, chunk=chunk)
    cache = kvbudget.compress(saved["ours"], torch.tensor([ids]), method=method, budget=budget)
    scores = kvzip_reference_scores(saved["reference"], tok, ids, prefix, 4, chunk, "</user><assistant>")
    layers, heads = len(scores), scores[0].shape[0]
    expected = reference_keep(scores, max(prefix, 4), heads * budget, level)
    assert _kept(cache) == expected
    entries = cache.stats().entries
    assert int(entries.sum()) == layers * heads * budget
    if level == "pair":  # one top-k over the whole model: layers and heads keep different counts
        assert len(set(entries.flatten().tolist())) > 1
        assert any(layer.is_ragged for layer in cache.layers)
    if level == "layer":
        assert entries.sum(1).eq(heads * budget).all()


def test_kvzip_without_a_template_reconstructs_from_the_first_token(saved: dict, tmp_path: Path) -> None:
    """No chat template: no prefix, suffix ``"\\n"``, the 4 sinks kept; chunked passes see only the
    first ``min(4, start)`` entries besides their chunk (kvpress's sink rule)."""
    tiny_model("llama", seed=5).save_pretrained(tmp_path)
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 96, (90,), generator=seeded(8)).tolist()
    cache = kvbudget.compress(ours, torch.tensor([ids]), method=make_method("kvzip", chunk=40), budget=30)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    scores = kvzip_reference_scores(reference, tok, ids, 0, 4, 40, "\n")
    assert _kept(cache) == reference_keep(scores, 4, 2 * 30, "pair")


def test_kvzip_on_sliding_window_layers_scores_what_the_window_shows(tmp_path: Path) -> None:
    """A Mistral whose every layer slides (window 60 over a 91-token context): the pass's queries,
    at positions after the context, see only its last entries, so entries their windows never hold
    score 0 — the reference is the model's own eager attention, which applies the window."""
    torch.manual_seed(5)
    from transformers import MistralConfig, MistralForCausalLM

    from conftest import TINY

    config = MistralConfig(**TINY, initializer_range=0.2, sliding_window=60)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    tok = tiny_tokenizer(chat_template=True)
    tok.save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    text = "Alice keeps 7 red keys in a box; Bob counts 12 blue stones by the river, then sleeps."
    ids = _encode(tok, "<user>" + text)
    prefix = len(_encode(tok, "<user>"))
    cache = kvbudget.compress(ours, torch.tensor([ids]), method=make_method("kvzip"), budget=20)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    scores = kvzip_reference_scores(reference, tok, ids, prefix, 4, 2048, "</user><assistant>")
    hidden = len(ids) - 60  # the pass's first query sits at len(ids): entries at or before this: unseen
    assert all(float(layer[:, prefix : hidden + 1].abs().max()) == 0.0 for layer in scores)
    expected = reference_keep(scores, max(prefix, 4), 2 * 20, "pair")
    assert _kept(cache) == expected
    # discriminating: the same weights with global attention keep other entries
    unwindowed = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", sliding_window=None
    ).eval()
    wide = kvzip_reference_scores(unwindowed, tok, ids, prefix, 4, 2048, "</user><assistant>")
    assert reference_keep(wide, max(prefix, 4), 2 * 20, "pair") != expected


def test_kvzip_refuses_bad_options() -> None:
    from kvbudget.errors import MethodOptionError

    for options, words in [
        ({"level": "global"}, "level"),
        ({"chunk": 0}, "chunk"),
        ({"overlap": -1}, "overlap"),
    ]:
        with pytest.raises(MethodOptionError, match=words):
            make_method("kvzip", **options)


# --------------------------------------------------------------------------- expected-attention
def rope_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The ``[d, d]`` matrix of ``x ↦ x·cos + rotate_half(x)·sin`` (transformers' RoPE), built entry
    by entry: ``rotate_half(x) = [−x[d/2:], x[:d/2]]``."""
    d = cos.shape[0]
    m = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d):
        m[i, i] = cos[i]
        if i < d // 2:
            m[i, i + d // 2] = -sin[i]
        else:
            m[i, i - d // 2] = sin[i]
    return m


def expected_attention_reference(model, ids: list[int], sinks: int, future: int, eps: float, cov_on: bool,
                                 last: int) -> list[torch.Tensor]:  # fmt: skip
    """Per layer ``[kv_heads, n]`` scores from the model's own projections and RoPE."""
    cfg = model.config
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    n = len(ids)
    cache = DynamicCache()
    with torch.no_grad():
        out = model(torch.tensor([ids]), past_key_values=cache, output_hidden_states=True)
        positions = torch.arange(n, n + future)[None]
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    rbar = sum(rope_matrix(cos[0, t].double(), sin[0, t].double()) for t in range(future)) / future
    scores = []
    for layer_idx, layer in enumerate(model.model.layers):
        with torch.no_grad():
            h = layer.input_layernorm(out.hidden_states[layer_idx][0])
            q = layer.self_attn.q_proj(h).view(n, hq, d).double()  # pre-RoPE queries
        stats = q[max(sinks, n - last if last else 0) :]
        keys = cache.layers[layer_idx].keys[0].double()  # [hk, n, d] post-RoPE
        values = cache.layers[layer_idx].values[0].double()
        per_head = torch.zeros(hq, n, dtype=torch.float64)
        for qh in range(hq):
            mu = stats[:, qh].mean(0)
            centred = stats[:, qh] - mu
            sigma = centred.T @ centred / stats.shape[0]
            mu_f, sigma_f = rbar @ mu, rbar @ sigma @ rbar.T
            k = keys[qh // (hq // hk), sinks:]
            logits = k @ mu_f / math.sqrt(d)
            if cov_on:
                logits = logits + torch.stack([kk @ sigma_f @ kk for kk in k]) / (2 * d)
            per_head[qh, sinks:] = torch.softmax(logits, 0)
        grouped = per_head.view(hk, hq // hk, n).mean(1)
        scores.append((grouped + eps) * values.norm(dim=-1))
    return scores


def ada_caps(scores: torch.Tensor, sinks: int, budget: int, alpha: float) -> list[int]:
    """AdaKV's per-head counts (window excluded): winners of one sort over every (head, slot), then
    ``n_h(1 − α) + B'α`` rounded by largest remainder (ties to the earlier head)."""
    heads, n = scores.shape
    b_prime = budget - sinks
    triples = sorted(((float(scores[h, i]), h, i) for h in range(heads) for i in range(sinks, n)),
                     key=lambda t: (-t[0], t[1], t[2]))  # fmt: skip
    wins = [0] * heads
    for _, h, _ in triples[: heads * b_prime]:
        wins[h] += 1
    shares = [w * (1 - alpha) + b_prime * alpha for w in wins]
    caps = [math.floor(x) for x in shares]
    rest = heads * b_prime - sum(caps)
    for h in sorted(range(heads), key=lambda h: (-(shares[h] - caps[h]), h))[:rest]:
        caps[h] += 1
    return caps


def kvpress_floor_caps(scores: torch.Tensor, sinks: int, budget: int, alpha: float) -> list[int]:
    """kvpress ``AdaKVPress``'s per-head counts (sinks excluded), step by step as its ``compress``:
    the sinks scored above every entry, each head's top ``max(1, int(α·B))`` raised to +inf, then the
    ``H·(n − B)`` lowest (head, slot) pairs pruned (ties: the later pair first)."""
    heads, n = scores.shape
    s = scores.double().clone()
    s[:, :sinks] = float(s.max()) + 1
    safe = max(1, int(budget * alpha)) if alpha > 0 else 0
    for h in range(heads):
        for i in sorted(range(n), key=lambda i: -float(s[h, i]))[:safe]:
            s[h, i] = math.inf
    ascending = sorted(((float(s[h, i]), h, i) for h in range(heads) for i in range(n)),
                       key=lambda t: (t[0], -t[1], -t[2]))  # fmt: skip
    kept = [n] * heads
    for _, h, _ in ascending[: heads * (n - budget)]:
        kept[h] -= 1
    return [k - sinks for k in kept]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize(
    ("options", "budget"),
    [
        ({"adaptive": False, "epsilon": 0.0}, 30),
        ({}, 30),
        ({"floor": "kvpress"}, 30),
        ({"floor": "kvpress", "floor_alpha": 0.9}, 24),
        ({"adaptive": False, "covariance": False, "queries": 40}, 24),
        ({"floor_alpha": 0.0, "future": 64}, 20),
    ],
)  # fmt: skip
def test_expected_attention_keeps_the_closed_form_top(kind: str, options: dict, budget: int) -> None:
    method = make_method("expected-attention", **options)
    ids = torch.randint(3, 90, (100,), generator=seeded(11)).tolist()
    cache = kvbudget.compress(tiny_model(kind, seed=2), torch.tensor([ids]), method=method, budget=budget)
    scores = expected_attention_reference(
        tiny_model(kind, seed=2),
        ids,
        method.sinks,
        method.future,
        method.epsilon,
        method.covariance,
        method.queries,
    )
    binds = False  # kvpress's floor changes some head's budget
    for layer_idx, layer in enumerate(cache.layers):
        s = scores[layer_idx]
        heads = s.shape[0]
        if not method.adaptive:
            caps = [budget - 4] * heads
        elif method.floor == "kvpress":
            caps = kvpress_floor_caps(s, 4, budget, method.floor_alpha)
            binds |= caps != kvpress_floor_caps(s, 4, budget, 0.0)
        else:
            caps = ada_caps(s, 4, budget, method.floor_alpha)
        for h in range(heads):
            ranked = sorted(range(4, len(ids)), key=lambda i: -float(s[h, i]))
            assert float(s[h, ranked[caps[h] - 1]] - s[h, ranked[caps[h]]]) > 1e-7  # no near tie at the cut
            expected = set(range(4)) | set(ranked[: caps[h]])
            assert set(layer.head(h)[2][0].tolist()) == expected, (layer_idx, h)
    entries = cache.stats().entries
    assert int(entries.sum()) == entries.numel() * budget
    if method.adaptive:
        assert len(set(entries.flatten().tolist())) > 1  # head budgets differ
    if method.floor_alpha == 0.9:
        assert binds


def test_expected_attention_needs_a_rotary_model_and_good_options() -> None:
    from kvbudget.errors import MethodOptionError

    for options, words in [
        ({"future": 0}, "future"),
        ({"epsilon": -1.0}, "epsilon"),
        ({"floor_alpha": 2.0}, "floor"),
        ({"floor": "median"}, "floor must be one of adakv, kvpress"),
    ]:
        with pytest.raises(MethodOptionError, match=words):
            make_method("expected-attention", **options)


# ----------------------------------------------------------------------------------------- r-kv
RH, RG, RD = 2, 2, 8  # KV heads, GQA group, head dim


def rkv_reference_keep(held: list[list[tuple[int, torch.Tensor]]], queries: list[torch.Tensor], budget: int,
                       w: int, kernel: int, lam: float, thr: float) -> list[set[int]]:  # fmt: skip
    """Per head the positions R-KV keeps of ``held[h] = [(position, key)]`` (slot order), scored by
    the last ``w`` queries ``[q_heads, d]`` (float64 loops over heads, queries and entries)."""
    scale = 1 / math.sqrt(RD)
    keep = []
    for h in range(RH):
        entries = held[h]
        n = len(entries)
        cand = list(range(n - w))
        attn = [0.0] * len(cand)
        for q in queries:
            logits = [
                max(scale * float(q[h * RG + g].double() @ entries[j][1].double()) for g in range(RG))
                for j in cand
            ]
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            for j in cand:
                attn[j] += exps[j] / sum(exps) / len(queries)
        pooled = [max(attn[max(0, j - kernel // 2) : j + kernel // 2 + 1]) for j in cand]
        unit = [e[1].double() / (e[1].double().norm() + 1e-8) for e in entries]
        sim = [[0.0 if i == j else float(unit[i] @ unit[j]) for j in range(n)] for i in range(n)]
        for i in range(n):
            similar = [j for j in range(n) if j != i and sim[i][j] > thr]
            if similar:
                sim[i][max(similar)] = 0.0
        means = [sum(sim[i][j] for i in range(n)) / n for j in range(n)]
        top = max(means)
        red = [math.exp(m - top) for m in means]
        red = [r / sum(red) for r in red]
        z = {j: lam * pooled[j] - (1 - lam) * red[j] for j in cand}
        ranked = sorted(cand, key=lambda j: -z[j])
        k = budget - w
        assert z[ranked[k - 1]] - z[ranked[k]] > 1e-6, "near tie at the cut"
        keep.append({entries[j][0] for j in ranked[:k]} | {entries[j][0] for j in range(n - w, n)})
    return keep


@pytest.mark.parametrize(("budget", "buffer", "seed"), [(12, 3, 0), (10, 1, 1), (16, 5, 2)])
def test_rkv_prefill_and_decode_keep_importance_minus_redundancy(budget: int, buffer: int, seed: int) -> None:
    from kvbudget.cache import BudgetLayer
    from kvbudget.observation import Observation

    g = seeded(seed)
    n0, steps, w = 30, 14, 4
    base = torch.randn(RH, 3, RD, generator=g)  # few directions: many keys are near-copies (redundant)
    keys = base[:, torch.randint(0, 3, (n0 + steps,), generator=g)] + 0.6 * torch.randn(
        RH, n0 + steps, RD, generator=g
    )
    values = torch.randn(RH, n0 + steps, RD, generator=g)
    queries = 2.0 * torch.randn(RH * RG, n0 + steps, RD, generator=g)
    method = make_method("r-kv", window=w, buffer=buffer, kernel=3)
    layer = BudgetLayer()
    layer.update(keys[None, :, :n0].clone(), values[None, :, :n0].clone())
    observation = Observation(0, 1, queries[None, :, :n0], layer, 1 / math.sqrt(RD))
    method.compress_layer(observation, targets=[budget])
    held = [[(i, keys[h, i]) for i in range(n0)] for h in range(RH)]
    recent = [queries[:, i] for i in range(n0 - w, n0)]
    kept = rkv_reference_keep(held, recent, budget, w, 3, 0.1, 0.5)
    held = [[(i, keys[h, i]) for i in sorted(kept[h])] for h in range(RH)]
    compressions = 1
    for t in range(n0, n0 + steps):
        assert [layer.head(h)[2][0].tolist() for h in range(RH)] == [
            [p for p, _ in held[h]] for h in range(RH)
        ]
        layer.update(keys[None, :, t : t + 1].clone(), values[None, :, t : t + 1].clone())
        step = Observation(0, 1, queries[None, :, t : t + 1], layer, 1 / math.sqrt(RD), run=observation.run)
        method.decode_step(step, [budget])  # the same run: its remembered queries
        held = [held[h] + [(t, keys[h, t])] for h in range(RH)]
        recent = (recent + [queries[:, t]])[-w:]
        if len(held[0]) >= budget + buffer:
            kept = rkv_reference_keep(held, recent, budget, w, 3, 0.1, 0.5)
            held = [[(p, k) for p, k in held[h] if p in kept[h]] for h in range(RH)]
            compressions += 1
        assert layer.head_lengths()[0].tolist() == [len(held[h]) for h in range(RH)]
        assert budget <= len(held[0]) < budget + buffer
    assert compressions >= 3


def test_rkv_cache_stays_between_budget_and_budget_plus_buffer(llama, chat_tokenizer) -> None:
    """End to end: the prompt is cut to B, then every 4th decoded token brings a head back to B."""
    context = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 2
    result = kvbudget.generate(
        llama, chat_tokenizer, context, "What?", method=make_method("r-kv", buffer=4), budget=24,
        max_new_tokens=12,
    )  # fmt: skip
    cells = llama.config.num_hidden_layers * llama.config.num_key_value_heads
    assert result.cache_stats_after.entries.eq(24).all()
    steps = len(result.token_ids) - 1
    assert steps >= 8
    assert result.cache_trace == [cells * (24 + s % 4) for s in range(1, steps + 1)]


def test_rkv_refuses_bad_options() -> None:
    from kvbudget.errors import MethodOptionError

    for options, words in [
        ({"buffer": 0}, "buffer"),
        ({"mix_lambda": 1.5}, "mix_lambda"),
        ({"window": 0}, "window"),
    ]:
        with pytest.raises(MethodOptionError, match=words):
            make_method("r-kv", **options)
