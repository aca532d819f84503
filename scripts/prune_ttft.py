"""TTFT of prune-stage methods relative to the full prefill, on the real model (median of runs).

    OMP_NUM_THREADS=2 PYTHONPATH=src .venv/bin/python scripts/prune_ttft.py \\
        [--model smollm2-135m] [--lengths 4096 8000] [--budget 256] [--runs 3] [--dtype float32]

Each run generates one token from an essay needle prompt of the given length (a fresh cache per
run); TTFT = prefill (with pruning/compression) + choosing the first token. Methods run in turns
(full, snapkv, asl, ... then again), so slow phases of a shared machine hit every method alike.
Prints a markdown table: TTFT seconds, ratio to full, and the selection layer.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import kvbudget
from kvbudget.eval.tasks.needle import needle_sample

METHODS = ["full", "snapkv", "asl", "fastkv", "gemfilter", "asl-2pass"]


def ttft(model, tokenizer, sample, method: str, budget: int) -> tuple[float, int | None]:
    result = kvbudget.generate(
        model, tokenizer, sample.context, sample.question, sample.answer_prefix,
        method=method, budget=None if method == "full" else budget, max_new_tokens=1,
    )  # fmt: skip
    return result.ttft_s, result.selection_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8000])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model, tokenizer = kvbudget.load_model(args.model, dtype=args.dtype)
    print(f"model {args.model} ({args.dtype}), budget {args.budget}, median of {args.runs} runs, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    header = "| method | " + " | ".join(f"{n} TTFT s | ratio | layer" for n in args.lengths) + " |"
    print(header)
    print("|---|" + "---|---|---|" * len(args.lengths))
    table: dict[str, list[str]] = {m: [] for m in args.methods}
    for length in args.lengths:
        sample = needle_sample(tokenizer, length=length, depth=0.5, haystack="essays", seed=1)
        ttft(model, tokenizer, sample, "full", args.budget)  # warm-up
        times: dict[str, list[float]] = {m: [] for m in args.methods}
        layers: dict[str, int | None] = {}
        for _ in range(args.runs):
            for method in args.methods:
                seconds, layer = ttft(model, tokenizer, sample, method, args.budget)
                print(f"  {length} {method}: {seconds:.2f} s, layer {layer}", file=sys.stderr, flush=True)
                times[method].append(seconds)
                layers[method] = layer
        full = statistics.median(times["full"]) if "full" in times else float("nan")
        for method in args.methods:
            median = statistics.median(times[method])
            layer = "-" if layers[method] is None else str(layers[method])
            table[method].append(f"{median:.2f} | {median / full:.2f} | {layer}")
    for method in args.methods:
        print(f"| {method} | " + " | ".join(table[method]) + " |")


if __name__ == "__main__":
    main()
