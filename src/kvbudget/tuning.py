"""BaKlaVa's Algorithm 3: grid search of a profiled method's parameters by perplexity.

For a compression ratio ``R`` every grid point — ``(t, r)`` for BaKlaVa, ``p`` for
SqueezeAttention — builds the method and measures the perplexity of ``passages`` Austen passages
of ``length`` tokens, each read in chunks with the cache held at ``round(R · length)`` entries per
head and reset between passages (:func:`kvbudget.eval.tasks.perplexity.chunked_perplexity`). The
method's ratio is pinned to ``R`` (:meth:`~kvbudget.methods.profiled.ProfiledMethod.pin_ratio`), so
parameters it does not search (BaKlaVa's layer split ``p``) are the ones an evaluation at ``R``
uses — not those stored for ``budget / (budget + chunk)``, the ratio each chunk's prefill sees. The
point with the lowest mean NLL wins. Results go into the profile JSON (``tuned[method][R]``) after
every grid point, so an interrupted search resumes where it stopped (points already measured with
the same settings are skipped; an entry stored under other settings, or before the ratio was pinned
and BaKlaVa's Algorithm 2 ran inside each layer — no ``lookup_ratio`` — is measured again).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvbudget.errors import InputError
from kvbudget.eval.tasks.perplexity import _austen_ids, chunked_perplexity, make_samples
from kvbudget.methods.registry import make_method
from kvbudget.profiles import Profile, load_profile, save_profile

TUNABLE = {"baklava": ("t", "r"), "baklava-snapkv": ("t", "r"), "squeezeattention": ("p",)}
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
DEFAULT_R = (0.2, 0.4, 0.6, 0.8)
DEFAULT_P = (0.2, 0.3, 0.4, 0.5, 0.7)


def default_grid(profile: Profile, method: str) -> dict[str, list[float]]:
    """``t`` at the 10/25/50/75/90% quantiles of the profile's KV importances (an absolute grid like
    the paper's would miss a model whose importances sit in a narrow band), ``r`` 0.2–0.8; ``p``."""
    if method == "squeezeattention":
        return {"p": list(DEFAULT_P)}
    importance = profile.importance().reshape(-1)
    ts = sorted({round(float(torch.quantile(importance, q)), 6) for q in QUANTILES})
    return {"t": ts, "r": list(DEFAULT_R)}


def grid_points(grid: dict[str, Sequence[float]], names: Sequence[str]) -> list[dict[str, float]]:
    missing = [n for n in names if not grid.get(n)]
    if missing:
        raise InputError(f"the grid needs values for {', '.join(missing)}")
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*(grid[n] for n in names))]


def passages(tokenizer: PreTrainedTokenizerBase, length: int, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` Austen passages of exactly ``length`` tokens (the perplexity task's seeded offsets)."""
    ids = _austen_ids(tokenizer)
    samples = make_samples(tokenizer, length, count, seed)
    return [torch.tensor([ids[s.meta["offset"] : s.meta["offset"] + length]]) for s in samples]


def tune(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    profile_path: str | os.PathLike[str],
    method: str = "baklava",
    ratio: float = 0.3,
    length: int = 1024,
    num_passages: int = 2,
    seed: int = 0,
    chunk: int = 32,
    grid: dict[str, Sequence[float]] | None = None,
    texts: list[torch.Tensor] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run (or resume) the grid search; returns and stores ``tuned[method][ratio]``.

    ``texts`` replaces the Austen passages (each ``[1, length]``), e.g. for tests.
    """
    if method not in TUNABLE:
        raise InputError(f"cannot tune '{method}': tunable methods are {', '.join(TUNABLE)}")
    if not 0.0 < ratio < 1.0:
        raise InputError(f"ratio must be in (0, 1), got {ratio}")
    path = Path(profile_path)
    profile = load_profile(path, model)
    names = TUNABLE[method]
    points = grid_points(grid or default_grid(profile, method), names)
    budget = max(1, round(ratio * length))
    source = "austen" if texts is None else "custom"
    texts = texts if texts is not None else passages(tokenizer, length, num_passages, seed)
    if not texts or any(t.dim() != 2 or t.shape[1] != length for t in texts):
        raise InputError(f"tuning texts must be [1, {length}] token tensors")
    settings = {
        "length": length, "passages": len(texts), "seed": seed, "chunk": chunk, "budget": budget,
        "text": source, "lookup_ratio": ratio,
    }  # fmt: skip
    key = f"{ratio:g}"
    entry = profile.tuned.setdefault(method, {}).get(key)
    if not entry or entry.get("settings") != settings:
        entry = {"settings": settings, "grid": [], "best": None, "complete": False}
    profile.tuned[method][key] = entry
    done = {tuple(point[n] for n in names) for point in entry["grid"]}
    todo = [p for p in points if tuple(p[n] for n in names) not in done]
    bar = tqdm(
        total=len(points), initial=len(points) - len(todo), desc=f"tune {method} @ {key}",
        disable=not progress,
    )  # fmt: skip
    for point in todo:
        method_obj = make_method(method, profile=str(path), **point)
        nll, tokens = 0.0, 0
        for ids in texts:
            result = chunked_perplexity(model, ids, method_obj, budget, chunk=chunk, ratio=ratio)
            nll += result.nll * result.tokens
            tokens += result.tokens
        mean = nll / tokens
        entry["grid"].append({**point, "nll": round(mean, 6), "perplexity": round(math.exp(mean), 4)})
        _finish(entry, points, names)
        save_profile(profile, path)
        bar.update(1)
    bar.close()
    _finish(entry, points, names)
    save_profile(profile, path)
    return entry


def _finish(entry: dict[str, Any], points: list[dict[str, float]], names: Sequence[str]) -> None:
    """Best point so far (lowest NLL, the earlier point on ties) and whether the grid is complete."""
    measured = {tuple(row[n] for n in names) for row in entry["grid"]}
    entry["best"] = min(entry["grid"], key=lambda row: row["nll"]) if entry["grid"] else None
    entry["complete"] = all(tuple(p[n] for n in names) in measured for p in points)
