"""RULER's 13 tasks: spec (templates, prefixes, budgets, metrics), determinism, length fit, and that
the reference answer is always recoverable from the context.

Unit tests run on small made-up data (monkeypatched loaders) with the character-level test
tokenizer; the integration tests use the fetched RULER data and smollm2-135m's tokenizer at 1K/4K.
"""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest

from kvbudget import data
from kvbudget.artifacts import kvbudget_home
from kvbudget.errors import InputError
from kvbudget.eval.tasks import ruler_qa
from kvbudget.eval.tasks.ruler import TASKS
from kvbudget.eval.tasks.ruler_common import count_tokens, fit_count
from kvbudget.eval.tasks.ruler_niah import CONFIGS, NEEDLE
from kvbudget.eval.tasks.ruler_vt import INSTRUCTION as VT_INSTRUCTION
from kvbudget.eval.tasks.ruler_words import FWE_INSTRUCTION, zipf_counts

NAMES = [
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
    "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
]  # fmt: skip


# --- made-up data ---------------------------------------------------------------------------------


def _fake_word(i: int, salt: int) -> str:
    letters = "bcdfghjklmnpqrstvwxz"
    vowels = "aeiou"
    n = i * 7919 + salt * 104729
    return "".join(letters[(n // 20**k) % 20] + vowels[(n // 5**k) % 5] for k in range(3)) + str(i % 10)


def _sentences(count: int, salt: int) -> list[str]:
    return [
        " ".join(_fake_word(i * 13 + j, salt) for j in range(5 + i % 7)).capitalize() + "."
        for i in range(count)
    ]


@pytest.fixture
def fake_data(monkeypatch):
    """Small, deterministic stand-ins for the RULER essays, SQuAD, HotpotQA and wonderwords lists."""
    lists = {
        "adjectives": [_fake_word(i, 1) for i in range(80)] + ["ad hoc"],
        "nouns": [_fake_word(i, 2) for i in range(300)],
        "verbs": [_fake_word(i, 3) for i in range(120)],
    }
    essays = " ".join(_sentences(1500, 4))
    squad = []
    for i in range(60):
        context = " ".join(_sentences(6, 100 + i))
        squad.append({"context": context, "question": f"Question {i}?", "answers": [context.split()[3]]})
    hotpot = []
    for i in range(40):
        paragraphs = [(f"Title {i}-{j}", " ".join(_sentences(3, 500 + 3 * i + j))) for j in range(3)]
        answer = "yes" if i % 10 == 0 else paragraphs[1][1].split()[2]
        hotpot.append({"question": f"Hotpot {i}?", "answers": [answer], "paragraphs": paragraphs})
    monkeypatch.setattr(data, "words", lambda kind: list(lists[kind]))
    monkeypatch.setattr(data, "ruler_essays", lambda: essays)
    monkeypatch.setattr(data, "squad", lambda: list(squad))
    monkeypatch.setattr(data, "hotpotqa", lambda: list(hotpot))
    ruler_qa.qa_pool.cache_clear()
    yield
    ruler_qa.qa_pool.cache_clear()


# --- checks shared by unit and integration tests ---------------------------------------------------


def check_recoverable(name: str, sample) -> None:
    """The reference answer can be read off the context."""
    context = sample.context
    if name.startswith("niah"):
        cfg = CONFIGS[name]
        for answer in sample.answers:
            assert answer in context
        for key in sample.meta["keys"]:  # each queried key has exactly its own needles
            assert context.count(f" for {key} is: ") == cfg.num_values
        for needle in sample.meta["needles"]:
            assert needle in context
        values = [re.search(r"is: (\S+)\.$", n).group(1) for n in sample.meta["needles"]]
        asked = [v for v in values if v in sample.answers]
        assert sorted(asked) == sorted(sample.answers)
    elif name == "vt":
        body = context.split(VT_INSTRUCTION)[-1]
        assigned = dict(re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", body))

        def resolve(var: str) -> str:
            value = assigned[var]
            return resolve(value[4:]) if value.startswith("VAR ") else value

        holders = {var for var in assigned if resolve(var) == str(sample.meta["value"])}
        assert holders == set(sample.answers) and len(holders) == 5
        assert str(sample.meta["value"]) in sample.question
    elif name == "cwe":
        counts = Counter(re.findall(r"\d+\. (\S+)", context))
        ranked = counts.most_common()
        assert {w for w, _ in ranked[:10]} == set(sample.answers)
        assert ranked[9][1] > ranked[10][1]  # no tie at the cut
    elif name == "fwe":
        counts = Counter(w for w in context[len(FWE_INSTRUCTION) :].split() if w != "...")
        ranked = counts.most_common()
        assert [w for w, _ in ranked[:3]] == sample.answers
        assert ranked[0][1] > ranked[1][1] > ranked[2][1] > ranked[3][1]
    else:
        pool = ruler_qa.qa_pool(ruler_qa.DATASETS[name])
        text, answers, own = pool.questions[sample.meta["question_id"]]
        assert sample.question.endswith(f"Question: {text}") and list(answers) == sample.answers
        for doc in own:  # the question's paragraphs are all there, whole
            assert f":\n{pool.docs[doc]}\n\n" in context + "\n\n"
        for answer in sample.answers:
            if answer.lower() not in ("yes", "no"):
                assert answer.lower() in context.lower()


# --- spec ------------------------------------------------------------------------------------------


def test_registry_has_the_13_tasks_with_ruler_metrics():
    assert list(TASKS) == NAMES
    for name, spec in TASKS.items():
        assert spec.name == name and spec.family == "ruler"
        assert spec.metric_name == ("string_match_part" if name.startswith("qa") else "string_match_all")
    assert TASKS["qa_1"].data == ("long-context-eval",) and "wonderwords" in TASKS["cwe"].data
    assert "long-context-eval" in TASKS["niah_single_2"].data


def test_templates_prefixes_and_budgets(fake_data, tokenizer):
    one = {name: TASKS[name].make_samples(tokenizer, 3000, 1, 0)[0] for name in NAMES}
    single = one["niah_single_1"]
    key = single.meta["keys"][0]
    assert single.context.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\nThe grass is green. The sky is blue. "
        "The sun is yellow. Here we go. There and back again.\n"
    )
    assert single.question == f"What is the special magic number for {key} mentioned in the provided text?"
    assert single.answer_prefix == f"The special magic number for {key} mentioned in the provided text is"
    assert NEEDLE.format(kind="numbers", key=key, value=single.answers[0]) in single.context
    assert one["niah_single_3"].context.startswith("A special magic uuid is hidden")
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                        one["niah_single_3"].answers[0])  # fmt: skip
    multi = one["niah_multiquery"]
    keys = multi.meta["keys"]
    assert multi.context.startswith("Some special magic numbers are hidden within the following text.")
    assert multi.question == (
        f"What are all the special magic numbers for {keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]} "
        "mentioned in the provided text?"
    )
    assert multi.answer_prefix.endswith("mentioned in the provided text are") and len(multi.answers) == 4
    assert len(one["niah_multivalue"].answers) == 4 and len(one["niah_multivalue"].meta["keys"]) == 1
    assert len(one["niah_multikey_1"].meta["needles"]) == 4 and len(one["niah_multikey_1"].answers) == 1
    assert all(re.fullmatch(r"\d{7}", a) for a in one["niah_multikey_2"].answers)
    vt = one["vt"]
    value = vt.meta["value"]
    assert (
        vt.question == f"Question: Find all variables that are assigned the value {value} in the text above."
    )
    assert vt.answer_prefix == (
        "Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
        f"assgined the value {vt.meta['value']}, they are:"
    )
    assert vt.context.count(VT_INSTRUCTION) == 2  # the solved example, then the task
    assert all(re.fullmatch(r"[A-Z]{5}", v) for v in vt.answers) and 10000 <= vt.meta["value"] <= 99999
    cwe = one["cwe"]
    assert cwe.question == "Question: What are the 10 most common words in the above list?"
    assert cwe.answer_prefix == "Answer: The top 10 words that appear most often in the list are:"
    assert (cwe.meta["common_repeats"], cwe.meta["uncommon_repeats"]) == (6, 1)  # RULER below 4096
    assert "ad hoc" not in cwe.context
    fwe = one["fwe"]
    assert fwe.context.startswith(FWE_INSTRUCTION + " ")
    assert fwe.answer_prefix.startswith("Answer: According to the coded text above, the three most")
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in fwe.answers)
    for name in ("qa_1", "qa_2"):
        qa = one[name]
        assert qa.context.startswith(
            "Answer the question based on the given documents. Only give me the answer and do not output "
            "any other words.\n\nThe following are given documents.\n\nDocument 1:\n"
        )
        assert qa.question.startswith("Answer the question based on the given documents.")
        assert qa.answer_prefix == "Answer:"
        numbers = [int(n) for n in re.findall(r"^Document (\d+):$", qa.context, flags=re.M)]
        assert numbers == list(range(1, len(numbers) + 1)) == list(range(1, qa.meta["num_documents"] + 1))
    budgets = {"vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32, "qa_2": 32}
    assert {n: s.max_new_tokens for n, s in one.items()} == {n: budgets.get(n, 128) for n in NAMES}


def test_cwe_uses_ruler_long_counts_from_4096_tokens(fake_data, tokenizer):
    sample = TASKS["cwe"].make_samples(tokenizer, 8192, 1, 0)[0]  # (characters: the example alone is 2K)
    assert (sample.meta["common_repeats"], sample.meta["uncommon_repeats"]) == (30, 3)
    main = Counter(re.findall(r"\d+\. (\S+)", sample.context.split("\n")[-1]))
    assert {main[w] for w in sample.answers} == {30} and set(main.values()) == {30, 3}


def test_fwe_counts_are_zipf_alpha_2():
    counts = zipf_counts(1000, 20)
    assert counts[:4] == [607, 151, 67, 37]  # int(1000 k^-2 / zeta(2))


@pytest.mark.parametrize("name", NAMES)
def test_generator_is_seeded_fits_the_length_and_answer_is_recoverable(fake_data, tokenizer, name):
    make = TASKS[name].make_samples
    first = make(tokenizer, 3000, 3, 0)
    assert first == make(tokenizer, 3000, 3, 0)
    other = make(tokenizer, 3000, 3, 1)
    assert all(a.context != b.context for a, b in zip(first, other, strict=True))
    assert make(tokenizer, 3000, 2, 0) == first[:2]  # sample i does not depend on how many are asked
    for index, sample in enumerate(first):
        assert sample.meta["task"] == name and sample.meta["index"] == index and sample.meta["length"] == 3000
        tokens = count_tokens(tokenizer, sample.context)
        assert tokens == sample.meta["tokens"] and abs(tokens - 3000) <= 0.02 * 3000
        check_recoverable(name, sample)
    assert len({s.context for s in first}) == 3


@pytest.mark.parametrize("name", ["niah_single_2", "niah_multikey_3", "vt", "cwe", "qa_1"])
def test_too_short_length_is_an_input_error(fake_data, tokenizer, name):
    with pytest.raises(InputError):
        TASKS[name].make_samples(tokenizer, 60, 1, 0)


def test_fit_count_finds_the_nearest_count():
    assert fit_count(lambda n: 40 + 7 * n, 1000, 0, 10**6, 1) == (137, 999)
    assert fit_count(lambda n: 40 + 7 * n, 1000, 0, 50, 10) == (50, 390)  # capped by the data


# --- metrics --------------------------------------------------------------------------------------


def test_metrics_on_hand_made_predictions():
    niah = TASKS["niah_multivalue"].metric
    answers = ["1234567", "7654321", "1111111", "2222222"]
    assert niah("They are 1234567, 7654321, 1111111 and 2222222.", answers) == 1.0
    assert niah("1234567 and 7654321", answers) == 0.5
    assert niah("none", answers) == 0.0
    assert TASKS["cwe"].metric("1. APPLE 2. pear", ["apple", "pear", "plum", "fig"]) == 0.5  # any case
    assert TASKS["vt"].metric("ABCDE FGHIJ", ["ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"]) == 0.4
    qa = TASKS["qa_1"].metric
    assert qa("It was in france, in 1066.", ["Normandy", "France"]) == 1.0
    assert qa("Normandy", ["Normandy", "France"]) == 1.0
    assert qa("England", ["Normandy", "France"]) == 0.0


# --- integration: RULER data and the model's tokenizer ---------------------------------------------


@pytest.fixture(scope="module")
def real_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(kvbudget_home() / "models" / "smollm2-135m" / "hf")
    for name in NAMES:  # load the data and warm the caches once
        TASKS[name].make_samples(tok, 1024, 1, 123)
    return tok


@pytest.mark.integration
@pytest.mark.parametrize("name", NAMES)
def test_real_data_lengths_recoverability_and_seeding(real_tokenizer, name):
    make = TASKS[name].make_samples
    for length in (1024, 4096):
        start = time.perf_counter()
        samples = make(real_tokenizer, length, 2, 0)
        per_sample = (time.perf_counter() - start) / 2
        assert per_sample < 1.0, f"{name} at {length}: {per_sample:.2f} s per sample"
        for sample in samples:
            tokens = len(real_tokenizer(sample.context, add_special_tokens=False)["input_ids"])
            assert abs(tokens - length) <= 0.02 * length, (name, length, tokens)
            check_recoverable(name, sample)
    assert make(real_tokenizer, 1024, 2, 0) == make(real_tokenizer, 1024, 2, 0)
    assert make(real_tokenizer, 1024, 1, 0)[0].context != make(real_tokenizer, 1024, 1, 1)[0].context
