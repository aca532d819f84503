"""kvbudget: KV-cache compression for Hugging Face transformers LLMs under a memory budget.

Public API: :func:`generate`, :func:`compress`, :func:`load_model`, :func:`attach` /
:func:`detach`, :func:`make_method`, :func:`method_names`, :class:`BudgetCache`, and for
``model.generate`` users :class:`CompressingCache` and :func:`answer` (:mod:`kvbudget.native`).
Nothing happens at import time: attention is routed through kvbudget only by ``attach``
(which ``generate`` and ``compress`` call).
"""

from __future__ import annotations

from typing import Any

from kvbudget.version import __version__ as __version__

__all__ = [
    "BudgetCache",
    "CompressingCache",
    "GenerationResult",
    "answer",
    "attach",
    "attached",
    "compress",
    "detach",
    "generate",
    "load_cache",
    "load_model",
    "make_method",
    "method_names",
    "save_cache",
]


def __getattr__(name: str) -> Any:
    """Lazy imports keep ``import kvbudget`` light (torch and transformers load on first use)."""
    if name in ("generate", "compress", "GenerationResult"):
        from kvbudget import engine

        return getattr(engine, name)
    if name in ("attach", "detach", "attached"):
        from kvbudget import attention

        return getattr(attention, name)
    if name in ("CompressingCache", "answer"):
        from kvbudget import native

        return getattr(native, name)
    if name in ("save_cache", "load_cache"):
        from kvbudget import cache_files

        return getattr(cache_files, name)
    if name == "BudgetCache":
        from kvbudget.cache import BudgetCache

        return BudgetCache
    if name in ("make_method", "method_names"):
        from kvbudget.methods import registry

        return getattr(registry, name)
    if name == "load_model":
        from kvbudget.models import load_model

        return load_model
    raise AttributeError(f"module 'kvbudget' has no attribute {name!r}")
