"""Append-only JSONL results, keyed by a config hash, safe against interruption.

Each row is written as one line, flushed and fsynced. A run killed mid-write can leave a partial
(torn) last line: opening the store drops it (:attr:`ResultStore.dropped` says so), so a rerun
appends every missing row exactly once. Anything else that is not a row — a line that is not JSON
before the last one, a JSON value without a ``key`` (a JSONL file of something else), bytes that
are not UTF-8 — is a one-line :class:`~kvbudget.errors.ResultsFileError` naming the file and line;
such a file is never changed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbudget.errors import ResultsFileError


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


@dataclass
class ResultsScan:
    """What :func:`scan_results` found in a results file.

    ``rows``: the complete rows, in file order. ``complete_bytes``: the length of the part that
    ends with the last newline. ``torn_line``: the 1-based number of an unfinished last line (no
    newline, not a complete row) or ``None``; ``torn_bytes``: its length. ``unterminated``: the
    last row is complete but lacks its newline.
    """

    source: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    complete_bytes: int = 0
    torn_line: int | None = None
    torn_bytes: int = 0
    unterminated: bool = False

    def torn_note(self) -> str:
        """One line on the torn last line (empty when there is none)."""
        if self.torn_line is None:
            return ""
        return (
            f"{self.source} line {self.torn_line} is torn ({self.torn_bytes} bytes without a newline, as a "
            "run killed mid-write leaves it)"
        )


def _parse_row(line: str, source: Path, number: int) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ResultsFileError(
            f"{source} line {number} is not JSON ({err.msg}): not a kvbudget results file, or a damaged "
            "one (delete that line to keep the others)"
        ) from None
    if not isinstance(row, dict) or not isinstance(row.get("key"), str):
        raise ResultsFileError(
            f"{source} line {number} is not a kvbudget results row (no 'key' field): give the folder "
            "that `kvbudget eval --out` wrote"
        )
    return row


def scan_results(path: Path) -> ResultsScan:
    """Read ``DIR/results.jsonl`` (or, when only that exists, ``results.jsonl.gz``) without changing
    anything; a one-line :class:`ResultsFileError` names the file and line that is not a row.

    Everything after the last newline is the unfinished last line: a complete row there (a file
    whose newline was lost) is kept, anything else is reported as torn (``torn_line``).
    """
    archive = archive_path(path)
    source = archive if not path.exists() and archive.exists() else path
    if not source.exists():
        return ResultsScan(source)
    if source.is_dir():
        raise ResultsFileError(f"{source} is a folder, not a results file")
    try:
        data = source.read_bytes()
        if source == archive:
            data = gzip.decompress(data)
    except OSError as err:
        if isinstance(err, gzip.BadGzipFile):
            raise ResultsFileError(f"{source} is not a gzip file") from None
        raise ResultsFileError(f"cannot read {source}: {err.strerror or err}") from None
    except (EOFError, zlib.error):
        raise ResultsFileError(f"{source} is a damaged gzip file") from None
    good = data.rfind(b"\n") + 1
    try:
        text = data[:good].decode("utf-8")
    except UnicodeDecodeError as err:
        number = data[: err.start].count(b"\n") + 1
        raise ResultsFileError(
            f"{source} is not UTF-8 text (byte 0x{data[err.start]:02x} on line {number}): not a kvbudget "
            "results file"
        ) from None
    scan = ResultsScan(source, complete_bytes=good)
    lines = text.split("\n")[:-1]
    for number, line in enumerate(lines, 1):
        if line.strip():
            scan.rows.append(_parse_row(line, source, number))
    tail = data[good:]
    if tail.strip():
        try:
            row = json.loads(tail.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            row = None
        if isinstance(row, dict) and isinstance(row.get("key"), str):
            scan.rows.append(row)
            scan.unterminated = True
        else:
            scan.torn_line, scan.torn_bytes = len(lines) + 1, len(tail)
    return scan


def no_results_message(out: Path) -> str:
    """Why ``out`` holds no results (no folder, no file, an empty file, only a torn line), in one
    line that says what to run."""
    path = out / "results.jsonl"
    rerun = f"run `kvbudget eval --out {out}`"
    if not out.exists():
        return f"results folder {out} does not exist: {rerun} first"
    if not out.is_dir():
        return f"{out} is a file, not a folder: give the folder that `kvbudget eval --out` wrote"
    scan = scan_results(path)
    if scan.torn_line is not None:
        return f"{scan.torn_note()} and no line before it is complete: {rerun} to redo that run"
    if scan.source.exists():
        return f"no results in {scan.source} (no rows): {rerun} first"
    return f"no results in {path}: {rerun} first"


class ResultStore:
    """``DIR/results.jsonl``: read the finished keys, append rows (a committed
    ``results.jsonl.gz`` is unpacked first, :func:`restore_archive`).

    A torn last line is dropped from the file; :attr:`dropped` then describes it (else ``""``).
    A file that is not kvbudget rows raises :class:`ResultsFileError` and is left as it is.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.dropped = ""
        self._repair_and_load()

    def _repair_and_load(self) -> None:
        scan = scan_results(self.path)  # checks the file (or its archive) before anything is written
        restore_archive(self.path)
        if not self.path.exists():
            return
        self.rows = scan.rows
        if scan.unterminated:
            with open(self.path, "ab") as f:
                f.write(b"\n")
        elif self.path.stat().st_size > scan.complete_bytes:
            self.dropped = scan.torn_note()
            with open(self.path, "r+b") as f:
                f.truncate(scan.complete_bytes)

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
    """All complete rows of a results file (or its ``.gz``); a torn last line is skipped, not
    repaired, and nothing is written. Raises :class:`ResultsFileError` for a file of something else."""
    return scan_results(path).rows
