"""The model's worker thread: admission under a memory cap, the queue, continuous batching, reuse.

One thread owns the model (docs/architecture.md, "Serving"). Each turn of its loop it drops
cancelled requests, then either admits **one** queued request whose prefill fits under the cap
(prefill and compress it alone, stream its first token) or, when none fits or none waits, runs
**one** decode step over every active sequence (:func:`~kvbudget.serve.batcher.decode_step`) and
streams each row's token. Prefills go first (as vLLM's default scheduling): every request that fits
joins the batch before the next step, and the cap bounds how many do. A sequence
leaves the batch between steps when it ends (EOS, a stop string, ``max_tokens``) or is cancelled
(its client went away).

Memory: every active sequence holds a reservation, the KV bytes it may reach before it ends
(:func:`~kvbudget.serve.batcher.reserved_bytes`, from its cache's own physical bytes); a queued
request is admitted only when the reservations, the finished turns kept for follow-ups and its own
prefill peak (:func:`~kvbudget.serve.batcher.prefill_peak_bytes`) fit under the cap, so the KV the
process holds never exceeds it. Kept turns are dropped least recently used first when a request
needs their room. A request that could never fit is refused at submission; when the queue is full,
:class:`QueueFull` (the HTTP layer's 429).

Follow-ups: a finished sequence's cache is kept as a :class:`~kvbudget.serve.batcher.Turn` keyed by
its exact token ids; a request whose prompt extends one (same compression) takes that cache over
and prefills only its new tokens. Nothing of one conversation reaches another: the key is the
whole token prefix.

Chunked prefill (:mod:`kvbudget.serve.chunked_prefill`): while other conversations are decoding, a
prompt of at least ``chunk_tokens`` tokens is read ``chunk_layers`` decoder layers at a time, one
piece between two decode steps, so they keep decoding while it is read; one prompt is read at a
time (the next waits until it is done). Its tokens are those of an unchunked prefill.

Documents (:mod:`kvbudget.serve.documents`): :meth:`Scheduler.submit_document` compresses a prompt
prefix once, without a question, admitted like a request; requests naming it read its cache as a
shared, read-only prefix (:func:`kvbudget.shared_prefix.share`) and prefill only their own tokens.
Its bytes count once in what the process holds, until it is deleted and no conversation reads it.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvbudget.attention import attach
from kvbudget.cache import model_entry_bytes
from kvbudget.engine import check_ratio_budgets, memory_budget
from kvbudget.errors import InputError, KVBudgetError
from kvbudget.methods.base import Method
from kvbudget.methods.spec import MethodSpec
from kvbudget.phases import Stage
from kvbudget.prefill.common import eos_ids
from kvbudget.serve import defaults
from kvbudget.serve.batcher import (
    Compression,
    Sequence,
    Turn,
    decode_step,
    grown_bytes,
    make_sequence,
    prefill_peak_bytes,
    prefill_sequence,
    reserved_bytes,
)
from kvbudget.serve.chunked_prefill import can_chunk, prefill_steps
from kvbudget.serve.documents import Document, DocumentNotFound, new_document_id
from kvbudget.serve.logs import log
from kvbudget.shared_prefix import share


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that may begin a stop string (not streamed until known)."""
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def release_freed_memory() -> bool:
    """Ask the C allocator to return freed memory to the system (glibc's ``malloc_trim``): a server
    that has just dropped caches would otherwise keep their pages resident, fragmented among its
    threads' arenas, until they are reused. Where there is no ``malloc_trim`` (macOS, musl), nothing;
    returns whether it ran."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


class QueueFull(KVBudgetError):
    """The request queue is full (the HTTP layer answers 429 with ``Retry-After``)."""


class TooLarge(InputError):
    """The request could never fit under the server's memory cap."""


@dataclass
class Job:
    """A submitted request: its sequence, its stop strings, and where its events go.

    ``sink`` receives each event (a dict): ``{"text": delta, "token_ids": [...]}`` per token, then
    one ``{"finish_reason": ..., "usage": {...}}``, or ``{"error": message}``. It is called from the
    worker thread (the HTTP layer hands the events to its event loop).
    """

    seq: Sequence
    sink: Callable[[dict[str, Any]], None]
    stop: tuple[str, ...] = ()
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    reuse: Turn | None = None
    text: str = ""
    first_token_at: float | None = None
    reserved: int = 0
    request_id: str = "-"
    done: bool = False
    #: a document to create (its id) from this job's prompt, and the text it was made from
    creates: str | None = None
    document_text: str | None = None
    #: the document this request reads
    document: Document | None = None
    #: a chunked prefill in progress (:func:`kvbudget.serve.chunked_prefill.prefill_steps`)
    steps: Iterator[int] | None = None
    #: the spilled conversation (in the cache directory) this request continues
    spilled: dict[str, Any] | None = None

    def cancel(self) -> None:
        """Ask the worker to drop this request (before its next step)."""
        self.cancelled.set()


class Metrics:
    """What the scheduler reports; the HTTP layer's subclass feeds Prometheus. No-ops here."""

    def ttft(self, seconds: float) -> None: ...

    def tpot(self, seconds: float) -> None: ...

    def tokens(self, count: int) -> None: ...


class Scheduler:
    """Serve requests on ``model`` from one worker thread (:meth:`start`, :meth:`stop`).

    Args:
        memory_cap: KV bytes the process may hold, all sequences and kept turns together.
        default: the compression of a request that names none.
        max_queue: requests waiting at most (more: :class:`QueueFull`).
        keep_turns: keep finished caches for follow-ups (within the cap).
        document_default: how a document is compressed when its creator names no method (default:
            KVzip under a byte budget of 12.5% of the full cache's bytes).
        document_dir: where documents are also written (:mod:`kvbudget.serve.document_dir`), found
            again after a restart or by another replica, and reloaded after a memory squeeze.
        chunk_tokens: prompts this long or longer are read in pieces while others decode (``None``:
            never); chunk_layers: decoder layers a piece.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        memory_cap: int,
        default: Compression | None = None,
        max_queue: int = 64,
        keep_turns: bool = True,
        metrics: Metrics | None = None,
        document_default: Compression | None = None,
        document_dir: Any = None,
        chunk_tokens: int | None = 1024,
        chunk_layers: int = 1,
    ) -> None:
        if memory_cap <= 0:
            raise InputError(f"the memory cap must be positive, got {memory_cap} bytes")
        if max_queue < 1:
            raise InputError(f"the queue must hold at least one request, got {max_queue}")
        self.model, self.tokenizer = model, tokenizer
        self.memory_cap, self.max_queue, self.keep_turns = memory_cap, max_queue, keep_turns
        self.default = default or Compression.server_default()
        self.document_default = document_default or Compression.for_document(defaults.DOCUMENT_METHOD)
        self.metrics = metrics or Metrics()
        self.eos = eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self._methods: dict[str, Method] = {}
        self._queue: deque[Job] = deque()
        self._active: list[Job] = []
        self._turns: OrderedDict[tuple[int, ...], tuple[Turn, Compression, int]] = OrderedDict()
        self._documents: dict[str, Document] = {}
        self.document_dir = document_dir
        if chunk_layers < 1:
            raise InputError(f"a prefill piece holds at least one layer, got {chunk_layers}")
        self.chunk_tokens, self.chunk_layers = chunk_tokens, chunk_layers
        self._reading: Job | None = None  # the job whose prompt is being read in pieces
        #: kept turns squeezed out of memory into the cache directory, by their token ids
        self._spilled: dict[tuple[int, ...], dict[str, Any]] = {}
        if document_dir is not None:
            self._documents.update((d.id, d) for d in document_dir.find(model))
            self._spilled.update((t["ids"], t) for t in document_dir.find_turns(model))
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self.peak_held_bytes = 0
        self.peak_active = 0
        attach(model)
        self.method_for(self.default)  # a bad default fails at start, not at the first request
        self._document_method(self.document_default)

    # ------------------------------------------------------------------ requests
    def method_for(self, compression: Compression) -> Method:
        """The configured method of ``compression`` (one shared, frozen object per spec)."""
        method = self._methods.get(compression.method)
        if method is None:
            method = MethodSpec.parse(compression.method).build()
            self._methods[compression.method] = method
        if compression.budget is not None:
            method.check_budget(compression.budget)
        return method

    def submit(
        self,
        prompt_ids: list[int],
        sink: Callable[[dict[str, Any]], None],
        max_tokens: int = 256,
        compression: Compression | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        request_id: str = "-",
        shared_prefix: int = 0,
    ) -> Job:
        """Queue a request; one-line errors (before any model work) for a bad or oversized one (the
        method's own minimum for this prompt as ``kvbudget.generate`` checks it), and
        :class:`QueueFull` when the queue is full. ``request_id`` names it in the log.
        ``shared_prefix``: the prompt's first ids are a prefix every request beginning with them
        shares (a long system prompt): a document the server compresses once (its id the prefix's
        hash), the request's own tokens after it kept as they are."""
        compression = compression or self.default
        if shared_prefix and compression.document is None:
            document_id = self._shared_document(prompt_ids[:shared_prefix], request_id)
            if document_id is not None:
                compression = replace(compression, document=document_id)
        if len(prompt_ids) + max_tokens > self.max_context:
            raise InputError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds the model's context "
                f"of {self.max_context} tokens"
            )
        document = None
        if compression.document is not None:  # the document's compression; the request's tokens as they are
            document = self.document(compression.document)
            n = len(document.ids)
            if len(prompt_ids) <= n or tuple(prompt_ids[:n]) != document.ids:
                raise InputError(f"the prompt does not begin with document {document.id}'s {n} tokens")
            compression = replace(document.compression, document=document.id)
        method = self.method_for(compression)
        if document is None:
            check_ratio_budgets(method, compression.ratio, [len(prompt_ids)])
            if compression.memory is not None:  # a budget the method cannot keep: a one-line 400 now
                memory_budget(self.model, method, compression.memory, len(prompt_ids))
        seq = make_sequence(
            prompt_ids, max_tokens, self.eos, compression, temperature, top_p, seed, method, ignore_eos
        )
        job = Job(seq, sink, tuple(stop), request_id=request_id, document=document)
        return self._enqueue(job, "the request", ": use a smaller prompt, max_tokens or budget")

    def _enqueue(self, job: Job, what: str, advice: str = "") -> Job:
        """Queue ``job`` unless it could never fit (:class:`TooLarge`) or the queue is full."""
        with self._lock:
            turn = None if job.creates else self._find_turn(job.seq.prompt_ids, job.seq.compression)
            need = self._peak(job, turn)
            if need > self.memory_cap:
                raise TooLarge(
                    f"{what} needs up to {need} bytes of KV cache, more than the server's cap of "
                    f"{self.memory_cap} bytes{advice}"
                )
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting): retry later")
            self._queue.append(job)
            self._lock.notify()
        return job

    # ------------------------------------------------------------------ documents
    def _document_method(self, compression: Compression) -> Method:
        method = self.method_for(compression)
        if Stage.DECODE in method.stages:
            raise InputError(
                f"{compression.method} compresses while decoding: a shared document's method must "
                "compress the prompt only"
            )
        return method

    def _shared_document(self, ids: list[int], request_id: str) -> str | None:
        """The id of the document a shared prefix ``ids`` is: found (in memory or the cache
        directory), or queued for compression now, with the server's document method; requests on
        it wait for it. ``None`` when the document method cannot compress it (the request is then
        served as any other)."""
        key = hashlib.sha256(f"{self.document_default}:{ids}".encode()).hexdigest()[:24]
        document_id = f"doc-{key}"
        with self._lock:
            try:
                return self.document(document_id).id
            except DocumentNotFound:
                pass
            try:
                self.submit_document(ids, lambda event: None, request_id=request_id, document_id=document_id)
            except QueueFull:
                raise
            except KVBudgetError:
                return None
        return document_id

    def submit_document(
        self,
        ids: list[int],
        sink: Callable[[dict[str, Any]], None],
        compression: Compression | None = None,
        text: str | None = None,
        request_id: str = "-",
        document_id: str | None = None,
    ) -> Job:
        """Queue the compression of a document (``ids``, made from ``text`` if given), admitted like a
        request; ``sink`` then receives ``{"document": info}`` (or ``{"error": ...}``). One-line
        errors before any model work, as :meth:`submit`. ``document_id``: a shared prefix's (the
        document is listed at once, pending, so that requests on it wait for it)."""
        compression = compression or self.document_default
        if not ids:
            raise InputError("the document is empty")
        if len(ids) >= self.max_context:
            raise InputError(f"a document of {len(ids)} tokens leaves no room in the model's context "
                             f"of {self.max_context} tokens")  # fmt: skip
        method = self._document_method(compression)
        check_ratio_budgets(method, compression.ratio, [len(ids)])
        if compression.memory is not None:
            memory_budget(self.model, method, compression.memory, len(ids))
        seq = make_sequence(ids, 1, self.eos, compression, method=method)
        job = Job(
            seq, sink, request_id=request_id, creates=document_id or new_document_id(), document_text=text
        )
        with self._lock:
            self._enqueue(job, "compressing the document")
            if document_id is not None:
                self._documents[document_id] = Document(
                    document_id, tuple(ids), text, None, len(ids) - 1, compression, 0.0, pending=True
                )
        return job

    def document(self, document_id: str) -> Document:
        """The live document ``document_id`` (looked for in the cache directory too: another replica
        may have made it), or :class:`DocumentNotFound`."""
        found = self._documents.get(document_id)
        if found is None and self.document_dir is not None:
            on_disk = self.document_dir.find(self.model, document_id)
            if on_disk:
                with self._lock:
                    found = self._documents.setdefault(document_id, on_disk[0])
        if found is None or found.deleted:
            raise DocumentNotFound(f"no document {document_id!r} on this server (deleted, or never created)")
        return found

    def documents(self) -> list[dict[str, Any]]:
        """Every live document's info, oldest first."""
        with self._lock:
            return [self._info(d) for d in self._documents.values() if not d.deleted]

    def document_info(self, document_id: str) -> dict[str, Any]:
        with self._lock:
            return self._info(self.document(document_id))

    def delete_document(self, document_id: str) -> dict[str, Any]:
        """Delete a document: no new request may name it; the turns kept on it are dropped; its cache
        is freed once the conversations reading it end."""
        with self._lock:
            doc = self.document(document_id)
            doc.deleted = True
            if self.document_dir is not None:
                self.document_dir.delete(document_id)
            for ids in [ids for ids, (_, comp, _) in self._turns.items() if comp.document == document_id]:
                del self._turns[ids]
            self._collect_documents()
        gc.collect()
        release_freed_memory()
        return {"id": document_id, "object": "kvbudget.document", "deleted": True}

    def _users(self, document_id: str) -> int:
        active = sum(1 for j in self._active if j.document is not None and j.document.id == document_id)
        return active + sum(1 for _, comp, _ in self._turns.values() if comp.document == document_id)

    def _info(self, doc: Document) -> dict[str, Any]:
        return doc.info(self._users(doc.id))

    def _unload_documents(self, keep: Document | None) -> None:
        """Drop from memory the documents no conversation reads that the cache directory holds (under
        the lock): a request naming one loads it again."""
        for doc in self._documents.values():
            if doc is not keep and doc.saved and doc.cache is not None and not self._users(doc.id):
                doc.cache = None

    def _collect_documents(self) -> None:
        """Forget deleted documents no conversation reads any more (under the lock)."""
        for doc_id in [i for i, d in self._documents.items() if d.deleted and not self._users(i)]:
            del self._documents[doc_id]

    def _create_document(self, job: Job) -> None:
        seq, start = job.seq, time.perf_counter()
        try:
            prefill_sequence(self.model, seq, self.pad_id)
        except Exception as exc:  # this document fails alone, and the requests waiting for it
            with self._lock:
                pending = self._documents.get(job.creates)
                if pending is not None and pending.pending:
                    del self._documents[job.creates]
            self._fail(job, exc)
            return
        seq.cache.session = None  # read from now on, never compressed again
        doc = self._documents.get(job.creates)
        if doc is None or not doc.pending:
            doc = Document(job.creates, tuple(seq.prompt_ids), job.document_text, None, seq.last_pos,
                           seq.compression, 0.0)  # fmt: skip
        doc.cache, doc.compress_s, doc.pending = seq.cache, time.perf_counter() - start, False
        if self.document_dir is not None:
            try:
                self.document_dir.save(doc, self.model)
                doc.saved = True
            except KVBudgetError as exc:  # kept in memory only; the request still gets its document
                log.warning("document %s not written to the cache directory: %s", doc.id, exc)
        doc.stored_bytes = doc.nbytes
        with self._lock:
            if job in self._active:
                self._active.remove(job)
            self._documents[doc.id] = doc
            job.done = True
            info = self._info(doc)
        log.info("document %s: %d tokens, %s, %d KV bytes", doc.id, len(doc.ids), doc.compression.label(),
                 doc.nbytes)  # fmt: skip
        job.sink({"document": info})
        self._account()

    # ------------------------------------------------------------------ state
    def stats(self) -> dict[str, int]:
        """Active and queued requests, kept turns, KV bytes held (caches' physical bytes) and
        reserved, and the cap."""
        with self._lock:
            return {
                "active": len(self._active), "queued": len(self._queue), "kept_turns": len(self._turns),
                "held_bytes": self.held_bytes(), "reserved_bytes": self._reserved(),
                "cap_bytes": self.memory_cap, "document_bytes": self._document_bytes(),
                "documents": sum(not d.deleted for d in self._documents.values()),
            }  # fmt: skip

    def held_bytes(self) -> int:
        """KV bytes the process holds now: active sequences' caches, kept turns and documents (each
        counted once, however many conversations read it)."""
        active = sum(j.seq.cache.physical_bytes() for j in self._active if j.seq.cache is not None)
        turns = sum(turn.cache.physical_bytes() for turn, _, _ in self._turns.values())
        return active + turns + self._document_bytes()

    def _document_bytes(self) -> int:
        return sum(d.nbytes for d in self._documents.values())

    def drop_kept_turns(self) -> int:
        """Forget every finished turn kept for follow-ups (their caches are freed once unreferenced);
        returns how many there were."""
        with self._lock:
            count = len(self._turns)
            self._turns.clear()
            self._collect_documents()
        gc.collect()
        release_freed_memory()
        return count

    def kept_turn_bytes(self) -> int:
        """KV bytes of the finished turns kept for follow-ups (their caches' physical bytes)."""
        with self._lock:
            return sum(turn.cache.physical_bytes() for turn, _, _ in self._turns.values())

    def _reserved(self) -> int:
        turns = sum(size for _, _, size in self._turns.values())
        return sum(j.reserved for j in self._active) + turns + self._document_bytes()

    # ------------------------------------------------------------------ the worker
    def start(self) -> None:
        if self._thread is not None:
            return
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kvbudget-serve", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._running = False
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        busy = False
        while True:
            with self._lock:
                idle = not self._queue and not self._active
            if idle and busy:  # the last sequence just ended: hand what it freed back to the system
                release_freed_memory()
            busy = not idle
            with self._lock:
                while self._running and not self._queue and not self._active:
                    self._lock.wait()
                if not self._running:
                    break
                self._drop_cancelled()
                job = self._next_admissible() if self._reading is None else None
            try:
                if job is not None:
                    self._prefill(job)  # prefill first: admit all that fit, then decode them together
                elif self._reading is not None:
                    self._read_piece()  # one piece of a long prompt, then a step of the others
                    self._step()
                elif self._active:
                    self._step()
            except Exception as exc:  # a failed forward must not take the server down with it
                self._fail_all(exc)
        with self._lock:
            for job in [*self._queue, *self._active]:
                job.done = True
                job.sink({"error": "the server is shutting down"})
            self._queue.clear()
            self._active.clear()

    def _drop_cancelled(self) -> None:
        self._queue = deque(j for j in self._queue if not j.cancelled.is_set())
        kept = []
        for job in self._active:
            if job.cancelled.is_set():
                job.seq.cache = None  # freed now: nothing else refers to it
                if job.steps is not None:  # a prompt being read: its partial cache goes with it
                    job.steps.close()
                    job.steps = None
                if job is self._reading:
                    self._reading = None
            else:
                kept.append(job)
        self._active = kept
        self._collect_documents()

    def _peak(self, job: Job, turn: Turn | None) -> int:
        """KV bytes ``job`` may hold at its peak: a kept turn's cache grown by the new tokens and the
        answer, a request on a document its own tokens and answer in the model's dtype (a bound:
        quantized ones take less; the document is counted once, apart), or a fresh prefill's bound."""
        if turn is not None:
            return grown_bytes(turn.cache, len(job.seq.prompt_ids) - len(turn.ids) + job.seq.max_tokens)
        if job.document is not None:
            loading = job.document.stored_bytes if job.document.cache is None else 0
            return self._own_bound(job, len(job.document.ids)) + loading
        return prefill_peak_bytes(self.model, job.seq)

    def _own_bound(self, job: Job, prefix: int) -> int:
        """KV bytes of ``job``'s tokens after its first ``prefix`` and of its answer, in the model's
        dtype (a bound: quantized ones take less)."""
        config = self.model.config
        own = len(job.seq.prompt_ids) - prefix + job.seq.max_tokens
        per_token = model_entry_bytes(config, self.model.dtype) * config.num_key_value_heads
        return own * per_token * config.num_hidden_layers

    def _find_spilled(self, prompt_ids: list[int], compression: Compression) -> dict[str, Any] | None:
        """The longest spilled conversation the prompt extends, under the same compression."""
        best = None
        for ids, turn in list(self._spilled.items()):
            n = len(ids)
            if turn["compression"] == compression and len(prompt_ids) > n and tuple(prompt_ids[:n]) == ids:
                if not self.document_dir.holds(turn["id"]):  # deleted over the folder's cap since
                    del self._spilled[ids]
                    continue
                best = turn if best is None or n > len(best["ids"]) else best
        return best

    def _spill_oldest_turn(self) -> None:
        """Drop the least recently used kept turn from memory (under the lock), writing it to the
        cache directory first when there is one and a file can hold it."""
        ids, (turn, compression, _) = self._turns.popitem(last=False)
        if self.document_dir is None or compression.document is not None:
            return
        try:
            turn_id = self.document_dir.save_turn(ids, turn.cache, compression, turn.last_pos, self.model)
        except KVBudgetError as exc:  # a decode-stage method's cache, say: dropped, as without a directory
            log.debug("turn of %d tokens not spilled: %s", len(ids), exc)
            return
        size = turn.cache.physical_bytes()
        self._spilled[ids] = {"id": turn_id, "ids": ids, "last_pos": turn.last_pos, "kv_bytes": size,
                              "compression": compression}  # fmt: skip

    def _next_admissible(self) -> Job | None:
        """The first queued request if it fits now (dropping kept turns, oldest first, to make room)."""
        if not self._queue:
            return None
        job = self._queue[0]
        doc = job.document
        if doc is not None and self._documents.get(doc.id) is not doc:
            self._queue.popleft()  # its document was deleted (and freed), or failed, while it waited
            job.done = True
            job.sink({"error": f"document {doc.id} was deleted or could not be compressed"})
            return None
        if doc is not None and doc.pending:
            return None  # its compression is queued ahead of it
        kept = None if job.creates else self._find_turn(job.seq.prompt_ids, job.seq.compression)
        if kept is not None:  # taken over: its bytes move from the store into the job's reservation
            self._turns.pop(kept.ids)
        spilled = None
        if kept is None and not job.creates and doc is None:
            spilled = self._find_spilled(job.seq.prompt_ids, job.seq.compression)
        turn = kept
        if turn is None and doc is not None and doc.cache is not None:  # the document's cache, shared
            turn = Turn(doc.ids, share(doc.cache), doc.last_pos)
        need = self._peak(job, turn) if spilled is None else self._own_bound(job, len(spilled["ids"]))
        need += spilled["kv_bytes"] if spilled is not None else 0
        while self._reserved() + need > self.memory_cap and self._turns:
            self._spill_oldest_turn()  # least recently used first
        if self._reserved() + need > self.memory_cap:
            self._unload_documents(keep=doc)
        if self._reserved() + need > self.memory_cap:
            if kept is not None:
                self._keep(kept, job.seq.compression)
            return None
        self._queue.popleft()
        if spilled is not None:
            del self._spilled[spilled["ids"]]
            job.spilled = spilled
        job.reuse = turn
        job.reserved = need  # until the prefill is done and the reservation is measured
        self._active.append(job)
        return job

    def _prefill(self, job: Job) -> None:
        if job.creates is not None:
            self._create_document(job)
            return
        seq = job.seq
        try:
            if job.spilled is not None and job.reuse is None:  # a conversation spilled to disk
                spilled = job.spilled
                cache = self.document_dir.load_turn(spilled["id"], self.model)
                job.reuse = Turn(spilled["ids"], cache, spilled["last_pos"])
            if job.document is not None and job.reuse is None:  # on disk only: loaded now
                doc = job.document
                if doc.cache is None:
                    doc.cache = self.document_dir.load(doc, self.model)
                job.reuse = Turn(doc.ids, share(doc.cache), doc.last_pos)
            if self._chunked(job):
                job.steps = prefill_steps(self.model, seq, self.pad_id, self.chunk_layers)
                self._reading = job
                self._read_piece()
                return
            token = prefill_sequence(self.model, seq, self.pad_id, job.reuse)
        except Exception as exc:  # this request fails alone; the others keep decoding
            self._fail(job, exc)
            return
        self._prefilled(job, token)

    def _chunked(self, job: Job) -> bool:
        """Read ``job``'s prompt in pieces: a long, fresh prompt while others are decoding."""
        decoding = any(j is not job and j.seq.cache is not None for j in self._active)
        return (
            self.chunk_tokens is not None and job.reuse is None and decoding
            and len(job.seq.prompt_ids) >= self.chunk_tokens and can_chunk(job.seq)
        )  # fmt: skip

    def _read_piece(self) -> None:
        """The next piece of the prompt being read; when it is the last, the request's first token."""
        job = self._reading
        try:
            next(job.steps)
            return
        except StopIteration:
            pass
        except Exception as exc:  # this request fails alone; the others keep decoding
            job.steps, self._reading = None, None
            self._fail(job, exc)
            return
        job.steps, self._reading = None, None
        self._prefilled(job, job.seq.generated[-1])

    def _prefilled(self, job: Job, token: int) -> None:
        seq = job.seq
        job.first_token_at = time.perf_counter()
        self.metrics.ttft(job.first_token_at - job.submitted)
        with self._lock:
            job.reserved = reserved_bytes(self.model, seq)
        self._emit(job, [token])
        self._account()

    def _step(self) -> None:
        with self._lock:
            jobs = [j for j in self._active if j.seq.cache is not None and not j.seq.finished]
        if not jobs:
            return
        start = time.perf_counter()
        tokens = decode_step(self.model, [j.seq for j in jobs])
        elapsed = time.perf_counter() - start
        self.metrics.tpot(elapsed)
        self.metrics.tokens(len(jobs))
        for job, token in zip(jobs, tokens, strict=True):
            if isinstance(token, Exception):  # this row's sampling failed: it alone ends
                self._fail(job, token)
            else:
                self._emit(job, [token])
        self._account()

    def _emit(self, job: Job, tokens: list[int]) -> None:
        """Stream ``tokens``' text (a stop string ends the answer before it); finish ``job`` if done."""
        seq = job.seq
        ids = seq.generated[:-1] if seq.generated and seq.generated[-1] in seq.eos else seq.generated
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        reason = None
        for stop in job.stop:
            at = text.find(stop)
            if at >= 0:
                text, reason = text[:at], "stop"
        shown = text
        if reason is None and not seq.finished:
            shown = text[: len(text) - _held_back(text, job.stop)]
            if shown.endswith("\ufffd"):
                return  # half a character: wait for the rest of its bytes
        delta = shown[len(job.text) :]
        job.text = shown
        if delta:
            job.sink({"text": delta, "token_ids": tokens})
        if reason is None and seq.finished:
            reason = "stop" if seq.generated[-1] in seq.eos and not seq.ignore_eos else "length"
        if reason is not None:
            self._finish(job, reason)

    def _finish(self, job: Job, reason: str) -> None:
        seq = job.seq
        cache = seq.cache
        comp = seq.compression
        kept = (
            sum(int(layer.head_lengths().sum()) for layer in cache.layers if layer.is_initialized)
            if cache
            else 0
        )
        usage = {
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(seq.generated),
            "total_tokens": len(seq.prompt_ids) + len(seq.generated),
            "kvbudget": {
                "method": comp.method, "budget": comp.budget, "ratio": comp.ratio,
                "kv_bits": comp.kv_bits or (None if comp.memory is not None else 16), "memory": comp.memory,
                "reused_tokens": seq.reused_tokens, "kept_entries": kept,
                "kv_bytes": cache.physical_bytes() if cache else 0, "document": comp.document,
            },
        }  # fmt: skip
        with self._lock:
            if job in self._active:
                self._active.remove(job)
            if self.keep_turns and cache is not None and not job.cancelled.is_set():
                self._keep(seq.turn(), seq.compression)
            job.done = True
            self._collect_documents()
        ttft = None if job.first_token_at is None else job.first_token_at - job.submitted
        job.sink({"finish_reason": reason, "usage": usage, "ttft_s": ttft})

    def _find_turn(self, prompt_ids: list[int], compression: Compression) -> Turn | None:
        """The longest kept turn the prompt extends, kept under the same compression."""
        best: Turn | None = None
        for turn, comp, _ in self._turns.values():
            if (
                comp == compression
                and turn.continues(prompt_ids)
                and (best is None or len(turn.ids) > len(best.ids))
            ):
                best = turn
        return best

    def _keep(self, turn: Turn, compression: Compression) -> None:
        self._turns[turn.ids] = (turn, compression, turn.cache.physical_bytes())

    def _account(self) -> None:
        with self._lock:
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes())
            self.peak_active = max(self.peak_active, len(self._active))

    def _fail(self, job: Job, exc: BaseException) -> None:
        """End ``job`` alone with an error event, its cache freed, one log line naming it."""
        with self._lock:
            if job in self._active:
                self._active.remove(job)
            job.seq.cache = None
            job.done = True
            if job.steps is not None:
                job.steps.close()
                job.steps = None
            if job is self._reading:
                self._reading = None
            self._collect_documents()
        cause = str(exc) if isinstance(exc, KVBudgetError) else f"{type(exc).__name__}: {exc}"
        cause = " ".join(cause.split())[:300]
        log.error("request %s failed in the model thread: %s", job.request_id, cause)
        log.debug("request %s", job.request_id, exc_info=exc)
        job.sink({"error": cause})

    def _fail_all(self, exc: BaseException) -> None:
        """A forward over the whole batch failed: every active request ends with it."""
        with self._lock:
            jobs = list(self._active)
        for job in jobs:
            self._fail(job, exc)
