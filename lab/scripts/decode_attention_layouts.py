"""One decode step's attention over one layer of qwen2.5-coder-0.5b's shape (2 KV heads × 64 channels,
14 query heads, bf16, 2 threads), laid out three ways, and the 4-bit layer read dequantized or fused
(lab/notes/decode-attention-cpu.md, docs/architecture.md "Decode attention").

    .venv/bin/python lab/scripts/decode_attention_layouts.py [--lengths 8192,32768]

Prints the median of 20 calls (ms) for: SDPA with ``enable_gqa`` over one-row queries per query
head; SDPA with each KV head's query group as the rows of one query; the 4-bit layer dequantized
into bf16 then the grouped SDPA; the fused read (kvbudget.quantized_read).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvbudget.quantized_read import fused_decode
from kvbudget.quantized_store import QuantizedHead


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def row(n: int, heads: int = 2, d: int = 64, q_heads: int = 14) -> list[float]:
    """The four timings (ms) at ``n`` entries a head."""
    keys = torch.randn(1, heads, n, d).bfloat16()
    values = torch.randn(1, heads, n, d).bfloat16()
    query = torch.randn(1, q_heads, 1, d).bfloat16()
    rows = query.view(1, heads, q_heads // heads, d)
    stored = [QuantizedHead.from_full(keys[:, h], values[:, h], 4) for h in range(heads)]

    def dequantized() -> torch.Tensor:
        k, v = torch.empty_like(keys), torch.empty_like(values)
        for h, head in enumerate(stored):
            head.dequantize(out=(k[:, h], v[:, h]))
        return F.scaled_dot_product_attention(rows, k, v)

    return [
        median_ms(lambda: F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)),
        median_ms(lambda: F.scaled_dot_product_attention(rows, keys, values)),
        median_ms(dequantized),
        median_ms(lambda: fused_decode(query, stored, d**-0.5)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="8192,32768")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print("| entries | enable_gqa | grouped | 4-bit dequantized + grouped | 4-bit fused |")
    print("|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        print(f"| {n} | " + " | ".join(f"{c:.2f}" for c in row(n)) + " |")


if __name__ == "__main__":
    main()
