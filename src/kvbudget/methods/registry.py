"""The method registry: names → method classes, and ``make_method``."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvbudget.errors import UnknownMethodError
from kvbudget.methods.ada_pyramidkv import AdaPyramidKV
from kvbudget.methods.ada_snapkv import AdaSnapKV
from kvbudget.methods.asl import ASL, ASL2Pass, ASLFullKV
from kvbudget.methods.baklava import BaKlaVa, BaKlaVaSnapKV
from kvbudget.methods.base import Method
from kvbudget.methods.cake import CAKE
from kvbudget.methods.cam import CaM
from kvbudget.methods.chunkkv import ChunkKV
from kvbudget.methods.d2o import D2O, D2ONoMerge, D2OUniform
from kvbudget.methods.expected_attention import ExpectedAttention
from kvbudget.methods.fastkv import FastKV
from kvbudget.methods.full import FullCache
from kvbudget.methods.gemfilter import GemFilter
from kvbudget.methods.h2o import H2O
from kvbudget.methods.keydiff import KeyDiff
from kvbudget.methods.knorm import KNorm
from kvbudget.methods.kvzip import KVzip
from kvbudget.methods.lagkv import LagKV
from kvbudget.methods.lava import LAVa, LAVaNoHead, LAVaPyramid, LAVaUniform
from kvbudget.methods.lookahead import LAQ, LAQAda, LAQLava, LAQPlusPlus
from kvbudget.methods.presets import preset_options, split_preset
from kvbudget.methods.pyramidinfer import PyramidInfer
from kvbudget.methods.pyramidkv import PyramidKV
from kvbudget.methods.qfilter import QFilter
from kvbudget.methods.random_eviction import RandomEviction
from kvbudget.methods.rkv import RKV
from kvbudget.methods.snapkv import SnapKV
from kvbudget.methods.squeezeattention import SqueezeAttention
from kvbudget.methods.streamingllm import StreamingLLM
from kvbudget.methods.tova import TOVA
from kvbudget.methods.vatp import VATP

REGISTRY: dict[str, type[Method]] = {
    cls.name: cls
    for cls in (
        FullCache,
        RandomEviction,
        KNorm,
        StreamingLLM,
        SnapKV,
        PyramidKV,
        AdaSnapKV,
        AdaPyramidKV,
        H2O,
        TOVA,
        VATP,
        LAVa,
        LAVaUniform,
        LAVaNoHead,
        LAVaPyramid,
        CAKE,
        D2O,
        D2OUniform,
        D2ONoMerge,
        CaM,
        SqueezeAttention,
        BaKlaVa,
        BaKlaVaSnapKV,
        LAQ,
        LAQPlusPlus,
        LAQAda,
        LAQLava,
        ASL,
        ASLFullKV,
        ASL2Pass,
        FastKV,
        GemFilter,
        PyramidInfer,
        KeyDiff,
        LagKV,
        ChunkKV,
        QFilter,
        KVzip,
        ExpectedAttention,
        RKV,
    )
}


def method_names() -> list[str]:
    """Names of all registered methods, in registry order."""
    return list(REGISTRY)


def method_class(name: str) -> type[Method]:
    """The class registered under ``name`` (a ``@preset`` suffix is ignored)."""
    try:
        return REGISTRY[split_preset(name)[0]]
    except KeyError:
        raise UnknownMethodError(f"unknown method '{name}': expected one of {', '.join(REGISTRY)}") from None


def _coerce(value: Any, default: Any, name: str, method: str) -> Any:
    """Convert CLI strings to the type of the option's default."""
    if not isinstance(value, str) or isinstance(default, str):
        return value
    try:
        if isinstance(default, bool):
            if value.lower() in ("1", "true", "yes"):
                return True
            if value.lower() in ("0", "false", "no"):
                return False
            raise ValueError(value)
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise UnknownMethodError(
            f"{method}: option {name} expects {type(default).__name__}, got {value!r}"
        ) from None
    return value


def make_method(name: str, **options: Any) -> Method:
    """Build a fresh method object with non-default options, validated.

    Example: ``make_method("snapkv", window=64, kernel=5, pooling="avg")``. String values are
    converted to the option's type (for the CLI's ``--opt key=value``). ``name@preset`` applies a
    paper's comparison settings first (:mod:`kvbudget.methods.presets`); ``options`` override them.
    """
    base, preset = preset_options(name)
    options = {**preset, **options}
    name = base
    cls = method_class(name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise UnknownMethodError(
            f"{name}: unknown option(s) {', '.join(unknown)}; options are {', '.join(fields) or 'none'}"
        )
    defaults = {k: f.default for k, f in fields.items()}
    converted = {k: _coerce(v, defaults[k], k, name) for k, v in options.items()}
    return cls(**converted)


def resolve_method(method: str | Method) -> Method:
    """A registry name becomes a fresh default object; a method object is used as given."""
    if isinstance(method, Method):
        return method
    if isinstance(method, str):
        return make_method(method)
    raise UnknownMethodError(
        f"method must be a registry name or a Method object, got {type(method).__name__}"
    )
