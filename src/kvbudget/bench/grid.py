"""The benchmark grid: methods × budgets × context lengths × repeats, one process per measurement.

Each measurement runs in a fresh Python process (:mod:`kvbudget.bench.measure`) so its peak
RSS is its own (``ru_maxrss`` only grows, and a previous run's freed memory may stay mapped by
the allocator). Runs go to ``DIR/runs.jsonl`` as they finish (a rerun skips those done);
``DIR/bench.json`` holds the machine (memory bandwidth, threads, versions), the configuration,
and one aggregated row per (method, length, budget, batch): the median of every figure over the
repeats and its spread (min, max). ``DIR/bench.md`` and two plots summarise them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvbudget.bench.measure import RESULT_PREFIX, MeasureSpec
from kvbudget.errors import KVBudgetError

#: figures aggregated over repeats (median, min, max)
TIMED = ("ttft_s", "tpot_s", "tpot_steady_s", "static_setup_s", "compress_s", "prefill_s")
#: what a row written before a key existed stands for (the eager path has no setup)
TIMED_DEFAULTS = {"tpot_steady_s": "tpot_s", "static_setup_s": None}
SIZED = ("peak_rss_bytes", "kv_peak_bytes", "logical_bytes", "physical_bytes", "decode_kv_bytes")


@dataclass
class BenchConfig:
    """What :func:`run_bench` runs. ``full`` is measured once per length (it has no budget)."""

    model: str = "smollm2-135m"
    methods: list[str] = field(default_factory=lambda: ["full", "snapkv", "ada-snapkv", "lava"])
    budgets: list[int] = field(default_factory=lambda: [256])
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    repeats: int = 3
    new_tokens: int = 64
    dtype: str = "float32"
    threads: int | None = None  # torch threads per worker (OMP_NUM_THREADS); None = inherit
    task: str = "needle"
    seed: int = 0
    batch: int = 1  # rows decoded together (see MeasureSpec.batch)
    device: str = "cpu"  # cpu, cuda or auto (see MeasureSpec.device)
    random_weights: bool = False  # see MeasureSpec.random_weights
    decode: str = "eager"  # eager, static or static-compiled (see MeasureSpec.decode)

    def validate(self) -> None:
        from kvbudget.engine import DECODE_PATHS
        from kvbudget.eval.runner import MethodSpec

        for m in self.methods:
            MethodSpec.parse(m)
        if not self.budgets or any(b <= 0 for b in self.budgets):
            raise KVBudgetError(f"budgets must be positive integers, got {self.budgets}")
        if not self.lengths or any(n <= 0 for n in self.lengths):
            raise KVBudgetError(f"lengths must be positive integers, got {self.lengths}")
        if self.repeats < 1:
            raise KVBudgetError(f"repeats must be ≥ 1, got {self.repeats}")
        if self.batch < 1:
            raise KVBudgetError(f"batch must be ≥ 1, got {self.batch}")
        if self.decode not in DECODE_PATHS:
            raise KVBudgetError(f"decode must be one of {', '.join(DECODE_PATHS)}, got {self.decode!r}")
        if self.new_tokens < 2:
            raise KVBudgetError(f"new_tokens must be ≥ 2 (TPOT needs a decode step), got {self.new_tokens}")

    def specs(self) -> list[MeasureSpec]:
        """Every measurement, grouped by length so a partial run covers short contexts first; within
        a length, repeat by repeat (every method once, then again), so the machine's drift over
        minutes spreads over all methods instead of biasing the ones measured last."""
        out = []
        for length in self.lengths:
            for repeat in range(self.repeats):
                for method in self.methods:
                    budgets = [max(self.budgets)] if method.split(":")[0] == "full" else self.budgets
                    for budget in budgets:
                        out.append(
                            MeasureSpec(
                                self.model,
                                method,
                                length,
                                budget,
                                self.new_tokens,
                                self.dtype,
                                self.task,
                                self.seed,
                                repeat,
                                self.batch,
                                self.device,
                                self.random_weights,
                                self.decode,
                            )  # fmt: skip
                        )
        return out


def run_key(spec: MeasureSpec | dict[str, Any]) -> str:
    d = asdict(spec) if isinstance(spec, MeasureSpec) else spec
    keys = ("model", "method", "length", "budget", "new_tokens", "dtype", "task", "seed", "repeat")
    # runs before `batch` had 1; CPU rows, real weights and eager decoding keep their earlier keys
    extra = (
        ([d["device"]] if d.get("device", "cpu") != "cpu" else [])
        + (["random"] if d.get("random_weights") else [])
        + ([d["decode"]] if d.get("decode", "eager") != "eager" else [])
    )
    return json.dumps([d[k] for k in keys] + [d.get("batch", 1)] + extra)


def run_worker(spec: MeasureSpec, threads: int | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; its row (or ``{"error": ...}``)."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-m", "kvbudget.bench.measure", json.dumps(asdict(spec))],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"worker exited with code {proc.returncode}: {' | '.join(tail)}"}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(runs: list[dict[str, Any]], bandwidth: float | None) -> list[dict[str, Any]]:
    """One row per (method, length, budget, batch): medians, ``<figure>_spread`` (min/max) and the bound."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        if "error" in run:
            continue
        groups.setdefault((run["method"], run["length"], run["budget"], run.get("batch", 1)), []).append(run)
    rows = []
    for (method, length, budget, batch), group in groups.items():
        row: dict[str, Any] = {
            "method": method,
            "length": length,
            "budget": None if method.split(":")[0] == "full" else budget,
            "batch": batch,
            "prompt_tokens": group[0]["prompt_tokens"],
            "repeats": len(group),
        }
        gpu = ("gpu_peak_bytes",) if all("gpu_peak_bytes" in r for r in group) else ()  # runs on a GPU
        for key in TIMED + SIZED + gpu:
            stats = _spread([float(_timed(r, key)) for r in group])
            row[key] = stats["median"] if key in TIMED else int(stats["median"])
            row[key + "_spread"] = [stats["min"], stats["max"]]
        row["compress_overhead"] = row["compress_s"] / row["prefill_s"] if row["prefill_s"] else None
        row["weight_bytes"] = group[0]["weight_bytes"]
        if bandwidth:
            # a decode step reads the weights and the cache as it is during decoding
            row["tpot_bound_s"] = (row["weight_bytes"] + row["decode_kv_bytes"]) / bandwidth
            row["tpot_over_bound"] = row["tpot_s"] / row["tpot_bound_s"]
        rows.append(row)
    return rows


def _timed(row: dict[str, Any], key: str) -> float:
    """``row[key]``, or for rows written before ``key`` existed what it stands for."""
    if key in row:
        return row[key]
    fallback = TIMED_DEFAULTS.get(key, key)
    return row[fallback] if fallback is not None else 0.0


def machine_info(bandwidth: dict[str, Any] | None) -> dict[str, Any]:
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "bandwidth": bandwidth,
    }


def read_runs(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    runs = []
    for line in path.read_text().splitlines():
        try:
            runs.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted run
    return runs


def run_bench(
    config: BenchConfig,
    out: Path,
    progress: Callable[[str], None] | None = None,
    measure_bw: bool = True,
) -> Path:
    """Run the grid into ``out`` (resumable); returns ``out/bench.json``."""
    from kvbudget.bench.bandwidth import measure_bandwidth

    config.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs_path = out / "runs.jsonl"
    runs = read_runs(runs_path)
    done = {run_key(r) for r in runs if "error" not in r}
    bandwidth = None
    bw_path = out / "bandwidth.json"
    if bw_path.is_file():
        bandwidth = json.loads(bw_path.read_text())
    elif measure_bw:
        if config.threads is not None:
            import torch

            torch.set_num_threads(config.threads)
        from kvbudget.models import resolve_device

        bandwidth = measure_bandwidth(device=str(resolve_device(config.device))).as_dict()
        bw_path.write_text(json.dumps(bandwidth))
    specs = config.specs()
    with runs_path.open("a") as fh:
        for i, spec in enumerate(specs):
            if run_key(spec) in done:
                continue
            if progress:
                progress(f"[{i + 1}/{len(specs)}] {spec.method} length={spec.length} budget={spec.budget} "
                         f"repeat={spec.repeat}")  # fmt: skip
            row = run_worker(spec, config.threads)
            if "error" in row:
                row = {**asdict(spec), "error": row["error"]}
                if progress:
                    progress(f"  error: {row['error']}")
            runs.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
    rows = aggregate(runs, bandwidth["copy"] if bandwidth else None)
    result = {
        "machine": machine_info(bandwidth),
        "config": asdict(config),
        "rows": rows,
        "errors": [r for r in runs if "error" in r],
    }
    path = out / "bench.json"
    path.write_text(json.dumps(result, indent=1))
    from kvbudget.bench.report import write_bench_report

    write_bench_report(result, out)
    return path
