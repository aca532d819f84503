"""The list every generic test runs over: each registered method with small ("easy") options.

A new method gets the no-op, budget, batch, decode and reference tests the moment it is
registered (a named combination too: every registry name runs); give it small options here if its
defaults need a longer prompt than the tiny tests use.
"""

from __future__ import annotations

from typing import Any

from kvbudget.methods.base import Method
from kvbudget.methods.registry import make_method, method_names

SMALL_OPTIONS: dict[str, dict[str, Any]] = {
    "snapkv": {"window": 4, "kernel": 3},
    "pyramidkv": {"window": 4, "kernel": 3},
    "ada-snapkv": {"window": 4, "kernel": 3},
    "ada-pyramidkv": {"window": 4, "kernel": 3},
    "vatp": {"window": 4, "sinks": 2},
    "lava": {"window": 4, "kernel": 3},
    "lava-uniform": {"window": 4, "kernel": 3},
    "lava-nohead": {"window": 4, "kernel": 3},
    "lava-pyramid": {"window": 4, "kernel": 3},
    "cake": {"window": 4},
    "baklava-snapkv": {"window": 4, "kernel": 3},
    "laq": {"kernel": 3, "steps": 3, "lookahead_window": 4},
    "laq++": {"window": 4, "kernel": 3, "steps": 3, "lookahead_window": 4},
    "laq-ada": {"window": 4, "kernel": 3, "steps": 3, "lookahead_window": 4},
    "laq-lava": {"window": 4, "kernel": 3, "steps": 3, "lookahead_window": 4},
    # tau > 1 selects at l_min (relative variance 1 there): the tiny tests really prune
    "asl": {"window": 4, "kernel": 3, "tau": 1.5},
    "asl-fullkv": {"window": 4, "kernel": 3, "tau": 1.5},
    "asl-2pass": {"window": 4, "kernel": 3, "tau": 1.5},
    "fastkv": {"window": 4, "kernel": 3},
    "gemfilter": {"kernel": 3},
    "pyramidinfer": {"min_context": 8, "decay": 0.5},
    "lagkv": {"sinks": 2, "lag_size": 8},
    "chunkkv": {"window": 4, "kernel": 3, "chunk_size": 5},
    "qfilter": {"window": 4},
    "kvzip": {"chunk": 48},  # two or more reconstruction passes on the tiny prompts
    "r-kv": {"buffer": 1},  # re-selects after every decoded token: the cache stays at the budget
}

ALL_METHODS = method_names()
DECODE_METHODS = [name for name in ALL_METHODS if "decode" in make_method(name).stages]
COMPRESSING_METHODS = [name for name in ALL_METHODS if name != "full"]
#: methods whose layers keep different budgets that sum to the model's total (cascading LAVa/CAKE,
#: D2O's variance allocation)
DYNAMIC_LAYER_METHODS = [
    name
    for name in ALL_METHODS
    if make_method(name).cascading or getattr(make_method(name), "dynamic_layers", False)
]
#: methods that change kept keys/values by merging evicted entries into them: a decode step cannot
#: equal the masked full-sequence reference; their merge arithmetic has its own reference tests
#: (tests/test_d2o.py)
MERGING_METHODS = ["d2o", "d2o-uniform", "cam"]
#: methods whose per-layer (and per-head) budgets come from an offline profile
PROFILED_METHODS = ["squeezeattention", "baklava", "baklava-snapkv"]
#: prune-stage methods change the prefill forward (deeper layers see only selected tokens)
PRUNE_METHODS = [name for name in ALL_METHODS if "prune" in make_method(name).stages]


def small(name: str) -> Method:
    """A fresh method object with options fitting the tiny tests' prompts (~100–200 tokens)."""
    return make_method(name, **SMALL_OPTIONS.get(name, {}))
