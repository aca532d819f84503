"""RULER's aggregation tasks: common words extraction (cwe) and frequent words extraction (fwe).

cwe: a numbered list of wonderwords words where 10 words appear 30 times and the others 3 times
(6 and 1 below 4096 tokens), preceded by a solved smaller example; answer = the 10 common words.
fwe: "coded" 6-letter words drawn with Zipf frequencies (alpha 2.0, vocabulary length // 50), the
most frequent one replaced by "..."; answer = the next three. Score: ``string_match_all``.
"""

from __future__ import annotations

import math
import random
import string

from transformers import PreTrainedTokenizerBase

from kvbudget.errors import InputError
from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.ruler_common import fit_context, rng_for
from kvbudget.eval.tasks.ruler_niah import single_words

CWE_INSTRUCTION = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
CWE_NUM_COMMON = 10
CWE_MAX_NEW_TOKENS = 120
#: (example words, example common repeats, example uncommon repeats, common repeats, uncommon repeats)
CWE_SHORT = (20, 3, 1, 6, 1)  # RULER below 4096 tokens
CWE_LONG = (40, 10, 3, 30, 3)  # RULER's defaults: freq_cw 30, freq_ucw 3, num_cw 10

FWE_INSTRUCTION = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words."
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_ALPHA = 2.0
FWE_WORD_LENGTH = 6
FWE_MAX_NEW_TOKENS = 50


def numbered(words: list[str]) -> str:
    """RULER's list format: ``1. w1 2. w2 ...``."""
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def cwe_pool() -> tuple[str, ...]:
    """RULER's cwe vocabulary: wonderwords nouns + adjectives + verbs, distinct, one word each."""
    return tuple(
        sorted(set(single_words("nouns")) | set(single_words("adjectives")) | set(single_words("verbs")))
    )


def _word_list(words: list[str], common: int, common_repeats: int, uncommon_repeats: int, rng) -> list[str]:
    items = words[:common] * common_repeats + words[common:] * uncommon_repeats
    rng.shuffle(items)
    return items


def cwe_sample(tokenizer: PreTrainedTokenizerBase, task: str, length: int, seed: int, index: int) -> Sample:
    """One cwe sample whose context (solved example + instruction + list) is ``length`` tokens."""
    ex_words, ex_cr, ex_ur, cr, ur = CWE_SHORT if length < 4096 else CWE_LONG
    rng = rng_for(task, seed, index)
    pool = cwe_pool()
    example_words = rng.sample(pool, ex_words)
    taken = set(example_words)
    rest = [w for w in pool if w not in taken]
    order = rng.sample(rest, min(len(rest), length // 3 + 64))
    ex_items = _word_list(example_words, CWE_NUM_COMMON, ex_cr, ex_ur, rng)
    example = (
        f"{CWE_INSTRUCTION}\n{numbered(ex_items)}\n{CWE_QUESTION} {CWE_PREFIX} "
        f"{numbered(example_words[:CWE_NUM_COMMON])}"
    )
    head = f"{example}\n{CWE_INSTRUCTION}\n"

    def build(n: int, _: int) -> str:
        items = _word_list(order[:n], CWE_NUM_COMMON, cr, ur, rng_for(task, seed, index, f"order/{n}"))
        return head + numbered(items)

    guess = max(CWE_NUM_COMMON, (length // 2) // (5 * ur))
    fitted = fit_context(tokenizer, build, length, CWE_NUM_COMMON, len(order), guess, task=task)
    common = order[:CWE_NUM_COMMON]
    return Sample(
        context=fitted.text,
        question=CWE_QUESTION,
        answers=list(common),
        answer_prefix=CWE_PREFIX,
        max_new_tokens=CWE_MAX_NEW_TOKENS,
        meta={
            "task": task, "length": length, "index": index, "common_repeats": cr,
            "uncommon_repeats": ur, "num_words": fitted.units, "tokens": fitted.tokens,
        },
    )  # fmt: skip


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta(alpha), alpha > 1 (partial sum plus Euler-Maclaurin tail; ~1e-12 accurate)."""
    head = math.fsum(k**-alpha for k in range(1, terms))
    return (
        head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha + alpha * terms ** (-alpha - 1) / 12
    )


def zipf_counts(total: int, vocab: int, alpha: float = FWE_ALPHA) -> list[int]:
    """RULER's word counts: ``int(total * k**-alpha / zeta(alpha))`` for ranks k = 1..vocab."""
    z = zeta(alpha)
    return [int(total * k**-alpha / z) for k in range(1, vocab + 1)]


def coded_vocab(rng: random.Random, size: int) -> list[str]:
    """``size`` distinct random lowercase words, ranked at random; rank 1 is the "..." noise."""
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LENGTH))
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    vocab[0] = "..."
    return vocab


def fwe_sample(tokenizer: PreTrainedTokenizerBase, task: str, length: int, seed: int, index: int) -> Sample:
    """One fwe sample whose context (instruction + coded text) is ``length`` tokens."""
    vocab = coded_vocab(rng_for(task, seed, index), max(5, length // 50))

    def build(n: int, _: int) -> str:
        items = [w for w, c in zip(vocab, zipf_counts(n, len(vocab)), strict=True) for _ in range(c)]
        rng_for(task, seed, index, f"order/{n}").shuffle(items)
        return f"{FWE_INSTRUCTION} {' '.join(items)}"

    fitted = fit_context(tokenizer, build, length, 1, 10**8, max(1, int(length / 1.6)), task=task)
    counts = zipf_counts(fitted.units, len(vocab))
    if not counts[1] > counts[2] > counts[3] > counts[4]:
        raise InputError(f"{task}: {length} tokens is too short for distinct top-3 word counts")
    return Sample(
        context=fitted.text,
        question=FWE_QUESTION,
        answers=vocab[1:4],
        answer_prefix=FWE_PREFIX,
        max_new_tokens=FWE_MAX_NEW_TOKENS,
        meta={
            "task": task, "length": length, "index": index, "total_words": fitted.units,
            "top_counts": dict(zip(vocab[:5], counts[:5], strict=True)), "tokens": fitted.tokens,
        },
    )  # fmt: skip
