"""The kvbudget attention hook is exact when nothing is compressed (vs plain sdpa, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvbudget
from conftest import seeded, tiny_model
from kvbudget.cache import BudgetCache


def _logits(model, ids, mask=None, cache=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, past_key_values=cache, use_cache=cache is not None).logits


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_hook_equals_sdpa_without_compression(kind):
    model = tiny_model(kind)
    ids = torch.randint(3, 90, (2, 64), generator=seeded(0))
    reference = _logits(model, ids)
    with kvbudget.attached(model):
        no_cache = _logits(model, ids)
        budget_cache = _logits(model, ids, cache=BudgetCache(model.config.num_hidden_layers))
        dynamic_cache = _logits(model, ids, cache=DynamicCache())
    for out in (no_cache, budget_cache, dynamic_cache):
        assert torch.allclose(out, reference, atol=1e-5), (out - reference).abs().max()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hook_equals_sdpa_with_left_padding_and_chunked_prefill(kind):
    model = tiny_model(kind)
    ids = torch.randint(3, 90, (2, 48), generator=seeded(1))
    mask = torch.ones_like(ids)
    mask[1, :11] = 0  # row 1 is left-padded
    reference = _logits(model, ids, mask)
    with kvbudget.attached(model):
        cache = BudgetCache(model.config.num_hidden_layers)
        first = _logits(model, ids[:, :30], mask[:, :30], cache)  # prefill in two chunks
        second = _logits(model, ids[:, 30:], mask, cache)
        dynamic = DynamicCache()
        _logits(model, ids[:, :30], mask[:, :30], dynamic)
        second_dynamic = _logits(model, ids[:, 30:], mask, dynamic)
    chunked = torch.cat([first, second], dim=1)
    real = mask.bool()
    assert torch.allclose(chunked[real], reference[real], atol=1e-5), (chunked - reference)[real].abs().max()
    assert torch.allclose(second_dynamic[real[:, 30:]], reference[:, 30:][real[:, 30:]], atol=1e-5)
    assert cache.get_seq_length() == 48
    assert int(cache.stats().entries[0, 0]) == 48 + 37  # pads are not entries


@pytest.mark.integration
def test_hook_equals_sdpa_on_the_real_model(real_model):
    model, tokenizer = real_model
    kvbudget.detach(model)
    ids = torch.tensor([tokenizer("The quick brown fox jumps over the lazy dog. " * 40)["input_ids"]])
    reference = _logits(model, ids)
    with kvbudget.attached(model):
        out = _logits(model, ids, cache=BudgetCache(model.config.num_hidden_layers))
    assert torch.allclose(out, reference, atol=1e-5), (out - reference).abs().max()


def test_decode_sized_attention_on_cuda_leaves_cudnn_out():
    """cuDNN's SDPA backend builds a graph per key length: off for decode-sized calls on CUDA only."""
    from kvbudget.attention import DECODE_QUERIES, leaves_cudnn_out

    cuda = torch.device("cuda")  # a device object; no GPU needed
    assert leaves_cudnn_out(cuda, 1, 300)  # a decode step
    assert leaves_cudnn_out(cuda, DECODE_QUERIES, 300)
    assert not leaves_cudnn_out(cuda, DECODE_QUERIES + 1, 300)  # a question: math would not fit
    assert not leaves_cudnn_out(cuda, 300, 300)  # a prefill
    assert not leaves_cudnn_out(torch.device("cpu"), 1, 300)


def test_turning_cudnn_sdpa_off_keeps_the_other_choices_and_restores_it():
    from kvbudget.attention import _cudnn_sdpa_off

    cuda = torch.backends.cuda
    assert cuda.cudnn_sdp_enabled()
    cuda.enable_flash_sdp(False)
    try:
        with _cudnn_sdpa_off():
            assert not cuda.cudnn_sdp_enabled()
            assert not cuda.flash_sdp_enabled() and cuda.math_sdp_enabled()  # the user's choices stay
        assert cuda.cudnn_sdp_enabled()
        with pytest.raises(RuntimeError), _cudnn_sdpa_off():
            raise RuntimeError("inside")
        assert cuda.cudnn_sdp_enabled()  # restored after an error too
        for enable in (cuda.enable_mem_efficient_sdp, cuda.enable_math_sdp):
            enable(False)
        with _cudnn_sdpa_off():  # cuDNN is the only backend left on: it stays on
            assert cuda.cudnn_sdp_enabled()
    finally:
        for enable in (cuda.enable_flash_sdp, cuda.enable_mem_efficient_sdp, cuda.enable_math_sdp):
            enable(True)


@pytest.mark.parametrize("method", ["full", "ada-snapkv"])  # one rectangular layer, one per head
def test_a_one_token_step_equals_attention_by_hand_over_each_heads_entries(method):
    """The one-token step's grouped layout (each KV head's query group as the rows of one query,
    kvbudget.attention._grouped_step) against softmax attention written out per query head: a
    left-padded batch whose padding slots are invalid (the full cache keeps them), and a
    compressed one whose heads keep different entries."""
    from kvbudget.attention import attend_layer

    model = tiny_model("qwen2")  # 4 query heads on 2 KV heads
    ids = torch.randint(3, 90, (2, 90), generator=seeded(3))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    cache = kvbudget.compress(model, ids, method, budget=48, attention_mask=mask)
    layer = cache.layers[1]
    assert layer.has_invalid if method == "full" else layer.is_ragged
    q_heads = model.config.num_attention_heads
    d = model.config.hidden_size // q_heads
    query = torch.randn((2, q_heads, 1, d), generator=seeded(4))
    out = attend_layer(query, layer, d**-0.5)
    group = q_heads // layer.num_heads
    for h in range(layer.num_heads):
        keys, values, positions = layer.head(h)
        for r in range(2):
            visible = positions[r] >= 0
            visible[-1] = True  # a step's own token (the last entry) always sees itself
            for qh in range(h * group, (h + 1) * group):
                logits = (keys[r].double() @ query[r, qh, 0].double()) * d**-0.5
                p = torch.softmax(logits.masked_fill(~visible, float("-inf")), 0)
                want = p @ values[r].double()
                torch.testing.assert_close(out[r, qh, 0].double(), want, atol=1e-5, rtol=1e-5)
