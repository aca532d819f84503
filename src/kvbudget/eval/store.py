"""Append-only JSONL results, keyed by a config hash, safe against interruption.

Each row is written as one line, flushed and fsynced. A run killed mid-write can leave a partial
last line: opening the store truncates it, so a rerun appends every missing row exactly once.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Any


def config_key(config: dict[str, Any]) -> str:
    """Stable hash of a JSON-serialisable configuration."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def archive_path(path: Path) -> Path:
    """``DIR/results.jsonl.gz``: the gzip copy of a results file that a repository commits (the
    leaderboard's rows are several MB as plain JSONL). :func:`restore_archive` unpacks it."""
    return path.with_name(path.name + ".gz")


def restore_archive(path: Path) -> None:
    """Unpack ``results.jsonl.gz`` into ``results.jsonl`` when only the archive exists, so reports
    read it and a rerun resumes from it."""
    archive = archive_path(path)
    if not path.exists() and archive.exists():
        path.write_bytes(gzip.decompress(archive.read_bytes()))


class ResultStore:
    """``DIR/results.jsonl``: read the finished keys, append rows (a committed
    ``results.jsonl.gz`` is unpacked first, :func:`restore_archive`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self._repair_and_load()

    def _repair_and_load(self) -> None:
        restore_archive(self.path)
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        good = data.rfind(b"\n") + 1  # everything after the last newline is an unfinished row
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
        for line in data[:good].decode("utf-8").splitlines():
            if line.strip():
                self.rows.append(json.loads(line))

    @property
    def keys(self) -> set[str]:
        return {row["key"] for row in self.rows}

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, default=_jsonable) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(row)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, float) and value != value:  # NaN
        return None
    return str(value)


def load_rows(path: Path) -> list[dict[str, Any]]:
    """All complete rows of a results file (a partial last line is ignored, not repaired)."""
    rows = []
    restore_archive(path)
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
