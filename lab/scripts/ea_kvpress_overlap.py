"""Where kvbudget's and kvpress's Expected Attention part: the positions each keeps, per layer and KV head.

    .venv/bin/python lab/scripts/ea_kvpress_overlap.py [--tasks vt,lcc] [--samples 10] [--ratio 0.875]
        [--dtype bfloat16] [--out lab/results/ea-kvpress/overlap-bfloat16.md]

On the leaderboard's own prompts (qwen2.5-coder-0.5b in bf16, 2,048 tokens; context and question
together, as the question-aware track compresses them) it prefills each prompt once with kvbudget's
``expected-attention`` and once with kvpress's ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``
(kvpress's own process, ``make peer``), in three pairings:

- ``leaderboard``: both defaults, as the leaderboard ran them — ours ``floor_alpha=0.2`` with AdaKV's
  ``cap_h = n_h(1 − α) + α·B'``, kvpress's ``alpha_safeguard=0.2`` (each head's own top ``int(0.2·B)``
  first);
- ``floor=kvpress``: ours with kvpress's floor against kvpress's default;
- ``floor 0``: ``floor_alpha=0`` against ``alpha_safeguard=0`` — both one top-k over the layer's heads.

``tests/test_kvpress_oracle.py`` finds the last two identical, head by head, on a tiny float32 model.

It prints, per task and pair, the share of kept positions the two have in common (summed over layers
and heads, over the samples) and the share of (layer, head) pairs whose kept sets are identical.
``KVBUDGET_LOCK`` (a file) is held throughout, so a leaderboard run on the machine waits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch

import kvbudget
from kvbudget.artifacts import file_lock
from kvbudget.bench.peer import runner_script
from kvbudget.eval.peer_rows import eval_tasks_only, export_sample, peer_python
from kvbudget.eval.runner import EvalConfig, Runner, ratio_budget
from kvbudget.methods.registry import make_method
from kvbudget.models import resolve_source

MODEL = "qwen2.5-coder-0.5b"
#: pairing → (our options, kvpress's alpha_safeguard)
PAIRS = {
    "leaderboard": ({}, 0.2),
    "floor=kvpress": ({"floor": "kvpress"}, 0.2),
    "floor 0": ({"floor_alpha": 0.0}, 0.0),
}


def kvpress_job(name: str, alpha: float, ratio: float, budget: int) -> dict:
    inner = {"press": "ExpectedAttentionPress", "kwargs": {"epsilon": 0.01}}
    return {"method": name, "press": "AdaKVPress", "kwargs": {"alpha_safeguard": alpha}, "inner": inner,
            "budget": budget, "compression_ratio": ratio}  # fmt: skip


def ours_kept(model, ids: list[int], options: dict, budget: int) -> list[list[list[int]]]:
    method = make_method("expected-attention", **options)
    cache = kvbudget.compress(model, torch.tensor([ids]), method=method, budget=budget)
    return [[layer.head(h)[2][0].tolist() for h in range(layer.num_heads)] for layer in cache.layers]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", default="vt,lcc")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--ratio", type=float, default=0.875)
    parser.add_argument(
        "--dtype", default="bfloat16", help="both sides' model dtype (the leaderboard's: bfloat16)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args()
    python, versions = peer_python()
    tasks = args.tasks.split(",")

    lock = os.environ.get("KVBUDGET_LOCK")
    with file_lock(Path(lock)) if lock else nullcontext():
        model, tokenizer = kvbudget.load_model(MODEL, dtype=args.dtype)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            config = EvalConfig(
                MODEL, tasks, [2048], ["full"], [], [args.ratio], args.samples, dtype=args.dtype
            )
            runner = Runner(config, work / "rows", model=model, tokenizer=tokenizer, progress=False)
            samples = []
            for entry in eval_tasks_only(runner):
                exported = export_sample(runner, *entry)
                ids = exported["context_ids"] + exported["question_ids"]  # compressed together (aware)
                samples.append({"id": exported["id"], "task": exported["task"], "context_ids": ids,
                                "question_ids": [], "eos_ids": [], "max_new_tokens": 1})  # fmt: skip
            alphas = sorted({alpha for _, alpha in PAIRS.values()})
            jobs = [kvpress_job(f"alpha {alpha}", alpha, args.ratio, 0) for alpha in alphas]
            (work / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
            (work / "jobs.json").write_text(json.dumps(jobs))
            print(f"kvpress ({versions}): {len(samples)} prompts × {len(jobs)} head floors ...", flush=True)
            subprocess.run(
                [str(python), "-P", str(runner_script()), "--model", str(resolve_source(MODEL)),
                 "--samples", str(work / "samples.jsonl"), "--jobs", str(work / "jobs.json"),
                 "--out", str(work / "out.jsonl"), "--indices", "--dtype", args.dtype],
                check=True, timeout=3600,
            )  # fmt: skip
            theirs = {(r["sample"], r["method"]): r["indices"]
                      for r in map(json.loads, (work / "out.jsonl").read_text().splitlines())}  # fmt: skip

        lines = [f"{args.dtype}, r = {args.ratio}:", "",
                 "| task | pairing | kept positions in common | (layer, head) sets identical | prompts |",
                 "|---|---|---|---|---|"]  # fmt: skip
        for task in tasks:
            for name, (options, alpha) in PAIRS.items():
                common = total = same = heads = count = 0
                for sample in (s for s in samples if s["task"] == task):
                    budget = ratio_budget(args.ratio, len(sample["context_ids"]))
                    ours = ours_kept(model, sample["context_ids"], options, budget)
                    for mine, peer in zip(ours, theirs[(sample["id"], f"alpha {alpha}")], strict=True):
                        for a, b in zip(mine, peer, strict=True):
                            common += len(set(a) & set(b))
                            total += len(b)
                            same += sorted(a) == sorted(b)
                            heads += 1
                    count += 1
                shares = f"{100 * common / total:.1f}% | {100 * same / heads:.1f}%"
                lines.append(f"| {task} | {name} | {shares} | {count} |")
        print("\n".join(lines))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
