"""InfiniteBench's synthetic retrieval tasks (Zhang et al. 2024, "∞Bench"), built to its generator.

- ``passkey``: the noise line "The grass is green. The sky is blue. The sun is yellow. Here we go.
  There and back again." repeated, with "The pass key is NNNNN. Remember it. NNNNN is the pass
  key." inserted as a line at some depth; NNNNN is five random digits.
- ``number_string``: the same with "The sequence of digits is D…D. Remember it. D…D is the
  sequence of digits." — ten digits: five random ones, then five copies of existing digits
  inserted next to them (InfiniteBench's rule, which makes repeated digits common).
- ``kv_retrieval``: a JSON object of random UUID keys → UUID values; the question gives one key.
- ``math_find``: a Python-style list of integers 0–99; the question asks for the largest, second
  largest, third largest, smallest, second smallest, third smallest or median number
  (InfiniteBench's seven kinds, cycled over the samples; value ranges drawn as InfiniteBench does).

Prompts follow InfiniteBench's templates (``{prompt}\\n\\n{context}\\n\\n{input}``, with the answer
prefix its completion-style templates append, e.g. "The pass key is"): the instruction opens the
context, the question follows it, and the answer prefix follows the generation prompt.

``length`` is the context's length in the model's tokens (instruction included), within 2%
(one noise sentence, list number or JSON pair is the granularity; for ``kv_retrieval`` pairs are
re-drawn until the total fits, which needs UUIDs whose token counts vary, as with BPE tokenizers).
Depths, keys and numbers are drawn from ``seed``: sample ``i`` of ``n`` sits at a depth drawn
uniformly within the i-th of n equal slices of [0, 1] (so a run covers all depths evenly).

Metrics: ``passkey``/``number_string``: the answer appears as a whole number (not inside a longer
digit run) in the prediction; ``kv_retrieval``: the value appears as a word after splitting on
InfiniteBench's separators (its own rule); ``math_find``: InfiniteBench's rule — the first number
in the prediction equals the answer (containment would be meaningless for two-digit answers).
"""

from __future__ import annotations

import random
import re
import statistics
import uuid
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from kvbudget.errors import InputError
from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.base import TaskSpec

NOISE = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
PASSKEY_PROMPT = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
NUMBER_STRING_PROMPT = (
    "There is an important info hidden inside a lot of irrelevant text. Find it. "
    "I will quiz you about the important information there."
)
KV_PROMPT = "Extract the value corresponding to the specified key in the JSON object below."
KV_ANSWER_PREFIX = "The value associated with the specified key is:"
MATH_KINDS = (
    "largest",
    "second largest",
    "third largest",
    "smallest",
    "second smallest",
    "third smallest",
    "median",
)
MATH_ANSWER_ONLY = "You should answer with only one number, no other words."

#: relative tolerance on the context length in tokens
TOLERANCE = 0.02
# aim inside the tolerance so a retokenised context still fits
_AIM = 0.01


# --- shared helpers (also used by the code tasks) ---------------------------------------------------


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """Length of ``text`` in the tokenizer's tokens, without special tokens."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fit_units(count: Callable[[int], int], target: int, max_units: int, guess: int) -> int:
    """The number of units ``n`` in ``[0, max_units]`` whose ``count(n)`` is nearest ``target``.

    ``count`` must be non-decreasing in ``n`` (tokens of a text built from ``n`` units). Brackets
    the target by doubling steps from ``guess``, then bisects: O(log) calls to ``count``.
    """
    cache: dict[int, int] = {}

    def c(n: int) -> int:
        if n not in cache:
            cache[n] = count(n)
        return cache[n]

    n = min(max(guess, 0), max_units)
    step = max(1, n // 64)
    if c(n) < target:
        lo, hi = n, n + step
        while hi < max_units and c(hi) < target:
            lo, step = hi, step * 2
            hi = hi + step
        hi = min(hi, max_units)
    else:
        lo, hi = n - step, n
        while lo > 0 and c(lo) >= target:
            hi, step = lo, step * 2
            lo = lo - step
        lo = max(lo, 0)
    # invariant (when reachable): c(lo) < target <= c(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if c(mid) < target:
            lo = mid
        else:
            hi = mid
    return min((lo, hi), key=lambda k: (abs(c(k) - target), k))


def check_length(length: int, minimum: int = 16) -> None:
    if length < minimum:
        raise InputError(f"length must be at least {minimum} tokens, got {length}")


def sample_depths(rng: random.Random, num_samples: int) -> list[float]:
    """One depth per sample: uniform within the i-th of ``num_samples`` equal slices of [0, 1]."""
    return [(i + rng.random()) / num_samples for i in range(num_samples)]


def _check_num(num_samples: int) -> None:
    if num_samples < 1:
        raise InputError(f"num_samples must be at least 1, got {num_samples}")


# --- passkey / number_string ------------------------------------------------------------------------


def _noise_lines(n_sentences: int) -> list[str]:
    full, rest = divmod(n_sentences, len(NOISE))
    lines = [" ".join(NOISE)] * full
    if rest:
        lines.append(" ".join(NOISE[:rest]))
    return lines


def _haystack(prompt: str, needle: str, n_sentences: int, depth: float) -> str:
    lines = _noise_lines(n_sentences)
    lines.insert(round(depth * len(lines)), needle)
    return prompt + "\n\n" + "\n".join(lines)


def _fit_haystack(tokenizer: PreTrainedTokenizerBase, prompt: str, needle: str, length: int, depth: float):
    per_sentence = count_tokens(tokenizer, " ".join(NOISE) + "\n") / len(NOISE)
    fixed = count_tokens(tokenizer, prompt + "\n\n" + needle + "\n")
    guess = max(0, round((length - fixed) / per_sentence))
    n = fit_units(
        lambda k: count_tokens(tokenizer, _haystack(prompt, needle, k, depth)),
        length,
        max_units=4 * length,
        guess=guess,
    )
    return _haystack(prompt, needle, n, depth)


def _passkey_maker(kind: str):
    def make_samples(
        tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
    ) -> list[Sample]:
        check_length(length, 64)
        _check_num(num_samples)
        rng = random.Random(f"infinitebench:{kind}:{seed}")
        samples = []
        for index, depth in enumerate(sample_depths(rng, num_samples)):
            if kind == "passkey":
                key = "".join(str(rng.randint(0, 9)) for _ in range(5))
                needle = f"The pass key is {key}. Remember it. {key} is the pass key."
                prompt, question, prefix, max_new = (
                    PASSKEY_PROMPT,
                    "What is the pass key?",
                    "The pass key is",
                    12,
                )
            else:
                digits = [str(rng.randint(0, 9)) for _ in range(5)]
                for k in range(5):
                    pos = rng.randint(0, 5 + k - 1)
                    digits.insert(pos, digits[pos])
                key = "".join(digits)
                needle = f"The sequence of digits is {key}. Remember it. {key} is the sequence of digits."
                prompt, question = NUMBER_STRING_PROMPT, "What is the sequence of digits?"
                prefix, max_new = "The sequence of digits is", 16
            context = _fit_haystack(tokenizer, prompt, needle, length, depth)
            samples.append(
                Sample(
                    context=context,
                    question=question,
                    answers=[key],
                    answer_prefix=prefix,
                    max_new_tokens=max_new,
                    meta={
                        "task": kind,
                        "length": length,
                        "index": index,
                        "seed": seed,
                        "depth": round(depth, 4),
                        "needle": needle,
                        "context_tokens": count_tokens(tokenizer, context),
                    },
                )
            )
        return samples

    return make_samples


def contains_number(prediction: str, answers: list[str]) -> float:
    """1 if an answer appears in the prediction as a whole number (not inside a longer digit run)."""
    return float(any(re.search(rf"(?<!\d){re.escape(a)}(?!\d)", prediction) for a in answers))


# --- kv_retrieval -----------------------------------------------------------------------------------


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _kv_context(pairs: list[tuple[str, str]]) -> str:
    body = ", ".join(f'"{k}": "{v}"' for k, v in pairs)
    return f"{KV_PROMPT}\n\nJSON data:\n{{{body}}}"


def _fit_kv(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, rng: random.Random
) -> tuple[str, str, str, int]:
    pool: list[tuple[str, str]] = []

    def pairs(n: int) -> list[tuple[str, str]]:
        while len(pool) < n:
            pool.append((_uuid(rng), _uuid(rng)))
        return pool[:n]

    per_pair = count_tokens(tokenizer, _kv_context(pairs(8))) - count_tokens(tokenizer, _kv_context(pairs(7)))
    fixed = count_tokens(tokenizer, _kv_context([]))
    guess = max(1, round((length - fixed) / max(per_pair, 1)))
    n = fit_units(lambda k: count_tokens(tokenizer, _kv_context(pairs(max(k, 1)))), length, 4 * length, guess)
    n = max(n, 1)
    chosen = list(pairs(n))
    target = min(n - 1, int(depth * n))
    total = count_tokens(tokenizer, _kv_context(chosen))
    # Pairs are the granularity (tens of tokens): re-draw non-target pairs, keeping the candidate
    # that brings the total nearest the length, until it is within the aim.
    positions = [i for i in range(n) if i != target]
    rng.shuffle(positions)
    for i in positions:
        if abs(total - length) <= _AIM * length:
            break
        best = (abs(total - length), chosen[i], total)
        for _ in range(6):
            candidate = (_uuid(rng), _uuid(rng))
            trial = chosen[:i] + [candidate] + chosen[i + 1 :]
            t = count_tokens(tokenizer, _kv_context(trial))
            if abs(t - length) < best[0]:
                best = (abs(t - length), candidate, t)
        chosen[i], total = best[1], best[2]
    key, value = chosen[target]
    return _kv_context(chosen), key, value, target


def _kv_make_samples(
    tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
) -> list[Sample]:
    check_length(length, 128)
    _check_num(num_samples)
    rng = random.Random(f"infinitebench:kv_retrieval:{seed}")
    samples = []
    for index, depth in enumerate(sample_depths(rng, num_samples)):
        context, key, value, position = _fit_kv(tokenizer, length, depth, rng)
        samples.append(
            Sample(
                context=context,
                question=f'Key: "{key}"',
                answers=[value],
                answer_prefix=KV_ANSWER_PREFIX,
                max_new_tokens=64,
                meta={
                    "task": "kv_retrieval",
                    "length": length,
                    "index": index,
                    "seed": seed,
                    "depth": round(depth, 4),
                    "key": key,
                    "position": position,
                    "context_tokens": count_tokens(tokenizer, context),
                },
            )
        )
    return samples


def kv_match(prediction: str, answers: list[str]) -> float:
    """InfiniteBench's kv_retrieval rule: an answer is one of the prediction's words after
    replacing newlines, ``: " ' . , ? ! { }`` with spaces."""
    for c in "\n:\"'.,?!{}":
        prediction = prediction.replace(c, " ")
    words = set(prediction.split())
    return float(any(answer in words for answer in answers))


# --- math_find --------------------------------------------------------------------------------------


def _math_values(rng: random.Random, kind: str, count: int, lo: int = 0, hi: int = 99) -> list[int]:
    """InfiniteBench's ranges: "largest" kinds cap the values at a random max in [0.8·hi, hi],
    "smallest" kinds floor them at a random min in [lo, 0.2·hi]; median picks either at random."""
    if kind == "median":
        kind = "smallest" if rng.random() > 0.5 else "largest"
    if "largest" in kind:
        hi = rng.randint(int(hi * 0.8), hi)
    else:
        lo = rng.randint(lo, int(hi * 0.2))
    return [rng.randint(lo, hi) for _ in range(count)]


def math_answer(values: list[int], kind: str) -> str:
    """The answer of a math_find question: k-th largest/smallest distinct value, or the median."""
    if kind == "median":
        median = statistics.median(values)
        return str(int(median)) if float(median).is_integer() else str(median)
    rank = {"largest": 0, "second largest": 1, "third largest": 2}.get(kind)
    distinct = sorted(set(values), reverse=True)
    if rank is None:
        rank = {"smallest": 0, "second smallest": 1, "third smallest": 2}[kind]
        distinct = distinct[::-1]
    return str(distinct[min(rank, len(distinct) - 1)])


def _math_context(kind: str, values: list[int]) -> str:
    verb = "Calculate the median number" if kind == "median" else f"Find the {kind} number"
    return f"{verb} from the list below:\n\n{values}"


def _math_make_samples(
    tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
) -> list[Sample]:
    check_length(length, 32)
    _check_num(num_samples)
    rng = random.Random(f"infinitebench:math_find:{seed}")
    samples = []
    for index in range(num_samples):
        kind = MATH_KINDS[index % len(MATH_KINDS)]
        values = _math_values(rng, kind, 2 * length)
        per_number = count_tokens(tokenizer, str(values[:64])) / 64
        guess = round(length / per_number)

        def count(k: int, kind: str = kind, values: list[int] = values) -> int:
            return count_tokens(tokenizer, _math_context(kind, values[: max(k, 1)]))

        used = values[: max(fit_units(count, length, 2 * length, guess), 1)]
        context = _math_context(kind, used)
        noun = "median" if kind == "median" else kind
        samples.append(
            Sample(
                context=context,
                question=MATH_ANSWER_ONLY,
                answers=[math_answer(used, kind)],
                answer_prefix=f"The {noun} number of the list is:",
                max_new_tokens=8,
                meta={
                    "task": "math_find",
                    "length": length,
                    "index": index,
                    "seed": seed,
                    "kind": kind,
                    "count": len(used),
                    "context_tokens": count_tokens(tokenizer, context),
                },
            )
        )
    return samples


def first_number_match(prediction: str, answers: list[str]) -> float:
    """InfiniteBench's math_find rule: the first number in the prediction equals an answer."""
    found = re.search(r"\d+\.\d+|\d+", prediction)
    if found is None:
        return 0.0
    value = float(found.group(0))
    return float(any(value == float(answer) for answer in answers))


TASKS = {
    "passkey": TaskSpec(
        "passkey", "infinitebench", _passkey_maker("passkey"), contains_number, "contains_number"
    ),
    "number_string": TaskSpec(
        "number_string", "infinitebench", _passkey_maker("number_string"), contains_number, "contains_number"
    ),
    "kv_retrieval": TaskSpec("kv_retrieval", "infinitebench", _kv_make_samples, kv_match, "kv_match"),
    "math_find": TaskSpec(
        "math_find", "infinitebench", _math_make_samples, first_number_match, "first_number"
    ),
}
