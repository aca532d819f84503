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

Each entry: the base method, the options it sets, the paper and one line saying what it is.
This module imports no method, so any method module may read it.
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @property
    def spelled_out(self) -> str:
        """``"snapkv + layer_alloc=pyramid, head_alloc=ada"``."""
        return self.base + " + " + ", ".join(f"{k}={v}" for k, v in self.options.items())


ADAKV = "arXiv:2407.11550"
LAVA = "arXiv:2509.09754"
D2O = "arXiv:2406.13035"
LAQ = "arXiv:2505.20334"

#: name → combination, each placed after its base method in the registry's order
COMBINATIONS: dict[str, Combination] = {
    "pyramidkv": Combination(
        "snapkv", {"layer_alloc": "pyramid"}, "arXiv:2406.02069",
        "PyramidKV: SnapKV scores, layer budgets shrinking linearly from the bottom layer (β = 20)",
    ),
    "ada-snapkv": Combination(
        "snapkv", {"reduce_rows": "mean", "head_alloc": "ada"}, ADAKV,
        "Ada-SnapKV: SnapKV scores (window rows averaged), AdaKV's head budgets (floor α = 0.2)",
    ),
    "ada-pyramidkv": Combination(
        "snapkv", {"reduce_rows": "mean", "layer_alloc": "pyramid", "head_alloc": "ada"}, ADAKV,
        "Ada-PyramidKV: PyramidKV's layer budgets, then AdaKV's head budgets inside each layer",
    ),
    "lava-uniform": Combination(
        "lava", {"layer_alloc": "uniform"}, LAVA,
        "LAVa without layer dynamics: every layer H·(B − w) candidates, LAVa's flattened head split",
    ),
    "lava-nohead": Combination(
        "lava", {"head_alloc": "uniform"}, LAVA,
        "LAVa without head dynamics: cascading entropy layer budgets, each split evenly over the heads",
    ),
    "lava-pyramid": Combination(
        "lava", {"layer_alloc": "pyramid"}, LAVA,
        "LAVa's score and flattened head split with PyramidKV's fixed layer budgets (β = 20)",
    ),
    "d2o-uniform": Combination(
        "d2o", {"dynamic_layers": False}, D2O,
        "D2O without the layer-level operation (Table 6): uniform layers; eviction and merging as d2o",
    ),
    "d2o-nomerge": Combination(
        "d2o", {"merge": False}, D2O,
        "D2O without merging: variance layer budgets and sinks + heavy + recent eviction, evicted dropped",
    ),
    "laq++": Combination(
        "laq", {"window": 8}, LAQ,
        "LAQ++ (Eq. 5): the last 8 prompt queries join the pseudo queries; the last 8 tokens are kept",
    ),
    "laq-ada": Combination(
        "laq", {"window": 8, "reduce_rows": "mean", "head_alloc": "ada"}, LAQ,
        "LAQ++'s observation with AdaKV's head budgets (window rows averaged, floor α = 0.2); ours",
    ),
}  # fmt: skip
