"""Shared documents on disk (``kvbudget serve --cache-dir DIR --cache-dir-cap 10GiB``).

Each document is two files in ``DIR``: ``<id>.safetensors``, its compressed cache
(:func:`kvbudget.save_cache`: the model's identity, the method, the token ids), and ``<id>.json``,
what the server needs to list it and to render chats on it (its text, its compression, when it was
made, its bytes in memory). Both are written to a temporary file and renamed into place, the cache
first, so a reader — another replica pointed at the same folder, or the server after a restart —
sees a document whole or not at all. The folder holds at most ``cap`` bytes: writing a document
deletes the least recently used others (by the files' modification time, which a load refreshes)
until it fits.

A server finds the documents of its own model here at start and whenever a request names an id it
does not know: documents of another model or dtype (their header says so) are left alone, as are
files it cannot read. A document found on disk is loaded when a request first needs it; under
memory pressure the server may drop an unused document from memory, since its file keeps it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from safetensors import safe_open

from kvbudget.cache import BudgetCache
from kvbudget.cache_files import FORMAT, CacheSource, load_cache, model_fingerprint, save_cache
from kvbudget.errors import InputError, KVBudgetError, PathError
from kvbudget.profiles import config_hash
from kvbudget.serve.batcher import Compression
from kvbudget.serve.documents import Document

#: the ids :func:`kvbudget.serve.documents.new_document_id` makes (nothing else names a file here)
DOCUMENT_ID = re.compile(r"doc-[0-9a-f]{24}")
#: a spilled conversation's files: ``turn-<hash of its token ids>``
TURN_PREFIX = "turn-"


class DocumentDir:
    """The folder of a server's documents, at most ``cap_bytes`` bytes."""

    def __init__(self, path: str | os.PathLike[str], cap_bytes: int) -> None:
        if cap_bytes <= 0:
            raise InputError(f"--cache-dir-cap must be positive, got {cap_bytes} bytes")
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PathError(f"cannot use {self.path} as the cache directory: {err.strerror or err}") from None
        if not os.access(self.path, os.W_OK):
            raise PathError(f"cannot write the cache directory {self.path}")
        self.cap_bytes = cap_bytes
        self._identity: tuple[str, str, str] | None = None

    def _files(self, document_id: str) -> tuple[Path, Path]:
        return self.path / f"{document_id}.safetensors", self.path / f"{document_id}.json"

    def used_bytes(self) -> int:
        files = [*self.path.glob("doc-*.*"), *self.path.glob(f"{TURN_PREFIX}*.*")]
        return sum(p.stat().st_size for p in files if p.suffix in (".safetensors", ".json"))

    # ------------------------------------------------------------------ writing
    def save(self, doc: Document, model: Any) -> None:
        """Write ``doc`` (its cache, then its description), then delete the least recently used other
        documents until the folder is within its cap. A document larger than the cap alone is not
        written (a one-line error)."""
        cache_path, meta_path = self._files(doc.id)
        comp = doc.compression
        source = CacheSource(*self.identity(model), method=comp.method, budget=comp.budget, ratio=comp.ratio,
                             kv_bits=comp.kv_bits, token_ids=list(doc.ids), memory=comp.memory)  # fmt: skip
        save_cache(doc.cache, cache_path, source)
        size = cache_path.stat().st_size
        if size > self.cap_bytes:
            cache_path.unlink(missing_ok=True)
            raise KVBudgetError(f"document {doc.id} takes {size} bytes on disk, more than --cache-dir-cap")
        meta = {
            "id": doc.id, "ids": list(doc.ids), "text": doc.text, "created": doc.created,
            "compress_s": doc.compress_s, "kv_bytes": doc.nbytes, "compression": _compression_dict(comp),
        }  # fmt: skip
        _write_atomically(meta_path, json.dumps(meta).encode())
        self._within_cap(keep=doc.id)

    def _within_cap(self, keep: str) -> None:
        caches = [*self.path.glob("doc-*.safetensors"), *self.path.glob(f"{TURN_PREFIX}*.safetensors")]
        caches.sort(key=lambda p: p.stat().st_mtime)
        for path in caches:
            if self.used_bytes() <= self.cap_bytes:
                return
            document_id = path.stem
            if document_id != keep:
                self.delete(document_id)

    # ------------------------------------------------------------------ conversations
    def save_turn(self, ids: tuple[int, ...], cache: BudgetCache, compression: Compression, last_pos: int,
                  model: Any) -> str:  # fmt: skip
        """Write a finished conversation's cache (a kept turn squeezed out of memory), under the same cap
        as the documents; returns its file id. Raises :class:`KVBudgetError` for a cache a file cannot
        hold (a decode-stage method's, one on a shared document)."""
        turn_id = TURN_PREFIX + hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:24]
        cache_path, meta_path = self._files(turn_id)
        source = CacheSource(*self.identity(model), method=compression.method, budget=compression.budget,
                             ratio=compression.ratio, kv_bits=compression.kv_bits, token_ids=list(ids),
                             memory=compression.memory)  # fmt: skip
        save_cache(cache, cache_path, source)
        meta = {"id": turn_id, "ids": list(ids), "last_pos": last_pos, "kv_bytes": cache.physical_bytes(),
                "compression": _compression_dict(compression)}  # fmt: skip
        _write_atomically(meta_path, json.dumps(meta).encode())
        self._within_cap(keep=turn_id)
        return turn_id

    def find_turns(self, model: Any) -> list[dict[str, Any]]:
        """The spilled conversations of ``model`` here: their descriptions (``id``, ``ids``,
        ``last_pos``, ``kv_bytes``, ``compression`` as a :class:`Compression`)."""
        found = []
        for meta_path in sorted(self.path.glob(f"{TURN_PREFIX}*.json")):
            meta = self._readable(meta_path, model)
            if meta is not None:
                found.append(
                    {**meta, "ids": tuple(meta["ids"]), "compression": _compression(meta["compression"])}
                )
        return found

    def holds(self, file_id: str) -> bool:
        """Whether a document's or conversation's files are (still) here."""
        return all(p.is_file() for p in self._files(file_id))

    def load_turn(self, turn_id: str, model: Any) -> BudgetCache:
        """A spilled conversation's cache; its files are deleted (the conversation goes on in memory)."""
        cache = load_cache(self._files(turn_id)[0], model)
        self.delete(turn_id)
        return cache

    def _readable(self, meta_path: Path, model: Any) -> dict[str, Any] | None:
        """``meta_path``'s description when its cache file is a kvbudget cache of ``model``."""
        try:
            meta = json.loads(meta_path.read_text())
            with safe_open(str(meta_path.with_suffix(".safetensors")), framework="pt") as f:
                header = json.loads((f.metadata() or {}).get("kvbudget", "null"))
        except Exception:  # noqa: BLE001 - not a file of ours: left alone
            return None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            return None
        config, fingerprint, dtype = self.identity(model)
        if (header.get("config_hash"), header.get("dtype"), header.get("fingerprint")) != (
            config,
            dtype,
            fingerprint,
        ):
            return None
        return meta

    def delete(self, document_id: str) -> None:
        for path in self._files(document_id):
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ reading
    def find(self, model: Any, document_id: str | None = None) -> list[Document]:
        """The documents of ``model`` in the folder (or the one of ``document_id``), not loaded
        (``cache`` is ``None``); others and unreadable ones are skipped."""
        if document_id is not None and not DOCUMENT_ID.fullmatch(document_id):
            return []  # not an id this server makes: nothing on disk is named by it
        metas = [self._files(document_id)[1]] if document_id else sorted(self.path.glob("doc-*.json"))
        found = []
        for meta_path in metas:
            meta = self._readable(meta_path, model)
            if meta is None:
                continue
            found.append(Document(
                meta["id"], tuple(meta["ids"]), meta["text"], None, len(meta["ids"]) - 1,
                _compression(meta["compression"]), meta["compress_s"], created=meta["created"],
                stored_bytes=meta["kv_bytes"], saved=True,
            ))  # fmt: skip
        return found

    def identity(self, model: Any) -> tuple[str, str, str]:
        """The model's (config hash, weights' fingerprint, dtype), as cache files record them (computed
        once)."""
        if self._identity is None:
            dtype = str(model.dtype).removeprefix("torch.")
            self._identity = (config_hash(model.config), model_fingerprint(model), dtype)
        return self._identity

    def load(self, doc: Document, model: Any) -> BudgetCache:
        """``doc``'s cache from its file (refreshing its place in the least-recently-used order)."""
        cache_path, _ = self._files(doc.id)
        cache = load_cache(cache_path, model)
        os.utime(cache_path)
        return cache


def _compression_dict(comp: Compression) -> dict[str, Any]:
    return {"method": comp.method, "budget": comp.budget, "ratio": comp.ratio, "kv_bits": comp.kv_bits,
            "memory": comp.memory}  # fmt: skip


def _compression(c: dict[str, Any]) -> Compression:
    return Compression(c["method"], c["budget"], c["ratio"], c["kv_bits"], c["memory"])


def _write_atomically(path: Path, data: bytes) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as err:
        raise PathError(f"cannot write {path}: {err.strerror or err}") from None
