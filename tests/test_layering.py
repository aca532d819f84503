"""Modules import only downward: every module of ``src/kvbudget`` sits in one layer of ``LAYERS`` and
imports only from its own layer or lower ones.

The imports are read with ``ast`` from the source, so every import counts: at the top of the
module, inside a function, and under ``if TYPE_CHECKING:``. ``from kvbudget import data`` is an
import of the module ``kvbudget.data``; ``import kvbudget`` and ``from kvbudget import load_model``
import the package's public façade (``kvbudget/__init__.py``), which sits in the top layer.
Modules reached only through ``importlib`` (the task registry's task modules) are not seen.

Layers name folders (``kvbudget.methods.*``: the methods, ``kvbudget.prefill.*``, ``kvbudget.eval.*``,
``kvbudget.bench.*``, ...), so a new file in a folder is placed by where it lives; a new top-level
module fails :func:`test_every_module_is_placed_in_a_layer` until it is added to ``LAYERS``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: (layer, its modules), lowest first. A module may import from its own layer and every layer above
#: it in this list, never from one below it. An entry ``kvbudget.pkg.*`` is a folder: the package and
#: every module under it, so a new file there needs no entry; a module named explicitly (or under a
#: longer folder entry) belongs to that entry's layer instead.
LAYERS: list[tuple[str, list[str]]] = [
    (
        "foundations",
        [
            "kvbudget.errors",
            "kvbudget.version",
            "kvbudget.units",
            "kvbudget.architectures",
            "kvbudget.extras",
            "kvbudget.cpu_matmul",
            "kvbudget.phases",
        ],
    ),
    ("artifacts", ["kvbudget.artifacts", "kvbudget.profile_prompts"]),
    ("models and data", ["kvbudget.models", "kvbudget.data"]),
    ("quantization", ["kvbudget.quantization", "kvbudget.quantized_store"]),
    (
        "cache",
        [
            "kvbudget.cache_storage",
            "kvbudget.cache_layer",
            "kvbudget.cache",
            "kvbudget.static_cache",
            "kvbudget.joined_cache",
            "kvbudget.byte_budget",
            "kvbudget.shared_prefix",
        ],
    ),
    ("fused quantized read", ["kvbudget.quantized_read"]),
    ("masks", ["kvbudget.masks"]),
    ("attention", ["kvbudget.attention"]),
    ("observation", ["kvbudget.observation"]),
    ("session", ["kvbudget.session"]),
    ("method parts", ["kvbudget.scoring", "kvbudget.selection", "kvbudget.allocation", "kvbudget.merging"]),
    ("profiles", ["kvbudget.profiles"]),
    ("method interface", ["kvbudget.methods", "kvbudget.methods.base", "kvbudget.methods.prune_base"]),
    # the prefill's shared steps and its recording prefill sit with the methods: KVzap records one
    # while it starts
    ("methods", ["kvbudget.methods.*", "kvbudget.prefill.common", "kvbudget.prefill.record"]),
    ("prefill", ["kvbudget.prefill.*"]),
    ("cache files", ["kvbudget.cache_files"]),
    ("static decode", ["kvbudget.static_decode"]),
    ("engine", ["kvbudget.engine"]),
    ("transformers-native use", ["kvbudget.native"]),
    ("serving", ["kvbudget.serve.*"]),
    ("kvpress environment", ["kvbudget.peer.*"]),
    ("evaluation parts", ["kvbudget.eval.*"]),
    (
        "evaluation runner and peer rows",
        [
            "kvbudget.eval.runner",
            "kvbudget.eval.suites",
            "kvbudget.eval.distributed",
            "kvbudget.eval.peer_rows",
        ],
    ),
    ("benchmarks and tuning", ["kvbudget.bench.*", "kvbudget.tuning", "kvbudget.kvzap_training"]),
    ("demo and CLI checks", ["kvbudget.demo", "kvbudget.cli.checks"]),
    ("entry points", ["kvbudget.cli.*", "kvbudget"]),
]

#: Private names (a leading underscore) one module imports from another, each with why it may.
PRIVATE_IMPORTS_ALLOWED: dict[tuple[str, str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    return {_module_name(path): path for path in sorted((SRC / "kvbudget").rglob("*.py"))}


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` of every kvbudget import in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [
                (alias.name, "", node.lineno)
                for alias in node.names
                if alias.name.split(".")[0] == "kvbudget"
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin.split(".")[0] != "kvbudget":
                continue
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                found.append(
                    (submodule, "", node.lineno) if submodule in known else (origin, alias.name, node.lineno)
                )
    return found


def _layer_of(modules: list[str] | None = None) -> dict[str, int]:
    """Each module's layer index: its explicit entry, else its longest folder entry (``pkg.*``)."""
    modules = list(source_modules()) if modules is None else modules
    explicit = {m: index for index, (_, names) in enumerate(LAYERS) for m in names if not m.endswith(".*")}
    folders = [(m[:-2], index) for index, (_, names) in enumerate(LAYERS) for m in names if m.endswith(".*")]
    layer_of = dict(explicit)
    for module in modules:
        if module in explicit:
            continue
        matches = [(len(f), index) for f, index in folders if module == f or module.startswith(f + ".")]
        if matches:
            layer_of[module] = max(matches)[1]
    return layer_of


def test_every_module_is_placed_in_a_layer() -> None:
    listed = [module for _, modules in LAYERS for module in modules]
    assert len(listed) == len(set(listed)), (
        f"modules listed twice in LAYERS: {sorted(m for m in listed if listed.count(m) > 1)}"
    )
    modules = source_modules()
    layer_of = _layer_of(list(modules))
    unplaced = sorted(set(modules) - set(layer_of))
    assert not unplaced, (
        f"modules in no layer: {', '.join(unplaced)} — place each (or its folder, ``pkg.*``) in LAYERS of "
        "tests/test_layering.py, in the lowest layer that holds everything it imports"
    )
    stale = sorted(m.removesuffix(".*") for m in listed if m.removesuffix(".*") not in modules)
    assert not stale, f"LAYERS lists modules or folders that do not exist: {', '.join(stale)} — remove them"


def test_modules_import_only_from_their_layer_or_lower() -> None:
    layer_of = _layer_of()
    modules = source_modules()
    upward, unknown = [], []
    for module, path in modules.items():
        if module not in layer_of:
            continue  # reported by test_every_module_is_placed_in_a_layer
        for target, _, line in _imports(module, path, set(modules)):
            if target not in modules:
                unknown.append(f"{module}:{line} imports {target}, which is no module of the package")
            elif target in layer_of and layer_of[target] > layer_of[module]:
                upward.append(
                    f"{module}:{line} ({LAYERS[layer_of[module]][0]}) imports {target} "
                    f"({LAYERS[layer_of[target]][0]}, a higher layer)"
                )
    assert not unknown, "\n".join(unknown)
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(set(upward)))


def test_no_module_imports_a_private_name_of_another() -> None:
    modules = source_modules()
    private = []
    for module, path in modules.items():
        for target, name, line in _imports(module, path, set(modules)):
            if name.startswith("_") and not name.startswith("__") and target != module:
                if (module, target, name) not in PRIVATE_IMPORTS_ALLOWED:
                    private.append(f"{module}:{line} imports {target}.{name}")
    assert not private, (
        "private names imported across modules (make them public or move them):\n" + "\n".join(private)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from kvbudget import data\n", [("kvbudget.data", "")]),
        ("import kvbudget\n", [("kvbudget", "")]),
        ("from kvbudget import load_model\n", [("kvbudget", "load_model")]),
        ("def f():\n    from kvbudget.engine import prefill\n", [("kvbudget.engine", "prefill")]),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvbudget.session import S\n",
            [("kvbudget.session", "S")],
        ),
        ("from . import tasks\n", [("kvbudget.eval.tasks", "")]),
        ("from .tasks.base import TaskSpec\n", [("kvbudget.eval.tasks.base", "TaskSpec")]),
        ("import torch\nfrom transformers import Cache\n", []),
    ],
)
def test_imports_are_read_wherever_they_are(tmp_path: Path, source: str, expected: list) -> None:
    """The reader sees nested, TYPE_CHECKING and relative imports (here as if in kvbudget/eval/runner.py)."""
    path = tmp_path / "runner.py"
    path.write_text(source, encoding="utf-8")
    known = {"kvbudget", "kvbudget.data", "kvbudget.engine", "kvbudget.session", "kvbudget.eval.tasks"}
    known |= {"kvbudget.eval.tasks.base"}
    assert [(t, n) for t, n, _ in _imports("kvbudget.eval.runner", path, known)] == expected


def test_no_import_circles() -> None:
    """No module reaches itself through imports (any import: top level, nested or TYPE_CHECKING)."""
    modules = source_modules()
    known = set(modules)
    graph = {
        module: {target for target, _, _ in _imports(module, path, known) if target in known} - {module}
        for module, path in modules.items()
    }
    circles = []
    for start in graph:  # a depth-first search from each module for a path back to it
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" → ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles))[:20])
