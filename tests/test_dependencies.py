"""``pip install kvbudget`` installs what compressing a cache needs and no more.

The **core** is every module of ``src/kvbudget`` but the harness: the extras' subpackages
(``kvbudget.eval``, ``kvbudget.bench``, ``kvbudget.peer``: kvpress beside them) and
:data:`HARNESS_MODULES`. The core's third-party imports,
read with ``ast``, must be exactly ``pyproject.toml``'s ``dependencies`` (less :data:`USED_BY_TRANSFORMERS`,
declared for transformers' sake). A core module reaches the harness and the extras' packages only
inside :func:`kvbudget.extras.needs_extra` — a function it decorates or a ``with`` block — so that
without the extra the user gets one line naming it. ``kvbudget.extras.EXTRAS`` names the same
packages as ``pyproject.toml``'s extras, and the harness imports only what core and extras declare.
Last, the core really imports with every extra's package blocked, and ``kvbudget eval`` then prints
the hint.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from kvbudget.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

#: Distribution names whose import name is not the name lower-cased with ``-`` → ``_``.
IMPORT_NAMES = {"rouge-score": "rouge_score", "pyyaml": "yaml", "pillow": "PIL", "scikit-learn": "sklearn"}

#: Core dependencies kvbudget never imports, each with why it is declared.
USED_BY_TRANSFORMERS = {
    "gguf": "transformers imports it to read a .gguf file (load_model, `kvbudget fetch model`)",
    "accelerate": "transformers refuses gguf_file= without it ('accelerate is required when loading a "
    "GGUF file', modeling_utils)",
}

#: Harness modules outside ``eval/`` and ``bench/``: they import the harness at module level.
HARNESS_MODULES = {
    "kvbudget.tuning": "BaKlaVa's Algorithm 3 scores perplexity through kvbudget.eval.tasks.perplexity",
    "kvbudget.demo": "runs the needle table and the demo suite of the evaluation harness",
}

#: Harness imports no extra declares, each with why.
UNDECLARED_HARNESS_IMPORTS = {
    "kvpress": "imported only by peer/kvpress_runner.py, which runs inside .venv-peer (make peer)",
    "openvino": "imported only by peer/openvino_runner.py, which runs inside .venv-ov (make ov)",
    "openvino_genai": "imported only by peer/openvino_runner.py, which runs inside .venv-ov (make ov)",
    "datasets": "eval/longbench.py reads a Hugging Face dataset directory with it, for users who give one",
}


def _import_name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower()
    return IMPORT_NAMES.get(name, name.replace("-", "_").replace(".", "_"))


def core_dependencies() -> dict[str, str]:
    """Import name -> distribution name of ``[project] dependencies``."""
    return {
        _import_name(req): re.match(r"[A-Za-z0-9._-]+", req).group(0)
        for req in PYPROJECT["project"]["dependencies"]
    }


def extra_dependencies() -> dict[str, set[str]]:
    """Each extra's import names (a reference to another extra of kvbudget is left out)."""
    return {
        extra: {_import_name(req) for req in reqs if _import_name(req) != "kvbudget"}
        for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items()
    }


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_harness(module: str) -> bool:
    return module in HARNESS_MODULES or module.split(".")[:2] in (
        ["kvbudget", "eval"],
        ["kvbudget", "bench"],
        ["kvbudget", "peer"],
    )


def _needs_extra_call(node: ast.AST) -> str | None:
    """The extra named by ``needs_extra("eval", ...)``, or ``None`` when ``node`` is no such call."""
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name == "needs_extra" and node.args and isinstance(node.args[0], ast.Constant):
            return node.args[0].value
    return None


def imports_of(source: str) -> list[tuple[str, int, str | None]]:
    """``(imported module, line, guard)`` of every absolute import. ``guard`` is the extra of the
    enclosing ``needs_extra`` (decorator or ``with``), ``"TYPE_CHECKING"`` under that ``if``, or
    ``None``."""
    found: list[tuple[str, int, str | None]] = []

    def visit(node: ast.AST, guard: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            guard = next((e for d in node.decorator_list if (e := _needs_extra_call(d))), guard)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            guard = next((e for item in node.items if (e := _needs_extra_call(item.context_expr))), guard)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, "TYPE_CHECKING")
            for child in node.orelse:
                visit(child, guard)
            return
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno, guard) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno, guard))
        for child in ast.iter_child_nodes(node):
            visit(child, guard)

    visit(ast.parse(source), None)
    return found


def _third_party(module: str) -> str | None:
    top = module.split(".")[0]
    return None if top in sys.stdlib_module_names or top in ("kvbudget", "__future__") else top


def boundary_problems(modules: dict[str, str]) -> tuple[dict[str, set[str]], list[str]]:
    """For ``{module name: source}``: the core's unguarded third-party imports (import name -> where),
    and each import that crosses the core/extras boundary without the right ``needs_extra``."""
    extras = extra_dependencies()
    core_imports: dict[str, set[str]] = {}
    crossings: list[str] = []
    for module, source in modules.items():
        if is_harness(module):
            continue
        for imported, line, guard in imports_of(source):
            where = f"{module}:{line}"
            package = _third_party(imported)
            if guard == "TYPE_CHECKING":
                continue
            harness = imported.startswith("kvbudget.") and is_harness(imported)
            if package is None and not harness:
                continue
            if guard is None:
                if harness:
                    crossings.append(f"{where} imports the harness module {imported} outside needs_extra")
                else:
                    core_imports.setdefault(package, set()).add(where)
            elif package is not None and package not in extras.get(guard, set()):
                crossings.append(f"{where} imports {package} under needs_extra({guard!r}), which lacks it")
    return core_imports, crossings


def source_modules() -> dict[str, str]:
    return {_module_name(p): p.read_text(encoding="utf-8") for p in sorted((SRC / "kvbudget").rglob("*.py"))}


def test_core_dependencies_are_exactly_what_the_core_imports() -> None:
    declared = core_dependencies()
    imported, _ = boundary_problems(source_modules())
    undeclared = {name: sorted(where) for name, where in imported.items() if name not in declared}
    assert not undeclared, (
        f"core modules import packages pyproject.toml does not declare: {undeclared} — declare them in "
        "[project] dependencies, or move the import into the harness or inside needs_extra(...)"
    )
    unused = sorted(set(declared) - set(imported) - set(USED_BY_TRANSFORMERS))
    assert not unused, (
        f"pyproject.toml declares core dependencies no core module imports: {unused} — move them to the "
        "extra that uses them, or list them in USED_BY_TRANSFORMERS with the reason"
    )
    stale = sorted(set(USED_BY_TRANSFORMERS) - set(declared))
    assert not stale, f"USED_BY_TRANSFORMERS names packages that are not declared: {stale}"
    assert not set(USED_BY_TRANSFORMERS) & set(imported), (
        "imported after all: drop it from USED_BY_TRANSFORMERS"
    )


def test_the_core_reaches_the_harness_and_extras_only_under_needs_extra() -> None:
    _, crossings = boundary_problems(source_modules())
    assert not crossings, "\n".join(crossings)


def test_the_check_fails_on_an_undeclared_or_unguarded_import() -> None:
    """The two checks above on made-up modules: each kind of mistake is caught, the right form is not."""
    unguarded = "import torch\nimport matplotlib\n\ndef f():\n    import rapidfuzz\n"
    imported, crossings = boundary_problems({"kvbudget.engine": unguarded})
    assert set(imported) == {"torch", "matplotlib", "rapidfuzz"} and not crossings
    assert "matplotlib" not in core_dependencies()  # so the first test fails on it
    guarded = textwrap.dedent(
        """
        from kvbudget.extras import needs_extra

        @needs_extra("eval", "kvbudget x")
        def command():
            import matplotlib
            from kvbudget.eval.runner import run_eval

        def helper():
            with needs_extra("eval", "reading R data"):
                import rdata
            with needs_extra("ray", "distributed runs"):
                import rouge_score
            from kvbudget.bench.grid import run_bench
        """
    )
    imported, crossings = boundary_problems({"kvbudget.cli": guarded, "kvbudget.eval.x": "import pandas\n"})
    assert imported == {}  # the harness module's import is not the core's
    assert len(crossings) == 2
    assert "rouge_score under needs_extra('ray')" in crossings[0]
    assert "harness module kvbudget.bench.grid outside needs_extra" in crossings[1]


def test_the_extras_hints_name_the_packages_pyproject_declares() -> None:
    declared = extra_dependencies()
    runtime = {extra: names for extra, names in declared.items() if extra != "dev"}
    assert set(runtime) == set(EXTRAS), (
        f"pyproject.toml's extras {sorted(runtime)} and kvbudget.extras.EXTRAS {sorted(EXTRAS)} differ"
    )
    for extra, (_, names) in EXTRAS.items():
        assert set(names) == runtime[extra], (
            f"EXTRAS[{extra!r}] lists {sorted(names)}, pyproject {sorted(runtime[extra])}"
        )
    assert not set(core_dependencies()) & set().union(*runtime.values()), "a package is both core and extra"


def test_the_harness_imports_only_declared_packages() -> None:
    declared = set(core_dependencies()).union(*extra_dependencies().values()) - {
        "pytest",
        "hypothesis",
        "ruff",
    }
    undeclared = {}
    for module, source in source_modules().items():
        if not is_harness(module):
            continue
        for imported, line, guard in imports_of(source):
            package = _third_party(imported)
            if (
                package
                and guard != "TYPE_CHECKING"
                and package not in declared | set(UNDECLARED_HARNESS_IMPORTS)
            ):
                undeclared.setdefault(package, []).append(f"{module}:{line}")
    assert not undeclared, f"the harness imports packages no extra declares: {undeclared}"
    assert set(HARNESS_MODULES) <= set(source_modules()), "HARNESS_MODULES names a module that does not exist"


def test_the_core_imports_and_eval_stops_with_one_line_without_the_extras() -> None:
    """In a fresh interpreter where the extras' packages (and what rdata pulls in) cannot be imported:
    every core module imports, and ``kvbudget eval`` prints one line naming the extra, exit code 2."""
    blocked = sorted(
        set().union(*(names for _, names in EXTRAS.values())) - {"numpy", "tqdm"} | {"pandas", "xarray"}
    )
    core = sorted(m for m in source_modules() if not is_harness(m))
    code = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {blocked!r}:
            sys.modules[name] = None  # `import name` raises ImportError; find_spec finds nothing
        for module in {core!r}:
            importlib.import_module(module)
        from kvbudget.cli import app
        app(["eval", "--tasks", "needle", "--out", sys.argv[1]])
        """
    )
    # numpy and tqdm stay importable: transformers needs them itself, so they are always installed.
    done = subprocess.run([sys.executable, "-c", code, "/nonexistent/run"], capture_output=True, text=True)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        "error: kvbudget eval needs the evaluation extra: pip install 'kvbudget[eval]'"
    )
    assert "matplotlib" in lines[0]  # it names what is missing
