"""Observation statistics against float64 references computed here with explicit loops.

Covers the fast paths of :meth:`Observation.column_sums` / ``_probs`` — one decode query over
valid keys, query blocks whose keys are all valid (only the causal triangle masked), grouped GQA
matmuls — and the general masked path (pads in a batch, compressed layers with gaps).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import seeded
from kvbudget.cache import BudgetLayer
from kvbudget.observation import QUERY_BLOCK, Observation

D = 8
SCALE = 1.0 / math.sqrt(D)  # not a power of two: the scaling is not exact in fp32


def make_observation(
    batch: int, kv_heads: int, group: int, n: int, q: int, pads: list[int], seed: int, drop: int = 0
) -> Observation:
    """A layer of ``n`` entries (row ``r`` left-padded by ``pads[r]``) observed by its last ``q`` queries.

    ``drop``: entries removed before the queries' tokens were appended (a compressed layer whose
    slots are not consecutive positions); the queries' own tokens are the last ``q`` entries.
    """
    g = seeded(seed)
    keys = torch.randn((batch, kv_heads, n + drop, D), generator=g) * 2
    values = torch.randn((batch, kv_heads, n + drop, D), generator=g)
    query = torch.randn((batch, kv_heads * group, q, D), generator=g) * 2
    layer = BudgetLayer()
    layer.update(keys[:, :, : n + drop - q], values[:, :, : n + drop - q])
    if drop:
        rest = n + drop - q
        kept = torch.randperm(rest, generator=g)[: rest - drop].sort().values
        layer.keep([[kept.clone() for _ in range(kv_heads)] for _ in range(batch)])
    layer.update(keys[:, :, n + drop - q :], values[:, :, n + drop - q :])
    if any(pads):
        valid = torch.ones((batch, n), dtype=torch.bool)
        for r, pad in enumerate(pads):
            valid[r, :pad] = False
        layer.positions = layer.positions.masked_fill(~valid[:, None, :], -1)
        layer.has_invalid = True
    return Observation(0, 1, query, layer, SCALE)


def reference_probs(obs: Observation, query: np.ndarray) -> np.ndarray:
    """``[b, hq, m, n]`` float64: query ``i`` of ``m`` is the token of entry ``n - m + i``; it sees the
    valid entries up to its own (an invalid query sees only itself)."""
    keys = obs.keys.double().numpy()
    valid = (obs.positions >= 0).numpy()
    b, hq, m, _ = query.shape
    n = keys.shape[2]
    group = hq // keys.shape[1]
    out = np.zeros((b, hq, m, n))
    for r in range(b):
        for h in range(hq):
            kv = h // group
            for i in range(m):
                own = n - m + i
                seen = [j for j in range(own + 1) if valid[r, kv, j]] if valid[r, kv, own] else [own]
                logits = [float(np.dot(query[r, h, i], keys[r, kv, j])) * SCALE for j in seen]
                top = max(logits)
                exps = [math.exp(x - top) for x in logits]
                for j, e in zip(seen, exps, strict=True):
                    out[r, h, i, j] = e / sum(exps)
    return out


def reference_column_sums(obs: Observation) -> np.ndarray:
    """``[b, hq, n]``: attention each entry received from the valid queries."""
    probs = reference_probs(obs, obs.query.double().numpy())
    n, q = obs.keys.shape[2], obs.query.shape[2]
    query_valid = (obs.positions[:, 0, n - q :] >= 0).numpy()  # [b, q]
    return (probs * query_valid[:, None, :, None]).sum(2)


CASES = {
    # name: (batch, kv_heads, group, n, q, pads, drop)
    "prefill, several query blocks": (1, 2, 3, 2 * QUERY_BLOCK + 21, 2 * QUERY_BLOCK + 21, [0], 0),
    "prefill, no GQA": (1, 3, 1, QUERY_BLOCK + 5, QUERY_BLOCK + 5, [0], 0),
    "padded batch": (2, 2, 2, QUERY_BLOCK + 9, QUERY_BLOCK + 9, [0, 23], 0),
    "question after the context": (1, 2, 2, 90, 11, [0], 0),
    "decode step": (1, 2, 3, 40, 1, [0], 0),
    "decode step, compressed layer": (1, 2, 3, 40, 1, [0], 17),
    "decode step, padded batch": (2, 2, 3, 40, 1, [0, 6], 0),
    "chunked decode, compressed layer": (1, 2, 2, 40, 4, [0], 9),
}


@pytest.mark.parametrize("chunk", [512, 16, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_column_sums_match_a_float64_reference(case: str, chunk: int) -> None:
    obs = make_observation(*CASES[case][:6], seed=len(case), drop=CASES[case][6])
    got = obs.column_sums(chunk)
    assert got.shape == (obs.query.shape[0], obs.query.shape[1], obs.keys.shape[2])
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.double().numpy(), reference_column_sums(obs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_window_probs_match_a_float64_reference(case: str) -> None:
    obs = make_observation(*CASES[case][:6], seed=len(case) + 1, drop=CASES[case][6])
    window = min(7, obs.query.shape[2])
    got = obs.window_probs(window)
    want = reference_probs(obs, obs.query[:, :, -window:].double().numpy())
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-6)


def test_decode_step_fast_path_equals_the_masked_path() -> None:
    """One query over valid keys skips every mask; the same query through the masked path (one
    invalid key added far away, whose probability is then 0) gives the same row to 1e-6."""
    obs = make_observation(1, 2, 3, 30, 1, [0], seed=5, drop=4)
    fast = obs.column_sums()
    layer = obs.layer
    extra = BudgetLayer()
    extra.update(torch.zeros((1, 2, 1, D)), torch.zeros((1, 2, 1, D)))
    extra.update(layer.keys, layer.values)
    extra.positions = torch.cat([torch.full((1, 2, 1), -1), layer.positions], dim=-1)
    extra.has_invalid = True
    masked = Observation(0, 1, obs.query, extra, SCALE).column_sums()
    assert float(masked[..., 0].abs().max()) == 0.0
    torch.testing.assert_close(masked[..., 1:], fast, rtol=0, atol=1e-6)
    torch.testing.assert_close(fast.sum(-1), torch.ones(1, 6))
