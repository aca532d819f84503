"""Would more training data close KVzap's gap to KVzip+? A learning curve (#48's diagnosis).

Collects KVzip+ pairs on ``kvbudget train kvzap``'s passages (every token of each, not its 384) and
on the leaderboard's question-agnostic contexts (the first ``--samples`` of each task), then fits
the surrogates on growing subsets of the training passages and tokens and reports, for each, the
rank correlation (mean over layers) on the held-out passages and on each leaderboard context, and
the share of KVzip+'s kept set at r = 0.5 the surrogate keeps on the leaderboard's contexts.

    .venv/bin/python lab/scripts/kvzap_learning_curve.py \
      --out lab/results/kvzap-diagnosis/kvzap-learning-curve.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import kvbudget
from kvbudget.engine import build_prompt
from kvbudget.eval.tasks import get_task
from kvbudget.kvzap_training import TrainConfig, training_passages
from kvbudget.methods.kvzap_surrogate import fit_linear, fit_mlp, kvzip_plus_pairs, rank_correlation
from kvbudget.methods.kvzip import reconstruction_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvzap_fidelity import board_arguments, kept_share  # noqa: E402  (a sibling script)


def main() -> None:
    args = board_arguments(__doc__).parse_args()
    cfg = TrainConfig()
    model, tokenizer = kvbudget.load_model(args.model, dtype="bfloat16")
    prefix = reconstruction_prompts(model, "", "").prefix
    started = time.perf_counter()
    passages = training_passages(tokenizer, cfg.passages, cfg.length, cfg.seed)
    pairs = [kvzip_plus_pairs(model, prefix + ids) for _, ids in passages]
    print(f"training pairs: {len(pairs)} passages in {time.perf_counter() - started:.0f} s", flush=True)
    board = []
    for name in args.tasks.split(","):
        for sample in get_task(name).make_samples(tokenizer, args.length, args.samples, 0):
            prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
            board.append(kvzip_plus_pairs(model, prompt.context_ids))
    train_n = cfg.passages - cfg.held_out
    hx = torch.cat([p[0] for p in pairs[train_n:]], 1)
    hy = torch.cat([p[1] for p in pairs[train_n:]], 1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    grid = [(21, 384, "linear"), (42, 384, "linear"), (21, 1024, "linear"), (42, 1024, "linear"),
            (42, 384, "mlp"), (42, 1024, "mlp")]  # fmt: skip
    for n, tokens, kind in grid:
        xs, ys = [], []
        for x, y in pairs[:n]:
            pick = torch.randperm(x.shape[1], generator=gen)[:tokens]
            xs.append(x[:, pick])
            ys.append(y[:, pick])
        x, y = torch.cat(xs, 1), torch.cat(ys, 1)
        t0 = time.perf_counter()
        surrogate = fit_linear(x, y) if kind == "linear" else fit_mlp(x, y, epochs=cfg.epochs, seed=0)
        held = rank_correlation(surrogate, hx, hy)
        lead = [sum(c) / len(c) for c in (rank_correlation(surrogate, bx, by) for bx, by in board)]
        kept = [kept_share(surrogate, bx, by, 0.5) for bx, by in board]
        row = {"kind": kind, "passages": n, "tokens each": tokens, "pairs": int(x.shape[1]),
               "fit_s": round(time.perf_counter() - t0, 1),
               "held-out corr": round(sum(held) / len(held), 3),
               "leaderboard corr": round(sum(lead) / len(lead), 3),
               "leaderboard kept@0.5": round(sum(kept) / len(kept), 3)}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
