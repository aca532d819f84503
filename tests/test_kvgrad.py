"""KVgrad (kvpress 0.5.5's ``KVgradPress``) against its formula, written out here with loops.

``S[l, h, i] = max_{g, t} a_{g,t}[i] · ‖W_O^{(h, g)} v_i‖ · ‖∂Φ/∂o_t^l‖`` with ``Φ = Σ_t ‖h_t^L‖²``
over the reconstruction pass's tokens. The end-to-end reference runs transformers' own model (eager
attention, no kvbudget) over the context followed by each pass's input: ``a`` is its attention
(``output_attentions``) renormalised over the keys KVzip's score keeps, ``o^l`` the output of each
layer's attention module and ``h^L`` the last decoder layer's output, caught by this file's own
hooks, the gradient from ``torch.autograd.grad``; the product and the maxima are loops, and the kept
set a sort of every ``(score, layer, head, slot)``. kvpress's press is the oracle end to end
(``tests/test_kvpress_oracle.py``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import kvbudget
from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.errors import KVBudgetError, MethodOptionError
from kvbudget.methods.kvgrad import GradientReconstructionScores, KVgrad
from kvbudget.methods.registry import make_method

REPEAT = "\n\nRepeat the previous context exactly."
CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with "


# ------------------------------------------------------------------------ the session's score
HEADS, GROUP, D, HIDDEN = 2, 2, 4, 8
N, Q, LEAD, START, END = 10, 5, 2, 3, 8
SCALE = 0.5


def _inputs(seed: int = 0):
    gen = seeded(seed)
    keys = torch.randn(1, HEADS, N + Q, D, generator=gen)
    values = torch.randn(1, HEADS, N + Q, D, generator=gen)
    query = torch.randn(1, HEADS * GROUP, Q, D, generator=gen)
    w_o = torch.randn(HIDDEN, HEADS * GROUP * D, generator=gen)
    grads = torch.rand(Q, generator=gen) * 4 + 0.1
    positions = torch.arange(N + Q)[None, None].expand(1, HEADS, -1)
    layer = SimpleNamespace(keys=keys, values=values, positions=positions, sliding_window=None, softcap=None)
    layer.shallow_copy = lambda: SimpleNamespace(**vars(layer))
    return keys, values, query, w_o, grads, layer


def _expected(keys, values, query, w_o, grads, value_norm: str) -> torch.Tensor:
    """The formula, one (head, entry, query head, pass token) at a time; ``value_norm``: ``"wo"``
    (the formula), ``"v"`` (‖v‖, a wrong variant) or ``"none"``."""
    out = torch.zeros(HEADS, END - START, dtype=torch.float64)
    lead, chunk = list(range(LEAD)), list(range(START, END))
    for h in range(HEADS):
        for g in range(GROUP):
            qh = h * GROUP + g
            for t in range(Q):
                seen = lead + chunk + [N + u for u in range(t + 1)]  # the pass's own tokens, causal
                logits = torch.tensor([float(query[0, qh, t] @ keys[0, h, j]) * SCALE for j in seen])
                probs = torch.softmax(logits.double(), 0)
                for c, i in enumerate(chunk):
                    weight = float(probs[len(lead) + c]) * (float(grads[t]) if grads is not None else 1.0)
                    if value_norm == "wo":
                        weight *= float((w_o[:, qh * D : (qh + 1) * D] @ values[0, h, i]).norm())
                    elif value_norm == "v":
                        weight *= float(values[0, h, i].norm())
                    out[h, c] = max(float(out[h, c]), weight)
    return out


def _session_scores(keys, values, query, w_o, grads, layer) -> torch.Tensor:
    context = [SimpleNamespace(keys=keys[:, :, :N], shallow_copy=lambda: None)]
    scores = [torch.zeros(HEADS, N)]
    session = GradientReconstructionScores(make_method("kvgrad"), 1, context, scores)
    session.span = (LEAD, START, END)
    session.after_attention(0, query, layer, SCALE, [layer])
    assert scores[0].abs().sum() == 0  # nothing is scored before the backward pass
    session.score_held({0: grads}, {0: w_o})
    assert not session.held
    return scores[0][:, START:END]


def test_kvgrad_scores_follow_the_formula() -> None:
    keys, values, query, w_o, grads, layer = _inputs()
    got = _session_scores(keys, values, query, w_o, grads, layer)
    expected = _expected(keys, values, query, w_o, grads, "wo")
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # the plausible wrong variants rank the entries otherwise on this fixture
    variants = [(None, "wo"), (grads, "v"), (grads, "none")]
    for variant_grads, value_norm in variants:
        variant = _expected(keys, values, query, w_o, variant_grads, value_norm)
        assert not torch.equal(got.argsort(-1), variant.argsort(-1))


# ------------------------------------------------------------------------ end to end, on a model
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny Llama saved twice over: with a chat-template tokenizer and without one (KVgrad, as
    KVzip, tokenises its requests with the tokenizer stored next to the weights)."""
    out = {}
    for template in (True, False):
        path = tmp_path_factory.mktemp("kvgrad") / "model"
        tiny_model("llama", seed=5).save_pretrained(path)
        tiny_tokenizer(chat_template=template).save_pretrained(path)
        out[template] = {
            "tok": tiny_tokenizer(chat_template=template),
            "ours": AutoModelForCausalLM.from_pretrained(path).eval(),
            "reference": AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval(),
        }
    return out


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _pass(model, seq: list[int], n: int, objective_on_norm: bool) -> tuple[tuple, list[torch.Tensor], list]:
    """transformers' forward over ``seq`` (context of ``n`` tokens, then the pass): attention weights,
    per layer ``‖∂Φ/∂o_t‖`` of the pass's tokens ``[q]`` (float64), and per layer the values."""
    layers = model.model.layers
    outputs: dict[int, torch.Tensor] = {}
    last: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_hook(lambda _m, _a, out, i=i: outputs.__setitem__(i, out[0]))
             for i, layer in enumerate(layers)]  # fmt: skip
    watched = model.model.norm if objective_on_norm else layers[-1]
    hooks.append(watched.register_forward_hook(lambda _m, _a, out: last.append(out)))
    try:
        with torch.enable_grad():
            out = model(torch.tensor([seq]), output_attentions=True, use_cache=True)
            h = last[-1][0, n:].double()
            objective = sum((h[t] ** 2).sum() for t in range(h.shape[0]))
            grads = torch.autograd.grad(objective, [outputs[i] for i in range(len(layers))])
    finally:
        for hook in hooks:
            hook.remove()
    norms = [torch.tensor([float(g[0, n + t].double().norm()) for t in range(len(seq) - n)]) for g in grads]
    values = [layer.values[0].detach().double() for layer in out.past_key_values.layers]
    return out.attentions, norms, values


def kvgrad_reference_scores(
    model, tok, ids: list[int], prefix: int, chunk: int, suffix_text: str, variant: str = "formula"
) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, n]``; ``variant``: ``"formula"``, ``"no-grad"`` (the gradient factor
    left out), ``"v"`` (‖v‖ for ‖W_O v‖) or ``"normed"`` (``Φ`` on the final norm's output)."""
    n, cfg = len(ids), model.config
    hq, hk, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    group, d = hq // hk, cfg.hidden_size // hq
    scores = [torch.zeros(hk, n, dtype=torch.float64) for _ in range(layers)]
    suffix = _encode(tok, suffix_text)
    for start in range(prefix, n, chunk):
        end = min(start + chunk, n)
        request = (
            _encode(tok, REPEAT)
            if start == prefix
            else _encode(tok, CONTINUE) + ids[max(prefix, start - 8) : start]
        )
        feed = request + suffix + ids[start:end]
        q = len(feed)
        attentions, grad_norms, values = _pass(model, ids + feed, n, variant == "normed")
        lead = min(max(prefix, 4), start)
        columns = list(range(lead)) + list(range(start, end)) + list(range(n, n + q))
        for la in range(layers):
            probs = attentions[la][0, :, n:, :].double()[:, :, columns]  # [hq, q, |columns|]
            probs = (probs / probs.sum(-1, keepdim=True)).tolist()  # the softmax restricted to those keys
            w_o = model.model.layers[la].self_attn.o_proj.weight.detach().double()
            grads = grad_norms[la].tolist()
            for h in range(hk):
                for c, i in enumerate(range(start, end)):
                    v = values[la][h, i]
                    best = 0.0
                    for g in range(group):
                        qh = h * group + g
                        if variant == "v":
                            written = float(v.norm())
                        else:
                            written = float((w_o[:, qh * d : (qh + 1) * d] @ v).norm())
                        for t in range(q):
                            grad = 1.0 if variant == "no-grad" else grads[t]
                            best = max(best, probs[qh][t][lead + c] * written * grad)
                    scores[la][h, i] = best
    return scores


def reference_keep(scores: list[torch.Tensor], always: int, budget: int) -> list[list[set]]:
    """Kept slots per layer and head: the first ``always`` entries, then one sort of every
    ``(score, layer, head, slot)`` over the model (``budget`` entries per head on average)."""
    layers, heads, n = len(scores), scores[0].shape[0], scores[0].shape[1]
    keep = [[set(range(always)) for _ in range(heads)] for _ in range(layers)]
    triples = [(float(scores[la][h, i]), la, h, i) for la in range(layers) for h in range(heads)
               for i in range(always, n)]  # fmt: skip
    triples.sort(key=lambda t: -t[0])
    room = layers * heads * (budget - always)
    gap = triples[room - 1][0] - triples[room][0]
    assert gap > 1e-4 * triples[room][0], "the fixture has a near tie at the cut"
    for _, la, h, i in triples[:room]:
        keep[la][h].add(i)
    return keep


def _kept(cache) -> list[list[set]]:
    return [[set(layer.head(h)[2][0].tolist()) for h in range(layer.num_heads)] for layer in cache.layers]


CASES = [
    # template, chunk, budget: "<user>" kept whole and several passes; no template, one pass
    (True, 45, 30),
    (False, 512, 24),
]


@pytest.mark.parametrize(("template", "chunk", "budget"), CASES)
def test_kvgrad_keeps_the_attributions_top(saved: dict, template: bool, chunk: int, budget: int) -> None:
    models, tok = saved[template], saved[template]["tok"]
    text = "Alice keeps 7 red keys in a box; Bob counts 12 blue stones by the river, then sleeps."
    ids = _encode(tok, ("<user>" if template else "") + text)
    prefix = len(_encode(tok, "<user>")) if template else 0
    suffix = "</user><assistant>" if template else "\n"
    method = make_method("kvgrad", chunk=chunk)
    cache = kvbudget.compress(models["ours"], torch.tensor([ids]), method=method, budget=budget)
    scores = kvgrad_reference_scores(models["reference"], tok, ids, prefix, chunk, suffix)
    expected = reference_keep(scores, max(prefix, 4), budget)
    assert _kept(cache) == expected
    layers, heads = len(scores), scores[0].shape[0]
    assert int(cache.stats().entries.sum()) == layers * heads * budget
    for variant in ("no-grad", "v", "normed"):  # plausible wrong variants keep other entries
        wrong = kvgrad_reference_scores(models["reference"], tok, ids, prefix, chunk, suffix, variant)
        assert reference_keep(wrong, max(prefix, 4), budget) != expected, variant


def test_kvgrad_leaves_no_gradient_and_ignores_frozen_weights(tmp_path: Path) -> None:
    """The backward pass writes no ``.grad`` and changes no ``requires_grad`` flag; frozen weights,
    an outer ``no_grad`` or ``inference_mode`` keep the same entries."""
    tiny_model("llama", seed=2).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 96, (1, 100), generator=seeded(4))
    method = make_method("kvgrad", chunk=40)
    kept = _kept(kvbudget.compress(model, ids, method=method, budget=20))
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    with torch.no_grad():
        assert _kept(kvbudget.compress(model, ids, method=method, budget=20)) == kept
    model.requires_grad_(False)
    with torch.inference_mode():
        assert _kept(kvbudget.compress(model, ids, method=method, budget=20)) == kept
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    zip_plus = _kept(kvbudget.compress(model, ids, method=make_method("kvzip+", chunk=40), budget=20))
    assert zip_plus != kept


def test_kvgrad_options_and_model_checks() -> None:
    assert KVgrad().chunk == 512 and KVgrad().sinks == 4 and KVgrad().level == "pair"
    with pytest.raises(MethodOptionError, match="kvgrad: chunk must be an integer ≥ 1"):
        make_method("kvgrad", chunk=0)
    model = tiny_model("llama")
    for layer in model.model.layers:
        del layer.self_attn.o_proj
        layer.self_attn.o_proj = nn.Identity()
    ids = torch.randint(3, 90, (1, 60), generator=seeded(1))
    with pytest.raises(KVBudgetError, match="kvgrad needs each attention's output projection"):
        kvbudget.compress(model, ids, method=make_method("kvgrad", chunk=40), budget=20)
