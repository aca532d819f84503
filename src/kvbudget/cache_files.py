"""Compressed caches on disk: :func:`save_cache` and :func:`load_cache` (safetensors).

A document compressed once (question-agnostic, say by KVzip) can be saved and loaded again later —
in another process, after a restart — instead of prefilling and compressing it again. The file
holds every layer's entries as the cache stores them (each KV head's own length, quantized codes
and scales as they are), their positions and per-entry state, and a header naming what the cache
is of: the model (its config hash, a fingerprint of its embedding weights, its dtype), the method
and its budget or ratio, ``kv_bits``, and the token ids the cache has seen. ``load_cache`` refuses,
in one line, a file of another model or dtype, and a file that is not a complete kvbudget cache.

Written to a temporary file in the same folder and renamed into place, so a reader never sees half
a file. One sequence a file (batch size 1). A decode-stage method's cache is refused: its eviction
state lives in the run, which the file does not hold.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel

from kvbudget.attention import attach
from kvbudget.cache import BudgetCache, BudgetLayer
from kvbudget.errors import KVBudgetError, PathError
from kvbudget.phases import Stage
from kvbudget.profiles import config_hash
from kvbudget.quantized_store import QuantizedHead, TieredHead
from kvbudget.version import __version__

FORMAT = "kvbudget-cache/1"
_HEAD_FIELDS = [f.name for f in fields(QuantizedHead) if f.name not in ("bits", "group", "whole_groups")]


@dataclass(frozen=True)
class CacheSource:
    """What a cache was made from, as :func:`save_cache` records it: the model's identity, the
    method (``label``: name and options), its budget or ratio and ``kv_bits``, and the token ids."""

    config_hash: str
    fingerprint: str
    dtype: str
    method: str
    budget: int | None
    ratio: float | None
    kv_bits: int | None
    token_ids: list[int]
    memory: float | None = None


def model_fingerprint(model: PreTrainedModel) -> str:
    """sha256 of the first rows of the model's input embeddings (in its dtype): two models of one
    architecture with other weights differ here, where their config hashes do not."""
    rows = model.get_input_embeddings().weight[:8].detach().to("cpu").contiguous()
    return hashlib.sha256(rows.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def source_of(model: PreTrainedModel, cache: BudgetCache, token_ids: list[int]) -> CacheSource:
    """The :class:`CacheSource` of ``cache``, compressed by its session for ``model`` from ``token_ids``."""
    session = cache.session
    method = getattr(session, "method", None)
    label = method.name if method is not None else "full"
    if method is not None and method.options():
        label += ":" + ",".join(f"{k}={v}" for k, v in method.options().items())
    return CacheSource(
        config_hash=config_hash(model.config),
        fingerprint=model_fingerprint(model),
        dtype=str(model.dtype).removeprefix("torch."),
        method=label,
        budget=getattr(session, "budget", None),
        ratio=getattr(session, "ratio", None),
        kv_bits=cache.kv_bits,
        token_ids=list(token_ids),
        memory=getattr(session, "memory", None),
    )


def save_cache(cache: BudgetCache, path: str | Path, source: CacheSource | None = None) -> Path:
    """Write ``cache`` (one sequence) to ``path`` (a ``.safetensors`` file, written atomically).

    ``source`` says what the cache is of; default: what :func:`kvbudget.compress` recorded on it
    (``cache.source``). Returns the path.

    Raises:
        KVBudgetError: no source, a batch of several sequences, a decode-stage method's cache, or
            token ids that are not the tokens the cache has seen.
        PathError: the folder cannot be written.
    """
    source = source or cache.source
    if source is None:
        raise KVBudgetError(
            "save_cache needs to know what the cache is of: pass "
            "source=kvbudget.cache_files.source_of(model, cache, token_ids) (kvbudget.compress records it)"
        )
    layers = [layer for layer in cache.layers if layer.is_initialized]
    if len(layers) != len(cache.layers):
        raise KVBudgetError("save_cache: the cache has layers nothing was stored in (prefill it first)")
    if layers[0].batch_size != 1:
        raise KVBudgetError(f"save_cache writes one sequence a file, the cache holds {layers[0].batch_size}")
    method = getattr(cache.session, "method", None)
    if method is not None and Stage.DECODE in method.stages:
        raise KVBudgetError(
            f"save_cache: {method.name} evicts while decoding and its eviction state lives in the run, "
            "which a file does not hold; save a cache of a method that compresses the prompt only"
        )
    seen, ids = layers[0].seen, len(source.token_ids)
    if seen != ids:
        raise KVBudgetError(f"save_cache: the cache has seen {seen} tokens, its token ids are {ids}")
    tensors: dict[str, torch.Tensor] = {}
    layouts = [_put_layer(layer, str(i), tensors) for i, layer in enumerate(cache.layers)]
    header = {"format": FORMAT, "kvbudget": __version__, "layouts": layouts}
    header.update({f.name: getattr(source, f.name) for f in fields(CacheSource)})
    metadata = {"kvbudget": json.dumps(header)}
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except OSError as err:
        raise PathError(f"cannot write the cache file {path}: {err.strerror or err}") from None
    return path


def _put_layer(layer: BudgetLayer, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Add the layer's tensors under ``prefix.``; its layout for the header."""
    ragged = layer.is_ragged
    heads = layer.num_heads
    positions = layer.positions if ragged else [layer.positions]
    for j, p in enumerate(positions):
        tensors[f"{prefix}.positions.{j}"] = p
    for name, s in layer.state.items():
        for j, t in enumerate(s if ragged else [s]):
            tensors[f"{prefix}.state.{name}.{j}"] = t
    layout: dict[str, Any] = {
        "seen": layer.seen, "ragged": ragged, "heads": heads, "has_invalid": layer.has_invalid,
        "sliding_window": layer.sliding_window, "softcap": layer.softcap, "state": sorted(layer.state),
    }  # fmt: skip
    if layer.quant is not None:
        layout["quant"] = []
        for h, q in enumerate(layer.quant):
            parts = {"high": q.high, "low": q.low} if isinstance(q, TieredHead) else {"": q}
            if not all(isinstance(part, QuantizedHead) for part in parts.values()):
                raise KVBudgetError("save_cache: a conversation on a shared document cannot be saved alone")
            layout["quant"].append({
                name: {"bits": part.bits, "group": part.group, "whole_groups": part.whole_groups}
                for name, part in parts.items()
            })  # fmt: skip
            for part_name, part in parts.items():
                tag = f"{prefix}.q{h}.{part_name}." if part_name else f"{prefix}.q{h}."
                for name in _HEAD_FIELDS:
                    tensors[tag + name] = getattr(part, name)
        return layout
    keys, values = (layer.head_keys, layer.head_values) if ragged else ([layer.keys], [layer.values])
    for j, (k, v) in enumerate(zip(keys, values, strict=True)):
        tensors[f"{prefix}.keys.{j}"], tensors[f"{prefix}.values.{j}"] = k, v
    return layout


def load_cache(path: str | Path, model: PreTrainedModel) -> BudgetCache:
    """The cache saved at ``path``, for ``model`` (whose attention this routes through kvbudget, as
    :func:`kvbudget.compress` does). Decoding continues from it as from the cache that was saved
    (``model.generate(token_ids + question, past_key_values=cache)``); no method acts on it any more:
    it only stores what is appended. ``cache.source`` says what it is of.

    Raises:
        PathError: no such file.
        KVBudgetError: not a complete kvbudget cache file, or a cache of another model or dtype.
    """
    path = Path(path)
    if not path.is_file():
        raise PathError(f"no cache file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get("kvbudget", "null"))
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise ValueError("no kvbudget cache header")
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    except Exception as err:  # safetensors raises its own errors on a torn or foreign file
        raise KVBudgetError(
            f"{path} is not a kvbudget cache file ({str(err).splitlines()[0][:120]})"
        ) from None
    source = CacheSource(**{f.name: header.get(f.name, f.default) for f in fields(CacheSource)})
    _check_model(source, model, path)
    layouts = header["layouts"]
    if len(layouts) != model.config.num_hidden_layers:
        raise KVBudgetError(
            f"{path} holds {len(layouts)} layers, the model has {model.config.num_hidden_layers}"
        )
    device = model.device
    cache = BudgetCache(len(layouts), None, kv_bits=source.kv_bits)
    try:
        for i, layout in enumerate(layouts):
            cache.layers[i] = _take_layer(layout, str(i), tensors, device)
    except KeyError as err:
        raise KVBudgetError(f"{path} is not a complete kvbudget cache file (missing {err.args[0]})") from None
    for i in range(len(layouts)):
        cache.note_memory(i)
    attach(model)
    cache.attention_attached = True
    cache.source = source
    return cache


def _check_model(source: CacheSource, model: PreTrainedModel, path: Path) -> None:
    dtype = str(model.dtype).removeprefix("torch.")
    if source.config_hash != config_hash(model.config):
        raise KVBudgetError(f"{path} is a cache of another model (its config differs from this one's)")
    if source.dtype != dtype:  # before the weights: the fingerprint is of the weights in their dtype
        raise KVBudgetError(
            f"{path} holds a {source.dtype} cache, the model runs in {dtype}: load it in {source.dtype}"
        )
    if source.fingerprint != model_fingerprint(model):
        raise KVBudgetError(f"{path} is a cache of another model (its weights differ from this one's)")


def _take_layer(
    layout: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor], device: Any
) -> BudgetLayer:
    layer = BudgetLayer()
    ragged, heads = layout["ragged"], layout["heads"]
    parts = heads if ragged else 1

    def get(name: str) -> torch.Tensor:
        return tensors[f"{prefix}.{name}"].to(device)

    positions = [get(f"positions.{j}") for j in range(parts)]
    state = {name: [get(f"state.{name}.{j}") for j in range(parts)] for name in layout["state"]}
    if "quant" in layout:
        quant: list[Any] = []
        for h, q in enumerate(layout["quant"]):
            parts = {}
            for part_name, meta in q.items():
                tag = f"q{h}.{part_name}." if part_name else f"q{h}."
                values = {name: get(tag + name) for name in _HEAD_FIELDS}
                parts[part_name] = QuantizedHead(
                    **values, bits=meta["bits"], group=meta["group"], whole_groups=meta["whole_groups"]
                )
            quant.append(TieredHead(parts["high"], parts["low"]) if "high" in parts else parts[""])
        first = quant[0].tail_keys
        layer.keys = layer.values = None
        layer.quant = quant
    else:
        keys = [get(f"keys.{j}") for j in range(parts)]
        values = [get(f"values.{j}") for j in range(parts)]
        first = keys[0]
        if ragged:
            layer.head_keys, layer.head_values = keys, values
        else:
            layer.keys, layer.values = keys[0], values[0]
    layer.positions = positions if ragged else positions[0]
    layer.state = state if ragged else {name: s[0] for name, s in state.items()}
    layer.dtype, layer.device = first.dtype, first.device
    layer.seen, layer.has_invalid = layout["seen"], layout["has_invalid"]
    layer.sliding_window, layer.softcap = layout["sliding_window"], layout["softcap"]
    layer.is_initialized = True
    return layer
