"""``kvbudget bench serve --workload shared|multiturn``: many clients asking about one document.

One shared-context sample (``sc_keys`` by default: a ``length``-token context with four planted
facts and four questions about them, :mod:`kvbudget.eval.tasks.shared_context`) is served three
ways, each under the same KV cap, each row a fresh server in this process:

* ``document``: the document compressed once without a question (``POST /v1/kvbudget/documents``,
  the server's document method, default KVzip under a byte budget of 12.5%), every question a
  request naming it (the shared prefix, :mod:`kvbudget.serve.documents`);
* ``document:full``: the same sharing with the document uncompressed (a prefix cache as vLLM's and
  SGLang's: shared, full);
* ``per-request`` (``--methods``' first compressed method, SnapKV by default): each question a
  request carrying the whole document, compressed with that question in view, as without documents;
* ``document:reload``: the compressed document written to a cache directory by one server, which
  stops; a new server on the same directory answers — its first request loads the document from
  disk instead of prefilling and compressing it (``kvbudget serve --cache-dir``).

``clients`` clients each ask the sample's questions (each client starting at another one):
``shared`` as separate requests on the document (SCBench's multi-request), ``multiturn`` as one
conversation each (every question after the model's own earlier answers; the server reuses the
conversation's kept turn). The first request — the document's creation and a first question, alone
— is timed apart from the others, which all run concurrently. Reported per row: the KV bytes held at
the peak (the document's counted once), what the document itself takes, the first request's time and
the others' TTFT (p50, p99, max; their max against the first's), TPOT p50/p99, accuracy on the first
question and on the later ones (``multiturn``: on each conversation's first turn and its later
turns), the later ones' accuracy against ``document:full``'s, and every answer (client, turn,
question, score, text).
"""

from __future__ import annotations

import http.client
import json
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvbudget.bench.serve_load import percentile, stream_request
from kvbudget.errors import InputError
from kvbudget.eval.tasks import get_task
from kvbudget.serve import defaults
from kvbudget.serve.app import create_app, prometheus_metrics, serving
from kvbudget.serve.batcher import Compression
from kvbudget.serve.document_dir import DocumentDir
from kvbudget.serve.scheduler import Scheduler
from kvbudget.units import format_bytes

WORKLOADS = ("shared", "multiturn")
MODES = ("document", "document:reload", "document:full", "per-request")


@dataclass
class SharedBenchConfig:
    """One run: ``modes`` (``document``, ``document:full``, ``per-request``) of ``workload``."""

    model: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    workload: str = "shared"
    task: str = "sc_keys"
    length: int = 8192
    sample: int = 0
    clients: int = 8
    modes: list[str] = field(default_factory=lambda: list(MODES))
    document_method: str = defaults.DOCUMENT_METHOD
    per_request_method: str = "snapkv"
    ratio: float = 0.875
    cap_bytes: int = 1 << 30
    time_limit_s: float = 3600.0
    seed: int = 0
    device: str = "cpu"


def _questions(sample) -> list[tuple[str, list[str], int]]:
    first = [(sample.question, sample.answers, sample.max_new_tokens)]
    return first + [(f.question, f.answers, f.max_new_tokens) for f in sample.follow_ups]


def _body(mode: str, messages: list[dict], max_tokens: int, document: str | None, config) -> dict:
    body: dict[str, Any] = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if document is not None:
        body["kvbudget"] = {"document": document}
    else:
        body["kvbudget"] = {"method": config.per_request_method, "ratio": 1.0 - config.ratio}
    return body


def _ask_all(base: str, mode: str, config: SharedBenchConfig, sample, document: str | None,
             order: list[int], metric) -> list[dict]:  # fmt: skip
    """One client's questions in ``order``: separate requests (shared) or one conversation."""
    questions, out, history = _questions(sample), [], []
    for turn, q in enumerate(order):
        question, answers, max_tokens = questions[q]
        content = question if document is not None or (config.workload == "multiturn" and turn) else None
        if content is None:
            content = f"{sample.context}\n\n{question}"
        if config.workload == "multiturn":
            messages = [*history, {"role": "user", "content": content}]
        else:
            messages = [{"role": "user", "content": content}]
        body = _body(mode, messages, max_tokens, document, config)
        result = stream_request(base, body, config.time_limit_s,
                                "/v1/chat/completions")  # fmt: skip
        result.update(question=q, turn=turn)
        if "text" in result:
            result["score"] = float(metric(result["text"], answers))
            history = [*messages, {"role": "assistant", "content": result["text"]}]
        out.append(result)
    return out


def _scheduler(model, tokenizer, config: SharedBenchConfig, folder: Path | None = None):
    registry, metrics = prometheus_metrics()
    scheduler = Scheduler(
        model, tokenizer, config.cap_bytes, Compression("full"), max_queue=256, metrics=metrics,
        document_default=Compression.for_document(config.document_method),
        document_dir=DocumentDir(folder, 1 << 40) if folder is not None else None,
    )  # fmt: skip
    return scheduler, registry


def run_mode(model, tokenizer, config: SharedBenchConfig, mode: str, sample, metric) -> dict[str, Any]:
    """One row: a fresh server, the first request alone, then every client at once."""
    folder = Path(tempfile.mkdtemp(prefix="kvbudget-bench-docs-")) if mode == "document:reload" else None
    document, doc_info = None, None
    if folder is not None:  # made and written by a server that then stops
        scheduler, registry = _scheduler(model, tokenizer, config, folder)
        with serving(create_app(scheduler, "bench", registry)) as base:
            doc_info = _post_json(
                base, "/v1/kvbudget/documents", {"text": sample.context}, config.time_limit_s
            )
            document = doc_info["id"]
    scheduler, registry = _scheduler(model, tokenizer, config, folder)
    n = len(_questions(sample))
    with serving(create_app(scheduler, "bench", registry)) as base:
        start = time.perf_counter()
        if mode in ("document", "document:full"):
            body: dict[str, Any] = {"text": sample.context}
            if mode == "document:full":
                body["method"] = "full"
            doc_info = _post_json(base, "/v1/kvbudget/documents", body, config.time_limit_s)
            document = doc_info["id"]
        first = _ask_all(base, mode, config, sample, document, [0], metric)[0]
        first_s = time.perf_counter() - start
        results: list[dict] = []
        lock = threading.Lock()

        def client(c: int) -> None:
            order = [(c + i) % n for i in range(n)]
            if c == 0:
                order = order[1:]  # its first question was the first request
            got = [{**r, "client": c} for r in _ask_all(base, mode, config, sample, document, order, metric)]
            with lock:
                results.extend(got)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(config.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = scheduler.stats()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    done = [r for r in results if "text" in r]
    ttft = [r["ttft_s"] for r in done if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in [first, *done] if r.get("tpot_s") is not None]
    scored = [r for r in [{**first, "client": None}, *done] if "score" in r]
    asked_first = [r for r in scored if r["question"] == 0]
    later = [r for r in scored if r["question"] != 0]
    return {
        "mode": mode, "label": _label(mode, config), "requests": 1 + len(results),
        "answered": int("text" in first) + len(done),
        "errors": [r["error"] for r in [first, *results] if "error" in r][:5],
        "peak_kv_bytes": scheduler.peak_held_bytes, "document_bytes": doc_info["kv_bytes"] if doc_info else 0,
        "held_after_bytes": stats["held_bytes"], "compress_s": doc_info["compress_s"] if doc_info else None,
        "first_s": first_s, "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_max_s": max(ttft) if ttft else None,
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        "accuracy_first_question": _mean(asked_first), "accuracy_later_questions": _mean(later),
        "accuracy_first_turn": _mean([r for r in scored if r["turn"] == 0]),
        "accuracy_later_turns": _mean([r for r in scored if r["turn"] > 0]),
        "answers": [{k: r.get(k) for k in ("client", "turn", "question", "score", "text")} for r in scored],
    }  # fmt: skip


def _mean(rows: list[dict]) -> float | None:
    return statistics.fmean(r["score"] for r in rows) if rows else None


def _label(mode: str, config: SharedBenchConfig) -> str:
    if mode == "per-request":
        return f"{config.per_request_method} per request (ratio={1 - config.ratio:g})"
    if mode == "document:full":
        return "shared document, full (prefix cache)"
    if mode == "document:reload":
        return f"shared document, {config.document_method}, loaded from --cache-dir after a restart"
    return f"shared document, {config.document_method}"


def _post_json(base: str, path: str, body: dict, timeout: float) -> dict:
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    data = json.loads(response.read() or b"{}")
    conn.close()
    if response.status != 200:
        raise InputError(f"{path}: HTTP {response.status}: {data.get('error', {}).get('message', '')}")
    return data


def run_shared_bench(
    config: SharedBenchConfig, out: Path, model=None, tokenizer=None, progress=print
) -> Path:
    """Every mode of ``config``; writes ``out/serve-shared.json`` and ``out/serve-shared.md``."""
    if config.workload not in WORKLOADS:
        raise InputError(f"--workload takes needle, {', '.join(WORKLOADS)}; got {config.workload!r}")
    unknown = [m for m in config.modes if m not in MODES]
    if unknown or not config.modes:
        raise InputError(f"modes are {', '.join(MODES)}; got {', '.join(config.modes)}")
    if config.clients < 1:
        raise InputError("--clients must be ≥ 1")
    # a bad spec fails before the model loads
    Compression.for_document(config.document_method)
    task = get_task(config.task)
    if model is None:
        from kvbudget.models import load_model

        model, tokenizer = load_model(config.model, dtype=config.dtype, device=config.device)
    config = replace(config, device=str(model.device))
    samples = list(task.make_samples(tokenizer, config.length, config.sample + 1, config.seed))
    sample = samples[config.sample]
    if not sample.follow_ups:
        raise InputError(
            f"--workload {config.workload} needs a shared-context task (sc_keys, …), not {task.name}"
        )
    rows = []
    for mode in config.modes:
        progress(f"bench serve --workload {config.workload}: {mode}, {config.clients} clients")
        rows.append(run_mode(model, tokenizer, config, mode, sample, task.metric))
    full = next((r for r in rows if r["mode"] == "document:full"), None)
    later = _later_key(config)
    for r in rows:
        base = full and full[later]
        r["later_vs_full"] = r[later] / base if base and r[later] is not None else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve-shared.json").write_text(json.dumps({"config": asdict(config), "rows": rows}, indent=1))
    (out / "serve-shared.md").write_text(markdown(config, rows))
    return out / "serve-shared.md"


def _later_key(config: SharedBenchConfig) -> str:
    """What "later" means: a conversation's turns after its first (``multiturn``), else the questions
    after the document's first (``shared``: every request is a first turn)."""
    return "accuracy_later_turns" if config.workload == "multiturn" else "accuracy_later_questions"


def _f(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, fmt)


def markdown(config: SharedBenchConfig, rows: list[dict]) -> str:
    later = _later_key(config)
    first, unit = (
        ("accuracy_first_turn", "turn")
        if config.workload == "multiturn"
        else ("accuracy_first_question", "question")
    )
    lines = [
        f"`kvbudget bench serve --workload {config.workload}`: {config.model} ({config.dtype}) on "
        f"{config.device}, "
        f"{config.task} sample {config.sample} at {config.length} tokens, {config.clients} clients × "
        f"{rows[0]['requests'] // max(1, config.clients) if rows else 0} questions, KV cap "
        f"{format_bytes(config.cap_bytes)}.",
        "",
        "| serving | peak KV | document | first request | later TTFT p50 / p99 / max | max later ÷ first "
        f"| TPOT p50 / p99 | first {unit} | later {unit}s | later vs shared full | answered |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["ttft_max_s"] / r["first_s"] if r["ttft_max_s"] is not None and r["first_s"] else None
        lines.append(
            f"| {r['label']} | {format_bytes(r['peak_kv_bytes'])} | {format_bytes(r['document_bytes'])} "
            f"| {_f(r['first_s'], '.1f')} s | {_f(r['ttft_p50_s'], '.2f')} / {_f(r['ttft_p99_s'], '.2f')} / "
            f"{_f(r['ttft_max_s'], '.2f')} s | {_f(ratio, '.0%', 1)} "
            f"| {_f(r['tpot_p50_s'], '.0f', 1000)} / {_f(r['tpot_p99_s'], '.0f', 1000)} ms "
            f"| {_f(r.get(first), '.0f', 100)}% "
            f"| {_f(r.get(later), '.0f', 100)}% "
            f"| {_f(r['later_vs_full'], '.0%', 1)} | {r['answered']} / {r['requests']} |"
        )
    return "\n".join(lines) + "\n"
