"""LongBench loader, prompts and official metrics; the shared string metrics (metrics.py).

Every expected score is computed by hand in the comments. Fixtures are JSONL files the tests
write; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from kvbudget.errors import InputError
from kvbudget.eval import longbench as lb
from kvbudget.eval.metrics import (
    f1_tokens,
    normalize_answer,
    qa_f1,
    string_match_all,
    string_match_part,
)

# --- shared metrics ---------------------------------------------------------------------------------


def test_normalize_answer():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_qa_f1_hand_computed():
    # "the cat sat" -> [cat, sat]; "a cat sat down" -> [cat, sat, down]: 2 shared tokens,
    # precision 2/2, recall 2/3, F1 = 2·1·(2/3) / (1 + 2/3) = (4/3) / (5/3) = 0.8
    assert qa_f1("the cat sat", ["a cat sat down"]) == pytest.approx(0.8)
    # without normalisation both sides would be 3 and 4 tokens: F1 = 2·(2/3)(2/4)/(2/3 + 2/4) = 4/7
    assert f1_tokens("the cat sat".split(), "a cat sat down".split()) == pytest.approx(4 / 7)
    # best over answers: "dog" shares nothing; "cat" vs [cat, sat]: P 1/2, R 1, F1 = 2/3
    assert qa_f1("the cat sat", ["dog", "cat"]) == pytest.approx(2 / 3)
    assert qa_f1("", ["cat"]) == 0.0 and qa_f1("cat", []) == 0.0


def test_string_match_all_and_part():
    # RULER: case-insensitive substrings; all = fraction found, part = any found
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("APPLE", ["apple"]) == 1.0
    assert string_match_all("anything", []) == 0.0
    assert string_match_part("The numbers are 123.", ["999", "123"]) == 1.0
    assert string_match_part("nothing here", ["999", "123"]) == 0.0


# --- LongBench metrics --------------------------------------------------------------------------------


def test_qa_f1_score_and_scorer_rule():
    # LongBench's qa_f1 is the shared one: 0.8 as above
    assert lb.qa_f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    # scorer: best over answers; "big cat" vs "the cat" -> [cat] vs [big, cat]: P 1, R 1/2, F1 2/3
    assert lb.longbench_score("narrativeqa", "the cat", ["dog", "a big cat"]) == pytest.approx(2 / 3)
    # hotpotqa scores the whole prediction: [paris, london] vs [paris]: P 1/2, R 1, F1 = 2/3
    assert lb.longbench_score("hotpotqa", "Paris\nLondon", ["Paris"]) == pytest.approx(2 / 3)
    # triviaqa (like trec, samsum, lsht) scores only the first line: "Paris" vs "Paris" = 1
    assert lb.longbench_score("triviaqa", "\nParis\nLondon", ["Paris"]) == 1.0


def test_qa_f1_zh_character_level():
    # 北京是首都 -> 北 京 是 首 都 (5); 首都北京 -> 首 都 北 京 (4); 4 shared:
    # P 4/5, R 4/4, F1 = 2·0.8·1 / 1.8 = 8/9
    assert lb.qa_f1_zh_score("北京是首都。", "首都北京") == pytest.approx(8 / 9)
    # Latin letters and digits stay whole tokens, punctuation is dropped
    assert lb.zh_tokens("GPT-4发布于2023年！") == ["gpt", "4", "发", "布", "于", "2023", "年"]
    # "2023年" vs "2023" -> [2023, 年] vs [2023]: P 1/2, R 1, F1 = 2/3
    assert lb.qa_f1_zh_score("2023年", "2023") == pytest.approx(2 / 3)


def test_rouge_l_hand_computed():
    # [the cat sat on the mat] vs [the cat is on the mat]: LCS = the cat on the mat = 5,
    # P = 5/6, R = 5/6, F = 5/6
    assert lb.rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # [a b c d] vs [a c]: LCS 2, P 2/4, R 2/2, F = 2·0.5·1/1.5 = 2/3
    assert lb.rouge_score("a b c d", "a c") == pytest.approx(2 / 3)
    assert lb.rouge_score("", "the cat") == 0.0
    # characters: 今天天气很好 vs 今天天气不好: LCS 今天天气好 = 5 of 6 each: F = 5/6
    assert lb.rouge_zh_score("今天天气很好", "今天天气不好") == pytest.approx(5 / 6)
    assert lb.longbench_score("gov_report", "the cat sat on the mat", ["xyz", "the cat is on the mat"]) == (
        pytest.approx(5 / 6)
    )


def test_classification_score_as_longbench():
    classes = ["Person", "Location", "Entity", "Description"]
    assert lb.classification_score("Person", "Person", all_classes=classes) == 1.0
    # two classes named, the true one among them: 1/2
    assert lb.classification_score("Person or Location", "Person", all_classes=classes) == 0.5
    assert lb.classification_score("Location", "Person", all_classes=classes) == 0.0
    # LongBench removes from the list it iterates: with matches [a, ab, abc, x] and truth "abc",
    # "a" is removed, which skips "ab" (it would be removed too): [ab, abc, x] -> 1/3, not 1/2
    assert lb.classification_score("a ab abc x", "abc", all_classes=["a", "ab", "abc", "x"]) == pytest.approx(
        1 / 3
    )
    # trec scores the first line only
    assert lb.longbench_score("trec", "Location\nPerson", ["Location"], classes) == 1.0


def test_retrieval_count_and_code_scores():
    # numbers in the prediction: [3, 5], one equals 3: 1/2
    assert lb.retrieval_score("Paragraph 3, not Paragraph 5", "Paragraph 3") == 0.5
    assert lb.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert lb.retrieval_score("no number", "Paragraph 3") == 0.0
    assert lb.retrieval_zh_score("答案是段落12", "段落12") == 1.0
    # numbers [7, 10], one equals 7: 1/2
    assert lb.count_score("There are 7 unique paragraphs out of 10", 7) == 0.5
    # code: the first line with no ` # // — "x = foo(2)" vs "x = foo(1)": Indel 1 - 2/20 = 0.9
    assert lb.code_sim_score("```python\n# comment\nx = foo(2)\n", "x = foo(1)") == pytest.approx(0.9)
    assert lb.code_sim_score("\n    x = foo(1)", "    x = foo(1)") == 1.0  # not stripped, as LongBench
    assert (
        lb.longbench_scorer("passage_count", ["7", "3 or 7", "8"], [["7"], ["7"], ["7"]]) == 50.0
    )  # (1+.5+0)/3


def test_every_dataset_has_prompt_maxlen_and_metric():
    assert len(lb.DATASETS) == 21
    assert list(lb.DATASET2PROMPT) == list(lb.DATASET2MAXLEN) == list(lb.DATASETS)
    assert set(lb.DATASET2METRIC) == set(lb.DATASETS)
    assert set(lb.DATASETS_E) <= set(lb.DATASETS)
    # LongBench/config/dataset2prompt.json verbatim: sha256 of its canonical JSON dump
    canonical = json.dumps(lb.DATASET2PROMPT, ensure_ascii=False, sort_keys=True).encode()
    assert (
        hashlib.sha256(canonical).hexdigest()
        == "e7d865d712fe45e2455f5e864ac474001d7758d68d349e76ffbcdd382483358f"
    )
    assert lb.DATASET2MAXLEN["gov_report"] == 512 and lb.DATASET2MAXLEN["hotpotqa"] == 32
    assert lb.DATASET2MAXLEN["lcc"] == 64 and lb.DATASET2MAXLEN["samsum"] == 128


# --- loader and templates -------------------------------------------------------------------------------

RECORDS = [
    {
        "input": "Which city is the capital of France?",
        "context": "Passage 1:\nParis is the capital of France.\nPassage 2:\nBerlin is in Germany.",
        "answers": ["Paris"],
        "length": 14,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": "a1",
    },
    {
        "input": "Where is Berlin?",
        "context": "Berlin is in Germany. " * 40,
        "answers": "Germany",  # a bare string is accepted as one answer
        "length": 160,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": "a2",
    },
    {
        "input": "Q3?",
        "context": "c3",
        "answers": ["a3"],
        "length": 1,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": "a3",
    },
]


@pytest.fixture
def data_dir(tmp_path):
    with open(tmp_path / "hotpotqa.jsonl", "w", encoding="utf-8") as f:
        for record in RECORDS:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.write("\n")  # a trailing blank line is skipped
    trec = {
        "input": "What is the capital of Peru?",
        "context": "Question: Who wrote Hamlet?\nType: Person\n",
        "answers": ["Location"],
        "length": 10,
        "dataset": "trec",
        "language": "en",
        "all_classes": ["Person", "Location", "Entity"],
        "_id": "t1",
    }
    (tmp_path / "trec.jsonl").write_text(json.dumps(trec) + "\n", encoding="utf-8")
    return tmp_path


def test_loader_reads_the_fixture(data_dir):
    records = lb.load_longbench("hotpotqa", data_dir)
    assert [r["_id"] for r in records] == ["a1", "a2", "a3"]
    assert records[1]["answers"] == ["Germany"]
    assert records[0]["context"] == RECORDS[0]["context"]


def test_loader_errors_are_clear(data_dir, tmp_path, monkeypatch):
    with pytest.raises(InputError, match="qasper.jsonl"):
        lb.load_longbench("qasper", data_dir)
    with pytest.raises(InputError, match="unknown LongBench dataset"):
        lb.load_longbench("nq", data_dir)
    with pytest.raises(InputError, match="not in LongBench-E"):
        lb.load_longbench("musique", data_dir, e=True)
    (tmp_path / "musique.jsonl").write_text('{"input": "q", "context": "c", "answers": ["a"]}\n{oops\n')
    with pytest.raises(InputError, match="musique.jsonl:2"):
        lb.load_longbench("musique", tmp_path)
    (tmp_path / "qmsum.jsonl").write_text('{"input": "q", "answers": ["a"]}\n')
    with pytest.raises(InputError, match="lacks context"):
        lb.load_longbench("qmsum", tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(InputError, match="pip install datasets"):
        lb.load_longbench("hotpotqa", hub=True)


def test_default_data_dir_follows_the_environment(monkeypatch, tmp_path, data_dir):
    monkeypatch.delenv("KVBUDGET_LONGBENCH_DIR", raising=False)
    monkeypatch.setenv("KVBUDGET_HOME", str(tmp_path / "home"))
    assert lb.default_data_dir() == tmp_path / "home" / "data" / "longbench"
    monkeypatch.setenv("KVBUDGET_LONGBENCH_DIR", str(data_dir))
    assert len(lb.load_longbench("hotpotqa")) == 3


def test_templates_format_correctly():
    record = RECORDS[0]
    expected = (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n" + record["context"] + "\n\nAnswer the question "
        "based on the given passages. Only give me the answer and do not output any other words.\n\n"
        "Question: Which city is the capital of France?\nAnswer:"
    )
    assert lb.format_prompt("hotpotqa", record) == expected
    code = {"context": "def f():\n", "input": "    return 1\n"}
    assert (
        lb.format_prompt("lcc", code)
        == "Please complete the code given below. \ndef f():\nNext line of code:\n"
    )
    assert lb.format_prompt("repobench-p", code) == (
        "Please complete the code given below. \ndef f():\n    return 1\nNext line of code:\n"
    )
    assert lb.format_prompt("gov_report", {"context": "R", "input": ""}).endswith(
        "Report:\nR\n\nNow, write a one-page summary of the report.\n\nSummary:"
    )
    # braces inside the data are left alone
    assert "{x}" in lb.format_prompt("narrativeqa", {"context": "{x}", "input": "{y}"})
    for dataset in lb.DATASETS:
        prompt = lb.format_prompt(dataset, {"context": "CTX", "input": "INP"})
        assert "CTX" in prompt and "{" not in prompt
        head, tail = lb.split_prompt(dataset, {"context": "CTX", "input": "INP"})
        assert head.endswith("CTX") and prompt.startswith(head)
        assert prompt[len(head) :].lstrip("\n") == tail


def test_samples_from_the_fixture(data_dir, tokenizer):
    samples = lb.longbench_samples("hotpotqa", data_dir)
    assert len(samples) == 3
    first = samples[0]
    assert first.context.endswith(RECORDS[0]["context"])
    assert first.context.startswith("Answer the question based on the given passages.")
    assert first.question.startswith("Answer the question based on the given passages.")
    assert first.question.endswith("Question: Which city is the capital of France?\nAnswer:")
    assert first.answers == ["Paris"] and first.max_new_tokens == 32 and first.answer_prefix == ""
    assert first.meta["_id"] == "a1" and first.meta["chat_template"] is True
    assert [s.meta["index"] for s in samples] == [0, 1, 2] and samples[2].meta["record"] == 2
    chosen = lb.longbench_samples("hotpotqa", data_dir, num_samples=2, seed=0)
    assert chosen == lb.longbench_samples("hotpotqa", data_dir, num_samples=2, seed=0)
    assert [s.meta["_id"] for s in lb.longbench_samples("hotpotqa", data_dir, num_samples=2)] == ["a1", "a2"]
    # LongBench's middle truncation: first and last max/2 tokens of the context (one char = one token here)
    cut = lb.longbench_samples("hotpotqa", data_dir, tokenizer=tokenizer, max_context_tokens=40)[1]
    context = RECORDS[1]["context"]
    assert cut.context.endswith(context[:20] + context[-20:])


def test_longbench_task_spec(data_dir, tokenizer):
    task = lb.longbench_task("trec", data_dir)
    assert task.family == "longbench" and task.metric_name == "classification_score"
    [sample] = task.make_samples(tokenizer, 1000, 1, 0)
    assert sample.meta["chat_template"] is False and sample.max_new_tokens == 64
    assert task.metric("Location\nPerson", sample.answers) == 1.0  # classes read from the data
    assert task.metric("Person", sample.answers) == 0.0
