"""``sc_aggregate``: every value of a key, gathered from the whole shared context (a shared-context task).

The haystack is RULER's essays (Hsieh et al., "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv 2404.06654) with sixteen of RULER's needles "One of the
special magic numbers for {key} is: {7-digit number}.": four keys (adjective-noun pairs from the
wonderwords lists), four values each. The needles are spread uniformly over the context, one in
each sixteenth (a random depth inside it, away from its edges), and interleaved between the keys:
each quarter holds one value of every key, in a random order. Each of the four turns asks for all
of one key's values with RULER's multi-value question and answer prefix ("What are all the
special magic numbers for {key} mentioned in the provided text?" / "The special magic numbers for
{key} mentioned in the provided text are"), the keys in a shuffled order (never the order in which
they first appear). Score: ``string_match_all``, the fraction of the key's four values found.

An answer aggregates the whole context, so every turn needs every quarter of the cache: SCBench's
global-information setting (Li et al., "SCBench: A KV Cache-Centric Analysis of Long-Context
Methods", arXiv 2412.10319) asked on RULER's multi-value needles, four times over one context.
Ours, not SCBench's or RULER's: the four keys sharing one haystack; 64 new tokens per turn (four
7-digit numbers; RULER allows 128).

``meta``: ``keys``, ``items`` (each needle's key, value, character ``offset`` and token ``depth``,
in context order), ``depths`` (the sixteen), ``order`` (the key each turn asks about, by its index
in ``keys``); each turn's meta (the first turn's merged into ``Sample.meta``) holds ``turn`` (from
1), ``item`` (the key's index), ``key``, ``depth_first`` and ``depth_last`` (its first and last
value's depth) and ``key_depths`` (all four).
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

TASK = "sc_aggregate"
MAX_NEW_TOKENS = 64
#: values per key (one in each quarter)
NUM_VALUES = 4
#: RULER's multi-value template
_CONFIG = CONFIGS["niah_multivalue"]
INSTRUCTION = prompt_parts(_CONFIG, "")[0]


def question_and_prefix(key: str) -> tuple[str, str]:
    """RULER's multi-value question and answer prefix for ``key``."""
    _, question, prefix = prompt_parts(_CONFIG, key)
    return question, prefix


def aggregate_sample(tokenizer: PreTrainedTokenizerBase, length: int, seed: int, index: int) -> Sample:
    """One ``sc_aggregate`` sample whose context is ``length`` tokens (within 2%)."""
    rng = rng_for(TASK, seed, index)
    vocab = key_words()
    keys = distinct(rng, lambda r: random_item(r, "words", vocab), NUM_TURNS)
    values = distinct(rng, lambda r: random_item(r, "numbers", vocab), NUM_TURNS * NUM_VALUES)
    owners = [k for _ in range(NUM_VALUES) for k in rng.sample(range(NUM_TURNS), NUM_TURNS)]  # per quarter
    seen = [0] * NUM_TURNS
    slot_values = []
    for key in owners:  # key k's j-th value (in context order) is values[4k + j]
        slot_values.append(values[NUM_VALUES * key + seen[key]])
        seen[key] += 1
    needles = [
        NEEDLE.format(kind="numbers", key=keys[k], value=v) for k, v in zip(owners, slot_values, strict=True)
    ]
    fitted, offsets, depths = essay_context(tokenizer, length, rng, INSTRUCTION + "\n", needles, TASK)
    first_seen = sorted(range(NUM_TURNS), key=owners.index)
    order = [first_seen[i] for i in shuffled_order(rng, NUM_TURNS)]
    items = [
        {"key": keys[k], "value": v, "offset": o, "depth": d}
        for k, v, o, d in zip(owners, slot_values, offsets, depths, strict=True)
    ]
    turns = []
    for turn, key in enumerate(order, 1):
        question, prefix = question_and_prefix(keys[key])
        key_depths = [d for k, d in zip(owners, depths, strict=True) if k == key]
        meta = {
            "turn": turn, "item": key, "key": keys[key], "depth_first": key_depths[0],
            "depth_last": key_depths[-1], "key_depths": key_depths,
        }  # fmt: skip
        answers = values[NUM_VALUES * key : NUM_VALUES * (key + 1)]
        turns.append(FollowUp(question, answers, prefix, MAX_NEW_TOKENS, meta))
    meta = {
        "task": TASK, "length": length, "index": index, "seed": seed, "keys": keys, "items": items,
        "depths": depths, "order": order, "units": fitted.units, "tokens": fitted.tokens,
    }  # fmt: skip
    return shared_sample(fitted.text, turns, meta)


make_samples = per_index(aggregate_sample)
