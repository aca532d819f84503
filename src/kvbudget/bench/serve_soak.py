"""``kvbudget bench serve --soak``: a bounded soak of ``kvbudget serve`` on 127.0.0.1.

A server runs in this process (the real HTTP app on a free port) under a small KV cap while
``clients`` threads, each with its own seeded random stream, send for ``seconds``: chat requests of
random lengths with random methods and sizes (some refused as too small for their method: a 400 is
an answer too), streamed requests, streams the client drops after a chunk or two, follow-ups that
continue a conversation (its kept turn reused), and bad requests (from :data:`BAD_BODIES`). After a
warm-up (the same traffic for a third of ``seconds``: the C allocator's arenas and torch's kernels
grow to a plateau over the shapes they see, with or without the server) the process's resident
memory is read; when the clients stop and the server has drained, it is read again. Both readings
are taken with the kept turns dropped (:meth:`~kvbudget.serve.scheduler.Scheduler.drop_kept_turns`):
what the cap lets the server keep is not a leak; what stays once they are gone would be.

Checked, and written to ``soak.json`` / ``soak.md``: no request got a 5xx or was lost (every good
request answered whole, or refused with a 4xx or 429), no sequence left active or queued, the KV
bytes held are exactly the kept turns' and no other cache is alive, and the resident memory is
within :data:`RSS_TOLERANCE` of the warm-up's.
"""

from __future__ import annotations

import gc
import http.client
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvbudget.cache import BudgetCache
from kvbudget.engine import DEFAULT_BUDGET
from kvbudget.errors import InputError
from kvbudget.serve.app import create_app, serving
from kvbudget.serve.batcher import Compression
from kvbudget.serve.scheduler import Scheduler
from kvbudget.units import format_bytes

#: the resident memory after the soak may exceed the warm-up's by this fraction at most
RSS_TOLERANCE = 0.10
#: a soak runs this long at most (the suite's and CI's bound)
MAX_SECONDS = 600.0
WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars keep watch above quiet "
         "hills and rivers run toward the distant sea").split()  # fmt: skip
#: requests a careless or hostile client sends (each must get a 4xx)
BAD_BODIES: tuple[bytes, ...] = (
    b"{not json",
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "MODEL", "messages": [{"role": "usr", "content": "hi"}]}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "logprobs": true}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
    + b"9" * 5000
    + b"}",
    b'{"model": "MODEL", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "kvbudget": {"ratio": 0}}',
    b'{"model": "other", "messages": [{"role": "user", "content": "hi"}]}',
    b"[]",
)


@dataclass
class SoakConfig:
    """One soak: ``methods`` (specs) at random sizes, prompts of ``min_words``–``max_words`` words,
    answers of up to ``max_tokens``, ``clients`` threads for ``seconds`` under ``cap_bytes``."""

    methods: list[str] = field(default_factory=lambda: ["full", "snapkv", "h2o", "streamingllm", "asl"])
    ratios: tuple[float, ...] = (0.125, 0.25, 0.5)
    budgets: tuple[int, ...] = (64, 128)
    min_words: int = 2
    max_words: int = 400
    max_tokens: int = 24
    clients: int = 6
    seconds: float = 120.0
    #: the warm-up's traffic before the first memory reading (default: a third of ``seconds``)
    warmup_seconds: float | None = None
    cap_bytes: int = 64 << 20
    max_body: int = 256 << 10
    seed: int = 0

    def check(self) -> None:
        total = self.seconds + (self.warmup_seconds if self.warmup_seconds is not None else self.seconds / 3)
        if not 0 < self.seconds or total > MAX_SECONDS:
            raise InputError(
                f"a soak and its warm-up run for (0, {MAX_SECONDS:.0f}] seconds, got {total:.0f}"
            )
        if self.clients < 1 or not self.methods:
            raise InputError("a soak needs at least one client and one method")
        if not 1 <= self.min_words <= self.max_words:
            raise InputError(
                f"prompt words must satisfy 1 ≤ min ≤ max, got {self.min_words}, {self.max_words}"
            )


def resident_bytes() -> int | None:
    """This process's resident memory (Linux's ``/proc/self/statm``), or ``None`` elsewhere."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


class SoakClient:
    """One client thread's requests and what came back, by kind of request and status."""

    def __init__(self, base: str, model_name: str, config: SoakConfig, seed: int) -> None:
        url = urlparse(base)
        self.host, self.port, self.model_name, self.config = url.hostname, url.port, model_name, config
        self.rng = random.Random(seed)
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.problems: list[str] = []
        self.reused_tokens = 0
        self.history: list[dict[str, str]] | None = None
        self.follow_options: dict[str, Any] = {}

    # ------------------------------------------------------------------ requests
    def words(self) -> str:
        n = self.rng.randint(self.config.min_words, self.config.max_words)
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def kvbudget(self) -> dict[str, Any]:
        method = self.rng.choice(self.config.methods)
        if method == "full":
            return {"method": method}
        if self.rng.random() < 0.5:
            return {"method": method, "ratio": self.rng.choice(self.config.ratios)}
        return {"method": method, "budget": self.rng.choice(self.config.budgets)}

    def body(self, messages: list[dict[str, str]], stream: bool, options: dict[str, Any]) -> bytes:
        body = {"model": self.model_name, "messages": messages, "stream": stream, "kvbudget": options,
                "max_tokens": self.rng.randint(1, self.config.max_tokens)}  # fmt: skip
        return json.dumps(body).encode()

    def post(self, raw: bytes) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        conn.request("POST", "/v1/chat/completions", raw, {"content-type": "application/json"})
        return conn, conn.getresponse()

    def one(self) -> None:
        kind = self.rng.choices(["whole", "stream", "drop", "follow", "bad"], weights=[4, 3, 2, 2, 2])[0]
        try:
            getattr(self, f"send_{kind}")()
        except (OSError, http.client.HTTPException, ValueError) as exc:  # lost: nothing came back
            self.outcomes[(kind, "lost")] += 1
            self.problems.append(f"{kind}: {type(exc).__name__}: {exc}")

    def note(self, kind: str, status: int, body: bytes | str) -> None:
        self.outcomes[(kind, str(status))] += 1
        if status >= 500:
            self.problems.append(f"{kind}: HTTP {status}: {str(body)[:200]}")

    def send_whole(self, messages: list[dict[str, str]] | None = None, kind: str = "whole") -> str | None:
        messages = messages or [{"role": "user", "content": self.words()}]
        conn, response = self.post(self.body(messages, False, self.kvbudget() if kind != "follow" else
                                             self.follow_options))  # fmt: skip
        data = response.read()
        conn.close()
        self.note(kind, response.status, data)
        if response.status != 200:
            return None
        answer = json.loads(data)
        self.reused_tokens += answer["usage"]["kvbudget"]["reused_tokens"]
        if answer["choices"][0]["finish_reason"] not in ("stop", "length"):
            self.problems.append(f"{kind}: an answer without its end")
        return answer["choices"][0]["message"]["content"]

    def send_stream(self) -> None:
        conn, response = self.post(
            self.body([{"role": "user", "content": self.words()}], True, self.kvbudget())
        )
        if response.status != 200:
            self.note("stream", response.status, response.read())
            conn.close()
            return
        text = response.read().decode()
        conn.close()
        done = text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        self.note("stream", 200 if done else 500, text[-200:])

    def send_drop(self) -> None:
        conn, response = self.post(
            self.body([{"role": "user", "content": self.words()}], True, self.kvbudget())
        )
        if response.status == 200:
            response.readline()  # the first event, then the client goes away mid-answer
        self.outcomes[("drop", str(response.status))] += 1
        if response.status >= 500:
            self.problems.append(f"drop: HTTP {response.status}")
        conn.close()

    def send_follow(self) -> None:
        if self.history is None:
            self.follow_options = self.kvbudget()
            self.history = [{"role": "user", "content": self.words()}]
        answer = self.send_whole(self.history, "follow")
        if answer is None or len(self.history) > 6:
            self.history = None
            return
        self.history = [*self.history, {"role": "assistant", "content": answer},
                        {"role": "user", "content": self.words()}]  # fmt: skip

    def send_bad(self) -> None:
        raw = self.rng.choice(BAD_BODIES).replace(b"MODEL", self.model_name.encode())
        if self.rng.random() < 0.2:  # over the body limit
            raw = b'{"model": "' + b"x" * (self.config.max_body + 1) + b'"}'
        conn, response = self.post(raw)
        data = response.read()
        conn.close()
        self.note("bad", response.status, data)
        if not 400 <= response.status < 500:
            self.problems.append(f"bad: HTTP {response.status} for {raw[:60]!r}")


def run_soak(
    model: Any, tokenizer: Any, config: SoakConfig, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the soak on ``model``; returns its figures and ``ok`` (every check passed)."""
    config.check()
    scheduler = Scheduler(
        model, tokenizer, config.cap_bytes, Compression.from_spec(config.methods[0], budget=DEFAULT_BUDGET)
    )
    app = create_app(scheduler, "soak", max_body=config.max_body)
    with serving(app) as base:
        clients = [SoakClient(base, "soak", config, config.seed + i) for i in range(config.clients)]
        warmup = config.warmup_seconds if config.warmup_seconds is not None else config.seconds / 3
        _traffic(clients, warmup)  # the same traffic: the allocator and torch's kernels see its shapes
        _settle(scheduler)
        scheduler.drop_kept_turns()  # memory is compared without kept turns, which the cap bounds
        gc.collect()
        rss_warm = resident_bytes()
        progress(f"soak: warmed up for {warmup:.0f} s, resident {format_bytes(rss_warm or 0)}; "
                 f"{config.clients} clients for {config.seconds:.0f} s")  # fmt: skip
        _traffic(clients, config.seconds)
        _settle(scheduler)
        stats = scheduler.stats()
        kept = scheduler.kept_turn_bytes()
        live_caches = sum(issubclass(type(o), BudgetCache) for o in gc.get_objects())
        scheduler.drop_kept_turns()
        gc.collect()
        rss_end = resident_bytes()
    outcomes: Counter[tuple[str, str]] = Counter()
    for c in clients:
        outcomes.update(c.outcomes)
    problems = [p for c in clients for p in c.problems]
    statuses = Counter()
    for (_, status), n in outcomes.items():
        statuses[status] += n
    result = {
        "config": asdict(config),
        "requests": sum(outcomes.values()),
        "by_kind": {f"{kind} {status}": n for (kind, status), n in sorted(outcomes.items())},
        "statuses": dict(sorted(statuses.items())),
        "server_errors": sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500),
        "lost": statuses.get("lost", 0),
        "problems": problems[:20],
        "reused_tokens": sum(c.reused_tokens for c in clients),
        "peak_held_bytes": scheduler.peak_held_bytes,
        "cap_bytes": config.cap_bytes,
        "end_active": stats["active"], "end_queued": stats["queued"], "end_held_bytes": stats["held_bytes"],
        "end_kept_turns": stats["kept_turns"], "kept_turn_bytes": kept, "live_caches": live_caches,
        "rss_warm_bytes": rss_warm, "rss_end_bytes": rss_end,
    }  # fmt: skip
    result["ok"] = (
        not problems and result["server_errors"] == 0 and result["lost"] == 0
        and stats["active"] == 0 and stats["queued"] == 0 and stats["held_bytes"] == kept
        and live_caches <= stats["kept_turns"] and scheduler.peak_held_bytes <= config.cap_bytes
        and (rss_warm is None or rss_end is None or rss_end <= rss_warm * (1 + RSS_TOLERANCE))
    )  # fmt: skip
    return result


def _traffic(clients: list[SoakClient], seconds: float) -> None:
    """Every client sends requests until ``seconds`` have passed (then finishes the one it is on)."""
    end = time.monotonic() + seconds
    threads = [threading.Thread(target=_client_loop, args=(c, end)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 600)


def _client_loop(client: SoakClient, end: float) -> None:
    while time.monotonic() < end:
        client.one()


def _settle(scheduler: Scheduler, timeout: float = 120.0) -> None:
    """Wait until nothing is active or queued, then collect garbage (dropped caches freed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = scheduler.stats()
        if stats["active"] == 0 and stats["queued"] == 0:
            break
        time.sleep(0.05)
    gc.collect()


def soak_markdown(result: dict[str, Any], model_label: str, command: str) -> str:
    """The soak's figures as the markdown docs/serving.md quotes."""
    config = result["config"]
    rows = "\n".join(f"| {kind} | {n} |" for kind, n in result["by_kind"].items())
    mib = 1 << 20
    rss = (
        f"{result['rss_warm_bytes'] / mib:.0f} MiB after warm-up, "
        f"{result['rss_end_bytes'] / mib:.0f} MiB at the end "
        f"({result['rss_end_bytes'] / result['rss_warm_bytes'] - 1:+.1%})"
        if result["rss_warm_bytes"] and result["rss_end_bytes"]
        else "not measured on this platform"
    )
    return "\n".join([
        f"# Soak: {model_label}", "", f"`{command}`", "",
        f"{config['clients']} clients for {config['seconds']:.0f} s under a "
        f"{format_bytes(config['cap_bytes'])} KV cap, methods {', '.join(config['methods'])}: "
        f"**{result['requests']} requests**, "
        f"statuses {', '.join(f'{s}: {n}' for s, n in result['statuses'].items())}; "
        f"**{result['server_errors']} 5xx, {result['lost']} lost**; {result['reused_tokens']} prompt tokens "
        f"reused; peak KV held {format_bytes(result['peak_held_bytes'])}.", "",
        f"At the end: {result['end_active']} active, {result['end_queued']} queued, KV held "
        f"{format_bytes(result['end_held_bytes'])} = the {result['end_kept_turns']} kept turns' "
        f"{format_bytes(result['kept_turn_bytes'])}; resident memory {rss}. Checks passed: {result['ok']}.",
        "", "| request, status | count |", "|---|---|", rows, "",
    ])  # fmt: skip


def write_soak(result: dict[str, Any], out: Path, model_label: str, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    report = out / "soak.md"
    report.write_text(soak_markdown(result, model_label, command), encoding="utf-8")
    return report
