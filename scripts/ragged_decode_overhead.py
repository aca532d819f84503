"""Per-layer cost of one decode step: rectangular vs per-head (ragged) layout, one thread.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/ragged_decode_overhead.py

A layer of 3 KV heads (head_dim 64) is filled with 1000 tokens and compressed to 256 entries per
head (rectangular) or 300/180/288 (per head, the same 768 in all); then ``BudgetLayer.update`` of
one token and ``attend_layer`` of 9 query heads are timed (mean µs per call).
"""

from __future__ import annotations

import time

import torch

from kvbudget.attention import attend_layer
from kvbudget.cache import BudgetLayer


def compressed_layer(counts: tuple[int, int, int]) -> BudgetLayer:
    layer = BudgetLayer()
    layer.update(torch.randn(1, 3, 1000, 64), torch.randn(1, 3, 1000, 64))
    layer.keep([[torch.arange(c) for c in counts]])
    return layer


def main() -> None:
    torch.set_num_threads(1)
    k, v, q = torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64), torch.randn(1, 9, 1, 64)
    for name, counts in (("rectangular", (256, 256, 256)), ("per-head", (300, 180, 288))):
        layers = [compressed_layer(counts) for _ in range(40)]
        for layer in layers:  # the first two appends after a compression allocate the room
            layer.update(k, v)
            layer.update(k, v)
        start = time.perf_counter()
        for layer in layers:
            for _ in range(25):
                layer.update(k, v)
        update_us = (time.perf_counter() - start) / 1000 * 1e6
        start = time.perf_counter()
        for _ in range(1000):
            attend_layer(q, layers[0], 0.125)
        attend_us = (time.perf_counter() - start) / 1000 * 1e6
        print(f"{name}: update {update_us:.1f} µs, attention {attend_us:.1f} µs per layer")


if __name__ == "__main__":
    main()
