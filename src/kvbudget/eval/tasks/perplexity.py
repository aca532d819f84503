"""Long-document perplexity with a fixed cache (PG-19 style, as D2O's and BaKlaVa's figures).

Samples are ``length``-token passages of the Jane Austen novels (Debian's ``r-cran-janeaustenr``).
The text is read in chunks of ``chunk`` tokens; each chunk's tokens are predicted from the cache:

* **decode-stage methods** (StreamingLLM, H2O, TOVA, ...): one running cache, trimmed back to the
  budget after every chunk, so it never holds more than ``budget + chunk`` entries;
* **prefill-stage methods** (SnapKV, AdaKV, ...): each chunk's prefix is prefilled and compressed
  once as :func:`kvbudget.engine.prefill_batch` does, then the chunk is scored on that compressed
  prefix (prune-stage methods prefill it with their pruned forward, two-pass methods' re-indexed
  positions continue into the chunk; lookahead methods look ahead from the prefix's end);
* **full**: the whole passage in one forward.

Deviation from token-by-token evaluation: chunks of 32 tokens (default) see each other causally
without eviction inside the chunk — 32× fewer forwards on a CPU; ``chunk=1`` is exact.

In the evaluation every method of a passage, the full cache included, scores the same tokens: those
from :func:`scored_from` on (the passage's second half), whatever its budget. A perplexity is only
comparable with another on the same tokens — the early ones, with little context, are harder.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvbudget.attention import attach
from kvbudget.data import austen_novels
from kvbudget.engine import prefill_batch
from kvbudget.errors import BudgetError, InputError
from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.base import TaskSpec
from kvbudget.methods.base import Method, RunState
from kvbudget.methods.profiled import ProfiledMethod
from kvbudget.phases import Stage
from kvbudget.prefill.common import PrefillInputs
from kvbudget.prefill.layerwise import prefill_for_decoding
from kvbudget.session import CompressionSession

#: Share of each evaluation passage that is context only and never scored (:func:`scored_from`).
CONTEXT_SHARE = 0.5


def scored_from(length: int, chunk: int = 32) -> int:
    """The first scored position of a ``length``-token passage in the evaluation, the same for every
    method and budget: ``⌊length · CONTEXT_SHARE⌋``, at least one ``chunk`` and at most ``length − 1``.

    :func:`chunked_perplexity`'s own default (``first_chunk`` = the budget) would score a different
    span per budget — the last ``length − budget`` tokens, and for the full cache every token after
    the first chunk — so the evaluation passes this as ``first_chunk`` to every run of a passage.
    """
    return max(chunk, min(int(length * CONTEXT_SHARE), length - 1))


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """What decides a tokenizer's ids, hashed: a fast tokenizer's whole serialised pipeline
    (normaliser, pre-tokeniser, model, post-processor), else its class and vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        content = backend.to_str()
    else:
        content = f"{type(tokenizer).__name__}{sorted(tokenizer.get_vocab().items())}"
    return hashlib.sha256(content.encode("utf-8")).hexdigest()


#: the novels' ids of the last two tokenizer pipelines (by :func:`tokenizer_fingerprint`)
_AUSTEN_IDS: OrderedDict[str, tuple[int, ...]] = OrderedDict()


def austen_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The token ids of every Austen novel, joined by blank lines (~4 M characters: seconds to
    tokenise; memoised per tokenizer pipeline, so another copy of one tokenizer reuses its ids)."""
    key = tokenizer_fingerprint(tokenizer)
    if key in _AUSTEN_IDS:
        _AUSTEN_IDS.move_to_end(key)
    else:
        text = "\n\n".join(austen_novels().values())
        _AUSTEN_IDS[key] = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        while len(_AUSTEN_IDS) > 2:
            _AUSTEN_IDS.popitem(last=False)
    return _AUSTEN_IDS[key]


def make_samples(
    tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
) -> list[Sample]:
    """``num_samples`` passages of exactly ``length`` tokens at seeded offsets of the novels."""
    ids = austen_ids(tokenizer)
    if length < 2 or length > len(ids):
        raise InputError(f"perplexity passages must be 2..{len(ids)} tokens, got {length}")
    rng = random.Random(seed)
    samples = []
    for index in range(num_samples):
        start = rng.randrange(0, len(ids) - length)
        samples.append(
            Sample(
                context=tokenizer.decode(list(ids[start : start + length])),
                question="",
                answers=[],
                max_new_tokens=0,
                meta={"task": "perplexity", "length": length, "index": index, "offset": start},
            )
        )
    return samples


@dataclass
class PerplexityResult:
    """Mean next-token NLL (nats) over the scored tokens, its perplexity, and the largest cache."""

    nll: float
    tokens: int
    max_entries_per_head: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed NLL of ``targets: [n]`` under ``logits: [n, vocab]``."""
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")


@torch.inference_mode()
def chunked_perplexity(
    model: PreTrainedModel,
    ids: torch.Tensor,
    method: Method,
    budget: int | None,
    chunk: int = 32,
    first_chunk: int | None = None,
    ratio: float | None = None,
    on_start: Callable[[RunState], None] | None = None,
) -> PerplexityResult:
    """Perplexity of ``ids: [1, T]`` with ``method`` holding the cache at ``budget`` entries per head.

    ``on_start`` is called with the run state of every run the call starts (diagnostics: D2O's
    merge watcher, the layer budgets a run chose).

    The first ``first_chunk`` tokens (default ``budget``, at least one chunk) form the initial
    context and are not scored; every later token is predicted from the compressed cache.

    ``ratio`` is the compression ratio at which a profiled method (SqueezeAttention, BaKlaVa)
    looks up its tuned parameters, pinned in each of the call's runs
    (:meth:`~kvbudget.methods.profiled.ProfiledRun.pin`); default ``budget / T``, the ratio an
    evaluation of the whole passage at ``budget`` uses. Without the pin each prefill would use its
    own ``budget / prefix``, ``≈ budget / (budget + chunk)``.
    """
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1
    ):
        raise BudgetError(f"the perplexity's compression ratio must be in (0, 1], got {ratio!r}")
    attach(model)
    pinned = None
    if isinstance(method, ProfiledMethod) and budget is not None:
        pinned = ratio if ratio is not None else min(budget / ids.shape[1], 1.0)
    return _chunked_perplexity(model, ids, method, budget, chunk, first_chunk, pinned, on_start)


def _chunked_perplexity(
    model: PreTrainedModel,
    ids: torch.Tensor,
    method: Method,
    budget: int | None,
    chunk: int,
    first_chunk: int | None,
    pinned: float | None = None,
    on_start: Callable[[RunState], None] | None = None,
) -> PerplexityResult:
    """:func:`chunked_perplexity` on an attached model; ``pinned``: the ratio a profiled method's
    runs pick tuned parameters at."""

    def session_for() -> CompressionSession:
        session = CompressionSession(method, layers, budget=budget, model=model)
        if pinned is not None:
            session.run.pin(pinned)
        if on_start is not None:
            on_start(session.run)
        return session

    ids = ids.to(model.device)
    total = ids.shape[1]
    start = max(chunk, min(first_chunk or budget or chunk, total - 1))
    layers = model.config.num_hidden_layers
    if method.name == "full" or budget is None:
        logits = model(ids).logits[0, start - 1 : -1]
        return PerplexityResult(float(_nll(logits, ids[0, start:])) / (total - start), total - start, total)
    nll, scored, peak = 0.0, 0, 0
    if Stage.DECODE in method.stages:
        cache, logits = prefill_for_decoding(model, ids[:, :start], session_for())
        for pos in range(start, total, chunk):
            stop = min(pos + chunk, total)
            nll += float(_nll(logits, ids[0, pos : pos + 1]))
            out = model(ids[:, pos:stop], past_key_values=cache, use_cache=True).logits[0]
            nll += float(_nll(out[:-1], ids[0, pos + 1 : stop]))
            scored += stop - pos
            peak = max(peak, int(cache.stats().entries.max()))
            logits = out[-1:]
    else:
        for pos in range(start, total, chunk):
            stop = min(pos + chunk, total)
            session = session_for()
            head = ids[:, :pos]
            prefix = PrefillInputs(
                head, torch.ones_like(head), torch.arange(pos, device=ids.device)[None], pos
            )
            cache, prefix_logits, prefix = prefill_batch(model, prefix, session)
            next_pos = int(prefix.positions[0, -1]) + 1  # a two-pass method's positions are re-indexed
            session.stop()  # the chunk is scored on the compressed prefix, uncompressed
            positions = torch.arange(next_pos, next_pos + stop - pos, device=ids.device)[None]
            out = model(ids[:, pos:stop], position_ids=positions, past_key_values=cache, use_cache=True)
            out = out.logits[0]
            nll += float(_nll(torch.cat([prefix_logits[-1:], out[:-1]]), ids[0, pos:stop]))
            scored += stop - pos
            peak = max(peak, int(cache.stats().entries.max()))
    return PerplexityResult(nll / scored, scored, peak)


TASKS = {
    "perplexity": TaskSpec(
        "perplexity",
        "perplexity",
        make_samples,
        lambda prediction, answers: 0.0,
        "perplexity",
        ("janeaustenr",),
    ),
}
