"""What KVgrad's backward pass adds to KVzip's reconstruction pass (issue #48), on random models.

    .venv/bin/python lab/scripts/kvgrad_cost.py

Prints, per model, prompt length and chunk, the best of a few ``kvbudget.compress`` times of the
full cache, kvzip, kvzip+ and kvgrad (budget 32), and kvgrad's time over kvzip's.
"""

import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvbudget
from kvbudget.methods.registry import make_method

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import seeded, tiny_model  # noqa: E402


def bench(model, n: int, chunk: int, repeats: int) -> None:
    ids = torch.randint(5, 90, (1, n), generator=seeded(3))
    best = {}
    for name in ("full", "kvzip", "kvzip+", "kvgrad"):
        method = make_method(name) if name == "full" else make_method(name, chunk=chunk)
        kvbudget.compress(model, ids, method=method, budget=32)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            kvbudget.compress(model, ids, method=method, budget=32)
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    shown = {k: round(v, 4) for k, v in best.items()}
    print(f"n={n} chunk={chunk} {shown} kvgrad/kvzip {best['kvgrad'] / best['kvzip']:.2f}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    bench(tiny_model("llama"), 300, 512, 5)
    bench(tiny_model("llama"), 300, 100, 5)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    mid = LlamaForCausalLM(config).eval()
    bench(mid, 1024, 512, 3)
    bench(mid, 2048, 2048, 2)
