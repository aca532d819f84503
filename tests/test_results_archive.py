"""The committed archive of a results file: numbered gzip parts that round-trip to the same rows,
resume a run, keep earlier parts byte-identical after appends, and replace a one-file archive."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbudget.cli import app
from kvbudget.errors import ResultsFileError
from kvbudget.eval.store import ResultStore, load_rows, pack_results


def _rows(count: int, start: int = 0) -> list[dict]:
    """Rows of uneven length, as real ones are (predictions differ)."""
    return [
        {"key": f"k{i}", "score": i % 3 / 2, "prediction": "x" * (17 * i % 150)}
        for i in range(start, start + count)
    ]


def _write(folder: Path, rows: list[dict]) -> bytes:
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    (folder / "results.jsonl").write_bytes(data)
    return data


def _parts(folder: Path) -> list[Path]:
    return sorted(folder.glob("results.*.jsonl.gz"))


def test_parts_hold_whole_rows_under_the_size_and_round_trip_without_the_plain_file(tmp_path):
    rows = _rows(80)
    data = _write(tmp_path, rows)
    parts = pack_results(tmp_path / "results.jsonl", part_bytes=1000)
    assert parts == _parts(tmp_path) and [p.name for p in parts][:2] == [
        "results.000.jsonl.gz",
        "results.001.jsonl.gz",
    ]
    pieces = [gzip.decompress(p.read_bytes()) for p in parts]
    assert len(pieces) >= 5
    assert all(len(piece) <= 1000 and piece.endswith(b"\n") for piece in pieces)
    assert b"".join(pieces) == data
    (tmp_path / "results.jsonl").unlink()
    assert load_rows(tmp_path / "results.jsonl") == rows


def test_a_run_resumes_from_the_parts_and_a_repack_changes_only_the_last_ones(tmp_path):
    rows = _rows(60)
    _write(tmp_path, rows)
    before = {p.name: p.read_bytes() for p in pack_results(tmp_path / "results.jsonl", part_bytes=1000)}
    (tmp_path / "results.jsonl").unlink()

    store = ResultStore(tmp_path / "results.jsonl")  # unpacks the parts
    assert store.keys == {row["key"] for row in rows}
    for row in _rows(30, start=60):
        store.append(row)
    after = {p.name: p.read_bytes() for p in pack_results(tmp_path / "results.jsonl", part_bytes=1000)}
    assert len(after) > len(before)
    last = max(before)
    assert all(after[name] == blob for name, blob in before.items() if name != last)
    (tmp_path / "results.jsonl").unlink()
    assert load_rows(tmp_path / "results.jsonl") == _rows(90)


def test_a_row_longer_than_a_part_gets_a_part_of_its_own_and_stale_parts_go(tmp_path):
    rows = [{"key": "short"}, {"key": "long", "prediction": "y" * 5000}, {"key": "after"}]
    _write(tmp_path, _rows(40) + rows)
    many = pack_results(tmp_path / "results.jsonl", part_bytes=1000)
    alone = [p for p in many if b'"long"' in gzip.decompress(p.read_bytes())]
    assert len(alone) == 1 and gzip.decompress(alone[0].read_bytes()).count(b"\n") == 1

    _write(tmp_path, rows)  # fewer rows than before: the parts past the new last one are removed
    few = pack_results(tmp_path / "results.jsonl", part_bytes=1000)
    assert _parts(tmp_path) == few and len(few) == 3 < len(many)


def test_a_one_file_archive_is_repacked_into_parts_and_removed(tmp_path):
    rows = _rows(20)
    legacy = tmp_path / "results.jsonl.gz"
    legacy.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    result = CliRunner().invoke(app, ["pack", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "packed" in result.output and "results.000.jsonl.gz" in result.output
    assert not legacy.exists() and _parts(tmp_path)
    (tmp_path / "results.jsonl").unlink()
    assert load_rows(tmp_path / "results.jsonl") == rows


def test_both_archive_kinds_or_a_part_cut_mid_row_are_one_line_errors(tmp_path):
    _write(tmp_path, _rows(10))
    pack_results(tmp_path / "results.jsonl", part_bytes=400)
    (tmp_path / "results.jsonl").unlink()
    (tmp_path / "results.jsonl.gz").write_bytes(gzip.compress(b'{"key": "old"}\n'))
    with pytest.raises(ResultsFileError, match="both results.jsonl.gz and results.000.jsonl.gz"):
        load_rows(tmp_path / "results.jsonl")
    (tmp_path / "results.jsonl.gz").unlink()

    part = _parts(tmp_path)[0]
    part.write_bytes(gzip.compress(gzip.decompress(part.read_bytes())[:-9]))
    with pytest.raises(ResultsFileError, match="results.000.jsonl.gz ends in the middle of a row"):
        load_rows(tmp_path / "results.jsonl")
    with pytest.raises(ResultsFileError):
        ResultStore(tmp_path / "results.jsonl")
    assert not (tmp_path / "results.jsonl").exists()  # nothing unpacked from a damaged archive
