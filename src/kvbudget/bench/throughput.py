"""Throughput under a memory cap: the largest batch each method fits, and its tokens per second.

D2O (arXiv 2406.13035, §5.5, Table 5) argues that a cache held at a fixed size lets a larger batch
fit in the same memory, so a server generates more tokens per second. ``kvbudget bench
throughput`` measures that: for each method (and budget, and prompt length) it finds the largest
batch whose memory stays under ``memory_cap`` and reports the decode throughput at that batch.

**Rows.** Every batch row holds the same prompt (the first sample of ``task``, ``length`` tokens
with its template), so nothing is padded and every row is compressed alike; rows decode
``new_tokens`` greedily and never stop at EOS, so every run decodes the same number of steps.

**Memory** (:class:`KVMeter`, :class:`CudaMeter`). On CUDA: the allocator's peak
(``torch.cuda.max_memory_allocated``) minus what was allocated just before the run (the weights):
the cache, the activations and any transient copy. On CPU no resettable allocator peak exists, so
the figure is the KV cache's own peak of allocated key/value bytes
(:attr:`kvbudget.cache.BudgetCache.peak_physical_bytes`, storage room included; activations and
positions/method state excluded). Each run records the peak of its prefill and of its decoding;
``cap_on="run"`` (default) caps the larger of the two — the batch is prefilled at once, then
decoded — and ``cap_on="decode"`` caps the decoding alone, the memory a server that prefills
requests one by one and decodes them together needs beyond one prefill (the runs here still
prefill the batch at once).

**Finding the batch** (:func:`find_batch`): memory is close to ``fixed + per_row · batch``. One
row is measured first; ``⌊cap / one row⌋`` rows then fit for any ``fixed ≥ 0``; the line through
the measured points predicts the largest batch, which is measured in turn, until the largest
measured batch that fits is also the largest the line allows (or ``max_batch``). No batch beyond
the prediction is run, so nothing is found by running out of memory. ``check_next`` also measures
one row more than the answer, to show it does not fit.

**Throughput**: decode tokens per second ``batch · steps / decode seconds`` (the steps after the
first token, which comes from the prefill's logits), and end to end ``batch · new_tokens /
(prefill + decode seconds)``; with ``repeats > 1`` the chosen batch is run again and the times are
the median.
"""

from __future__ import annotations

import gc
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvbudget.errors import BudgetError, InputError, KVBudgetError
from kvbudget.units import parse_size as parse_size  # the CLI and tests read it here

CAP_ON = ("run", "decode")
#: a run's memory figures (bytes); None in a run that ran out of device memory
PEAKS = ("prefill_peak_bytes", "decode_peak_bytes", "run_peak_bytes")


@dataclass
class ThroughputConfig:
    """What :func:`run_throughput` measures (see the module docstring).

    Attributes:
        memory_cap: bytes the measured memory must stay under (:func:`parse_size` reads ``2GiB``).
        cap_on: ``"run"`` (the peak of the prefill and the decoding) or ``"decode"`` (decoding only).
        max_batch: the largest batch tried, whatever the cap allows.
        check_next: also measure ``batch + 1`` rows (it must not fit) and record its memory.
        repeats: runs of the chosen batch; its times are their median.
        device: ``cpu`` or ``cuda[:i]``; threads: torch threads (default: inherited).
    """

    model: str = "qwen2.5-coder-0.5b"
    methods: list[str] = field(default_factory=lambda: ["full", "d2o", "h2o"])
    budgets: list[int] = field(default_factory=lambda: [256])
    lengths: list[int] = field(default_factory=lambda: [2048])
    new_tokens: int = 128
    memory_cap: int = 2 << 30
    cap_on: str = "run"
    dtype: str = "bfloat16"
    device: str = "cpu"
    task: str = "needle"
    seed: int = 0
    max_batch: int = 64
    check_next: bool = False
    repeats: int = 1
    threads: int | None = None

    def validate(self) -> None:
        """One-line errors for bad options; cheap (no model is loaded)."""
        from kvbudget.eval.runner import MethodSpec
        from kvbudget.eval.tasks import get_task
        from kvbudget.models import resolve_dtype

        if not self.methods:
            raise KVBudgetError("--methods is empty: name at least one method (e.g. full,d2o,h2o)")
        if not self.budgets or any(b <= 0 for b in self.budgets):
            raise BudgetError(
                f"--budgets must be positive integers (entries per KV head), got {self.budgets}"
            )
        if not self.lengths or any(n <= 0 for n in self.lengths):
            raise InputError(f"--lengths must be positive integers (prompt tokens), got {self.lengths}")
        for method in self.methods:
            built = MethodSpec.parse(method).build()
            if built.stages:
                for budget in self.budgets:
                    built.check_budget(budget)
        if self.new_tokens < 2:
            raise InputError(
                f"--new-tokens must be ≥ 2 (decode throughput needs a step), got {self.new_tokens}"
            )
        if isinstance(self.memory_cap, bool) or not isinstance(self.memory_cap, int) or self.memory_cap <= 0:
            raise KVBudgetError(f"--memory-cap must be a positive number of bytes, got {self.memory_cap!r}")
        if self.cap_on not in CAP_ON:
            raise KVBudgetError(f"--cap-on must be one of {', '.join(CAP_ON)}, got {self.cap_on!r}")
        if self.max_batch < 1:
            raise KVBudgetError(f"--max-batch must be ≥ 1, got {self.max_batch}")
        if self.repeats < 1:
            raise KVBudgetError(f"--repeats must be ≥ 1, got {self.repeats}")
        if self.threads is not None and self.threads < 1:
            raise KVBudgetError(f"--threads must be ≥ 1, got {self.threads}")
        resolve_dtype(self.dtype)
        get_task(self.task)
        device = _device(self.device)
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            if self.memory_cap >= total:
                raise KVBudgetError(
                    f"--memory-cap {self.memory_cap} bytes is not below {device}'s {total} bytes: "
                    "the search would run out of device memory before reaching the cap"
                )

    def cases(self) -> list[tuple[str, int, int | None]]:
        """``(method, length, budget)`` to measure; ``full`` once per length (it has no budget)."""
        out: list[tuple[str, int, int | None]] = []
        for length in self.lengths:
            for method in self.methods:
                if method.split(":")[0] == "full":
                    out.append((method, length, None))
                else:
                    out.extend((method, length, budget) for budget in self.budgets)
        return out


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise KVBudgetError(f"--device expects cpu or cuda[:index], got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise KVBudgetError(f"--device expects cpu or cuda[:index], got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KVBudgetError(f"--device {text} requested but CUDA is not available")
    return device


# ------------------------------------------------------------------------------------- meters
class KVMeter:
    """Memory = the KV cache's peak allocated key/value bytes (any device; the CPU default)."""

    kind = "kv_peak_physical_bytes"
    description = (
        "the KV cache's peak allocated key/value bytes (storage room included; activations, "
        "positions and method state not counted): no resettable allocator peak exists on CPU"
    )

    def start(self) -> None:
        pass

    def peak(self, cache) -> int:
        return int(cache.peak_physical_bytes)

    def next_phase(self, cache) -> None:
        """Start a new peak from the cache as it is now."""
        cache.peak_physical_bytes = cache.physical_bytes()

    def sync(self) -> None:
        pass


class CudaMeter:
    """Memory = the CUDA allocator's peak during the run minus what was allocated before it."""

    kind = "cuda_peak_allocated_minus_weights"
    description = (
        "torch.cuda.max_memory_allocated during the run minus torch.cuda.memory_allocated just before "
        "it (the weights): cache, activations and transient copies"
    )

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self, cache) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device) - self.base)

    def next_phase(self, cache) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


def make_meter(device: torch.device) -> KVMeter | CudaMeter:
    return CudaMeter(device) if device.type == "cuda" else KVMeter()


# ------------------------------------------------------------------------------------- one run
def run_batch(
    model, prompt, method: str, budget: int | None, new_tokens: int, batch: int, meter, pad_id: int
):
    """Prefill ``batch`` copies of ``prompt`` with ``method`` and decode ``new_tokens``; one run's row.

    Returns the peaks (``prefill_peak_bytes``, ``decode_peak_bytes``), the cache's bytes after the
    prefill and at the end, and the times (seconds; decode excludes the first token).
    """
    from kvbudget.engine import decode_loop, prefill
    from kvbudget.eval.runner import MethodSpec
    from kvbudget.session import CompressionSession

    session = CompressionSession(
        MethodSpec.parse(method).build(), model.config.num_hidden_layers, budget=budget or len(prompt.ids)
    )
    meter.start()
    start = time.perf_counter()
    cache, logits, mask, last = prefill(model, [prompt] * batch, session, pad_id)
    prefill_peak = meter.peak(cache)
    meter.sync()
    prefill_s = time.perf_counter() - start
    after_prefill = cache.physical_bytes()
    meter.next_phase(cache)
    decoded = decode_loop(model, cache, logits, mask, last, set(), new_tokens, trace=False)
    meter.sync()
    total_s = time.perf_counter() - start
    decode_peak = meter.peak(cache)
    steps = decoded.steps
    row = {
        "batch": batch,
        "prefill_peak_bytes": prefill_peak,
        "decode_peak_bytes": decode_peak,
        "run_peak_bytes": max(prefill_peak, decode_peak),
        "kv_after_prefill_bytes": after_prefill,
        "kv_end_bytes": cache.physical_bytes(),
        "prefill_s": prefill_s,
        "decode_s": decoded.seconds,
        "total_s": total_s,
        "decode_steps": steps,
        "tpot_s": decoded.seconds / steps if steps else math.nan,
        "decode_tok_s": batch * steps / decoded.seconds if decoded.seconds > 0 else math.nan,
        "total_tok_s": batch * new_tokens / total_s,
    }
    del cache, logits, decoded
    gc.collect()
    return row


# ------------------------------------------------------------------------------------- the search
@dataclass
class LineFit:
    """``memory(batch) ≈ fixed + per_row · batch`` through the measured points (bytes)."""

    fixed: float
    per_row: float

    def at(self, batch: int) -> float:
        return self.fixed + self.per_row * batch

    def largest_under(self, cap: int) -> int:
        """The largest batch the line keeps at or under ``cap`` (0 when not even one row)."""
        if self.per_row <= 0:
            return 1 << 30 if self.fixed <= cap else 0
        return max(0, math.floor((cap - self.fixed) / self.per_row + 1e-9))


def fit_line(points: dict[int, int]) -> LineFit:
    """Least-squares line through ``{batch: bytes}``; through the origin for a single point.

    With one point the fixed part is taken as 0, which over-estimates every larger batch's memory
    (for a real fixed part ≥ 0), so the batches it allows do fit.
    """
    if len(points) == 1:
        (b, m), = points.items()  # fmt: skip
        return LineFit(0.0, m / b)
    xs, ys = list(points), [points[b] for b in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return LineFit(my - slope * mx, slope)


@dataclass
class BatchSearch:
    """The outcome of :func:`find_batch`.

    Attributes:
        batch: the largest measured batch whose memory fits (0: one row does not fit).
        runs: every measured run, by batch.
        fit: the line through the measured points; limited_by: ``"cap"``, ``"max_batch"`` or
            ``"one row exceeds the cap"``; converged: False when ``max_runs`` ran out first.
    """

    batch: int
    runs: dict[int, dict[str, Any]]
    fit: LineFit
    limited_by: str
    converged: bool = True


def find_batch(
    measure: Callable[[int], dict[str, Any]],
    cap: int,
    key: str,
    max_batch: int,
    check_next: bool = False,
    max_runs: int = 8,
) -> BatchSearch:
    """The largest batch ``b ≤ max_batch`` with ``measure(b)[key] ≤ cap`` (see the module docstring).

    ``measure(b)`` runs ``b`` rows and returns the run's row (``key``: its memory, None when it ran
    out of memory). One row is run first, then while no run has failed, the batch the line through
    the two largest fitting runs allows (through the origin with one run: for a fixed part ≥ 0 that
    batch fits). The search stops when that line allows nothing more (``check_next``: only once
    ``batch + 1`` is measured not to fit). After a failure it narrows the bracket between the
    largest fitting and the smallest failing run along their chord (bisecting past a run out of
    memory) until they are adjacent. At most ``1 + max_runs`` runs.
    """
    runs: dict[int, dict[str, Any]] = {}

    def mem(b: int) -> float:
        if b not in runs:
            runs[b] = measure(b)
        value = runs[b][key]
        return math.inf if value is None else value  # None: the run ran out of memory

    def line(points: list[int]) -> LineFit:
        return fit_line({b: runs[b][key] for b in points})

    if mem(1) > cap:
        fit = line([1]) if runs[1][key] is not None else LineFit(math.nan, math.nan)
        return BatchSearch(0, runs, fit, "one row exceeds the cap")
    fits, fails, converged = 1, None, False
    for _ in range(max_runs):
        fitting = sorted(b for b in runs if mem(b) <= cap)[-2:]
        if fits == max_batch or (fails is not None and fails == fits + 1):
            converged = True
            break
        if fails is None:
            guess = min(max_batch, line(fitting).largest_under(cap))
            if guess <= fits:  # the line allows nothing beyond a batch known to fit
                if len(fitting) > 1 and not check_next:
                    converged = True
                    break
                guess = fits + 1  # a second point fixes the line's fixed part, or check_next
        elif math.isfinite(mem(fails)):
            guess = min(max(line([fits, fails]).largest_under(cap), fits + 1), fails - 1)
        else:
            guess = (fits + fails) // 2
        # every measured batch is ≤ fits or ≥ fails, and fits < guess < fails: never a rerun
        if mem(guess) <= cap:
            fits = guess
        else:
            fails = guess if fails is None else min(fails, guess)
    fitting = sorted(b for b in runs if mem(b) <= cap)[-2:]
    fit = line(fitting)
    if check_next and fits < max_batch and (fits + 1) not in runs:
        mem(fits + 1)  # max_runs ran out first
    limited_by = "max_batch" if fits == max_batch else "cap"
    return BatchSearch(fits, runs, fit, limited_by, converged)


# ------------------------------------------------------------------------------------- the bench
def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _median_times(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("prefill_s", "decode_s", "total_s", "tpot_s", "decode_tok_s", "total_tok_s")
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def measure_case(
    model, tokenizer, config: ThroughputConfig, method: str, length: int, budget: int | None, meter,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Find the batch of one ``(method, length, budget)`` and its throughput; the result row."""
    from kvbudget.bench.measure import fit_prompt

    prompt = fit_prompt(tokenizer, config.task, length, config.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    warm = type(prompt)(prompt.ids[: min(len(prompt.ids), 2 * (budget or 64) + 64)], [])
    run_batch(model, warm, method, budget, 3, 1, meter, pad_id)  # kernels, allocator, lazy imports

    def measure(batch: int) -> dict[str, Any]:
        try:
            row = run_batch(model, prompt, method, budget, config.new_tokens, batch, meter, pad_id)
        except torch.OutOfMemoryError:  # a safety net on a device: the search never aims past the cap
            gc.collect()
            if progress:
                progress(f"  {method} budget={budget} batch={batch}: out of device memory")
            return {"batch": batch, "out_of_memory": True, **dict.fromkeys(PEAKS)}
        if progress:
            run_mib, decode_mib = row["run_peak_bytes"] / (1 << 20), row["decode_peak_bytes"] / (1 << 20)
            progress(
                f"  {method} budget={budget} batch={batch}: run peak {run_mib:.1f} MiB, "
                f"decode peak {decode_mib:.1f} MiB, {row['decode_tok_s']:.1f} tok/s"
            )
        return row

    key = f"{config.cap_on}_peak_bytes"
    search = find_batch(measure, config.memory_cap, key, config.max_batch, config.check_next)
    out: dict[str, Any] = {
        "method": method,
        "length": length,
        "budget": budget,
        "prompt_tokens": len(prompt.ids),
        "new_tokens": config.new_tokens,
        "batch": search.batch,
        "fits": search.batch > 0,
        "limited_by": search.limited_by,
        "search_converged": search.converged,
        "bytes_per_row": _finite(search.fit.per_row),
        "fixed_bytes": _finite(search.fit.fixed),
        "predicted_next_bytes": _finite(search.fit.at(search.batch + 1)),
        "next_batch_bytes": search.runs.get(search.batch + 1, {}).get(key),
        "measured_batches": sorted(search.runs),
        "runs": [search.runs[b] for b in sorted(search.runs)],
    }
    for phase in CAP_ON:  # what the other accounting would allow, from the same runs
        points = {
            b: r[f"{phase}_peak_bytes"]
            for b, r in search.runs.items()
            if r[f"{phase}_peak_bytes"] is not None
        }
        fit = fit_line(points) if points else None
        out[f"{phase}_bytes_per_row"] = fit.per_row if fit else None
        out[f"batch_if_cap_on_{phase}"] = (
            min(config.max_batch, fit.largest_under(config.memory_cap)) if fit else 0
        )
    out["batch1_decode_tok_s"] = search.runs[1].get("decode_tok_s")
    if search.batch == 0:
        return out
    chosen = [search.runs[search.batch]]
    for _ in range(config.repeats - 1):
        chosen.append(
            run_batch(model, prompt, method, budget, config.new_tokens, search.batch, meter, pad_id)
        )
    out["memory_bytes"] = chosen[0][key]
    out["prefill_peak_bytes"] = chosen[0]["prefill_peak_bytes"]
    out["decode_peak_bytes"] = chosen[0]["decode_peak_bytes"]
    out.update(_median_times(chosen))
    out["repeats"] = len(chosen)
    return out


def relative_to_full(rows: list[dict[str, Any]]) -> None:
    """Add ``batch_vs_full`` and ``decode_tok_s_vs_full`` (ratios to ``full`` at the same length)."""
    for row in rows:
        full = next(
            (r for r in rows if r["method"].split(":")[0] == "full" and r["length"] == row["length"]), None
        )
        ok = full is not None and full.get("batch") and row.get("batch")
        row["batch_vs_full"] = row["batch"] / full["batch"] if ok else None
        row["decode_tok_s_vs_full"] = row["decode_tok_s"] / full["decode_tok_s"] if ok else None
        row["total_tok_s_vs_full"] = row["total_tok_s"] / full["total_tok_s"] if ok else None


def machine(device: torch.device) -> dict[str, Any]:
    import os

    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def measure_all(
    model, tokenizer, config: ThroughputConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every case of ``config`` on a loaded ``model``; the result (what ``throughput.json`` holds)."""
    from kvbudget.attention import check_supported
    from kvbudget.bench.bandwidth import weight_bytes

    check_supported(model)
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    for length in config.lengths:
        if length + config.new_tokens > max_context:
            raise InputError(
                f"--lengths {length} + --new-tokens {config.new_tokens} exceeds the model's context of "
                f"{max_context} tokens"
            )
    device = next(model.parameters()).device
    meter = make_meter(device)
    rows = []
    for i, (method, length, budget) in enumerate(config.cases()):
        if progress:
            progress(f"[{i + 1}/{len(config.cases())}] {method} length={length} budget={budget}")
        rows.append(measure_case(model, tokenizer, config, method, length, budget, meter, progress))
    relative_to_full(rows)
    return {
        "machine": machine(device),
        "config": asdict(config),
        "memory": {
            "kind": meter.kind,
            "description": meter.description,
            "cap_bytes": config.memory_cap,
            "cap_on": config.cap_on,
            "rows": "the same prompt in every batch row",
        },
        "weight_bytes": weight_bytes(model),
        "rows": rows,
    }


def run_throughput(config: ThroughputConfig, out, progress: Callable[[str], None] | None = None):
    """Validate, load the model, measure every case, write ``out/throughput.{json,md,png}``; the JSON path."""
    import json
    from pathlib import Path

    from kvbudget.bench.throughput_report import write_throughput_report
    from kvbudget.models import load_model

    config.validate()
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KVBudgetError(f"cannot create the output folder {out}: {exc}") from None
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    model, tokenizer = load_model(config.model, dtype=config.dtype, device=config.device)
    result = measure_all(model, tokenizer, config, progress)
    result["model"] = config.model
    path = out / "throughput.json"
    path.write_text(json.dumps(result, indent=1))
    write_throughput_report(result, out)
    return path
