"""Lookahead overhead of LAQ: (lookahead + re-selection) time as a share of TTFT, real model.

    OMP_NUM_THREADS=1 .venv/bin/python lab/scripts/laq_overhead.py [--length 4096] [--budget 128]
        [--runs 3] [--methods laq,laq++] [--model smollm2-135m]

One needle prompt of ``--length`` context tokens; per method one warm-up run, then ``--runs``
timed runs of ``kvbudget.generate(..., max_new_tokens=1)``. TTFT includes the prefill, the
lookahead (clone, SnapKV on the clone, 8 pseudo tokens) and the re-selection; the script prints
each run and the medians, and exits 1 if a median share exceeds ``--limit`` (default 10%).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import kvbudget
from kvbudget.eval.tasks.needle import needle_sample


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--methods", default="laq,laq++")
    parser.add_argument("--limit", type=float, default=0.10)
    args = parser.parse_args()
    model, tokenizer = kvbudget.load_model(args.model)
    sample = needle_sample(tokenizer, length=args.length, depth=0.5, haystack="essays", seed=0)
    print(f"model {args.model}, torch threads {torch.get_num_threads()}, budget {args.budget}")
    worst = 0.0
    for method in args.methods.split(","):
        shares, ttfts, overheads = [], [], []
        for run in range(args.runs + 1):
            result = kvbudget.generate(
                model, tokenizer, sample.context, sample.question, sample.answer_prefix,
                method=method, budget=args.budget, max_new_tokens=1,
            )  # fmt: skip
            t = result.timings
            overhead = t["lookahead"] + t["reselect"]
            if run == 0:
                print(f"{method}: prompt {result.prompt_tokens} tokens (warm-up run not counted)")
                continue
            ttfts.append(result.ttft_s)
            overheads.append(overhead)
            shares.append(overhead / result.ttft_s)
            print(
                f"  run {run}: ttft {result.ttft_s:.3f} s = prefill {t['prefill']:.3f} + lookahead "
                f"{t['lookahead']:.3f} + reselect {t['reselect']:.3f} (+ other) -> overhead {shares[-1]:.1%}",
                flush=True,
            )
        share = statistics.median(shares)
        worst = max(worst, share)
        print(
            f"{method}: median ttft {statistics.median(ttfts):.3f} s, median overhead "
            f"{statistics.median(overheads):.3f} s = {share:.1%} of TTFT"
        )
    print(f"worst median overhead {worst:.1%} (limit {args.limit:.0%})")
    return 0 if worst <= args.limit else 1


if __name__ == "__main__":
    sys.exit(main())
