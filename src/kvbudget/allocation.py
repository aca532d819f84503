"""Allocators: how many entries each layer and each KV head keeps.

Budgets count entries per KV head with the protected window included, as in the papers' tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def uniform_layer_budget(budget: int, length: int, layer_idx: int, num_layers: int, window: int) -> int:
    """Every layer keeps ``budget`` entries per head (never more than the ``length`` it has)."""
    return min(budget, length)


def pyramid_layer_budget(
    budget: int, length: int, layer_idx: int, num_layers: int, window: int, beta: int = 20
) -> int:
    """PyramidKV: budgets decrease linearly from the bottom layer to the top one.

    With ``B' = budget − window``: ``min = B' // β``, ``max = 2B' − min``; if ``max ≥ length − window``
    then ``max = length − window`` and ``min = 2B' − max``; ``step = (max − min) // (layers − 1)``;
    layer ``l`` keeps ``max − l·step`` plus the window. The floored step makes the layers' total
    exceed ``layers · budget`` by ``ε·layers·(layers−1)/2`` entries per head, ``ε < 1`` the step's
    dropped fraction (as in the authors' code; a few percent at the papers' budgets).

    Where the prompt is shorter than ``2B'`` (a compression ratio below about 0.5) the authors'
    code (``PyramidKVCluster.update_kv``) keeps the uniform ``B'`` at every layer instead; this
    keeps the clamped pyramid there (the formula of the paper and of ``docs/methods.md``). kvpress
    0.5.5's ``PyramidKVPress`` falls back to uniform in the opposite case, when ``min`` would fall
    below the window (at β = 20 and window 64, every ratio above about 0.4 on a 2K prompt).
    """
    if budget >= length:
        return length
    b_prime = budget - window
    low = b_prime // beta
    high = 2 * b_prime - low
    if high >= length - window:
        high = length - window
        low = 2 * b_prime - high
    step = (high - low) // max(num_layers - 1, 1)
    return min(high - layer_idx * step + window, length)


def largest_remainder_round(shares: torch.Tensor, total: int) -> torch.Tensor:
    """Round non-negative ``shares: [k]`` to integers that sum exactly to ``total``."""
    floor = shares.floor()
    result = floor.long()
    missing = int(total - int(result.sum()))
    if missing > 0:
        order = torch.argsort(shares - floor, descending=True, stable=True)
        result[order[:missing]] += 1
    elif missing < 0:
        order = torch.argsort(shares - floor, descending=False, stable=True)
        candidates = order[result[order] > 0]
        result[candidates[:-missing]] -= 1
    return result


def adaptive_head_budgets(
    scores: torch.Tensor, layer_budget: int, window: int, floor_alpha: float
) -> torch.Tensor:
    """AdaKV head budgets for one batch row of one layer.

    Args:
        scores: ``[kv_heads, m]`` candidate scores (window excluded; invalid = -inf).
        layer_budget: entries per head on average, window included.
        window: protected recent entries per head.
        floor_alpha: fraction of ``B' = layer_budget − window`` every head is guaranteed.

    Returns:
        ``[kv_heads]`` budgets (window included) summing exactly to ``kv_heads · layer_budget``:
        ``cap_h = n_h·(1−α) + B'·α`` with ``n_h`` the head's winners of one top-``H·B'`` over the
        flattened scores, rounded by largest remainder.
    """
    heads, m = scores.shape
    b_prime = layer_budget - window
    total = heads * b_prime
    # stable sort: exact ties go to the earlier (head, slot), independent of the sort kernel
    winners = torch.sort(scores.reshape(-1), descending=True, stable=True).indices[:total] // m
    counts = torch.bincount(winners, minlength=heads).float()
    shares = counts * (1 - floor_alpha) + b_prime * floor_alpha
    return largest_remainder_round(shares, total) + window


def safeguard_head_budgets(
    scores: torch.Tensor, layer_budget: int, window: int, floor_alpha: float
) -> torch.Tensor:
    """Head budgets with kvpress's AdaKV floor (``AdaKVPress``'s ``alpha_safeguard``), one batch row.

    Every head first keeps its own top ``s = int(α·B)`` entries (at least one when ``α > 0``), its
    protected entries among them (kvpress scores them above everything); the rest of the layer's
    ``H·B`` entries go to one top-k over the heads' remaining candidates. A head's budget is what it
    ends up with. (:func:`adaptive_head_budgets` instead mixes each head's winners with an even share,
    AdaKV's ``n_h(1−α) + α·B'``.)

    Args:
        scores: ``[kv_heads, m]`` candidate scores (protected excluded; invalid = -inf).
        layer_budget: ``B``, entries per head on average, protected included.
        window: protected entries per head.
        floor_alpha: ``α``, the share of ``B`` each head keeps by its own ranking.

    Returns:
        ``[kv_heads]`` budgets (protected included) summing exactly to ``kv_heads · layer_budget``.
    """
    heads, m = scores.shape
    b_prime = layer_budget - window
    safe = int(layer_budget * floor_alpha)
    if floor_alpha > 0 and layer_budget > 0:
        safe = max(1, safe)
    forced = min(max(safe - window, 0), b_prime)
    rest = torch.sort(scores, dim=-1, descending=True, stable=True).values[:, forced:]  # [heads, m − forced]
    total = heads * (b_prime - forced)
    counts = torch.zeros(heads, dtype=torch.long)
    if total > 0:
        winners = torch.sort(rest.reshape(-1), descending=True, stable=True).indices[:total] // rest.shape[1]
        counts = torch.bincount(winners.cpu(), minlength=heads)
    return counts + forced + window


# ---------------------------------------------------------------------------- dynamic layer budgets
def proportional_budgets(
    weights: Sequence[float] | torch.Tensor, total: int, bounds: Sequence[int]
) -> torch.Tensor:
    """Integers ``b_i ≤ bounds_i`` proportional to ``weights`` that sum exactly to ``min(total, Σ bounds)``.

    Water-filling: every item whose share ``w_i / Σ w · rest`` reaches its bound gets the bound, and
    the rest is shared again over the others in proportion to their weights, until no share exceeds
    its bound (CAKE's "capped, excess spread over the uncapped layers"). The free shares are then
    rounded by largest remainder (ties to the earlier item); a share below its bound rounds to at
    most the bound, so bounds always hold. Free items whose weights are all zero share equally.

    Args:
        weights: ``[k]`` non-negative (entropies, preferences, head shares).
        total: integer to distribute.
        bounds: ``[k]`` non-negative integer upper bounds (capacities, or budgets that may only shrink).
    Returns:
        ``[k]`` int64.
    """
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
    caps = torch.as_tensor(bounds, dtype=torch.long).reshape(-1)
    if w.numel() != caps.numel():
        raise ValueError(f"{w.numel()} weights for {caps.numel()} bounds")
    if bool((w < 0).any()) or bool(torch.isnan(w).any()) or bool((caps < 0).any()):
        raise ValueError("weights must be non-negative numbers and bounds non-negative integers")
    if total >= int(caps.sum()):
        return caps.clone()
    fixed = torch.zeros(w.numel(), dtype=torch.bool)
    rest = int(total)
    while True:
        free = (~fixed).nonzero().flatten()
        if free.numel() == 0:
            break
        wf = w[free]
        if float(wf.sum()) <= 0.0 or not bool(torch.isfinite(wf.sum())):
            wf = torch.ones_like(wf)
        shares = wf / wf.sum() * rest
        over = shares >= caps[free]
        if not bool(over.any()):
            break
        fixed[free[over]] = True
        rest -= int(caps[free[over]].sum())
    result = torch.where(fixed, caps, torch.zeros_like(caps))
    if free.numel():
        result[free] = torch.minimum(largest_remainder_round(shares, rest), caps[free])
    return result


def cascade_layer_budgets(
    weights: Sequence[float], total: int, previous: Sequence[int], capacity: int
) -> torch.Tensor:
    """One step of cascading layer budgets: layers ``0..l`` seen, layer ``l`` just prefilled.

    ``B_i ∝ weights_i`` over the layers seen so far against the **full** ``total``, each capped at
    ``capacity`` (the candidates a layer has) and at its ``previous`` budget (``len(previous) = l``):
    earlier layers were already evicted down to it, so budgets only shrink. The result sums to
    ``min(total, Σ bounds)`` — exactly ``total`` once it fits.
    """
    if len(weights) != len(previous) + 1:
        raise ValueError(f"{len(weights)} weights for {len(previous)} earlier layers + 1")
    bounds = [min(int(b), capacity) for b in previous] + [capacity]
    return proportional_budgets(weights, total, bounds)


def normalized_entropy(scores: torch.Tensor) -> float:
    """LAVa's layer uncertainty (Eq. 7–8): entropy of ``p = s / Σ s`` over all given scores, / ``log N``.

    ``scores``: one batch row's non-negative candidate scores of one layer (all heads, flattened or
    not; ``N = scores.numel()``). ``0·log 0 = 0``; ``N ≤ 1`` or an all-zero row gives 0. The paper
    divides by ``H × N`` (N tokens), the authors' code by ``log`` of the number of candidates — we
    follow the code. ``N`` is the same for every layer of a prompt, so the normaliser does not
    change the layer budgets (they are proportional to the entropies).
    """
    s = scores.double().reshape(-1)
    n = s.numel()
    total = float(s.sum())
    if n <= 1 or total <= 0.0:
        return 0.0
    p = s / total
    return float(-torch.special.xlogy(p, p).sum()) / math.log(n)


def cake_preference(probs: torch.Tensor, tau1: float, tau2: float) -> float:
    """CAKE's layer preference ``P = H^(1/τ1) · V^(1/τ2)`` of one batch row.

    Args:
        probs: ``[q_heads, w, m]`` window attention probabilities on the ``m`` candidate keys (the
            softmax ran over all keys, window keys included).
    ``H = −Σ A log(A + 1e-10)`` over heads, rows and columns (the dispersion of the attention);
    ``V = Σ_{heads, columns} var_rows(A)`` with the unbiased variance over the window rows (the
    shift of the attention). Computed in float64.
    """
    a = probs.double()
    entropy = float(-(a * torch.log(a + 1e-10)).sum())
    variance = float(a.var(dim=1, unbiased=True).sum()) if a.shape[1] > 1 else 0.0
    return max(entropy, 0.0) ** (1.0 / tau1) * max(variance, 0.0) ** (1.0 / tau2)


# ---------------------------------------------------------------------------- head split of a layer
def flattened_head_budgets(
    candidates: torch.Tensor, total: int, floor_alpha: float = 0.0, bounds: torch.Tensor | None = None
) -> torch.Tensor:
    """Split ``total`` candidate entries of one layer over its heads by one top-k over all heads.

    Args:
        candidates: ``[kv_heads, m]`` scores of one batch row; entries that are not candidates
            (protected window, invalid slots) are ``-inf``.
        total: candidate entries the layer keeps (window excluded).
        floor_alpha: share of the even split ``total / H`` every head is guaranteed (0 = the plain
            top-k, LAVa's Algorithm 1, and what every method passes; LAVa's authors'-code floor is
            :func:`kvbudget.methods.lava.floored_head_budgets`).
        bounds: ``[kv_heads]`` most entries a head may keep (default: its candidates).
    Returns:
        ``[kv_heads]`` int64 counts (window excluded) summing to ``min(total, Σ bounds)``. With
        ``floor_alpha = 0`` they are the heads' winners of the stable top-``total`` over the
        flattened scores (exact ties go to the earlier head, then the earlier slot); otherwise
        ``n_h(1 − α) + α·total/H`` rounded by :func:`proportional_budgets` within the bounds.
    """
    heads, m = candidates.shape
    finite = torch.isfinite(candidates)
    limit = finite.sum(-1) if bounds is None else torch.minimum(bounds.long().cpu(), finite.sum(-1).cpu())
    total = min(int(total), int(limit.sum()))
    if total <= 0:
        return torch.zeros(heads, dtype=torch.long)
    order = torch.sort(candidates.float().reshape(-1), descending=True, stable=True).indices[:total]
    counts = torch.bincount((order // m).cpu(), minlength=heads)
    if floor_alpha == 0.0 and bool((counts <= limit).all()):
        return counts
    shares = counts.double() * (1.0 - floor_alpha) + total / heads * floor_alpha
    return proportional_budgets(shares, total, limit)


def even_head_budgets(total: int, bounds: torch.Tensor) -> torch.Tensor:
    """``total`` split as evenly as possible over the heads (``total / H`` each, the remainder to the
    first heads), within ``bounds: [kv_heads]``; sums to ``min(total, Σ bounds)``."""
    bounds = bounds.long().cpu()
    return proportional_budgets(torch.ones(bounds.numel()), total, bounds)


# ---------------------------------------------------------------------------- D2O (variance) layer budgets
def attention_variance(column_sums: torch.Tensor, normalise: str = "minmax") -> float:
    """D2O's layer statistic ``σ_l`` (Eq. 4, A.9) from one batch row's prompt-attention column sums.

    Args:
        column_sums: ``[q_heads, n]`` attention each valid prompt key received, summed over all
            prompt queries (``c_h``).
        normalise: ``"minmax"`` — ``F_h = var(c_h)`` (unbiased), min-max normalised across the
            layer's heads, averaged (the authors' code; docs/methods.md, D2O); ``"raw"`` — the mean of
            ``F_h`` over the heads (Eq. 4 as printed, per head as in A.9).
    Returns:
        ``σ_l`` (float).
    """
    c = column_sums.double()
    f = c.var(dim=-1, unbiased=True) if c.shape[-1] > 1 else torch.zeros(c.shape[0], dtype=torch.float64)
    if normalise == "raw":
        return float(f.mean())
    if normalise != "minmax":
        raise ValueError(f"unknown variance normalisation '{normalise}': expected minmax or raw")
    spread = float(f.max() - f.min())
    if spread <= 0.0:
        return 0.0
    return float(((f - f.min()) / spread).mean())


def inverse_variance_layer_budgets(
    sigma: Sequence[float] | torch.Tensor, total: int, lower: int, upper: int
) -> torch.Tensor:
    """D2O's layer budgets (Eq. 5, A.2): ``S_l = softmax_l(−σ_l) · total``, within ``[lower, upper]``.

    ``total = layers · ρ · S`` (entries per head over all layers). Shares are integerised by
    largest remainder so they sum to exactly ``total``. When a share falls outside the bounds (the
    paper clamps to ``[0.01, 1]`` of the prompt), ``S_l = clamp(λ·exp(−σ_l), lower, upper)`` with the
    one ``λ`` that keeps the sum at ``total`` (found by bisection): bounded layers get their bound,
    the others stay proportional to ``exp(−σ_l)``.

    Args:
        sigma: ``[layers]`` variance statistics (:func:`attention_variance`).
        total: entries per head to distribute; lower, upper: integer bounds per layer.
    Returns:
        ``[layers]`` int64 summing to ``total`` (clipped to ``[layers·lower, layers·upper]``).
    """
    s = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
    if s.numel() == 0 or not bool(torch.isfinite(s).all()):
        raise ValueError("sigma must be a non-empty sequence of finite numbers")
    if lower > upper:
        raise ValueError(f"lower bound {lower} exceeds upper bound {upper}")
    k = s.numel()
    if total >= k * upper:
        return torch.full((k,), upper, dtype=torch.long)
    if total <= k * lower:
        return torch.full((k,), lower, dtype=torch.long)
    log_w = -(s - s.min())  # softmax is shift-invariant: log-weights ≤ 0, the largest is 0
    shares = torch.softmax(log_w, 0) * total
    if bool((shares < lower).any()) or bool((shares > upper).any()):
        # Σ clamp(exp(log λ + log w), lower, upper) grows with log λ: bisect it in log space, so
        # weights far below the float range (raw variances in the hundreds) simply sit at ``lower``
        lo, hi = math.log(max(lower, 1e-300)), math.log(upper) - float(log_w.min())
        for _ in range(200):
            mid = (lo + hi) / 2
            if float(torch.exp(mid + log_w).clamp(lower, upper).sum()) < total:
                lo = mid
            else:
                hi = mid
        shares = torch.exp(hi + log_w).clamp(lower, upper)
        shares = (shares * (total / float(shares.sum()))).clamp(lower, upper)  # the bisection's last 1e-12
    result = largest_remainder_round(shares, total)
    return result.clamp(lower, upper)


# ---------------------------------------------------------------------------- offline profiles
def kmeans_1d(values: Sequence[float], k: int = 3) -> list[int]:
    """Exact 1-D k-means: cluster labels ``0..k−1`` ordered by centre (0 = lowest centre).

    Clusters of 1-D data are contiguous runs of the sorted values, so every split of the sorted
    values into ``k`` non-empty runs is tried and the one with the least within-cluster sum of
    squares wins (the first such split on exact ties) — deterministic and globally optimal,
    unlike Lloyd's algorithm with random starts (what scikit-learn's ``KMeans`` runs). Fewer
    than ``k`` values give one cluster per value.
    """
    x = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    n = x.numel()
    order = torch.argsort(x, stable=True)
    s = x[order]
    k = min(k, n)
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), s.cumsum(0)])
    prefix2 = torch.cat([torch.zeros(1, dtype=torch.float64), (s * s).cumsum(0)])

    def sse(a: int, b: int) -> float:  # values s[a:b]
        total = float(prefix[b] - prefix[a])
        return float(prefix2[b] - prefix2[a]) - total * total / (b - a)

    best: tuple[float, tuple[int, ...]] | None = None

    def search(start: int, left: int, cuts: tuple[int, ...], cost: float) -> None:
        nonlocal best
        if left == 1:
            total = cost + sse(start, n)
            if best is None or total < best[0] - 1e-15:
                best = (total, cuts)
            return
        for cut in range(start + 1, n - left + 2):
            search(cut, left - 1, (*cuts, cut), cost + sse(start, cut))

    search(0, k, (), 0.0)
    labels = [0] * n
    bounds = [0, *best[1], n]
    for cluster in range(k):
        for i in range(bounds[cluster], bounds[cluster + 1]):
            labels[int(order[i])] = cluster
    return labels


def squeeze_layer_weights(similarity: Sequence[float], p: float) -> list[float]:
    """SqueezeAttention's layer split as relative budgets (mean 1 over the layers).

    The layers' similarities (cosine between a layer's residual input and input + attention
    output; high = the attention changes little) are clustered into 3 groups (exact 1-D
    k-means); the group with the highest centre keeps ``p`` of the uniform budget, the other
    layers share the rest equally: ``(n − n₃·p) / (n − n₃)``. Uniform when the similarities are
    all equal or fewer than 3 layers exist.
    """
    sims = [float(s) for s in similarity]
    n = len(sims)
    if n < 3 or max(sims) - min(sims) <= 1e-12:
        return [1.0] * n
    labels = kmeans_1d(sims, 3)
    top = [label == 2 for label in labels]
    n3 = sum(top)
    other = (n - n3 * p) / (n - n3)
    return [p if is_top else other for is_top in top]


def baklava_reallocate(importance: torch.Tensor, base: torch.Tensor, t: float, r: float) -> torch.Tensor:
    """BaKlaVa's Algorithm 2 over ``m`` KV caches (BaKlaVa calls it on one layer's ``kv_heads``).

    Args:
        importance: ``[m]`` KV-cache importance ``I = 1 − similarity``.
        base: ``[m]`` allocations before reallocation (equal within a layer), any positive scale.
        t: caches with ``I < t`` are "low importance".
        r: fraction of its allocation each low-importance cache gives up.
    Returns:
        ``[m]`` float64 allocations with the same sum: if ``0 < n < m`` caches are below ``t``
        (``n = 0`` or ``n = m``: unchanged), each gives up ``r`` of its allocation and the freed
        total goes in equal parts to the ``k = min(n, m − n)`` most important caches (ties to the
        earlier cache). With a uniform base ``b`` this is the paper's ``Δr = n·r·b/k`` per receiving
        cache; a non-uniform base gives each receiver the same share of the freed total.
    """
    imp = importance.double().reshape(-1)
    alloc = base.double().reshape(-1).clone()
    m = imp.numel()
    low = imp < t
    n = int(low.sum())
    if n == 0 or n > m - 1:
        return alloc
    freed = float((alloc[low] * r).sum())
    alloc[low] = alloc[low] * (1.0 - r)
    k = min(n, m - n)
    candidates = (~low).nonzero().flatten()
    ranked = candidates[torch.sort(imp[candidates], descending=True, stable=True).indices[:k]]
    alloc[ranked] += freed / k
    return alloc


def integer_budgets(shares: torch.Tensor, total: int, capacity: int, floor: int = 1) -> torch.Tensor:
    """Integer budgets ``≥ floor`` and ``≤ capacity``, proportional to ``shares: [m]``, summing to
    ``min(total, m·capacity)``: ``floor`` each, the rest by :func:`proportional_budgets`
    (water-filling at the capacity, largest-remainder rounding)."""
    m = shares.numel()
    floor = min(floor, capacity)
    if total >= m * capacity:
        return torch.full((m,), capacity, dtype=torch.long)
    rest = max(total - m * floor, 0)
    return proportional_budgets(shares.double(), rest, [capacity - floor] * m) + floor
