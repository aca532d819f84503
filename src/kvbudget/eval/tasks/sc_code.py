"""``sc_code``: what a named function returns, four functions planted in real source (a shared-context task).

The context is Python source from the interpreter's own standard library (no download; the files
of :func:`kvbudget.eval.tasks.code.stdlib_files`, in an order permuted by seed and sample index),
each file under a ``# path: <relative path>`` header, cut into top-level units: a unit starts at a
top-level ``def`` or ``class`` (with its decorators and the comment lines just above) and runs to
the next; a file's first unit holds what precedes its first definition. Units longer than a
tenth of the length are left out (a class of thousands of lines would otherwise leave a quarter
of the context without a place to plant in), so the context is whole top-level definitions of
real files, in file order, less the longest; the last unit is cut at a line to fit the length.

Four small functions ``def {name}():\\n    return {5-digit int}`` are planted between top-level
units, one in each quarter of the context (a random depth inside the quarter, away from its
edges, then the nearest unit boundary). Names are ``verb_noun_noun`` from a small built-in
vocabulary (``resolve_harbor_quota``), distinct, none found in the files read nor part of another;
values are distinct and found nowhere in those files either. Each of the four turns asks "What
does the function `{name}()` defined in the code above return? Answer with the number only.",
answer prefix "`{name}()` returns", the functions in a shuffled order (never the context's).
Score: ``string_match_all`` on the number; 32 new tokens per turn.

Retrieval of a named function from a repository-sized context over several turns follows
SCBench's code setting (Li et al., "SCBench: A KV Cache-Centric Analysis of Long-Context Methods",
arXiv 2412.10319); ours asks for a planted function's return value rather than for a function's
code, so the answer is exact and its place in the context known.

``meta``: ``items`` (each planted function's ``name``, ``value``, ``snippet``, character ``offset``
and token ``depth``, in context order), ``depths``, ``order`` (the item each turn asks about),
``files`` (every file read, with its sha256), ``files_sha256`` (one string pinning them all) and
``python`` (the interpreter's version), so a changed standard library is detectable; each turn's
meta (the first turn's merged into ``Sample.meta``) holds ``turn`` (from 1), ``item``, ``name``,
``value``, ``depth``, ``offset`` and ``quarter``.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import platform
import random
from itertools import accumulate, chain

from transformers import PreTrainedTokenizerBase

from kvbudget.data import stdlib_root
from kvbudget.eval.sample import FollowUp, Sample
from kvbudget.eval.tasks.code import load_source, stdlib_files
from kvbudget.eval.tasks.ruler_common import count_tokens, fit_context, rng_for
from kvbudget.eval.tasks.sc_common import (
    NUM_TURNS,
    distinct,
    interleave,
    per_index,
    shared_sample,
    shuffled_order,
    strata_depths,
    strata_windows,
    token_depths,
)

TASK = "sc_code"
MAX_NEW_TOKENS = 32
#: a unit longer than this share of the length (in tokens, estimated from characters) is left out
UNIT_SHARE = 1 / 10
SNIPPET = "def {name}():\n    return {value}\n\n\n"
_VERBS = (
    "compute", "resolve", "fetch", "build", "count", "derive", "encode", "measure", "estimate",
    "select", "render", "collect", "validate", "convert", "schedule", "allocate", "summarize", "rank",
)  # fmt: skip
_NOUNS = (
    "ledger", "quota", "bucket", "margin", "tariff", "cursor", "shard", "beacon", "harbor", "orchard",
    "lantern", "vessel", "meadow", "glacier", "canyon", "pigeon", "compass", "anchor", "saddle",
    "quarry", "thimble", "walrus", "nebula", "tundra", "parcel", "ration", "pebble", "falcon",
)  # fmt: skip
#: characters read to estimate the tokenizer's characters per token on code
_SAMPLE_CHARS = 30_000


def question(name: str) -> str:
    return f"What does the function `{name}()` defined in the code above return? Answer with the number only."


def answer_prefix(name: str) -> str:
    return f"`{name}()` returns"


def function_name(rng: random.Random) -> str:
    """A ``verb_noun_noun`` name from the built-in vocabulary (two different nouns)."""
    first, second = rng.sample(_NOUNS, 2)
    return f"{rng.choice(_VERBS)}_{first}_{second}"


def file_units(rel: str, text: str, tree: ast.Module) -> list[str]:
    """The file's top-level units (see the module docstring), the first under a ``# path:`` header.

    The last unit ends with two blank lines, so the next file's header follows as PEP 8 spaces
    top-level definitions.
    """
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    starts = {0}
    previous_end = 0  # 0-based line just after the previous top-level statement
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            line = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
            while line > previous_end and lines[line - 1].startswith("#"):
                line -= 1
            starts.add(line)
        previous_end = node.end_lineno
    bounds = sorted(starts) + [len(lines)]
    units = ["".join(lines[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    units[-1] = units[-1].rstrip("\n") + "\n\n\n"
    units[0] = f"# path: {rel}\n" + units[0]
    return units


def _stream(
    tokenizer: PreTrainedTokenizerBase, length: int, files: list[str], root: str
) -> tuple[list[str], list[str], dict[str, str], str, float]:
    """(units, the file of each unit, sha256 of every file read, the files' whole text, characters
    per token) for the context.

    Reads files in order until the kept units hold about 1.25 ``length`` tokens (characters per
    token estimated on the first files read); a unit longer than :data:`UNIT_SHARE` of the length
    is left out, and a file's header moves to its first kept unit.
    """
    sources = (s for s in (load_source(root, rel) for rel in files) if s is not None and s.text.strip())
    read = []
    sample = ""
    for source in sources:
        read.append(source)
        sample += source.text
        if len(sample) >= _SAMPLE_CHARS:
            break
    per_token = len(sample) / max(count_tokens(tokenizer, sample), 1)
    cap, need = UNIT_SHARE * length * per_token, 1.25 * length * per_token + 2000
    units: list[str] = []
    owners: list[str] = []
    shas: dict[str, str] = {}
    texts: list[str] = []
    chars = 0
    for source in chain(read, sources):
        if chars >= need:
            break
        shas[source.rel] = source.sha256
        texts.append(source.text)
        header = f"# path: {source.rel}\n"
        kept = [u for u in file_units(source.rel, source.text, source.tree) if len(u) <= cap + len(header)]
        if kept and not kept[0].startswith(header):
            kept[0] = header + kept[0]
        units += kept
        owners += [source.rel] * len(kept)
        chars += sum(map(len, kept))
    return units, owners, shas, "".join(texts), per_token


def code_sample(
    tokenizer: PreTrainedTokenizerBase, length: int, seed: int, index: int, root: str | None = None
) -> Sample:
    """One ``sc_code`` sample whose context is ``length`` tokens (within 2%)."""
    root = root or str(stdlib_root())
    rng = rng_for(TASK, seed, index)
    files = list(stdlib_files(root))
    rng_for(TASK, seed, index, "files").shuffle(files)
    units, owners, shas, source_text, per_token = _stream(tokenizer, length, files, root)
    names = distinct(rng, function_name, NUM_TURNS, avoid=source_text)
    values = distinct(rng, lambda r: str(r.randint(10000, 99999)), NUM_TURNS, avoid=source_text)
    snippets = [SNIPPET.format(name=n, value=v) for n, v in zip(names, values, strict=True)]
    windows = strata_windows(NUM_TURNS, task=TASK)
    targets = [d for (d,) in strata_depths(rng, NUM_TURNS, task=TASK)]
    order = shuffled_order(rng, NUM_TURNS)
    placed: dict[tuple[int, int], list[int]] = {}

    def build(n: int, k: int) -> str:
        cut = ["".join(line + "\n" for line in units[n].split("\n")[:k])] if k else []
        text, offsets = interleave("", units[:n] + cut, snippets, targets, "", windows, limit=n)
        placed[n, k] = offsets
        return text

    def pieces(n: int) -> int:
        return units[n].count("\n") if n < len(units) else 0

    ends = list(accumulate(map(len, units)))
    guess = min(bisect.bisect_left(ends, length * per_token), len(units))
    fitted = fit_context(tokenizer, build, length, 0, len(units), guess, pieces=pieces, task=TASK)
    offsets = placed[fitted.units, fitted.pieces]
    depths = token_depths(tokenizer, fitted.text, offsets)
    items = [
        {"name": n, "value": v, "snippet": s, "offset": o, "depth": d}
        for n, v, s, o, d in zip(names, values, snippets, offsets, depths, strict=True)
    ]
    turns = []
    for turn, item in enumerate(order, 1):
        meta = {"turn": turn, "item": item, "quarter": item + 1, **items[item]}
        del meta["snippet"]
        name = names[item]
        turns.append(FollowUp(question(name), [values[item]], answer_prefix(name), MAX_NEW_TOKENS, meta))
    used = {rel: shas[rel] for rel in dict.fromkeys(owners[: fitted.units + (fitted.pieces > 0)])}
    pinned = "".join(f"{path}:{sha}\n" for path, sha in sorted(used.items()))
    meta = {
        "task": TASK, "length": length, "index": index, "seed": seed, "items": items, "depths": depths,
        "order": order, "files": used,
        "files_sha256": hashlib.sha256(pinned.encode()).hexdigest(),
        "python": platform.python_version(), "units": fitted.units, "partial_lines": fitted.pieces,
        "tokens": fitted.tokens,
    }  # fmt: skip
    return shared_sample(fitted.text, turns, meta)


make_samples = per_index(code_sample)
