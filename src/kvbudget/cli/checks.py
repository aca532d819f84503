"""Checks the command line runs on its arguments before any model or data set loads.

Each check raises a :class:`~kvbudget.errors.KVBudgetError` subclass with one line naming the bad
value and what is allowed; the CLI prints it and exits with code 2. Nothing here loads weights,
reads a data set or writes a file (the write probe of :func:`output_dir` removes its file at once).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from kvbudget.errors import (
    ArtifactError,
    BudgetError,
    InputError,
    KVBudgetError,
    PathError,
    UnsupportedModelError,
)
from kvbudget.extras import require_extra


def text_file(path: Path, what: str) -> str:
    """The UTF-8 text of ``path``; a one-line :class:`PathError` when it is missing, a folder,
    unreadable, empty, a PDF, not UTF-8 or binary."""
    if not path.exists():
        raise PathError(f"{what} not found: {path}")
    if path.is_dir():
        raise PathError(f"{what} {path} is a folder, not a file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise PathError(f"cannot read {what} {path}: {err.strerror or err}") from None
    if not data.strip():
        blank = " (only whitespace)" if data else ""
        raise PathError(f"{what} {path} is empty{blank}: give a UTF-8 text file")
    if data.startswith(b"%PDF-"):
        raise PathError(
            f"{what} {path} is a PDF, not plain text: extract its text first "
            f"(e.g. `pdftotext {path} out.txt`) and pass that file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PathError(
            f"{what} {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}): "
            "pass a plain-text file (convert others first, e.g. `iconv -f latin1 -t utf-8`)"
        ) from None
    if "\x00" in text:
        raise PathError(f"{what} {path} is binary (it holds NUL bytes), not plain text: pass a text file")
    return text


def output_dir(path: Path, what: str = "--out", shown: Path | None = None) -> None:
    """``path`` is a folder that exists or can be created, and files can be written in it.

    The probe writes and removes one empty temporary file in ``path`` or, when ``path`` does not
    exist yet, in its nearest existing parent (nothing is created). ``shown``: the path named in
    the message (default ``path``).
    """
    shown = shown or path
    if path.exists() and not path.is_dir():
        raise PathError(f"{what} {shown} is a file, not a folder")
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise PathError(f"{what} {shown}: cannot create its folder, {existing} is a file")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvbudget-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise PathError(
            f"{what} {shown}: cannot create or write this folder ({existing}: {err.strerror or err})"
        ) from None


def output_file(path: Path, what: str) -> None:
    """``path`` can be written: not a folder, in a folder that exists or can be created."""
    if path.is_dir():
        raise PathError(f"{what} {path} is a folder, not a file")
    output_dir(path.parent, what, shown=path)


def results_folder(out: Path) -> Path:
    """``out`` is a results folder that exists, in which a report can be written."""
    if not out.exists():
        raise PathError(f"results folder {out} does not exist: run `kvbudget eval --out {out}` first")
    if not out.is_dir():
        raise PathError(f"{out} is a file, not a folder: give the folder that `kvbudget eval --out` wrote")
    output_dir(out, "results folder")
    return out


def model_source(name: str, *, fetched: bool = True) -> None:
    """``name`` is a registry model (fetched, when ``fetched``), a local Hugging Face folder of a
    supported architecture, or a ``.gguf`` file; checked from names and ``config.json`` only."""
    from kvbudget.architectures import SUPPORTED_MODEL_TYPES
    from kvbudget.models import MODELS, is_fetched

    if name in MODELS:
        if fetched and not is_fetched(name):
            raise ArtifactError(
                f"model '{name}' is not fetched; run `kvbudget fetch model {name}` (or `make fetch`)"
            )
        return
    path = Path(name).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if config.is_file():
            try:
                model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
            except (OSError, ValueError, AttributeError) as err:
                raise KVBudgetError(f"cannot read {config}: {err}") from None
            if model_type not in SUPPORTED_MODEL_TYPES:
                raise UnsupportedModelError(
                    f"unsupported model type '{model_type}' ({config}): kvbudget supports "
                    f"{', '.join(SUPPORTED_MODEL_TYPES)}"
                )
            return
        if len(list(path.glob("*.gguf"))) == 1:
            return
        raise KVBudgetError(f"model folder {path} has neither a config.json nor a single .gguf file")
    if path.suffix.lower() == ".gguf":
        if path.is_file():
            return
        raise ArtifactError(f"GGUF file not found: {path}")
    raise KVBudgetError(
        f"unknown model '{name}': expected one of {sorted(MODELS)}, a local Hugging Face directory, "
        "or a .gguf file"
    )


def dtype(name: str) -> str:
    """The canonical dtype name (``bf16`` → ``bfloat16``), or a one-line error listing them."""
    from kvbudget.models import resolve_dtype

    return str(resolve_dtype(name)).removeprefix("torch.")


def at_least(value: int | None, minimum: int, option: str) -> None:
    """``value`` (when given) is ≥ ``minimum``."""
    if value is not None and value < minimum:
        raise InputError(f"{option} must be ≥ {minimum}, got {value}")


def positive(values: Iterable[int] | None, option: str, what: str) -> None:
    """Every value is a positive integer (``what``: their unit, for the message)."""
    bad = [v for v in values or [] if v <= 0]
    if bad:
        raise BudgetError(f"{option} must be positive integers ({what}), got {', '.join(map(str, bad))}")


def fractions(values: Iterable[float] | None, option: str) -> None:
    """Every value is in [0, 1]."""
    bad = [v for v in values or [] if not 0.0 <= v <= 1.0]
    if bad:
        raise InputError(f"{option} values must be in [0, 1], got {', '.join(map(str, bad))}")


def data_fetched(name: str) -> None:
    """Registry data artifact ``name`` is fetched (no data is read)."""
    from kvbudget.data import data_path

    data_path(name)


def profile_prompt(spec: str) -> None:
    """A profile prompt spec ``SOURCE[:TOKENS]`` (see :func:`kvbudget.profiles.prompt_from_spec`)
    names a source that exists and holds text; files are read, nothing is tokenized."""
    source = spec
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isdigit():
        source = head
        if int(tail) < 2:
            raise InputError(f"profile prompt {spec!r}: at least 2 tokens are needed")
    if source in ("builtin-text", "builtin-code"):
        return
    if source == "austen":
        require_extra("eval", f"profile prompt {spec!r} (the Austen novels, read with rdata)")
        data_fetched("janeaustenr")
        return
    if source.startswith("stdlib/"):
        from kvbudget.data import stdlib_root

        path = stdlib_root() / source.removeprefix("stdlib/")
        if not path.is_file():
            raise InputError(f"profile prompt {spec!r}: no such standard-library file {path}")
        text_file(path, f"profile prompt {spec!r}")
        return
    path = Path(source)
    if not path.exists():
        raise InputError(
            f"profile prompt {spec!r}: not a file and not one of builtin-text, builtin-code, austen, "
            "stdlib/REL.py"
        )
    text_file(path, "profile prompt file")
