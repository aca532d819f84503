"""README.md's methods table and docs/methods.md's index, allocator and combination tables are what
``scripts/methods_tables.py`` generates from the registry; each method's metadata is on its class.

When a test here fails after a method changed or was added, run
``.venv/bin/python scripts/methods_tables.py --update`` and commit README.md and docs/methods.md.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvbudget.methods.combinations import COMBINATIONS
from kvbudget.methods.registry import METHOD_CLASSES, method_info, method_names

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "methods_tables.py"


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("methods_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("path", "names"),
    [("README.md", ["table"]), ("docs/methods.md", ["index", "allocators", "combinations"])],
)
def test_committed_tables_are_what_the_registry_generates(tables, path: str, names: list[str]) -> None:
    text = (ROOT / path).read_text(encoding="utf-8")
    generated = tables.blocks((ROOT / "docs" / "methods.md").read_text(encoding="utf-8"))
    rewritten, found = tables.rewrite(text, generated)
    assert set(names) <= set(found), (
        f"{path} lacks the <!-- methods:NAME --> blocks {set(names) - set(found)}"
    )
    assert rewritten == text, f"{path} drifted from the registry: run scripts/methods_tables.py --update"


def test_the_readme_table_lists_every_registered_name_once(tables) -> None:
    rows = [line for line in tables.readme_table()[2:]]
    assert [re.match(r"\| `([^`]+)` \|", row).group(1) for row in rows] == method_names()
    assert all(row.count(" | ") == 3 for row in rows), "a summary holds a '|'"


def test_a_changed_summary_shows_as_drift(tables) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    edited = text.replace("| keeps everything (reference) |", "| keeps it all |")
    assert edited != text
    rewritten, _ = tables.rewrite(edited, tables.blocks((ROOT / "docs" / "methods.md").read_text()))
    assert rewritten == text


def test_the_index_places_a_method_by_the_file_its_section_links(tables) -> None:
    markdown = "# t\n\n## Alpha\n\n[snapkv.py](../src/kvbudget/methods/snapkv.py).\n\nMore.\n"
    index = tables.index_table(markdown)
    assert index[2].startswith("| [Alpha](#alpha) | `snapkv`, `pyramidkv`, `ada-snapkv`, `ada-pyramidkv` |")
    assert index[3].startswith("| no section yet") and "`lava`" in index[3] and "`snapkv`" not in index[3]


@pytest.mark.parametrize(
    ("paper", "cell"),
    [
        ("arXiv:2404.14469", "[arXiv:2404.14469](https://arxiv.org/abs/2404.14469)"),
        ("Qin et al., ICLR 2025, openreview EQgEMAD4kv", "[Qin et al., ICLR 2025](https://openreview.net/forum?id=EQgEMAD4kv)"),
        ("ASL (Taniguchi et al.), github.com/TANIGUCHIREI/ASL", "[ASL (Taniguchi et al.)](https://github.com/TANIGUCHIREI/ASL)"),
        ("-", "–"),
        ("sanity baseline", "sanity baseline"),
    ],
)  # fmt: skip
def test_paper_cells_link_the_reference(tables, paper: str, cell: str) -> None:
    assert tables.paper_cell(paper) == cell


@pytest.mark.parametrize("name", sorted(METHOD_CLASSES))
def test_every_method_class_states_its_own_metadata(name: str) -> None:
    """The summary is the class's own (not its base's), one line; a kvpress counterpart is never
    inherited silently from the base (LAQ extends SnapKV but is not SnapKVPress)."""
    cls = METHOD_CLASSES[name]
    assert "summary" in vars(cls) and cls.summary and "\n" not in cls.summary, name
    if cls.kvpress:
        assert "kvpress" in vars(cls), f"{name} inherits kvpress={cls.kvpress!r}: set it on the class"
    assert not cls.code or re.fullmatch(r"[\w.-]+/[\w.-]+", cls.code), cls.code
    assert isinstance(cls.exceeds_budget, bool) and isinstance(cls.small_options, dict)


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_every_combination_has_its_own_summary(name: str) -> None:
    info = method_info(name)
    assert info.summary and info.summary != info.cls.summary and info.paper
