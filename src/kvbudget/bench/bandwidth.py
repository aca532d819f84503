"""The memory-bandwidth lower bound on decode time.

Decoding one token reads every weight once and every cached key/value once, so no
implementation can take less than ``(weight bytes + KV bytes) / bandwidth`` per token on a
machine whose memory moves ``bandwidth`` bytes per second. :func:`measure_bandwidth` measures
that rate once with a large tensor copy (each copied byte is read once and written once, so the
traffic is twice the tensor's size), on the torch threads the benchmark itself uses.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel


@dataclass
class Bandwidth:
    """Measured memory bandwidth, bytes per second.

    Attributes:
        copy: ``2 · size / time`` of ``dst.copy_(src)`` (read + write traffic), best of ``repeats``.
        read: ``size / time`` of ``src.sum()`` (read only), best of ``repeats``.
        size_bytes: tensor size used; threads: ``torch.get_num_threads()`` during the measurement.
    """

    copy: float
    read: float
    size_bytes: int
    threads: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def measure_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu") -> Bandwidth:
    """Copy (and sum) a ``size_bytes`` float32 tensor ``repeats`` times; keep the fastest run.

    The tensor must be much larger than the last-level cache (1 GiB by default) or the figure
    measures the cache, not memory. ``device``: where the tensor lives (a GPU's memory for a
    benchmark on that GPU; each timing then ends with a synchronize).
    """
    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    n = max(1, size_bytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page once before timing
    sync()
    best_copy = best_read = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best_copy = min(best_copy, time.perf_counter() - start)
        start = time.perf_counter()
        float(src.sum())
        best_read = min(best_read, time.perf_counter() - start)
    size = n * 4
    return Bandwidth(2 * size / best_copy, size / best_read, size, torch.get_num_threads())


def weight_bytes(model: PreTrainedModel) -> int:
    """Bytes of the model's parameters, each shared tensor (tied embeddings) counted once.

    A decode step reads all of them once: every matrix multiplies the new token's hidden state,
    and a tied embedding is read in full as the LM head.
    """
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def decode_bound_s(weights: int, kv_bytes: int, bandwidth: float) -> float:
    """Lower bound on seconds per decoded token: every weight and KV byte read once."""
    return (weights + kv_bytes) / bandwidth
