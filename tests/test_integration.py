"""Integration tests on the real default model (smollm2-135m, fetched by `make fetch`)."""

from __future__ import annotations

import pytest
import torch

import kvbudget
from kvbudget.engine import build_prompt
from kvbudget.eval.runner import EvalConfig, Runner
from kvbudget.eval.store import load_rows
from kvbudget.eval.tasks.needle import needle_sample
from kvbudget.methods.registry import make_method
from method_matrix import ALL_METHODS, BEYOND_BUDGET, DECODE_METHODS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_and_tokenizer(real_model):
    return real_model


@pytest.fixture(scope="module")
def needle_500(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    return needle_sample(tokenizer, length=500, depth=0.5, haystack="essays", seed=1)


def _run(model_and_tokenizer, sample, **kwargs):
    model, tokenizer = model_and_tokenizer
    return kvbudget.generate(
        model, tokenizer, sample.context, sample.question, sample.answer_prefix,
        max_new_tokens=kwargs.pop("max_new_tokens", sample.max_new_tokens), **kwargs,
    )  # fmt: skip


#: one budget for the matrix's compressed runs (qfilter's 64-token window needs 65)
MATRIX_BUDGET = max(64, *(make_method(name).min_budget() for name in ALL_METHODS))
MATRIX_TOKENS = 6  # greedy: the full cache's first 6 tokens are each run's reference


def _config(methods: list[str], budgets: list[int]) -> EvalConfig:
    """One needle sample (~550 tokens) of the real model, ``MATRIX_TOKENS`` answer tokens."""
    return EvalConfig(
        tasks=["needle"], lengths=[500], methods=methods, budgets=budgets, limit=1,
        max_new_tokens=MATRIX_TOKENS,
    )  # fmt: skip


@pytest.fixture(scope="module")
def matrix(model_and_tokenizer, tmp_path_factory) -> dict:
    """Every method on one real needle sample through the runner's shared prefill (the leaderboard's
    path; bit-identical to each method's own prefill, tests/test_eval_runner.py): at
    ``MATRIX_BUDGET``, and at a budget covering the prompt — its length, ``MATRIX_TOKENS`` more for
    methods that evict while decoding. One prefill a part serves the 47 methods' 94 runs."""
    model, tokenizer = model_and_tokenizer
    probe = Runner(_config(["full"], []), tmp_path_factory.mktemp("probe"), model=model, tokenizer=tokenizer)
    ((_, _, _, sample),) = probe.samples()  # the sample the runs below prefill, built without a model run
    prompt = len(build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix).ids)
    rows = {}
    for methods, covering in (
        ([m for m in ALL_METHODS if m not in DECODE_METHODS], prompt),
        (["full", *DECODE_METHODS], prompt + MATRIX_TOKENS),
    ):
        out = tmp_path_factory.mktemp("matrix")
        config = _config(methods, [MATRIX_BUDGET, covering])
        Runner(config, out, model=model, tokenizer=tokenizer, progress=False).run()
        rows.update({(row["label"], row["budget"]): row for row in load_rows(out / "results.jsonl")})
    assert rows[("full", None)]["prompt_tokens"] == prompt
    return rows, prompt


def test_full_cache_finds_the_needle(matrix):
    rows, _ = matrix
    full = rows[("full", None)]  # its 6 tokens: a space and the needle's first 5 digits (of 7)
    assert full["error"] is None and len(full["prediction"].strip()) == 5, full["prediction"]
    assert full["answers"][0].startswith(full["prediction"].strip()), (full["prediction"], full["answers"])


@pytest.mark.parametrize("name", [m for m in ALL_METHODS if m != "full"])
def test_every_method_is_a_no_op_when_the_budget_covers_the_prompt(name, matrix):
    rows, prompt = matrix
    row = rows[(name, prompt + (MATRIX_TOKENS if name in DECODE_METHODS else 0))]
    assert row["error"] is None, row["error"]
    # the full cache's answer, token for token, with the same log-probabilities
    assert row["agreement"] == 1.0 and row["prediction"] == row["full_prediction"], row["prediction"]
    assert row["kl"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("name", [m for m in ALL_METHODS if m != "full"])
def test_every_method_runs_end_to_end(name, matrix):
    """One budget on the real model (the tiny models' matrix checks budgets more widely)."""
    rows, prompt = matrix
    row, full = rows[(name, MATRIX_BUDGET)], rows[("full", None)]
    assert row["error"] is None, row["error"]
    layers, heads = 30, 3
    budgets = torch.tensor(row["budgets"])
    assert budgets.shape == (layers, heads)
    assert isinstance(row["prediction"], str) and 0 <= row["agreement"] <= 1
    if name in BEYOND_BUDGET:
        # asl-fullkv: full cache up to the selection layer (everywhere when none is selected, as the
        # authors' code); PyramidInfer's layer 0 keeps the whole prompt: these hold more than the
        # budget by design
        assert row["logical_bytes"] <= full["logical_bytes"]
        return
    assert int(budgets.sum()) <= layers * heads * MATRIX_BUDGET * 1.1  # pyramid's floored step adds a little
    # the ~550-token prompt kept at most 1.1 × 65 entries a head: the bytes shrink by over 7×
    assert prompt > 540 and row["logical_bytes"] < full["logical_bytes"] / 7


def test_ada_snapkv_saves_real_memory_with_skewed_head_budgets(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    sample = needle_sample(tokenizer, length=2000, depth=0.3, haystack="essays", seed=2)
    result = _run(
        model_and_tokenizer, sample, method="ada-snapkv", budget=64, max_new_tokens=1, return_cache=True
    )
    stats = result.cache_stats_after
    layers, heads, head_dim = 30, 3, 64
    assert result.prompt_tokens > 1900
    assert int(stats.entries.sum()) == 64 * layers * heads  # exactly the budget's entries
    assert stats.logical_bytes == 64 * layers * heads * head_dim * 2 * 4  # fp32 keys + values
    assert stats.physical_bytes <= 1.15 * stats.logical_bytes
    assert result.budgets.sum(1).eq(64 * heads).all()  # every layer's heads share its total exactly
    assert (result.budgets.max(1).values - result.budgets.min(1).values).gt(
        0
    ).sum() >= layers // 2  # they vary
    assert any(layer.is_ragged for layer in result.cache.layers)


@pytest.mark.parametrize("name", ["snapkv", "ada-snapkv"])
def test_batch_of_two_lengths_equals_each_alone(name, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    samples = [
        needle_sample(tokenizer, length=600, depth=0.4, haystack="essays", seed=3),
        needle_sample(tokenizer, length=900, depth=0.7, haystack="essays", seed=4),
    ]
    batch = kvbudget.generate(
        model, tokenizer, [s.context for s in samples], [s.question for s in samples],
        [s.answer_prefix for s in samples], method=name, budget=96, max_new_tokens=10,
    )  # fmt: skip
    for sample, batched in zip(samples, batch, strict=True):
        alone = _run(model_and_tokenizer, sample, method=name, budget=96, max_new_tokens=10)
        assert batched.token_ids == alone.token_ids
        assert batched.budgets.equal(alone.budgets)


def test_model_generate_continues_a_compressed_cache(model_and_tokenizer, needle_500):
    model, tokenizer = model_and_tokenizer
    prompt = build_prompt(tokenizer, needle_500.context, needle_500.question, needle_500.answer_prefix)
    ids = torch.tensor([prompt.ids])
    cache = kvbudget.compress(model, ids[:, :-1], method="snapkv", budget=256)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert cache.get_seq_length() == ids.shape[1] + 7  # logical length: true positions continue
    # the same continuation from an identical cache with a plain greedy loop
    cache2 = kvbudget.compress(model, ids[:, :-1], method="snapkv", budget=256)
    token, mine = ids[:, -1:], []
    with torch.no_grad():
        for _ in range(8):
            token = model(token, past_key_values=cache2).logits[:, -1].argmax(-1, keepdim=True)
            mine.append(int(token))
    generated = out[0, ids.shape[1] :].tolist()
    assert generated == mine[: len(generated)]


@pytest.mark.parametrize("name", ["ada-snapkv", "lava", "asl"])
def test_static_decoding_equals_eager_decoding_on_the_real_model(name, model_and_tokenizer, needle_500):
    """The static path (one masked attention call per layer over static buffers) gives the eager
    path's tokens and kept entries on the real model: ragged heads (ada-snapkv), a cascading method
    (lava) and a pruned prefill (asl)."""
    eager = _run(model_and_tokenizer, needle_500, method=name, budget=64)
    static = _run(model_and_tokenizer, needle_500, method=name, budget=64, decode="static")
    assert static.token_ids == eager.token_ids
    assert static.cache_stats_after.entries.equal(eager.cache_stats_after.entries)
