"""Issue #48: lagkv vs kvpress's LagKVPress on question-agnostic needle prompts (2K, 8 depths).

Usage: .venv/bin/python lab/scripts/lagkv_gap.py OUT SEED METHOD[,METHOD...] [--peer PRESS,...]
Our methods run through the leaderboard's Runner (shared prefill, compress_context_only, bf16);
kvpress's through run_peer_rows (same samples, same split, same ratios). Rows accumulate in
OUT/results.jsonl (a rerun skips finished rows); the table counts needles found.
"""

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from kvbudget.eval import peer_rows
from kvbudget.eval.runner import EvalConfig, Runner

out, seed, methods = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(";")
peers = sys.argv[5].split(",") if len(sys.argv) > 5 and sys.argv[4] == "--peer" else []
# extra kvpress settings under variant names
peer_rows.PRESSES["lagkv@sink16"] = {"press": "LagKVPress", "kwargs": {"n_sink": 16}}
config = EvalConfig(
    model="qwen2.5-coder-0.5b",
    tasks=["needle"],
    lengths=[2048],
    methods=[m for m in methods if m],
    budgets=[],
    compression_ratios=[0.75, 0.875],
    limit=8,
    seed=seed,
    compress_context_only=True,
    dtype="bfloat16",
)
start = time.time()
runner = Runner(config, out, progress=False)
if config.methods:
    runner.run()
print(f"ours done {time.time() - start:.0f}s", flush=True)
if peers:
    peer_rows.run_peer_rows(
        config, out, peers, progress=False, model=runner.model, tokenizer=runner.tokenizer
    )
    print(f"peer done {time.time() - start:.0f}s", flush=True)

found = defaultdict(lambda: defaultdict(list))
for line in (out / "results.jsonl").read_text().splitlines():
    row = json.loads(line)
    if "error" in row and row["error"]:
        print("ERROR", row.get("label"), row["error"])
        continue
    label = row.get("label") or row["method"]
    found[label][row.get("compression_ratio")].append((row.get("sample"), row.get("score")))
for label, by_ratio in sorted(found.items()):
    cells = []
    for ratio, hits in sorted(by_ratio.items(), key=lambda kv: str(kv[0])):
        hits = sorted(hits, key=lambda h: h[0] if h[0] is not None else -1)
        cells.append(
            f"r={ratio}: {sum(s or 0 for _, s in hits):.0f}/{len(hits)} "
            + "".join("x" if s else "." for _, s in hits)
        )
    print(f"{label:40s} " + "  ".join(cells))
