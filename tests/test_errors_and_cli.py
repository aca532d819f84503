"""Bad input gives one clear error (exit code 2 in the CLI); the CLI runs end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from typer.testing import CliRunner

import kvbudget
from conftest import tiny_model, tiny_tokenizer
from kvbudget.cli import app
from kvbudget.errors import (
    BudgetError,
    InputError,
    KVBudgetError,
    MethodOptionError,
    MissingExtraError,
    UnknownMethodError,
    UnsupportedModelError,
)
from kvbudget.extras import needs_extra

CONTEXT = "A long enough context about foxes and dogs. " * 4


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"method": "no-such-method"}, UnknownMethodError, "unknown method 'no-such-method'"),
        ({"budget": 0}, BudgetError, "budget must be a positive integer"),
        ({"budget": -5}, BudgetError, "got -5"),
        ({"budget": 4096}, BudgetError, "exceeds the model's context of 1024"),
        ({"ratio": 0.0}, BudgetError, "ratio must be in (0, 1]"),
        ({"ratio": 1.5}, BudgetError, "ratio must be in (0, 1]"),
        ({"budget": 10, "ratio": 0.5}, BudgetError, "either budget or ratio"),
        ({"method": "snapkv", "budget": 16}, BudgetError, "budget must be ≥ 33 for snapkv"),
        ({"method": "snapkv", "ratio": 0.05}, BudgetError, "below the 33 entries snapkv always keeps"),
        ({"context": "   "}, InputError, "context is empty"),
        ({"context": "x" * 1100}, InputError, "exceeds the model's context of 1024 tokens"),
        ({"max_new_tokens": 0}, InputError, "max_new_tokens must be ≥ 1"),
    ],
)
def test_generate_rejects_bad_input_with_a_clear_message(kwargs, error, words, llama, tokenizer):
    args = {"context": CONTEXT, "question": "Why?", "method": "snapkv", "budget": 64, **kwargs}
    if "ratio" in kwargs and "budget" not in kwargs:
        args.pop("budget")
    with pytest.raises(error) as info:
        kvbudget.generate(llama, tokenizer, **args)
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"window": -1}, "window must be an integer ≥ 0"),
        ({"kernel": 4}, "kernel must be odd"),
        ({"pooling": "median"}, "pooling must be max, avg or none"),
        ({"floor": 0.2}, "unknown option(s) floor"),
        ({"window": "many"}, "window expects int, got 'many'"),
    ],
)
def test_make_method_validates_options(options, words):
    method = "ada-snapkv"
    with pytest.raises(MethodOptionError) as info:
        kvbudget.make_method(method, **options)
    assert words in str(info.value)


def test_make_method_converts_cli_strings():
    method = kvbudget.make_method("ada-snapkv", window="16", floor_alpha="0.5", pooling="avg")
    assert (method.window, method.floor_alpha, method.pooling) == (16, 0.5, "avg")
    assert kvbudget.make_method("snapkv").window == 32  # fresh default objects


def test_unsupported_architecture_is_named():
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=128)
    model = GPT2LMHeadModel(config).eval()
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'gpt2'"):
        kvbudget.attach(model)
    with pytest.raises(UnsupportedModelError):
        kvbudget.generate(model, tiny_tokenizer(), CONTEXT, "Why?", method="snapkv", budget=64)


def test_attach_is_explicit_and_detach_restores(llama):
    model = tiny_model("llama", seed=5)
    assert model.config._attn_implementation == "sdpa"  # importing kvbudget changed nothing
    with kvbudget.attached(model):
        assert model.config._attn_implementation == "kvbudget"
    assert model.config._attn_implementation == "sdpa"
    assert not any(m._forward_pre_hooks for m in model.modules())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer(chat_template=True).save_pretrained(path)
    return path


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_cli_generate_prints_answer_and_stats(tiny_dir, tmp_path):
    context = tmp_path / "context.txt"
    context.write_text(CONTEXT * 3)
    result = _run(
        "generate", "--model", str(tiny_dir), "--context-file", str(context), "--question", "Why?",
        "--method", "ada-snapkv", "--budget", "48", "--opt", "window=8", "--max-new-tokens", "4",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "answer:" in result.output
    assert "logical KV bytes" in result.output and "TTFT" in result.output
    assert "ada-snapkv on" in result.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--method", "nope"], "unknown method 'nope'"),
        (["--budget", "0"], "budget must be a positive integer"),
        (["--ratio", "2"], "ratio must be in (0, 1]"),
        (["--opt", "window"], "--opt expects key=value"),
        (["--opt", "colour=red"], "unknown option(s) colour"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args, words, tiny_dir, tmp_path):
    context = tmp_path / "context.txt"
    context.write_text(CONTEXT)
    result = _run("generate", "--model", str(tiny_dir), "--context-file", str(context), *args)
    assert result.exit_code == 2
    assert words in result.output
    assert "Traceback" not in result.output


def test_cli_missing_context_file_and_unknown_model(tmp_path):
    result = _run("generate", "--context-file", str(tmp_path / "missing.txt"))
    assert result.exit_code == 2 and "context file not found" in result.output
    context = tmp_path / "c.txt"
    context.write_text(CONTEXT)
    result = _run("generate", "--model", "no-such-model", "--context-file", str(context))
    assert result.exit_code == 2 and "unknown model 'no-such-model'" in result.output


def test_cli_methods_lists_the_registry():
    result = _run("methods")
    assert result.exit_code == 0
    for name in kvbudget.method_names():
        assert name in result.output


def test_compress_context_only_appends_the_question_uncompressed(llama, chat_tokenizer):
    aware = kvbudget.generate(llama, chat_tokenizer, CONTEXT * 2, "Why?", method="snapkv", budget=40,
                              max_new_tokens=4, return_cache=True)  # fmt: skip
    agnostic = kvbudget.generate(llama, chat_tokenizer, CONTEXT * 2, "Why?", method="snapkv", budget=40,
                                 max_new_tokens=4, compress_context_only=True, return_cache=True)  # fmt: skip
    question_tokens = aware.prompt_tokens - int(agnostic.cache_stats_before.entries[0, 0])
    assert question_tokens > 0
    # question-aware: budget entries + generated; agnostic: budget + the whole question + generated
    assert int(agnostic.cache_stats_after.entries[0, 0]) == 40 + question_tokens
    assert int(aware.cache_stats_after.entries[0, 0]) == 40
    assert agnostic.cache.get_seq_length() == aware.cache.get_seq_length()
    assert torch.equal(agnostic.budgets, torch.full_like(agnostic.budgets, 40))


@pytest.mark.parametrize("method", ["keydiff", "tova", "cake", "d2o", "baklava", "cam", "r-kv"])
def test_question_agnostic_decoding_keeps_the_appended_question(method, llama, chat_tokenizer):
    """A method that holds its budget while decoding holds what the prefill kept plus the appended
    question (each layer its own plan, for the methods with one): the first decode step does not
    evict the question back to the budget."""
    aware = kvbudget.generate(llama, chat_tokenizer, CONTEXT * 2, "Why?", method="snapkv", budget=40,
                              max_new_tokens=1)  # fmt: skip
    agnostic = kvbudget.generate(llama, chat_tokenizer, CONTEXT * 2, "Why?", method=method, budget=40,
                                 max_new_tokens=6, compress_context_only=True, return_cache=True)  # fmt: skip
    assert len(agnostic.token_ids) >= 2  # at least one decode step ran (and held the budget)
    question_tokens = aware.prompt_tokens - int(agnostic.cache_stats_before.entries[0, 0])
    steps = len(agnostic.token_ids) - 1  # decode steps, each adds one entry and evicts one
    first_question = aware.prompt_tokens - question_tokens
    assert agnostic.budgets.float().mean() == 40  # per-layer plans (CAKE, D2O, BaKlaVa) average the budget
    grown = steps if method == "r-kv" else 0  # R-KV re-selects once 128 decoded tokens are buffered
    for i, layer in enumerate(agnostic.cache.layers):
        assert torch.equal(layer.head_lengths()[0], agnostic.budgets[i] + question_tokens + grown)
        for head in layer.positions[0]:
            # a decode step evicts one entry, question or not: never the whole question at once
            evicted = set(range(first_question, aware.prompt_tokens)) - set(head.tolist())
            assert len(evicted) <= steps


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(llama, chat_tokenizer):
    def run(**kw):
        return kvbudget.generate(llama, chat_tokenizer, CONTEXT, "Why?", method="snapkv", budget=40,
                                 max_new_tokens=10, **kw).token_ids  # fmt: skip

    greedy = run()
    assert run(temperature=1.0, seed=3) == run(temperature=1.0, seed=3)
    assert any(run(temperature=5.0, seed=s) != greedy for s in range(3))
    assert run(temperature=1.0, top_p=1e-6, seed=1) == greedy  # only the top token survives


#: The evaluation extra's packages that `pip install kvbudget` leaves out (numpy and tqdm come with
#: transformers), blocked so that `import` fails and `find_spec` finds nothing.
EVAL_ONLY = ("matplotlib", "rapidfuzz", "rdata", "rouge_score")


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["eval", "--tasks", "needle"], "kvbudget eval"),
        (["report", "."], "kvbudget report"),
        (["pack", "."], "kvbudget pack"),
        (["tune", "--ratio", "0.3"], "kvbudget tune"),
        (["demo"], "kvbudget demo"),
        (["bench", "--methods", "full"], "kvbudget bench"),
        (["bench", "peer"], "kvbudget bench peer"),
        (["bench", "throughput"], "kvbudget bench throughput"),
        (["profile"], "profile prompt 'austen:2048' (the Austen novels, read with rdata)"),
    ],
)
def test_cli_without_the_eval_extra_names_it_in_one_line(args, command, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing written where the test runs
    for name in EVAL_ONLY:
        monkeypatch.setitem(sys.modules, name, None)
    result = _run(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    hint = f"error: {command} needs the evaluation extra: pip install 'kvbudget[eval]' (missing: "
    assert len(lines) == 1 and lines[0].startswith(hint), result.stderr
    assert "Traceback" not in result.output and not any(tmp_path.iterdir())


def test_cli_core_commands_need_no_extra(monkeypatch):
    for name in EVAL_ONLY:
        monkeypatch.setitem(sys.modules, name, None)
    assert _run("methods").exit_code == 0


def test_needs_extra_turns_only_the_extras_import_errors_into_the_hint():
    with pytest.raises(MissingExtraError) as info:
        with needs_extra("eval", "reading R data"):
            raise ModuleNotFoundError("No module named 'rdata.parser'", name="rdata.parser")
    assert (
        str(info.value)
        == "reading R data needs the evaluation extra: pip install 'kvbudget[eval]' (missing: rdata)"
    )
    assert isinstance(info.value, ImportError) and isinstance(info.value, KVBudgetError)
    # a module no extra provides, or a broken install of an extra's package: passed through unchanged
    with pytest.raises(ModuleNotFoundError) as info:
        with needs_extra("eval", "x"):
            import kvbudget_no_such_module  # noqa: F401
    assert not isinstance(info.value, MissingExtraError) and info.value.name == "kvbudget_no_such_module"
    with pytest.raises(ModuleNotFoundError, match="PIL") as info:
        with needs_extra("eval", "x"):
            raise ModuleNotFoundError("No module named 'PIL'", name="PIL")  # matplotlib's own dependency
    assert not isinstance(info.value, MissingExtraError)
