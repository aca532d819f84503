"""The static compressed cache and its decode step (docs/architecture.md, "Static GPU decode:
count launches, not FLOPs") against today's decoding.

A cache compressed by a method, then decoded greedily, must give the same tokens and logits
whether the steps run over the :class:`~kvbudget.cache.BudgetCache` (today's path, one attention
call per head in the per-head layout) or over its :class:`~kvbudget.static_cache.StaticBudgetCache`
conversion (one masked call per layer). The attention itself is checked against a reference
written from the definition (softmax over each head's valid entries).
"""

from __future__ import annotations

import pytest
import torch

import kvbudget
from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.attention import attend_static
from kvbudget.methods.registry import make_method
from kvbudget.prefill.common import forward_last_logits
from kvbudget.static_cache import CacheFullError, StaticBudgetCache
from kvbudget.static_decode import StaticDecoder, static_refusal
from method_matrix import ALL_METHODS, small

STEPS = 6
CONTEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
QUESTION = "What does the fox do?"


def _reference_attention(q, keys, values, lengths, scale):
    """softmax(q·kᵀ·scale) v per (row, query head), over the first ``lengths[b, kv_head]`` slots."""
    b, hq, _, d = q.shape
    hk = keys.shape[1]
    out = torch.zeros(b, hq, 1, values.shape[-1], dtype=q.dtype)
    for r in range(b):
        for h in range(hq):
            kv = h // (hq // hk)
            n = int(lengths[r, kv])
            logits = (keys[r, kv, :n] @ q[r, h, 0]) * scale
            out[r, h, 0] = torch.softmax(logits, -1) @ values[r, kv, :n]
    return out


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-queries", "query-heads"])
def test_static_attention_equals_the_definition(grouped) -> None:
    """Both layouts of a one-token step (the CPU's and CUDA's) against the definition."""
    gen = seeded(0)
    lengths = [torch.tensor([[5, 17], [64, 1]])]
    cache = StaticBudgetCache.allocate(
        lengths, 8, new_tokens=3, dtype=torch.float32, device=torch.get_default_device()
    )
    cache.keys[0].normal_(generator=gen)
    cache.values[0].normal_(generator=gen)
    q = torch.randn(2, 6, 1, 8, generator=gen)
    out = attend_static(q, cache, 0, 0.3, grouped_queries=grouped)
    expected = _reference_attention(q, cache.keys[0], cache.values[0], cache.lengths[0], 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_both_layouts_agree_under_a_sliding_window() -> None:
    gen = seeded(5)
    lengths = [torch.tensor([[15, 17], [64, 12]])]
    cache = StaticBudgetCache.allocate(
        lengths, 8, new_tokens=1, dtype=torch.float32, device=torch.get_default_device(), seen=20
    )
    cache.keys[0].normal_(generator=gen)
    cache.values[0].normal_(generator=gen)
    q = torch.randn(2, 6, 1, 8, generator=gen)
    grouped = attend_static(q, cache, 0, 0.3, window=12, grouped_queries=True)
    per_head = attend_static(q, cache, 0, 0.3, window=12, grouped_queries=False)
    torch.testing.assert_close(per_head, grouped, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(grouped, attend_static(q, cache, 0, 0.3, grouped_queries=True))


def test_update_writes_each_head_at_its_length_and_respects_the_room() -> None:
    lengths = [torch.tensor([[2, 5]])]
    cache = StaticBudgetCache.allocate(
        lengths, 4, new_tokens=1, dtype=torch.float32, device=torch.get_default_device(), seen=9
    )
    new_k = torch.ones(1, 2, 1, 4)
    cache.reserve(1)
    cache.update(new_k, 2 * new_k, 0)
    assert cache.lengths[0].tolist() == [[3, 6]]
    assert cache.keys[0][0, 0, 2].eq(1).all() and cache.keys[0][0, 1, 5].eq(1).all()
    assert cache.keys[0][0, 0, 3].eq(0).all()  # nothing written past the head's length
    assert cache.positions[0][0, :, :6].tolist() == [[0, 1, 9, -1, -1, -1], [0, 1, 2, 3, 4, 9]]
    with pytest.raises(CacheFullError, match="room for 0 more"):
        cache.reserve(1)


def _decode_reference(model, cache, token, mask, rope):
    """Today's path: greedy steps over the BudgetCache, as ``kvbudget.engine.decode_loop`` runs them."""
    tokens, logits_seen = [], []
    for _ in range(STEPS):
        mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype)], 1)
        logits = forward_last_logits(model, token[:, None], mask, rope[:, None], cache)
        logits_seen.append(logits)
        token = logits.argmax(-1)
        tokens.append(token)
        rope = rope + 1
    return torch.stack(tokens, 1), logits_seen


@pytest.mark.parametrize("name", ["full", "snapkv", "ada-snapkv", "lava", "pyramidkv", "asl"])
def test_static_decoding_equals_todays_path(name) -> None:
    """Two rows of different lengths (left padding), compressed by ``name``, then six greedy steps."""
    model = tiny_model("llama")
    gen = seeded(1)
    ids = torch.randint(5, 96, (2, 64), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # the second row is 55 tokens, left-padded
    prompt, last = ids[:, :-1], ids[:, -1]
    budget = None if name == "full" else 12
    compressed = kvbudget.compress(
        model, prompt, method=small(name), budget=budget, attention_mask=mask[:, :-1]
    )
    rope = mask[:, :-1].sum(-1)  # each row's next RoPE position: its real tokens so far
    static = StaticBudgetCache.from_budget_cache(compressed, new_tokens=STEPS, rope=rope)
    if name in ("ada-snapkv", "lava"):  # ragged per-head budgets: the static layout pads them
        assert static.padding_bytes() > 0
    expected, expected_logits = _decode_reference(model, compressed, last, mask[:, :-1], rope)
    decoder = StaticDecoder(model, static, last, graph=False)
    got = []
    for step in range(STEPS):
        got.append(decoder.step().clone())
        torch.testing.assert_close(decoder.logits, expected_logits[step], atol=1e-4, rtol=1e-4)
    assert torch.cat(got, 1).equal(expected)
    with pytest.raises(CacheFullError):
        decoder.step()


def test_the_static_step_reads_nothing_back_from_the_device(monkeypatch) -> None:
    """No host sync inside a step: no ``.item()``, ``bool``/``int`` of a tensor or ``.tolist()``
    (on a GPU these would wait for the device, and a CUDA graph cannot capture them)."""
    model = tiny_model("qwen2")
    lengths = [torch.tensor([[7, 3]])] * model.config.num_hidden_layers
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    static = StaticBudgetCache.allocate(
        lengths, head_dim, 4, torch.float32, torch.get_default_device(), seen=20
    )
    for k, v in zip(static.keys, static.values, strict=True):
        k.normal_(generator=seeded(2))
        v.normal_(generator=seeded(3))
    decoder = StaticDecoder(model, static, torch.tensor([4]), graph=False)
    calls: list[str] = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    decoder.step()
    decoder.step()
    monkeypatch.undo()
    assert calls == []


@pytest.mark.device
@pytest.mark.parametrize(("name", "compiled"), [("ada-snapkv", False), ("lava", True)])
def test_the_captured_step_equals_eager_steps_and_never_syncs(request, name: str, compiled: bool) -> None:
    """On ``--device cuda``: the step as a CUDA graph (compiled by Inductor first, ``compiled``) gives
    the eager step's tokens and logits, and replaying it under ``set_sync_debug_mode("error")``
    raises on no host sync."""
    target = torch.device(request.config.getoption("--device"))
    if target.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    model = tiny_model("llama").to(target)
    ids = torch.randint(5, 96, (2, 64), generator=seeded(4)).to(target)
    compressed = kvbudget.compress(model, ids[:, :-1], method=small(name), budget=12)
    eager = StaticDecoder(
        model, StaticBudgetCache.from_budget_cache(compressed, STEPS), ids[:, -1], graph=False
    )
    graph = StaticDecoder(
        model,
        StaticBudgetCache.from_budget_cache(compressed, STEPS),
        ids[:, -1],
        graph=True,
        compiled=compiled,
    )
    for step in range(STEPS):
        expected = eager.step().clone()
        if step >= 2:  # the first step warms up, the second captures; the others only replay
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = graph.step().clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got.equal(expected)
        torch.testing.assert_close(graph.logits, eager.logits, atol=1e-4, rtol=1e-4)


def test_the_compiled_step_gives_the_eager_steps_tokens(monkeypatch) -> None:
    """``decode="static-compiled"``: the step traced by ``torch.compile`` (TorchDynamo, then AOTAutograd
    with the cache writes functionalised; the ``aot_eager`` backend here, Inductor's code generation
    takes ~20 s on this CPU and runs in the device test) decodes the eager path's tokens."""
    compiled = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled(fn, backend="aot_eager", **kw))
    model = tiny_model("llama")
    tokenizer = tiny_tokenizer(chat_template=True)
    contexts = [CONTEXT, CONTEXT[: len(CONTEXT) // 2]]
    runs = [
        kvbudget.generate(
            model,
            tokenizer,
            contexts,
            [QUESTION] * 2,
            method=small("ada-snapkv"),
            budget=40,
            max_new_tokens=8,
            decode=decode,
        )  # fmt: skip
        for decode in ("eager", "static-compiled")
    ]
    for eager, static in zip(*runs, strict=True):
        assert static.token_ids == eager.token_ids and len(static.token_ids) == 8


@pytest.mark.parametrize("name", [n for n in ALL_METHODS if "decode" not in make_method(n).stages])
def test_generate_with_static_decoding_equals_eager_decoding(name) -> None:
    """For every method that does not evict while decoding: the same tokens, budgets and kept
    entries, ``decode="static"`` or not (a batch of two prompts of different lengths)."""
    model = tiny_model("llama")
    tokenizer = tiny_tokenizer(chat_template=True)
    contexts = [CONTEXT, CONTEXT[: len(CONTEXT) // 2]]
    options = dict(method=small(name), budget=40, max_new_tokens=8)
    eager = kvbudget.generate(model, tokenizer, contexts, [QUESTION] * 2, **options)
    options["method"] = small(name)
    static = kvbudget.generate(model, tokenizer, contexts, [QUESTION] * 2, decode="static", **options)
    for e, s in zip(eager, static, strict=True):
        assert s.token_ids == e.token_ids
        assert s.budgets.equal(e.budgets)
        assert s.cache_stats_after.entries.equal(e.cache_stats_after.entries)


def test_methods_that_evict_while_decoding_say_why_they_decode_eagerly() -> None:
    model = tiny_model("llama")
    cache = kvbudget.compress(model, torch.randint(5, 90, (1, 60)), method=small("h2o"), budget=40)
    assert "evicts while decoding" in static_refusal(make_method("h2o"), cache)
    snap = kvbudget.compress(model, torch.randint(5, 90, (1, 60)), method=small("snapkv"), budget=40)
    assert static_refusal(make_method("snapkv"), snap) is None
    assert "sampling" in static_refusal(make_method("snapkv"), snap, temperature=0.7)
    with pytest.raises(kvbudget.errors.InputError, match="decode must be one of eager, static"):
        kvbudget.generate(model, tiny_tokenizer(True), CONTEXT, QUESTION, decode="graph")
