"""RULER's needle-in-a-haystack family (eight tasks): needles "One of the special magic {values}
for {key} is: {value}." hidden in repeated noise, Paul Graham essays, or other needles.

Keys are adjective-noun pairs from the wonderwords lists, 7-digit numbers or UUIDs; values are
7-digit numbers or UUIDs. With one queried value the prompt is phrased in the singular, as RULER
does. Score: ``string_match_all`` over the queried values.
"""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from kvbudget import data
from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.ruler_common import fit_context, insert_at_random, join_keys, rng_for

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
#: RULER's 40 insertion depths (percent) for the essay haystack: rounded linspace(0, 100, 40)
DEPTHS = tuple(round(100 * i / 39) for i in range(40))
MAX_NEW_TOKENS = 128
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")


@dataclass(frozen=True)
class NiahConfig:
    """One RULER niah task: haystack (repeat/essay/needle), key and value types, needle counts."""

    haystack: str
    key_type: str
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


CONFIGS = {
    "niah_single_1": NiahConfig("repeat", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_queries=4),
}


@lru_cache(maxsize=8)
def _single_words(words: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted({w.strip() for w in words if w.strip() and " " not in w.strip()}))


def single_words(kind: str) -> tuple[str, ...]:
    """wonderwords list ``kind`` (nouns/adjectives/verbs): distinct, sorted, one word each."""
    return _single_words(tuple(data.words(kind)))


def key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns) of wonderwords; a word key is ``adjective-noun``."""
    return single_words("adjectives"), single_words("nouns")


def random_item(rng: random.Random, kind: str, vocab: tuple[tuple[str, ...], tuple[str, ...]]) -> str:
    """A random 7-digit number, UUID (version 4) or adjective-noun word (RULER's three types).

    ``vocab`` is :func:`key_words` (adjectives, nouns).
    """
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        adjectives, nouns = vocab
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    raise ValueError(f"unknown needle type '{kind}'")


@lru_cache(maxsize=2)
def _words_of(text: str) -> tuple[str, ...]:
    return tuple(re.sub(r"\s+", " ", text).split(" "))


def essay_words() -> tuple[str, ...]:
    """RULER's essay haystack as a word list (whitespace runs collapsed, split on spaces)."""
    return _words_of(data.ruler_essays())


def split_sentences(text: str) -> list[str]:
    """Sentences: split after ``.``, ``!`` or ``?`` (optionally closing quote/bracket) and whitespace."""
    return [s for s in _SENTENCE_END.split(text) if s]


def prompt_parts(cfg: NiahConfig, query: str) -> tuple[str, str, str]:
    """(instruction, question, answer prefix) of RULER's niah template, singular for one value."""
    kind = cfg.value_type
    if cfg.num_queries * cfg.num_values == 1:
        kind = kind[:-1]
        return (
            f"A special magic {kind} is hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind} afterwards.",
            f"What is the special magic {kind} for {query} mentioned in the provided text?",
            f"The special magic {kind} for {query} mentioned in the provided text is",
        )
    return (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind} afterwards.",
        f"What are all the special magic {kind} for {query} mentioned in the provided text?",
        f"The special magic {kind} for {query} mentioned in the provided text are",
    )


def _piece_starts(line: str) -> list[int]:
    """Where suffixes of ``line`` may start: its beginning and after every space or hyphen."""
    return [0] + [i + 1 for i, c in enumerate(line) if c in " -"]


def niah_sample(tokenizer: PreTrainedTokenizerBase, task: str, length: int, seed: int, index: int) -> Sample:
    """One sample of RULER niah task ``task`` whose context is ``length`` tokens (within 1-2%)."""
    cfg = CONFIGS[task]
    rng = rng_for(task, seed, index)
    vocab = key_words() if "words" in (cfg.key_type, cfg.value_type) else ((), ())
    num_keys = max(cfg.num_keys, cfg.num_queries)
    keys: list[str] = []
    while len(keys) < num_keys:
        key = random_item(rng, cfg.key_type, vocab)
        if key not in keys:
            keys.append(key)
    values = [[random_item(rng, cfg.value_type, vocab) for _ in range(cfg.num_values)] for _ in keys]
    needles = [
        NEEDLE.format(kind=cfg.value_type, key=key, value=value)
        for key, vals in zip(keys, values, strict=True)
        for value in vals
    ]
    rng.shuffle(needles)
    queried = rng.sample(range(num_keys), cfg.num_queries)
    answers = [value for i in queried for value in values[i]]
    instruction, question, prefix = prompt_parts(cfg, join_keys([keys[i] for i in queried]))
    head = instruction + "\n"
    meta: dict = {"haystack": cfg.haystack, "needles": list(needles), "keys": [keys[i] for i in queried]}

    if cfg.haystack == "essay":
        words = essay_words()
        depths = sorted(rng.sample(DEPTHS, len(needles)))
        meta["depths"] = depths

        def build(n: int, _: int) -> str:
            sentences = split_sentences(" ".join(words[:n]).strip())
            cuts = [int(len(sentences) * depth / 100) for depth in depths] + [len(sentences)]
            parts, start = [], 0
            for cut, needle in zip(cuts, needles + [""], strict=True):
                parts += [" ".join(sentences[start:cut]), needle]
                start = cut
            return head + " ".join(p for p in parts if p)

        fitted = fit_context(tokenizer, build, length, 0, len(words), int(length / 1.35), task=task)
    else:
        distractors: list[str] = []
        hay_rng = rng_for(task, seed, index, "haystack")

        def filler(n: int) -> list[str]:
            if cfg.haystack == "repeat":
                return [NOISE] * n
            while len(distractors) < n + 1:  # one spare: the partial line
                key = random_item(hay_rng, cfg.key_type, vocab)
                if key not in keys:
                    value = random_item(hay_rng, cfg.value_type, vocab)
                    distractors.append(NEEDLE.format(kind=cfg.value_type, key=key, value=value))
            return distractors[:n]

        def build(n: int, k: int) -> str:
            lines = insert_at_random(filler(n), needles, rng_for(task, seed, index, f"slots/{n}"))
            if k:
                spare = distractors[n]
                lines.insert(0, spare[_piece_starts(spare)[-k] :])
            return head + "\n".join(lines)

        def pieces(n: int) -> int:
            filler(n)
            return len(_piece_starts(distractors[n])) - 1

        unit = 22 if cfg.haystack == "repeat" else (80 if cfg.key_type == "uuids" else 24)
        fitted = fit_context(
            tokenizer, build, length, len(needles), 10**7, max(len(needles), length // unit),
            pieces=None if cfg.haystack == "repeat" else pieces, task=task,
        )  # fmt: skip
    meta.update(units=fitted.units, partial_pieces=fitted.pieces, tokens=fitted.tokens)
    return Sample(
        context=fitted.text,
        question=question,
        answers=answers,
        answer_prefix=prefix,
        max_new_tokens=MAX_NEW_TOKENS,
        meta={"task": task, "length": length, "index": index, **meta},
    )
