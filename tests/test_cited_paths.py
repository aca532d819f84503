"""Every file path the repository cites — in its docs, docstrings, comments and scripts — exists in it.

The tracked Python, Markdown, TOML and shell files and the Makefile are read for what looks like a
path of this repository:

* a path from the root: ``src/…``, ``tests/…``, ``docs/…``, ``lab/…``, ``scripts/…`` or ``runs/…``
  ending in a file extension or a ``/``;
* a path inside the package, as docstrings write them: ``methods/lava.py``, ``prefill/pruned.py``,
  ``kvbudget/__init__.py`` (resolved in ``src/`` and ``src/kvbudget/``);
* a relative link of a Markdown file (``[text](../lab/README.md)``), resolved from its folder;
* a bare upper-case Markdown name (``README.md``, ``CONTRIBUTING.md``), resolved from the citing
  file's folder, the root or ``docs/``.

A path is not checked where it is a pattern or made at run time: a glob (``*``), a placeholder
(``<name>``, ``{name}``, ``$VAR``, ``…``) right after it, part of a URL or of a longer path (after
``/``, ``~``, ``$`` or ``.``). A path that git ignores is an output (``runs/…``, a results file kept
out of the repository) and is not checked either; :data:`GENERATED` lists the few outputs cited
that no ignore rule covers.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvbudget"

#: the files read for citations: these suffixes, and the Makefile
SUFFIXES = (".py", ".md", ".toml", ".sh")

#: this file, relative to the root: its examples cite paths that do not exist on purpose
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()
#: paths (from the root) cited as what a command writes that no ignore rule covers, each with why it
#: is not in the tree
GENERATED: dict[str, str] = {}

_PATH_CHARS = r"[A-Za-z0-9_.+/-]"
#: placeholders and globs that may follow a path's start: the path is a pattern, not a file
_PATTERN_NEXT = set("<{*$[…")
#: what may stand right before a path that is part of something longer (a URL, a home or variable path)
_LONGER_BEFORE = r"(?<![A-Za-z0-9_./~$:@-])"
ROOTED = re.compile(_LONGER_BEFORE + rf"((?:src|tests|docs|lab|scripts|runs)/{_PATH_CHARS}*)")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
BARE_MARKDOWN = re.compile(_LONGER_BEFORE + r"([A-Z][A-Z0-9_]*\.md)\b")


def _package_relative() -> re.Pattern[str]:
    """``kvbudget/…`` and ``SUBPACKAGE/…`` for every subpackage of ``src/kvbudget``."""
    subpackages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    prefixes = "|".join(re.escape(name) for name in ["kvbudget", *subpackages])
    return re.compile(_LONGER_BEFORE + rf"((?:{prefixes})/{_PATH_CHARS}*)")


def _tracked_files() -> list[str]:
    """The files git tracks, and those it would track (new, not ignored)."""
    done = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip("not a git checkout: the cited paths are checked in the repository only")
    return [name for name in done.stdout.split("\0") if name]


def _ignored(root: Path, paths: set[str]) -> set[str]:
    """The paths (relative to ``root``) that git's ignore rules cover there."""
    if not paths:
        return set()
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=root, input="\n".join(sorted(paths)) + "\n", capture_output=True, text=True, check=False,
    )  # fmt: skip
    return set(done.stdout.splitlines())


def _clean(token: str) -> str | None:
    """``token`` without the punctuation that ends a sentence around it; ``None`` unless it names a
    file (an extension) or a folder (a trailing ``/``)."""
    token = token.rstrip(".,;:)'\"`")
    last = token.rstrip("/").rsplit("/", 1)[-1]
    if token.endswith("/") or re.search(r"\.[a-z][a-z0-9]*$", last):  # not ``module.Class``
        return token
    return None


def citations(text: str, source: str) -> list[tuple[int, str, list[str]]]:
    """``(line, path as cited, candidates relative to the root)`` for every path ``text`` cites;
    ``source``: the citing file, relative to the root. The citation holds if a candidate exists."""
    folder = Path(source).parent
    package = _package_relative()
    found: list[tuple[int, str, list[str]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        links = list(MARKDOWN_LINK.finditer(line)) if source.endswith(".md") else []
        for link in links:  # a link's target is relative to the Markdown file's folder
            target = link.group(1)
            if re.match(r"[a-z]+:", target) or any(c in target for c in "<{*$"):
                continue  # a URL, a mail address or a pattern
            found.append((number, target, [_normal(folder, target)]))
        for pattern, bases in (
            (ROOTED, [Path()]),
            (package, [Path("src"), Path("src/kvbudget")]),
            (BARE_MARKDOWN, [folder, Path(), Path("docs")]),
        ):
            for match in pattern.finditer(line):
                if any(link.start(1) <= match.start() < link.end() for link in links):
                    continue  # checked as the link above
                after = line[match.end() : match.end() + 1]
                path = _clean(match.group(1))
                if path is None or after in _PATTERN_NEXT or "//" in path:
                    continue
                found.append((number, path, [_normal(base, path) for base in bases]))
    return found


def _normal(base: Path, path: str) -> str:
    """``base / path`` relative to the root with ``..`` and ``.`` resolved (no file system access),
    keeping the trailing ``/`` of a folder."""
    parts: list[str] = []
    for part in (base / path).parts:
        if part == "..":
            if parts:
                parts.pop()
            else:
                parts.append(part)
        elif part != ".":
            parts.append(part)
    return "/".join(parts) + ("/" if path.endswith("/") else "")


def _with_folders(files: list[str]) -> set[str]:
    """``files`` and every folder above them, relative to the root."""
    present = set(files)
    for name in files:
        present.update(parent.as_posix() for parent in Path(name).parents if parent != Path())
    return present


def dangling_citations(root: Path, files: list[str], present: set[str] | None = None) -> list[str]:
    """``file:line: path`` for every cited path of ``files`` (relative to ``root``) that is not in
    ``present`` (the repository's files and folders; default: whatever exists under ``root``) and
    that no ignore rule covers. A clean clone holds only ``present``: an ignored output lying in a
    developer's checkout must not make a citation hold there that fails in CI."""

    def exists(candidate: str) -> bool:
        if present is None:
            return (root / candidate).exists()
        return candidate.rstrip("/") in present

    cited = []
    for name in files:
        path = root / name
        if not (name.endswith(SUFFIXES) or Path(name).name == "Makefile") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        cited += [(name, *citation) for citation in citations(text, name)]
    missing = [
        (name, line, shown, candidates)
        for name, line, shown, candidates in cited
        if not any(exists(c) or c.rstrip("/") in GENERATED for c in candidates)
    ]
    # a folder keeps its trailing ``/``: git matches a folder rule (``/runs/``) against a path that
    # is not on disk only when the path says it is a folder
    ignored = _ignored(root, {c for *_, candidates in missing for c in candidates})
    return [
        f"{name}:{line}: {shown}"
        for name, line, shown, candidates in missing
        if not any(c in ignored for c in candidates)
    ]


def test_every_cited_path_exists() -> None:
    tracked = _tracked_files()
    files = [name for name in tracked if name != THIS_FILE]  # its examples cite missing paths
    missing = dangling_citations(ROOT, files, present=_with_folders(tracked))
    assert not missing, (
        "paths cited in the repository that it does not hold (fix the citation, add the file, or — "
        "for a command's output — list it in GENERATED):\n" + "\n".join(missing)
    )


@pytest.mark.parametrize(
    ("line", "cited"),
    [
        ("see docs/architecture.md, lab/results/gpu/", ["docs/architecture.md", "lab/results/gpu/"]),
        ("(`methods/lava.py`, prefill/pruned.py).", ["methods/lava.py", "prefill/pruned.py"]),
        ("as NOTES.md §10 says", ["NOTES.md"]),
        ("`methods/prune_base.PruneMethod`, kvbudget.cli.app", []),
        ("https://github.com/o/r/blob/main/docs/x.md", []),
        ("lab/results/<name>/ and runs/{run}.json and src/*.py", []),
        ("$KVBUDGET_HOME/profiles/x.json, ~/src/a.py, ../other/docs/b.md", []),
        ("the folder src/kvbudget and the module src/kvbudget/cli", []),
    ],
)
def test_what_counts_as_a_cited_path(line: str, cited: list[str]) -> None:
    assert [path for _, path, _ in citations(line, "src/kvbudget/x.py")] == cited


def test_a_missing_path_is_reported_with_its_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x\n", encoding="utf-8")
    (tmp_path / "a.py").write_text('"""See docs/here.md,\nthen docs/gone.md and NOTES.md."""\n')
    (tmp_path / "b.md").write_text("[here](docs/here.md), [gone](docs/gone.md#part)\n")
    assert dangling_citations(tmp_path, ["a.py", "b.md"]) == [
        "a.py:2: docs/gone.md",
        "a.py:2: NOTES.md",
        "b.md:1: docs/gone.md",
    ]


def test_an_ignored_folder_holds_without_being_on_disk_and_an_untracked_file_does_not(
    tmp_path: Path,
) -> None:
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("/runs/\n", encoding="utf-8")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "kept.md").write_text("x\n", encoding="utf-8")
    (tmp_path / "docs" / "local.md").write_text("x\n", encoding="utf-8")  # on disk, not in the repo
    (tmp_path / "a.md").write_text("runs/ and docs/kept.md, docs/ and docs/local.md\n")
    present = _with_folders(["a.md", "docs/kept.md"])
    assert dangling_citations(tmp_path, ["a.md"], present=present) == ["a.md:1: docs/local.md"]
