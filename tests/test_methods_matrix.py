"""Generic properties every registered method must have (tiny random models, no download)."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

import kvbudget
from conftest import seeded, tiny_model
from kvbudget.cache import BudgetCache
from kvbudget.methods.registry import method_info
from method_matrix import (
    ALL_METHODS,
    BEYOND_BUDGET,
    COMPRESSING_METHODS,
    DECODE_METHODS,
    DYNAMIC_LAYER_METHODS,
    MERGING_METHODS,
    PROFILED_METHODS,
    PRUNE_METHODS,
    small,
)

CONTEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
QUESTION = "What does the fox do?"


@pytest.mark.parametrize("name", ALL_METHODS)
def test_budget_covering_the_prompt_changes_nothing(name, llama, chat_tokenizer):
    """Budget ≥ prompt: a no-op. Decode-stage methods hold the cache at the budget while
    generating, so for them the budget must also cover the generated tokens."""
    full = kvbudget.generate(llama, chat_tokenizer, CONTEXT, QUESTION, method="full", max_new_tokens=16)
    budget = full.prompt_tokens + (16 if name in DECODE_METHODS else 0)
    same = kvbudget.generate(
        llama, chat_tokenizer, CONTEXT, QUESTION, method=small(name), budget=budget, max_new_tokens=16
    )
    assert same.token_ids == full.token_ids
    assert int(same.cache_stats_after.entries.min()) == full.prompt_tokens
    assert same.budgets.eq(full.prompt_tokens).all()


@pytest.mark.parametrize("name", COMPRESSING_METHODS)
def test_compression_keeps_the_budget(name, llama):
    ids = torch.randint(3, 90, (1, 120), generator=seeded(1))
    budget = 24
    cache = kvbudget.compress(llama, ids, method=small(name), budget=budget)
    stats = cache.stats()
    layers, heads = stats.entries.shape
    # logical length: every token was seen; two-pass methods re-index the selected tokens 0..k−1
    assert cache.get_seq_length() == (budget if getattr(small(name), "two_pass", False) else 120)
    if getattr(small(name), "layer_alloc", None) == "pyramid":  # pyramidkv, ada-pyramidkv, lava-pyramid
        per_layer = stats.entries.sum(1)
        assert per_layer[0] > per_layer[-1]  # pyramid: bottom keeps more than top
        # the floored step of the paper's formula can only add, by < layers·(layers−1)/2 per head
        assert (
            layers * heads * budget
            <= stats.entries.sum()
            < heads * (layers * budget + layers * (layers - 1) / 2)
        )
        # PyramidKV's formula by hand (window 4, β 20, 120 tokens): B' = 20, min 1, max 39, step 12
        assert per_layer.tolist() == [heads * (39 - 12 * layer + 4) for layer in range(layers)]
    elif name == "asl-fullkv":
        # full cache up to the selection layer (l_min = 1 with tau > 1), the k selected tokens after it
        assert stats.entries[:2].eq(120).all() and stats.entries[2:].eq(budget).all()
    elif name == "pyramidinfer":
        # every layer holds what it processed: the whole prompt first, never fewer than the budget
        per_layer = stats.entries[:, 0]
        assert per_layer[0] == 120 and per_layer.min() >= budget
        assert (per_layer[1:] <= per_layer[:-1]).all() and per_layer[-1] < 120
    elif name in DYNAMIC_LAYER_METHODS or name in PROFILED_METHODS:
        # dynamic or profiled layer budgets (LAVa, CAKE, D2O, BaKlaVa): the model's total is exact,
        # every head keeps its window
        assert int(stats.entries.sum()) == layers * heads * budget
        assert stats.entries.min() >= small(name).window
    else:
        assert stats.entries.sum(1).eq(heads * budget).all()  # every layer holds exactly its total
    assert stats.logical_bytes == int(stats.entries.sum()) * cache.layers[0].entry_bytes()
    assert stats.physical_bytes == stats.logical_bytes  # batch of one: no padding anywhere


def _reference_attention(kept: dict[int, list[torch.Tensor]]):
    """Eager attention over the full sequence; the LAST query sees only the kept keys (and itself)."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        hq, hk = query.shape[1], key.shape[1]
        group = hq // hk
        k = key.repeat_interleave(group, 1).float()
        v = value.repeat_interleave(group, 1).float()
        logits = query.float() @ k.transpose(-1, -2) * scaling
        n = key.shape[2]
        allowed = torch.ones(query.shape[2], n, dtype=torch.bool).tril(n - query.shape[2])
        allowed = allowed.expand(hq, -1, -1).clone()
        for h in range(hk):
            last_row = torch.zeros(n, dtype=torch.bool)
            last_row[kept[module.layer_idx][h]] = True
            last_row[n - 1] = True
            allowed[h * group : (h + 1) * group, -1] = last_row
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        return (probs @ v).to(query.dtype).transpose(1, 2).contiguous(), None

    return attention


@pytest.mark.parametrize("name", [m for m in ALL_METHODS if m not in MERGING_METHODS + PRUNE_METHODS])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decode_step_equals_masked_full_sequence(name, kind):
    """Exact attention over the kept entries. Merging methods (MERGING_METHODS) change the kept
    keys/values, so no masked reference exists for them; tests/test_d2o.py checks their merged
    tensors (prefill and decode) against float64 re-computations of the papers' formulas.
    Prune-stage methods are excluded too: their deeper layers' keys come from a pruned forward,
    which a masked full-sequence forward does not reproduce (tests/test_prune.py checks them
    against an independent layer-by-layer recomputation instead)."""
    model = tiny_model(kind)
    ids = torch.randint(3, 90, (1, 80), generator=seeded(2))
    cache = kvbudget.compress(model, ids[:, :-1], method=small(name), budget=20)
    kept = {
        i: [layer.head(h)[2][0][layer.head(h)[2][0] >= 0] for h in range(layer.num_heads)]
        for i, layer in enumerate(cache.layers)
    }
    with torch.no_grad():
        logits = model(ids[:, -1:], past_key_values=cache).logits[0, -1]
        kvbudget.detach(model)
        AttentionInterface.register("kvbudget_reference", _reference_attention(kept))
        model.set_attn_implementation("kvbudget_reference")
        reference = model(ids).logits[0, -1]
        model.set_attn_implementation("sdpa")
    assert torch.allclose(logits, reference, atol=1e-4), (logits - reference).abs().max()


@pytest.mark.parametrize("name", ALL_METHODS)
def test_batch_of_different_lengths_equals_each_alone(name, llama, chat_tokenizer):
    contexts = [CONTEXT, CONTEXT[:90]]
    questions = [QUESTION, "Who sleeps?"]
    batch = kvbudget.generate(
        llama, chat_tokenizer, contexts, questions, method=small(name), budget=40, max_new_tokens=12
    )
    for r in range(2):
        alone = kvbudget.generate(
            llama, chat_tokenizer, contexts[r], questions[r], method=small(name), budget=40, max_new_tokens=12
        )
        assert batch[r].token_ids == alone.token_ids
        assert batch[r].budgets.equal(alone.budgets)


@pytest.mark.parametrize("name", DECODE_METHODS)
def test_decode_methods_hold_the_budget_every_step(name, llama):
    ids = torch.randint(3, 90, (1, 60), generator=seeded(3))
    budget = 24
    cache = kvbudget.compress(llama, ids, method=small(name), budget=budget)
    held = cache.stats().entries.clone()
    if name in DYNAMIC_LAYER_METHODS or name in PROFILED_METHODS:  # per-layer budgets; exact total
        assert int(held.sum()) == held.numel() * budget
    else:
        assert held.eq(budget).all()
    token = ids[:, -1:]
    with torch.no_grad():
        for step in range(10):
            logits = llama(token, past_key_values=cache).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            entries = cache.stats().entries
            assert entries.eq(held).all(), (step, entries)
            assert cache.get_seq_length() == 61 + step


@pytest.mark.parametrize("name", ["snapkv", "ada-snapkv", "h2o"])
def test_model_generate_accepts_a_budget_cache(name, llama):
    ids = torch.randint(3, 90, (1, 70), generator=seeded(4))
    cache = kvbudget.compress(llama, ids[:, :-1], method=small(name), budget=24)
    assert isinstance(cache, BudgetCache)
    out = llama.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 76)
    assert cache.get_seq_length() == 75
    # the same continuation, decoded by kvbudget's own loop from an identical cache
    cache2 = kvbudget.compress(llama, ids[:, :-1], method=small(name), budget=24)
    token, mine = ids[:, -1:], []
    with torch.no_grad():
        for _ in range(6):
            token = llama(token, past_key_values=cache2).logits[:, -1].argmax(-1, keepdim=True)
            mine.append(int(token))
    assert out[0, 70:].tolist() == mine


def test_the_groups_are_read_from_the_methods() -> None:
    """The groups come from the methods' stages, options and metadata (tests/method_matrix.py), and
    they hold the methods known to belong to them; every method's small options fit the budget test."""
    assert {"d2o", "d2o-uniform", "cam"} <= set(MERGING_METHODS) and "d2o-nomerge" not in MERGING_METHODS
    assert {"squeezeattention", "baklava", "baklava-snapkv"} <= set(PROFILED_METHODS)
    assert {"asl-fullkv", "pyramidinfer"} <= set(BEYOND_BUDGET) and "asl" not in BEYOND_BUDGET
    assert {"h2o", "streamingllm", "d2o", "cake"} <= set(DECODE_METHODS)
    assert {"lava", "cake", "d2o"} <= set(
        DYNAMIC_LAYER_METHODS
    ) and "lava-uniform" not in DYNAMIC_LAYER_METHODS
    assert {"asl", "fastkv", "gemfilter", "pyramidinfer"} <= set(PRUNE_METHODS)
    for name in ALL_METHODS:  # the budget test keeps 24 entries a head
        method = small(name)
        assert method.window + method.sinks < 24, (name, method.window, method.sinks)
        assert set(method_info(name).small_options) <= set(method.options()), name
