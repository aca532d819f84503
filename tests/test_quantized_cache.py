"""Quantized storage in the cache (``kv_bits``): one KV head's store (kvbudget.quantized_store)
against KIVI's formulas written as loops, the bytes it allocates against a hand count, and the
cache with it through every entry point (generate, compress, CompressingCache, answer, methods).

The tiny models run in float32, so the stored scales and minima are exact fp32 numbers and the
reference needs no rounding of its own.
"""

from __future__ import annotations

import pytest
import torch

import kvbudget
from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.cache import BudgetCache
from kvbudget.errors import KVBudgetError
from kvbudget.methods.spec import MethodSpec
from kvbudget.quantized_store import QuantizedHead
from method_matrix import ALL_METHODS, small
from test_native import CONTEXT, QUESTION, QUESTIONS, _hf_generate, _prompt_ids


# ---------------------------------------------------------------------------------- the reference
def kivi_roundtrip(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> torch.Tensor:
    """KIVI's asymmetric quantization and back, by loops: ``x: [n, d]``; keys per channel over
    ``group`` consecutive tokens, values per token over ``group`` consecutive channels."""
    out = torch.empty_like(x)
    levels = 2**bits - 1
    n, d = x.shape
    cells = (
        [(slice(t, t + group), slice(c, c + 1)) for t in range(0, n, group) for c in range(d)]
        if per_channel
        else [(slice(t, t + 1), slice(c, c + group)) for t in range(n) for c in range(0, d, group)]
    )
    for rows, cols in cells:
        block = x[rows, cols]
        low, high = float(block.min()), float(block.max())
        step = (high - low) / levels
        if step == 0:
            out[rows, cols] = low
            continue
        codes = torch.clamp(torch.round((block - low) / step), 0, levels)
        out[rows, cols] = codes * step + low
    return out


def reference_head(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int):
    """What a head holding ``keys/values: [n, d]`` reads back: whole groups of ``group`` tokens
    quantized, the last ``n mod group`` exact."""
    whole = keys.shape[0] // group * group
    vgroup = group if keys.shape[1] % group == 0 else keys.shape[1]
    k = torch.cat([kivi_roundtrip(keys[:whole], bits, group, True), keys[whole:]])
    v = torch.cat([kivi_roundtrip(values[:whole], bits, vgroup, False), values[whole:]])
    return k, v


def _random(b: int, n: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn((b, n, d), generator=seeded(seed)) * torch.linspace(0.5, 4.0, d)


# ---------------------------------------------------------------------------------- one head
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_whole_groups_read_back_as_kivis_formulas(bits):
    keys, values = _random(2, 70, 16, 0), _random(2, 70, 16, 1)
    head = QuantizedHead.from_full(keys, values, bits, group=8)
    assert head.quantized_entries == 64 and head.length == 70
    k, v = head.dequantize()
    for r in range(2):
        ref_k, ref_v = reference_head(keys[r], values[r], bits, 8)
        torch.testing.assert_close(k[r], ref_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[r], ref_v, atol=1e-5, rtol=1e-5)
    assert k[:, 64:].equal(keys[:, 64:]) and v[:, 64:].equal(values[:, 64:])  # the tail is exact


def test_decode_steps_fill_the_tail_then_quantize_it_as_one_group():
    keys, values = _random(1, 29, 16, 2), _random(1, 29, 16, 3)
    head = QuantizedHead.from_full(keys[:, :5], values[:, :5], 4, group=8)
    for t in range(5, 29):
        head = head.append(keys[:, t : t + 1], values[:, t : t + 1])
        assert head.quantized_entries == (t + 1) // 8 * 8 and head.tail_keys.shape[1] == (t + 1) % 8
    at_once = QuantizedHead.from_full(keys, values, 4, group=8)
    for got, want in zip(head.dequantize(), at_once.dequantize(), strict=True):
        assert got.equal(want)


def test_a_gather_keeps_codes_and_drops_unused_scale_rows():
    keys, values = _random(2, 64, 16, 4), _random(2, 64, 16, 5)
    head = QuantizedHead.from_full(keys, values, 4, group=8)  # 8 key groups, no tail
    before_k, before_v = head.dequantize()
    idx = torch.tensor([[1, 3, 9, 12, 60], [0, 2, 8, 15, 63]])  # groups 0, 1, 7 only
    taken = head.take(idx)
    k, v = taken.dequantize()
    assert k.equal(torch.stack([before_k[r, idx[r]] for r in range(2)]))
    assert v.equal(torch.stack([before_v[r, idx[r]] for r in range(2)]))
    assert taken.key_scale.shape[1] == 3  # the five other groups' rows went
    assert taken.nbytes < head.nbytes


def test_a_gather_that_splits_rows_differently_reads_back_the_same_values():
    keys, values = _random(2, 20, 16, 6), _random(2, 20, 16, 7)
    head = QuantizedHead.from_full(keys, values, 4, group=8)  # 16 quantized, 4 in the tail
    before_k, before_v = head.dequantize()
    idx = torch.tensor([[2, 17, 18, 19], [3, 5, 9, 16]])  # row 0: one quantized entry, row 1: three
    taken = head.take(idx)
    assert taken.quantized_entries == 1 and taken.tail_keys.shape[1] == 3
    k, v = taken.dequantize()
    assert k.equal(torch.stack([before_k[r, idx[r]] for r in range(2)]))
    assert v.equal(torch.stack([before_v[r, idx[r]] for r in range(2)]))


def test_rewriting_entries_requantizes_only_what_changed():
    keys, values = _random(1, 32, 16, 8), _random(1, 32, 16, 9)
    head = QuantizedHead.from_full(keys, values, 4, group=8)
    k, v = head.dequantize()
    new_k, new_v = k.clone(), v.clone()
    new_v[0, 5] = values[0, 20] * 3  # a merge into entry 5's value
    new_k[0, 11] = keys[0, 11] + 2  # and into entry 11's key (group 1: entries 8..15)
    rewritten = head.replaced(new_k, new_v)
    k2, v2 = rewritten.dequantize()
    others = [i for i in range(32) if i != 5]
    assert v2[0, others].equal(v[0, others])
    assert torch.allclose(v2[0, 5], kivi_roundtrip(new_v[0, 5:6], 4, 8, False)[0], atol=1e-5)
    outside = [i for i in range(32) if not 8 <= i < 16]
    assert k2[0, outside].equal(k[0, outside])
    torch.testing.assert_close(k2[0, 8:16], kivi_roundtrip(new_k[0, 8:16], 4, 8, True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bytes_are_counted_by_hand(bits):
    b, n, d = 2, 45, 16
    head = QuantizedHead.from_full(_random(b, n, d, 10), _random(b, n, d, 11), bits, group=8)
    q, tail, groups = 40, 5, 5
    codes = 2 * b * q * d * bits // 8
    key_scales = 2 * b * groups * d * 4  # scale and minimum, fp32
    key_groups = b * q * 2  # int16
    value_scales = 2 * b * q * (d // 8) * 4
    assert head.nbytes == codes + key_scales + key_groups + value_scales + 2 * b * tail * d * 4


# ---------------------------------------------------------------------------------- the cache
def test_kv_bits_16_or_none_changes_nothing(llama, tokenizer):
    runs = [
        kvbudget.generate(
            llama,
            tokenizer,
            CONTEXT,
            QUESTION,
            method=small("snapkv"),
            budget=40,
            max_new_tokens=12,
            kv_bits=bits,
        )  # fmt: skip
        for bits in (None, 16)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].cache_stats_after.as_dict() == runs[1].cache_stats_after.as_dict()


@pytest.mark.parametrize("name", ["snapkv", "ada-snapkv", "full"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_decode_step_attends_over_what_kivi_reads_back(name, bits):
    """The next token's logits over a quantized cache equal those over the same cache in full
    precision with each head's entries replaced by the loop reference's read-back."""
    model = tiny_model("llama")
    ids = torch.randint(3, 90, (1, 90), generator=seeded(3))
    quantized = kvbudget.compress(model, ids[:, :-1], method=small(name), budget=70, kv_bits=bits)
    exact = kvbudget.compress(model, ids[:, :-1], method=small(name), budget=70)
    for layer, q_layer in zip(exact.layers, quantized.layers, strict=True):
        assert q_layer.quant is not None and all(h.bits == bits for h in q_layer.quant)
        heads = [layer.head(h) for h in range(layer.num_heads)]
        replaced = [reference_head(k[0], v[0], bits, 32) for k, v, _ in heads]
        if layer.is_ragged:
            layer.head_keys = [k[None] for k, _ in replaced]
            layer.head_values = [v[None] for _, v in replaced]
        else:
            layer.keys = torch.stack([k for k, _ in replaced])[None]
            layer.values = torch.stack([v for _, v in replaced])[None]
    with torch.no_grad():
        got = model(ids[:, -1:], past_key_values=quantized).logits[0, -1]
        want = model(ids[:, -1:], past_key_values=exact).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_physical_bytes_are_the_quantized_storage(llama, tokenizer):
    run = kvbudget.generate(llama, tokenizer, CONTEXT, QUESTION, method=small("ada-snapkv"), budget=40,
                            max_new_tokens=8, kv_bits=4, return_cache=True)  # fmt: skip
    d = llama.config.hidden_size // llama.config.num_attention_heads
    total = 0  # fp32 scales; 16 channels make one value group; int16 key groups
    for layer in run.cache.layers:
        for head in layer.quant:
            q, t, g = head.quantized_entries, head.tail_keys.shape[1], head.key_scale.shape[1]
            total += 2 * q * d // 2 + 2 * g * d * 4 + q * 2 + 2 * q * 1 * 4 + 2 * t * d * 4
    assert run.cache.physical_bytes() == total == run.cache.stats().physical_bytes
    assert run.cache.stats().as_dict()["kv_bits"] == 4
    full = kvbudget.generate(llama, tokenizer, CONTEXT, QUESTION, method=small("ada-snapkv"), budget=40,
                             max_new_tokens=1)  # fmt: skip
    assert run.cache_stats_after.physical_bytes < full.cache_stats_after.physical_bytes / 2  # fp32 → 4 bits


@pytest.mark.parametrize("name", ALL_METHODS)
def test_every_method_runs_with_4_bit_storage(name, llama, chat_tokenizer):
    run = kvbudget.generate(llama, chat_tokenizer, CONTEXT, QUESTION, method=small(name), budget=40,
                            max_new_tokens=12, kv_bits=4, return_cache=True)  # fmt: skip
    assert run.token_ids
    layers = [layer for layer in run.cache.layers if layer.is_initialized]
    assert layers and all(layer.quant is not None for layer in layers)
    assert all(head.bits == 4 for layer in layers for head in layer.quant)


@pytest.mark.parametrize("name", ALL_METHODS)
def test_layers_quantized_during_the_prefill_store_what_quantizing_after_it_stores(
    name, llama, chat_tokenizer, monkeypatch
):
    """A method that never reads a layer again once the next is prefilled has each layer quantized
    then (one layer in full precision at the prefill's peak, not all): the same stored entries and
    tokens as quantizing every layer once the prefill is done, at a lower peak."""

    def run(early: bool):
        monkeypatch.setattr(BudgetCache, "quantize_early", early)
        return kvbudget.generate(llama, chat_tokenizer, CONTEXT, QUESTION, method=small(name), budget=40,
                                 max_new_tokens=6, kv_bits=4, return_cache=True)  # fmt: skip

    late, early = run(False), run(True)
    assert early.token_ids == late.token_ids
    for mine, theirs in zip(early.cache.layers, late.cache.layers, strict=True):
        for a, b in zip(mine.quant or [], theirs.quant or [], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a.dequantize(), b.dequantize(), strict=True))
    if small(name).quantizes_during_prefill:
        assert early.cache.peak_physical_bytes < late.cache.peak_physical_bytes
    else:
        assert early.cache.peak_physical_bytes == late.cache.peak_physical_bytes


def test_compressing_cache_in_generate_equals_kvbudget_generate(llama, tokenizer):
    for name in ("snapkv", "h2o", "d2o"):
        reference = kvbudget.generate(llama, tokenizer, CONTEXT, QUESTION, method=small(name), budget=40,
                                      max_new_tokens=20, kv_bits=4)  # fmt: skip
        with kvbudget.CompressingCache(llama, small(name), budget=40, kv_bits=4) as cache:
            [generated] = _hf_generate(llama, tokenizer, _prompt_ids(tokenizer), cache)
        assert generated == reference.token_ids, name
        assert all(layer.quant is not None for layer in cache.layers)


def test_answer_equals_question_agnostic_generate_at_4_bits(llama, tokenizer):
    answers = kvbudget.answer(llama, tokenizer, CONTEXT, QUESTIONS, method=small("snapkv"), budget=40,
                              max_new_tokens=12, kv_bits=4)  # fmt: skip
    separately = [
        kvbudget.generate(
            llama,
            tokenizer,
            CONTEXT,
            q,
            method=small("snapkv"),
            budget=40,
            max_new_tokens=12,
            compress_context_only=True,
            kv_bits=4,
        ).text  # fmt: skip
        for q in QUESTIONS
    ]
    assert answers == separately


def test_sequences_at_different_precisions_interleave_on_one_method_object(llama):
    method = small("h2o")  # decode-stage: its run state lives in each cache's session
    ids = torch.randint(3, 90, (1, 100), generator=seeded(4))
    steps = torch.randint(3, 90, (1, 8), generator=seeded(5))

    def logits_alone(bits):
        cache = kvbudget.compress(llama, ids, method=method, budget=70, kv_bits=bits)
        return [llama(steps[:, i : i + 1], past_key_values=cache).logits[0, -1] for i in range(8)]

    with torch.no_grad():
        alone = {bits: logits_alone(bits) for bits in (4, 8)}
        caches = {b: kvbudget.compress(llama, ids, method=method, budget=70, kv_bits=b) for b in (4, 8)}
        for i in range(8):
            for bits, cache in caches.items():
                got = llama(steps[:, i : i + 1], past_key_values=cache).logits[0, -1]
                assert got.equal(alone[bits][i]), (bits, i)
    assert not alone[4][-1].equal(alone[8][-1])


def test_a_batch_row_without_pads_decodes_as_it_does_alone(llama, tokenizer):
    contexts, questions = [CONTEXT, CONTEXT[:100]], [QUESTION, "and then?"]
    batch = kvbudget.generate(llama, tokenizer, contexts, questions, method=small("snapkv"), ratio=0.4,
                              max_new_tokens=12, kv_bits=4)  # fmt: skip
    alone = kvbudget.generate(llama, tokenizer, CONTEXT, QUESTION, method=small("snapkv"), ratio=0.4,
                              max_new_tokens=12, kv_bits=4)  # fmt: skip
    assert batch[0].token_ids == alone.token_ids
    assert batch[1].token_ids


@pytest.mark.parametrize("bits", [3, 1, 32, True, "4"])
def test_other_bit_widths_are_refused_in_one_line(bits, llama, tokenizer):
    with pytest.raises(KVBudgetError, match="kv_bits must be one of 2, 4, 8 or 16") as err:
        kvbudget.generate(llama, tokenizer, CONTEXT, QUESTION, kv_bits=bits)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------- grids
def test_a_method_spec_carries_kv_bits_apart_from_the_methods_options():
    spec = MethodSpec.parse("snapkv:window=8,kv_bits=4")
    assert spec.options == (("window", "8"),) and spec.kv_bits == 4
    assert spec.label == "snapkv:window=8,kv_bits=4"
    assert MethodSpec.parse("snapkv:kv_bits=16") == MethodSpec.parse("snapkv")
    with pytest.raises(KVBudgetError, match="kv_bits must be one of 2, 4, 8 or 16"):
        MethodSpec.parse("snapkv:kv_bits=3")


def test_eval_runs_each_method_at_each_precision(tmp_path):
    from typer.testing import CliRunner

    from kvbudget.cli import app
    from kvbudget.cli.evaluation import _at_precisions
    from kvbudget.eval.runner import EvalConfig, Runner
    from kvbudget.eval.store import load_rows

    methods = _at_precisions(["full", "snapkv:window=8"], [4, 16])
    assert methods == ["full:kv_bits=4", "full", "snapkv:window=8,kv_bits=4", "snapkv:window=8"]
    config = EvalConfig(
        tasks=["needle_filler"], lengths=[200], methods=methods, budgets=[70], limit=1, model="tiny"
    )
    Runner(config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(True), progress=False).run()
    rows = {r["label"]: r for r in load_rows(tmp_path / "results.jsonl")}
    assert set(rows) == {"full", "full:kv_bits=4", "snapkv:window=8", "snapkv:window=8,kv_bits=4"}
    assert all(r["error"] is None for r in rows.values())
    assert [rows[label]["kv_bits"] for label in ("full", "full:kv_bits=4")] == [16, 4]
    for label in ("full", "snapkv:window=8"):
        assert (
            rows[label + (":" if label == "full" else ",") + "kv_bits=4"]["physical_bytes"]
            < rows[label]["physical_bytes"] / 2
        )
    assert len({r["key"] for r in rows.values()}) == 4
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path / "x"), "--kv-bits", "4,3"])
    assert result.exit_code == 2 and "kv_bits must be one of 2, 4, 8 or 16" in result.output


def test_the_cli_refuses_other_bit_widths_before_loading_a_model(tmp_path):
    from typer.testing import CliRunner

    from kvbudget.cli import app

    context = tmp_path / "context.txt"
    context.write_text("a context " * 20, encoding="utf-8")
    for command in (["generate", "--context-file", str(context)], ["serve"]):
        result = CliRunner().invoke(app, [*command, "--kv-bits", "5", "--model", "no-such-model"])
        assert result.exit_code == 2, result.output
        assert "kv_bits must be one of 2, 4, 8 or 16, got 5" in result.output
