"""``sc_keys``: multi-key retrieval over one shared context, four questions (a shared-context task).

The haystack is RULER's essays (Hsieh et al., "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv 2404.06654), with RULER's needles "One of the special magic
numbers for {key} is: {7-digit number}." — four of them, keys adjective-noun pairs from the
wonderwords lists, one needle in each quarter of the context (a random depth inside the quarter,
away from its edges), placed between sentences. Each of the four turns asks for one key's number
with RULER's single-value question and answer prefix ("What is the special magic number for
{key} mentioned in the provided text?" / "The special magic number for {key} mentioned in the
provided text is"), the keys in a shuffled order (never the context's); the instruction is
RULER's plural one, as four numbers are hidden. Score: ``string_match_all`` on the number.

Four questions about different parts of one context, asked as turns of one conversation or as
separate requests on it, follow SCBench (Li et al., "SCBench: A KV Cache-Centric Analysis of
Long-Context Methods", arXiv 2412.10319): a cache compressed for the first question must still
hold what the later ones need. Ours, not SCBench's: the essay haystack and RULER's needles (SCBench's
retrieval tasks use their own key-value and prefix-suffix strings); 32 new tokens per turn (RULER
allows 128 for one number).

``meta``: ``items`` (each needle's key, value, character ``offset`` and token ``depth``, in context
order), ``depths``, ``order`` (the item each turn asks about); each turn's meta (the first turn's
merged into ``Sample.meta``) holds ``turn`` (from 1), ``item``, ``key``, ``value``, ``depth``,
``offset`` and ``quarter``.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from kvbudget.eval.sample import FollowUp, Sample
from kvbudget.eval.tasks.ruler_common import rng_for
from kvbudget.eval.tasks.ruler_niah import (
    CONFIGS,
    NEEDLE,
    key_words,
    prompt_parts,
    random_item,
)
from kvbudget.eval.tasks.sc_common import (
    NUM_TURNS,
    distinct,
    essay_context,
    per_index,
    shared_sample,
    shuffled_order,
)

TASK = "sc_keys"
MAX_NEW_TOKENS = 32
#: RULER's plural instruction (several numbers are hidden)
INSTRUCTION = prompt_parts(CONFIGS["niah_multiquery"], "")[0]


def question_and_prefix(key: str) -> tuple[str, str]:
    """RULER's single-value question and answer prefix for ``key``."""
    _, question, prefix = prompt_parts(CONFIGS["niah_multikey_1"], key)
    return question, prefix


def keys_sample(tokenizer: PreTrainedTokenizerBase, length: int, seed: int, index: int) -> Sample:
    """One ``sc_keys`` sample whose context is ``length`` tokens (within 2%)."""
    rng = rng_for(TASK, seed, index)
    vocab = key_words()
    keys = distinct(rng, lambda r: random_item(r, "words", vocab), NUM_TURNS)
    values = distinct(rng, lambda r: random_item(r, "numbers", vocab), NUM_TURNS)
    needles = [NEEDLE.format(kind="numbers", key=k, value=v) for k, v in zip(keys, values, strict=True)]
    fitted, offsets, depths = essay_context(tokenizer, length, rng, INSTRUCTION + "\n", needles, TASK)
    order = shuffled_order(rng, NUM_TURNS)
    items = [
        {"key": k, "value": v, "offset": o, "depth": d}
        for k, v, o, d in zip(keys, values, offsets, depths, strict=True)
    ]
    turns = []
    for turn, item in enumerate(order, 1):
        question, prefix = question_and_prefix(keys[item])
        meta = {"turn": turn, "item": item, "quarter": item + 1, **items[item]}
        turns.append(FollowUp(question, [values[item]], prefix, MAX_NEW_TOKENS, meta))
    meta = {
        "task": TASK, "length": length, "index": index, "seed": seed, "items": items, "depths": depths,
        "order": order, "units": fitted.units, "tokens": fitted.tokens,
    }  # fmt: skip
    return shared_sample(fitted.text, turns, meta)


make_samples = per_index(keys_sample)
