"""Several questions on one compressed context (kvbudget.eval.conversation) and the runner's
shared-context rows: multi-turn and multi-request against hand-built token sequences decoded by the
plain model, rewinding a cache, drafts that change nothing, rows per mode that resume."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_model, tiny_tokenizer
from kvbudget import generate
from kvbudget.cache import BudgetCache
from kvbudget.engine import build_prompt, prefill
from kvbudget.errors import KVBudgetError
from kvbudget.eval import runner as runner_module
from kvbudget.eval.conversation import MODES, Conversation, follow_up_text, join_turn
from kvbudget.eval.metrics import string_match_all
from kvbudget.eval.runner import EvalConfig, Runner
from kvbudget.eval.sample import FollowUp, Sample
from kvbudget.eval.store import load_rows
from kvbudget.eval.tasks.base import TaskSpec
from kvbudget.methods.spec import MethodSpec
from kvbudget.native import attached
from kvbudget.phases import Stage
from kvbudget.session import CompressionSession

CONTEXT = "The cat sat on the mat. " * 6 + "Key alpha is 417. " + "Rain fell in the hills. " * 6
QUESTIONS = ["What is key alpha?", "Where did the cat sit?", "What fell?"]
EOS = {1}


def _turns(max_new: int = 6) -> list[FollowUp]:
    return [FollowUp(q, ["x"], "A:", max_new) for q in QUESTIONS]


def _greedy(model, ids: list[int], max_new: int) -> list[int]:
    """Plain greedy decoding with the model's own forward over the whole sequence (no cache)."""
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
        out.append(int(logits.argmax()))
        if out[-1] in EOS:
            break
    return out


@torch.inference_mode()
def _start(model, tok, method: str, budget: int | None, agnostic: bool, prompts):
    budget = budget if budget is not None else len(prompts[0].ids)
    built = MethodSpec.parse(method).build()
    session = CompressionSession(built, model.config.num_hidden_layers, budget=budget, model=model)
    return prefill(model, [prompts[0]], session, tok.pad_token_id, agnostic, EOS)


def _converse(model, tok, method="full", budget=None, agnostic=False, drafts=None, turns=None):
    turns = turns or _turns()
    prompts = [build_prompt(tok, CONTEXT, t.question, t.answer_prefix) for t in turns]
    with attached(model):
        cache, logits, mask, last = _start(model, tok, method, budget, agnostic, prompts)
        step_by_step = Stage.DECODE in MethodSpec.parse(method).build().stages
        talk = Conversation(model, tok, EOS, step_by_step)
        return talk.run(cache, logits, mask, last, prompts, turns, drafts), prompts


def test_follow_up_text_is_the_templates_turn_boundary_and_plain_without_one():
    assert follow_up_text(tiny_tokenizer(True), "Why?", "A:") == "</assistant><user>Why?</user><assistant>A:"
    assert follow_up_text(tiny_tokenizer(False), "Why?", "A:") == "\n\nWhy?\nA:"


def test_an_answer_ending_on_the_templates_closing_token_has_it_once():
    im_end = 7
    assert join_turn([5, 6, im_end], [im_end, 9, 10], {im_end}) == [5, 6, im_end, 9, 10]
    assert join_turn([5, 6, 8], [im_end, 9], {im_end}) == [5, 6, 8, im_end, 9]  # cut short: closed
    assert join_turn([5, 6, 2], [im_end, 9], {im_end, 2}) == [5, 6, 2, im_end, 9]  # another EOS: both


def test_full_cache_multi_turn_is_greedy_decoding_of_the_whole_conversation():
    model, tok = tiny_model(), tiny_tokenizer(True)
    outcomes, _ = _converse(model, tok)
    # the conversation written out by hand: the template's user turn, then each answer and the
    # boundary "</assistant><user>…</user><assistant>A:" before the next question
    ids = tok(f"<user>{CONTEXT}\n\n{QUESTIONS[0]}</user><assistant>A:", add_special_tokens=False)["input_ids"]
    for i, question in enumerate(QUESTIONS):
        if i:
            ids += tok(f"</assistant><user>{question}</user><assistant>A:", add_special_tokens=False)[
                "input_ids"
            ]
        answer = _greedy(model, ids, 6)
        assert outcomes["multi-turn"][i].token_ids == answer, i
        ids += answer


def test_full_cache_multi_request_answers_each_question_alone():
    model, tok = tiny_model(), tiny_tokenizer(True)
    outcomes, _ = _converse(model, tok)
    for i, question in enumerate(QUESTIONS):
        ids = tok(f"<user>{CONTEXT}\n\n{question}</user><assistant>A:", add_special_tokens=False)["input_ids"]
        assert outcomes["multi-request"][i].token_ids == _greedy(model, ids, 6), i
    assert outcomes["multi-request"][0] is outcomes["multi-turn"][0]


def test_question_agnostic_multi_request_equals_generate_per_question():
    model, tok = tiny_model(), tiny_tokenizer(True)
    outcomes, _ = _converse(model, tok, "snapkv:window=4,kernel=3", 24, agnostic=True)
    for i, question in enumerate(QUESTIONS):
        method = MethodSpec.parse("snapkv:window=4,kernel=3").build()
        alone = generate(
            model, tok, CONTEXT, question, "A:", method=method, budget=24, compress_context_only=True,
            max_new_tokens=6,
        )  # fmt: skip
        assert outcomes["multi-request"][i].text == alone.text, i


def test_question_aware_multi_request_keeps_the_context_entries_chosen_with_question_one():
    model, tok = tiny_model(), tiny_tokenizer(True)
    prompts = [build_prompt(tok, CONTEXT, q, "A:") for q in QUESTIONS]
    context = len(prompts[0].context_ids)
    with attached(model):
        cache, *_ = _start(model, tok, "snapkv:window=4,kernel=3", 24, False, prompts)
    rewound = copy.deepcopy(cache, {id(model): model})
    rewound.rewind(context)
    assert rewound.get_seq_length() == context
    for before, after in zip(cache.layers, rewound.layers, strict=True):
        for h in range(before.num_heads):
            kept = before.head(h)[2][0]
            assert after.head(h)[2][0].tolist() == [p for p in kept.tolist() if 0 <= p < context]
    # SnapKV keeps its observation window, question 1's last tokens: they are gone
    assert any(int(layer.head(0)[2].max()) >= context for layer in cache.layers)


def test_rewind_drops_late_entries_from_ragged_heads_and_refuses_a_longer_length():
    cache = BudgetCache(1)
    layer = cache.layers[0]
    keys = torch.arange(2 * 6 * 2, dtype=torch.float32).view(1, 2, 6, 2)
    layer.update(keys, keys.clone())
    layer.keep([[torch.tensor([0, 2, 4, 5]), torch.tensor([1, 3])]])  # head 0: positions 0 2 4 5; head 1: 1 3
    cache.rewind(4)
    assert layer.seen == 4
    assert layer.head(0)[2][0].tolist() == [0, 2] and layer.head(1)[2][0].tolist() == [1, 3]
    assert layer.head(0)[0][0, :, 0].tolist() == [0.0, 4.0]  # the keys went with their positions
    with pytest.raises(KVBudgetError, match="cannot rewind to 5 tokens"):
        cache.rewind(5)


@pytest.mark.parametrize("method", ["snapkv:window=4,kernel=3", "h2o"])
def test_drafts_change_no_answer(method):
    model, tok = tiny_model(), tiny_tokenizer(True)
    full, _ = _converse(model, tok)
    drafts = {mode: [t.token_ids for t in turns] for mode, turns in full.items()}
    plain, _ = _converse(model, tok, method, 24)
    drafted, _ = _converse(model, tok, method, 24, drafts=drafts)
    for mode in MODES:
        assert [t.token_ids for t in drafted[mode]] == [t.token_ids for t in plain[mode]], mode
    assert sum(t.draft_accepted for t in drafted["multi-request"]) > 0


def test_a_deep_copied_cache_shares_the_model_it_is_bound_to():
    model, tok = tiny_model(), tiny_tokenizer(True)
    prompts = [build_prompt(tok, CONTEXT, QUESTIONS[0], "A:")]
    with attached(model):
        cache, *_ = _start(model, tok, "snapkv:window=4,kernel=3", 24, False, prompts)
    copied = copy.deepcopy(cache)
    assert copied.session is not cache.session and copied.session._bound_to is model


# ---------------------------------------------------------------------------------------- runner
def _task_samples(tokenizer, length, num_samples, seed) -> list[Sample]:
    first, *rest = _turns()
    follow = [FollowUp(t.question, ["417"] if i == 0 else ["mat"], "A:", 6) for i, t in enumerate(rest)]
    return [  # the samples differ in their first question
        Sample(CONTEXT, first.question + " " * i, ["417"], "A:", 6, {"index": i}, follow_ups=follow)
        for i in range(num_samples)
    ]


TASK = TaskSpec("tiny_shared", "shared-context", _task_samples, string_match_all, "string_match_all")


def _rows(tmp_path, monkeypatch, methods, agnostic=False) -> list[dict]:
    monkeypatch.setattr(runner_module, "get_task", lambda name: TASK)
    config = EvalConfig(
        model="tiny", tasks=["tiny_shared"], lengths=[0], methods=methods, budgets=[24], limit=2,
        compress_context_only=agnostic,
    )  # fmt: skip
    Runner(config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(True), progress=False).run()
    return load_rows(tmp_path / "results.jsonl")


def test_runner_writes_a_row_per_run_and_mode_scored_per_turn_and_resumes(tmp_path, monkeypatch):
    methods = ["full", "snapkv:window=4,kernel=3", "asl"]
    rows = _rows(tmp_path, monkeypatch, methods)
    assert len(rows) == 2 * 3 * 2 and len({r["key"] for r in rows}) == len(rows)
    assert {r["conversation"] for r in rows} == set(MODES)
    good = [r for r in rows if r["method"] != "asl"]
    assert all(r["error"] is None and len(r["turns"]) == 3 for r in good)
    for row in good:
        scores = [t["score"] for t in row["turns"]]
        assert row["score"] == pytest.approx(sum(scores) / 3)
        assert [t["turn"] for t in row["turns"]] == [1, 2, 3]
        assert all(t["score"] == string_match_all(t["prediction"], t["answers"]) for t in row["turns"])
    assert all(r["logical_bytes"] >= r["physical_bytes"] > 0 for r in good)
    full = [r for r in good if r["method"] == "full"]
    assert all(
        t["agreement"] == 1.0 and t["prediction"] == t["full_prediction"] for r in full for t in r["turns"]
    )
    pruned = [r for r in rows if r["method"] == "asl"]
    assert len(pruned) == 4 and all("prune-stage" in r["error"] for r in pruned)
    # the same command again writes nothing; a new method adds only its rows
    assert len(_rows(tmp_path, monkeypatch, methods)) == len(rows)
    assert len(_rows(tmp_path, monkeypatch, [*methods, "tova"])) == len(rows) + 4


def test_runner_rows_match_the_conversation_run_directly(tmp_path, monkeypatch):
    rows = _rows(tmp_path, monkeypatch, ["full", "snapkv:window=4,kernel=3"], agnostic=True)
    model, tok = tiny_model(), tiny_tokenizer(True)
    turns = _task_samples(tok, 0, 1, 0)[0].turns()
    direct, _ = _converse(model, tok, "snapkv:window=4,kernel=3", 24, agnostic=True, turns=turns)
    for row in rows:
        if row["method"] == "snapkv" and row["sample"] == 0:
            predictions = [t["prediction"] for t in row["turns"]]
            assert predictions == [t.text for t in direct[row["conversation"]]], row["conversation"]
            assert row["mode"] == "agnostic"


def _row(method: str, sample: int, mode: str, scores: list[float], task: str = "t", ratio=0.5) -> dict:
    return {
        "key": f"{method}{sample}{mode}{task}", "task": task, "length": 0, "sample": sample, "method": method,
        "label": method, "conversation": mode, "compression_ratio": None if method == "full" else ratio,
        "budget": None if method == "full" else 8, "error": None, "compress_s": 1.0, "physical_bytes": 2048,
        "turns": [{"score": s} for s in scores],
    }  # fmt: skip


def test_later_turns_against_the_full_cache_by_hand():
    from kvbudget.eval.turns_report import later_minus_full, later_turns, turns_table

    rows = [
        _row("full", 0, "multi-turn", [1, 1, 1, 1]), _row("full", 1, "multi-turn", [1, 1, 0, 1]),
        _row("m", 0, "multi-turn", [1, 0, 0, 1]), _row("m", 1, "multi-turn", [1, 1, 0, 0]),
    ]  # fmt: skip
    assert later_turns(rows[2]) == pytest.approx(1 / 3)
    # per sample: (1/3 − 1) and (1/3 − 2/3); one task: their mean
    difference = later_minus_full(rows, "m", ("r", 0.5), "multi-turn", resamples=200)
    assert difference.mean == pytest.approx(((1 / 3 - 1) + (1 / 3 - 2 / 3)) / 2) and difference.n == 2
    assert difference.low <= difference.mean <= difference.high
    assert later_minus_full(rows, "m", ("r", 0.5), "multi-request") is None
    # the full cache stored at 4 bits is another run, not the reference (its method is "full" too)
    quantized = [
        dict(_row("full", i, "multi-turn", [1, 0, 0, 0]), label="full:kv_bits=4", key=f"q{i}") for i in (0, 1)
    ]
    assert (
        later_minus_full(rows + quantized, "m", ("r", 0.5), "multi-turn", resamples=200).mean
        == difference.mean
    )
    table = turns_table(rows, resamples=200)
    line = next(line for line in table if "| m |" in line)
    assert "| 100.0 | 33.3 | -50.0 [" in line and line.endswith("| 1.0 | 2 | 2 |")


def test_the_report_reads_each_mode_as_a_task_and_shows_turns(tmp_path, monkeypatch):
    from kvbudget.eval.report import write_report

    _rows(tmp_path, monkeypatch, ["full", "snapkv:window=4,kernel=3"])
    text = write_report(tmp_path, resamples=50).read_text()
    assert "## tiny_shared-multi-turn" in text and "## tiny_shared-multi-request" in text
    assert (tmp_path / "score_vs_budget_tiny_shared-multi-turn.png").is_file()
    assert "## Turn 1 and later turns (shared-context tasks)" in text
    assert (tmp_path / "turns.png").stat().st_size > 0
