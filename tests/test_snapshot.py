"""Shared prefill: deriving a cache from a snapshot equals compressing during the prefill, bit for bit."""

from __future__ import annotations

import pytest
import torch

import kvbudget
from kvbudget.engine import build_prompt, decode_loop, eos_ids, prefill_inputs
from kvbudget.errors import KVBudgetError
from kvbudget.observation import Observation
from kvbudget.prefill.derived import derive, take_snapshot
from kvbudget.session import CompressionSession
from method_matrix import ALL_METHODS, PRUNE_METHODS, small

CONTEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3,
    "Short context here. " * 5,
]
QUESTIONS = ["What does the fox do?", "What is here?"]


def _layers_equal(a, b) -> bool:
    for la, lb in zip(a.layers, b.layers, strict=True):
        for h in range(la.num_heads):
            ka, va, pa = la.head(h)
            kb, vb, pb = lb.head(h)
            if not (torch.equal(ka, kb) and torch.equal(va, vb) and torch.equal(pa, pb)):
                return False
    return True


@pytest.mark.parametrize("name", PRUNE_METHODS)
def test_prune_methods_need_the_hidden_states_in_the_snapshot(name, llama, chat_tokenizer):
    """A prune-stage method runs its deeper layers from the hidden states where it cuts."""
    inputs = prefill_inputs([build_prompt(chat_tokenizer, CONTEXTS[0], QUESTIONS[0])], 0)
    with pytest.raises(KVBudgetError, match="prune-stage.*hidden_states=True"):
        derive(llama, take_snapshot(llama, inputs), small(name), budget=20)


@pytest.mark.parametrize("agnostic", [False, True])
@pytest.mark.parametrize("name", PRUNE_METHODS)
def test_derived_prune_method_equals_its_own_prefill(name, agnostic, llama, chat_tokenizer):
    """Replaying the snapshot up to the cut and running the deeper layers on the kept tokens gives
    the prune prefill's cache, budgets, cut layers and answers bit for bit (a padded batch)."""
    budget = 24
    prompts = [build_prompt(chat_tokenizer, c, q) for c, q in zip(CONTEXTS, QUESTIONS, strict=True)]
    eos = eos_ids(llama, chat_tokenizer)
    own = small(name)
    session = CompressionSession(own, llama.config.num_hidden_layers, budget=budget)
    cache, logits, mask, last_pos = kvbudget.engine.prefill(
        llama, prompts, session, chat_tokenizer.pad_token_id, agnostic, eos
    )
    inputs = prefill_inputs(prompts, chat_tokenizer.pad_token_id, compress_context_only=agnostic)
    derived = small(name)
    d_cache, d_logits, d_mask, d_last = derive(
        llama, take_snapshot(llama, inputs, hidden_states=True), derived, budget=budget, eos=eos
    )
    assert d_cache.session.run.selection_layers == session.run.selection_layers
    assert any(layer is not None for layer in session.run.selection_layers)  # the method did cut
    assert torch.equal(d_cache.session.kept, cache.session.kept)
    assert torch.equal(d_logits, logits) and torch.equal(d_mask, mask) and torch.equal(d_last, last_pos)
    assert _layers_equal(d_cache, cache)
    assert d_cache.session.phase == "decode"
    ours = decode_loop(llama, d_cache, d_logits, d_mask, d_last, eos, 8).generated
    assert ours == decode_loop(llama, cache, logits, mask, last_pos, eos, 8).generated


def test_derived_runs_share_the_snapshots_attention_statistics(llama, chat_tokenizer, monkeypatch):
    """Column sums and window probabilities are computed once per snapshot layer, not per run."""
    inputs = prefill_inputs([build_prompt(chat_tokenizer, CONTEXTS[0], QUESTIONS[0])], 0)
    snapshot = take_snapshot(llama, inputs)
    calls = {"n": 0}
    original = Observation._probs

    def counting(self, query, visible):
        calls["n"] += 1
        return original(self, query, visible)

    monkeypatch.setattr(Observation, "_probs", counting)
    first, *_ = derive(llama, snapshot, small("d2o"), budget=20)
    once = calls["n"]
    second, *_ = derive(llama, snapshot, small("d2o"), budget=30)
    assert once > 0 and calls["n"] == once  # the second budget reused every layer's column sums
    alone = CompressionSession(small("d2o"), llama.config.num_hidden_layers, budget=30)
    cache, *_ = kvbudget.engine.prefill(
        llama, [build_prompt(chat_tokenizer, CONTEXTS[0], QUESTIONS[0])], alone, 0
    )
    assert _layers_equal(second, cache)


@pytest.mark.parametrize("name", ["kvzip", "kvzip+", "kvgrad"])
def test_derived_runs_reconstruct_each_row_once(name, llama, chat_tokenizer, monkeypatch):
    """The KVzip family's reconstruction passes run once per snapshot row, not once per budget: a
    second budget's cache equals its own layer-wise run, and it still reports the passes' time."""
    prompts = [build_prompt(chat_tokenizer, c, q) for c, q in zip(CONTEXTS, QUESTIONS, strict=True)]
    snapshot = take_snapshot(llama, prefill_inputs(prompts, chat_tokenizer.pad_token_id),
                             attention_inputs=small(name).wants_attention_inputs)  # fmt: skip
    calls = {"n": 0}
    family = type(small(name))
    original = family.replay

    def counting(self, *args):
        calls["n"] += 1
        return original(self, *args)

    monkeypatch.setattr(family, "replay", counting)
    eos = eos_ids(llama, chat_tokenizer)
    first, *_ = derive(llama, snapshot, small(name), budget=20, eos=eos)
    once = calls["n"]
    second, logits, mask, last_pos = derive(llama, snapshot, small(name), budget=30, eos=eos)
    assert once >= 2 and calls["n"] == once  # both rows (two chunks each) scored by the first run only
    passes = sum(known[2] for known in snapshot.lookahead_memo.values())
    assert second.session.lookahead_seconds >= passes > 0
    assert second.session.compress_seconds >= second.session.lookahead_seconds
    alone = kvbudget.generate(llama, chat_tokenizer, CONTEXTS, QUESTIONS, method=small(name), budget=30,
                              max_new_tokens=6, return_cache=True)  # fmt: skip
    assert calls["n"] > once  # the layer-wise run scored on its own
    assert torch.equal(second.session.kept, torch.stack([r.budgets for r in alone]))
    assert not torch.equal(first.session.kept, second.session.kept)
    decoded = decode_loop(llama, second, logits, mask, last_pos, eos, 6)
    assert decoded.generated == [r.token_ids for r in alone]
    assert _layers_equal(second, alone[0].cache)


@pytest.mark.parametrize("agnostic", [False, True])
@pytest.mark.parametrize("name", [m for m in ALL_METHODS if m not in PRUNE_METHODS])
def test_derived_cache_equals_layer_wise_compression(name, agnostic, llama, chat_tokenizer):
    budget = 40
    layer_wise = kvbudget.generate(
        llama, chat_tokenizer, CONTEXTS, QUESTIONS, method=small(name), budget=budget, max_new_tokens=10,
        compress_context_only=agnostic, return_cache=True,
    )  # fmt: skip
    prompts = [build_prompt(chat_tokenizer, c, q) for c, q in zip(CONTEXTS, QUESTIONS, strict=True)]
    inputs = prefill_inputs(prompts, chat_tokenizer.pad_token_id, compress_context_only=agnostic)
    snapshot = take_snapshot(llama, inputs, attention_inputs=small(name).wants_attention_inputs)  # KVzap's
    eos = eos_ids(llama, chat_tokenizer)  # what generate uses (ends a post-prefill method's lookahead)
    cache, logits, *_ = derive(llama, snapshot, small(name), budget=budget, eos=eos)
    if agnostic:
        prefix = inputs.compressed_until
        assert cache.get_seq_length() == inputs.ids.shape[1] > prefix
    assert torch.equal(cache.session.kept, torch.stack([r.budgets for r in layer_wise]))
    decoded = decode_loop(llama, cache, logits, inputs.mask, inputs.positions[:, -1], eos, 10)
    assert decoded.generated == [r.token_ids for r in layer_wise]
    assert _layers_equal(cache, layer_wise[0].cache)


def test_one_snapshot_serves_many_methods_unchanged(llama, chat_tokenizer):
    prompts = [build_prompt(chat_tokenizer, CONTEXTS[0], QUESTIONS[0])]
    inputs = prefill_inputs(prompts, chat_tokenizer.pad_token_id)
    snapshot = take_snapshot(llama, inputs)
    before = [t.clone() for t in (snapshot.cache.layers[0].keys, snapshot.cache.layers[0].positions)]
    first, *_ = derive(llama, snapshot, small("ada-snapkv"), budget=30)
    for name in ("h2o", "snapkv", "streamingllm"):
        derive(llama, snapshot, small(name), budget=20)
    again, *_ = derive(llama, snapshot, small("ada-snapkv"), budget=30)
    assert _layers_equal(first, again)
    assert torch.equal(before[0], snapshot.cache.layers[0].keys)
    assert torch.equal(before[1], snapshot.cache.layers[0].positions)
    assert int(snapshot.cache.stats().entries[0, 0]) == len(prompts[0].ids)
