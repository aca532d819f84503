"""The methods tables of README.md and docs/methods.md, generated from the method registry:

    .venv/bin/python scripts/methods_tables.py [--update]

Without --update it prints every table in its ``<!-- methods:NAME -->`` block; with it, it rewrites
those blocks in README.md and docs/methods.md (``--update FILE ...`` for other files).
``tests/test_methods_tables.py`` fails when the committed blocks differ from what this generates.

What each block reads (a method's metadata is on its class, or on its named combination where it
differs: ``kvbudget.methods.registry.method_info``):

* ``methods:table`` (README.md): every registry name, in registry order, with its stages, ``summary``
  and ``paper``.
* ``methods:index`` (docs/methods.md): one row per section of docs/methods.md, in the page's order,
  with the methods whose file the section's opening paragraph links, their papers and their
  authors' code (``code``); a method whose file no section links gets a last row that points at
  its docstring.
* ``methods:allocators``: the classes that take the allocator options, grouped by the values
  (``layer_allocators``, ``head_allocators``, ``allocator_params``).
* ``methods:combinations``: the named combinations, each as its base and options.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from kvbudget.methods.combinations import COMBINATIONS
from kvbudget.methods.registry import METHOD_CLASSES, make_method, method_info, method_names

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
METHODS_MD = ROOT / "docs" / "methods.md"

#: what an allocator value is, beside its name in the allocator table
ALLOCATOR_NOTES = {"entropy": "cascading", "flat": "LAVa's Alg. 1"}


# ------------------------------------------------------------------------------------------ cells
def paper_cell(paper: str) -> str:
    """``arXiv:ID`` → a link to arxiv.org; ``TEXT, openreview ID`` and ``TEXT, host/path`` → TEXT linked;
    anything else as written; no paper → ``–``."""
    if paper in ("", "-"):
        return "–"
    arxiv = re.fullmatch(r"arXiv:(\S+)", paper)
    if arxiv:
        return f"[{paper}](https://arxiv.org/abs/{arxiv.group(1)})"
    text, _, where = paper.rpartition(", ")
    if text and where.startswith("openreview "):
        return f"[{text}](https://openreview.net/forum?id={where.removeprefix('openreview ')})"
    if text and re.fullmatch(r"[\w.-]+\.[a-z]+/\S+", where):
        return f"[{text}](https://{where})"
    return paper


def code_cell(code: str) -> str:
    return f"[{code}](https://github.com/{code})" if code else "—"


def stages_cell(name: str) -> str:
    """``prefill + decode``; ``prefill (cascading)`` for a cascading method; ``prune (2 passes)``;
    ``–`` for none. Read from a default object (LAVa is cascading only with its entropy layers)."""
    method = make_method(name)
    parts = []
    for stage in method.stages:
        text = stage.replace("_", "-")
        if stage == "prefill" and method.cascading:
            text += " (cascading)"
        if stage == "prune" and getattr(method, "two_pass", False):
            text += " (2 passes)"
        parts.append(text)
    return " + ".join(parts) or "–"


def _unique(values: list[str]) -> list[str]:
    return [v for v in dict.fromkeys(values) if v]


# ------------------------------------------------------------------------------------------ blocks
def readme_table() -> list[str]:
    lines = ["| name | stages | what it does | paper |", "|---|---|---|---|"]
    for name in method_names():
        info = method_info(name)
        lines.append(f"| `{name}` | {stages_cell(name)} | {info.summary} | {paper_cell(info.paper)} |")
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def sections(markdown: str) -> list[tuple[str, set[str]]]:
    """Each ``## `` section of docs/methods.md with the method modules its opening paragraph links
    (``[x.py](../src/kvbudget/methods/x.py)``), in the page's order."""
    found = []
    for match in re.finditer(r"^## (.+)\n\n((?:.+\n)+)", markdown, re.M):
        modules = set(re.findall(r"\(\.\./src/kvbudget/methods/(\w+)\.py\)", match.group(2)))
        found.append((match.group(1).strip(), modules))
    return found


def index_table(markdown: str) -> list[str]:
    owner: dict[str, str] = {}
    for heading, modules in sections(markdown):
        for module in modules:
            owner.setdefault(module, heading)
    rows: dict[str, list[str]] = {heading: [] for heading, _ in sections(markdown)}
    orphans: list[str] = []
    for name in method_names():
        module = method_info(name).cls.__module__.rpartition(".")[2]
        (rows[owner[module]] if module in owner else orphans).append(name)
    lines = ["| section | methods | paper | authors' code |", "|---|---|---|---|"]

    def row(first: str, names: list[str]) -> str:
        infos = [method_info(n) for n in names]
        linked = [paper_cell(p) for p in _unique([i.paper for i in infos])]
        papers = ", ".join(cell for cell in linked if cell.startswith("["))  # references only
        codes = ", ".join(code_cell(c) for c in _unique([i.code for i in infos])) or "—"
        return f"| {first} | {', '.join(f'`{n}`' for n in names)} | {papers or '–'} | {codes} |"

    for heading, names in rows.items():
        if names:
            lines.append(row(f"[{heading}](#{slug(heading)})", names))
    if orphans:
        lines.append(
            row("no section yet: see the docstrings in [methods/](../src/kvbudget/methods/)", orphans)
        )
    return lines


def allocators_table() -> list[str]:
    groups: dict[tuple, list[str]] = {}
    for name, cls in METHOD_CLASSES.items():
        if not cls.layer_allocators:
            continue
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        params = tuple((p, defaults[p], owner) for p, (_, owner) in cls.allocator_params.items())
        layer = tuple(sorted(cls.layer_allocators, key=lambda v: v != defaults["layer_alloc"]))
        head = tuple(sorted(cls.head_allocators, key=lambda v: v != defaults["head_alloc"]))
        groups.setdefault((layer, head, params), []).append(name)
    lines = [
        "| method | `layer_alloc` (first = default) | `head_alloc` (first = default) | parameters |",
        "|---|---|---|---|",
    ]

    def values(names: tuple[str, ...]) -> str:
        return ", ".join(f"`{v}` ({ALLOCATOR_NOTES[v]})" if v in ALLOCATOR_NOTES else f"`{v}`" for v in names)

    for (layer, head, params), names in groups.items():
        parameters = ", ".join(f"`{p}` ({default}, with `{owner}`)" for p, default, owner in params) or "—"
        lines.append(
            f"| {', '.join(f'`{n}`' for n in names)} | {values(layer)} | {values(head)} | {parameters} |"
        )
    return lines


def combinations_table() -> list[str]:
    lines = ["| name | is |", "|---|---|"]
    for name in method_names():
        if name in COMBINATIONS:
            combined = COMBINATIONS[name]
            options = ", ".join(f"{k}={v}" for k, v in combined.options.items())
            lines.append(f"| `{name}` | `{combined.base}` + `{options}` |")
    return lines


def blocks(methods_markdown: str) -> dict[str, list[str]]:
    """Every generated block by name (the ``NAME`` of its ``<!-- methods:NAME -->`` markers);
    ``methods_markdown`` is docs/methods.md's text, whose sections the index lists."""
    return {
        "table": readme_table(),
        "index": index_table(methods_markdown),
        "allocators": allocators_table(),
        "combinations": combinations_table(),
    }


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- methods:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /methods:{re.escape(name)} -->)", re.S
    )


def rewrite(text: str, tables: dict[str, list[str]]) -> tuple[str, list[str]]:
    """``text`` with each ``<!-- methods:NAME -->`` … ``<!-- /methods:NAME -->`` block replaced by
    its table, and the names of the blocks found."""
    found = []
    for name, lines in tables.items():
        body = "\n".join(lines) + "\n"
        text, n = _pattern(name).subn(lambda m, body=body: m.group(1) + body + m.group(2), text)
        if n:
            found.append(name)
    return text, found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--update", type=Path, nargs="*", default=None,
        help="rewrite the blocks of these files (default: README.md and docs/methods.md)",
    )  # fmt: skip
    args = parser.parse_args()
    tables = blocks(METHODS_MD.read_text(encoding="utf-8"))
    if args.update is None:
        for name, lines in tables.items():
            print(f"<!-- methods:{name} -->\n" + "\n".join(lines) + f"\n<!-- /methods:{name} -->\n")
        return
    for path in args.update or [README, METHODS_MD]:
        text = path.read_text(encoding="utf-8")
        new, found = rewrite(text, tables)
        if new != text:
            path.write_text(new, encoding="utf-8")
        print(f"{path}: {', '.join(found) or 'no methods block'}{'' if new != text else ' (unchanged)'}")


if __name__ == "__main__":
    main()
