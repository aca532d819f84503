"""bf16 linear layers on CPUs without a native bf16 matrix multiply.

On an x86 CPU without AVX-512 (AVX2 only: AMD Zen 2/3, most client Intel parts), oneDNN declines
bf16 GEMMs and PyTorch runs a reference kernel: a bf16 ``nn.Linear`` then takes 5-8× an fp32 one
(a ``[2094, 896] × [896, 4864]`` product: 1,012 ms in bf16, 138 ms in fp32 on a 2-core AMD EPYC,
torch 2.13), and a bf16 prefill of qwen2.5-coder-0.5b at 2,094 tokens 86 s against 17 s through fp32.

There a bf16 model's linear layers can compute in fp32 from their bf16 operands and round the
result to bf16 (:class:`Fp32MatmulLinear`). A product of two bf16 numbers is exact in fp32, and a
native bf16 GEMM also accumulates in fp32 and rounds its output to bf16, so the two differ only in
the order of the sums: the last bits, as two machines' native kernels do. Weights, activations and
the KV cache stay bf16; the fp32 copy of one weight lives only during its layer's call. Converting
the weight costs more than the reference kernel saves below :data:`MIN_ROWS` rows (a decode step's
token: ``[1, 896] × [896, 4864]`` 0.8 ms native, 3.1 ms through fp32; at 32 rows 14.6 against 8.1;
at 2,094 rows 1,012 against 134), so fewer rows take the native kernel.

:func:`use_fp32_matmul` switches one model instance's ``nn.Linear`` modules (their class, in place:
parameters, tied weights, hooks and state-dict keys are untouched); nothing global changes.
:func:`kvbudget.load_model` applies it by default where :func:`native_bf16_matmul` is false
(``bf16_matmul="auto"``). The kvpress peer script (:mod:`kvbudget.peer.kvpress_runner`, which
imports nothing from kvbudget) applies the same rule to kvpress's model, so both sides of a
comparison compute alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbudget.errors import InputError

#: the fewest rows (tokens × batch) a linear layer's input needs to take the fp32 path (measured above)
MIN_ROWS = 32
#: ``load_model``'s choices: the rule below, PyTorch's own kernel, or fp32 products always.
BF16_MATMUL_MODES = ("auto", "native", "fp32")


def native_bf16_matmul() -> bool:
    """Whether this CPU has a fast bf16 GEMM (oneDNN supports bf16 here: AVX-512 or AMX).

    PyTorch's own test of that (``torch.ops.mkldnn._is_mkldnn_bf16_supported``, a private op; where a
    build lacks it, the CPU capability: AVX-512 or better counts as native).
    """
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "SVE"))


class Fp32MatmulLinear(nn.Linear):
    """``nn.Linear`` that, for bf16 input and weight on the CPU with at least :data:`MIN_ROWS` rows,
    computes ``x W^T + b`` in fp32 and rounds to bf16: ``F.linear(x.float(), W.float(),
    b.float()).bfloat16()``; x: ``[..., in]`` → ``[..., out]``. Anything else runs ``nn.Linear``'s own
    forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype is torch.bfloat16
            and self.weight.dtype is torch.bfloat16
            and x.device.type == "cpu"
            and x.numel() >= MIN_ROWS * self.in_features
        ):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(torch.bfloat16)
        return super().forward(x)


def use_fp32_matmul(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` an :class:`Fp32MatmulLinear` (in place); returns
    how many were switched. Subclasses of ``nn.Linear`` (a library's own layers) are left alone."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Fp32MatmulLinear
            switched += 1
    return switched


def check_bf16_matmul(mode: str) -> None:
    """Refuse a ``bf16_matmul`` outside :data:`BF16_MATMUL_MODES` in one line."""
    if mode not in BF16_MATMUL_MODES:
        raise InputError(f"bf16_matmul must be one of {', '.join(BF16_MATMUL_MODES)}, got {mode!r}")


def apply_bf16_matmul(model: nn.Module, mode: str) -> int:
    """``load_model``'s step: switch ``model``'s linear layers when ``mode`` asks (``fp32``) or when
    ``auto`` and the model is bf16 on a CPU without :func:`native_bf16_matmul`; returns how many."""
    check_bf16_matmul(mode)
    if mode == "native":
        return 0
    if mode == "auto":
        param = next(model.parameters(), None)
        if param is None or param.dtype is not torch.bfloat16 or param.device.type != "cpu":
            return 0
        if native_bf16_matmul():
            return 0
    return use_fp32_matmul(model)
