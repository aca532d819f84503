"""What the shared-context tasks share: spreading planted items over the context, placing them,
measuring where they landed, and turning four questions into one :class:`Sample`.

A shared-context sample (SCBench: Li et al., "SCBench: A KV Cache-Centric Analysis of Long-Context
Methods", arXiv 2412.10319) is one long context and several questions about different parts of
it, asked one after another in one conversation (multi-turn) or each as its own request on the
same context (multi-request). So every question is answerable from the context alone, the planted
items lie in different parts of the context (one per stratum: quarter, sixteenth), and the
questions come in a shuffled order, never the context's.

Depths are fractions of the context in the model's tokens: the share of the context's tokens
that lie wholly before the item's first character (:func:`token_depths`).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvbudget.errors import InputError
from kvbudget.eval.sample import FollowUp, Sample
from kvbudget.eval.tasks.ruler_common import Fitted, count_tokens, fit_context
from kvbudget.eval.tasks.ruler_niah import essay_words, split_sentences

#: questions per sample (the first is ``Sample.question``, the rest ``Sample.follow_ups``)
NUM_TURNS = 4
#: an item's target depth keeps this share of its stratum's width from either edge
MARGIN = 0.2


def strata_windows(
    strata: int, start: float = 0.0, task: str = "shared-context"
) -> list[tuple[float, float]]:
    """Where an item of each of ``strata`` equal slices of the context may go, as fractions.

    Slice ``i`` is ``[i/strata, (i+1)/strata)`` narrowed by :data:`MARGIN` of its width on both
    sides (so an item placed a little off still lies in its slice), and cut below at ``start``
    (where the context's fixed head ends). Raises :class:`InputError` when the head leaves a slice
    no room.
    """
    width = 1 / strata
    windows = []
    for i in range(strata):
        lo, hi = max((i + MARGIN) * width, start), (i + 1 - MARGIN) * width
        if lo >= hi:
            raise InputError(
                f"{task}: the context's fixed head takes {start:.0%} of it, which leaves no room for an "
                f"item in slice {i + 1} of {strata}; ask for a longer length"
            )
        windows.append((lo, hi))
    return windows


def strata_depths(
    rng: random.Random, strata: int, per: int = 1, start: float = 0.0, task: str = "shared-context"
) -> list[list[float]]:
    """``per`` sorted random depths inside each window of :func:`strata_windows`."""
    return [sorted(rng.uniform(lo, hi) for _ in range(per)) for lo, hi in strata_windows(strata, start, task)]


def shuffled_order(rng: random.Random, n: int) -> list[int]:
    """A random permutation of ``range(n)`` that is not the identity (questions out of context order)."""
    order = list(range(n))
    while n > 1 and order == sorted(order):
        rng.shuffle(order)
    return order


def interleave(
    head: str,
    units: Sequence[str],
    needles: Sequence[str],
    depths: Sequence[float],
    sep: str,
    windows: Sequence[tuple[float, float]] | None = None,
    limit: int | None = None,
) -> tuple[str, list[int]]:
    """``head`` then ``units`` joined by ``sep``, each needle a unit of its own between two units.

    Needle ``j`` (``depths`` ascending) goes to the unit boundary where its first character lands
    nearest ``depths[j]`` of the whole text's characters — among the boundaries inside
    ``windows[j]`` (fractions) when there are any — never before an earlier needle nor after the
    first ``limit`` units (default: all). Returns the text and each needle's character offset.
    """
    limit = len(units) if limit is None else min(limit, len(units))
    gap = len(sep)
    starts = [0, *accumulate(len(u) + gap for u in units)]  # starts[k]: units[:k] with separators
    pieces = len(units) + len(needles)
    total = len(head) + sum(map(len, units)) + sum(map(len, needles)) + gap * max(pieces - 1, 0)
    cuts: list[int] = []
    earlier = 0  # characters of the earlier needles, separators too
    for j, (needle, depth) in enumerate(zip(needles, depths, strict=True)):
        shift = len(head) + earlier  # the needle's offset is shift + starts[cut]
        first, last = (cuts[-1] if cuts else 0), limit
        if windows is not None:
            lo, hi = windows[j]
            inside = (
                bisect.bisect_left(starts, lo * total - shift, lo=first),
                min(bisect.bisect_right(starts, hi * total - shift) - 1, last),
            )
            if inside[0] <= inside[1]:
                first, last = inside
        want = depth * total - shift
        k = bisect.bisect_left(starts, want, lo=first, hi=last + 1)
        candidates = [c for c in (k - 1, k) if first <= c <= last]
        cuts.append(min(candidates, key=lambda c: abs(starts[c] - want)))
        earlier += len(needle) + gap
    out: list[str] = []
    offsets: list[int] = []
    position, j = len(head), 0
    for k in range(len(units) + 1):
        while j < len(needles) and cuts[j] == k:
            offsets.append(position)
            out.append(needles[j])
            position += len(needles[j]) + gap
            j += 1
        if k < len(units):
            out.append(units[k])
            position += len(units[k]) + gap
    return head + sep.join(out), offsets


def token_depths(tokenizer: PreTrainedTokenizerBase, text: str, offsets: Sequence[int]) -> list[float]:
    """Each offset's depth: the share of ``text``'s tokens that end at or before it (4 decimals)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        ends = [end for _, end in backend.encode(text, add_special_tokens=False).offsets]
        return [round(bisect.bisect_right(ends, offset) / len(ends), 4) for offset in offsets]
    total = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [
        round(len(tokenizer(text[:offset], add_special_tokens=False)["input_ids"]) / total, 4)
        for offset in offsets
    ]


def distinct(
    rng: random.Random, draw: Callable[[random.Random], str], count: int, avoid: str = ""
) -> list[str]:
    """``count`` draws of ``draw(rng)``, none a substring of another nor found in ``avoid``."""
    items: list[str] = []
    for _ in range(1000 * count):
        item = draw(rng)
        if item not in avoid and not any(item in other or other in item for other in items):
            items.append(item)
            if len(items) == count:
                return items
    raise InputError(f"cannot draw {count} distinct items that the context does not already hold")


def shared_sample(context: str, turns: list[FollowUp], meta: dict[str, Any]) -> Sample:
    """The sample: the first turn as ``Sample``'s question (its meta merged into ``meta``), the rest
    as follow-ups. Each turn's meta holds its number (``turn``, from 1) and what it asks about."""
    first, *rest = turns
    return Sample(
        context=context,
        question=first.question,
        answers=first.answers,
        answer_prefix=first.answer_prefix,
        max_new_tokens=first.max_new_tokens,
        meta={**meta, **first.meta},
        follow_ups=rest,
    )


def essay_context(
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    rng: random.Random,
    head: str,
    needles: list[str],
    task: str,
) -> tuple[Fitted, list[int], list[float]]:
    """An essay haystack of ``length`` tokens after ``head``, ``needles[i]`` in stratum ``i`` at a
    depth drawn from ``rng``: the fitted context, each needle's character offset and token depth."""
    start = count_tokens(tokenizer, head) / length
    windows = strata_windows(len(needles), start, task)
    targets = [d for (d,) in strata_depths(rng, len(needles), start=start, task=task)]
    words = essay_words()
    placed: dict[int, list[int]] = {}

    def build(n: int, _: int) -> str:
        text, offsets = interleave(
            head, split_sentences(" ".join(words[:n]).strip()), needles, targets, " ", windows
        )
        placed[n] = offsets
        return text

    fitted = fit_context(tokenizer, build, length, 0, len(words), int(length / 1.35), task=task)
    offsets = placed[fitted.units]
    return fitted, offsets, token_depths(tokenizer, fitted.text, offsets)


def per_index(one: Callable[[PreTrainedTokenizerBase, int, int, int], Sample]):
    """A task's ``make_samples`` from its one-sample generator ``one(tokenizer, length, seed, index)``:
    sample ``i`` does not depend on how many are asked."""

    def make_samples(tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0):
        return [one(tokenizer, length, seed, index) for index in range(num_samples)]

    return make_samples
