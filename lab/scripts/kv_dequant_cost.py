"""What decoding from a 4-bit KIVI cache would cost if every step dequantized it (lab/notes/byte-budget.md).

    .venv/bin/python lab/scripts/kv_dequant_cost.py

One KV head of qwen2.5-coder-0.5b's shape (head_dim 64, 7 query heads a KV head), bf16, 2 threads:
``Quantized.dequantize`` of keys and values against one decode step's SDPA over the same entries,
at 8K and 32K; then unpacking 8,192 × 32 packed bytes to bf16 codes by shifts and by a table, and a
per-group ``bmm`` of codes with scaled queries. Random data; run it on an otherwise idle machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvbudget.quantization import quantize_keys, quantize_values


def median_ms(fn: Callable[[], object], runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    torch.set_num_threads(2)
    for n in (8192, 32768):
        k, v = torch.randn(1, n, 64, dtype=torch.bfloat16), torch.randn(1, n, 64, dtype=torch.bfloat16)
        qk, qv = quantize_keys(k, 4, 32), quantize_values(v, 4, 32)
        dequant = median_ms(lambda qk=qk, qv=qv: (qk.dequantize(), qv.dequantize()))
        q = torch.randn(1, 7, 1, 64, dtype=torch.bfloat16)
        kk, vv = k[:, None].expand(1, 7, n, 64), v[:, None].expand(1, 7, n, 64)
        sdpa = median_ms(
            lambda q=q, kk=kk, vv=vv: torch.nn.functional.scaled_dot_product_attention(q, kk, vv)
        )
        print(f"n={n}: dequantize k+v {dequant:.2f} ms, SDPA {sdpa:.2f} ms a KV head; "
              f"x48 heads·layers: {48 * dequant:.0f} vs {48 * sdpa:.0f} ms a step")  # fmt: skip
    n = 8192
    packed = torch.randint(0, 256, (n, 32), dtype=torch.uint8)
    table = torch.stack([torch.arange(256) & 15, torch.arange(256) >> 4], -1).to(torch.bfloat16)
    shifts = median_ms(lambda: torch.stack([packed & 15, packed >> 4], -1).reshape(n, 64).to(torch.bfloat16))
    lookup = median_ms(lambda: table.index_select(0, packed.reshape(-1).to(torch.int32)).reshape(n, 64))
    codes = table.index_select(0, packed.reshape(-1).to(torch.int32)).reshape(n // 32, 32, 64)
    scaled = torch.randn(n // 32, 64, 7, dtype=torch.bfloat16)
    bmm = median_ms(lambda: torch.bmm(codes, scaled))
    print(f"unpack 8192x32 bytes: shifts {shifts:.2f} ms, table {lookup:.2f} ms; per-group bmm {bmm:.2f} ms")


if __name__ == "__main__":
    main()
