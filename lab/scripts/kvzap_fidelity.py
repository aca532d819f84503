"""How well KVzap's surrogates predict KVzip+ on the leaderboard's own contexts (#48's diagnosis).

For the first ``--samples`` samples of each task (question-agnostic: the chat template's prefix and
the context, the part the leaderboard compresses), KVzip+'s log scores and each surrogate's
predictions are compared per layer: Spearman's rank correlation (averaged over KV heads), and the
share of KVzip+'s kept set at a ratio that the surrogate keeps too (per layer and head, top-k of
``k = round((1 − r)·m)``), both averaged over layers. The surrogates' own held-out correlation (on
the training sources) is printed beside them.

    .venv/bin/python lab/scripts/kvzap_fidelity.py --tasks niah_multikey_1,vt,lcc --samples 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvbudget
from kvbudget.engine import build_prompt
from kvbudget.eval.tasks import get_task
from kvbudget.methods.kvzap_surrogate import (
    KINDS,
    kvzip_plus_pairs,
    rank_correlation,
    resolve_surrogate,
)


def kept_overlap(pred: torch.Tensor, true: torch.Tensor, ratio: float) -> float:
    """Share of the true top-k that the predicted top-k holds, ``pred/true: [m, kv]``, mean over heads."""
    k = max(1, round((1 - ratio) * true.shape[0]))
    kept = [torch.zeros(true.shape, dtype=torch.bool).scatter_(0, s.topk(k, dim=0).indices, True)
            for s in (pred, true)]  # fmt: skip
    return float((kept[0] & kept[1]).sum(0).float().mean()) / k


def kept_share(surrogate, x: torch.Tensor, y: torch.Tensor, ratio: float) -> float:
    """:func:`kept_overlap` averaged over layers; ``x: [L, m, hidden]``, ``y: [L, m, kv]``."""
    shares = [kept_overlap(surrogate.predict(i, x[i]), y[i], ratio) for i in range(y.shape[0])]
    return sum(shares) / len(shares)


def board_arguments(doc: str) -> argparse.ArgumentParser:
    """The options both diagnosis scripts take: the model, and which leaderboard contexts."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tasks", default="niah_multikey_1,vt,lcc")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the figures")
    return parser


def main() -> None:
    parser = board_arguments(__doc__)
    parser.add_argument("--ratios", default="0.5,0.875")
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    model, tokenizer = kvbudget.load_model(args.model, dtype="bfloat16")
    surrogates = {kind: resolve_surrogate(model, "", kind) for kind in KINDS}
    for kind, s in surrogates.items():
        held = s.meta.get("held_out_rank_correlation") or []
        if held:
            print(f"{kind}: held-out rank correlation on the training sources, mean over layers "
                  f"{sum(held) / len(held):.3f} (range {min(held):.3f}–{max(held):.3f})")  # fmt: skip
    rows = []
    for task_name in args.tasks.split(","):
        task = get_task(task_name)
        for index, sample in enumerate(task.make_samples(tokenizer, args.length, args.samples, 0)):
            prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
            started = time.perf_counter()
            x, y = kvzip_plus_pairs(model, prompt.context_ids)
            row = {"task": task_name, "index": index, "entries": int(x.shape[1]),
                   "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
            for kind, s in surrogates.items():
                corr = rank_correlation(s, x, y)
                row[f"{kind} rank corr"] = sum(corr) / len(corr)
                for r in ratios:
                    row[f"{kind} kept@{r}"] = kept_share(s, x, y, r)
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    keys = [k for k in rows[0] if " " in k]
    print("mean over samples: " + ", ".join(f"{k} {sum(r[k] for r in rows) / len(rows):.3f}" for k in keys))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
