"""Papers' comparison presets (``method@preset``): each builds the paper's numbers, explicit options win.

Expected values are written here from the papers' text, not read back from ``PRESETS``.
"""

from __future__ import annotations

import pytest

from kvbudget.errors import MethodOptionError, UnknownMethodError
from kvbudget.methods.prune_base import layer_at_fraction
from kvbudget.methods.registry import make_method


# ---------------------------------------------------------------------- asl (ASL paper, App. C.2)
def test_asl_preset_snapkv_is_window_32_kernel_7_average_pooling():
    method = make_method("snapkv@asl")
    # "For 1D average pooling in SnapKV and ASL, window size = 32 and kernel size = 7."
    assert (method.window, method.kernel, method.pooling) == (32, 7, "avg")
    assert method.reduce_heads == "sum"  # authors' compress_kv sums each GQA group
    assert make_method("snapkv").pooling == "max"  # our own default is untouched


def test_asl_preset_fastkv_is_asls_comparison_setting():
    method = make_method("fastkv@asl")
    assert (method.window, method.kernel, method.pooling, method.reduce_heads) == (32, 7, "avg", "sum")
    # "The selection layer for FastKV is 15 for Llama-3.1-8B-UL and 14 for Qwen2.5-7B" (32 and 28 layers)
    assert method.selection_layer_for(32) == 15
    assert method.selection_layer_for(28) == 14
    assert make_method("fastkv").selection_layer_for(28) == 13  # ours without the preset: (L − 1) // 2
    assert method.tsp_len == 0  # the KV budget's worth of tokens, as ASL runs it (select_k = budget)


def test_asl_preset_gemfilter_selects_at_layer_14_of_28():
    method = make_method("gemfilter@asl")
    # "The selection layer for GemFilter is 13 for Llama-3.1-8B-UL and 14 for Qwen2.5-7B."
    assert method.selection_layer_for(28) == 14
    assert make_method("gemfilter").selection_layer_for(28) == 11  # ours without the preset
    assert make_method("gemfilter").selection_layer_for(32) == 13  # the paper's Llama layer
    assert method.kernel == 5  # GemFilter's own pooling is not part of the preset


def test_asl_preset_does_not_cover_other_methods():
    with pytest.raises(UnknownMethodError, match="preset 'asl' has no settings for 'h2o'"):
        make_method("h2o@asl")


@pytest.mark.parametrize(
    ("name", "options", "attr", "expected"),
    [
        ("fastkv@asl", {"window": 8}, "window", 8),
        ("fastkv@asl", {"pooling": "max"}, "pooling", "max"),
        ("snapkv@asl", {"pooling": "max", "kernel": 5}, "kernel", 5),
        ("fastkv@asl", {"tsp_layer_fraction": "0.25"}, "tsp_layer_fraction", 0.25),  # CLI strings
    ],
)
def test_an_explicit_option_overrides_the_asl_preset(name, options, attr, expected):
    assert getattr(make_method(name, **options), attr) == expected


def test_an_explicit_layer_index_overrides_the_preset_fraction():
    assert make_method("fastkv@asl", tsp_layer=15).selection_layer_for(32) == 15
    assert make_method("gemfilter@asl", filter_layer=13).selection_layer_for(32) == 13
    assert make_method("fastkv@asl", tsp_layer_fraction=0.25).selection_layer_for(28) == 7


def test_layer_fraction_maps_to_the_rounded_half_up_layer():
    assert [layer_at_fraction(0.5, n) for n in (28, 32, 31, 4)] == [14, 16, 16, 2]
    assert layer_at_fraction(0.0, 28) == 0 and layer_at_fraction(1.0, 28) == 27  # at most the last


@pytest.mark.parametrize(
    ("name", "option", "value"),
    [("fastkv", "tsp_layer_fraction", 1.5), ("fastkv", "tsp_layer_fraction", -0.5),
     ("gemfilter", "filter_layer_fraction", 2.0), ("gemfilter", "filter_layer_fraction", "half")],
)  # fmt: skip
def test_a_bad_layer_fraction_is_a_one_line_error(name, option, value):
    with pytest.raises(MethodOptionError, match=option) as err:
        make_method(name, **{option: value})
    assert "\n" not in str(err.value)


def test_fastkv_rejects_unknown_pooling_and_gqa_reduction():
    with pytest.raises(MethodOptionError, match="reduce_heads must be mean, sum or max, got 'median'"):
        make_method("fastkv", reduce_heads="median")
    with pytest.raises(MethodOptionError, match="pooling must be max or avg, got 'none'"):
        make_method("fastkv", pooling="none")
