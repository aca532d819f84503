"""TPOT of decoding over a cache of N entries a head, bf16 against quantized storage, without the
prefill: the cache is filled with random keys and values (a decode step's time does not depend on
them), so 32K tokens cost seconds to set up instead of minutes of prefill.

    .venv/bin/python lab/scripts/tpot_synthetic.py --lengths 8192,32768 --bits 16,4 --steps 32 --repeats 3

Per (length, bits): the median decode step over ``steps`` greedy steps after 4 warm-up steps, the
repeats alternating precisions so drift hits both; printed as a markdown table with the ratio to
bf16 at the same length. qwen2.5-coder-0.5b (4-bit GGUF weights dequantized to bf16), 2 threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvbudget.attention import attach
from kvbudget.cache import BudgetCache
from kvbudget.models import load_model


def filled_cache(model, length: int, bits: int) -> BudgetCache:
    config = model.config
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    cache = BudgetCache(config.num_hidden_layers)
    cache.attention_attached = True
    for i in range(config.num_hidden_layers):
        k = torch.randn(1, heads, length, dim, generator=g).to(model.dtype)
        v = torch.randn(1, heads, length, dim, generator=g).to(model.dtype)
        cache.update(k, v, i)
    if bits != 16:
        cache.quantize(bits)
    return cache


@torch.inference_mode()
def step_times(model, cache: BudgetCache, length: int, steps: int) -> list[float]:
    token = torch.tensor([[17]])
    times = []
    for s in range(steps + 4):
        start = time.perf_counter()
        out = model(input_ids=token, position_ids=torch.tensor([[length + s]]), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)  # fmt: skip
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if s >= 4:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--bits", default="16,4")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, _ = load_model(args.model, dtype="bfloat16")
    attach(model)
    lengths = [int(x) for x in args.lengths.split(",")]
    bits = [int(x) for x in args.bits.split(",")]
    medians: dict[tuple[int, int], list[float]] = {(n, b): [] for n in lengths for b in bits}
    kv: dict[tuple[int, int], int] = {}
    for n in lengths:
        for r in range(args.repeats):
            for b in bits if r % 2 == 0 else bits[::-1]:
                cache = filled_cache(model, n, b)
                kv[(n, b)] = cache.physical_bytes()
                medians[(n, b)].append(statistics.median(step_times(model, cache, n, args.steps)))
                del cache
    print("| tokens | storage | TPOT ms (median of repeats; min–max) | × bf16 | KV MiB |")
    print("|---:|---|---:|---:|---:|")
    for n in lengths:
        base = statistics.median(medians[(n, 16)]) if (n, 16) in medians else None
        for b in bits:
            m = medians[(n, b)]
            ratio = f"{statistics.median(m) / base:.2f}" if base else "—"
            name = "bf16" if b == 16 else f"{b}-bit"
            spread = f"({1000 * min(m):.1f}–{1000 * max(m):.1f})"
            mib = kv[(n, b)] / 2**20
            print(f"| {n} | {name} | {1000 * statistics.median(m):.1f} {spread} | {ratio} | {mib:.1f} |")


if __name__ == "__main__":
    main()
