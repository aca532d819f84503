"""A document compressed once and read by many conversations as a shared, read-only prefix
(:mod:`kvbudget.shared_prefix`): each conversation answers exactly as it would on its own copy of
the document's cache, the document is never written, and a conversation's bytes are its own."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_model, tiny_tokenizer
from kvbudget.engine import build_prompt
from kvbudget.errors import KVBudgetError
from kvbudget.quantized_store import QuantizedHead
from kvbudget.serve.batcher import Compression, Turn, decode_step, make_sequence, prefill_sequence
from kvbudget.shared_prefix import PlainHead, SharedHead, share

DOCUMENT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 6
QUESTIONS = ["What jumps over the dog?", "What goes in the box, and how many?"]
#: the document stored in the model's dtype, at 4 bits, and under a byte budget (two precisions)
DOCUMENTS = [
    Compression("snapkv:window=8", ratio=0.5),
    Compression("expected-attention", ratio=0.5, kv_bits=4),
    Compression("snapkv:window=8", memory=0.3),
    Compression("full"),
]


def _tensors(cache) -> list[torch.Tensor]:
    """Every tensor the cache's layers hold (keys and values as stored, positions, state)."""
    out = []
    for layer in cache.layers:
        if layer.quant is not None:
            for head in layer.quant:
                out += [v for v in vars(head).values() if isinstance(v, torch.Tensor)]
                for part in ("high", "low"):
                    if hasattr(head, part):
                        out += [v for v in vars(getattr(head, part)).values() if isinstance(v, torch.Tensor)]
        else:
            out += (
                [layer.keys, layer.values] if not layer.is_ragged else [*layer.head_keys, *layer.head_values]
            )
        out += [layer.positions] if isinstance(layer.positions, torch.Tensor) else list(layer.positions)
    return [t.clone() for t in out]


def _document(model, tokenizer, compression):
    ids = build_prompt(tokenizer, DOCUMENT).context_ids
    seq = make_sequence(ids, 1, set(), compression)
    prefill_sequence(model, seq, 0)
    return ids, seq


def _conversation(model, tokenizer, doc_ids, doc, question, cache, tokens=6):
    ids = build_prompt(tokenizer, DOCUMENT, question).ids
    assert ids[: len(doc_ids)] == doc_ids
    seq = make_sequence(ids, tokens, set(), doc.compression)
    prefill_sequence(model, seq, 0, Turn(tuple(doc_ids), cache, doc.last_pos))
    return seq


@pytest.mark.parametrize("compression", DOCUMENTS, ids=lambda c: c.label())
def test_conversations_on_a_shared_document_answer_as_on_their_own_copies(compression) -> None:
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    doc_ids, doc = _document(model, tokenizer, compression)
    before = _tensors(doc.cache)
    own = [
        _conversation(model, tokenizer, doc_ids, doc, q, copy.deepcopy(doc.cache, {id(model): model}))
        for q in QUESTIONS
    ]
    shared = [_conversation(model, tokenizer, doc_ids, doc, q, share(doc.cache)) for q in QUESTIONS]
    # decoded together, each row over its own cache (the server's step), the two kinds interleaved
    rows = [own[0], shared[0], own[1], shared[1]]
    while not all(s.finished for s in rows):
        decode_step(model, [s for s in rows if not s.finished])
    assert shared[0].generated == own[0].generated and shared[1].generated == own[1].generated
    after = _tensors(doc.cache)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    doc_lengths = [head for layer in doc.cache.layers for head in layer.head_lengths()[0].tolist()]
    for seq in shared:  # the conversation holds its own tokens only: the prompt's tail and the answer
        heads = [h for layer in seq.cache.layers if layer.quant for h in layer.quant]
        assert all(isinstance(h, SharedHead) and h.shared for h in heads)
        new = len(seq.prompt_ids) - len(doc_ids) + len(seq.generated) - 1
        assert [h.length for h in heads] == [n + new for n in doc_lengths]
        # its own: the new tokens, and a quantized document's unfilled last group (under 32 entries)
        assert all(new <= h.own.length < new + 32 for h in heads)
        assert seq.cache.physical_bytes() < doc.cache.physical_bytes()


def test_an_eviction_that_touches_the_prefix_copies_it_and_counts_it() -> None:
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 40, 16, generator=g), torch.randn(1, 40, 16, generator=g)
    prefix = QuantizedHead.from_full(keys, values, 4)
    head = SharedHead(prefix, PlainHead(keys[:, :0].clone(), values[:, :0].clone())).append(
        keys[:, :5], values[:, :5]
    )
    whole_k, whole_v = head.dequantize()
    assert whole_k.shape == (1, 45, 16) and head.nbytes == 5 * 16 * 2 * 4  # fp32: its own five entries
    keep_all_prefix = torch.cat([torch.arange(40), torch.tensor([41, 44])])[None]
    kept = head.take(keep_all_prefix)
    assert kept.shared and kept.prefix is prefix and kept.own.length == 2
    idx = torch.tensor([[0, 3, 39, 40, 42]])
    private = head.take(idx)
    assert not private.shared and private.length == 5
    k, v = private.dequantize()
    assert torch.equal(k, whole_k[:, idx[0]]) and torch.equal(v, whole_v[:, idx[0]])
    assert private.nbytes == private.prefix.nbytes + private.own.nbytes
    rewritten = head.replaced(whole_k, whole_v * 2)  # a merge that changed the prefix's values
    assert not rewritten.shared
    unchanged = head.replaced(whole_k, torch.cat([whole_v[:, :40], whole_v[:, 40:] * 2], 1))
    assert unchanged.shared and unchanged.prefix is prefix
    with pytest.raises(KVBudgetError, match="one row"):
        head.map_batch(lambda t: t)
