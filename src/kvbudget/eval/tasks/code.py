"""Code completion on real source: the interpreter's own standard library (no download).

- ``lcc`` (LongBench LCC style, next-line completion): the context is the first ~``length`` tokens
  of a long stdlib file, cut at the end of a line; the answer is the next non-empty line.
- ``repobench`` (RepoBench-P style, cross-file completion): the context is other files of the
  target's package directory (``email/``, ``asyncio/``, …), each under a ``# path: <relative
  path>`` header — always including the sibling module that defines the identifier the answer
  uses — then the beginning of the target file; the answer is the next line, which uses an
  identifier the target imports from a sibling module (``from .utils import quote``,
  ``from . import utils``, ``from email.utils import quote``).

No answer prefix: the model continues the code; the question is "Complete the next line of code."
Metric: :func:`kvbudget.eval.metrics.edit_similarity` — ``rapidfuzz`` ``fuzz.ratio / 100`` between
the first non-empty line of the prediction and the answer, both stripped (LongBench's
code_sim_score on one line).

Files come from ``sysconfig.get_paths()["stdlib"]``, less ``site-packages``, data tables
(``encodings/``, ``pydoc_data/``), files that are not UTF-8 or do not parse, and test suites
(``test/``, ``tests/``, ``idle_test/``) — except that ``lcc`` falls back to test files once the
library's run out (only three library files exceed 32K tokens). Selection is deterministic: the
sorted file list, permuted by ``seed``, scanned in that order (files smaller than ``length`` bytes
cannot hold ``length`` tokens and are skipped without tokenising). Each sample's ``meta``
records every file's sha256 and the Python version, so results are reproducible and a changed
standard library is detectable.

The cut is the line end nearest ``length`` tokens (within 1.5%; the task tolerance is 2%) whose
next non-empty line starts a statement — not a comment, docstring line or continuation line — so
answers are real code lines; a file with no such cut is skipped.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import os
import platform
import random
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from kvbudget.data import stdlib_root
from kvbudget.errors import InputError
from kvbudget.eval.metrics import edit_similarity
from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.base import TaskSpec
from kvbudget.eval.tasks.infinitebench import TOLERANCE, check_length, count_tokens, fit_units

QUESTION = "Complete the next line of code."
MAX_NEW_TOKENS = 64  # LongBench's dataset2maxlen for lcc and repobench-p
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_EXCLUDED_DIRS = frozenset({"site-packages", "__pycache__", "encodings", "pydoc_data", "__phello__"})
_AIM = 0.015  # cut window; the verified context is within TOLERANCE (2%)


@lru_cache(maxsize=8)
def stdlib_files(root: str | None = None, tests: bool = False) -> tuple[str, ...]:
    """Relative POSIX paths of the eligible ``.py`` files under ``root`` (default: the stdlib), sorted.

    Library files by default; ``tests=True`` lists the test suites' files instead (``test/``,
    ``tests/``, ``idle_test/``).
    """
    base = Path(root) if root else stdlib_root()
    files = []
    for directory, dirs, names in os.walk(base):
        rel_dir = Path(directory).relative_to(base).as_posix()
        parts = [] if rel_dir == "." else rel_dir.split("/")
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS and not (not parts and d.startswith("config-"))]
        if bool(_TEST_DIRS.intersection(parts)) != tests:
            continue
        prefix = "/".join(parts) + "/" if parts else ""
        files.extend(prefix + name for name in names if name.endswith(".py"))
    return tuple(sorted(files))


@dataclass(frozen=True)
class Source:
    """A parsed source file: text, lines (with ends), their start offsets, statement-start lines."""

    rel: str
    text: str
    sha256: str
    lines: tuple[str, ...]
    starts: tuple[int, ...]
    statements: frozenset[int]  # 1-based line numbers where a statement begins (no docstrings)
    tree: ast.Module

    def line_end(self, i: int) -> int:
        """Offset just after line ``i`` (0-based) without its line break."""
        return self.starts[i] + len(self.lines[i].rstrip("\r\n"))


@lru_cache(maxsize=2048)
def load_source(root: str, rel: str) -> Source | None:
    """The parsed file, or None when it is not UTF-8 or does not parse."""
    raw = (Path(root) / rel).read_bytes()
    try:
        text = raw.decode("utf-8")
        tree = ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    lines = tuple(text.splitlines(keepends=True))
    starts, pos = [], 0
    for line in lines:
        starts.append(pos)
        pos += len(line)
    statements = frozenset(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.stmt)
        and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
    )
    return Source(rel, text, hashlib.sha256(raw).hexdigest(), lines, tuple(starts), statements, tree)


@lru_cache(maxsize=256)
def _token_ends_upto(tokenizer: PreTrainedTokenizerBase, root: str, rel: str, limit: int) -> array:
    """End offsets of the tokens of the file's first ``limit`` characters."""
    if not tokenizer.is_fast:
        raise InputError("code tasks need a fast tokenizer (offset mapping)")
    text = load_source(root, rel).text[:limit]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return array("q", (end for _, end in enc["offset_mapping"]))


def token_ends(tokenizer: PreTrainedTokenizerBase, root: str, rel: str, needed: int) -> array:
    """End offsets of the file's tokens, at least the first ``needed`` of them (all if fewer).

    Tokenises a prefix of the file (doubling it as needed) rather than the whole file; offsets
    near the prefix's end may differ from the whole file's, so callers use only the first
    ``needed`` (a 5% margin and 16 tokens are kept beyond).
    """
    size = len(load_source(root, rel).text)
    limit = min(size, max(4096, 8 * needed))
    while True:
        ends = _token_ends_upto(tokenizer, root, rel, limit)
        if limit >= size or len(ends) >= needed * 1.05 + 16:
            return ends
        limit = min(size, 2 * limit)


def _tokens_before(tokenizer: PreTrainedTokenizerBase, root: str, rel: str, offset: int, needed: int) -> int:
    """Tokens of the file before ``offset`` — exact up to ``needed``, otherwise some count > ``needed``."""
    return bisect.bisect_right(token_ends(tokenizer, root, rel, needed), offset)


def _file_meta(source: Source) -> dict:
    return {"file": source.rel, "sha256": source.sha256}


def _next_nonempty(source: Source, i: int) -> int | None:
    for j in range(i + 1, len(source.lines)):
        if source.lines[j].strip():
            return j
    return None


def _is_code_line(source: Source, j: int) -> bool:
    return (j + 1) in source.statements and not source.lines[j].lstrip().startswith("#")


def _check_common(length: int, num_samples: int) -> None:
    check_length(length, 64)
    if num_samples < 1:
        raise InputError(f"num_samples must be at least 1, got {num_samples}")


# --- lcc ------------------------------------------------------------------------------------------


def lcc_sample(
    tokenizer: PreTrainedTokenizerBase, rel: str, length: int, root: str | None = None
) -> Sample | None:
    """An LCC sample from one file, or None when the file cannot give a ``length``-token prefix."""
    root = root or str(stdlib_root())
    source = load_source(root, rel)
    if source is None:
        return None
    ends = token_ends(tokenizer, root, rel, int(length * (1 + _AIM)) + 1)
    if len(ends) < length:
        return None
    candidates = []
    for i in range(len(source.lines)):
        if not source.lines[i].strip():
            continue
        end = source.line_end(i)
        n = bisect.bisect_right(ends, end)
        if n > length * (1 + _AIM):
            break
        if n < length * (1 - _AIM):
            continue
        j = _next_nonempty(source, i)
        if j is not None and _is_code_line(source, j):
            candidates.append((abs(n - length), i, j))
    for _, i, j in sorted(candidates):
        context = source.text[: source.line_end(i)]
        tokens = count_tokens(tokenizer, context)
        if abs(tokens - length) <= TOLERANCE * length:
            return Sample(
                context=context,
                question=QUESTION,
                answers=[source.lines[j].strip()],
                answer_prefix="",
                max_new_tokens=MAX_NEW_TOKENS,
                meta={
                    "task": "lcc",
                    "length": length,
                    **_file_meta(source),
                    "answer_line": j + 1,
                    "context_tokens": tokens,
                    "python": platform.python_version(),
                },
            )
    return None


def _lcc_make_samples(
    tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
) -> list[Sample]:
    _check_common(length, num_samples)
    root = str(stdlib_root())
    files = []
    for tests in (False, True):  # test files only once the library's files run out (long lengths)
        tier = [rel for rel in stdlib_files(root, tests) if (Path(root) / rel).stat().st_size >= length]
        random.Random(f"code:lcc:{seed}:{tests}").shuffle(tier)
        files.extend(tier)
    return _first_samples(
        (lcc_sample(tokenizer, rel, length, root) for rel in files), num_samples, seed, "lcc", length
    )


def _first_samples(
    candidates: Iterable[Sample | None], num_samples: int, seed: int, task: str, length: int
) -> list[Sample]:
    """The first ``num_samples`` candidates that gave a sample, indexed; a clear error if too few."""
    samples: list[Sample] = []
    for sample in candidates:
        if sample is not None:
            sample.meta.update(index=len(samples), seed=seed)
            samples.append(sample)
            if len(samples) == num_samples:
                return samples
    raise InputError(
        f"only {len(samples)} standard-library files give a {task} sample of {length} tokens; "
        f"ask for fewer samples or a shorter length"
    )


# --- repobench ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """An answer line: 0-based ``line`` using ``name`` (defined as ``symbol``) from sibling ``module``."""

    line: int
    name: str
    module: str  # relative path of the sibling file
    symbol: str | None  # name to look up in the sibling, when known


def _package_dir(rel: str) -> str:
    return rel.rsplit("/", 1)[0] if "/" in rel else ""


@lru_cache(maxsize=4)
def _siblings_by_dir(root: str) -> dict[str, tuple[str, ...]]:
    by_dir: dict[str, list[str]] = {}
    for rel in stdlib_files(root):
        by_dir.setdefault(_package_dir(rel), []).append(rel)
    return {
        d: tuple(files) for d, files in by_dir.items() if d and f"{d}/__init__.py" in files and len(files) > 1
    }


def sibling_usages(source: Source, siblings: tuple[str, ...]) -> list[Usage]:
    """Statement-start lines (after the imports they use) that use a name imported from a sibling."""
    directory = _package_dir(source.rel)
    package = directory.replace("/", ".")
    modules = {rel.rsplit("/", 1)[1][:-3]: rel for rel in siblings if rel != source.rel}
    init = f"{directory}/__init__.py"
    names: dict[str, tuple[str, str | None, int]] = {}  # local name -> (sibling, symbol, import end line)
    module_aliases: dict[str, tuple[str, int]] = {}  # local name -> (sibling, import end line)
    for node in ast.walk(source.tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        own = (node.level == 1 and node.module is None) or (node.level == 0 and node.module == package)
        sub = None
        if node.level == 1 and node.module:
            sub = node.module
        elif node.level == 0 and node.module and node.module.startswith(package + "."):
            sub = node.module[len(package) + 1 :]
        for alias in node.names:
            local = alias.asname or alias.name
            if alias.name == "*":
                continue
            if own and alias.name in modules:
                module_aliases[local] = (modules[alias.name], node.end_lineno)
            elif own and init != source.rel and init in siblings:
                names[local] = (init, alias.name, node.end_lineno)
            elif sub in modules:
                names[local] = (modules[sub], alias.name, node.end_lineno)
    usages: dict[int, Usage] = {}
    for node in ast.walk(source.tree):
        found = None
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
        ):
            module, after = module_aliases[node.value.id]
            found = (
                node.lineno,
                Usage(node.lineno - 1, f"{node.value.id}.{node.attr}", module, node.attr),
                after,
            )
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names:
            module, symbol, after = names[node.id]
            found = (node.lineno, Usage(node.lineno - 1, node.id, module, symbol), after)
        if found and found[0] > found[2] and found[0] in source.statements and found[0] not in usages:
            if not source.lines[found[0] - 1].lstrip().startswith("#"):
                usages[found[0]] = found[1]
    return [usages[k] for k in sorted(usages)]


def _definition_line(source: Source, symbol: str | None) -> int:
    """0-based line where ``symbol`` is defined at the top level of ``source`` (0 if not found)."""
    for node in source.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == symbol:
            return (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == symbol for t in targets):
                return node.lineno - 1
    return 0


def _piece(rel: str, body: str) -> str:
    return f"# path: {rel}\n{body.rstrip()}"


def _join(pieces: list[str]) -> str:
    return "\n\n".join(pieces)


def repobench_sample(
    tokenizer: PreTrainedTokenizerBase,
    rel: str,
    length: int,
    rng: random.Random,
    root: str | None = None,
) -> Sample | None:
    """A RepoBench-style sample with target ``rel``, or None when its package cannot fill ``length``."""
    root = root or str(stdlib_root())
    source = load_source(root, rel)
    siblings = _siblings_by_dir(root).get(_package_dir(rel))
    if source is None or siblings is None:
        return None
    usages = []
    for usage in sibling_usages(source, siblings):
        before = _tokens_before(tokenizer, root, rel, source.starts[usage.line], length // 2 + 1)
        if before <= length // 2 and load_source(root, usage.module) is not None:
            usages.append(usage)
    if not usages:
        return None
    usage = rng.choice(usages)
    target = _piece(rel, source.text[: source.starts[usage.line]])
    budget = length - count_tokens(tokenizer, target)

    def lines_piece(src: Source, start: int, n: int) -> str:
        return _piece(src.rel, "".join(src.lines[start : start + n]))

    gold = load_source(root, usage.module)
    whole: list[str] = []  # pieces included whole
    used = {rel: source.sha256}
    partial: tuple[Source, int] | None = None  # the piece cut to fit: (source, first line)
    gold_tokens = count_tokens(tokenizer, _piece(gold.rel, gold.text))
    used[gold.rel] = gold.sha256
    if gold_tokens <= budget:
        whole.append(_piece(gold.rel, gold.text))
        remaining = budget - gold_tokens
        others = [s for s in siblings if s not in used]
        rng.shuffle(others)
        for other in others:
            if remaining <= _AIM * length:
                break
            src = load_source(root, other)
            if src is None or not src.text.strip():
                continue
            used[other] = src.sha256
            tokens = count_tokens(tokenizer, _piece(src.rel, src.text))
            if tokens <= remaining:
                whole.append(_piece(src.rel, src.text))
                remaining -= tokens
            else:
                partial = (src, 0)
                break
        else:
            if remaining > TOLERANCE * length:
                return None
    else:
        partial = (gold, max(0, _definition_line(gold, usage.symbol) - 8))
    order = list(range(len(whole) + (partial is not None)))
    rng.shuffle(order)

    def assemble(n: int) -> str:
        pieces = list(whole)
        if partial is not None:
            pieces.append(lines_piece(partial[0], partial[1], n))
        return _join([pieces[k] for k in order] + [target])

    n = 0
    if partial is not None:
        src, start = partial
        span = len(src.lines) - start
        n = fit_units(lambda k: count_tokens(tokenizer, assemble(k)), length, span, span // 2)
    context = assemble(n)
    tokens = count_tokens(tokenizer, context)
    if abs(tokens - length) > TOLERANCE * length:
        return None
    return Sample(
        context=context,
        question=QUESTION,
        answers=[source.lines[usage.line].strip()],
        answer_prefix="",
        max_new_tokens=MAX_NEW_TOKENS,
        meta={
            "task": "repobench",
            "length": length,
            **_file_meta(source),
            "answer_line": usage.line + 1,
            "identifier": usage.name,
            "gold_file": gold.rel,
            "files": used,
            # one string pinning every file of the context (scalar, so result stores keep it)
            "files_sha256": hashlib.sha256(
                "".join(f"{path}:{sha}\n" for path, sha in sorted(used.items())).encode()
            ).hexdigest(),
            "context_tokens": tokens,
            "python": platform.python_version(),
        },
    )


def _repobench_make_samples(
    tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
) -> list[Sample]:
    _check_common(length, num_samples)
    root = str(stdlib_root())
    packages = _siblings_by_dir(root)
    files = [rel for files in packages.values() for rel in files]
    files.sort()
    rng = random.Random(f"code:repobench:{seed}")
    rng.shuffle(files)
    candidates = (
        repobench_sample(tokenizer, rel, length, random.Random(f"code:repobench:{seed}:{rel}"), root)
        for rel in files
    )
    return _first_samples(candidates, num_samples, seed, "repobench", length)


TASKS = {
    "lcc": TaskSpec("lcc", "code", _lcc_make_samples, edit_similarity, "edit_similarity"),
    "repobench": TaskSpec("repobench", "code", _repobench_make_samples, edit_similarity, "edit_similarity"),
}
