"""KVzip+ (KVzap, arXiv:2601.07891) against its formula, written out here with loops.

``S[h, i] = max_{g, t} a_{g,t}[i] · ‖W_O^{(h, g)} v_i‖ / ‖x_t‖``: ``a`` is the softmax of a
reconstruction query over the lead entries, the chunk and the pass's own tokens (causal), ``x_t``
the attention module's input at the pass's token ``t``, ``W_O^{(h, g)}`` the output projection's
columns of query head ``g`` of KV head ``h``'s group. kvpress's ``KVzipPress`` with its KVzip+
option is the end-to-end oracle (``tests/test_kvpress_oracle.py``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import kvbudget
from conftest import seeded, tiny_model
from kvbudget.errors import KVBudgetError
from kvbudget.methods.kvzip import ReconstructionScores
from kvbudget.methods.kvzip_plus import KVzipPlus, NormalizedReconstructionScores
from kvbudget.methods.registry import make_method

HEADS, GROUP, D, HIDDEN = 2, 2, 4, 8
N, Q, LEAD, START, END = 10, 5, 2, 3, 8
SCALE = 0.5


def _inputs(seed: int = 0):
    gen = seeded(seed)
    keys = torch.randn(1, HEADS, N + Q, D, generator=gen)
    values = torch.randn(1, HEADS, N + Q, D, generator=gen)
    query = torch.randn(1, HEADS * GROUP, Q, D, generator=gen)
    hidden = torch.randn(1, Q, HIDDEN, generator=gen) * torch.linspace(0.5, 3.0, Q)[None, :, None]
    o_proj = nn.Linear(HEADS * GROUP * D, HIDDEN, bias=False)
    with torch.no_grad():
        o_proj.weight.copy_(torch.randn(HIDDEN, HEADS * GROUP * D, generator=gen))
    module = nn.Module()
    module.o_proj, module.layer_idx = o_proj, 0
    positions = torch.arange(N + Q)[None, None].expand(1, HEADS, -1)
    layer = SimpleNamespace(keys=keys, values=values, positions=positions, sliding_window=None, softcap=None)
    return keys, values, query, hidden, module, layer


def _expected(keys, values, query, hidden, w_o, normalised: bool) -> torch.Tensor:
    """The formula, one (head, entry, query head, pass token) at a time."""
    out = torch.zeros(HEADS, END - START)
    lead = list(range(LEAD))
    chunk = list(range(START, END))
    for h in range(HEADS):
        for g in range(GROUP):
            qh = h * GROUP + g
            for t in range(Q):
                seen = lead + chunk + [N + u for u in range(t + 1)]  # the pass's own tokens, causal
                logits = torch.tensor([float(query[0, qh, t] @ keys[0, h, j]) * SCALE for j in seen])
                probs = torch.softmax(logits, 0)
                for c, i in enumerate(chunk):
                    weight = float(probs[len(lead) + c])
                    if normalised:
                        written = w_o[:, qh * D : (qh + 1) * D] @ values[0, h, i]
                        weight *= float(written.norm()) / float(hidden[0, t].norm())
                    out[h, c] = max(float(out[h, c]), weight)
    return out


def _scores(session_cls, keys, values, query, hidden, module, layer) -> torch.Tensor:
    context = [SimpleNamespace(keys=keys[:, :, :N])]
    scores = [torch.zeros(HEADS, N)]
    session = session_cls(make_method("kvzip+"), 1, context, scores)
    session.span = (LEAD, START, END)
    if session.wants_attention_inputs:
        session.before_attention(module, hidden)
    session.after_attention(0, query, layer, SCALE)
    return scores[0][:, START:END]


def test_kvzip_plus_scores_follow_the_formula() -> None:
    keys, values, query, hidden, module, layer = _inputs()
    got = _scores(NormalizedReconstructionScores, keys, values, query, hidden, module, layer)
    expected = _expected(keys, values, query, hidden, module.o_proj.weight.detach(), normalised=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_kvzip_plus_differs_from_kvzip_and_from_plain_value_norms() -> None:
    """The plausible wrong variants rank the entries otherwise: no normalisation (KVzip), ‖v‖ in
    place of ‖W_O v‖, and ‖x‖ left out."""
    keys, values, query, hidden, module, layer = _inputs()
    got = _scores(NormalizedReconstructionScores, keys, values, query, hidden, module, layer)
    plain = _scores(ReconstructionScores, keys, values, query, hidden, module, layer)
    torch.testing.assert_close(plain, _expected(keys, values, query, hidden, None, normalised=False))
    assert not torch.equal(got.argsort(-1), plain.argsort(-1))
    by_v = plain * values[0, :, START:END].norm(dim=-1)  # a crude variant: ‖v‖, no W_O, no ‖x‖
    assert not torch.equal(got.argsort(-1), by_v.argsort(-1))
    w_o = module.o_proj.weight.detach()
    no_x = _expected(keys, values, query, torch.ones(1, Q, HIDDEN) / math.sqrt(HIDDEN), w_o, normalised=True)
    assert not torch.allclose(got, no_x)


def test_kvzip_plus_compresses_a_model_and_keeps_the_budget() -> None:
    model = tiny_model("llama")
    ids = torch.randint(5, 90, (1, 150), generator=seeded(3))
    plus = kvbudget.compress(model, ids, method=make_method("kvzip+", chunk=48), budget=30)
    zip_ = kvbudget.compress(model, ids, method=make_method("kvzip", chunk=48), budget=30)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    kept = [layer.head(h)[2][0].tolist() for layer in plus.layers for h in range(heads)]
    assert sum(len(k) for k in kept) == layers * heads * 30  # one top-k over every layer and head
    assert kept != [layer.head(h)[2][0].tolist() for layer in zip_.layers for h in range(heads)]


def test_kvzip_plus_needs_an_output_projection() -> None:
    keys, values, query, hidden, module, layer = _inputs()
    del module.o_proj
    session = NormalizedReconstructionScores(
        KVzipPlus(), 1, [SimpleNamespace(keys=keys)], [torch.zeros(2, N)]
    )
    with pytest.raises(KVBudgetError, match="needs the attention's output projection"):
        session.before_attention(module, hidden)
