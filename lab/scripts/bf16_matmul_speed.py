"""A bf16 prefill with PyTorch's own bf16 matrix multiply against kvbudget's fp32 path (README, Models).

    .venv/bin/python lab/scripts/bf16_matmul_speed.py [--model qwen2.5-coder-0.5b] [--tokens 2094]

First times one bf16 linear layer's product (qwen2.5-coder-0.5b's MLP, ``[rows, 896] × [896, 4864]``) at
1, 32 and 2,094 rows through PyTorch's kernel and through fp32 (the figures behind
``kvbudget.cpu_matmul.MIN_ROWS``). Then loads the model twice in bf16 (``bf16_matmul="fp32"`` and
``"native"``), times one forward of the same
random token ids through each (the last position's logits only), and prints the seconds, the largest
logit difference and whether the next token agrees. Reads nothing else, writes nothing. On a CPU
with a native bf16 GEMM both paths take about the same time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import kvbudget
from kvbudget.cpu_matmul import native_bf16_matmul


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=2094)
    args = parser.parse_args()
    ids = torch.randint(100, 20000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 GEMM: {native_bf16_matmul()}"
    )
    weight = torch.randn(4864, 896).bfloat16()
    for rows in (1, 32, 2094):
        x = torch.randn(rows, 896).bfloat16()
        times = {}
        for name, fn in (
            ("native", lambda x=x: F.linear(x, weight)),
            ("fp32", lambda x=x: F.linear(x.float(), weight.float()).bfloat16()),
        ):
            fn()
            started = time.perf_counter()
            for _ in range(5):
                fn()
            times[name] = (time.perf_counter() - started) / 5 * 1000
        print(f"linear at {rows} rows: native {times['native']:.1f} ms, through fp32 {times['fp32']:.1f} ms")
    logits = {}
    for mode in ("fp32", "native"):
        model, _ = kvbudget.load_model(args.model, dtype="bfloat16", bf16_matmul=mode)
        with torch.no_grad():
            started = time.perf_counter()
            logits[mode] = model(ids, logits_to_keep=1).logits.float()
            print(f"{mode:>6}: {time.perf_counter() - started:.1f} s for {args.tokens} tokens")
        del model
    diff = (logits["fp32"] - logits["native"]).abs().max().item()
    same = torch.equal(logits["fp32"].argmax(-1), logits["native"].argmax(-1))
    print(f"largest logit difference {diff:.3f}; next token the same: {same}")


if __name__ == "__main__":
    main()
