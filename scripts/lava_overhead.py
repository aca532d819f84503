"""Compression overhead of LAVa (or another method) at 4K: compress_s / prefill_s and where it goes.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python scripts/lava_overhead.py \\
        [--model smollm2-135m] [--length 4096] [--budget 256] [--method lava] [--runs 1] \\
        [--derive-runs 3] [--cprofile]

The prompt is the one ``kvbudget bench`` uses (:func:`kvbudget.bench.measure.fit_prompt`, the
needle task, ``--length`` tokens in all). One short warm-up prefill, then ``--runs`` timed
prefills. ``compress_s`` is ``CompressionSession.compress_seconds`` (as in the bench);
``prefill_s`` is the prefill's wall time without it; the overhead is their ratio (the bench's
``compress_overhead``). The breakdown times the method object's own steps (wrapped on the
instance only): ``score``, ``layer_weight``, ``split`` (head split, in compress and in rebalance),
``compress`` and ``rebalance`` in all; the rest of each is selection and cache editing.
``--derive-runs K`` then takes one full-cache snapshot of the prompt and times ``K`` compressions
of it (:func:`kvbudget.snapshot.derive`: the same per-layer compression and cascading as the
prefill, without the model's forward), which isolates the compression time from the noise of the
prefill. ``--cprofile`` additionally prints the top functions by own time of one run (a derive if
``--derive-runs`` > 0; cProfile slows Python-heavy code, so use it for where, not for how much).
The digest of the kept positions (every layer, row and head) lets two versions of the code be
compared for identical results.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from kvbudget.bench.measure import fit_prompt
from kvbudget.engine import prefill, prefill_inputs
from kvbudget.eval.runner import MethodSpec
from kvbudget.models import load_model
from kvbudget.session import CompressionSession
from kvbudget.snapshot import derive, take_snapshot

STEPS = ["score", "layer_weight", "split", "compress", "rebalance"]


def instrument(method: Any, seconds: dict[str, float]) -> None:
    """Wrap ``method``'s steps (on this instance only) to add their wall time to ``seconds``."""

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start

        return wrapper

    for name in STEPS:
        if hasattr(method, name):
            method.__dict__[name] = timed(name, getattr(method, name))


def kept_digest(cache: Any) -> str:
    """sha256 over every layer's kept positions per row and head (sorted), 16 hex digits."""
    digest = hashlib.sha256()
    for layer in cache.layers:
        for h in range(layer.num_heads):
            positions = layer.head(h)[2]
            for row in positions:
                digest.update(row[row >= 0].sort().values.numpy().tobytes())
    return digest.hexdigest()[:16]


def run(model: Any, prompt: Any, spec: str, budget: int, pad_id: int) -> tuple[float, float, dict, str]:
    """One timed prefill: (prefill wall seconds, compress seconds, step seconds, kept digest)."""
    seconds: dict[str, float] = defaultdict(float)
    method = MethodSpec.parse(spec).build()
    instrument(method, seconds)
    session = CompressionSession(method, model.config.num_hidden_layers, budget=budget)
    start = time.perf_counter()
    cache, _, _, _ = prefill(model, [prompt], session, pad_id)
    wall = time.perf_counter() - start
    return wall, session.compress_seconds, dict(seconds), kept_digest(cache)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--method", default="lava")
    parser.add_argument("--task", default="needle")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--derive-runs", type=int, default=3, help="compressions of one snapshot to time")
    parser.add_argument("--cprofile", action="store_true", help="also print cProfile's top functions")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    prompt = fit_prompt(tokenizer, args.task, args.length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    print(f"model {args.model}, method {args.method}, budget {args.budget}, prompt {len(prompt.ids)} "
          f"tokens, {torch.get_num_threads()} torch threads")  # fmt: skip
    warm = type(prompt)(prompt.ids[: 2 * args.budget + 64], [])
    run(model, warm, args.method, args.budget, pad_id)
    gc.collect()
    shares = []
    for i in range(args.runs):
        wall, compress, steps, digest = run(model, prompt, args.method, args.budget, pad_id)
        prefill_s = wall - compress
        shares.append(compress / prefill_s)
        parts = ", ".join(f"{k} {steps[k]:.3f}" for k in STEPS if k in steps)
        print(f"run {i + 1}: prefill_s {prefill_s:.3f}, compress_s {compress:.3f} "
              f"-> overhead {shares[-1]:.2%}; steps (s): {parts}; kept digest {digest}")  # fmt: skip
        gc.collect()
    if shares:
        print(f"median overhead {statistics.median(shares):.2%} over {args.runs} run(s)")
    if args.derive_runs > 0:
        snapshot = take_snapshot(model, prefill_inputs([prompt], pad_id))
        timings = []
        for i in range(args.derive_runs):
            seconds: dict[str, float] = defaultdict(float)
            method = MethodSpec.parse(args.method).build()
            instrument(method, seconds)
            cache = derive(model, snapshot, method, budget=args.budget)[0]
            timings.append(cache.session.compress_seconds)
            parts = ", ".join(f"{k} {seconds[k]:.3f}" for k in STEPS if k in seconds)
            print(f"derive {i + 1}: compress_s {timings[-1]:.3f}; steps (s): {parts}; "
                  f"kept digest {kept_digest(cache)}")  # fmt: skip
        print(f"median compress_s of derive {statistics.median(timings):.3f} over {args.derive_runs} run(s)")
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        if args.derive_runs > 0:
            derive(model, snapshot, MethodSpec.parse(args.method).build(), budget=args.budget)
        else:
            run(model, prompt, args.method, args.budget, pad_id)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
