"""Continuous batching: sequences prefilled alone, then decoded together in one forward per step
(each row over its own ragged cache, with its own method and budget), make the tokens
``kvbudget.generate`` makes for each alone — while they join and leave at different steps."""

from __future__ import annotations

import pytest
import torch

import kvbudget
from conftest import tiny_model, tiny_tokenizer
from kvbudget.engine import build_prompt, eos_ids
from kvbudget.errors import InputError, KVBudgetError
from kvbudget.joined_cache import JoinedCache
from kvbudget.methods.spec import MethodSpec
from kvbudget.serve.batcher import (
    Compression,
    decode_step,
    make_sequence,
    prefill_peak_bytes,
    prefill_sequence,
    reserved_bytes,
)

TEXTS = [
    "the quick brown fox jumps over the lazy dog " * 3,
    "pack my box with five dozen liquor jugs; " * 4,
    "how vexingly quick daft zebras jump! " * 2,
    "sphinx of black quartz, judge my vow. " * 5,
    "five boxing wizards jump quickly at dawn " * 3,
]
#: prefill-only, full, decode-stage (evicts every step), per-head ragged methods and one scoring each
#: new token from its attention input (the batch's row, kvzap-decoding) side by side
REQUESTS = [
    (Compression("snapkv:window=8", budget=16), 12),
    (Compression("full"), 9),
    (Compression("h2o", budget=24), 14),
    (Compression("ada-snapkv:window=8", ratio=0.5), 11),
    (Compression("kvzap-decoding:kind=linear,threshold_window=4", budget=20), 10),
]


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama")
    tokenizer = tiny_tokenizer()
    kvbudget.attach(model)
    return model, tokenizer


def _alone(model, tokenizer, text: str, comp: Compression, max_tokens: int) -> list[int]:
    kwargs = {"budget": comp.budget, "ratio": comp.ratio} if comp.method != "full" else {}
    method = MethodSpec.parse(comp.method).build()
    result = kvbudget.generate(model, tokenizer, text, method=method, max_new_tokens=max_tokens, **kwargs)
    return result.token_ids


def test_sequences_joining_and_leaving_decode_as_each_alone(setup) -> None:
    model, tokenizer = setup
    eos = eos_ids(model, tokenizer)
    expected = [
        _alone(model, tokenizer, text, comp, n) for text, (comp, n) in zip(TEXTS, REQUESTS, strict=True)
    ]
    seqs = [
        make_sequence(build_prompt(tokenizer, text).ids, n, eos, comp)
        for text, (comp, n) in zip(TEXTS, REQUESTS, strict=True)
    ]
    active, waiting, batch_sizes = [], list(seqs), []
    while waiting or active:
        if waiting:  # one new sequence joins before each step, as the scheduler admits them
            seq = waiting.pop(0)
            prefill_sequence(model, seq, pad_id=0)
            if not seq.finished:
                active.append(seq)
        if active:
            batch_sizes.append(len(active))
            decode_step(model, active)
            active = [s for s in active if not s.finished]
    assert max(batch_sizes) == len(seqs)  # every sequence really shared a forward with the others
    for seq, want in zip(seqs, expected, strict=True):
        assert seq.generated == want, seq.compression.label()
    assert seqs[2].cache.layers[0].head_lengths().max() <= 24  # h2o kept its budget while decoding


def test_a_sequence_decoded_in_a_batch_keeps_its_own_cache(setup) -> None:
    model, tokenizer = setup
    eos = eos_ids(model, tokenizer)
    small = make_sequence(
        build_prompt(tokenizer, TEXTS[0]).ids, 6, eos, Compression("snapkv:window=8", budget=16)
    )
    big = make_sequence(build_prompt(tokenizer, TEXTS[3]).ids, 6, eos, Compression("full"))
    for seq in (small, big):
        prefill_sequence(model, seq, pad_id=0)
    before = [s.cache.layers[0].head_lengths()[0].tolist() for s in (small, big)]
    decode_step(model, [small, big])
    after = [s.cache.layers[0].head_lengths()[0].tolist() for s in (small, big)]
    assert after == [[n + 1 for n in heads] for heads in before]  # one entry each, no padding
    assert small.cache.layers[0].head_lengths().max() < big.cache.layers[0].head_lengths().min()


def test_a_follow_up_reuses_the_cache_and_prefills_only_its_new_tokens(setup) -> None:
    """Reusing a finished turn's cache for a prompt that extends it gives the tokens a cache built by
    prefilling the same extension with the session off gives (here: the full cache, where both equal
    prefilling the whole follow-up)."""
    model, tokenizer = setup
    eos = eos_ids(model, tokenizer)
    first = make_sequence(build_prompt(tokenizer, TEXTS[1]).ids, 5, set(), Compression("full"))
    prefill_sequence(model, first, pad_id=0)
    while not first.finished:
        decode_step(model, [first])
    follow_ids = first.cached_ids + [first.generated[-1]] + build_prompt(tokenizer, "and again?").ids
    follow = make_sequence(follow_ids, 6, eos, Compression("full"))
    turn = first.turn()
    assert turn.continues(follow_ids) and not turn.continues(follow_ids[:5])
    prefill_sequence(model, follow, pad_id=0, reuse=turn)
    while not follow.finished:
        decode_step(model, [follow])
    fresh = make_sequence(follow_ids, 6, eos, Compression("full"))
    prefill_sequence(model, fresh, pad_id=0)
    while not fresh.finished:
        decode_step(model, [fresh])
    assert follow.reused_tokens == len(first.cached_ids) > 0
    assert follow.generated == fresh.generated


def test_memory_bounds_hold_what_the_caches_really_hold(setup) -> None:
    model, tokenizer = setup
    eos = eos_ids(model, tokenizer)
    for comp in (
        Compression("snapkv:window=8", budget=16),
        Compression("full"),
        Compression("ada-snapkv:window=8", ratio=0.5),
        Compression("full", kv_bits=4),  # each layer quantized once done: one in fp32 at a time
        Compression("snapkv:window=8", budget=16, kv_bits=4),
        Compression("h2o", budget=24, kv_bits=2),
        Compression("snapkv:window=8", memory=0.3),
    ):
        seq = make_sequence(build_prompt(tokenizer, TEXTS[3]).ids, 10, set(), comp)
        peak = prefill_peak_bytes(model, seq)
        prefill_sequence(model, seq, pad_id=0)
        reserved = reserved_bytes(model, seq)
        assert seq.cache.peak_physical_bytes <= peak, comp.label()
        while not seq.finished:
            decode_step(model, [seq])
            assert seq.cache.physical_bytes() <= reserved, comp.label()
        assert eos  # the model has an EOS id (the scheduler stops on it)
    compressed = make_sequence(
        build_prompt(tokenizer, TEXTS[3]).ids, 10, eos, Compression("snapkv:window=8", budget=16)
    )
    full = make_sequence(build_prompt(tokenizer, TEXTS[3]).ids, 10, eos, Compression("full"))
    assert prefill_peak_bytes(model, compressed) < prefill_peak_bytes(model, full)
    four_bit = make_sequence(build_prompt(tokenizer, TEXTS[3]).ids, 10, eos, Compression("full", kv_bits=4))
    assert prefill_peak_bytes(model, four_bit) < prefill_peak_bytes(model, full)


def test_bad_sequences_and_rows_are_refused_with_one_line(setup) -> None:
    model, tokenizer = setup
    with pytest.raises(InputError, match="max_tokens"):
        make_sequence([5, 6], 0, {1}, Compression("full"))
    with pytest.raises(InputError, match="empty"):
        make_sequence([], 3, {1}, Compression("full"))
    batch = kvbudget.generate(model, tokenizer, [TEXTS[0], TEXTS[1]], method="knorm", budget=16,
                              max_new_tokens=1, return_cache=True)[0].cache  # fmt: skip
    with pytest.raises(KVBudgetError, match="one sequence"):
        JoinedCache(model.config.num_hidden_layers, [batch])
    with pytest.raises(KVBudgetError, match="BudgetCache"):
        JoinedCache(model.config.num_hidden_layers, [torch.zeros(1)])
