"""bf16 linear layers through fp32 on CPUs without a native bf16 GEMM (kvbudget.cpu_matmul)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import tiny_model, tiny_tokenizer
from kvbudget import cpu_matmul
from kvbudget.cpu_matmul import MIN_ROWS, Fp32MatmulLinear, apply_bf16_matmul, use_fp32_matmul
from kvbudget.errors import InputError
from kvbudget.models import load_model

CPU = torch.device("cpu")


def bf16_layer(rows_in: int = 48, out: int = 24, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(rows_in, out, bias=bias, device=CPU).to(torch.bfloat16)


def reference(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """The rule written out: every product and sum in fp32 from the bf16 values, rounded once."""
    y = torch.matmul(x.double(), layer.weight.double().t())  # exact enough to round to bf16 alike
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.to(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("bias", [True, False])
def test_fp32_path_is_the_rounded_fp32_product_of_the_bf16_operands(bias: bool) -> None:
    layer = bf16_layer(bias=bias)
    x = torch.randn(2, MIN_ROWS, 48, device=CPU).to(torch.bfloat16)
    native = layer(x)
    use_fp32_matmul(layer)
    assert type(layer) is Fp32MatmulLinear
    got = layer(x)
    assert got.dtype is torch.bfloat16 and got.shape == (2, MIN_ROWS, 24)
    want = reference(x, layer)
    # fp32 sums in another order than the float64 reference: at most one bf16 step apart
    assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    assert torch.allclose(got.float(), native.float(), rtol=2**-7, atol=1e-6)


def test_fewer_rows_than_the_threshold_take_the_native_kernel() -> None:
    layer = bf16_layer()
    x = torch.randn(MIN_ROWS - 1, 48, device=CPU).to(torch.bfloat16)
    native = layer(x)
    use_fp32_matmul(layer)
    assert torch.equal(layer(x), native)


def test_other_dtypes_are_untouched() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(48, 24, device=CPU)
    x = torch.randn(64, 48, device=CPU)
    native = layer(x)
    use_fp32_matmul(layer)
    assert torch.equal(layer(x), native)


def test_a_model_keeps_its_parameters_ties_and_keys_and_computes_alike() -> None:
    model = tiny_model("qwen2").to(device=CPU, dtype=torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    keys = list(model.state_dict())
    params = {name: p.data_ptr() for name, p in model.named_parameters()}
    linears = sum(type(m) is nn.Linear for m in model.modules())
    ids = torch.randint(3, 90, (1, 40), device=CPU)
    with torch.no_grad():
        native = model(ids).logits.float()
    assert use_fp32_matmul(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert list(model.state_dict()) == keys
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == params
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        got = model(ids).logits.float()
    assert torch.allclose(got, native, rtol=0.05, atol=0.05 * native.abs().max().item())
    assert torch.equal(got.argmax(-1), native.argmax(-1))


def test_auto_switches_only_a_bf16_cpu_model_without_a_native_gemm(monkeypatch) -> None:
    monkeypatch.setattr(cpu_matmul, "native_bf16_matmul", lambda: True)
    assert apply_bf16_matmul(tiny_model().to(device=CPU, dtype=torch.bfloat16), "auto") == 0
    monkeypatch.setattr(cpu_matmul, "native_bf16_matmul", lambda: False)
    assert apply_bf16_matmul(tiny_model().to(device=CPU), "auto") == 0  # fp32: nothing to do
    assert apply_bf16_matmul(tiny_model().to(device=CPU, dtype=torch.bfloat16), "auto") > 0
    assert apply_bf16_matmul(tiny_model().to(device=CPU, dtype=torch.bfloat16), "native") == 0
    monkeypatch.setattr(cpu_matmul, "native_bf16_matmul", lambda: True)
    assert apply_bf16_matmul(tiny_model().to(device=CPU, dtype=torch.bfloat16), "fp32") > 0


def test_load_model_applies_the_choice_and_refuses_an_unknown_one(tmp_path) -> None:
    source = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    model, _ = load_model(source, dtype="bfloat16", device="cpu", bf16_matmul="fp32")
    assert isinstance(model.lm_head, Fp32MatmulLinear)
    model, _ = load_model(source, dtype="bfloat16", device="cpu", bf16_matmul="native")
    assert type(model.lm_head) is nn.Linear
    with pytest.raises(InputError, match="bf16_matmul must be one of auto, native, fp32, got 'fast'"):
        load_model(tmp_path / "missing", bf16_matmul="fast")  # refused before the source is looked at


def test_the_kvpress_side_computes_exactly_as_kvbudget_does() -> None:
    """The peer script imports nothing from kvbudget, so it carries its own copy of the rule."""
    from kvbudget.peer import kvpress_runner

    assert kvpress_runner.FP32_MATMUL_MIN_ROWS == MIN_ROWS
    ours, theirs = bf16_layer(), bf16_layer()
    use_fp32_matmul(ours)
    theirs.__class__ = kvpress_runner.Fp32MatmulLinear
    for rows in (1, MIN_ROWS - 1, MIN_ROWS, 100):
        x = torch.randn(rows, 48, device=CPU).to(torch.bfloat16)
        assert torch.equal(ours(x), theirs(x))
    model = tiny_model().to(device=CPU, dtype=torch.bfloat16)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert kvpress_runner.match_bf16_matmul(model) == (0 if cpu_matmul.native_bf16_matmul() else linears)
