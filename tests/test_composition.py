"""Allocators as options: named combinations, the scorer × layer_alloc × head_alloc grid, refusals.

The references are written here from the papers' formulas: PyramidKV's linear schedule
(arXiv:2406.02069, as its authors' code floors it) and AdaKV's head split (arXiv:2407.11550: one
top-``H·B'`` over the layer's flattened candidate scores, ``n_h(1 − α) + B'α`` rounded by largest
remainder). The scores the allocators split are the scorer's own (recorded from the run): the
allocator is under test, not the scorer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kvbudget
from conftest import seeded, tiny_model
from kvbudget.cli import app
from kvbudget.errors import KVBudgetError, MethodOptionError, UnknownMethodError
from kvbudget.methods.combinations import COMBINATIONS
from kvbudget.methods.registry import METHOD_CLASSES, REGISTRY, make_method, method_names

LENGTH, BUDGET, LAYERS, HEADS = 120, 24, 4, 2

#: every named combination: its base and the options it sets (the registry's entries)
COMBINED = {name: (c.base, dict(c.options)) for name, c in COMBINATIONS.items()}


def small_options(base: str) -> dict:
    """Options for the tiny prompts (window + sinks below the budget): the base class's own."""
    return dict(METHOD_CLASSES[base].small_options)


#: the scorers on the generic per-layer path whose allocators are options: every class that takes
#: PyramidKV's and AdaKV's allocators (LAVa's own are tested in test_lava_takes_its_allocators_as_options)
GRID_SCORERS = [
    name
    for name, cls in METHOD_CLASSES.items()
    if {"uniform", "pyramid"} <= set(cls.layer_allocators) and {"uniform", "ada"} <= set(cls.head_allocators)
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def prompt(seed: int = 1, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(3, 90, (1, length), generator=seeded(seed))


def kept_positions(cache) -> list[list[list[int]]]:
    """Per layer and KV head, the positions the cache holds (batch row 0)."""
    return [[layer.head(h)[2][0].tolist() for h in range(layer.num_heads)] for layer in cache.layers]


def kept_state(cache) -> tuple[list, list]:
    """Kept positions and the kept keys (merging methods change keys, not positions)."""
    keys = [[layer.head(h)[0][0].tolist() for h in range(layer.num_heads)] for layer in cache.layers]
    return kept_positions(cache), keys


def head_lengths(cache) -> list[list[int]]:
    return [layer.head_lengths()[0].tolist() for layer in cache.layers]


# ------------------------------------------------------------------------------ references
def pyramid_reference(budget: int, length: int, layer: int, layers: int, window: int, beta: int = 20) -> int:
    """PyramidKV's per-head budget of ``layer``: B' = B − w, min = B' // β, max = 2B' − min (capped
    at the prompt), step = (max − min) // (layers − 1), layer l keeps max − l·step, plus the window."""
    if budget >= length:
        return length
    spread = budget - window
    low = spread // beta
    high = 2 * spread - low
    if high >= length - window:
        high = length - window
        low = 2 * spread - high
    step = (high - low) // (layers - 1)
    return min(high - layer * step + window, length)


def ada_reference(
    scores: np.ndarray, candidates: np.ndarray, layer_budget: int, protected: int, alpha: float
):
    """AdaKV's head budgets of one layer (window included), in the float32 arithmetic of the shares.

    ``scores``, ``candidates``: ``[heads, n]``. The top ``H·B'`` of the flattened candidate scores
    (ties to the earlier head, then slot) give ``n_h``; ``n_h(1 − α) + B'α`` rounded by largest
    remainder (ties to the earlier head) so the heads sum to ``H·B'``.
    """
    heads, n = scores.shape
    spread = layer_budget - protected
    total = heads * spread
    flat = np.where(candidates, scores.astype(np.float64), -np.inf).reshape(-1)
    order = sorted(range(flat.size), key=lambda i: (-flat[i], i))[:total]
    counts = np.bincount([i // n for i in order], minlength=heads)
    shares = counts.astype(np.float32) * np.float32(1 - alpha) + np.float32(spread * alpha)
    result = np.floor(shares).astype(np.int64)
    fraction = shares - np.floor(shares)
    missing = total - int(result.sum())
    for h in sorted(range(heads), key=lambda h: (-fraction[h], h))[:missing]:
        result[h] += 1
    return (result + protected).tolist()


def recording(method):
    """Record, per layer, the scores the method's allocators split and the entries it protects."""
    seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    score = method.score

    def wrapped(obs):
        scores = score(obs)
        valid = obs.valid[0].cpu().numpy()
        seen[obs.layer_idx] = (scores[0].float().cpu().numpy(), valid)
        return scores

    object.__setattr__(method, "score", wrapped)  # this object only (a frozen configuration)
    return seen


def protected_count(method) -> int:
    return method.window + method.sinks


# ------------------------------------------------------------------------------ named combinations
def test_every_named_combination_is_registered_and_sets_options_of_its_base():
    assert set(COMBINED) <= set(method_names())
    for name, (base, options) in COMBINED.items():
        defaults = METHOD_CLASSES[base]().options()
        assert options and set(options) <= set(make_method(base, **options).options()), name
        assert any(defaults.get(k) != v for k, v in options.items()), f"{name} sets only {base}'s defaults"


@pytest.mark.parametrize("name", sorted(COMBINED))
def test_a_combination_keeps_what_its_base_with_the_options_keeps(name, model):
    base, options = COMBINED[name]
    small = small_options(base)
    named = make_method(name, **small)
    spelled = make_method(base, **{**options, **small})
    assert named.name == name and spelled.name == base
    assert named.options() == spelled.options()
    for budget, seed in ((BUDGET, 1), (40, 2)):
        ids = prompt(seed)
        a = kvbudget.compress(model, ids, method=make_method(name, **small), budget=budget)
        b = kvbudget.compress(model, ids, method=make_method(base, **{**options, **small}), budget=budget)
        assert kept_state(a) == kept_state(b), (name, budget)
    # discriminating: the combination's options change what the base keeps by default
    plain = kvbudget.compress(model, prompt(1), method=make_method(base, **small), budget=BUDGET)
    combined = kvbudget.compress(model, prompt(1), method=make_method(name, **small), budget=BUDGET)
    assert kept_state(plain) != kept_state(combined), name


def test_explicit_options_and_presets_apply_over_a_combination():
    assert make_method("ada-snapkv", reduce_rows="sum").reduce_rows == "sum"
    assert make_method("pyramidkv", layer_alloc="uniform").options() == {
        **make_method("snapkv").options(),
    }
    lava = make_method("ada-pyramidkv@lava", kernel=5)  # combination < preset < explicit
    assert (lava.name, lava.layer_alloc, lava.head_alloc, lava.kernel, lava.window) == (
        "ada-pyramidkv", "pyramid", "ada", 5, 32,
    )  # fmt: skip


# ------------------------------------------------------------------------------ the grid
@pytest.mark.parametrize("head_alloc", ["uniform", "ada"])
@pytest.mark.parametrize("layer_alloc", ["uniform", "pyramid"])
@pytest.mark.parametrize("scorer", GRID_SCORERS)
def test_every_scorer_takes_every_allocator(scorer, layer_alloc, head_alloc, model):
    method = make_method(scorer, layer_alloc=layer_alloc, head_alloc=head_alloc, **small_options(scorer))
    seen = recording(method)
    cache = kvbudget.compress(model, prompt(3), method=method, budget=BUDGET)
    lengths = head_lengths(cache)
    window, protected = method.window, protected_count(method)
    for layer in range(LAYERS):
        if layer_alloc == "pyramid":
            layer_budget = pyramid_reference(BUDGET, LENGTH, layer, LAYERS, window)
        else:
            layer_budget = BUDGET
        assert sum(lengths[layer]) == HEADS * layer_budget, (layer, lengths)
        if head_alloc == "uniform":
            assert lengths[layer] == [layer_budget] * HEADS
            continue
        scores, valid = seen[layer]
        n = scores.shape[1]
        slots = np.arange(n)
        candidates = valid.copy()
        for h in range(HEADS):  # the last `window` and the first `sinks` valid entries are protected
            order = slots[valid[h]]
            candidates[h, order[len(order) - window :] if window else []] = False
            candidates[h, order[: method.sinks]] = False
        assert lengths[layer] == ada_reference(
            scores, candidates, layer_budget, protected, method.floor_alpha
        )
    if layer_alloc == "pyramid":  # discriminating: the schedule really varies over the layers
        assert sum(lengths[0]) > sum(lengths[-1])
    if head_alloc == "ada":
        assert any(len(set(per_layer)) > 1 for per_layer in lengths)  # heads really differ somewhere


def test_pyramid_reference_matches_the_papers_worked_numbers():
    # B = 24, w = 4, β = 20, 120 tokens, 4 layers: B' = 20, min 1, max 39, step 12
    assert [pyramid_reference(24, 120, layer, 4, 4) for layer in range(4)] == [43, 31, 19, 7]
    # the cap at the prompt: B = 100, w = 4, 120 tokens: max = 116, min = 76, step 13
    assert [pyramid_reference(100, 120, layer, 4, 4) for layer in range(4)] == [120, 107, 94, 81]


def test_ada_reference_rounds_the_floored_shares_exactly():
    # 2 heads, B' = 3 each: head 0 wins all 6 → shares 0.8·6 + 0.2·3 = 5.4 and 0.6 → 5 and 1
    scores = np.array([[9.0, 8, 7, 6, 5, 4], [0, 0, 0, 0, 0, 0]])
    assert ada_reference(scores, np.ones_like(scores, bool), 3, 0, 0.2) == [5, 1]
    assert ada_reference(scores, np.ones_like(scores, bool), 3, 0, 0.0) == [6, 0]


@pytest.mark.parametrize("head_alloc", ["flat", "uniform"])
@pytest.mark.parametrize("layer_alloc", ["entropy", "uniform", "pyramid"])
def test_lava_takes_its_allocators_as_options(layer_alloc, head_alloc, model):
    method = make_method("lava", layer_alloc=layer_alloc, head_alloc=head_alloc, **small_options("lava"))
    assert method.cascading == (layer_alloc == "entropy")
    cache = kvbudget.compress(model, prompt(4), method=method, budget=BUDGET)
    lengths = head_lengths(cache)
    sums = [sum(per_layer) for per_layer in lengths]
    if layer_alloc == "entropy":
        assert sum(sums) == LAYERS * HEADS * BUDGET and len(set(sums)) > 1
    elif layer_alloc == "uniform":
        assert sums == [HEADS * BUDGET] * LAYERS
    else:
        assert sums == [
            HEADS * pyramid_reference(BUDGET, LENGTH, layer, LAYERS, 4) for layer in range(LAYERS)
        ]
    if head_alloc == "uniform":  # B_l split evenly: the heads of a layer differ by at most one entry
        assert all(max(per_layer) - min(per_layer) <= 1 for per_layer in lengths)
    else:
        assert any(max(per_layer) - min(per_layer) > 1 for per_layer in lengths)


# ------------------------------------------------------------------------------ refusals
def refusing_names() -> list[str]:
    return [name for name in method_names() if not REGISTRY[name].layer_allocators]


def test_the_refusing_methods_are_the_expected_families():
    """A method takes the allocator options exactly when its budgets are not its own: a refusing
    method is a prune- or decode-stage one, or says why in ``fixed_allocation``."""
    takes = {name for name in method_names() if REGISTRY[name].layer_allocators}
    for name in method_names():
        cls = REGISTRY[name]
        own_budgets = bool(cls.fixed_allocation) or bool({"prune", "decode"} & set(cls.stages))
        assert (name in takes) != own_budgets, (name, cls.stages, cls.fixed_allocation)
        assert bool(cls.layer_allocators) == bool(cls.head_allocators), name
    assert {"random", "knorm", "snapkv", "pyramidkv", "ada-pyramidkv", "vatp", "lava", "lava-pyramid", "laq",
            "laq-ada", "laq-lava", "observed-attention"} <= takes  # fmt: skip
    assert {"h2o", "fastkv", "d2o", "cake", "baklava", "streamingllm"} <= set(refusing_names())
    assert {"snapkv", "knorm", "random", "vatp", "laq", "observed-attention"} <= set(GRID_SCORERS)
    assert "lava" not in GRID_SCORERS  # LAVa's allocators are its own values


@pytest.mark.parametrize("name", refusing_names())
@pytest.mark.parametrize("option", ["layer_alloc", "head_alloc"])
def test_a_method_without_allocator_options_refuses_them(name, option):
    with pytest.raises(MethodOptionError) as err:
        make_method(name, **{option: "pyramid"})
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{name}: option {option} does not apply")
    assert (err.value.method, err.value.option) == (name, option)


@pytest.mark.parametrize(
    ("name", "options", "words"),
    [
        (
            "snapkv",
            {"layer_alloc": "entropy"},
            "snapkv: layer_alloc must be uniform or pyramid, got 'entropy'",
        ),
        ("snapkv", {"head_alloc": "flat"}, "snapkv: head_alloc must be uniform or ada, got 'flat'"),
        ("lava", {"head_alloc": "ada"}, "lava: head_alloc must be flat or uniform, got 'ada'"),
        ("snapkv", {"beta": 10}, "snapkv: option beta=10 belongs to layer_alloc=pyramid"),
        ("pyramidkv", {"floor_alpha": 0.5}, "pyramidkv: option floor_alpha=0.5 belongs to head_alloc=ada"),
        ("pyramidkv", {"beta": 0}, "pyramidkv: beta must be an integer ≥ 1, got 0"),
        ("ada-snapkv", {"floor_alpha": 1.5}, "ada-snapkv: floor_alpha must be in [0, 1], got 1.5"),
        ("lava", {"beta": 5}, "lava: option beta=5 belongs to layer_alloc=pyramid"),
        ("snapkv", {"layer_alloc": 3}, "snapkv: layer_alloc must be uniform or pyramid, got 3"),
    ],
)
def test_a_bad_allocator_value_names_method_option_and_value(name, options, words):
    with pytest.raises(MethodOptionError) as err:
        make_method(name, **options)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_option_errors_and_unknown_methods_are_different_errors():
    with pytest.raises(MethodOptionError) as err:
        make_method("snapkv", window="many")
    assert isinstance(err.value, KVBudgetError) and not isinstance(err.value, UnknownMethodError)
    assert (err.value.method, err.value.option, err.value.value) == ("snapkv", "window", "many")
    with pytest.raises(UnknownMethodError, match="unknown method 'snapkv-ada'"):
        make_method("snapkv-ada")
    with pytest.raises(MethodOptionError, match="unknown option"):
        make_method("snapkv", alloc="pyramid")


def test_an_inactive_allocator_parameter_at_its_default_is_accepted():
    make_method("pyramidkv", layer_alloc="uniform")  # beta stays at its default: accepted
    assert (
        "beta" not in make_method("snapkv").options() and "floor_alpha" not in make_method("snapkv").options()
    )
    assert make_method("ada-pyramidkv").options()["beta"] == 20


# ------------------------------------------------------------------------------ CLI and layering
def test_cli_composes_and_refuses_allocators(tmp_path):
    runner = CliRunner()
    listing = runner.invoke(app, ["methods"])
    assert listing.exit_code == 0
    assert "layer_alloc" in listing.output and "head_alloc" in listing.output
    assert "ada-pyramidkv" in listing.output and "= snapkv +" in listing.output
    context = tmp_path / "c.txt"
    context.write_text("A context about foxes. " * 20)
    refused = runner.invoke(
        app, ["generate", "--context-file", str(context), "--method", "h2o", "--opt", "layer_alloc=pyramid"]
    )
    assert refused.exit_code == 2
    assert "h2o: option layer_alloc does not apply" in refused.output


def test_lookahead_does_not_import_the_registry():
    source = Path(kvbudget.methods.lookahead.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert not any(name.startswith("kvbudget.methods.registry") for name in imported), imported
    clone = make_method("laq", lookahead_method="ada-pyramidkv", lookahead_window=4).clone_method()
    assert (
        clone.name == "ada-pyramidkv" and clone.options() == make_method("ada-pyramidkv", window=4).options()
    )


def test_method_spec_lives_beside_the_registry():
    from kvbudget.eval.runner import MethodSpec as FromRunner
    from kvbudget.methods.spec import MethodSpec

    assert FromRunner is MethodSpec
    spec = MethodSpec.parse("snapkv:layer_alloc=pyramid,head_alloc=ada")
    assert spec.options == (("layer_alloc", "pyramid"), ("head_alloc", "ada"))
    assert spec.label == "snapkv:layer_alloc=pyramid,head_alloc=ada"
    built = spec.build()
    assert (built.layer_alloc, built.head_alloc) == ("pyramid", "ada")
    with pytest.raises(MethodOptionError, match="h2o: option head_alloc does not apply"):
        MethodSpec.parse("h2o:head_alloc=ada")
