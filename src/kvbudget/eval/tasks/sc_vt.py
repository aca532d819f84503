"""``sc_vt``: multi-hop variable tracking, four chains in one shared context (a shared-context task).

RULER's variable tracking (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context
Language Models?", arXiv 2404.06654; :mod:`kvbudget.eval.tasks.ruler_vt`), with four chains of four
hops (``VAR B = VAR A``, five variables of five capital letters, the first assigned a 5-digit
value, the values distinct) in RULER's noise lines, after RULER's solved example (one chain,
three-letter names). Each chain lies in its own quarter of the context: its five lines at sorted
random depths inside the quarter (away from its edges), so a chain's hops are spread over the
quarter but never leave it. Each of the four turns asks for one chain with RULER's question and
answer prefix ("Question: Find all variables that are assigned the value {value} in the text
above." / "Answer: According to the chain(s) of variable assignment in the text above, 5 variables
are assgined the value {value}, they are:"), the chains in a shuffled order (never the context's).
Score: ``string_match_all`` over the chain's five variables; 30 new tokens per turn (RULER's).

Several questions about different parts of one context, asked as turns of one conversation or as
separate requests on it, follow SCBench (Li et al., "SCBench: A KV Cache-Centric Analysis of
Long-Context Methods", arXiv 2412.10319), which also builds a multi-hop retrieval task on RULER's
variable tracking. Ours: each chain confined to a quarter (RULER scatters a chain's lines over the
whole text), and the solved example capped at an eighth of the length (RULER's ~470 tokens from
3,760 tokens on; RULER's vt caps it at half), so the first quarter has room for its chain.

``meta``: ``chains`` (each chain's ``value``, ``variables``, its lines' character ``offsets`` and
token ``depths``, in context order), ``depths`` (each chain's value line), ``order`` (the chain each
turn asks about), ``example_noises``; each turn's meta (the first turn's merged into
``Sample.meta``) holds ``turn`` (from 1), ``item`` (the chain), ``value``, ``depth`` (its value
line's), ``depth_last`` (its last hop's), ``offset`` and ``quarter``.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from kvbudget.eval.sample import FollowUp, Sample
from kvbudget.eval.tasks.ruler_common import count_tokens, fit_context, fit_count, rng_for
from kvbudget.eval.tasks.ruler_vt import (
    EXAMPLE_TOKENS,
    INSTRUCTION,
    NOISE_LINE,
    NUM_HOPS,
    answer_prefix,
    body,
    make_chains,
    question,
)
from kvbudget.eval.tasks.sc_common import (
    NUM_TURNS,
    interleave,
    per_index,
    shared_sample,
    shuffled_order,
    strata_depths,
    strata_windows,
    token_depths,
)

TASK = "sc_vt"
MAX_NEW_TOKENS = 30
#: the solved example takes at most this share of the length
EXAMPLE_SHARE = 1 / 8
#: noise lines' tokens, a first guess for the fit
_LINE_TOKENS = 23


def vt_sample(tokenizer: PreTrainedTokenizerBase, length: int, seed: int, index: int) -> Sample:
    """One ``sc_vt`` sample whose context (solved example + instruction + text) is ``length`` tokens."""
    rng = rng_for(TASK, seed, index)
    ex_vars, ex_chains, ex_values = make_chains(rng, 1, NUM_HOPS, name_length=3)
    while True:  # four chains with distinct values (names are distinct by construction)
        variables, chains, values = make_chains(rng, NUM_TURNS, NUM_HOPS, name_length=5)
        if len({*values, ex_values[0]}) == NUM_TURNS + 1:
            break
    num_vars = NUM_HOPS + 1

    def example(n: int) -> str:
        text = body(ex_chains, n, rng_for(TASK, seed, index, f"example/{n}"))
        solved = f"{answer_prefix(ex_values[0], num_vars)} {' '.join(ex_vars[0])}"
        return f"{INSTRUCTION}\n\n{text}\n{question(ex_values[0])} {solved}"

    budget = min(EXAMPLE_TOKENS, int(length * EXAMPLE_SHARE))
    ex_noises, _ = fit_count(
        lambda n: count_tokens(tokenizer, example(n)),
        budget,
        num_vars,
        10**6,
        max(num_vars, budget // _LINE_TOKENS),
    )
    head = f"{example(ex_noises)}\n\n{INSTRUCTION}\n\n"
    head_tokens = count_tokens(tokenizer, head)
    targets = strata_depths(rng, NUM_TURNS, per=num_vars, start=head_tokens / length, task=TASK)
    lines = [line for chain in chains for line in chain]
    flat = [depth for quarter in targets for depth in quarter]
    windows = [w for w in strata_windows(NUM_TURNS, head_tokens / length, TASK) for _ in range(num_vars)]
    order = shuffled_order(rng, NUM_TURNS)
    placed: dict[int, list[int]] = {}

    def build(n: int, _: int) -> str:
        text, offsets = interleave(head, [NOISE_LINE] * n, lines, flat, " ", windows)
        placed[n] = offsets
        return text

    guess = max(1, (length - head_tokens) // _LINE_TOKENS)
    fitted = fit_context(tokenizer, build, length, 0, 10**7, guess, task=TASK)
    offsets = placed[fitted.units]
    depths = token_depths(tokenizer, fitted.text, offsets)
    items = [
        {
            "value": values[c],
            "variables": variables[c],
            "offsets": offsets[c * num_vars : (c + 1) * num_vars],
            "depths": depths[c * num_vars : (c + 1) * num_vars],
        }
        for c in range(NUM_TURNS)
    ]
    turns = []
    for turn, c in enumerate(order, 1):
        meta = {
            "turn": turn, "item": c, "quarter": c + 1, "value": values[c], "offset": items[c]["offsets"][0],
            "depth": items[c]["depths"][0], "depth_last": items[c]["depths"][-1],
        }  # fmt: skip
        prefix = answer_prefix(values[c], num_vars)
        turns.append(FollowUp(question(values[c]), list(variables[c]), prefix, MAX_NEW_TOKENS, meta))
    meta = {
        "task": TASK, "length": length, "index": index, "seed": seed, "chains": items,
        "depths": [item["depths"][0] for item in items], "order": order, "example_noises": ex_noises,
        "units": fitted.units, "tokens": fitted.tokens,
    }  # fmt: skip
    return shared_sample(fitted.text, turns, meta)


make_samples = per_index(vt_sample)
