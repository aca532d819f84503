"""Long-document perplexity with a fixed cache: full, StreamingLLM, H2O, D2O and its ablations.

Each sample is a ``--length``-token Austen passage (the ``perplexity`` task). The first
``--first-chunk`` tokens are prefilled and compressed to the budget (so D2O's variance-based layer
budgets come from a real prompt); the rest is read in chunks of ``--chunk`` tokens, each chunk
scored from the cache, which the decode-stage methods trim back to the budget after every chunk.
Prints a markdown table (perplexity over all scored tokens of all samples).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/d2o_perplexity.py --samples 2
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from kvbudget.eval.tasks.perplexity import _austen_ids, chunked_perplexity, make_samples
from kvbudget.methods.registry import make_method
from kvbudget.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="full,streamingllm,h2o,d2o,d2o-nomerge")
    parser.add_argument("--budgets", default="256,512")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--first-chunk", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    samples = make_samples(tokenizer, args.length, args.samples, seed=0)
    ids_all = _austen_ids(tokenizer)
    passages = [
        torch.tensor([list(ids_all[s.meta["offset"] : s.meta["offset"] + args.length])]) for s in samples
    ]
    budgets = [int(b) for b in args.budgets.split(",")]
    print(f"{args.model}, {args.samples} Austen passages × {args.length} tokens, first {args.first_chunk} "
          f"prefilled, chunk {args.chunk}")  # fmt: skip
    print()
    print("| method | budget | perplexity | mean NLL | scored tokens | max entries / head | seconds |")
    print("|---|---|---|---|---|---|---|")
    for name in args.methods.split(","):
        for budget in [None] if name == "full" else budgets:
            nll, tokens, peak, start = 0.0, 0, 0, time.perf_counter()
            for ids in passages:
                result = chunked_perplexity(
                    model, ids, make_method(name), budget, chunk=args.chunk, first_chunk=args.first_chunk
                )
                nll += result.nll * result.tokens
                tokens += result.tokens
                peak = max(peak, result.max_entries_per_head)
            mean = nll / tokens
            seconds = time.perf_counter() - start
            print(f"| {name} | {budget or 'all'} | {math.exp(mean):.3f} | {mean:.4f} | {tokens} | {peak} "
                  f"| {seconds:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
