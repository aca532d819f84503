"""The harness's draft decoding equals plain greedy decoding plus separate teacher forcing."""

from __future__ import annotations

import pytest
import torch

from kvbudget.engine import build_prompt, decode_loop, prefill_inputs
from kvbudget.errors import KVBudgetError
from kvbudget.eval.draft import decode_with_draft
from kvbudget.eval.fidelity import teacher_forced_logprobs
from kvbudget.snapshot import derive, take_snapshot
from method_matrix import small

CONTEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
MAX_NEW = 12
NO_EOS: set[int] = set()


def _compressed(model, tokenizer, name: str, budget: int = 40):
    inputs = prefill_inputs([build_prompt(tokenizer, CONTEXT, "What does the fox do?")], tokenizer.pad_token_id)
    cache, logits = derive(model, take_snapshot(model, inputs), small(name), budget=budget)
    return cache, logits, inputs


def _greedy(model, tokenizer, name: str) -> list[int]:
    cache, logits, inputs = _compressed(model, tokenizer, name)
    return decode_loop(model, cache, logits, inputs.mask, inputs.positions[:, -1], NO_EOS, MAX_NEW).generated[0]


@pytest.mark.parametrize("name", ["snapkv", "ada-snapkv", "h2o", "streamingllm", "full"])
@pytest.mark.parametrize("diverge_at", [0, 3, None])
def test_draft_decoding_equals_greedy_and_teacher_forcing(name, diverge_at, llama, chat_tokenizer):
    step_by_step = name in ("h2o", "streamingllm")
    greedy = _greedy(llama, chat_tokenizer, name)
    draft = list(greedy)
    if diverge_at is not None:  # a draft agreeing with the method's greedy answer up to `diverge_at`
        draft[diverge_at] = (greedy[diverge_at] + 1) % llama.config.vocab_size
    cache, logits, inputs = _compressed(llama, chat_tokenizer, name)
    last = inputs.positions[:, -1]
    out = decode_with_draft(llama, cache, logits, draft, inputs.mask, last, NO_EOS, MAX_NEW, step_by_step)
    assert out.token_ids == greedy
    assert out.accepted == (len(draft) if diverge_at is None else diverge_at)
    assert out.steps == (0 if diverge_at is None else MAX_NEW - 1 - diverge_at)
    forced_cache, logits, _ = _compressed(llama, chat_tokenizer, name)
    forced = teacher_forced_logprobs(llama, forced_cache, logits, draft, inputs.mask, last, step_by_step)
    torch.testing.assert_close(out.logprobs, forced, atol=1e-4, rtol=0)


def test_drop_last_restores_the_cache_before_the_appended_tokens(llama, chat_tokenizer):
    cache, logits, inputs = _compressed(llama, chat_tokenizer, "ada-snapkv")  # per-head layout
    before = [(layer.seen, [t.clone() for t in layer.head(0)]) for layer in cache.layers]
    assert any(layer.is_ragged for layer in cache.layers)
    decode_loop(llama, cache, logits, inputs.mask, inputs.positions[:, -1], NO_EOS, 4)
    cache.drop_last(3)
    for layer, (seen, (k, v, p)) in zip(cache.layers, before, strict=True):
        assert layer.seen == seen
        for a, b in zip(layer.head(0), (k, v, p), strict=True):
            assert torch.equal(a, b)


def test_drop_last_refuses_entries_a_method_has_reselected(llama, chat_tokenizer):
    cache, logits, inputs = _compressed(llama, chat_tokenizer, "snapkv")
    with pytest.raises(KVBudgetError, match="trailing"):
        cache.drop_last(30)  # 30 of the 40 kept prompt entries are not the last 30 tokens seen
