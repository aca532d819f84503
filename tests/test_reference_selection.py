"""Reference tests: what every registered method keeps equals an independent computation from its paper.

For each method of ``kvbudget.method_names()`` a small fixed input (2 KV heads, GQA groups of 2,
24 tokens, head dim 8) is compressed through ``method.compress_layer`` (and, for the decode-stage methods,
one or more ``decode_step`` calls), and the kept positions are compared with a reference computed
here from the raw q, k, v tensors. The references never call kvbudget's scoring, allocation or
selection helpers: they use float64 numpy copies and explicit Python loops over heads and tokens —
a hand-written softmax over each causal prefix, pooling by explicit sliding windows, AdaKV winners
counted by sorting all ``(score, head, token)`` triples, PyramidKV budgets by the formula and by
hand.

Ties: the papers do not say how equal scores are broken, and max pooling copies one value to its
neighbours, so a plateau can straddle a top-k cut. A reference selection is therefore a
:class:`Choice` — the entries scored clearly above the cut (all must be kept) plus the entries tied
with it within ``TOL`` (any of them may fill the rest); with no tie at the cut it is one exact set
(most cases here). Decode evictions and the AdaKV cut are either asserted unambiguous or, for
AdaKV, enumerated over every split of the tied winners. Each SnapKV case also checks that its
fixture rejects the plausible wrong variants (GQA max vs mean, no pooling, avg pooling divided by
the in-range count, pooling across the window columns), so a test cannot pass by accident.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pytest
import torch

from conftest import seeded
from kvbudget.cache import BudgetLayer
from kvbudget.methods.registry import make_method, method_names
from kvbudget.observation import Observation
from kvbudget.session import CompressionSession

H, G, N, D = 2, 2, 24, 8  # KV heads, GQA group size, prompt length, head dim
HQ = H * G  # query heads; query head qh reads KV head qh // G
LAYERS = 4
BUDGET = 10
W = 4  # observation window used for the window scorers
SCALE = 1.0 / math.sqrt(D)
TOL = 1e-4  # smallest score gap accepted at a top-k cut (fp32 library vs fp64 reference)
SEED = 0


# ---------------------------------------------------------------------------------------- fixture
@dataclass
class Fixture:
    """Post-RoPE tensors of one layer (batch 1) and their float64 numpy copies (batch dropped)."""

    k: torch.Tensor  # [1, H, N, D]
    v: torch.Tensor
    q: torch.Tensor  # [1, HQ, N, D]
    seed: int

    @classmethod
    def make(cls, seed: int = SEED) -> Fixture:
        g = seeded(seed)
        k = torch.randn(1, H, N, D, generator=g)
        v = torch.randn(1, H, N, D, generator=g)
        q = 2.0 * torch.randn(1, HQ, N, D, generator=g)  # sharper attention: well separated scores
        return cls(k, v, q, seed)

    @cached_property
    def nk(self) -> np.ndarray:
        return self.k[0].double().numpy()

    @cached_property
    def nv(self) -> np.ndarray:
        return self.v[0].double().numpy()

    @cached_property
    def nq(self) -> np.ndarray:
        return self.q[0].double().numpy()

    def layer(self) -> BudgetLayer:
        layer = BudgetLayer()
        layer.update(self.k.clone(), self.v.clone())  # positions 0..N-1
        return layer

    def compress(
        self, name: str, options: dict, budget: int = BUDGET, layer_idx: int = 0, num_layers: int = LAYERS
    ) -> tuple[BudgetLayer, list[int], object]:
        """Compress a fresh layer with ``name``; returns the layer, the per-head counts and the method."""
        layer = self.layer()
        method = make_method(name, **options)
        obs = Observation(layer_idx, num_layers, query=self.q, layer=layer, scaling=SCALE)
        kept = method.compress_layer(obs, targets=[budget])
        assert tuple(kept.shape) == (1, H)
        return layer, kept[0].tolist(), method


def kept_positions(layer: BudgetLayer) -> list[list[int]]:
    return [layer.head(h)[2][0].tolist() for h in range(layer.num_heads)]


def assert_layer_holds(layer: BudgetLayer, expected: list, keys: np.ndarray, values: np.ndarray) -> None:
    """Each head ``h`` holds, sorted by position, the set ``expected[h]`` (a set, or a :class:`Choice`
    admitting it), with the keys and values of those positions."""
    held = kept_positions(layer)
    for h in range(H):
        pos = held[h]
        assert pos == sorted(set(pos)), f"head {h}: positions not sorted/unique: {pos}"
        want = expected[h]
        if isinstance(want, set):
            assert set(pos) == want, f"head {h}: kept {sorted(pos)}, reference {sorted(want)}"
        else:
            assert want.admits(set(pos)), f"head {h}: kept {sorted(pos)}, reference {want}"
        k_h, v_h, _ = layer.head(h)
        np.testing.assert_array_equal(k_h[0].double().numpy(), keys[h, pos])
        np.testing.assert_array_equal(v_h[0].double().numpy(), values[h, pos])
    assert layer.head_lengths()[0].tolist() == [len(p) for p in held]


# ------------------------------------------------------------------------------------ references
def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def attention_row(query: np.ndarray, keys: np.ndarray, entries: list[int]) -> list[float]:
    """Probabilities of one query over ``keys[e]`` for e in ``entries`` (the entries it may see)."""
    logits = []
    for e in entries:
        dot = 0.0
        for c in range(query.shape[0]):
            dot += float(query[c]) * float(keys[e, c])
        logits.append(dot * SCALE)
    return softmax(logits)


def causal_probs(q: np.ndarray, k: np.ndarray, qh: int, i: int) -> np.ndarray:
    """Row ``i`` of query head ``qh``'s causal attention over the prompt: ``[N]``, 0 for keys after ``i``."""
    row = np.zeros(k.shape[1])
    probs = attention_row(q[qh, i], k[qh // G], list(range(i + 1)))
    for j, p in enumerate(probs):
        row[j] = p
    return row


def pool(xs: list[float], kernel: int, how: str) -> list[float]:
    """Stride-1 pooling by explicit windows ``[j − kernel//2, j + kernel//2]``.

    ``max``: out-of-range slots are -inf pads, i.e. ignored. ``avg``: zero pads, always divided by
    ``kernel``. ``avg_valid`` (a wrong variant, used only to show the fixture can tell them apart)
    divides by the in-range count.
    """
    r = kernel // 2
    out = []
    for j in range(len(xs)):
        inside = [xs[i] for i in range(j - r, j + r + 1) if 0 <= i < len(xs)]
        if how == "max":
            out.append(max(inside))
        elif how == "avg":
            out.append(sum(inside) / kernel)
        elif how == "avg_valid":
            out.append(sum(inside) / len(inside))
        else:
            out.append(xs[j])
    return out


def window_scores(
    fx: Fixture,
    w: int,
    kernel: int,
    pooling: str,
    rows: str = "sum",
    heads: str = "mean",
    span: int | None = None,
) -> list[list[float]]:
    """WS(w, kernel, pool, reduce), the window score: per KV head, scores of the first N − w keys.

    ``span`` (a wrong variant, only to show the fixture tells them apart) pools over the first
    ``span`` columns instead of cutting the window columns off before pooling.
    """
    q, k = fx.nq, fx.nk
    m = N - w if span is None else span
    out = []
    for h in range(H):
        per_query_head = []
        for qh in range(h * G, (h + 1) * G):
            cols = [0.0] * m
            for i in range(N - w, N):  # window rows; each row's softmax runs over keys 0..i
                probs = causal_probs(q, k, qh, i)
                for j in range(m):
                    cols[j] += probs[j]
            if rows == "mean":
                cols = [c / w for c in cols]
            per_query_head.append(cols)
        if heads == "mean":
            reduced = [sum(p[j] for p in per_query_head) / G for j in range(m)]
        else:
            reduced = [max(p[j] for p in per_query_head) for j in range(m)]
        out.append(pool(reduced, kernel, pooling)[: N - w])
    return out


@dataclass
class Choice:
    """A reference selection of one head: ``count`` entries, all of ``sure`` plus some of ``tied``.

    ``tied`` holds the entries whose score equals (within ``TOL``) the score at the cut — e.g. a
    max-pooling plateau split by the cut. The papers do not say how such ties are broken, so any
    pick among them is accepted; with no tie at the cut, ``tied`` is empty and the set is exact.
    """

    sure: set[int]
    tied: set[int]
    count: int

    def __or__(self, protected: set[int]) -> Choice:
        """Add always-kept entries (never among the scored candidates)."""
        assert not protected & (self.sure | self.tied)
        return Choice(self.sure | protected, self.tied, self.count + len(protected))

    def admits(self, kept: set[int]) -> bool:
        return len(kept) == self.count and self.sure <= kept <= self.sure | self.tied

    def compatible(self, other: Choice) -> bool:
        """Whether one kept set can satisfy both choices."""
        return self.sure <= other.sure | other.tied and other.sure <= self.sure | self.tied


def top_k(values: list[float] | dict[int, float], k: int) -> Choice:
    """The ``k`` largest values (indices into a list, or keys of a dict)."""
    items = sorted(values.items() if isinstance(values, dict) else enumerate(values), key=lambda t: -t[1])
    if k <= 0:
        return Choice(set(), set(), 0)
    if k >= len(items):
        return Choice({i for i, _ in items}, set(), len(items))
    cut = items[k - 1][1]
    if cut - items[k][1] > TOL:
        return Choice({i for i, _ in items[:k]}, set(), k)
    return Choice({i for i, v in items if v > cut + TOL}, {i for i, v in items if abs(v - cut) <= TOL}, k)


def top_k_exact(values: list[float] | dict[int, float], k: int) -> set[int]:
    """The ``k`` largest values; asserts the cut is unambiguous (no tie within ``TOL``)."""
    choice = top_k(values, k)
    assert not choice.tied, f"ambiguous fixture: tie at the top-{k} cut of {values}; pick another seed"
    return choice.sure


def window_keep(scores: list[list[float]], caps: list[int], w: int) -> list[Choice]:
    """Per head: top ``cap − w`` scored candidates plus the last ``w`` tokens."""
    return [top_k(scores[h], caps[h] - w) | set(range(N - w, N)) for h in range(H)]


def pyramid_cap(budget: int, length: int, w: int, layer: int, layers: int, beta: int = 20) -> int:
    """PyramidKV layer budget, written from the paper (docs/methods.md)."""
    if length <= budget:
        return length
    b_prime = budget - w
    lo = b_prime // beta
    hi = 2 * b_prime - lo
    if hi >= length - w:
        hi = length - w
        lo = 2 * b_prime - hi
    step = (hi - lo) // (layers - 1)
    return hi - layer * step + w


def ada_caps(
    scores: list[list[float]], layer_budget: int, w: int, alpha: float = 0.2
) -> set[tuple[int, ...]]:
    """AdaKV per-head budgets (window included), from one top-H·B' over all (score, head, token) triples.

    ``n_h`` = the head's winners, ``cap_h = round(n_h(1 − α) + B'α) + w``. Returns every budget
    vector the spec allows: one, unless tied triples (a max-pooling plateau) straddle the cut, in
    which case each way of splitting the tied winners among their heads gives one vector.
    """
    b_prime = layer_budget - w
    total = H * b_prime
    triples = sorted(((s, h, j) for h in range(H) for j, s in enumerate(scores[h])), reverse=True)
    sure, tied = [0] * H, [0] * H
    if total >= len(triples):
        for _, h, _ in triples:
            sure[h] += 1
    elif total > 0:
        cut = triples[total - 1][0]
        for s, h, _ in triples:
            if s > cut + TOL:
                sure[h] += 1
            elif abs(s - cut) <= TOL:
                tied[h] += 1
    need = min(total, len(triples)) - sum(sure)
    options = set()
    for extra in itertools.product(*(range(t + 1) for t in tied)):
        if sum(extra) != need:
            continue
        caps = []
        for h in range(H):
            share = (sure[h] + extra[h]) * (1 - alpha) + b_prime * alpha
            assert abs(share - math.floor(share) - 0.5) > 1e-6, "half-way share: rounding is ambiguous"
            caps.append(round(share) + w)
        options.add(tuple(caps))
    return options


def column_sums(fx: Fixture) -> list[list[float]]:
    """H2O prompt score: attention each key receives from every prompt query (causal), GQA mean."""
    q, k = fx.nq, fx.nk
    sums = [[0.0] * N for _ in range(HQ)]
    for qh in range(HQ):
        for i in range(N):
            probs = causal_probs(q, k, qh, i)
            for j in range(i + 1):
                sums[qh][j] += probs[j]
    return [[sum(sums[qh][j] for qh in range(h * G, (h + 1) * G)) / G for j in range(N)] for h in range(H)]


def last_row_all_heads(fx: Fixture) -> list[float]:
    """TOVA: the last query's attention averaged over ALL query heads: ``[N]``."""
    rows = [causal_probs(fx.nq, fx.nk, qh, N - 1) for qh in range(HQ)]
    return [sum(r[j] for r in rows) / HQ for j in range(N)]


# ------------------------------------------------------------------------------------------ tests
def test_every_registered_method_has_a_reference_test() -> None:
    covered = {
        "full", "random", "knorm", "streamingllm", "snapkv", "pyramidkv",
        "ada-snapkv", "ada-pyramidkv", "h2o", "observed-attention", "tova", "vatp",
        # references in tests/test_lava.py, tests/test_cake.py and tests/test_d2o.py
        "lava", "lava-uniform", "lava-nohead", "lava-pyramid", "cake",
        "d2o", "d2o-uniform", "d2o-nomerge", "cam",
        # references in tests/test_baklava.py
        "squeezeattention", "baklava", "baklava-snapkv",
        # references in tests/test_laq.py
        "laq", "laq++", "laq-ada", "laq-lava",
        # prune-stage methods: references in tests/test_prune.py (ASL's scoring is shared by its variants)
        "asl", "asl-fullkv", "asl-2pass", "fastkv", "gemfilter", "pyramidinfer",
        # references in tests/test_keydiff_lagkv_chunkkv_qfilter.py
        "keydiff",
        "lagkv",
        "chunkkv",
        "qfilter",
        # references in tests/test_kvzip_expected_attention_rkv.py
        "kvzip", "expected-attention", "r-kv",
        # references in tests/test_kvzip_plus.py
        "kvzip+",
        # references in tests/test_kvzap.py
        "kvzap", "kvzap-decoding",
        # references in tests/test_leverage.py and tests/test_compactor.py
        "leverage", "compactor",
        # references in tests/test_kvgrad.py
        "kvgrad",
    }  # fmt: skip
    assert set(method_names()) == covered


# --- full
def test_full_keeps_everything_through_the_session() -> None:
    fx = Fixture.make()
    layer = fx.layer()
    session = CompressionSession(make_method("full"), LAYERS, budget=BUDGET)
    for begin in (session.begin_prefill, session.begin_decode):
        begin()
        session.after_attention(0, fx.q, layer, SCALE)
    assert_layer_holds(layer, [set(range(N))] * H, fx.nk, fx.nv)


def test_full_compress_called_directly_keeps_everything() -> None:
    fx = Fixture.make()
    layer, kept, _ = fx.compress("full", {})
    assert kept == [N] * H
    assert_layer_holds(layer, [set(range(N))] * H, fx.nk, fx.nv)


# --- random
def test_random_is_reproducible_and_seeded_per_layer() -> None:
    fx = Fixture.make()

    def kept(seed: int, layer_idx: int, window: int = 0) -> list[list[int]]:
        layer, counts, _ = fx.compress("random", {"seed": seed, "window": window}, layer_idx=layer_idx)
        assert counts == [BUDGET] * H
        return kept_positions(layer)

    a = kept(3, 1)
    assert a == kept(3, 1)  # same seed, same layer: same selection
    assert a != kept(4, 1)  # another seed: another selection
    assert a != kept(3, 2)  # another layer: another draw
    assert kept(3, 2) == kept(4, 1)  # the documented per-layer generator seed is seed + layer_idx
    for pos in a:
        assert len(pos) == BUDGET and pos == sorted(set(pos)) and all(0 <= p < N for p in pos)
    assert a[0] != a[1]  # heads draw independently
    for pos in kept(5, 0, window=3):
        assert {N - 3, N - 2, N - 1} <= set(pos)


def test_random_keeps_each_position_about_equally_often() -> None:
    fx = Fixture.make()
    counts = np.zeros((H, N))
    draws = 120
    for seed in range(draws):
        layer, _, _ = fx.compress("random", {"seed": 1000 + seed})
        for h, pos in enumerate(kept_positions(layer)):
            counts[h, pos] += 1
    freq = counts / draws  # expected BUDGET / N ≈ 0.42 each (binomial std ≈ 0.045)
    assert freq.min() > 0.2 and freq.max() < 0.65, freq


# --- knorm
@pytest.mark.parametrize("window", [0, 3])
def test_knorm_keeps_smallest_key_norms(window: int) -> None:
    fx = Fixture.make()
    layer, kept, _ = fx.compress("knorm", {"window": window})
    expected = []
    for h in range(H):
        norms = {}
        for j in range(N - window):
            norms[j] = -math.sqrt(sum(float(x) ** 2 for x in fx.nk[h, j]))
        expected.append(top_k(norms, BUDGET - window) | set(range(N - window, N)))
    assert kept == [BUDGET] * H
    assert_layer_holds(layer, expected, fx.nk, fx.nv)


# --- streamingllm
@pytest.mark.parametrize("sinks", [4, 2])
def test_streamingllm_keeps_sinks_and_recent(sinks: int) -> None:
    fx = Fixture.make()
    layer, kept, _ = fx.compress("streamingllm", {"sinks": sinks})
    expected = set(range(sinks)) | set(range(N - (BUDGET - sinks), N))
    assert kept == [BUDGET] * H
    assert_layer_holds(layer, [expected] * H, fx.nk, fx.nv)


def test_streamingllm_decode_evicts_the_oldest_non_sink() -> None:
    fx = Fixture.make()
    layer, _, method = fx.compress("streamingllm", {})
    g = seeded(99)
    keys, values = fx.nk, fx.nv
    for step in range(2):
        k1, v1 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        q1 = torch.randn(1, HQ, 1, D, generator=g)
        layer.update(k1, v1)
        keys = np.concatenate([keys, k1[0].double().numpy()], axis=1)
        values = np.concatenate([values, v1[0].double().numpy()], axis=1)
        obs = Observation(layer_idx=0, num_layers=LAYERS, query=q1, layer=layer, scaling=SCALE)
        method.decode_step(obs, row_budgets=[BUDGET])
        seen = N + step + 1
        expected = set(range(4)) | set(range(seen - (BUDGET - 4), seen))
        assert_layer_holds(layer, [expected] * H, keys, values)


# --- snapkv
# Wrong variants of WS; each case's fixture must keep something else under them (else the case
# could not tell the right formula from these).
VARIANTS = {
    "gqa_max": {"heads": "max"},
    "gqa_mean": {"heads": "mean"},
    "no_pooling": {"kernel": 1, "pooling": "none"},
    "avg_divides_by_in_range_count": {"pooling": "avg_valid"},
    "pools_window_columns_too": {"span": N},
}
SNAPKV_CASES = [
    # options, seed, wrong variants the fixture must reject
    pytest.param(
        {"window": W, "kernel": 3, "pooling": "max"}, 50,
        ["gqa_max", "no_pooling", "pools_window_columns_too"], id="max3",
    ),
    pytest.param(
        {"window": W, "kernel": 5, "pooling": "avg"}, 2,
        ["avg_divides_by_in_range_count", "gqa_max"], id="avg5",
    ),
    pytest.param({"window": W, "kernel": 3, "pooling": "max", "reduce_rows": "mean"}, 50, [], id="max3-mean"),
    pytest.param(
        {"window": W, "kernel": 3, "pooling": "max", "reduce_heads": "max"}, 0, ["gqa_mean"], id="gqa-max",
    ),
    pytest.param({"window": W, "kernel": 1, "pooling": "none"}, 0, [], id="nopool"),
    pytest.param(
        {"window": 6, "kernel": 7, "pooling": "max"}, 18,
        ["no_pooling", "pools_window_columns_too"], id="w6-max7-plateau-at-cut",
    ),
    pytest.param(
        {"window": 6, "kernel": 7, "pooling": "max"}, 143, ["no_pooling", "gqa_max"], id="w6-max7",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("options", "seed", "variants"), SNAPKV_CASES)
def test_snapkv_matches_window_score_reference(options: dict, seed: int, variants: list[str]) -> None:
    fx = Fixture.make(seed)
    w = options["window"]
    spec = {
        "kernel": options["kernel"], "pooling": options["pooling"],
        "rows": options.get("reduce_rows", "sum"), "heads": options.get("reduce_heads", "mean"),
    }  # fmt: skip
    layer, kept, method = fx.compress("snapkv", options)
    ref = window_scores(fx, w, **spec)
    expected = window_keep(ref, [BUDGET] * H, w)
    assert kept == [BUDGET] * H
    assert_layer_holds(layer, expected, fx.nk, fx.nv)
    # the scores themselves, not only their ranking (sum vs mean over the rows shows here)
    lib = method.score(Observation(0, LAYERS, fx.q, fx.layer(), SCALE))[0, :, : N - w].double().numpy()
    np.testing.assert_allclose(lib, np.array(ref), rtol=1e-5, atol=1e-7)
    # sum vs mean over the window rows: one scale per layer, so the same selection
    other_rows = {**spec, "rows": "mean" if spec["rows"] == "sum" else "sum"}
    assert window_keep(window_scores(fx, w, **other_rows), [BUDGET] * H, w) == expected
    for name in variants:
        wrong = window_keep(window_scores(fx, w, **{**spec, **VARIANTS[name]}), [BUDGET] * H, w)
        rejected = any(not x.compatible(y) for x, y in zip(expected, wrong, strict=True))
        assert rejected, f"the fixture cannot tell the variant {name} apart"


def test_snapkv_keeps_everything_when_budget_covers_the_prompt() -> None:
    fx = Fixture.make()
    layer, kept, _ = fx.compress("snapkv", {"window": W, "kernel": 3}, budget=N)
    assert kept == [N] * H
    assert_layer_holds(layer, [set(range(N))] * H, fx.nk, fx.nv)


# --- pyramidkv
def test_pyramid_budget_formula_by_hand() -> None:
    # B=10, L=24, w=4, 4 layers: B'=6, min=0, max=12 < 20, step=4 -> 12, 8, 4, 0 (+4)
    # B=16: B'=12, min=0, max=24 >= 20 -> max=20, min=4, step=5 -> 20, 15, 10, 5 (+4)
    # B=100, L=1000, w=8, 32 layers: B'=92, min=4, max=180, step=176//31=5 -> 180 - 5l (+8)
    by_hand = {
        (10, 24, 4, 4): [16, 12, 8, 4],
        (16, 24, 4, 4): [24, 19, 14, 9],
        (100, 1000, 8, 32): [188 - 5 * layer for layer in range(32)],
    }
    for (budget, length, w, layers), caps in by_hand.items():
        assert [pyramid_cap(budget, length, w, lay, layers) for lay in range(layers)] == caps
        method = make_method("pyramidkv", window=w)
        assert [method.layer_budget(budget, length, lay, layers) for lay in range(layers)] == caps
        ada = make_method("ada-pyramidkv", window=w)
        assert [ada.layer_budget(budget, length, lay, layers) for lay in range(layers)] == caps


# (budget, layer, seed): seeds with no tie at any head's cut; caps 16/12/8/4 and 24/19/14/9
PYRAMID_CASES = [
    (10, 0, 0), (10, 1, 10), (10, 2, 38), (10, 3, 0),
    (16, 0, 0), (16, 1, 4), (16, 2, 10), (16, 3, 45),
]  # fmt: skip


@pytest.mark.parametrize(("budget", "layer_idx", "seed"), PYRAMID_CASES)
def test_pyramidkv_keeps_snapkv_top_under_layer_budget(budget: int, layer_idx: int, seed: int) -> None:
    fx = Fixture.make(seed)
    options = {"window": W, "kernel": 3}
    layer, kept, _ = fx.compress("pyramidkv", options, budget=budget, layer_idx=layer_idx)
    cap = pyramid_cap(budget, N, W, layer_idx, LAYERS)
    ref = window_scores(fx, W, 3, "max")
    assert kept == [cap] * H
    assert_layer_holds(layer, window_keep(ref, [cap] * H, W), fx.nk, fx.nv)


# --- ada-snapkv / ada-pyramidkv
ADA_OPTIONS = {"window": W, "kernel": 3}


def check_ada(name: str, budget: int, layer_idx: int, layer_budget: int, seed: int) -> list[int]:
    fx = Fixture.make(seed)
    layer, kept, method = fx.compress(name, ADA_OPTIONS, budget=budget, layer_idx=layer_idx)
    ref = window_scores(fx, W, 3, "max", rows="mean", heads="mean")  # AdaKV: mean over the window rows
    # the mean over rows ranks like the sum within a layer, so check it on the score values
    lib = method.score(Observation(layer_idx, LAYERS, fx.q, fx.layer(), SCALE))[0, :, : N - W]
    np.testing.assert_allclose(lib.double().numpy(), np.array(ref), rtol=1e-5, atol=1e-7)
    allowed = ada_caps(ref, layer_budget, W)
    assert all(sum(caps) == H * layer_budget for caps in allowed)  # the layer total is exact
    assert tuple(kept) in allowed, f"head budgets {kept}, reference {sorted(allowed)}"
    assert_layer_holds(layer, window_keep(ref, kept, W), fx.nk, fx.nv)
    return kept


# seeds with an unambiguous AdaKV cut, skewed head budgets, and a floor that changes them
@pytest.mark.parametrize(("budget", "seed"), [(8, 65), (10, 104), (12, 169)])
def test_ada_snapkv_head_budgets_and_kept_sets(budget: int, seed: int) -> None:
    caps = check_ada("ada-snapkv", budget, 1, budget, seed)
    # discriminating fixture: the heads' budgets differ, and without the floor (α = 0) they would
    # differ otherwise
    assert caps[0] != caps[1]
    assert min(caps) >= W + round(0.2 * (budget - W))
    ref = window_scores(Fixture.make(seed), W, 3, "max", rows="mean")
    assert tuple(caps) not in ada_caps(ref, budget, W, alpha=0.0)


# budget 10: layer budgets 16, 12, 8, 4 (window only), seed 29 splits layer 2 into 7 + 9;
# budget 16: layer budgets 24 (everything), 19, 14, 9, seed 10 splits them 21 + 17, 16 + 12, 11 + 7
@pytest.mark.parametrize(("budget", "seed"), [(10, 29), (16, 10)])
@pytest.mark.parametrize("layer_idx", range(LAYERS))
def test_ada_pyramidkv_head_budgets_and_kept_sets(layer_idx: int, budget: int, seed: int) -> None:
    check_ada("ada-pyramidkv", budget, layer_idx, pyramid_cap(budget, N, W, layer_idx, LAYERS), seed)


# --- h2o
@pytest.mark.parametrize("heavy_fraction", [0.5, 0.8])
def test_h2o_keeps_heavy_hitters_by_column_sums_and_recent(heavy_fraction: float) -> None:
    fx = Fixture.make()
    layer, kept, _ = fx.compress("h2o", {"heavy_fraction": heavy_fraction, "chunk": 5})
    heavy = int(heavy_fraction * BUDGET)
    recent = BUDGET - heavy
    sums = column_sums(fx)
    expected = [top_k(sums[h][: N - recent], heavy) | set(range(N - recent, N)) for h in range(H)]
    assert kept == [BUDGET] * H
    assert_layer_holds(layer, expected, fx.nk, fx.nv)
    state = layer.state["attention_received"]
    for h, pos in enumerate(kept_positions(layer)):
        np.testing.assert_allclose(state[0, h].double().numpy(), [sums[h][p] for p in pos], rtol=1e-5)


def h2o_decode_and_check(
    fx: Fixture, layer: BudgetLayer, method: object, entries: list[list[int]], budget: int, steps: int
) -> None:
    """Decode ``steps`` random tokens; after each, compare the layer with the H2O reference.

    ``entries[h]``: positions head ``h`` holds before decoding. Reference score of an entry: its
    prompt column sum (GQA mean) plus the attention each new query paid it (softmax over the
    entries kept at that step, GQA mean); the lowest-scored entry outside the recent window
    ``budget − ⌊0.5·budget⌋`` is evicted.
    """
    sums = column_sums(fx)
    recent = budget - int(0.5 * budget)
    score = [{p: sums[h][p] for p in entries[h]} for h in range(H)]
    keys, values = fx.nk, fx.nv
    g = seeded(7)
    for _ in range(steps):
        k1, v1 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        q1 = 2.0 * torch.randn(1, HQ, 1, D, generator=g)
        new = keys.shape[1]
        keys = np.concatenate([keys, k1[0].double().numpy()], axis=1)
        values = np.concatenate([values, v1[0].double().numpy()], axis=1)
        layer.update(k1, v1)
        obs = Observation(layer_idx=0, num_layers=LAYERS, query=q1, layer=layer, scaling=SCALE)
        method.decode_step(obs, row_budgets=[budget])
        nq1 = q1[0, :, 0].double().numpy()
        for h in range(H):
            entries[h].append(new)
            score[h][new] = 0.0
            for qh in range(h * G, (h + 1) * G):  # the new query sees every kept entry
                for e, p in zip(entries[h], attention_row(nq1[qh], keys[h], entries[h]), strict=True):
                    score[h][e] += p / G
            candidates = {e: -score[h][e] for e in entries[h][: len(entries[h]) - recent]}
            (evicted,) = top_k_exact(candidates, 1)  # lowest accumulated score outside the recent window
            entries[h].remove(evicted)
            del score[h][evicted]
        assert_layer_holds(layer, [set(e) for e in entries], keys, values)
        state = layer.state["attention_received"]
        for h in range(H):
            want = [score[h][e] for e in entries[h]]
            np.testing.assert_allclose(state[0, h].double().numpy(), want, rtol=1e-5)


def test_h2o_decode_accumulates_new_attention_and_evicts_one() -> None:
    fx = Fixture.make()
    layer, _, method = fx.compress("h2o", {})
    recent = BUDGET - int(0.5 * BUDGET)
    sums = column_sums(fx)
    entries = [
        sorted(top_k_exact(sums[h][: N - recent], BUDGET - recent) | set(range(N - recent, N)))
        for h in range(H)
    ]
    h2o_decode_and_check(fx, layer, method, entries, BUDGET, steps=2)


def test_h2o_decode_after_a_prompt_that_fits_counts_the_prompt_attention() -> None:
    fx = Fixture.make()
    layer = fx.layer()
    method = make_method("h2o")
    method.compress_layer(Observation(0, LAYERS, fx.q, layer, SCALE), targets=[None])  # what the session does
    assert kept_positions(layer) == [list(range(N))] * H
    h2o_decode_and_check(fx, layer, method, [list(range(N)) for _ in range(H)], budget=N, steps=2)


# --- observed-attention
def observed_means(fx: Fixture, heads: str = "mean", divide: str = "seeing", window: int | None = None):
    """Observed attention (kvpress's ObservedAttentionPress): per query head, the attention key ``j``
    receives, summed over the queries ``i`` that see it and divided by their number, then reduced
    over each GQA group. ``window``: a sliding-window layer (query ``i`` sees keys ``i − window < j ≤
    i``). Wrong variants, only to show the fixture tells them apart: ``divide="none"`` (H2O's sums),
    ``divide="causal"`` (kvpress's ``n − j`` whatever the window), ``heads="max"``."""
    q, k = fx.nq, fx.nk
    out = []
    for h in range(H):
        per_query_head = []
        for qh in range(h * G, (h + 1) * G):
            sums, seeing = [0.0] * N, [0] * N
            for i in range(N):
                first = 0 if window is None else max(0, i - window + 1)
                entries = list(range(first, i + 1))
                for j, p in zip(entries, attention_row(q[qh, i], k[h], entries), strict=True):
                    sums[j] += p
                    seeing[j] += 1
            if divide == "seeing":
                per_query_head.append([sums[j] / seeing[j] for j in range(N)])
            elif divide == "causal":
                per_query_head.append([sums[j] / (N - j) for j in range(N)])
            else:
                per_query_head.append(sums)
        if heads == "mean":
            out.append([sum(p[j] for p in per_query_head) / G for j in range(N)])
        else:
            out.append([max(p[j] for p in per_query_head) for j in range(N)])
    return out


#: a fixture on which the wrong variants (sums, GQA max) keep other entries, with and without a window
OBSERVED_SEED = 2


@pytest.mark.parametrize(("window", "sinks", "chunk"), [(0, 0, 512), (3, 2, 5)])
def test_observed_attention_keeps_the_top_mean_attention(window: int, sinks: int, chunk: int) -> None:
    fx = Fixture.make(OBSERVED_SEED)
    options = {"window": window, "sinks": sinks, "chunk": chunk}
    layer, kept, _ = fx.compress("observed-attention", options)
    protected = set(range(sinks)) | set(range(N - window, N))
    candidates = [j for j in range(N) if j not in protected]
    ref = observed_means(fx)
    scored = BUDGET - len(protected)
    expected = [top_k({j: ref[h][j] for j in candidates}, scored) | protected for h in range(H)]
    assert kept == [BUDGET] * H
    assert_layer_holds(layer, expected, fx.nk, fx.nv)
    # discriminating: H2O's unnormalised sums and a GQA max keep other entries on this fixture
    for wrong in (observed_means(fx, divide="none"), observed_means(fx, heads="max")):
        other = [top_k({j: wrong[h][j] for j in candidates}, scored) for h in range(H)]
        assert any(not (other[h] | protected).compatible(expected[h]) for h in range(H))


def test_observed_attention_on_a_sliding_window_layer_averages_over_the_queries_that_see_each_key() -> None:
    fx = Fixture.make(OBSERVED_SEED)
    layer = fx.layer()
    layer.sliding_window = 6
    method = make_method("observed-attention")
    kept = method.compress_layer(Observation(0, LAYERS, fx.q, layer, SCALE), targets=[BUDGET])
    ref = observed_means(fx, window=6)
    expected = [top_k(ref[h], BUDGET) for h in range(H)]
    assert kept[0].tolist() == [BUDGET] * H
    assert_layer_holds(layer, expected, fx.nk, fx.nv)
    # discriminating: kvpress's n − j divisor (every causal query, seen or not) keeps other entries
    causal = observed_means(fx, divide="causal", window=6)
    assert any(not top_k(causal[h], BUDGET).compatible(expected[h]) for h in range(H))


# --- tova
def test_tova_keeps_top_of_last_row_averaged_over_all_query_heads() -> None:
    fx = Fixture.make()
    layer, kept, _ = fx.compress("tova", {})
    expected = top_k(last_row_all_heads(fx), BUDGET)
    assert kept == [BUDGET] * H
    assert_layer_holds(layer, [expected] * H, fx.nk, fx.nv)
    # discriminating: a per-KV-head GQA mean would keep different sets
    per_group = []
    for h in range(H):
        rows = [causal_probs(fx.nq, fx.nk, qh, N - 1) for qh in range(h * G, (h + 1) * G)]
        per_group.append(top_k([sum(r[j] for r in rows) / G for j in range(N)], BUDGET))
    assert any(not s.compatible(expected) for s in per_group)


def test_tova_decode_evicts_lowest_current_attention() -> None:
    fx = Fixture.make()
    layer, _, method = fx.compress("tova", {})
    entries = sorted(top_k_exact(last_row_all_heads(fx), BUDGET))
    keys, values = fx.nk, fx.nv
    g = seeded(5)
    for _ in range(2):
        k1, v1 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
        q1 = 2.0 * torch.randn(1, HQ, 1, D, generator=g)
        new = keys.shape[1]
        keys = np.concatenate([keys, k1[0].double().numpy()], axis=1)
        values = np.concatenate([values, v1[0].double().numpy()], axis=1)
        layer.update(k1, v1)
        obs = Observation(layer_idx=0, num_layers=LAYERS, query=q1, layer=layer, scaling=SCALE)
        method.decode_step(obs, row_budgets=[BUDGET])
        entries.append(new)
        nq1 = q1[0, :, 0].double().numpy()
        avg = dict.fromkeys(entries, 0.0)
        for qh in range(HQ):
            for e, p in zip(entries, attention_row(nq1[qh], keys[qh // G], entries), strict=True):
                avg[e] += p / HQ
        (evicted,) = top_k_exact({e: -s for e, s in avg.items()}, 1)
        entries.remove(evicted)
        assert_layer_holds(layer, [set(entries)] * H, keys, values)


# --- vatp
@pytest.mark.parametrize(("budget", "sinks"), [(12, None), (10, 0), (10, 2)])
def test_vatp_keeps_attention_times_value_l1_plus_sinks_and_window(budget: int, sinks: int | None) -> None:
    fx = Fixture.make()
    options = {"window": W} if sinks is None else {"window": W, "sinks": sinks}
    if sinks is None:
        sinks = 4  # the default: VATP keeps 4 attention sinks
    layer, kept, _ = fx.compress("vatp", options, budget=budget)
    expected = []
    for h in range(H):
        attention = [0.0] * N
        for qh in range(h * G, (h + 1) * G):
            for i in range(N - W, N):
                probs = causal_probs(fx.nq, fx.nk, qh, i)
                for j in range(N):
                    attention[j] += probs[j] / G
        score = {j: attention[j] * sum(abs(float(x)) for x in fx.nv[h, j]) for j in range(sinks, N - W)}
        expected.append(top_k(score, budget - W - sinks) | set(range(sinks)) | set(range(N - W, N)))
    assert kept == [budget] * H
    assert_layer_holds(layer, expected, fx.nk, fx.nv)
