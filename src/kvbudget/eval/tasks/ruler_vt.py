"""RULER's variable tracking (vt): a chain of assignments ``VAR B = VAR A`` hidden in noise lines.

One chain of four hops (five variables of five capital letters, the first assigned a 5-digit
value); the answer is every variable that ends up holding the value. As RULER, the prompt opens
with a solved example of the task (three-letter names, about 500 tokens). Score: ``string_match_all``.
"""

from __future__ import annotations

import random
import string

from transformers import PreTrainedTokenizerBase

from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.ruler_common import count_tokens, fit_context, fit_count, insert_at_random, rng_for

NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text."
NUM_CHAINS = 1
NUM_HOPS = 4
MAX_NEW_TOKENS = 30
#: RULER sizes its worked example to 500 tokens including the 30 to generate
EXAMPLE_TOKENS = 500 - MAX_NEW_TOKENS


def question(value: int) -> str:
    return f"Question: Find all variables that are assigned the value {value} in the text above."


def answer_prefix(value: int, num_variables: int) -> str:
    # "assgined" is RULER's spelling; kept so prompts match the benchmark's.
    return (
        "Answer: According to the chain(s) of variable assignment in the text above, "
        f"{num_variables} variables are assgined the value {value}, they are:"
    )


def make_chains(
    rng: random.Random, num_chains: int, num_hops: int, name_length: int
) -> tuple[list[list[str]], list[list[str]], list[int]]:
    """(variable names, assignment lines, value) of each chain; all names distinct."""
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=name_length))
        if name not in names:
            names.append(name)
    variables, chains, values = [], [], []
    for c in range(num_chains):
        chain_vars = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        value = rng.randint(10000, 99998)
        lines = [f"VAR {chain_vars[0]} = {value}"]
        lines += [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} " for j in range(num_hops)]
        variables.append(chain_vars)
        chains.append(lines)
        values.append(value)
    return variables, chains, values


def body(chains: list[list[str]], noises: int, rng: random.Random) -> str:
    """``noises`` noise lines with each chain's lines inserted in order at random places."""
    lines = [NOISE_LINE] * noises
    for chain in chains:
        lines = insert_at_random(lines, chain, rng)
    return " ".join(lines).replace(". \n", ".\n")


def vt_sample(tokenizer: PreTrainedTokenizerBase, task: str, length: int, seed: int, index: int) -> Sample:
    """One vt sample whose context (worked example + instruction + text) is ``length`` tokens."""
    rng = rng_for(task, seed, index)
    ex_vars, ex_chains, ex_values = make_chains(rng, NUM_CHAINS, NUM_HOPS, name_length=3)
    variables, chains, values = make_chains(rng, NUM_CHAINS, NUM_HOPS, name_length=5)
    num_vars = NUM_HOPS + 1
    min_lines = sum(len(chain) for chain in chains)

    def example(n: int) -> str:
        text = body(ex_chains, n, rng_for(task, seed, index, f"example/{n}"))
        solved = f"{answer_prefix(ex_values[0], num_vars)} {' '.join(ex_vars[0])}"
        return f"{INSTRUCTION}\n\n{text}\n{question(ex_values[0])} {solved}"

    budget = min(EXAMPLE_TOKENS, length // 2)
    ex_noises, _ = fit_count(
        lambda n: count_tokens(tokenizer, example(n)), budget, min_lines, 10**6, max(min_lines, budget // 23)
    )
    head = f"{example(ex_noises)}\n\n{INSTRUCTION}\n\n"

    def build(n: int, _: int) -> str:
        return head + body(chains, n, rng_for(task, seed, index, f"slots/{n}"))

    guess = max(min_lines, (length - budget) // 23)
    fitted = fit_context(tokenizer, build, length, min_lines, 10**7, guess, task=task)
    return Sample(
        context=fitted.text,
        question=question(values[0]),
        answers=list(variables[0]),
        answer_prefix=answer_prefix(values[0], num_vars),
        max_new_tokens=MAX_NEW_TOKENS,
        meta={
            "task": task, "length": length, "index": index, "value": values[0], "chains": chains,
            "example_noises": ex_noises, "units": fitted.units, "tokens": fitted.tokens,
        },
    )  # fmt: skip
