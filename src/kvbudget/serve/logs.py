"""The server's logs: one format for kvbudget's and uvicorn's lines, and one access line a request.

``kvbudget serve --log-level LEVEL`` sets both. The access line (logger ``kvbudget.serve.access``)
gives the method, path, status, prompt and answer tokens, time to first token, KV bytes held by the
answer's cache and the request id, e.g.::

    2026-12-06 13:01:02 INFO kvbudget.serve.access: POST /v1/chat/completions 200 in=31 out=12
        ttft=0.041s kv=41.2KiB id=req-3f9c…   (one line)

Failures inside the model thread log one line with the request id and the cause (logger
``kvbudget.serve``); client errors (4xx) log only their access line, never a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from kvbudget.units import format_bytes

#: characters of a client's value an error message or a log line quotes at most
QUOTE_CHARS = 40
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LEVELS = ("critical", "error", "warning", "info", "debug")

log = logging.getLogger("kvbudget.serve")
access_log = logging.getLogger("kvbudget.serve.access")


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (with ``…``): what an error message may echo."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def log_config(level: str = "info") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for uvicorn (its ``log_config``) that formats uvicorn's and
    kvbudget's server loggers alike at ``level``; uvicorn's own access log is off (kvbudget writes
    its own, with tokens and the request id)."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    upper = level.upper()
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": LOG_FORMAT, "datefmt": DATE_FORMAT}},
        "handlers": {"stderr": handler},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": upper, "propagate": False},
            "uvicorn.error": {"level": upper},
            "uvicorn.access": {"handlers": [], "level": "CRITICAL", "propagate": False},
            "kvbudget.serve": {"handlers": ["stderr"], "level": upper, "propagate": False},
        },
    }


def access_line(method: str, path: str, status: int, record: dict[str, Any]) -> str:
    """The access line of one request; ``record`` holds what the handler learnt (``id``,
    ``prompt_tokens``, ``completion_tokens``, ``ttft_s``, ``kv_bytes``), each shown when present."""
    parts = [f"{method} {path} {status}"]
    if "prompt_tokens" in record:
        parts.append(f"in={record['prompt_tokens']}")
    if "completion_tokens" in record:
        parts.append(f"out={record['completion_tokens']}")
    if record.get("ttft_s") is not None:
        parts.append(f"ttft={record['ttft_s']:.3f}s")
    if "kv_bytes" in record:
        parts.append(f"kv={format_bytes(record['kv_bytes']).replace(' ', '')}")
    if "error" in record:
        parts.append(f"error={record['error']}")
    parts.append(f"id={record.get('id', '-')}")
    return " ".join(parts)
