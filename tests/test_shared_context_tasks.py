"""The shared-context tasks (sc_keys, sc_vt, sc_code, sc_aggregate): one context, four questions.

Each sample is checked against hand-written expectations, never the modules' own helpers: the
planted text (a needle sentence, an assignment line, a ``def``) is rebuilt here from the turn's
answers and found in the context at the offset ``meta`` gives, and nowhere else; depths are
re-measured here by tokenising the context's prefix; the four turns name different items, lie one
per quarter (sc_aggregate: sixteen needles, one per sixteenth) and are asked out of context order.

Unit tests run on made-up essays and word lists (monkeypatched loaders), the interpreter's standard
library and the character-level test tokenizer; the ``integration`` tests use the fetched RULER
data and smollm2-135m's tokenizer.
"""

from __future__ import annotations

import ast
import hashlib
import re

import pytest

from kvbudget import data
from kvbudget.data import stdlib_root
from kvbudget.errors import InputError, KVBudgetError
from kvbudget.eval.tasks import get_task, task_names

NAMES = ["sc_keys", "sc_vt", "sc_code", "sc_aggregate"]
#: lengths that leave the fixed parts room at the character-level tokenizer (sc_vt's solved example
#: alone is ~1,000 characters)
LENGTHS = {"sc_keys": 6000, "sc_vt": 9000, "sc_code": 6000, "sc_aggregate": 6000}
MAX_NEW = {"sc_keys": 32, "sc_vt": 30, "sc_code": 32, "sc_aggregate": 64}
NEEDLE = "One of the special magic numbers for {key} is: {value}."


# --- made-up data ---------------------------------------------------------------------------------


def _fake_word(i: int, salt: int) -> str:
    letters, vowels = "bcdfghjklmnpqrstvwxz", "aeiou"
    n = i * 7919 + salt * 104729
    return "".join(letters[(n // 20**k) % 20] + vowels[(n // 5**k) % 5] for k in range(3)) + str(i % 10)


@pytest.fixture
def fake_data(monkeypatch):
    """Small, deterministic stand-ins for the RULER essays and the wonderwords lists."""
    lists = {
        "adjectives": [_fake_word(i, 1) for i in range(80)] + ["ad hoc"],
        "nouns": [_fake_word(i, 2) for i in range(300)],
    }
    sentences = [
        " ".join(_fake_word(i * 13 + j, 4) for j in range(5 + i % 7)).capitalize() + "." for i in range(2500)
    ]
    monkeypatch.setattr(data, "words", lambda kind: list(lists[kind]))
    monkeypatch.setattr(data, "ruler_essays", lambda: " ".join(sentences))


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _make(name: str, tokenizer, length: int, num: int = 2, seed: int = 0):
    return get_task(name).make_samples(tokenizer, length, num, seed)


# --- hand-written checks, shared by the unit and integration tests ----------------------------------


def _planted(name: str, turn) -> list[str]:
    """The text each of the turn's answers was planted as, rebuilt from the question and answers."""
    if name == "sc_keys":
        key = turn.meta["key"]
        assert turn.question == f"What is the special magic number for {key} mentioned in the provided text?"
        assert turn.answer_prefix == f"The special magic number for {key} mentioned in the provided text is"
        return [NEEDLE.format(key=key, value=turn.answers[0])]
    if name == "sc_aggregate":
        key = turn.meta["key"]
        assert turn.question == (
            f"What are all the special magic numbers for {key} mentioned in the provided text?"
        )
        assert turn.answer_prefix == f"The special magic numbers for {key} mentioned in the provided text are"
        return [NEEDLE.format(key=key, value=v) for v in turn.answers]
    if name == "sc_code":
        fn = turn.meta["name"]
        assert turn.question == (
            f"What does the function `{fn}()` defined in the code above return? Answer with the number only."
        )
        assert turn.answer_prefix == f"`{fn}()` returns"
        return [f"def {fn}():\n    return {turn.answers[0]}\n"]
    value = turn.meta["value"]
    assert (
        turn.question
        == f"Question: Find all variables that are assigned the value {value} in the text above."
    )
    assert turn.answer_prefix == (
        "Answer: According to the chain(s) of variable assignment in the text above, "
        f"5 variables are assgined the value {value}, they are:"
    )
    names = turn.answers
    return [f"VAR {names[0]} = {value}"] + [f"VAR {names[j]} = VAR {names[j - 1]} " for j in range(1, 5)]


def _depth(tokenizer, context: str, offset: int) -> float:
    return _tokens(tokenizer, context[:offset]) / _tokens(tokenizer, context)


def check_sample(name: str, sample, tokenizer, length: int) -> None:
    """Everything a shared-context sample promises, measured by hand."""
    context = sample.context
    total = _tokens(tokenizer, context)
    assert abs(total - length) <= 0.02 * length and sample.meta["tokens"] == total
    turns = sample.turns()
    assert len(turns) == 4 and len(sample.follow_ups) == 3
    assert [t.meta["turn"] for t in turns] == [1, 2, 3, 4]
    assert len({t.question for t in turns}) == 4
    assert all(t.max_new_tokens == MAX_NEW[name] for t in turns)
    starts = []  # per turn: the character offsets of its planted text
    for turn in turns:
        planted = _planted(name, turn)
        assert all(answer in piece for answer, piece in zip(turn.answers, planted, strict=False))
        offsets = []
        for piece in planted:
            assert context.count(piece) == 1, piece  # nowhere else
            offsets.append(context.index(piece))
        starts.append(offsets)
        # meta says where: the first planted piece's offset and its depth in tokens
        if name == "sc_aggregate":
            depths = [_depth(tokenizer, context, o) for o in offsets]
            assert turn.meta["key_depths"] == pytest.approx(depths, abs=0.002)
            assert sorted(int(4 * d) for d in depths) == [0, 1, 2, 3]  # one value per quarter
        else:
            assert turn.meta["offset"] == offsets[0]
            depth = _depth(tokenizer, context, offsets[0])
            assert turn.meta["depth"] == pytest.approx(depth, abs=0.002)
            assert turn.meta["quarter"] == int(4 * depth) + 1
            # a chain's five lines, in order, all inside its quarter
            assert offsets == sorted(offsets)
            assert {int(4 * _depth(tokenizer, context, o)) for o in offsets} == {int(4 * depth)}
    if name == "sc_aggregate":
        all_offsets = sorted(o for offsets in starts for o in offsets)
        depths = [_depth(tokenizer, context, o) for o in all_offsets]
        assert [int(16 * d) for d in depths] == list(range(16))  # one needle in each sixteenth
        assert sorted(item["depth"] for item in sample.meta["items"]) == pytest.approx(depths, abs=0.002)
        first_seen = [min(offsets) for offsets in starts]
        assert first_seen != sorted(first_seen)  # keys not asked in the order they first appear
        assert len({t.meta["key"] for t in turns}) == 4
        for turn in turns:  # the key names no other key's needles
            assert context.count(f"for {turn.meta['key']} is: ") == 4
    else:
        firsts = [offsets[0] for offsets in starts]
        assert sorted(int(4 * _depth(tokenizer, context, o)) for o in firsts) == [0, 1, 2, 3]
        assert firsts != sorted(firsts)  # asked out of context order
    if name == "sc_code":
        check_code(sample, turns)
    if name == "sc_vt":
        check_chains(sample, turns)


def check_code(sample, turns) -> None:
    """Each planted function is valid Python at the top level, returns its answer, and is named
    nowhere else; the rest of the context is the standard library's files, as pinned in meta."""
    context = sample.context
    for turn in turns:
        fn = turn.meta["name"]
        assert re.fullmatch(r"[a-z]+(_[a-z]+)+", fn) and context.count(fn) == 1
        offset = turn.meta["offset"]
        snippet = context[offset : context.index("\n\n", offset)] + "\n"
        tree = ast.parse(snippet)
        assert [type(node) for node in tree.body] == [ast.FunctionDef] and tree.body[0].name == fn
        namespace: dict = {}
        exec(compile(tree, "<planted>", "exec"), namespace)  # our own two-line function
        assert str(namespace[fn]()) == turn.answers[0] and len(turn.answers[0]) == 5
        assert offset == 0 or context[offset - 1] == "\n"  # at a line start, column 0
        after = context[offset + len(snippet) :].lstrip("\n")
        assert after == "" or re.match(r"(def |async def |class |@|#)", after)  # before a top-level unit
    files = sample.meta["files"]
    for rel in re.findall(r"^# path: (\S+)$", context, flags=re.M):
        assert rel in files
        assert hashlib.sha256((stdlib_root() / rel).read_bytes()).hexdigest() == files[rel]
    # every other line is a line of the file whose header precedes it
    planted = {line for t in turns for line in (f"def {t.meta['name']}():", f"    return {t.answers[0]}")}
    current: list[str] = []
    for line in context.split("\n"):
        if line.startswith("# path: "):
            current = (stdlib_root() / line[8:]).read_text(encoding="utf-8").split("\n")
        elif line.strip() and line not in planted:
            assert line in current, line


def check_chains(sample, turns) -> None:
    """Resolving every assignment after the solved example gives each turn's variables."""
    text = sample.context.split("Memorize and track")[-1]
    assigned = dict(re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)", text))
    assert len(assigned) == 20

    def resolve(var: str) -> str:
        source = assigned[var]
        return resolve(source[4:]) if source.startswith("VAR ") else source

    for turn in turns:
        holders = {var for var in assigned if resolve(var) == str(turn.meta["value"])}
        assert holders == set(turn.answers) and len(holders) == 5


# --- registry ---------------------------------------------------------------------------------------


def test_registered_and_listed():
    for name in NAMES:
        spec = get_task(name)
        assert spec.name == name and spec.family == "shared-context"
        assert spec.metric_name == "string_match_all"
        assert name in task_names()
    assert (
        set(get_task("sc_keys").data)
        == set(get_task("sc_aggregate").data)
        == {"long-context-eval", "wonderwords"}
    )
    assert get_task("sc_vt").data == get_task("sc_code").data == ()
    with pytest.raises(KVBudgetError, match="sc_keys, sc_vt, sc_code, sc_aggregate"):
        get_task("sc_nope")  # the listing `kvbudget eval` prints for an unknown task


# --- generators -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_turns_are_where_meta_says_spread_and_shuffled(fake_data, tokenizer, name):
    length = LENGTHS[name]
    for index, sample in enumerate(_make(name, tokenizer, length, 3, 0)):
        assert sample.meta["task"] == name and sample.meta["index"] == index
        check_sample(name, sample, tokenizer, length)


@pytest.mark.parametrize("name", NAMES)
def test_seeded_and_different_across_seeds_and_indices(fake_data, tokenizer, name):
    length = LENGTHS[name]
    first = _make(name, tokenizer, length, 3, 0)
    assert first == _make(name, tokenizer, length, 3, 0)
    assert _make(name, tokenizer, length, 2, 0) == first[:2]  # sample i does not depend on how many
    other = _make(name, tokenizer, length, 3, 1)
    for a, b in zip(first, other, strict=True):
        assert a.context != b.context and a.question != b.question
    assert len({s.context for s in first}) == 3 and len({s.question for s in first}) == 3


def test_too_short_a_length_is_an_input_error(fake_data, tokenizer):
    with pytest.raises(InputError, match="sc_vt"):
        _make("sc_vt", tokenizer, 2000, 1)  # the solved example fills the first quarter
    with pytest.raises(InputError):
        _make("sc_keys", tokenizer, 60, 1)


# --- metrics ----------------------------------------------------------------------------------------


def test_metric_on_hand_written_answers(fake_data, tokenizer):
    keys = _make("sc_keys", tokenizer, LENGTHS["sc_keys"], 1)[0]
    metric = get_task("sc_keys").metric
    for turn in keys.turns():
        assert metric(f" {turn.answers[0]}.", turn.answers) == 1.0
        assert metric(" 1234567.", turn.answers) == 0.0
    agg = _make("sc_aggregate", tokenizer, LENGTHS["sc_aggregate"], 1)[0]
    metric = get_task("sc_aggregate").metric
    for turn in agg.turns():
        a, b, c, d = turn.answers
        assert metric(f" {a}, {b}, {c} and {d}.", turn.answers) == 1.0
        assert metric(f" {c} and {a}.", turn.answers) == 0.5
        assert metric(" none of them.", turn.answers) == 0.0
    code = _make("sc_code", tokenizer, LENGTHS["sc_code"], 1)[0]
    for turn in code.turns():
        assert get_task("sc_code").metric(f" {turn.answers[0]}", turn.answers) == 1.0
        assert get_task("sc_code").metric(" 0", turn.answers) == 0.0
    vt = _make("sc_vt", tokenizer, LENGTHS["sc_vt"], 1)[0]
    for turn in vt.turns():
        assert get_task("sc_vt").metric(" " + " ".join(turn.answers), turn.answers) == 1.0
        assert get_task("sc_vt").metric(" VAR ABCDE", turn.answers) == 0.0


# --- integration: RULER data, the standard library and the model's tokenizer ------------------------


@pytest.fixture(scope="module")
def real_tokenizer():
    from transformers import AutoTokenizer

    from kvbudget.models import fetch_model

    return AutoTokenizer.from_pretrained(fetch_model("smollm2-135m", progress=False))


@pytest.mark.integration
@pytest.mark.parametrize("name", NAMES)
def test_real_data_and_tokenizer(real_tokenizer, name):
    for length, num in ((4096, 2), (16384, 1)):
        for sample in _make(name, real_tokenizer, length, num, 0):
            check_sample(name, sample, real_tokenizer, length)
