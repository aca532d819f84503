"""KVzip+'s cost against KVzip's, timed directly: ``kvbudget.compress`` (prefill and reconstruction
passes) on one random 2,094-token prompt of qwen2.5-coder-0.5b at r = 0.5, each method twice in turn.

    .venv/bin/python lab/scripts/kvzip_plus_cost.py
"""

from __future__ import annotations

import time

import torch

import kvbudget


def main() -> None:
    torch.manual_seed(0)
    model, _ = kvbudget.load_model("qwen2.5-coder-0.5b", dtype="bfloat16")
    ids = torch.randint(100, 20000, (1, 2094))
    seconds: dict[str, list[float]] = {}
    for _ in range(2):
        for method in ("kvzip", "kvzip+"):
            start = time.perf_counter()
            kvbudget.compress(model, ids, method=method, ratio=0.5)
            seconds.setdefault(method, []).append(time.perf_counter() - start)
    for method, values in seconds.items():
        print(f"{method}: " + " / ".join(f"{s:.1f} s" for s in values))


if __name__ == "__main__":
    main()
