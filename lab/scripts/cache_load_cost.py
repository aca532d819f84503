"""Loading a compressed document from disk against prefilling it again (issue: compress a document
once, answer many). qwen2.5-coder-0.5b (4-bit GGUF weights dequantized to bf16), an 8K-token
needle prompt, KVzip's question-agnostic compression at half the prompt, bf16 and 4-bit storage.

    .venv/bin/python lab/scripts/cache_load_cost.py [--length 8192]

Prints, per storage: prefill + compression seconds, the file's size, load seconds (median of 5).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kvbudget
from kvbudget.eval.tasks.needle import needle_sample


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--method", default="kvzip")
    args = parser.parse_args()
    model, tokenizer = kvbudget.load_model("qwen2.5-coder-0.5b", dtype="bfloat16")
    sample = needle_sample(tokenizer, length=args.length, depth=0.5, haystack="essays", seed=0)
    ids = torch.tensor([tokenizer(sample.context, add_special_tokens=False)["input_ids"]])
    print(f"{ids.shape[1]} tokens, {args.method} at ratio 0.5")
    print("| storage | prefill + compression s | file MiB | load s (median of 5, min-max) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for bits in (None, 4):
            start = time.perf_counter()
            cache = kvbudget.compress(model, ids, method=args.method, ratio=0.5, kv_bits=bits)
            made = time.perf_counter() - start
            path = kvbudget.save_cache(cache, Path(folder) / f"doc-{bits}.safetensors")
            del cache
            times = []
            for _ in range(5):
                start = time.perf_counter()
                kvbudget.load_cache(path, model)
                times.append(time.perf_counter() - start)
            size = path.stat().st_size / 2**20
            label = "bf16" if bits is None else f"{bits}-bit"
            print(
                f"| {label} | {made:.1f} | {size:.1f} | {statistics.median(times):.3f} "
                f"({min(times):.3f}-{max(times):.3f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
