"""llama.cpp's own server beside kvbudget's: ``llama-server`` (built by ``make llama`` into
``.llama/bin``) serving the registry model's GGUF file under the same KV cap, its KV cache at f16,
q8_0 or q4_0, driven by ``kvbudget bench serve --llama-server PATH`` with the same prompts (token ids)
as kvbudget's rows.

llama.cpp allocates its KV cache up front: ``--ctx-size`` tokens, split evenly between ``--parallel``
slots (``--no-kv-unified``), each slot one conversation. Under a cap of ``C`` bytes it therefore
holds as many conversations at once as fit — ``slots × (longest prompt + its answer)`` tokens,
rounded up to 256, times the bytes a token takes — and the rest wait in its queue. A token's KV
bytes at a cache type: layers × KV heads × head size × 2 (keys and values) × the type's bytes an
element — f16 2, q8_0 34/32 (blocks of 32 int8 codes and an f16 scale), q4_0 18/32 (32 4-bit
codes and an f16 scale; keys are blocked along a token's channels, not per channel as KIVI's).
Quantized values need flash attention (``--flash-attn on``, used for every type alike).

What differs from kvbudget's rows, and is said beside them: llama.cpp computes with the GGUF's
4-bit weights as they are (kvbudget dequantizes them to bf16), so its answers may differ; its prompt
cache is off (``--cache-ram 0``, ``cache_prompt: false``): nothing is reused between requests.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbudget.errors import InputError, KVBudgetError

#: bytes an element of the KV cache takes at each llama.cpp cache type (ggml's block layouts)
CACHE_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
#: llama.cpp pads a slot's context to this many tokens
CTX_PAD = 256


def check_binary(path: str | os.PathLike[str]) -> Path:
    """The ``llama-server`` executable at ``path``, or a one-line error saying how to build it."""
    binary = Path(path)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise InputError(
            f"no llama-server at {binary}: build it once with `make llama` (.llama/bin/llama-server)"
        )
    return binary


def check_cache_types(types: Sequence[str]) -> list[str]:
    """The cache types named, each one llama.cpp serves here, or a one-line error."""
    unknown = [t for t in types if t not in CACHE_TYPE_BYTES]
    if unknown or not types:
        raise InputError(f"--llama-cache-types takes {', '.join(CACHE_TYPE_BYTES)}; got {', '.join(types)}")
    return list(types)


def token_bytes(config: Any, cache_type: str) -> float:
    """KV bytes one token takes in llama.cpp's cache of a model with this (transformers) ``config``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * heads * head_dim * 2 * CACHE_TYPE_BYTES[cache_type]


@dataclass(frozen=True)
class SlotPlan:
    """``slots`` conversations sharing ``ctx`` tokens (``ctx // slots`` each), ``kv_bytes``
    allocated."""

    cache_type: str
    slots: int
    ctx: int
    kv_bytes: int

    @property
    def slot_tokens(self) -> int:
        return self.ctx // self.slots


def _padded(tokens: int) -> int:
    return -(-tokens // CTX_PAD) * CTX_PAD


def plan_slots(
    cap_bytes: int, longest_tokens: int, per_token: float, clients: int, cache_type: str
) -> SlotPlan:
    """As many slots of ``longest_tokens`` as the cap holds (at most ``clients``), the context they
    share rounded up to :data:`CTX_PAD` tokens within the cap; an error when it holds none."""
    slots = 0
    while slots < clients and _padded((slots + 1) * longest_tokens) * per_token <= cap_bytes:
        slots += 1
    if slots < 1:
        need = _padded(longest_tokens) * per_token
        raise InputError(
            f"the cap ({cap_bytes} bytes) holds no {longest_tokens}-token conversation in llama.cpp's "
            f"{cache_type} cache ({need:.0f} bytes)"
        )
    ctx = _padded(slots * longest_tokens)
    return SlotPlan(cache_type, slots, ctx, int(ctx * per_token))


def server_command(binary: Path, gguf: Path, port: int, plan: SlotPlan, threads: int) -> list[str]:
    """``llama-server``'s command line for ``plan`` on 127.0.0.1:``port``."""
    return [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(plan.ctx), "--parallel", str(plan.slots), "--no-kv-unified",
            "--cache-type-k", plan.cache_type, "--cache-type-v", plan.cache_type, "--flash-attn", "on",
            "--threads", str(threads), "--threads-batch", str(threads), "--cache-ram", "0",
            "--fit", "off", "--no-webui", "--slots"]  # fmt: skip


def parse_stream(lines: Sequence[bytes], start: float, clock: Callable[[], float]) -> dict[str, Any]:
    """One streamed ``/completion`` (server-sent events ``data: {...}``, read as they arrive):
    text, token ids, TTFT and TPOT as timed by ``clock`` from ``start``."""
    text, tokens, first, last = [], [], None, None
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            return {"error": event["error"].get("message", str(event["error"]))}
        new = event.get("tokens") or []
        if new:
            now = clock()
            first = now if first is None else first
            last = now
            tokens.extend(new)
        text.append(event.get("content", ""))
    n = len(tokens)
    return {"text": "".join(text), "token_ids": tokens, "ttft_s": None if first is None else first - start,
            "tpot_s": (last - first) / (n - 1) if n > 1 else None}  # fmt: skip


def _post_stream(port: int, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One streamed ``/completion``; a refusal, a dropped connection or a wait past ``timeout``
    (a request queued behind slots that have not finished) is an error of that request, not lost."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    try:
        conn.request("POST", "/completion", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            message = response.read().decode(errors="replace")[:200]
            return {"error": f"HTTP {response.status}: {message}"}
        return parse_stream(response, start, time.perf_counter)
    except OSError as exc:  # socket timeouts included
        return {"error": f"{type(exc).__name__} after {time.perf_counter() - start:.0f} s: {exc}"}
    finally:
        conn.close()


def _get_json(port: int, path: str, timeout: float = 5.0) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return json.loads(response.read()) if response.status == 200 else None
    finally:
        conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-6:])
            raise KVBudgetError(f"llama-server stopped (exit {proc.returncode}):\n{tail}")
        try:
            if (_get_json(port, "/health", 2.0) or {}).get("status") == "ok":
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise KVBudgetError(f"llama-server was not ready in {timeout:.0f} s (log: {log})")


def run_server(
    binary: Path,
    gguf: Path,
    plan: SlotPlan,
    prompts: Sequence[dict[str, Any]],
    *,
    clients: int,
    threads: int,
    log: Path,
    timeout_s: float,
) -> dict[str, Any]:
    """Serve ``prompts`` (``id``, ``input_ids``, ``max_new_tokens``, ``ignore_eos``) from ``clients``
    threads through one ``llama-server`` of ``plan``; returns the requests' results, the wall time and
    the most slots busy at once (``/slots``, polled every 0.25 s)."""
    port = _free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(server_command(binary, gguf, port, plan, threads), stdout=out, stderr=out)
    try:
        _wait_ready(proc, port, log, 300.0)
        pending, results, lock = list(prompts), [], threading.Lock()
        busy, done = [0], threading.Event()
        deadline = time.monotonic() + timeout_s

        def client() -> None:
            while time.monotonic() < deadline:
                with lock:
                    if not pending:
                        return
                    p = pending.pop(0)
                body = {"prompt": p["input_ids"], "n_predict": p["max_new_tokens"], "stream": True,
                        "temperature": 0.0, "ignore_eos": p["ignore_eos"], "cache_prompt": False,
                        "return_tokens": True}  # fmt: skip
                out = _post_stream(port, body, max(60.0, deadline - time.monotonic()))
                with lock:
                    results.append({"id": p["id"], **out})

        def watch() -> None:
            while not done.wait(0.25):
                try:
                    slots = _get_json(port, "/slots") or []
                except OSError:
                    continue
                busy[0] = max(busy[0], sum(1 for s in slots if s.get("is_processing")))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        start = time.perf_counter()
        threads_ = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        wall = time.perf_counter() - start
        done.set()
        watcher.join()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"requests": results, "wall_s": wall, "held_at_once": busy[0]}


def version(binary: Path) -> str:
    """``llama-server --version``'s build line (``version: N (commit)``)."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")]
    return lines[0].split(":", 1)[1].strip() if lines else "unknown"
