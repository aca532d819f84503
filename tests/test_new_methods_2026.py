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

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvbudget
from conftest import tiny_model, tiny_tokenizer
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
    ids = torch.randint(3, 96, (90,), generator=torch.Generator().manual_seed(8)).tolist()
    cache = kvbudget.compress(ours, torch.tensor([ids]), method=make_method("kvzip", chunk=40), budget=30)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    scores = kvzip_reference_scores(reference, tok, ids, 0, 4, 40, "\n")
    assert _kept(cache) == reference_keep(scores, 4, 2 * 30, "pair")


def test_kvzip_refuses_bad_options() -> None:
    from kvbudget.errors import UnknownMethodError

    for options, words in [
        ({"level": "global"}, "level"),
        ({"chunk": 0}, "chunk"),
        ({"overlap": -1}, "overlap"),
    ]:
        with pytest.raises(UnknownMethodError, match=words):
            make_method("kvzip", **options)
