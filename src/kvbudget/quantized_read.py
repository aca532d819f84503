"""A decode step's attention read straight from quantized KV storage, on a CPU (the fused read).

Dequantizing a layer before attention writes every entry back in the model's dtype, then reads it
again: on a 2-core CPU at 32K entries that doubled a decode step (docs/architecture.md "Decode
attention"). The fused read (``kernels/quantized_decode.cpp``, built on first use with
:mod:`torch.utils.cpp_extension`) computes one new token's attention over a head's entries in slot
order, dequantizing each entry into a small fp32 buffer as it goes: scores ``q·k``, softmax and
``Σ p·v`` in fp32, one thread per (batch row, KV head).

No library does this on a CPU: transformers' ``QuantizedCache`` dequantizes the whole layer (quanto,
HQQ), and torch's int4 kernels (``_weight_int4pack_mm_for_cpu``) group a weight's scales along its
input axis, which is KIVI's axis for neither keys (per channel, over tokens) nor values (per
token, over channels).

What it reads: a head stored as :class:`~kvbudget.quantized_store.QuantizedHead`,
:class:`~kvbudget.quantized_store.TieredHead`, or a shared document's
:class:`~kvbudget.shared_prefix.SharedHead`, flattened into segments (:func:`segments`). Where the
kernel cannot be built (no C++ compiler), :func:`fused_decode` returns ``None`` after one warning
and attention dequantizes as before. The numbers differ from dequantize-then-SDPA only in rounding:
the kernel rounds nothing to the model's dtype (tests/test_quantized_read.py holds both to a
reference in float64).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvbudget.artifacts import file_lock
from kvbudget.quantized_store import QuantizedHead, TieredHead
from kvbudget.shared_prefix import PlainHead, SharedHead

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "quantized_decode.cpp"

#: ``KVBUDGET_FUSED_READ=0`` turns the fused read off (attention dequantizes the layer instead)
ENV_SWITCH = "KVBUDGET_FUSED_READ"

_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None


def _cpu_flags() -> list[str]:
    """Compiler flags for the vector instructions torch itself uses on this CPU (not
    ``-march=native``: a build directory shared by machines stays valid for each)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    if capability == "AVX2":
        return ["-mavx2", "-mfma"]
    return []


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """The ninja wheel's binary on ``PATH`` while torch builds (it runs ``ninja`` from ``PATH``),
    where no ninja is there already; ``PATH`` restored afterwards."""
    before = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{before}"
        except ImportError:
            pass
    try:
        yield
    finally:
        os.environ["PATH"] = before


def _flags() -> list[str]:
    return ["-O3", "-ffast-math", "-fopenmp", *_cpu_flags()]


def _build_name(flags: Sequence[str]) -> str:
    """The extension's name, one per source, flags, torch and interpreter: two virtual
    environments on one machine (each with its own torch headers) never rebuild each other's copy."""
    identity = "\n".join([SOURCE.read_text(), " ".join(flags), torch.__version__, sys.executable])
    return f"kvbudget_quantized_decode_{hashlib.sha256(identity.encode()).hexdigest()[:10]}"


def _build() -> ModuleType:
    """Builds (or loads the cached build of) the kernel under torch's extension root.

    torch serializes builds of one extension with a ``lock`` file in its build directory that
    a killed build leaves behind, after which every later build waits for it forever. The build is
    serialized here with an ``flock`` instead (released when its holder dies), and under it a
    leftover ``lock`` file can only be a dead build's: it is removed."""
    from torch.utils import cpp_extension

    flags = _flags()
    name = _build_name(flags)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_directory = Path(root) / name
    build_directory.mkdir(parents=True, exist_ok=True)
    with file_lock(build_directory.parent / f".{name}.lock"):
        (build_directory / "lock").unlink(missing_ok=True)
        with _ninja_on_path():
            return cpp_extension.load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_directory),
                verbose=False,
            )


def kernel() -> ModuleType | None:
    """The built kernel module, building it on the first call; ``None`` where it cannot be built
    (the reason logged once as a warning) or is switched off (``KVBUDGET_FUSED_READ=0``)."""
    global _module, _failed
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            start = time.perf_counter()
            try:
                _module = _build()
                seconds = time.perf_counter() - start
                if seconds > 5:  # compiled now, not loaded from torch's extension cache
                    log.info("built the fused quantized read's kernel in %.0f s (once per machine)", seconds)
            except Exception as error:  # no compiler, no ninja, a failed build: dequantize instead
                last = str(error).strip().splitlines()[-1:] or [""]
                _failed = f"{type(error).__name__}: {last[0]}"
                log.warning(
                    "kvbudget: the fused quantized read could not be built (%s); attention "
                    "dequantizes quantized layers instead (slower decoding)",
                    _failed,
                )
    return _module


def segments(head: Any) -> list[tuple[int, list[torch.Tensor]]]:
    """A head's entries in slot order as ``(bits, tensors)`` segments: ``(16, [keys, values])``
    (``[b, m, d]``) or ``(bits, [key_codes, key_scale, key_min, key_group, value_codes,
    value_scale, value_min])`` (:class:`QuantizedHead`'s fields). Empty segments are left out."""
    if isinstance(head, TieredHead):
        return segments(head.high) + segments(head.low)
    if isinstance(head, QuantizedHead):
        out: list[tuple[int, list[torch.Tensor]]] = []
        if head.quantized_entries:
            out.append((head.bits, [
                head.key_codes, head.key_scale, head.key_min, head.key_group,
                head.value_codes, head.value_scale, head.value_min,
            ]))  # fmt: skip
        if head.tail_keys.shape[1]:
            out.append((16, [head.tail_keys, head.tail_values]))
        return out
    if isinstance(head, SharedHead):  # a shared document's prefix, then the conversation's own entries
        return segments(head.prefix) + segments(head.own)
    if isinstance(head, PlainHead):  # a shared document's entries in the model's dtype
        return [(16, [head.keys, head.values])] if head.keys.shape[1] else []
    raise TypeError(f"no segments for {type(head).__name__}")


def fused_decode(query: torch.Tensor, heads: Sequence[Any], scaling: float) -> torch.Tensor | None:
    """One new token's attention over quantized heads, or ``None`` where the fused read does not
    apply (not a CPU, a model dtype the kernel does not read, or no kernel).

    Args:
        query: ``[b, q_heads, 1, d]`` post-RoPE queries; ``heads``: the layer's KV heads (each
            ``[b, n_h, d]`` entries, every entry visible: no mask is applied).
    Returns:
        ``[b, q_heads, 1, d_v]`` in the query's dtype.
    """
    if query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    module = kernel()
    if module is None:
        return None
    b, q_heads, _, d = query.shape
    flat = [segments(h) for h in heads]
    dtypes = {t[1 if bits < 16 else 0].dtype for head in flat for bits, t in head}
    if len(dtypes) > 1 or any(not head for head in flat):
        return None
    rows = query.float().reshape(b, len(heads), q_heads // len(heads), d).contiguous()
    dv = heads[0].tail_values.shape[-1]
    out = module.quantized_decode(
        rows,
        [[[t.contiguous() for t in tensors] for _, tensors in head] for head in flat],
        [[bits for bits, _ in head] for head in flat],
        dv,
        float(scaling),
    )
    return out.reshape(b, q_heads, 1, dv).to(query.dtype)
