"""Transformers-native use (kvbudget.native): CompressingCache inside model.generate, and answer()."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from transformers import TextStreamer
from transformers.generation.streamers import BaseStreamer

import kvbudget
from conftest import tiny_model
from kvbudget.attention import is_attached
from kvbudget.engine import build_prompt, eos_ids
from kvbudget.errors import BudgetError, InputError, UnsupportedMethodError
from method_matrix import small

CONTEXT = "".join(chr(33 + (i * 7 + i // 5) % 90) for i in range(150))
QUESTION = "what is it?"
QUESTIONS = ["what is it?", "where, and when?", "who wrote the 3rd line?"]


def _prompt_ids(tokenizer, context: str = CONTEXT, question: str = QUESTION) -> torch.Tensor:
    return torch.tensor([build_prompt(tokenizer, context, question).ids])


def _hf_generate(model, tokenizer, ids, cache, max_new_tokens=20, **kwargs) -> list[int]:
    """``model.generate`` greedily with ``cache``; the new ids up to and including the first EOS."""
    eos = sorted(eos_ids(model, tokenizer))
    options = {"attention_mask": torch.ones_like(ids), "eos_token_id": eos, **kwargs}
    out = model.generate(
        input_ids=ids, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=tokenizer.pad_token_id, **options,
    )  # fmt: skip
    return [_cut_at_eos(row[ids.shape[1] :].tolist(), eos) for row in out]


def _cut_at_eos(ids: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


class EntryRecorder(BaseStreamer):
    """A streamer noting the cache's kept entries ``[layers, kv_heads]`` whenever a token arrives."""

    def __init__(self, cache) -> None:
        self.cache, self.calls, self.entries = cache, 0, []

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls > 1:  # the first call is the prompt, before any forward
            self.entries.append(torch.stack([layer.head_lengths()[0] for layer in self.cache.layers]))

    def end(self) -> None:
        pass


# ---------------------------------------------------------------------------------- model.generate
@pytest.mark.parametrize("name", ["snapkv", "streamingllm", "d2o", "ada-snapkv", "pyramidkv", "h2o"])
def test_generate_with_cache_equals_kvbudget_generate(name, llama, tokenizer):
    budget = 40
    reference = kvbudget.generate(llama, tokenizer, CONTEXT, QUESTION, method=small(name), budget=budget,
                                  max_new_tokens=20)  # fmt: skip
    ids = _prompt_ids(tokenizer)
    assert ids.shape[1] > 3 * budget
    with kvbudget.CompressingCache(llama, small(name), budget=budget) as cache:
        [generated] = _hf_generate(llama, tokenizer, ids, cache)
    assert generated == reference.token_ids
    assert cache.kept[0].equal(reference.budgets)  # the same entries kept per layer and head
    assert cache.get_seq_length() == ids.shape[1] + len(generated) - 1


def test_ratio_equals_kvbudget_generate(llama, tokenizer):
    reference = kvbudget.generate(llama, tokenizer, CONTEXT, QUESTION, method=small("snapkv"), ratio=0.3,
                                  max_new_tokens=12)  # fmt: skip
    ids = _prompt_ids(tokenizer)
    with kvbudget.CompressingCache(llama, small("snapkv"), ratio=0.3) as cache:
        [generated] = _hf_generate(llama, tokenizer, ids, cache, max_new_tokens=12)
    assert generated == reference.token_ids
    assert int(cache.kept[0, 0, 0]) == round(0.3 * ids.shape[1])


@pytest.mark.parametrize("name", ["snapkv", "streamingllm"])
def test_left_padded_batch_equals_kvbudget_generate(name, llama, tokenizer):
    contexts = [CONTEXT, CONTEXT[:110]]
    questions = [QUESTION, "and then?"]
    reference = kvbudget.generate(llama, tokenizer, contexts, questions, method=small(name), budget=40,
                                  max_new_tokens=12)  # fmt: skip
    rows = [build_prompt(tokenizer, c, q).ids for c, q in zip(contexts, questions, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with kvbudget.CompressingCache(llama, small(name), budget=40) as cache:
        generated = _hf_generate(llama, tokenizer, ids, cache, max_new_tokens=12, attention_mask=mask)
    assert generated == [r.token_ids for r in reference]


def test_text_streamer_prints_the_returned_text(llama, tokenizer):
    ids = _prompt_ids(tokenizer)
    printed = io.StringIO()
    with kvbudget.CompressingCache(llama, small("ada-snapkv"), budget=40) as cache:
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        with contextlib.redirect_stdout(printed):
            [generated] = _hf_generate(
                llama, tokenizer, ids, cache, max_new_tokens=16, min_new_tokens=16, streamer=streamer
            )
    text = tokenizer.decode(generated, skip_special_tokens=True)
    assert len(text) >= 8
    assert printed.getvalue() == text + "\n"


def test_streamingllm_holds_sinks_and_recent_tokens_while_decoding(llama, tokenizer):
    """Independent reference: after every step each head holds positions 0..3 and the last B − 4."""
    budget, sinks = 24, 4
    ids = _prompt_ids(tokenizer)
    with kvbudget.CompressingCache(llama, "streamingllm", budget=budget) as cache:
        seen_after_step = []

        class Positions(BaseStreamer):
            def __init__(self) -> None:
                self.calls = 0

            def put(self, value: torch.Tensor) -> None:
                self.calls += 1
                if self.calls == 1:
                    return
                seen = cache.get_seq_length()
                expected = list(range(sinks)) + list(range(seen - (budget - sinks), seen))
                for layer in cache.layers:
                    for h in range(layer.num_heads):
                        assert layer.head(h)[2][0].tolist() == expected
                seen_after_step.append(seen)

            def end(self) -> None:
                pass

        [generated] = _hf_generate(llama, tokenizer, ids, cache, max_new_tokens=15, min_new_tokens=15,
                                   streamer=Positions())  # fmt: skip
    assert len(generated) == 15
    assert seen_after_step == list(range(ids.shape[1], ids.shape[1] + 15))


def test_d2o_entries_stay_at_the_budget_while_decoding(llama, tokenizer):
    budget = 40
    ids = _prompt_ids(tokenizer)
    with kvbudget.CompressingCache(llama, small("d2o"), budget=budget) as cache:
        recorder = EntryRecorder(cache)
        _hf_generate(llama, tokenizer, ids, cache, max_new_tokens=15, min_new_tokens=15, streamer=recorder)
    layers, heads = llama.config.num_hidden_layers, llama.config.num_key_value_heads
    assert len(recorder.entries) == 15
    assert int(recorder.entries[0].sum()) == layers * heads * budget  # D2O's layer split, exact total
    for entries in recorder.entries:
        assert entries.equal(recorder.entries[0])


def test_snapkv_cache_grows_by_one_entry_per_step(llama, tokenizer):
    """A prefill-only method compresses once; decoding appends (the contrast to the two tests above)."""
    ids = _prompt_ids(tokenizer)
    with kvbudget.CompressingCache(llama, small("snapkv"), budget=40) as cache:
        recorder = EntryRecorder(cache)
        _hf_generate(llama, tokenizer, ids, cache, max_new_tokens=6, min_new_tokens=6, streamer=recorder)
    assert [int(e.max()) for e in recorder.entries] == [40, 41, 42, 43, 44, 45]


@pytest.mark.parametrize(
    ("name", "why"),
    [("gemfilter", "prune-stage"), ("asl", "prune-stage"), ("laq", "lookahead"), ("kvzip", "lookahead")],
)
def test_methods_generate_cannot_serve_are_refused_in_one_line(name, why, llama):
    with pytest.raises(UnsupportedMethodError) as err:
        kvbudget.CompressingCache(llama, name, budget=64)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{name} cannot run inside model.generate")
    assert why in message


def test_bad_budget_is_refused_before_any_work(llama):
    with pytest.raises(BudgetError, match="budget must be a positive integer"):
        kvbudget.CompressingCache(llama, "snapkv", budget=0)


def test_attention_is_restored_when_the_last_cache_closes(tokenizer):
    model = tiny_model("qwen2", seed=3)
    before = model.config._attn_implementation
    assert before != "kvbudget"
    first = kvbudget.CompressingCache(model, small("snapkv"), budget=40)
    with kvbudget.CompressingCache(model, small("snapkv"), budget=40) as second:
        assert model.config._attn_implementation == "kvbudget"
        _hf_generate(model, tokenizer, _prompt_ids(tokenizer), second, max_new_tokens=3)
    assert model.config._attn_implementation == "kvbudget"  # `first` is still open
    first.close()
    first.close()
    assert model.config._attn_implementation == before
    assert not is_attached(model)


def test_attention_attached_by_someone_else_stays_attached(tokenizer):
    model = tiny_model("llama", seed=5)
    kvbudget.attach(model)
    with kvbudget.CompressingCache(model, "snapkv", budget=64):
        pass
    assert is_attached(model)


# ---------------------------------------------------------------------------------- several questions
@pytest.mark.parametrize("name", ["snapkv", "streamingllm", "ada-snapkv", "d2o", "laq"])
def test_answer_equals_question_agnostic_generate_per_question(name, llama, tokenizer):
    answers = kvbudget.answer(llama, tokenizer, CONTEXT, QUESTIONS, method=small(name), budget=40,
                              max_new_tokens=12)  # fmt: skip
    separately = [
        kvbudget.generate(
            llama,
            tokenizer,
            CONTEXT,
            q,
            method=small(name),
            budget=40,
            max_new_tokens=12,
            compress_context_only=True,
        ).text  # fmt: skip
        for q in QUESTIONS
    ]
    assert answers == separately
    assert len(set(answers)) > 1  # the questions lead to different answers


def test_answer_with_a_chat_template_and_a_ratio(llama, chat_tokenizer):
    answers = kvbudget.answer(llama, chat_tokenizer, CONTEXT, QUESTIONS[:2], method=small("pyramidkv"),
                              ratio=0.4, max_new_tokens=10, answer_prefix="A:")  # fmt: skip
    separately = [
        kvbudget.generate(
            llama,
            chat_tokenizer,
            CONTEXT,
            q,
            "A:",
            method=small("pyramidkv"),
            ratio=0.4,
            max_new_tokens=10,
            compress_context_only=True,
        ).text  # fmt: skip
        for q in QUESTIONS[:2]
    ]
    assert answers == separately


def test_cache_copies_answer_each_question_with_model_generate(llama, tokenizer):
    """Compress the context with a plain forward, then generate from a copy per question."""
    prompts = [build_prompt(tokenizer, CONTEXT, q) for q in QUESTIONS]
    context_ids = torch.tensor([prompts[0].context_ids])
    with kvbudget.CompressingCache(llama, small("h2o"), budget=40) as cache:
        with torch.no_grad():
            llama(context_ids, past_key_values=cache)
        kept = [layer.head_lengths().clone() for layer in cache.layers]
        generated = [
            _hf_generate(llama, tokenizer, torch.tensor([p.ids]), cache.copy(), max_new_tokens=12)[0]
            for p in prompts
        ]
    assert [layer.head_lengths().equal(k) for layer, k in zip(cache.layers, kept, strict=True)] == [True] * 4
    assert cache.get_seq_length() == len(prompts[0].context_ids)  # the copies did not touch it
    separately = [
        kvbudget.generate(
            llama,
            tokenizer,
            CONTEXT,
            q,
            method=small("h2o"),
            budget=40,
            max_new_tokens=12,
            compress_context_only=True,
        ).token_ids  # fmt: skip
        for q in QUESTIONS
    ]
    assert generated == separately


def test_answer_leaves_the_models_attention_as_it_found_it(tokenizer):
    model = tiny_model("llama", seed=7)
    before = model.config._attn_implementation
    kvbudget.answer(
        model, tokenizer, CONTEXT, QUESTIONS[:1], method=small("snapkv"), budget=40, max_new_tokens=2
    )
    assert model.config._attn_implementation == before
    assert not is_attached(model)


def test_answer_refuses_prune_methods_and_bad_questions(llama, tokenizer):
    with pytest.raises(UnsupportedMethodError, match="^gemfilter cannot share one compressed context"):
        kvbudget.answer(llama, tokenizer, CONTEXT, QUESTIONS, method="gemfilter")
    for bad in ([], "what?", [1, 2]):
        with pytest.raises(InputError, match="questions must be a non-empty list of strings"):
            kvbudget.answer(llama, tokenizer, CONTEXT, bad)


# ---------------------------------------------------------------------------------- the real model
@pytest.mark.integration
def test_real_model_generate_and_answer(real_model):
    from kvbudget.eval.tasks.needle import needle_sample

    model, tokenizer = real_model
    sample = needle_sample(tokenizer, length=300, depth=0.5, haystack="essays", seed=2)
    prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    ids = torch.tensor([prompt.ids])
    for name in ("snapkv", "streamingllm", "ada-snapkv"):
        reference = kvbudget.generate(model, tokenizer, sample.context, sample.question, sample.answer_prefix,
                                      method=name, budget=128, max_new_tokens=12)  # fmt: skip
        printed = io.StringIO()
        with kvbudget.CompressingCache(model, name, budget=128) as cache, contextlib.redirect_stdout(printed):
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
            [generated] = _hf_generate(model, tokenizer, ids, cache, max_new_tokens=12, streamer=streamer)
        assert generated == reference.token_ids, name
        assert printed.getvalue() == reference.text + "\n"
    questions = [sample.question, "What is the main topic of the essays?"]
    answers = kvbudget.answer(model, tokenizer, sample.context, questions, method="snapkv", ratio=0.3,
                              max_new_tokens=12)  # fmt: skip
    separately = [
        kvbudget.generate(
            model,
            tokenizer,
            sample.context,
            q,
            method="snapkv",
            ratio=0.3,
            max_new_tokens=12,
            compress_context_only=True,
        ).text  # fmt: skip
        for q in questions
    ]
    assert answers == separately
