"""Shared machinery of the RULER generators: seeding, token counting and fitting a context's length.

Every RULER context grows with a count of haystack units (words, noise lines, distractor needles,
documents, list entries). RULER finds that count by stepping it up and re-tokenising; here
:func:`fit_context` estimates tokens per unit from a measurement or two and jumps to the count that
hits the target (two to five tokenisations), then, for coarse units (documents, UUID needles),
fills the remainder with part of one more unit, so the whole context lands within about 1% of the
length (2% at most).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from kvbudget.errors import InputError

#: the fitter stops once the context is this close to the target (relative)
AIM = 0.004
#: the contract: a context must be within this of the target, else the length is rejected
TOLERANCE = 0.02
#: a partial unit shorter than this many pieces is dropped when the context is within tolerance anyway
MIN_PIECES = 3


def rng_for(task: str, seed: int, index: int, purpose: str = "") -> random.Random:
    """A generator seeded by (task, seed, sample index, purpose): independent streams, reproducible."""
    return random.Random(f"ruler/{task}/{seed}/{index}/{purpose}")


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """Tokens of ``text`` without special tokens (the fast backend directly: no length warnings)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return len(backend.encode(text, add_special_tokens=False).ids)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fit_count(measure: Callable[[int], int], target: int, lo: int, hi: int, guess: int) -> tuple[int, int]:
    """The ``n`` in ``[lo, hi]`` whose ``measure(n)`` is nearest ``target`` (``measure`` ~linear in n).

    Secant steps from ``measure(lo)``; stops within :data:`AIM` of the target. Returns
    ``(n, measure(n))``.
    """
    seen: dict[int, int] = {}

    def m(n: int) -> int:
        if n not in seen:
            seen[n] = measure(n)
        return seen[n]

    def clamp(n: int) -> int:
        return min(max(n, lo), hi)

    base = m(lo)
    n = clamp(guess)
    for _ in range(24):
        t = m(n)
        if abs(t - target) <= AIM * target:
            break
        if n > lo and t > base:
            step = clamp(lo + round((target - base) * (n - lo) / (t - base)))
        else:
            step = clamp(max(2 * n, lo + 1))
        if step in seen:
            step = clamp(n + (1 if t < target else -1))
            if step in seen:
                break
        n = step
    best = min(seen, key=lambda k: (abs(seen[k] - target), k))
    return best, seen[best]


@dataclass(frozen=True)
class Fitted:
    """A fitted context: its text, whole units, pieces of the partial unit, and token count."""

    text: str
    units: int
    pieces: int
    tokens: int


def fit_context(
    tokenizer: PreTrainedTokenizerBase,
    build: Callable[[int, int], str],
    length: int,
    lo: int,
    hi: int,
    guess: int,
    pieces: Callable[[int], int] | None = None,
    task: str = "ruler",
) -> Fitted:
    """Fit ``build(units, pieces)`` to ``length`` tokens.

    ``units`` whole haystack units in ``[lo, hi]``; when ``pieces`` is given (coarse units), the
    count of whole units is the largest that fits and ``build(units, k)`` adds ``k`` of the
    ``pieces(units)`` pieces (words) of one more unit. Raises :class:`InputError` when the
    nearest context is not within :data:`TOLERANCE` (a length too small or too large for the data).
    """

    seen: dict[tuple[int, int], int] = {}

    def count(n: int, k: int = 0) -> int:
        if (n, k) not in seen:
            seen[n, k] = count_tokens(tokenizer, build(n, k))
        return seen[n, k]

    units, tokens = fit_count(count, length, lo, hi, guess)
    partial = 0
    if pieces is not None and abs(tokens - length) > AIM * length:
        while tokens > length and units > lo:
            units -= 1
            tokens = count(units)
        available = pieces(units)
        if tokens < length and available > 0:
            partial, tokens = fit_count(lambda k: count(units, k), length, 0, available, available // 2)
            if partial < MIN_PIECES and abs(count(units) - length) <= TOLERANCE * length:
                partial, tokens = 0, count(units)  # a stub of two words is worse than a 1-2% miss
    if abs(tokens - length) > TOLERANCE * length:
        raise InputError(
            f"{task}: cannot fit a context of {length} tokens (nearest: {tokens} tokens); "
            "the length is too small for the task's fixed parts or too large for its data"
        )
    return Fitted(build(units, partial), units, partial, tokens)


def join_keys(keys: list[str]) -> str:
    """RULER's query list: ``a``; ``a, b, and c``."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def insert_at_random(lines: list[str], items: list[str], rng: random.Random) -> list[str]:
    """``items`` inserted before distinct random lines (as RULER: never after the last), in order."""
    if len(items) > len(lines):
        raise InputError(f"cannot place {len(items)} items among {len(lines)} lines")
    slots = sorted(rng.sample(range(len(lines)), len(items)))
    out = list(lines)
    for offset, (slot, item) in enumerate(zip(slots, items, strict=True)):
        out.insert(slot + offset, item)
    return out
