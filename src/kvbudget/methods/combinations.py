"""Named combinations: registry names that are a base method with some options set.

``ada-pyramidkv`` is ``snapkv`` with ``layer_alloc=pyramid, head_alloc=ada, reduce_rows=mean``:
``make_method("ada-pyramidkv")`` builds exactly ``make_method("snapkv", layer_alloc="pyramid",
head_alloc="ada", reduce_rows="mean")``, under the name ``ada-pyramidkv`` (its messages, result
rows and tuned parameters use that name). Options given explicitly win over the combination's,
and a paper's comparison preset (``name@preset``, :mod:`kvbudget.methods.presets`) applies on top
of the combination. Any other combination of a method's options is written the same way
without a name (``--method snapkv --opt layer_alloc=pyramid``).

Not to be confused with ``method@preset``: a preset is how a *comparing* paper configured a
baseline; a combination is a method of its own (a paper's method or ablation, or ours).

Each entry: the base method, the options it sets, the paper and one line saying what it is (the
README's methods table). The other metadata of a method class (``code``, ``kvpress``,
``small_options``, ``exceeds_budget``; :class:`~kvbudget.methods.base.Method`) is the base class's
unless the entry sets it (``None``: the base's). This module imports no method, so any method
module may read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Combination:
    """A named combination: ``base`` with ``options`` (read-only)."""

    base: str
    options: Mapping[str, Any] = field(default_factory=dict)
    paper: str = ""
    summary: str = ""
    #: the base class's metadata where these are ``None`` (see :class:`~kvbudget.methods.base.Method`)
    code: str | None = None
    kvpress: str | None = None
    small_options: Mapping[str, Any] | None = None
    exceeds_budget: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        if self.small_options is not None:
            object.__setattr__(self, "small_options", MappingProxyType(dict(self.small_options)))

    @property
    def spelled_out(self) -> str:
        """``"snapkv + layer_alloc=pyramid, head_alloc=ada"``."""
        return self.base + " + " + ", ".join(f"{k}={v}" for k, v in self.options.items())


ADAKV = "arXiv:2407.11550"
LAVA = "arXiv:2509.09754"
D2O = "arXiv:2406.13035"
LAQ = "arXiv:2505.20334"

#: name → combination, each placed after its base method in the registry's order
_LAQ_SMALL = {"window": 4, "kernel": 3, "steps": 3, "lookahead_window": 4}
COMBINATIONS: dict[str, Combination] = {
    "pyramidkv": Combination(
        "snapkv", {"layer_alloc": "pyramid"}, "arXiv:2406.02069",
        "SnapKV scores, budgets shrinking from bottom to top layers",
        code="Zefan-Cai/KVCache-Factory", kvpress="PyramidKVPress",
    ),
    "ada-snapkv": Combination(
        "snapkv", {"reduce_rows": "mean", "head_alloc": "ada"}, ADAKV,
        "SnapKV scores, head budgets from one top-k over all heads (floor 0.2)",
        code="FFY0/AdaKV", kvpress="AdaKVPress",
    ),
    "ada-pyramidkv": Combination(
        "snapkv", {"reduce_rows": "mean", "layer_alloc": "pyramid", "head_alloc": "ada"}, ADAKV,
        "AdaKV heads within PyramidKV layers", code="FFY0/AdaKV", kvpress="",
    ),
    "lava-uniform": Combination(
        "lava", {"layer_alloc": "uniform"}, LAVA,
        "LAVa ablation, uniform layers: every layer H·(B − w) candidates, LAVa's flattened head split",
    ),
    "lava-nohead": Combination(
        "lava", {"head_alloc": "uniform"}, LAVA,
        "LAVa ablation, fixed heads: cascading entropy layer budgets, each split evenly over the heads",
    ),
    "lava-pyramid": Combination(
        "lava", {"layer_alloc": "pyramid"}, LAVA,
        "LAVa ablation, pyramid layers: LAVa's score and head split with PyramidKV's layer budgets",
    ),
    "d2o-uniform": Combination(
        "d2o", {"dynamic_layers": False}, D2O,
        "D2O ablation, uniform layer budgets (Table 6); eviction and merging as d2o",
    ),
    "d2o-nomerge": Combination(
        "d2o", {"merge": False}, D2O,
        "D2O ablation, no merging: variance layer budgets, sinks + heavy + recent, evicted entries dropped",
    ),
    "laq++": Combination(
        "laq", {"window": 8}, LAQ,
        "laq with the last 8 prompt queries added to the observation and kept (Eq. 5)",
        small_options=_LAQ_SMALL,
    ),
    "laq-ada": Combination(
        "laq", {"window": 8, "reduce_rows": "mean", "head_alloc": "ada"}, LAQ,
        "the laq++ observation with AdaKV's head budgets (window rows averaged, floor α = 0.2); ours",
        small_options=_LAQ_SMALL,
    ),
}  # fmt: skip
