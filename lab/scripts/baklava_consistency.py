"""Do head-importance ranks agree between profiling prompts? (BaKlaVa §3.1.2, Fig. 2)

Reads a profile with two or more prompts (``kvbudget profile --prompts A --prompts B --out P``)
and prints Spearman rank correlations between the first two prompts' per-prompt values: over all
KV caches (importance), all query heads, the layers' SqueezeAttention similarity, and the mean of
the within-layer correlations over KV caches. Also the overlap of the 10 most / least important caches.

    PYTHONPATH=src python lab/scripts/baklava_consistency.py /tmp/baklava/smollm2.json
"""

from __future__ import annotations

import sys

import torch

from kvbudget.profiles import kv_importance, load_profile


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share their mean rank), 1-based."""
    x = x.double().reshape(-1)
    order = torch.argsort(x, stable=True)
    r = torch.empty_like(x)
    r[order] = torch.arange(1, x.numel() + 1, dtype=torch.float64)
    for value in torch.unique(x):
        tied = x == value
        if int(tied.sum()) > 1:
            r[tied] = r[tied].mean()
    return r


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main(path: str) -> None:
    profile = load_profile(path)
    first, second = profile.per_prompt[:2]
    hk = profile.num_kv_heads
    heads_a = torch.tensor(first["head_similarity"], dtype=torch.float64)
    heads_b = torch.tensor(second["head_similarity"], dtype=torch.float64)
    imp_a, imp_b = kv_importance(heads_a, hk), kv_importance(heads_b, hk)
    within = [spearman(imp_a[i], imp_b[i]) for i in range(imp_a.shape[0]) if hk > 2]
    top = lambda x, k, hi: set(torch.argsort(x.reshape(-1), descending=hi)[:k].tolist())  # noqa: E731
    print(f"prompts: {first['name']} vs {second['name']}")
    print(f"spearman KV-cache importance ({imp_a.numel()} caches): {spearman(imp_a, imp_b):.3f}")
    print(f"spearman query-head similarity ({heads_a.numel()} heads): {spearman(heads_a, heads_b):.3f}")
    layer_a = torch.tensor(first["layer_similarity"])
    layer_b = torch.tensor(second["layer_similarity"])
    print(f"spearman layer similarity ({layer_a.numel()} layers): {spearman(layer_a, layer_b):.3f}")
    if within:
        print(f"mean within-layer spearman over KV caches: {sum(within) / len(within):.3f}")
    print(f"top-10 most important caches shared: {len(top(imp_a, 10, True) & top(imp_b, 10, True))}/10")
    print(f"top-10 least important caches shared: {len(top(imp_a, 10, False) & top(imp_b, 10, False))}/10")


if __name__ == "__main__":
    main(sys.argv[1])
