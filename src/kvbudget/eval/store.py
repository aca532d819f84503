"""Append-only JSONL results, keyed by a config hash, safe against interruption.

Each row is written as one line, flushed and fsynced. A run killed mid-write can leave a partial
(torn) last line: opening the store drops it (:attr:`ResultStore.dropped` says so), so a rerun
appends every missing row exactly once. Anything else that is not a row — a line that is not JSON
before the last one, a JSON value without a ``key`` (a JSONL file of something else), bytes that
are not UTF-8 — is a one-line :class:`~kvbudget.errors.ResultsFileError` naming the file and line;
such a file is never changed.

A repository commits the rows as an archive of numbered gzip parts (:func:`pack_results`,
``kvbudget pack``), which is read, and unpacked for a rerun, when ``results.jsonl`` is absent.
"""

from __future__ import annotations

import gzip
import hashlib
import io
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


PART_BYTES = 8 * 2**20
"""Rows (uncompressed) per archive part: JSONL rows gzip about tenfold, so a part is under 1 MB."""


def archive_path(path: Path) -> Path:
    """``DIR/results.jsonl.gz``: a one-file archive of a results file, as earlier versions wrote it
    (still read; :func:`pack_results` replaces it with numbered parts)."""
    return path.with_name(path.name + ".gz")


def part_path(path: Path, index: int) -> Path:
    """``DIR/results.NNN.jsonl.gz``: part ``index`` of the archive :func:`pack_results` writes."""
    stem, _, suffix = path.name.partition(".")
    return path.with_name(f"{stem}.{index:03d}.{suffix}.gz")


def archive_parts(path: Path) -> list[Path]:
    """The committed archive of ``DIR/results.jsonl``, in row order: its numbered parts
    (``results.000.jsonl.gz`` …, :func:`pack_results`), or the one-file ``results.jsonl.gz``, or
    nothing. A folder holding both kinds raises :class:`ResultsFileError` (which is current is
    unknown)."""
    parts = []
    while part_path(path, len(parts)).exists():
        parts.append(part_path(path, len(parts)))
    legacy = archive_path(path)
    if parts and legacy.exists():
        raise ResultsFileError(
            f"{path.parent} holds both {legacy.name} and {parts[0].name}: delete the stale archive "
            f"(`kvbudget pack {path.parent}` writes the parts from {path.name})"
        )
    return parts or ([legacy] if legacy.exists() else [])


def _read_part(part: Path) -> bytes:
    if part.is_dir():
        raise ResultsFileError(f"{part} is a folder, not a results file")
    try:
        return gzip.decompress(part.read_bytes())
    except OSError as err:
        if isinstance(err, gzip.BadGzipFile):
            raise ResultsFileError(f"{part} is not a gzip file") from None
        raise ResultsFileError(f"cannot read {part}: {err.strerror or err}") from None
    except (EOFError, zlib.error):
        raise ResultsFileError(f"{part} is a damaged gzip file") from None


def restore_archive(path: Path, data: bytes) -> None:
    """Write ``data``, the rows read from the committed archive (:func:`read_results`), to
    ``results.jsonl`` when only the archive exists, so a rerun resumes from it."""
    if data and not path.exists():
        path.write_bytes(data)


def pack_results(path: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Write ``DIR/results.jsonl`` (unpacked from its archive when only that exists) as the
    numbered gzip parts a repository commits, and remove stale parts and a one-file
    ``results.jsonl.gz``; returns the parts.

    Each part holds whole rows, at most ``part_bytes`` of them uncompressed (a single longer row
    gets a part of its own). Parts are cut greedily in file order and gzipped without a name or
    time stamp, so after rows are appended the earlier parts are byte-identical and only the last
    ones change in a commit. A torn last line is left out (it is not a row yet).
    """
    scan, data = read_results(path)  # a file of something else is an error here, before anything is written
    if not scan.rows:
        raise ResultsFileError(
            f"no rows in {scan.source} to pack: run `kvbudget eval --out {path.parent}` first"
        )
    restore_archive(path, data)  # an archive alone is repacked (a one-file results.jsonl.gz becomes parts)
    chunks: list[bytes] = []
    start = 0
    while start < len(data):
        end = data.rfind(b"\n", start, start + part_bytes) + 1
        if end <= start:  # one row longer than part_bytes
            end = data.index(b"\n", start) + 1
        chunks.append(data[start:end])
        start = end
    written = []
    for index, chunk in enumerate(chunks):
        buffer = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as gz:
            gz.write(chunk)
        target = part_path(path, index)
        if not target.exists() or target.read_bytes() != buffer.getvalue():
            target.write_bytes(buffer.getvalue())
        written.append(target)
    stale = len(chunks)
    while part_path(path, stale).exists():
        part_path(path, stale).unlink()
        stale += 1
    archive_path(path).unlink(missing_ok=True)
    return written


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
    """Read ``DIR/results.jsonl`` (or, when only that exists, its committed archive,
    :func:`archive_parts`) without changing anything; a one-line :class:`ResultsFileError` names
    the file and line that is not a row.

    Everything after the last newline is the unfinished last line: a complete row there (a file
    whose newline was lost) is kept, anything else is reported as torn (``torn_line``).
    """
    return read_results(path)[0]


def read_results(path: Path) -> tuple[ResultsScan, bytes]:
    """:func:`scan_results`, with the bytes it read up to the last newline (the archive's parts
    joined), so a caller that writes them reads the file once."""
    parts = [] if path.exists() else archive_parts(path)
    if not parts:
        if not path.exists():
            return ResultsScan(path), b""
        if path.is_dir():
            raise ResultsFileError(f"{path} is a folder, not a results file")
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ResultsFileError(f"cannot read {path}: {err.strerror or err}") from None
        scan = _scan_bytes(data, path)
        return scan, data[: scan.complete_bytes]
    scan, pieces = ResultsScan(parts[0]), []
    for part in parts:
        pieces.append(_read_part(part))
        piece = _scan_bytes(pieces[-1], part)
        if piece.torn_line is not None or piece.unterminated:
            raise ResultsFileError(f"{part} ends in the middle of a row: a damaged archive part")
        scan.rows.extend(piece.rows)
        scan.complete_bytes += piece.complete_bytes
    return scan, b"".join(pieces)


def _scan_bytes(data: bytes, source: Path) -> ResultsScan:
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
    """``DIR/results.jsonl``: read the finished keys, append rows (a committed archive is
    unpacked first, :func:`restore_archive`).

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
        scan, data = read_results(self.path)  # checks the file (or its archive) before anything is written
        restore_archive(self.path, data)
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
    """All complete rows of a results file (or its archive parts); a torn last line is skipped, not
    repaired, and nothing is written. Raises :class:`ResultsFileError` for a file of something else."""
    return scan_results(path).rows
