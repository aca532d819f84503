"""Generation tasks: code completion on the standard library (lcc, repobench) and GSM8K.

Code samples are checked against the files themselves: the context is the file's beginning (or
the package's files under ``# path:`` headers), the answer is the next line, and every recorded
sha256 matches. Unit tests use the tiny character-level tokenizer; ``integration`` tests use the
default model's tokenizer for the 2% length tolerance. GSM8K runs on a monkeypatched loader.
"""

from __future__ import annotations

import hashlib
import re

import pytest

import kvbudget.data
from kvbudget.data import stdlib_root
from kvbudget.errors import InputError
from kvbudget.eval.metrics import edit_similarity, first_code_line, last_number, normalize_number
from kvbudget.eval.tasks import code as code_tasks
from kvbudget.eval.tasks import gsm8k as gsm8k_tasks
from kvbudget.eval.tasks.code import TASKS, stdlib_files
from kvbudget.eval.tasks.infinitebench import count_tokens

ROOT = stdlib_root()


@pytest.fixture(scope="module")
def real_tokenizer():
    """The default model's tokenizer (smollm2-135m, fetched by `make fetch`)."""
    from transformers import AutoTokenizer

    from kvbudget.models import fetch_model

    return AutoTokenizer.from_pretrained(fetch_model("smollm2-135m", progress=False))


def _file(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


def _sha(rel: str) -> str:
    return hashlib.sha256((ROOT / rel).read_bytes()).hexdigest()


def test_stdlib_listing_excludes_tests_data_and_site_packages():
    files = stdlib_files()
    assert "json/decoder.py" in files and "asyncio/events.py" in files and "typing.py" in files
    assert files == tuple(sorted(files))
    banned = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}
    assert not any(banned.intersection(rel.split("/")[:-1]) for rel in files)
    tests = stdlib_files(tests=True)  # lcc's second tier, for lengths the library cannot fill
    assert "test/test_json/test_decode.py" in tests and not set(tests) & set(files)
    assert all({"test", "tests", "idle_test"}.intersection(rel.split("/")[:-1]) for rel in tests)


@pytest.mark.parametrize("name", ["lcc", "repobench"])
def test_same_seed_same_samples_other_seed_other_samples(name, tokenizer):
    first = TASKS[name].make_samples(tokenizer, 2000, 3, 0)
    assert first == TASKS[name].make_samples(tokenizer, 2000, 3, 0)
    other = TASKS[name].make_samples(tokenizer, 2000, 3, 1)
    assert [s.meta["file"] for s in first] != [s.meta["file"] for s in other]
    assert len({s.meta["file"] for s in first}) == 3  # distinct files within a run
    for index, sample in enumerate(first):
        assert sample.meta["task"] == name and sample.meta["length"] == 2000 and sample.meta["index"] == index
        assert sample.answer_prefix == "" and sample.question == "Complete the next line of code."
        assert TASKS[name].family == "code"


def test_lcc_context_is_the_file_start_and_the_answer_its_next_line(tokenizer):
    for sample in TASKS["lcc"].make_samples(tokenizer, 3000, 4, 7):
        rel = sample.meta["file"]
        text = _file(rel)
        assert sample.meta["sha256"] == _sha(rel)
        assert text.startswith(sample.context)
        assert abs(count_tokens(tokenizer, sample.context) - 3000) <= 0.02 * 3000
        rest = text[len(sample.context) :].split("\n")
        assert rest[0].strip() == ""  # the context ends at a line end
        next_line = next(line for line in rest[1:] if line.strip())
        assert next_line.strip() == sample.answers[0]
        assert text.split("\n")[sample.meta["answer_line"] - 1].strip() == sample.answers[0]
        assert not sample.answers[0].startswith("#")


def test_repobench_context_holds_sibling_files_then_the_target_start(tokenizer):
    for sample in TASKS["repobench"].make_samples(tokenizer, 3000, 4, 11):
        rel, gold = sample.meta["file"], sample.meta["gold_file"]
        assert abs(count_tokens(tokenizer, sample.context) - 3000) <= 0.02 * 3000
        headers = re.findall(r"^# path: (\S+)$", sample.context, flags=re.MULTILINE)
        assert headers[-1] == rel and gold in headers and len(headers) == len(set(headers))
        assert set(headers) <= set(sample.meta["files"])
        directory = rel.rsplit("/", 1)[0]
        assert all(h.rsplit("/", 1)[0] == directory for h in headers)  # same package directory
        for path, sha in sample.meta["files"].items():
            assert sha == _sha(path)
        pinned = "".join(f"{path}:{_sha(path)}\n" for path in sorted(sample.meta["files"]))
        assert sample.meta["files_sha256"] == hashlib.sha256(pinned.encode()).hexdigest()
        # the in-file part: the target's beginning, up to the answer line
        target_part = sample.context.rsplit(f"# path: {rel}\n", 1)[1]
        lines = _file(rel).split("\n")
        answer_line = sample.meta["answer_line"]
        assert "\n".join(lines[: answer_line - 1]).rstrip() == target_part
        assert lines[answer_line - 1].strip() == sample.answers[0]
        # the answer uses a name the target imports from a sibling module
        assert sample.meta["identifier"].split(".")[0] in sample.answers[0]
        # every other piece is a contiguous run of lines of its file
        for piece in sample.context.split("\n\n# path: ")[:-1]:
            path, body = piece.removeprefix("# path: ").split("\n", 1)
            assert body.rstrip() in _file(path)


def test_repobench_finds_usages_of_all_sibling_import_forms():
    source = code_tasks.load_source(str(ROOT), "email/headerregistry.py")
    siblings = code_tasks._siblings_by_dir(str(ROOT))["email"]
    usages = code_tasks.sibling_usages(source, siblings)
    modules = {u.module for u in usages}
    # `from email import utils` (module alias), `from email import _header_value_parser as parser`
    assert "email/utils.py" in modules and "email/_header_value_parser.py" in modules
    for usage in usages:
        line = source.lines[usage.line]
        assert usage.name.split(".")[0] in line and not line.lstrip().startswith(("import", "from"))


@pytest.mark.integration
@pytest.mark.parametrize("name", ["lcc", "repobench"])
def test_context_length_within_two_percent_real_tokenizer(name, real_tokenizer):
    for length in (1000, 4000):
        for sample in TASKS[name].make_samples(real_tokenizer, length, 5, 0):
            tokens = count_tokens(real_tokenizer, sample.context)
            assert abs(tokens - length) <= 0.02 * length, (name, length, tokens, sample.meta["file"])
            assert sample.meta["context_tokens"] == tokens


def test_too_many_samples_for_the_length_is_a_clear_error(tokenizer):
    with pytest.raises(InputError, match="only .* standard-library files"):
        TASKS["lcc"].make_samples(tokenizer, 2_000_000, 1, 0)


def test_edit_similarity_on_hand_made_predictions():
    answer = "x = foo(1)"
    assert edit_similarity("x = foo(1)", [answer]) == 1.0
    assert edit_similarity("\n\n    x = foo(1)   \ny = 2", [answer]) == 1.0  # first non-empty line, stripped
    assert edit_similarity("```python\nx = foo(1)\n```", [answer]) == 1.0  # Markdown fences skipped
    # one substitution = one deletion + one insertion: Indel similarity 1 - 2/20 = 0.9
    assert edit_similarity("x = foo(2)", [answer]) == pytest.approx(0.9)
    assert edit_similarity("", [answer]) == 0.0
    assert edit_similarity("x = foo(2)", ["y", answer]) == pytest.approx(0.9)  # best answer
    assert first_code_line("\n```\n\n  a\nb") == "a"


# --- gsm8k ------------------------------------------------------------------------------------------

ITEMS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "7"},
    {"question": "A book costs $12. How much do 100 books cost?", "answer": "1200"},
    {"question": "Half of 9?", "answer": "4.5"},
    {"question": "Ann reads 10 pages a day. How many in a week?", "answer": "70"},
    {"question": "A full solution as the answer.", "answer": "6 * 2 = <<6*2=12>>12\n#### 1,012"},
]


@pytest.fixture
def gsm8k_data(monkeypatch):
    monkeypatch.setattr(kvbudget.data, "gsm8k", lambda: [dict(item) for item in ITEMS])


def test_gsm8k_samples_are_seeded_and_ignore_length(gsm8k_data):
    make = gsm8k_tasks.TASKS["gsm8k"].make_samples
    first = make(None, 4000, 3, 0)
    assert first == make(None, 4000, 3, 0)
    assert [s.meta["item"] for s in first] != [s.meta["item"] for s in make(None, 4000, 3, 1)]
    assert [s.context for s in make(None, 100, 3, 0)] == [s.context for s in first]
    full = make(None, 0, 5, 2)
    assert sorted(s.meta["item"] for s in full) == [0, 1, 2, 3, 4]
    for index, sample in enumerate(full):
        item = ITEMS[sample.meta["item"]]
        assert sample.context == item["question"] and sample.max_new_tokens == 256
        assert "####" in sample.question and sample.meta["task"] == "gsm8k" and sample.meta["index"] == index
    solution = next(s for s in full if s.meta["item"] == 4)
    assert solution.answers == ["1012"]  # the number after ####, commas removed
    with pytest.raises(InputError):
        make(None, 0, 6, 0)


def test_gsm8k_metric_on_hand_made_predictions():
    metric = gsm8k_tasks.TASKS["gsm8k"].metric
    assert metric("3 + 4 = 7 apples.\n#### 7", ["7"]) == 1.0
    assert metric("He pays 12 * 100 = $1,200.", ["1200"]) == 1.0  # last number, commas removed
    assert metric("The answer is 18.00", ["18"]) == 1.0
    assert metric("#### 7\n\nQuestion: Sam has 5 pears", ["7"]) == 1.0  # first number after ####
    assert metric("3 + 4 = 7, so 7 apples. Then 5 more", ["7"]) == 0.0  # last number is 5
    assert metric("no idea", ["7"]) == 0.0
    assert metric("half is 4.5", ["4.50"]) == 1.0


def test_last_number_and_normalisation():
    assert last_number("It was -3 degrees") == "-3"
    assert last_number("16-3-4=9 eggs, $1,234.50 total") == "1234.5"
    assert last_number("so 16-3") == "3"  # a hyphen between numbers is not a sign
    assert last_number("sentence ends with 42.") == "42"
    assert last_number("no numbers") is None
    assert normalize_number("1,000.0") == "1000" and normalize_number("0.50") == "0.5"
