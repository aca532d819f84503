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

With ``distributed`` (:class:`~kvbudget.eval.distributed.RayOptions`) the grid points × passages
run on Ray worker actors (:class:`~kvbudget.eval.distributed.RayPool`, the pool of ``kvbudget eval
--workers``), each loading the model once and measuring one passage at one grid point at a time;
the driver alone writes the profile, after each grid point whose passages are all back, summing a
point's passages in the same order as the local loop, so the stored grid and best point are those
of a local search (the grid's rows are kept in grid order whatever order the points finish in).
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvbudget.errors import InputError
from kvbudget.eval.tasks.perplexity import austen_ids, chunked_perplexity, make_samples
from kvbudget.methods.registry import make_method
from kvbudget.profiles import Profile, load_profile, save_profile

if TYPE_CHECKING:
    from kvbudget.eval.distributed import RayOptions

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
    ids = austen_ids(tokenizer)
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
    distributed: RayOptions | None = None,
    model_source: str | os.PathLike[str] | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Run (or resume) the grid search; returns and stores ``tuned[method][ratio]``.

    ``texts`` replaces the Austen passages (each ``[1, length]``), e.g. for tests. ``distributed``
    runs the grid on Ray workers that load ``model_source`` (what ``model`` was loaded from: a
    registry name or a folder every node sees) in ``dtype``; ``model`` and ``tokenizer`` then serve
    the driver only (the profile's check and the passages).
    """
    if distributed is not None:
        from kvbudget.eval.distributed import require_ray

        distributed.validate()
        require_ray()
        if model_source is None:
            raise InputError("a distributed tune needs model_source: what the workers load the model from")
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

    def record(point: dict[str, float], results: Sequence[tuple[float, int]]) -> None:
        """A point's mean NLL over its passages ``(nll, tokens)`` in passage order, saved at once."""
        nll, tokens = 0.0, 0
        for passage_nll, passage_tokens in results:
            nll += passage_nll * passage_tokens
            tokens += passage_tokens
        mean = nll / tokens
        entry["grid"].append({**point, "nll": round(mean, 6), "perplexity": round(math.exp(mean), 4)})
        _finish(entry, points, names)
        save_profile(profile, path)
        bar.update(1)

    if distributed is not None and todo:
        config = {"method": method, "budget": budget, "chunk": chunk, "ratio": ratio}
        _tune_on_ray(distributed, str(model_source), dtype, path, config, todo, texts, record)
    for point in [] if distributed is not None else todo:
        method_obj = make_method(method, profile=str(path), **point)
        results = []
        for ids in texts:
            result = chunked_perplexity(model, ids, method_obj, budget, chunk=chunk, ratio=ratio)
            results.append((result.nll, result.tokens))
        record(point, results)
    bar.close()
    _finish(entry, points, names)
    save_profile(profile, path)
    return entry


def _finish(entry: dict[str, Any], points: list[dict[str, float]], names: Sequence[str]) -> None:
    """Best point so far (lowest NLL, the earlier point on ties) and whether the grid is complete; the
    grid's rows in grid order (a distributed search measures its points in any order)."""
    order = {tuple(p[n] for n in names): i for i, p in enumerate(points)}
    entry["grid"].sort(key=lambda row: order.get(tuple(row[n] for n in names), len(order)))
    measured = {tuple(row[n] for n in names) for row in entry["grid"]}
    entry["best"] = min(entry["grid"], key=lambda row: row["nll"]) if entry["grid"] else None
    entry["complete"] = all(tuple(p[n] for n in names) in measured for p in points)


class PerplexityWorker:
    """A tuning worker actor: the model, loaded once, and the profile as the driver read it (written
    to a file of the worker's own for each run, so the workers need not see the driver's disk; the
    file is removed when the run returns, as a killed actor runs no finalizer)."""

    def __init__(self, model_source: str, dtype: str, device: str, threads: int, profile_json: str) -> None:
        from kvbudget.models import load_model

        torch.set_num_threads(threads)
        self.model, _ = load_model(model_source, dtype=dtype, device=device)
        self.profile_json = profile_json

    def run(self, config: dict[str, Any], point: dict[str, float], ids: list[int]) -> tuple[float, int]:
        """One passage ``ids`` (its tokens) at one grid point: its mean NLL and scored tokens."""
        tokens = torch.tensor([ids], device=self.model.device)
        with tempfile.TemporaryDirectory(prefix="kvbudget-tune-") as folder:
            profile_path = Path(folder) / "profile.json"
            profile_path.write_text(self.profile_json, encoding="utf-8")
            method_obj = make_method(config["method"], profile=str(profile_path), **point)
            result = chunked_perplexity(
                self.model, tokens, method_obj, config["budget"], chunk=config["chunk"], ratio=config["ratio"]
            )
        return result.nll, result.tokens


@dataclass
class _Job:
    """One passage at one grid point; ``attempts``: how many workers died measuring it."""

    point: int
    passage: int
    attempts: int = 0
    causes: list[str] = field(default_factory=list)


def _tune_on_ray(
    options: RayOptions,
    model_source: str,
    dtype: str,
    path: Path,
    config: dict[str, Any],
    todo: list[dict[str, float]],
    texts: list[torch.Tensor],
    record: Any,
) -> None:
    """Measure ``todo`` × ``texts`` on Ray workers; ``record(point, results)`` as each point completes.

    A passage whose worker died is measured again (:class:`~kvbudget.eval.distributed.RayPool`); one
    that fails by itself, or whose workers died too often, stops the search with its error once the
    workers are stopped (the points recorded so far stay in the profile: rerun to resume)."""
    from kvbudget.eval.distributed import RayPool

    source = str(Path(model_source).resolve()) if Path(model_source).exists() else model_source
    profile_json = path.read_text(encoding="utf-8")
    pool = RayPool(
        options, PerplexityWorker, (source, dtype, options.device, options.threads_per_worker, profile_json)
    )
    passages_ids = [t[0].tolist() for t in texts]
    results: list[dict[int, tuple[float, int]]] = [{} for _ in todo]
    errors: list[BaseException] = []
    queue = deque(_Job(i, j) for i in range(len(todo)) for j in range(len(texts)))

    def done(job: _Job, result: tuple[float, int]) -> None:
        results[job.point][job.passage] = (float(result[0]), int(result[1]))
        if len(results[job.point]) == len(texts):
            record(todo[job.point], [results[job.point][j] for j in range(len(texts))])

    def failed(job: _Job, err: BaseException) -> None:
        errors.append(err)
        queue.clear()  # nothing more is handed out; the units in flight finish

    try:
        pool.start()
        pool.dispatch(
            queue,
            submit=lambda worker, job: worker.run.remote(config, todo[job.point], passages_ids[job.passage]),
            done=done,
            failed=failed,
            gave_up=failed,
            what="passage",
            resume=f"the points measured so far are saved in {path}: rerun to resume",
        )
    finally:
        pool.stop()
    if errors:
        raise errors[0]
