"""The method registry: names → methods, and ``make_method``.

A registry name is a method class (``snapkv``, ``lava``) or a named combination of one with some
options set (``ada-pyramidkv`` = ``snapkv`` + ``layer_alloc=pyramid, head_alloc=ada,
reduce_rows=mean``; :mod:`kvbudget.methods.combinations`). ``name@preset`` applies a comparing
paper's settings (:mod:`kvbudget.methods.presets`). Precedence, lowest first: the class's
defaults, the combination's options, the preset's, the options given.

A method's metadata (its one-line summary, paper, the authors' code, its kvpress counterpart, the
options that fit the tiny tests, whether it exceeds its budget) sits on its class
(:class:`~kvbudget.methods.base.Method`) or, where a combination differs from its base, on the
combination; :func:`method_info` reads it for any registry name. The README's methods table, the
index of docs/methods.md (``scripts/methods_tables.py``) and the generic tests enrol every
registered name from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvbudget.errors import MethodOptionError, UnknownMethodError
from kvbudget.methods.asl import ASL, ASL2Pass, ASLFullKV
from kvbudget.methods.baklava import BaKlaVa, BaKlaVaSnapKV
from kvbudget.methods.base import Method
from kvbudget.methods.cake import CAKE
from kvbudget.methods.cam import CaM
from kvbudget.methods.chunkkv import ChunkKV
from kvbudget.methods.combinations import COMBINATIONS, Combination
from kvbudget.methods.compactor import Compactor
from kvbudget.methods.d2o import D2O
from kvbudget.methods.expected_attention import ExpectedAttention
from kvbudget.methods.fastkv import FastKV
from kvbudget.methods.full import FullCache
from kvbudget.methods.gemfilter import GemFilter
from kvbudget.methods.h2o import H2O
from kvbudget.methods.keydiff import KeyDiff
from kvbudget.methods.knorm import KNorm
from kvbudget.methods.kvgrad import KVgrad
from kvbudget.methods.kvzap import KVzap
from kvbudget.methods.kvzap_decoding import KVzapDecoding
from kvbudget.methods.kvzip import KVzip
from kvbudget.methods.kvzip_plus import KVzipPlus
from kvbudget.methods.lagkv import LagKV
from kvbudget.methods.lava import LAVa
from kvbudget.methods.leverage import Leverage
from kvbudget.methods.lookahead import LAQ, LAQLava
from kvbudget.methods.observed_attention import ObservedAttention
from kvbudget.methods.presets import preset_options, split_preset
from kvbudget.methods.pyramidinfer import PyramidInfer
from kvbudget.methods.qfilter import QFilter
from kvbudget.methods.random_eviction import RandomEviction
from kvbudget.methods.rkv import RKV
from kvbudget.methods.snapkv import SnapKV
from kvbudget.methods.squeezeattention import SqueezeAttention
from kvbudget.methods.streamingllm import StreamingLLM
from kvbudget.methods.tova import TOVA
from kvbudget.methods.vatp import VATP

#: registry order (``kvbudget methods``, ``--methods all``, reports): a class, or a combination's name
_ORDER: tuple[type[Method] | str, ...] = (
    FullCache,
    RandomEviction,
    KNorm,
    StreamingLLM,
    SnapKV,
    "pyramidkv",
    "ada-snapkv",
    "ada-pyramidkv",
    H2O,
    ObservedAttention,
    TOVA,
    VATP,
    LAVa,
    "lava-uniform",
    "lava-nohead",
    "lava-pyramid",
    CAKE,
    D2O,
    "d2o-uniform",
    "d2o-nomerge",
    CaM,
    SqueezeAttention,
    BaKlaVa,
    BaKlaVaSnapKV,
    LAQ,
    "laq++",
    "laq-ada",
    LAQLava,
    ASL,
    ASLFullKV,
    ASL2Pass,
    FastKV,
    GemFilter,
    PyramidInfer,
    KeyDiff,
    Leverage,
    Compactor,
    LagKV,
    ChunkKV,
    QFilter,
    KVzip,
    KVzipPlus,
    KVgrad,
    KVzap,
    KVzapDecoding,
    ExpectedAttention,
    RKV,
)

#: the method classes by their own name
METHOD_CLASSES: dict[str, type[Method]] = {cls.name: cls for cls in _ORDER if not isinstance(cls, str)}

#: every registry name → the class its objects are (a combination's: its base's class)
REGISTRY: dict[str, type[Method]] = {
    entry if isinstance(entry, str) else entry.name: (
        METHOD_CLASSES[COMBINATIONS[entry].base] if isinstance(entry, str) else entry
    )
    for entry in _ORDER
}

#: the options that choose a method's allocators
ALLOCATOR_OPTIONS = ("layer_alloc", "head_alloc")


def method_names() -> list[str]:
    """Names of all registered methods (classes and named combinations), in registry order."""
    return list(REGISTRY)


def combination(name: str) -> Combination | None:
    """The named combination ``name`` is (a ``@preset`` suffix is ignored), or ``None`` for a class."""
    return COMBINATIONS.get(split_preset(name)[0])


def method_class(name: str) -> type[Method]:
    """The class of the objects ``name`` builds (a ``@preset`` suffix is ignored)."""
    try:
        return REGISTRY[split_preset(name)[0]]
    except KeyError:
        raise UnknownMethodError(f"unknown method '{name}': expected one of {', '.join(REGISTRY)}") from None


@dataclass(frozen=True)
class MethodInfo:
    """What a registry name is, for the docs and the tests: its class's metadata, with a named
    combination's own where it sets them (:mod:`kvbudget.methods.combinations`)."""

    name: str
    cls: type[Method]
    combination: Combination | None
    summary: str
    paper: str
    code: str
    kvpress: str
    small_options: Mapping[str, Any]
    exceeds_budget: bool


def method_info(name: str) -> MethodInfo:
    """The metadata of the registry name ``name`` (a ``@preset`` suffix is ignored)."""
    base = split_preset(name)[0]
    cls = method_class(base)
    combined = combination(base)

    def pick(field: str) -> Any:
        own = getattr(combined, field, None) if combined else None
        return getattr(cls, field) if own is None else own

    return MethodInfo(
        name=base, cls=cls, combination=combined,
        summary=combined.summary if combined else cls.summary,
        paper=combined.paper if combined else cls.paper,
        code=pick("code"), kvpress=pick("kvpress"),
        small_options=MappingProxyType(dict(pick("small_options"))),
        exceeds_budget=pick("exceeds_budget"),
    )  # fmt: skip


def _coerce(value: Any, default: Any, name: str, method: str, annotation: Any = None) -> Any:
    """Convert CLI strings to the type of the option's default (for a ``None`` default, to the number
    type its annotation names, ``float | None``; ``none`` stays ``None``)."""
    if not isinstance(value, str) or isinstance(default, str):
        return value
    if default is None:
        if value.lower() == "none":
            return None
        numbers = [t for t in (float, int) if t.__name__ in str(annotation)]
        default = numbers[0]() if numbers else None
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
        raise MethodOptionError(
            f"{method}: option {name} expects {type(default).__name__}, got {value!r}", method, name, value
        ) from None
    return value


def make_method(name: str, **options: Any) -> Method:
    """Build a fresh method object with non-default options, validated.

    Example: ``make_method("snapkv", window=64, kernel=5, pooling="avg")`` or, composing the
    allocators, ``make_method("snapkv", layer_alloc="pyramid", head_alloc="ada")``. String values
    are converted to the option's type (for the CLI's ``--opt key=value``). A named combination
    (``ada-pyramidkv``) sets its options first, ``name@preset`` applies a paper's comparison
    settings next (:mod:`kvbudget.methods.presets`); ``options`` override both.

    Raises :class:`~kvbudget.errors.UnknownMethodError` for an unknown name or preset and
    :class:`~kvbudget.errors.MethodOptionError` for an option the method does not have, an
    allocator option it refuses, or a value it does not allow.
    """
    base, preset = preset_options(name)
    cls = method_class(base)
    combined = combination(base)
    options = {**(combined.options if combined else {}), **preset, **options}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for option in ALLOCATOR_OPTIONS:
        if option in options and option not in fields:
            raise MethodOptionError(
                f"{base}: option {option} does not apply: {cls.allocation_refusal(option)}",
                base, option, options[option],
            )  # fmt: skip
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise MethodOptionError(
            f"{base}: unknown option(s) {', '.join(unknown)}; options are {', '.join(fields) or 'none'}",
            base, unknown[0], options[unknown[0]],
        )  # fmt: skip
    converted = {k: _coerce(v, fields[k].default, k, base, fields[k].type) for k, v in options.items()}
    return cls.named(base, **converted)


def resolve_method(method: str | Method) -> Method:
    """A registry name becomes a fresh default object; a method object is used as given."""
    if isinstance(method, Method):
        return method
    if isinstance(method, str):
        return make_method(method)
    raise UnknownMethodError(
        f"method must be a registry name or a Method object, got {type(method).__name__}"
    )
