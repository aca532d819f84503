"""Where a decode step's time goes: the weights' matrix-vector products, and per-step overhead.

    OMP_NUM_THREADS=2 .venv/bin/python lab/scripts/decode_step_parts.py --model smollm2-135m --length 2048

1. **Weights.** Every ``nn.Linear`` of the model (the tied LM head included), applied to one
   token's activations in turn, as one decode step applies them — at 1 and at 2 torch threads —
   against this machine's read bandwidth (``torch.sum`` over a 512 MiB tensor). The weights are
   read once per step whatever the cache holds, so this part is common to the full cache and a
   compressed one; the slower it runs, the closer their decode times come.
2. **Per-step overhead.** A random model with the same decoder shape as ``--model`` where it
   matters to the cache (layers, query/KV heads, head size) and a tiny hidden size, so the
   matrix products cost next to nothing: a decode step is then transformers' per-layer Python,
   the cache and attention. Decoding from ``--length`` tokens, medians of ``--rounds``
   alternating rounds of ``--steps`` steps: transformers' ``DynamicCache`` + sdpa (how kvpress
   decodes) over the whole prompt and over ``--budget`` entries per head, and kvbudget's cache +
   attention with ``full``, ``snapkv`` (rectangular layers) and ``ada-snapkv`` (per-head layers).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvbudget.attention import attached
from kvbudget.engine import Prompt, decode_loop, prefill
from kvbudget.eval.runner import MethodSpec
from kvbudget.models import load_model
from kvbudget.session import CompressionSession


def _seconds(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


@torch.inference_mode()
@torch.inference_mode()
def dynamic_steps(model, ids: torch.Tensor, steps: int) -> float:
    """Prefill ``ids: [1, n]`` into a DynamicCache (sdpa), then seconds per greedy decode forward
    over ``steps`` forwards."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for i in range(steps):
        pos = torch.tensor([[ids.shape[1] + i]])
        out = model(
            input_ids=token, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - start) / steps


@torch.inference_mode()
def budget_steps(model, prompt: Prompt, method: str, budget: int, steps: int) -> float:
    """Prefill with ``method`` (kvbudget attention), then seconds per step of the engine's decode
    loop over ``steps`` steps."""
    session = CompressionSession(
        MethodSpec.parse(method).build(), model.config.num_hidden_layers, budget=budget
    )
    with attached(model):
        cache, logits, mask, last = prefill(model, [prompt], session, 0)
        decoded = decode_loop(model, cache, logits, mask, last, set(), steps + 1, trace=False)
    return decoded.seconds / decoded.steps


@torch.inference_mode()
def weight_products(model) -> list[tuple[int, float, float]]:
    """Per thread count: (threads, seconds for every linear layer on one token, weight bytes / s)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, 1, m.in_features, dtype=m.weight.dtype) for m in linears]
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        seconds = _seconds(lambda: [m(x) for m, x in zip(linears, inputs, strict=True)], 10)
        out.append((threads, seconds, size / seconds))
    return out


def read_bandwidth() -> float:
    big = torch.ones(128 << 20)  # 512 MiB
    return big.numel() * 4 / _seconds(big.sum, 5)


def shape_twin(config) -> LlamaForCausalLM:
    """A random Llama with ``config``'s layers, heads and head size, hidden size = query heads × 8."""
    heads = config.num_attention_heads
    twin = LlamaConfig(
        vocab_size=512, hidden_size=8 * heads, intermediate_size=16 * heads,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        max_position_embeddings=1 << 16,
    )  # fmt: skip
    twin._attn_implementation = "sdpa"
    return LlamaForCausalLM(twin).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    threads = torch.get_num_threads()

    model, _ = load_model(args.model, dtype="float32")
    read = read_bandwidth()
    print(f"read bandwidth ({threads} threads): {read / 1e9:.1f} GB/s")
    for n, seconds, rate in weight_products(model):
        print(f"weights, one token through every linear layer, {n} thread(s): {1000 * seconds:.1f} ms "
              f"({rate / 1e9:.1f} GB/s, {rate / read:.2f} × read bandwidth)")  # fmt: skip
    torch.set_num_threads(threads)

    twin = shape_twin(model.config)
    del model
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, twin.config.vocab_size, (1, args.length), generator=generator)
    n, b, steps = args.length, args.budget, args.steps
    prompt = Prompt(ids[0].tolist(), [])
    configs = {  # a DynamicCache of the last b tokens decodes from position b: RoPE positions cost nothing
        f"DynamicCache + sdpa, {n} tokens": lambda: dynamic_steps(twin, ids, steps),
        f"DynamicCache + sdpa, last {b}": lambda: dynamic_steps(twin, ids[:, -b:], steps),
        "kvbudget full": lambda: budget_steps(twin, prompt, "full", n, steps),
        f"kvbudget snapkv @{b}": lambda: budget_steps(twin, prompt, "snapkv", b, steps),
        f"kvbudget ada-snapkv @{b}": lambda: budget_steps(twin, prompt, "ada-snapkv", b, steps),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, run in configs.items():
            times[name].append(run())
    print(f"per-step overhead, {twin.config.num_hidden_layers}-layer shape twin of {args.model} "
          f"(medians of {args.rounds} rounds × {args.steps} steps, min–max):")  # fmt: skip
    for name, values in times.items():
        print(f"  {name}: {1000 * statistics.median(values):.2f} ms "
              f"({1000 * min(values):.2f}–{1000 * max(values):.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
