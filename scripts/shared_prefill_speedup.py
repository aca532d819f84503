"""Time the demo grid with and without shared prefill (same rows, same predictions).

    .venv/bin/python scripts/shared_prefill_speedup.py [--limit 5] [--out runs/speedup]

Prints wall time and this process's CPU time of each run (with ``OMP_NUM_THREADS=1`` the CPU
time is the work done, much less distorted than wall time when other processes share the cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
from pathlib import Path

from kvbudget.eval.runner import run_eval
from kvbudget.eval.store import load_rows
from kvbudget.eval.suites import suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/speedup"))
    args = parser.parse_args()
    seconds, cpu = {}, {}
    for shared in (True, False):
        out = args.out / ("shared" if shared else "separate")
        shutil.rmtree(out, ignore_errors=True)
        config = dataclasses.replace(suite("demo"), limit=args.limit, shared=shared)
        start, start_cpu = time.perf_counter(), time.process_time()
        run_eval(config, out, progress=False)
        seconds[shared] = time.perf_counter() - start
        cpu[shared] = time.process_time() - start_cpu
        rows = len(load_rows(out / "results.jsonl"))
        print(f"shared={shared}: {seconds[shared]:.0f} s ({cpu[shared]:.0f} s CPU), {rows} rows", flush=True)
    a = {r["key"]: r["prediction"] for r in load_rows(args.out / "shared" / "results.jsonl")}
    b = {r["key"]: r["prediction"] for r in load_rows(args.out / "separate" / "results.jsonl")}
    same = sum(a[k] == b.get(k) for k in a)
    print(
        f"speed-up {seconds[False] / seconds[True]:.2f}x ({cpu[False] / cpu[True]:.2f}x in CPU time); "
        f"identical predictions {same}/{len(a)}"
    )


if __name__ == "__main__":
    main()
