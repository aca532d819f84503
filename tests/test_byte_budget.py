"""A byte budget (``memory=``, kvbudget.byte_budget): the bytes are met for every method, the
method's highest-ranked entries take the higher precision, bad input is refused in one line."""

from __future__ import annotations

import pytest
import torch

import kvbudget
from conftest import seeded
from kvbudget.byte_budget import RANK_STATE, apply_byte_budget
from kvbudget.cache import BudgetCache
from kvbudget.errors import KVBudgetError
from method_matrix import ALL_METHODS, small
from test_native import CONTEXT, QUESTION

D, SCALE = 16, 4  # the tiny models' head size and dtype (fp32)


def entry(bits: int) -> int:
    """Bytes of one entry at ``bits`` without its key-scale row: codes, one value group's scale and
    minimum (16 channels), its int16 key group — written out by hand."""
    return 2 * D * bits // 8 + 2 * SCALE + 2


def row() -> int:
    """Bytes of one key group's scale and minimum rows."""
    return 2 * D * SCALE


@pytest.mark.parametrize("name", ALL_METHODS)
def test_the_bytes_are_met_for_every_method(name, llama, chat_tokenizer):
    run = kvbudget.generate(llama, chat_tokenizer, CONTEXT, QUESTION, method=small(name), memory=0.125,
                            max_new_tokens=6, return_cache=True)  # fmt: skip
    assert run.token_ids
    chosen = run.cache_stats_after.extra["byte_budget"]
    layers, heads = len(run.cache.layers), run.cache.layers[0].num_heads
    full = layers * heads * run.prompt_tokens * 2 * D * SCALE  # the full fp32 cache's bytes
    assert chosen["target_bytes"] == int(0.125 * full)
    stored = chosen["stored_bytes"]
    assert stored <= chosen["target_bytes"]
    # short of the target by less than one more entry in every head of a layer (and a scale row each)
    assert chosen["target_bytes"] - stored < heads * (entry(8) + row())
    assert sum(chosen["high"]) > 0 and sum(chosen["low"]) > 0


def test_the_highest_ranked_entries_take_the_high_precision():
    n = 200
    keys = torch.randn((1, 2, n, D), generator=seeded(1))
    values = torch.randn((1, 2, n, D), generator=seeded(2))
    cache = BudgetCache(1)
    layer = cache.layers[0]
    layer.update(keys, values)
    ranks = torch.rand((1, 2, n), generator=seeded(3))
    layer.state[RANK_STATE] = ranks.clone()
    target_share = 0.2
    chosen = apply_byte_budget(cache, target_share)
    target = int(target_share * n * 2 * 2 * D * SCALE)
    assert chosen["target_bytes"] == target and chosen["stored_bytes"] <= target
    n_high, n_low = chosen["high"][0] // 2, chosen["low"][0] // 2  # per head (a rectangular layer)
    # by hand: whatever the counts, bytes = two tiers of the hand count, per head
    per_head = (n_high * entry(8) + -(-n_high // 32) * row()) + (n_low * entry(4) + -(-n_low // 32) * row())
    assert cache.physical_bytes() == 2 * per_head
    for h in range(2):
        order = torch.argsort(ranks[0, h], descending=True, stable=True)
        high_positions = set(layer.head(h)[2][0, :n_high].tolist())
        assert high_positions == set(order[:n_high].tolist())
        kept = set(layer.head(h)[2][0].tolist())
        assert kept == set(order[: n_high + n_low].tolist())
        # the high tier reads back within half an 8-bit step, the low tier within half a 4-bit one
        k, v, pos = layer.head(h)
        for segment, bits in ((slice(0, n_high), 8), (slice(n_high, n_high + n_low), 4)):
            exact = values[0, h, pos[0, segment]]
            step = (exact.amax(-1, keepdim=True) - exact.amin(-1, keepdim=True)) / (2**bits - 1)
            assert ((v[0, segment] - exact).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"memory": 0}, "memory must be a fraction of the full cache's bytes in \\(0, 1\\]"),
        ({"memory": 1.5}, "memory must be a fraction"),
        ({"memory": True}, "memory must be a fraction"),
        ({"memory": 0.1, "budget": 64}, "give memory or a budget/ratio, not both"),
        ({"memory": 0.1, "ratio": 0.5}, "give memory or a budget/ratio, not both"),
        ({"memory": 0.1, "kv_bits": 4}, "give memory or kv_bits, not both"),
    ],
)
def test_bad_memory_is_refused_in_one_line(kwargs, message, llama, tokenizer):
    with pytest.raises(KVBudgetError, match=message) as err:
        kvbudget.generate(llama, tokenizer, CONTEXT, QUESTION, **kwargs)
    assert "\n" not in str(err.value)


def test_a_batch_under_a_byte_budget_is_refused(llama, tokenizer):
    with pytest.raises(KVBudgetError, match="memory= stores one sequence at a time"):
        kvbudget.generate(llama, tokenizer, [CONTEXT, CONTEXT[:90]], [QUESTION, QUESTION], memory=0.2)


def test_question_agnostic_runs_keep_the_question_out_of_the_budget(llama, tokenizer):
    run = kvbudget.generate(llama, tokenizer, CONTEXT, QUESTION, method="snapkv", memory=0.2,
                            compress_context_only=True, max_new_tokens=4, return_cache=True)  # fmt: skip
    chosen = run.cache_stats_after.extra["byte_budget"]
    layers, heads = len(run.cache.layers), run.cache.layers[0].num_heads
    context_tokens = len(kvbudget.engine.build_prompt(tokenizer, CONTEXT, QUESTION).context_ids)
    assert chosen["target_bytes"] == int(0.2 * layers * heads * context_tokens * 2 * D * SCALE)
    assert run.cache_stats_after.physical_bytes > chosen["stored_bytes"]  # the question, in full precision


def test_eval_rows_under_a_byte_budget(tmp_path):
    from conftest import tiny_model, tiny_tokenizer
    from kvbudget.eval.runner import EvalConfig, Runner
    from kvbudget.eval.store import load_rows
    from kvbudget.methods.spec import MethodSpec

    assert MethodSpec.parse("snapkv:window=8,memory=0.2").label == "snapkv:window=8,memory=0.2"
    for bad in ("snapkv:memory=0", "snapkv:memory=2", "snapkv:memory=x", "snapkv:memory=0.2,kv_bits=4"):
        with pytest.raises(KVBudgetError, match="memory must be one share"):
            MethodSpec.parse(bad)
    methods = ["full", "snapkv:window=8,memory=0.2"]
    config = EvalConfig(
        tasks=["needle_filler"], lengths=[200], methods=methods, budgets=[40, 70], limit=1, model="t"
    )
    Runner(config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(True), progress=False).run()
    rows = {r["label"]: r for r in load_rows(tmp_path / "results.jsonl")}
    assert set(rows) == set(methods)  # the byte budget runs once, not at each of the budgets
    row = rows["snapkv:window=8,memory=0.2"]
    assert row["error"] is None and row["memory"] == 0.2
    chosen = row["byte_budget"]
    assert chosen["stored_bytes"] <= chosen["target_bytes"] == int(0.2 * rows["full"]["logical_bytes"])


def test_eval_memories_add_a_byte_budget_row_per_compressing_method(tmp_path):
    from typer.testing import CliRunner

    from kvbudget.cli import app
    from kvbudget.cli.evaluation import _under_memories

    assert _under_memories(["full", "snapkv:window=8", "kvzip", "h2o:kv_bits=4"], [0.25, 0.125]) == [
        "snapkv:window=8,memory=0.25", "snapkv:window=8,memory=0.125",
        "kvzip:memory=0.25", "kvzip:memory=0.125",
    ]  # fmt: skip
    for bad in ("0", "1.5"):
        result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path / "x"), "--memories", bad])
        assert result.exit_code == 2 and "memory must be a fraction" in result.output
        assert len(result.output.strip().splitlines()) == 1
