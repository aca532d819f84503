"""Wall time of one decode step: transformers' DynamicCache + sdpa vs kvbudget's cache and attention.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/decode_step_overhead.py --length 2048 --budget 256

What kvpress decodes with (a ``DynamicCache`` holding the kept entries, sdpa attention) is the
reference for our decode path. For the full cache (``length`` tokens) and for a compressed one
(``budget`` entries per head: a rectangular SnapKV cache and a per-head Ada-SnapKV cache), the
script prefills the same needle prompt, then times ``--steps`` single-token forwards of the
model (``logits_to_keep=1``, greedy) in each configuration, alternating configurations over
``--rounds`` rounds; it prints the median milliseconds per step of each. The DynamicCache for
the compressed case holds the first ``budget`` prompt tokens per head (the same shape kvpress's
SnapKVPress leaves; which entries are kept does not change the time). A last configuration
decodes identical content both ways: our SnapKV cache, copied into a ``DynamicCache`` and decoded
with sdpa (kvbudget's attention detached), against the same cache decoded by kvbudget.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from kvbudget.attention import attached
from kvbudget.bench.measure import fit_prompt
from kvbudget.engine import decode_loop, prefill
from kvbudget.eval.runner import MethodSpec
from kvbudget.models import load_model
from kvbudget.session import CompressionSession


def _timed_steps(model, cache: DynamicCache, token: torch.Tensor, position: int, steps: int) -> float:
    """Seconds per greedy decode forward (sdpa) from ``token: [1, 1]`` at ``position``."""
    start = time.perf_counter()
    for i in range(steps):
        pos = torch.tensor([[position + i]])
        out = model(
            input_ids=token, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - start) / steps


@torch.inference_mode()
def dynamic_steps(model, ids: torch.Tensor, steps: int) -> float:
    """Prefill ``ids: [1, n]`` into a DynamicCache (sdpa), then time ``steps`` decode forwards."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return _timed_steps(model, cache, out.logits[:, -1].argmax(-1, keepdim=True), ids.shape[1], steps)


@torch.inference_mode()
def budget_steps(model, prompt, method: str, budget: int, steps: int, as_dynamic: bool = False) -> float:
    """Prefill with ``method`` (kvbudget attention), then time ``steps`` decode forwards — of the
    engine's decode loop, or (``as_dynamic``) of the same entries copied into a DynamicCache."""
    spec = MethodSpec.parse(method)
    session = CompressionSession(spec.build(), model.config.num_hidden_layers, budget=budget)
    with attached(model):
        cache, logits, mask, last = prefill(model, [prompt], session, 0)
        if not as_dynamic:
            decoded = decode_loop(model, cache, logits, mask, last, set(), steps + 1, trace=False)
            return decoded.seconds / decoded.steps
    copy = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):  # rectangular layers (SnapKV)
        copy.update(layer.keys.contiguous(), layer.values.contiguous(), i)
    return _timed_steps(model, copy, logits.argmax(-1, keepdim=True), int(last) + 1, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype="float32")
    model.set_attn_implementation("sdpa")
    prompt = fit_prompt(tokenizer, "needle", args.length)
    ids = torch.tensor([prompt.ids])
    snap = "snapkv:window=64,kernel=5,pooling=avg,reduce_rows=mean"
    configs = {
        f"DynamicCache full ({ids.shape[1]})": lambda: dynamic_steps(model, ids, args.steps),
        "kvbudget full": lambda: budget_steps(model, prompt, "full", args.budget, args.steps),
        f"DynamicCache {args.budget}": lambda: dynamic_steps(model, ids[:, : args.budget], args.steps),
        f"kvbudget snapkv {args.budget}": lambda: budget_steps(model, prompt, snap, args.budget, args.steps),
        f"kvbudget ada-snapkv {args.budget}": lambda: budget_steps(
            model, prompt, snap.replace("snapkv", "ada-snapkv", 1), args.budget, args.steps
        ),
        f"snapkv {args.budget} as DynamicCache": lambda: budget_steps(
            model, prompt, snap, args.budget, args.steps, as_dynamic=True
        ),
    }
    for run in configs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, run in configs.items():
            times[name].append(run())
    for name, ts in times.items():
        spread = f"min {min(ts) * 1e3:.2f}, max {max(ts) * 1e3:.2f}"
        print(f"{name:32s} {statistics.median(ts) * 1e3:7.2f} ms/step ({spread})")


if __name__ == "__main__":
    main()
