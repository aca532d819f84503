"""Reference tests for keydiff, lagkv, chunkkv and qfilter: the kept sets equal independent
computations written from the papers and the authors' code.

The references use float64 numpy copies of the raw tensors and explicit loops; they never call
kvbudget's scoring, allocation or selection helpers. Each case asserts a clear gap at the top-k cut
(``TOL``), so fp32 rounding cannot decide a membership, and the cases that could pass by accident
are checked to differ from a plausible wrong variant.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvbudget.cache import BudgetLayer
from kvbudget.methods.registry import make_method
from kvbudget.observation import Observation

H, G, N, D = 2, 2, 48, 8  # KV heads, GQA group, prompt length, head dim
HQ = H * G
LAYERS = 4
SCALE = 1.0 / math.sqrt(D)
TOL = 1e-5


class Fixture:
    """Post-RoPE tensors of one layer (batch 1) and their float64 numpy copies."""

    def __init__(self, seed: int = 0, n: int = N) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(1, H, n, D, generator=g)
        self.v = torch.randn(1, H, n, D, generator=g)
        self.q = 2.0 * torch.randn(1, HQ, n, D, generator=g)
        self.nk, self.nv, self.nq = (t[0].double().numpy() for t in (self.k, self.v, self.q))
        self.n = n

    def layer(self) -> BudgetLayer:
        layer = BudgetLayer()
        layer.update(self.k.clone(), self.v.clone())
        return layer

    def observation(self, layer: BudgetLayer, layer_idx: int = 0) -> Observation:
        return Observation(layer_idx, LAYERS, query=self.q, layer=layer, scaling=SCALE)

    def compress(self, method, budget: int, layer_idx: int = 0) -> BudgetLayer:
        layer = self.layer()
        method.compress(self.observation(layer, layer_idx), targets=[budget])
        return layer


def kept(layer: BudgetLayer) -> list[set[int]]:
    return [set(layer.head(h)[2][0].tolist()) for h in range(layer.num_heads)]


def top(scores: dict[int, float], k: int) -> set[int]:
    """The ``k`` best entries, asserting a gap of ``TOL`` at the cut."""
    ranked = sorted(scores, key=lambda e: -scores[e])
    if 0 < k < len(ranked):
        gap = scores[ranked[k - 1]] - scores[ranked[k]]
        assert gap > TOL, f"tie at the cut ({gap}): pick another seed"
    return set(ranked[:k])


# ------------------------------------------------------------------------------------------ keydiff
def keydiff_reference(keys: np.ndarray, entries: list[int]) -> dict[int, float]:
    """−cos(k_i, mean of the unit keys) over ``entries`` of one head (arXiv:2504.15364)."""
    anchor = np.zeros(keys.shape[1])
    for e in entries:
        anchor += keys[e] / math.sqrt(sum(x * x for x in keys[e]))
    anchor /= len(entries)
    norm_a = math.sqrt(sum(x * x for x in anchor))
    return {e: -float(keys[e] @ anchor) / (math.sqrt(float(keys[e] @ keys[e])) * norm_a) for e in entries}


@pytest.mark.parametrize(("window", "sinks", "seed"), [(0, 0, 0), (4, 2, 1)])
def test_keydiff_keeps_keys_least_similar_to_the_mean_key(window: int, sinks: int, seed: int) -> None:
    fx = Fixture(seed)
    budget = 14
    layer = fx.compress(make_method("keydiff", window=window, sinks=sinks), budget)
    forced = set(range(sinks)) | set(range(N - window, N))
    for h in range(H):
        scores = keydiff_reference(fx.nk[h], list(range(N)))
        free = {e: s for e, s in scores.items() if e not in forced}
        want = forced | top(free, budget - len(forced))
        assert kept(layer)[h] == want
        # teeth: the raw dot product with the mean key (no normalisation) keeps another set
        mean = fx.nk[h].mean(0)
        assert top({e: -float(fx.nk[h][e] @ mean) for e in free}, budget - len(forced)) != want - forced


def test_keydiff_decode_recomputes_the_anchor_over_the_held_entries() -> None:
    fx = Fixture(2)
    budget = 12
    method = make_method("keydiff")
    layer = fx.compress(method, budget)
    held = kept(layer)
    keys = fx.nk
    g = torch.Generator().manual_seed(9)
    for step in range(3):
        k1, v1 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        keys = np.concatenate([keys, k1[0].double().numpy()], axis=1)
        layer.update(k1, v1)
        obs = Observation(0, LAYERS, query=torch.randn(1, HQ, 1, D, generator=g), layer=layer, scaling=SCALE)
        method.decode_step(obs, row_budgets=[budget])
        for h in range(H):
            entries = sorted(held[h] | {N + step})
            held[h] = top(keydiff_reference(keys[h], entries), budget)
        assert kept(layer) == held
