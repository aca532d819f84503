"""Documents the server compresses once and every request naming them shares.

A :class:`Document` is a long prompt prefix (its token ids: the chat template's opening and the
document's text, as :func:`kvbudget.engine.build_prompt` tokenizes a context) compressed alone —
without any question, so every question sees the same document — by the server's document method
(``kvbudget serve --document-method``, KVzip under a byte budget by default) or the one its creator
named. Requests that name it (``extra_body={"kvbudget": {"document": "<id>"}}``) read its cache as a
read-only prefix (:func:`kvbudget.shared_prefix.share`): each conversation holds only its own
tokens after it, and the document's bytes count once against the memory cap, for as long as the
document exists or a conversation still reads it. Nothing of one conversation reaches another:
what is shared is the document itself.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvbudget.cache import BudgetCache
from kvbudget.errors import InputError
from kvbudget.serve.batcher import Compression


class DocumentNotFound(InputError):
    """No document of that id on this server (the HTTP layer answers 404)."""


def new_document_id() -> str:
    return "doc-" + uuid.uuid4().hex[:24]


@dataclass
class Document:
    """A compressed document.

    Attributes:
        id: what requests name. ids: its token ids (a prompt naming it begins with them).
        text: the text it was made from (``None`` when given as token ids: then only completions,
            whose prompt ids follow the document's, can name it).
        cache: its compressed cache (batch 1; read, never written, by the conversations on it), or
            ``None`` while it is only on disk (``--cache-dir``: loaded when a request needs it).
        last_pos: the RoPE position of its last token.
        compression: how it was compressed. compress_s: seconds the prefill and compression took.
        deleted: deleted by its owner; freed once ``users`` is 0.
        stored_bytes: its cache's bytes in memory when it was made (what loading it takes).
        saved: its files are in the server's cache directory.
        pending: its compression is queued (a shared prefix a request just named): requests on it
            wait for it.
    """

    id: str
    ids: tuple[int, ...]
    text: str | None
    cache: BudgetCache | None
    last_pos: int
    compression: Compression
    compress_s: float
    created: int = field(default_factory=lambda: int(time.time()))
    deleted: bool = False
    stored_bytes: int = 0
    saved: bool = False
    pending: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes it holds in memory now (0 while only on disk)."""
        return self.cache.physical_bytes() if self.cache is not None else 0

    def info(self, users: int = 0) -> dict[str, Any]:
        """What the documents API answers about it; ``users``: the conversations reading it now
        (active or kept for follow-ups)."""
        comp = self.compression
        return {
            "id": self.id, "object": "kvbudget.document", "created": self.created, "tokens": len(self.ids),
            "method": comp.method, "budget": comp.budget, "ratio": comp.ratio, "kv_bits": comp.kv_bits,
            "memory": comp.memory, "kv_bytes": self.nbytes or self.stored_bytes,
            "compress_s": round(self.compress_s, 3), "conversations": users,
            "in_memory": self.cache is not None, "on_disk": self.saved, "pending": self.pending,
        }  # fmt: skip
