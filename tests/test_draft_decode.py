"""The harness's draft decoding equals plain greedy decoding plus separate teacher forcing."""

from __future__ import annotations

import pytest
import torch

from kvbudget.engine import build_prompt, decode_loop, prefill_inputs
from kvbudget.errors import KVBudgetError
from kvbudget.eval.draft import decode_with_draft
from kvbudget.eval.fidelity import teacher_forced_logprobs
from kvbudget.prefill.derived import derive, take_snapshot
from method_matrix import small

CONTEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
MAX_NEW = 12
NO_EOS: set[int] = set()


def _compressed(model, tokenizer, name: str, budget: int = 40):
    prompt = build_prompt(tokenizer, CONTEXT, "What does the fox do?")
    inputs = prefill_inputs([prompt], tokenizer.pad_token_id)
    snapshot = take_snapshot(model, inputs, attention_inputs=small(name).wants_attention_inputs)
    cache, logits, *_ = derive(model, snapshot, small(name), budget=budget)
    return cache, logits, inputs


def _greedy(model, tokenizer, name: str) -> list[int]:
    cache, logits, inputs = _compressed(model, tokenizer, name)
    last = inputs.positions[:, -1]
    return decode_loop(model, cache, logits, inputs.mask, last, NO_EOS, MAX_NEW).generated[0]


def _changed(tokens: list[int], at: int, vocab: int) -> list[int]:
    """``tokens`` with a different token at index ``at``."""
    return tokens[:at] + [(tokens[at] + 1) % vocab] + tokens[at + 1 :]


@pytest.mark.parametrize("name", ["snapkv", "ada-snapkv", "h2o", "streamingllm", "full"])
@pytest.mark.parametrize("diverge_at", [0, 3, None])
def test_draft_decoding_equals_greedy_and_teacher_forcing(name, diverge_at, llama, chat_tokenizer):
    step_by_step = name in ("h2o", "streamingllm")
    greedy = _greedy(llama, chat_tokenizer, name)
    # a draft agreeing with the method's greedy answer up to `diverge_at`
    draft = greedy if diverge_at is None else _changed(greedy, diverge_at, llama.config.vocab_size)
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


@pytest.mark.parametrize("name", ["snapkv", "ada-snapkv", "full"])
def test_candidates_continue_the_answer_after_the_draft_diverges(name, llama, chat_tokenizer):
    vocab = llama.config.vocab_size
    greedy = _greedy(llama, chat_tokenizer, name)
    draft = _changed(greedy, 2, vocab)
    candidates = [
        _changed(greedy, 0, vocab),  # does not extend the answer: skipped
        _changed(greedy, 7, vocab),  # verified up to index 7, where the method picks its own token
        greedy[:9],  # then this one carries the answer to index 9
    ]
    cache, logits, inputs = _compressed(llama, chat_tokenizer, name)
    out = decode_with_draft(
        llama, cache, logits, draft, inputs.mask, inputs.positions[:, -1], NO_EOS, MAX_NEW, False, candidates
    )
    assert out.token_ids == greedy
    assert out.accepted == 2
    assert out.steps == MAX_NEW - 9  # one-token steps only for the tokens after the last candidate
    cache, logits, inputs = _compressed(llama, chat_tokenizer, name)
    out = decode_with_draft(
        llama, cache, logits, draft, inputs.mask, inputs.positions[:, -1], NO_EOS, MAX_NEW, False, [greedy]
    )
    assert out.token_ids == greedy and out.steps == 0
