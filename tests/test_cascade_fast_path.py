"""The rank fast path of layer-wise methods keeps exactly what the generic path keeps.

``LayerwiseMethod.selection_order`` lets LAVa (flattened top-k, no floor) and CAKE (per-head top-k)
store each entry's rank once and re-evict by a threshold on it. The generic path — the head split
(``split``) and ``select_keep`` over the stored scores, re-run at every cascade step — is the
independent computation here: every layer's kept positions must be equal after every step (and,
with the fast path's lazy re-eviction, after the last one).
LAVa's ``V̄_h`` shortcut (``scoring.max_l1_value_norm``) is checked against the direct computation.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY, seeded
from kvbudget.cache_storage import take
from kvbudget.engine import Prompt, prefill
from kvbudget.methods.layerwise import NEVER, candidate_ranks
from kvbudget.methods.registry import make_method
from kvbudget.scoring import max_l1_value_norm
from kvbudget.selection import protected_mask, select_keep
from kvbudget.session import CompressionSession

LAYERS = 8


def kept_by_generic_path(method, scores, candidates, protected, total):
    """What the generic path keeps of one row: ``split`` counts, then ``select_keep``."""
    counts = method.split(scores, candidates, total, candidates.sum(-1))
    budgets = (counts + protected.sum(-1))[None]
    valid = (candidates | protected)[None]
    return [idx.tolist() for idx in select_keep(scores[None], budgets, valid, protected[None])[0]]


@pytest.mark.parametrize(("name", "order"), [("lava", "flat"), ("cake", "head")])
@pytest.mark.parametrize("seed", range(4))
def test_rank_threshold_equals_split_and_select_keep_with_many_ties(name, order, seed):
    g = seeded(seed)
    heads, n = 3, 40
    method = make_method(name, window=4)
    assert method.selection_order() == order
    scores = torch.randint(0, 4, (heads, n), generator=g).float()  # many exact ties
    positions = torch.arange(n).expand(1, heads, n).clone()
    positions[0, :, :3] = -1  # invalid leading slots (left padding)
    protected = protected_mask(positions, 4, 1)[0]
    candidates = (positions[0] >= 0) & ~protected
    ranks = candidate_ranks(scores, candidates, protected, order)
    assert (ranks[~(candidates | protected)] == NEVER).all() and (ranks[protected] == -1).all()
    per_head = int(candidates.sum(-1).max())
    for total in range(0, (heads if order == "flat" else 1) * per_head + 3):
        expected = kept_by_generic_path(method, scores, candidates, protected, total)
        got = [(ranks[h] < total).nonzero().flatten().tolist() for h in range(heads)]
        assert got == expected, total


def stored_positions(layer) -> list[list[list[int]]]:
    """Per head and row, the stored positions, pads (-1) included: the layout, not only the set."""
    return [layer.head(h)[2].tolist() for h in range(layer.num_heads)]


def run(method, model, prompts, budget, name: str, generic: bool, slack: float = 1.0):
    """Prefill a batch; every layer's kept positions (per row and head) after every cascade step.

    ``slack``: the fast path's lazy re-eviction factor (1.0: re-evict after every layer, as the
    generic path does). After each step, every held layer's candidates must be within ``slack``
    times its current budget.
    """
    # these three on this instance only (a frozen configuration): the generic path, the slack, a spy
    if generic:
        object.__setattr__(method, "selection_order", lambda: None)
    object.__setattr__(method, "reevict_slack", slack)
    steps: list[list] = []
    stored_dtypes: set[torch.dtype] = set()
    rebalance = method.rebalance

    def spy(layers, targets, run):
        for layer in layers[:-1]:
            stored = layer.state.get(method.state_name)
            if stored is not None:
                stored_dtypes.add((stored[0] if isinstance(stored, list) else stored).dtype)
        rebalance(layers, targets, run)
        steps.append([stored_positions(layer) for layer in layers])
        for i, layer in enumerate(layers if method.cascading else []):
            per_head = layer.head_lengths()
            for r, rp in enumerate(run.plan.rows):
                if rp is not None and i in rp.budgets:
                    candidates = per_head[r] - rp.protected
                    held = candidates.sum() if name == "lava" else candidates.max()  # the budget's unit
                    assert held <= slack * rp.budgets[i]

    object.__setattr__(method, "rebalance", spy)
    session = CompressionSession(method, LAYERS, budget=budget)
    cache, _, _, _ = prefill(model, prompts, session, pad_id=0)
    final = [stored_positions(layer) for layer in cache.layers]
    return steps, final, session.kept, stored_dtypes


@pytest.mark.parametrize(
    ("name", "options", "budget"),
    [
        ("lava", {"window": 4, "kernel": 3}, 10),
        ("lava", {"window": 4, "kernel": 3}, 30),
        ("lava", {"window": 4, "kernel": 3, "sinks": 2}, 20),
        ("cake", {"window": 4}, 16),
        ("lava-uniform", {"window": 4, "kernel": 3}, 20),
    ],
)
def test_fast_path_keeps_what_the_generic_path_keeps_at_every_step(name, options, budget):
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "num_hidden_layers": LAYERS}, initializer_range=0.2)
    model = LlamaForCausalLM(config).eval()
    g = seeded(1)
    lengths = [90, 61, 75]  # a batch of different lengths: left padding, per-head rows padded apart
    prompts = [Prompt(torch.randint(3, 90, (n,), generator=g).tolist(), []) for n in lengths]
    fast = run(make_method(name, **options), model, prompts, budget, name, generic=False)
    slow = run(make_method(name, **options), model, prompts, budget, name, generic=True)
    assert fast[0] == slow[0]  # every cascade step
    assert fast[1] == slow[1]  # final kept positions
    assert torch.equal(fast[2], slow[2])  # session budgets
    lazy = run(make_method(name, **options), model, prompts, budget, name, generic=False, slack=1.5)
    assert lazy[1] == slow[1] and torch.equal(lazy[2], slow[2])  # the same final cache
    if make_method(name).cascading:
        assert lazy[0] != slow[0]  # mid-prefill, some layer waited for its re-eviction
    if make_method(name).cascading:
        assert fast[3] == {torch.int32} and slow[3] == {torch.float32}  # each path really ran
        assert len(fast[0]) == LAYERS and fast[0][1][0] != fast[0][-1][0]  # layer 0 was re-evicted
    if name == "lava":  # discriminating: the flattened split gave the heads different counts
        per_head = [[sum(p >= 0 for p in head[r]) for head in layer] for layer in fast[1] for r in range(3)]
        assert any(len(set(counts)) > 1 for counts in per_head)


def test_a_floor_or_an_even_split_uses_the_generic_path():
    assert make_method("lava", floor_alpha=0.3).selection_order() is None
    assert make_method("lava-nohead").selection_order() is None
    assert make_method("lava").selection_order() == "flat"


@pytest.mark.parametrize("seed", [3, 4, 6])
def test_max_l1_value_norm_equals_the_direct_computation_bit_for_bit(seed):
    """LAVa's ``V̄_h``: the near-max shortcut gives exactly the masked ``norm(p=1)`` maximum."""
    g = seeded(seed)
    b, h, n, d = 2, 3, 64, 32
    values = torch.randn(b, h, n, d, generator=g)
    base = torch.randn(d, generator=g)
    for j in range(0, n, 5):  # permutations of one vector: norms equal up to summation order
        values[:, :, j] = base[torch.randperm(d, generator=g)]
    valid = torch.rand(b, h, n, generator=g) > 0.2
    # head (0, 0): only permutations of one vector, where abs().sum's largest is not norm's largest
    values[0, 0] = torch.stack([base[torch.randperm(d, generator=g)] for _ in range(n)])
    valid[0, 0] = True
    exact, approx = values[0, 0].norm(p=1, dim=-1), values[0, 0].abs().sum(-1)
    assert exact.max() > exact[approx == approx.max()].max(), "pick a seed"  # the shortcut needs its margin
    values[~valid] *= 100.0  # invalid slots hold the largest norms: they must not count
    valid[1, 2] = False  # a head without valid entries: 0
    obs = SimpleNamespace(values=values, valid=valid)
    expected = values.norm(p=1, dim=-1).masked_fill(~valid, 0.0).amax(-1)
    assert torch.equal(max_l1_value_norm(obs), expected)
    assert expected[1, 2] == 0 and (expected[0] > 0).all()
    valid[0, 1, 3] = True
    values[0, 1, 3, 0] = float("nan")  # non-finite: the direct computation (nan propagates)
    expected = values.norm(p=1, dim=-1).masked_fill(~valid, 0.0).amax(-1)
    assert torch.equal(max_l1_value_norm(obs).isnan(), expected.isnan()) and expected[0, 1].isnan()


def test_keep_copy_equals_gather_contiguous_or_not():
    """``BudgetLayer.keep``'s copy (``index_select``) gives exactly what an expanded ``gather`` gives."""
    g = seeded(0)
    storage = torch.randn(2, 3, 20, 4, generator=g)
    for t in (storage, storage[:, :, :10], storage[:1]):  # contiguous, a view with room, one row
        idx = torch.randint(0, 10, (*t.shape[:2], 6), generator=g)
        assert torch.equal(take(t, idx), t.gather(2, idx[..., None].expand(*idx.shape, 4)))
        assert torch.equal(take(t[:, 0], idx[:, 0]), t[:, 0].gather(1, idx[:, 0, :, None].expand(-1, -1, 4)))
