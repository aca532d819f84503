"""A method's configuration is frozen and its run state lives in the session (docs/architecture.md,
"Configuration and run state").

One method object must serve many sequences at once, as a server's does: runs interleaved step by
step — the prefill of one sequence between another's prefill and its decoding — give each
sequence what a method object of its own gives it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvbudget
from conftest import tiny_model
from kvbudget.prefill.common import forward_last_logits
from method_matrix import ALL_METHODS, small

STEPS = 4


def _prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(5, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def _kept(cache) -> list[list[list[int]]]:
    """Every layer's kept positions per head, sorted."""
    out = []
    for layer in cache.layers:
        heads = layer.positions if isinstance(layer.positions, list) else list(layer.positions.unbind(1))
        out.append([sorted(p.reshape(-1).tolist()) for p in heads])
    return out


class _Sequence:
    """One sequence's compressed cache and its greedy decoding, a step at a time."""

    def __init__(self, model, ids: torch.Tensor, method, budget: int) -> None:
        self.model = model
        self.cache = kvbudget.compress(model, ids[:, :-1], method=method, budget=budget)
        self.token, self.mask = ids[:, -1], torch.ones_like(ids[:, :-1])
        self.pos = torch.tensor([ids.shape[1] - 1])
        self.tokens: list[int] = []

    def step(self) -> None:
        self.mask = torch.cat([self.mask, torch.ones((1, 1), dtype=self.mask.dtype)], 1)
        logits = forward_last_logits(
            self.model, self.token[:, None], self.mask, self.pos[:, None], self.cache
        )
        self.token = logits.argmax(-1)
        self.tokens.append(int(self.token))
        self.pos = self.pos + 1


@pytest.mark.parametrize("name", ALL_METHODS)
def test_one_method_object_serves_two_interleaved_sequences(name: str) -> None:
    model = tiny_model("llama")
    first, second = _prompt(1, 90), _prompt(2, 70)
    budget = 40
    shared = small(name)
    a = _Sequence(model, first, shared, budget)
    b = _Sequence(model, second, shared, budget)  # prefilled between a's prefill and a's decoding
    for _ in range(STEPS):
        a.step()
        b.step()
    alone_a, alone_b = (
        _Sequence(model, first, small(name), budget),
        _Sequence(model, second, small(name), budget),
    )
    for _ in range(STEPS):
        alone_a.step()
    for _ in range(STEPS):
        alone_b.step()
    assert a.tokens == alone_a.tokens and b.tokens == alone_b.tokens
    assert _kept(a.cache) == _kept(alone_a.cache)
    assert _kept(b.cache) == _kept(alone_b.cache)
    assert shared == small(name)  # the configuration did not change


@pytest.mark.parametrize("name", ALL_METHODS)
def test_a_methods_configuration_refuses_assignment(name: str) -> None:
    method = small(name)
    field = dataclasses.fields(method)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(method, field, getattr(method, field))
