"""``kvbudget bench serve``: a bounded local load on ``kvbudget serve``, full cache vs compressed
methods under the same KV memory cap.

For each method a server runs in this process (a :class:`~kvbudget.serve.scheduler.Scheduler` behind
the real HTTP app on a free port of 127.0.0.1) and ``clients`` threads send the task's prompts
(the evaluation task's own samples, with known answers: the needle at 8K tokens by default) as
streamed ``/v1/completions`` requests of token ids — the leaderboard's prompts, chat template and
answer prefix included — until ``requests`` are answered or ``time_limit_s`` passes. Reported per
method: sequences held at once (the scheduler's peak), peak KV bytes held against the cap, the
aggregate decode rate (tokens of all sequences per second of the run, and per second of decode
steps), TTFT and TPOT p50/p99 as the clients saw them, and accuracy on the answers.

The cap defaults to what two full-cache conversations of the prompt length need
(:func:`~kvbudget.serve.batcher.prefill_peak_bytes` of the full cache), so the full cache holds two
at once and a compressed method as many as fit.

``random_weights`` builds the model from its ``config.json`` alone (a 7B config on a GPU, say, with
``device="cuda"``): sequences held, memory and speed mean what they say, the answers nothing — every
request then decodes ``max_tokens`` tokens whatever it samples, and no accuracy is reported.

With ``openvino_python`` (``.venv-ov``'s Python, ``make ov``) the same prompts also run through
OpenVINO GenAI's continuous-batching pipeline (:mod:`kvbudget.peer.openvino`) with its KV pool set
to the cap, once with the full cache and once with its cache eviction sized to keep the fraction
of the prompt the compressed methods keep: rows "openvino (full)" and "openvino (eviction)".

With ``llama_server`` (llama.cpp's ``llama-server``, ``make llama``) the same prompts also run through
llama.cpp serving the model's GGUF file, once per cache type of ``llama_cache_types`` (f16, q8_0,
q4_0), with as many slots as the cap holds at that type (:mod:`kvbudget.peer.llama_cpp`): rows
"llama.cpp (q4_0)" and so on.

A method is a spec as the evaluation takes it: ``snapkv``, ``full:kv_bits=4`` (the full cache stored
at 4 bits), ``snapkv:kv_bits=4`` (at the ratio, stored at 4 bits), ``snapkv:memory=0.125`` (a byte
budget: 12.5% of the full cache's bytes, no ratio).
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvbudget.engine import build_prompt
from kvbudget.errors import InputError
from kvbudget.eval.tasks import get_task
from kvbudget.prefill.common import eos_ids
from kvbudget.serve.app import create_app, prometheus_metrics, serving
from kvbudget.serve.batcher import Compression, make_sequence, prefill_peak_bytes
from kvbudget.serve.scheduler import Metrics, Scheduler
from kvbudget.units import format_bytes


@dataclass
class ServeBenchConfig:
    """One ``bench serve`` run: ``methods`` (specs; ``full`` the baseline) at ``ratio`` (kvpress's
    compression ratio: the fraction of the prompt removed) under ``cap_bytes`` (``None``: two full
    conversations), ``clients`` concurrent clients, ``requests`` prompts per method."""

    model: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    task: str = "needle"
    length: int = 8192
    methods: list[str] = field(default_factory=lambda: ["full", "snapkv", "ada-snapkv"])
    ratio: float = 0.875
    cap_bytes: int | None = None
    clients: int = 10
    requests: int = 10
    max_tokens: int | None = None
    ignore_eos: bool = False
    time_limit_s: float = 1800.0
    seed: int = 0
    openvino_python: str | None = None
    openvino_model: str | None = None
    device: str = "cpu"
    random_weights: bool = False
    llama_server: str | None = None
    llama_cache_types: list[str] = field(default_factory=lambda: ["f16", "q8_0", "q4_0"])
    llama_threads: int = 2
    chunk_tokens: int | None = 1024


class _Counting(Metrics):
    """Decode steps' tokens and seconds (the decode rate), beside Prometheus."""

    def __init__(self, inner: Metrics) -> None:
        self.inner, self.step_tokens, self.step_seconds = inner, 0, 0.0

    def ttft(self, seconds: float) -> None:
        self.inner.ttft(seconds)

    def tpot(self, seconds: float) -> None:
        self.step_seconds += seconds
        self.inner.tpot(seconds)

    def tokens(self, count: int) -> None:
        self.step_tokens += count
        self.inner.tokens(count)


def stream_request(
    base: str, body: dict[str, Any], timeout: float, path: str = "/v1/completions"
) -> dict[str, Any]:
    """Send one streamed completion (or chat completion, ``path="/v1/chat/completions"``); returns
    its text, TTFT, TPOT and usage (or its error)."""
    try:
        return _stream_once(base, body, timeout, path)
    except OSError as exc:  # a wait past ``timeout`` or a dropped connection: this request's error
        return {"error": f"{type(exc).__name__}: {exc}"}


def _stream_once(base: str, body: dict[str, Any], timeout: float, path: str) -> dict[str, Any]:
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    start = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        error = json.loads(response.read() or b"{}").get("error", {}).get("message", "")
        conn.close()
        return {"error": f"HTTP {response.status}: {error}"}
    text, first, last, usage, chunks = [], None, None, {}, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            conn.close()
            return {"error": event["error"]["message"]}
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            if piece:
                now = time.perf_counter()
                first = first if first is not None else now
                last, chunks = now, chunks + 1
                text.append(piece)
    conn.close()
    tokens = usage.get("completion_tokens", chunks)
    tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    return {"text": "".join(text), "ttft_s": None if first is None else first - start, "tpot_s": tpot,
            "usage": usage}  # fmt: skip


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_one(
    model, tokenizer, config: ServeBenchConfig, method: str, cap: int, samples: list, task
) -> dict[str, Any]:
    """One method under the cap: its scheduler and server, the clients, the row."""
    compression = compression_of(method, config.ratio)
    registry, prometheus = prometheus_metrics()
    counting = _Counting(prometheus)
    scheduler = Scheduler(model, tokenizer, cap, compression, max_queue=max(64, config.requests),
                          keep_turns=False, metrics=counting, chunk_tokens=config.chunk_tokens)  # fmt: skip
    pending = list(range(len(samples)))
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    deadline = time.monotonic() + config.time_limit_s

    def client(base: str) -> None:
        while time.monotonic() < deadline:
            with lock:
                if not pending:
                    return
                i = pending.pop(0)
            sample = samples[i]
            prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
            max_tokens = config.max_tokens or sample.max_new_tokens
            body = {"model": "bench", "prompt": prompt.ids, "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True},
                    "kvbudget": {"ignore_eos": config.ignore_eos or config.random_weights}}  # fmt: skip
            out = stream_request(base, body, timeout=max(60.0, deadline - time.monotonic()))
            if "text" in out and not config.random_weights:  # random weights answer nothing
                out["score"] = float(task.metric(out["text"], sample.answers))
            with lock:
                results.append({"sample": i, **out})

    start = time.perf_counter()
    with serving(create_app(scheduler, "bench", registry)) as base:
        threads = [threading.Thread(target=client, args=(base,)) for _ in range(config.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - start
    done = [r for r in results if "text" in r]
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in done)
    ttft = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in done if r["tpot_s"] is not None]
    scored = [r for r in done if "score" in r]  # none with random weights
    return {
        "method": method, "compression": compression.label(), "cap_bytes": cap,
        "answered": len(done), "errors": [r["error"] for r in results if "error" in r][:5],
        "held_at_once": scheduler.peak_active, "peak_kv_bytes": scheduler.peak_held_bytes,
        "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
        "decode_tokens_per_s": counting.step_tokens / max(counting.step_seconds, 1e-9),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        "accuracy": statistics.fmean(r["score"] for r in scored) if scored else None,
    }  # fmt: skip


def compression_of(method: str, ratio: float) -> Compression:
    """A bench method spec as the server's :class:`Compression`: ``full`` keeps everything, a byte
    budget (``:memory=f``) has no ratio, any other method runs at kvpress ``ratio``; ``:kv_bits=b``
    stores what is kept at ``b`` bits."""
    return Compression.from_spec(method, ratio=1.0 - ratio)


def default_cap(model, tokenizer, config: ServeBenchConfig, samples: list) -> int:
    """KV bytes two full-cache conversations of the longest prompt need at their peak."""
    longest = max(
        samples, key=lambda s: len(build_prompt(tokenizer, s.context, s.question, s.answer_prefix).ids)
    )
    ids = build_prompt(tokenizer, longest.context, longest.question, longest.answer_prefix).ids
    seq = make_sequence(ids, config.max_tokens or longest.max_new_tokens, {0}, Compression("full"))
    return 2 * prefill_peak_bytes(model, seq)


def run_serve_bench(config: ServeBenchConfig, out: Path, model=None, tokenizer=None, progress=print) -> Path:
    """Run every method of ``config``; writes ``out/serve.json`` and ``out/serve.md``."""
    if not 0.0 <= config.ratio < 1.0:
        raise InputError(f"--ratio is kvpress's compression ratio, in [0, 1), got {config.ratio}")
    if config.clients < 1 or config.requests < 1:
        raise InputError("--clients and --requests must be ≥ 1")
    if config.random_weights and config.openvino_python:
        raise InputError("--random-weights with --openvino: OpenVINO's model has the real weights; run one")
    if config.openvino_python:  # before the kvbudget rows, not after them
        from kvbudget.peer.openvino import check_environment

        check_environment(config.openvino_python, _openvino_ir_dir(config), config.model)
    if config.llama_server:
        if config.random_weights:
            raise InputError(
                "--random-weights with --llama-server: llama.cpp's model has the real weights; run one"
            )
        from kvbudget.peer.llama_cpp import check_binary, check_cache_types

        check_binary(config.llama_server)
        check_cache_types(config.llama_cache_types)
        _gguf(config.model)
    for method in config.methods:
        compression_of(method, config.ratio)  # a bad spec fails before the model loads
    task = get_task(config.task)
    if model is None:
        from kvbudget.models import load_model

        model, tokenizer = load_model(
            config.model, dtype=config.dtype, device=config.device, random_weights=config.random_weights
        )
    config = replace(config, device=str(model.device))  # where it ran ("auto" resolved)
    samples = list(task.make_samples(tokenizer, config.length, config.requests, config.seed))
    cap = config.cap_bytes or default_cap(model, tokenizer, config, samples)
    rows = []
    for method in config.methods:
        progress(f"bench serve: {method} under a cap of {format_bytes(cap)} ({config.requests} requests, "
                 f"{config.clients} clients)")  # fmt: skip
        rows.append(run_one(model, tokenizer, config, method, cap, samples, task))
        progress(f"  held {rows[-1]['held_at_once']} at once, {rows[-1]['tokens_per_s']:.2f} tok/s")
    out.mkdir(parents=True, exist_ok=True)
    if config.openvino_python:
        progress(f"bench serve: OpenVINO GenAI (full, eviction) under a cap of {format_bytes(cap)}")
        rows.extend(run_openvino(model, tokenizer, config, cap, samples, task, out))
    if config.llama_server:
        rows.extend(run_llama(model, tokenizer, config, cap, samples, task, out, progress))
    (out / "serve.json").write_text(
        json.dumps({"config": asdict(config), "cap_bytes": cap, "rows": rows}, indent=1)
    )
    (out / "serve.md").write_text(markdown(config, cap, rows))
    return out / "serve.md"


def run_openvino(
    model, tokenizer, config: ServeBenchConfig, cap: int, samples: list, task, out: Path
) -> list[dict[str, Any]]:
    """The same prompts (ids, answer lengths, EOS ids) through OpenVINO GenAI's runner: its rows."""
    from kvbudget.peer.openvino import PRECISIONS, run_runner

    eos = sorted(eos_ids(model, tokenizer))
    prompts = []
    for i, s in enumerate(samples):
        ids = build_prompt(tokenizer, s.context, s.question, s.answer_prefix).ids
        max_new_tokens = config.max_tokens or s.max_new_tokens
        prompts.append({"id": i, "input_ids": list(ids), "max_new_tokens": max_new_tokens, "eos_ids": eos,
                        "ignore_eos": config.ignore_eos})  # fmt: skip
    document = run_runner(
        config.openvino_python, _openvino_ir_dir(config), prompts, cap, keep_fraction=1.0 - config.ratio,
        concurrency=config.clients, precision=PRECISIONS[config.dtype], workdir=out,
        timeout_s=2 * config.time_limit_s + 600,
    )  # fmt: skip
    answers = {i: s.answers for i, s in enumerate(samples)}

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return openvino_rows(document, answers, decode, task.metric)


def _gguf(model_name: str) -> Path:
    """The registry model's GGUF file (what llama.cpp serves), or a one-line error."""
    from kvbudget.models import MODELS, model_dir

    if model_name not in MODELS:
        raise InputError(f"--llama-server serves a registry model's GGUF file; {model_name} is not one")
    path = model_dir(model_name) / MODELS[model_name].gguf_filename
    if not path.is_file():
        raise InputError(f"no GGUF file at {path}: run `kvbudget fetch model {model_name}` first")
    return path


def run_llama(
    model, tokenizer, config: ServeBenchConfig, cap: int, samples: list, task, out: Path, progress=print
) -> list[dict[str, Any]]:
    """The same prompts (token ids, answer lengths) through ``llama-server``, once per cache type,
    as many slots as the cap holds at that type: its rows."""
    from kvbudget.peer import llama_cpp

    binary, gguf = llama_cpp.check_binary(config.llama_server), _gguf(config.model)
    prompts = []
    for i, s in enumerate(samples):
        ids = build_prompt(tokenizer, s.context, s.question, s.answer_prefix).ids
        new_tokens = config.max_tokens or s.max_new_tokens
        prompts.append({"id": i, "input_ids": list(ids), "max_new_tokens": new_tokens,
                        "ignore_eos": config.ignore_eos})  # fmt: skip
    longest = max(len(p["input_ids"]) + p["max_new_tokens"] for p in prompts)
    build = llama_cpp.version(binary)
    answers = {i: s.answers for i, s in enumerate(samples)}
    rows = []
    for cache_type in config.llama_cache_types:
        per_token = llama_cpp.token_bytes(model.config, cache_type)
        plan = llama_cpp.plan_slots(cap, longest, per_token, config.clients, cache_type)
        progress(f"bench serve: llama.cpp ({cache_type}), {plan.slots} slots of {plan.slot_tokens} tokens "
                 f"({format_bytes(plan.kv_bytes)}) under a cap of {format_bytes(cap)}")  # fmt: skip
        run = llama_cpp.run_server(
            binary, gguf, plan, prompts, clients=config.clients, threads=config.llama_threads,
            log=out / f"llama-{cache_type}.log", timeout_s=config.time_limit_s,
        )  # fmt: skip
        rows.append(
            llama_row(run, plan, cap, answers, task.metric, f"{build}, {gguf.name}", config.llama_threads)
        )
    return rows


def llama_row(
    run: dict[str, Any],
    plan,
    cap: int,
    answers: dict[int, list[str]],
    metric: Callable[[str, list[str]], float],
    served: str,
    threads: int,
) -> dict[str, Any]:
    """The row of one ``llama-server`` run (:func:`kvbudget.peer.llama_cpp.run_server`) of ``plan``
    (a :class:`~kvbudget.peer.llama_cpp.SlotPlan`): a request that failed is an error, not an
    answer; llama.cpp allocates the plan's KV up front, which is its peak; ``served`` names the build
    and the GGUF file."""
    done = [r for r in run["requests"] if "error" not in r]
    scores = [float(metric(r["text"], answers[r["id"]])) for r in done]
    ttft = [r["ttft_s"] for r in done if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in done if r.get("tpot_s") is not None]
    tokens, wall = sum(len(r["token_ids"]) for r in done), run["wall_s"]
    kind = plan.cache_type
    return {
        "method": f"llama.cpp:{kind}", "compression": f"llama.cpp ({kind})", "cap_bytes": cap,
        "answered": len(done), "errors": [r["error"] for r in run["requests"] if "error" in r][:5],
        "held_at_once": run["held_at_once"], "peak_kv_bytes": plan.kv_bytes, "tokens": tokens,
        "wall_s": wall, "tokens_per_s": tokens / wall if wall else None, "decode_tokens_per_s": None,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        "accuracy": statistics.fmean(scores) if scores else None,
        "note": (f"llama.cpp ({kind}): llama-server {served} as it is (its 4-bit weights, not "
                 f"dequantized), {plan.slots} slots of {plan.slot_tokens} tokens, KV {kind} allocated up "
                 f"front ({format_bytes(plan.kv_bytes)}), flash attention on, prompt cache off, "
                 f"{threads} threads."),
    }  # fmt: skip


def _openvino_ir_dir(config: ServeBenchConfig) -> Path | None:
    from kvbudget.peer.openvino import default_ir_dir

    return Path(config.openvino_model) if config.openvino_model else default_ir_dir(config.model)


def openvino_rows(
    document: dict[str, Any],
    answers: dict[int, list[str]],
    decode: Callable[[list[int]], str],
    metric: Callable[[str, list[str]], float],
) -> list[dict[str, Any]]:
    """One row per mode of the OpenVINO runner's ``document`` (:mod:`kvbudget.peer.openvino_runner`):
    ``answers`` by prompt id, ``decode`` token ids to text, ``metric`` the task's score. A request the
    pipeline did not finish (``IGNORED``: its pool could not hold it) is an error, not an answer; the
    runner times no decode step apart from prefill chunks, so ``decode_tokens_per_s`` is None."""
    rows = []
    for run in document["runs"]:
        done = [r for r in run["requests"] if "error" not in r]
        scores = [float(metric(decode(r["token_ids"]), answers[r["id"]])) for r in done]
        ttft = [r["ttft_s"] for r in done if r.get("ttft_s") is not None]
        tpot = [r["tpot_s"] for r in done if r.get("tpot_s") is not None]
        tokens, wall = sum(len(r["token_ids"]) for r in done), run["wall_s"]
        rows.append({
            "method": f"openvino:{run['mode']}", "compression": f"openvino ({run['mode']})",
            "cap_bytes": document["cap_bytes"], "answered": len(done),
            "errors": [r["error"] for r in run["requests"] if "error" in r][:5],
            "held_at_once": run["held_at_once"], "peak_kv_bytes": run["peak_kv_bytes"], "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall if wall else None, "decode_tokens_per_s": None,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
            "accuracy": statistics.fmean(scores) if scores else None, "note": _openvino_note(document, run),
        })  # fmt: skip
    return rows


def _openvino_note(document: dict[str, Any], run: dict[str, Any]) -> str:
    """What an OpenVINO row ran: the pipeline, its KV pool and its eviction settings."""
    note = (
        f"openvino ({run['mode']}): OpenVINO GenAI {document['versions']['openvino_genai']} "
        f"ContinuousBatchingPipeline on {document['device']}, KV pool of {run['num_kv_blocks']} blocks of "
        f"{run['block_size']} tokens ({format_bytes(run['pool_bytes'])}, {document['kv_precision']})"
    )
    eviction = run.get("cache_eviction")
    if eviction:
        note += (
            f", CacheEvictionConfig keeping {eviction['max_cache_size']} tokens per sequence (start "
            f"{eviction['start_size']}, recent {eviction['recent_size']}), {run['aggregation']}, "
            f"snapkv_window_size {eviction['snapkv_window_size']}"
        )
    return note + "."


def _f(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def markdown(config: ServeBenchConfig, cap: int, rows: list[dict[str, Any]]) -> str:
    """The table ``docs/serving.md`` shows."""
    weights = ", random weights: no accuracy" if config.random_weights else ""
    lines = [
        f"`kvbudget bench serve`: {config.model} ({config.dtype}{weights}) on {config.device}, "
        f"{config.task} at {config.length} tokens, "
        f"{config.clients} clients, {config.requests} requests per method, KV cap {format_bytes(cap)}, "
        f"compressed methods at kvpress ratio {config.ratio}.",
        "",
        "| method | held at once | peak KV | tok/s (run) | tok/s (decode steps) | TTFT p50 / p99 | "
        "TPOT p50 / p99 | accuracy | answered |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['compression']} | {r['held_at_once']} | {format_bytes(r['peak_kv_bytes'])} | "
            f"{_f(r['tokens_per_s'], '.2f')} | {_f(r['decode_tokens_per_s'], '.2f')} | "
            f"{_f(r['ttft_p50_s'], '.1f')} / {_f(r['ttft_p99_s'], '.1f')} s | "
            f"{_f(r['tpot_p50_s'] and r['tpot_p50_s'] * 1000, '.0f')} / "
            f"{_f(r['tpot_p99_s'] and r['tpot_p99_s'] * 1000, '.0f')} ms | "
            f"{'—' if r['accuracy'] is None else format(r['accuracy'] * 100, '.0f') + '%'} | "
            f"{r['answered']} |"
        )
    notes = [r["note"] for r in rows if r.get("note")]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"
