"""InfiniteBench synthetic tasks: seeded generators, lengths, recoverable answers and metrics.

Unit tests use the tiny character-level tokenizer (one token per character); the tests marked
``integration`` check the 2% length tolerance with the default model's real tokenizer.
"""

from __future__ import annotations

import ast
import json
import re
import statistics

import pytest

from kvbudget.errors import InputError
from kvbudget.eval.tasks.infinitebench import (
    NOISE,
    TASKS,
    contains_number,
    count_tokens,
    first_number_match,
    fit_units,
    kv_match,
    math_answer,
)

NAMES = ("passkey", "number_string", "kv_retrieval", "math_find")


@pytest.fixture(scope="module")
def real_tokenizer():
    """The default model's tokenizer (smollm2-135m, fetched by `make fetch`)."""
    from transformers import AutoTokenizer

    from kvbudget.models import fetch_model

    return AutoTokenizer.from_pretrained(fetch_model("smollm2-135m", progress=False))


def _make(name, tokenizer, length=3000, num=4, seed=0):
    return TASKS[name].make_samples(tokenizer, length, num, seed)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_samples_other_seed_other_samples(name, tokenizer):
    first, again, other = _make(name, tokenizer), _make(name, tokenizer), _make(name, tokenizer, seed=1)
    assert first == again
    assert [s.answers for s in first] != [s.answers for s in other]
    assert [s.context for s in first] != [s.context for s in other]


@pytest.mark.parametrize("name", NAMES)
def test_sample_fields_and_meta(name, tokenizer):
    samples = _make(name, tokenizer, num=3, seed=5)
    assert len(samples) == 3
    for index, sample in enumerate(samples):
        assert sample.meta["task"] == name
        assert sample.meta["length"] == 3000
        assert sample.meta["index"] == index
        assert sample.question and sample.answer_prefix and len(sample.answers) == 1
        assert sample.max_new_tokens >= 8
        assert TASKS[name].family == "infinitebench"
        # the metric accepts the answer itself, after the answer prefix as a model would write it
        assert TASKS[name].metric(f" {sample.answers[0]}.", sample.answers) == 1.0
        assert TASKS[name].metric("I do not know.", sample.answers) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_context_length_within_two_percent_char_tokenizer(name, tokenizer):
    for length in (2000, 5000):
        for sample in _make(name, tokenizer, length=length, num=3):
            assert abs(count_tokens(tokenizer, sample.context) - length) <= 0.02 * length
            assert sample.meta["context_tokens"] == count_tokens(tokenizer, sample.context)


@pytest.mark.integration
@pytest.mark.parametrize("name", NAMES)
def test_context_length_within_two_percent_real_tokenizer(name, real_tokenizer):
    for length in (1000, 4000):
        for sample in _make(name, real_tokenizer, length=length, num=5):
            tokens = count_tokens(real_tokenizer, sample.context)
            assert abs(tokens - length) <= 0.02 * length, (name, length, tokens)


@pytest.mark.parametrize("name", ["passkey", "number_string"])
def test_needle_holds_the_answer_in_noise_lines_at_the_drawn_depths(name, tokenizer):
    samples = _make(name, tokenizer, length=4000, num=5, seed=3)
    depths = []
    for sample in samples:
        key = sample.answers[0]
        assert re.fullmatch(r"\d{5}" if name == "passkey" else r"\d{10}", key)
        instruction, body = sample.context.split("\n\n", 1)
        assert instruction.startswith("There is an important info hidden inside a lot of irrelevant text.")
        lines = body.split("\n")
        needle_at = [i for i, line in enumerate(lines) if key in line]
        assert len(needle_at) == 1 and lines[needle_at[0]] == sample.meta["needle"]
        assert lines[needle_at[0]].count(key) == 2
        noise = [line for i, line in enumerate(lines) if i != needle_at[0]]
        assert all(line == " ".join(NOISE[: line.count(".")]) for line in noise)
        depths.append(needle_at[0] / (len(lines) - 1))
    # stratified: sample i sits in the i-th fifth of the haystack
    for i, depth in enumerate(depths):
        assert i / 5 - 0.02 <= depth <= (i + 1) / 5 + 0.02
    if name == "number_string":  # five drawn digits, then five repeats inserted: a repeat is adjacent
        assert all(
            any(a == b for a, b in zip(k, k[1:], strict=False)) for k in (s.answers[0] for s in samples)
        )


def test_kv_retrieval_answer_is_the_value_of_the_asked_key(tokenizer):
    for sample in _make("kv_retrieval", tokenizer, length=4000, num=3, seed=2):
        head, body = sample.context.split("JSON data:\n", 1)
        assert head.startswith(
            "Extract the value corresponding to the specified key in the JSON object below."
        )
        mapping = json.loads(body)
        key = re.fullmatch(r'Key: "([0-9a-f-]{36})"', sample.question).group(1)
        assert mapping[key] == sample.answers[0]
        assert list(mapping).index(key) == sample.meta["position"]
        assert sample.answer_prefix == "The value associated with the specified key is:"
        assert len(set(mapping.values())) == len(mapping)


def test_math_find_answer_recomputed_from_the_list(tokenizer):
    samples = _make("math_find", tokenizer, length=3000, num=7, seed=4)
    kinds = [s.meta["kind"] for s in samples]
    assert kinds == [
        "largest",
        "second largest",
        "third largest",
        "smallest",
        "second smallest",
        "third smallest",
        "median",
    ]
    for sample in samples:
        prompt, listing = sample.context.split("\n\n", 1)
        values = ast.literal_eval(listing)
        assert len(values) == sample.meta["count"] and all(0 <= v <= 99 for v in values)
        distinct = sorted(set(values))
        expected = {
            "largest": distinct[-1],
            "second largest": distinct[-2],
            "third largest": distinct[-3],
            "smallest": distinct[0],
            "second smallest": distinct[1],
            "third smallest": distinct[2],
            "median": statistics.median(values),
        }[sample.meta["kind"]]
        assert float(sample.answers[0]) == expected
        assert prompt.endswith("from the list below:")
        assert sample.answer_prefix.endswith("number of the list is:")
        assert sample.question == "You should answer with only one number, no other words."


def test_math_answer_kinds():
    values = [5, 9, 9, 7, 1]
    assert math_answer(values, "largest") == "9"
    assert math_answer(values, "second largest") == "7"  # distinct values: the repeated 9 counts once
    assert math_answer(values, "third largest") == "5"
    assert math_answer(values, "smallest") == "1"
    assert math_answer(values, "second smallest") == "5"
    assert math_answer(values, "third smallest") == "7"
    assert math_answer(values, "median") == "7"
    assert math_answer([1, 2, 3, 4], "median") == "2.5"
    assert math_answer([1, 3, 3, 4], "median") == "3"


def test_metrics_on_hand_made_predictions():
    assert contains_number(" 12345. Remember it.", ["12345"]) == 1.0
    assert contains_number("The pass key is 123456.", ["12345"]) == 0.0  # inside a longer number
    assert contains_number("It is 1234 5.", ["12345"]) == 0.0
    assert contains_number("0012345", ["12345"]) == 0.0
    value = "2bb35dc3-34a4-4ac6-a444-414f21c3ddf6"
    assert kv_match(f' "{value}".', [value]) == 1.0
    assert kv_match(f"{value}\nand more", [value]) == 1.0
    assert kv_match(value[:-1], [value]) == 0.0
    assert kv_match(f"x{value}", [value]) == 0.0
    assert first_number_match(" 99", ["99"]) == 1.0
    assert first_number_match(" 98, or maybe 99", ["99"]) == 0.0  # InfiniteBench: the first number counts
    assert first_number_match("45.5", ["45.5"]) == 1.0
    assert first_number_match("45.0", ["45"]) == 1.0
    assert first_number_match("none", ["45"]) == 0.0


def test_fit_units_finds_the_nearest_count():
    calls = []

    def count(n):
        calls.append(n)
        return 3 * n + 10

    assert fit_units(count, 100, 10_000, guess=1) == 30  # 3·30 + 10 = 100 exactly
    assert fit_units(count, 101, 10_000, guess=5000) == 30  # 100 is nearer than 103
    assert fit_units(count, 102, 10_000, guess=30) == 31  # 103 is nearer than 100
    assert fit_units(count, 10**9, 50, guess=10) == 50  # capped
    assert fit_units(count, 0, 50, guess=10) == 0
    calls.clear()
    fit_units(count, 30_010, 1_000_000, guess=9_000)
    assert len(calls) < 40  # logarithmic, not a scan


def test_bad_arguments_are_rejected(tokenizer):
    with pytest.raises(InputError):
        TASKS["passkey"].make_samples(tokenizer, 10, 1, 0)
    with pytest.raises(InputError):
        TASKS["kv_retrieval"].make_samples(tokenizer, 1000, 0, 0)
