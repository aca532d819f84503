"""TPOT of decoding over a cache of N entries a head, bf16 against quantized storage, without the
prefill: the cache is filled with random keys and values (a decode step's time does not depend on
them), so 32K tokens cost seconds to set up instead of minutes of prefill.

    .venv/bin/python lab/scripts/tpot_synthetic.py --lengths 8192,32768 --bits 16,4 --steps 32 --repeats 3
    .venv/bin/python lab/scripts/tpot_synthetic.py --lengths 8192,32768 --equal-bytes 0.125

Per (length, bits): the median decode step over ``steps`` greedy steps after 4 warm-up steps, the
repeats alternating precisions so drift hits both; printed as a markdown table with the ratio to
bf16 at the same length. qwen2.5-coder-0.5b (4-bit GGUF weights dequantized to bf16), 2 threads.

``--equal-bytes M`` compares two caches of a prompt of each length at the same bytes instead:
eviction alone keeping a share ``M`` of its entries in bf16, against the byte budget ``memory=M``
(about 2.5 times the entries, a quarter of them at 8 bits and the rest at 4, as
``kvbudget.byte_budget`` stores them; the latest entries at 8 bits, as without a method's ranks).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvbudget.attention import attach
from kvbudget.byte_budget import apply_byte_budget, method_budget
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


def equal_bytes_cache(model, length: int, memory: float | None, share: float) -> BudgetCache:
    """A prompt of ``length`` tokens compressed to the same bytes two ways: its latest ``share`` of
    entries kept in bf16 (``memory`` None), or under the byte budget ``memory`` as the engine stores
    it (the entries ``method_budget`` gives a method, then two precisions meeting the bytes)."""
    if memory is not None:
        config = model.config
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        cache = filled_cache(model, method_budget(memory, length, dim, model.dtype.itemsize), 16)
        apply_byte_budget(cache, memory, prompt_tokens=length)
        return cache
    cache = filled_cache(model, length, 16)
    kept = torch.arange(length - max(1, round(share * length)), length)
    for layer in cache.layers:
        layer.keep([[kept] * layer.num_heads])
    return cache


def equal_bytes(model, lengths: list[int], memory: float, steps: int, repeats: int) -> None:
    configs = {"evict": None, "memory": memory}
    medians: dict[tuple[int, str], list[float]] = {(n, c): [] for n in lengths for c in configs}
    kv: dict[tuple[int, str], tuple[int, int]] = {}
    for n in lengths:
        for r in range(repeats):
            for c in list(configs) if r % 2 == 0 else list(configs)[::-1]:
                cache = equal_bytes_cache(model, n, configs[c], memory)
                kv[(n, c)] = (cache.physical_bytes(), int(cache.layers[0].head_lengths()[0].sum()))
                medians[(n, c)].append(statistics.median(step_times(model, cache, n, steps)))
                del cache
    print("| prompt tokens | cache | entries a layer | KV MiB | TPOT ms (median; min–max) | × eviction |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in lengths:
        base = statistics.median(medians[(n, "evict")])
        for c, name in (
            ("evict", f"eviction, {memory:g} of the entries in bf16"),
            ("memory", f"memory={memory:g}"),
        ):
            m = medians[(n, c)]
            spread = f"({1000 * min(m):.1f}–{1000 * max(m):.1f})"
            nbytes, entries = kv[(n, c)]
            tpot, ratio = f"{1000 * statistics.median(m):.1f} {spread}", statistics.median(m) / base
            print(f"| {n} | {name} | {entries} | {nbytes / 2**20:.1f} | {tpot} | {ratio:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--bits", default="16,4")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--equal-bytes", type=float, default=None, metavar="M", help="eviction keeping M against memory=M"
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, _ = load_model(args.model, dtype="bfloat16")
    attach(model)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.equal_bytes is not None:
        equal_bytes(model, lengths, args.equal_bytes, args.steps, args.repeats)
        return
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
