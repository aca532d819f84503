"""The list every generic test runs over: each registered method with small ("easy") options.

Every registry name is enrolled from the registry (a named combination too), with the options its
class (or combination) gives in ``small_options``: a new method gets the no-op, budget, batch,
decode and reference tests the moment it is registered. The groups below are read from the
methods themselves (their stages, options and metadata), never listed by hand.
"""

from __future__ import annotations

from kvbudget.methods.base import Method
from kvbudget.methods.profiled import ProfiledMethod
from kvbudget.methods.registry import make_method, method_info, method_names

ALL_METHODS = method_names()


def small(name: str) -> Method:
    """A fresh method object with options fitting the tiny tests' prompts (~100–200 tokens)."""
    return make_method(name, **method_info(name).small_options)


DECODE_METHODS = [name for name in ALL_METHODS if "decode" in make_method(name).stages]
COMPRESSING_METHODS = [name for name in ALL_METHODS if name != "full"]
#: methods whose layers keep different budgets that sum to the model's total (cascading LAVa/CAKE,
#: D2O's variance allocation)
DYNAMIC_LAYER_METHODS = [
    name
    for name in ALL_METHODS
    if make_method(name).cascading or getattr(make_method(name), "dynamic_layers", False)
]
#: methods that change kept keys/values by merging evicted entries into them (``Method.merges``): a
#: decode step cannot equal the masked full-sequence reference; their merge arithmetic has its own
#: reference tests (tests/test_d2o.py)
MERGING_METHODS = [name for name in ALL_METHODS if make_method(name).merges]
#: methods whose per-layer (and per-head) budgets come from an offline profile
PROFILED_METHODS = [name for name in ALL_METHODS if issubclass(method_info(name).cls, ProfiledMethod)]
#: prune-stage methods change the prefill forward (deeper layers see only selected tokens)
PRUNE_METHODS = [name for name in ALL_METHODS if "prune" in make_method(name).stages]
#: methods that hold more than the budget by design (``exceeds_budget``)
BEYOND_BUDGET = [name for name in ALL_METHODS if method_info(name).exceeds_budget]
