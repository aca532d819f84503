"""The ``kvbudget`` attention function, its mask function, and explicit attachment.

``attach(model)`` registers (once, by name, in transformers' ``AttentionInterface`` and
``AttentionMaskInterface``) an attention function that computes exact attention over whatever a
:class:`~kvbudget.cache.BudgetCache` layer holds — rectangular or per-head, with invalid slots
masked — and then hands the cache's compression session the layer's post-RoPE queries. Nothing
happens at import; ``detach(model)`` restores the model's previous attention implementation.

The cache reaches the attention function through a forward pre-hook on each attention module that
copies the module's ``past_key_values`` argument into the ``kvbudget_cache`` keyword (transformers
forwards extra keywords to the attention function).

Architectures (``SUPPORTED_MODEL_TYPES``): Llama, Qwen2, Mistral, Qwen3, Gemma 2, Gemma 3 (text)
and Phi-3. The function receives the queries and keys the model computed — after Qwen3's and
Gemma 3's query/key norms, after RoPE (Gemma 3's local or global base per layer), split from
Phi-3's fused ``qkv_proj`` — and applies what the model asks for on top of ``scaling``:

* ``sliding_window=W`` (Mistral, Phi-3, Qwen2/Qwen3 with ``use_sliding_window``, Gemma's local
  layers): a query at logical position ``p`` sees the keys at positions ``> p − W`` (transformers'
  ``sliding_window_overlay``), computed from the positions the cache stores, so it stays exact
  after compression. The window is recorded on the cache layer (``BudgetLayer.sliding_window``):
  :class:`~kvbudget.observation.Observation` applies it to the probabilities methods score with,
  and the cache drops the entries that left the window (see :mod:`kvbudget.cache`).
* ``softcap=c`` (Gemma 2's ``attn_logit_softcapping``): logits become ``c · tanh(logits / c)``
  before the mask and softmax, here and in the observation's probabilities.

Sliding-window layers are compressed like every other layer, within their window: the method's
budget applies to them too, and entries outside the window are never kept past the next forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from kvbudget.architectures import SUPPORTED_MODEL_TYPES
from kvbudget.cache import BudgetCache, BudgetLayer
from kvbudget.errors import UnsupportedModelError
from kvbudget.joined_cache import JoinedCache
from kvbudget.masks import attention_mask_for, causal_visibility, window_visibility
from kvbudget.phases import Phase
from kvbudget.quantized_read import fused_decode
from kvbudget.static_cache import StaticBudgetCache

ATTENTION_NAME = "kvbudget"


@dataclass
class PaddingInfo:
    """What the ``kvbudget`` mask function passes to the attention function.

    Attributes:
        padding: the 2-D padding mask ``[batch, seen + q]`` (True = real token), or ``None``.
        q_length: tokens in this forward.
    """

    padding: torch.Tensor | None
    q_length: int

    def new_token_valid(self) -> torch.Tensor | None:
        """Validity of the tokens of this forward, ``[batch, q]``, or ``None`` if all are real."""
        if self.padding is None:
            return None
        return self.padding[:, -self.q_length :]


def kvbudget_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> PaddingInfo:
    """Mask function registered as ``"kvbudget"``: passes the padding mask through.

    The attention function builds causal and validity masks itself from the cache's positions, so
    no ``[q, kv]`` mask is materialised here.
    """
    padding = attention_mask
    if padding is not None and bool(padding.all()):
        padding = None
    return PaddingInfo(padding=padding, q_length=q_length)


def softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with Gemma 2's logit soft-capping: ``softmax(c · tanh(scaling · q kᵀ / c) + mask) v``.

    ``query: [b, q_heads, q, d]``, ``key/value: [b, kv_heads, n, d]`` (each KV head serves
    ``q_heads / kv_heads`` query heads), ``mask`` broadcastable to ``[b, q_heads, q, n]`` (True =
    attend) or ``None`` (no mask). The softmax runs in fp32 (as transformers' eager attention).
    Returns ``[b, q_heads, q, d_v]``.
    """
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    logits = torch.matmul(query, key.transpose(-1, -2)) * scaling
    logits = torch.tanh(logits / softcap) * softcap
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)


#: The most queries a forward may have and still leave cuDNN's SDPA backend out on CUDA (decode
#: steps, lookahead steps). cuDNN builds an execution graph for each key length it meets, and a
#: decode step meets a new length every step (in the per-head layout, one per KV head). On an H200
#: with torch 2.11, that build cost 29–41 ms of host time per call in the per-head layout (a 7B
#: model's decode step took 3.4–5.3 s) and 1.4–2.2 ms per call in the rectangular layout and on
#: transformers' DynamicCache, against 6.5 ms of GPU work per step (docs/gpu.md). Longer forwards
#: keep cuDNN: without it a masked grouped-query call has only the math backend left (flash takes
#: no mask, and torch's efficient backend no grouped heads), whose ``[b, heads, q, n]`` fp32 scores
#: would not fit for a long question or KVzip's reconstruction over a long context.
DECODE_QUERIES = 16


def leaves_cudnn_out(device: torch.device, queries: int, keys: int) -> bool:
    """Whether ``queries`` new queries over ``keys`` entries on ``device`` run with cuDNN's SDPA
    backend off: on CUDA, decode-sized forwards (at most :data:`DECODE_QUERIES`) over a cache."""
    return device.type == "cuda" and queries < keys and queries <= DECODE_QUERIES


@contextmanager
def _cudnn_sdpa_off() -> Iterator[None]:
    """Turn cuDNN's SDPA backend off for the block, leaving the user's other choices as they are
    (unless it is the only backend the user left on)."""
    cuda = torch.backends.cuda
    others = cuda.flash_sdp_enabled() or cuda.mem_efficient_sdp_enabled() or cuda.math_sdp_enabled()
    if not (cuda.cudnn_sdp_enabled() and others):
        yield
        return
    cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        cuda.enable_cudnn_sdp(True)


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with GQA, or :func:`softcapped_attention` under a softcap.
    On CUDA a decode-sized call runs with cuDNN's SDPA backend off (:data:`DECODE_QUERIES`)."""
    q, n = query.shape[2], key.shape[2]
    if softcap is not None:
        if is_causal:
            mask = causal_visibility(n, q, query.device)
        return softcapped_attention(query, key, value, mask, scaling, softcap)
    with _cudnn_sdpa_off() if leaves_cudnn_out(query.device, q, n) else nullcontext():
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=True
        )


def attend_layer(query: torch.Tensor, layer: BudgetLayer, scaling: float) -> torch.Tensor:
    """Exact attention of ``query: [b, q_heads, q, d]`` over all entries of ``layer``.

    The last ``q`` entries of every head are the queries' own tokens (they were just appended).
    The layer's ``sliding_window`` and ``softcap`` (set by :func:`kvbudget_attention` from what the
    model passes) apply. Returns ``[b, q_heads, q, d_v]``.
    """
    _, q_heads, q, _ = query.shape
    window, softcap = layer.sliding_window, layer.softcap
    heads = layer.num_heads
    group = q_heads // heads
    # a one-token step off CUDA: each KV head's query group as the rows of one query
    # (:func:`_grouped_step`)
    grouped = q == 1 and group > 1 and query.device.type != "cuda"
    if q == 1 and _reads_quantized(layer) and window is None and softcap is None:
        out = fused_decode(query, layer.quant, scaling)  # None off a CPU or without the kernel
        if out is not None:
            return out
    if not layer.is_ragged:
        keys, values = layer.rectangular()  # a quantized layer's dequantized once
        n = keys.shape[2]
        if not layer.has_invalid and q == n and window is None:
            return _sdpa(query, keys, values, None, scaling, softcap, is_causal=q > 1)
        # a forward's own tokens have the same positions in every head: one mask serves all heads
        positions = layer.positions[:, 0] if q == n else layer.positions
        mask = attention_mask_for(positions, q, layer.has_invalid, window)
        if grouped:
            return _grouped_step(query, keys, values, mask, scaling, softcap)
        if mask is not None and mask.dim() == 4 and mask.shape[1] > 1:
            mask = mask.repeat_interleave(query.shape[1] // mask.shape[1], dim=1)
        return _sdpa(query, keys, values, mask, scaling, softcap)
    outputs = []
    for h in range(heads):
        k, v, pos = layer.head(h)
        mask = attention_mask_for(pos, q, layer.has_invalid, window)
        rows = query[:, h * group : (h + 1) * group]
        if grouped:
            outputs.append(_grouped_step(rows, k[:, None], v[:, None], mask, scaling, softcap))
        else:
            outputs.append(_sdpa(rows, k[:, None], v[:, None], mask, scaling, softcap))
    return torch.cat(outputs, dim=1)


def _reads_quantized(layer: BudgetLayer) -> bool:
    """Whether a step may read ``layer`` through the fused quantized read: its heads are stored
    below 16 bits and every entry is visible."""
    return layer.quant is not None and not layer.has_invalid and all(h.bits < 16 for h in layer.quant)


def _grouped_step(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """One new token's attention, ``query: [b, q_heads, 1, d]`` over ``keys/values: [b, heads, n, d]``
    laid out as ``[b, heads, q_heads / heads, d]``: each KV head's query group as the rows of one
    query. Exact; on a CPU SDPA with ``enable_gqa`` runs a one-row query per query head, 15-20x
    slower at 8K-32K entries than this layout's one matrix product per KV head
    (docs/architecture.md "Decode attention"). ``mask``: broadcastable to ``[b, heads, 1, n]``, so
    the same for every row of a group. Returns ``[b, q_heads, 1, d_v]``."""
    b, q_heads, _, d = query.shape
    heads = keys.shape[1]
    rows = query.reshape(b, heads, q_heads // heads, d)
    if softcap is not None:
        out = softcapped_attention(rows, keys, values, mask, scaling, softcap)
    else:
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(b, q_heads, 1, values.shape[-1])


def attend_static(
    query: torch.Tensor,
    cache: StaticBudgetCache,
    layer_idx: int,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
    grouped_queries: bool | None = None,
) -> torch.Tensor:
    """Exact attention of ``query: [b, q_heads, q, d]`` over a static layer, in one call.

    Each KV head's query group is laid out as that head's queries (``[b, kv_heads, group · q, d]``),
    so one SDPA call with a ``[b, kv_heads, group · q, capacity]`` length mask covers every
    (row, head) at its own length, with no loop over heads and no host sync. Query ``t`` of the
    ``q`` new tokens (already written by :meth:`StaticBudgetCache.update`) sees the slots before
    ``length − q + 1 + t``; a sliding ``window`` also drops entries whose position is at most the
    query's position − window. Returns ``[b, q_heads, q, d_v]``.

    ``grouped_queries`` picks the layout of a one-token step (``None``: by device). ``False`` keeps
    each query head its own row (``[b, q_heads, 1, d]``, the KV heads shared through SDPA's
    ``enable_gqa``, the length mask repeated over each group): the faster on CUDA. ``True`` is the
    grouped layout above, the one used on the CPU. Both are exact; steps of several tokens and
    soft-capping always use the grouped one.
    """
    if grouped_queries is None:
        grouped_queries = query.device.type != "cuda"
    keys, values = cache.keys[layer_idx], cache.values[layer_idx]
    b, q_heads, q, d = query.shape
    heads = keys.shape[1]
    group = q_heads // heads
    grouped = query.reshape(b, heads, group * q, d)
    lengths = cache.lengths[layer_idx]  # [b, heads], the new tokens included
    slots = cache._slots[layer_idx]  # [capacity]
    if q == 1 and window is None:
        mask = (slots < lengths[..., None])[:, :, None, :]  # [b, heads, 1, capacity]
    else:
        step = torch.arange(q, device=query.device)
        ends = lengths[..., None] - q + 1 + step  # [b, heads, q]: slots before this are visible
        mask = slots < ends[..., None]  # [b, heads, q, capacity]
        if window is not None:
            seen_at = (cache.seen[:, None, None] + step)[..., None]  # [b, 1, q, 1] query positions
            mask = mask & (cache.positions[layer_idx][:, :, None, :] > seen_at - window)
        mask = mask[:, :, None].expand(b, heads, group, q, slots.numel()).reshape(b, heads, group * q, -1)
    if softcap is None and q == 1 and group > 1 and grouped_queries is False:
        # each query head its own row, the KV heads shared (enable_gqa): on CUDA, SDPA then runs a
        # kernel with a grid over the query heads and a split over the entries, where the grouped
        # layout's few long rows run on a handful of SMs (7x slower on an H200, docs/gpu.md)
        per_head = mask.expand(b, heads, group, slots.numel()).reshape(b, q_heads, 1, -1)
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=per_head, scale=scaling, enable_gqa=True
        )
    if softcap is not None:
        out = softcapped_attention(grouped, keys, values, mask, scaling, softcap)
    else:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(b, q_heads, q, -1)


def _plain_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    info: Any,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact attention for caches that are not BudgetCaches (or no cache): causal + padding, and
    the sliding ``window`` over the key indices (such caches hold contiguous tokens ending with the
    queries' own, as transformers' sliding-window cache layers do)."""
    q, n = query.shape[2], key.shape[2]
    if isinstance(info, torch.Tensor) and info.dim() == 4:
        mask = info
    else:
        padding = info.padding if isinstance(info, PaddingInfo) else None
        if padding is None and (q == n or q == 1) and (window is None or n <= window):
            return _sdpa(query, key, value, None, scaling, softcap, is_causal=q > 1 and q == n)
        mask = causal_visibility(n, q, query.device)[None, None]
        if window is not None:
            index = torch.arange(n, device=query.device)
            mask = mask & window_visibility(index[None], q, window)
        if padding is not None:
            padding = padding[:, -n:].to(torch.bool)
            diagonal = torch.zeros_like(mask)
            diagonal[..., n - q :] = torch.eye(q, dtype=torch.bool, device=mask.device)
            mask = (mask & padding[:, None, None, :]) | diagonal
    return _sdpa(query, key, value, mask, scaling, softcap)


def kvbudget_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"kvbudget"``.

    Args:
        query: ``[b, q_heads, q, d]`` post-RoPE queries (after the model's query norm, if any);
            key/value: what the cache returned.
        attention_mask: the :class:`PaddingInfo` from :func:`kvbudget_mask` (or a user 4-D mask).
        kwargs: ``sliding_window`` (the layer's window, ``None`` = global) and ``softcap`` (Gemma
            2's attention logit soft-capping) as the model passes them; ``kvbudget_cache``.

    Returns:
        ``([b, q, q_heads, d], None)`` as transformers expects.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    cache = kwargs.get("kvbudget_cache")
    if isinstance(cache, StaticBudgetCache):
        out = attend_static(query, cache, module.layer_idx, scale, window, softcap)
        return out.transpose(1, 2).contiguous(), None
    if isinstance(cache, JoinedCache):  # continuous batching: each row attends over its own cache
        rows = [
            _attend_budget_cache(
                cache.rows[r], module.layer_idx, query[r : r + 1], None, scale, window, softcap
            )
            for r in range(len(cache.rows))
        ]
        return torch.cat(rows, 0).transpose(1, 2).contiguous(), None
    if not isinstance(cache, BudgetCache):
        out = _plain_attention(query, key, value, attention_mask, scale, window, softcap)
        return out.transpose(1, 2).contiguous(), None
    out = _attend_budget_cache(cache, module.layer_idx, query, attention_mask, scale, window, softcap)
    return out.transpose(1, 2).contiguous(), None


def _attend_budget_cache(
    cache: BudgetCache,
    layer_idx: int,
    query: torch.Tensor,
    attention_mask: Any,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """``[b, q_heads, q, d]`` attention of ``query`` over layer ``layer_idx`` of ``cache``, then the
    cache's session (compression) sees the layer."""
    layer = cache.layers[layer_idx]
    layer.sliding_window, layer.softcap = window, softcap
    if isinstance(attention_mask, PaddingInfo):
        valid = attention_mask.new_token_valid()
        if valid is not None:
            layer.invalidate_new_tokens(valid)
    out = attend_layer(query, layer, scale)
    if cache.session is not None:
        cache.session.after_attention(layer_idx, query, layer, scale, cache.layers)
        cache.note_memory(layer_idx)
        if cache.session.edits_earlier_layers and cache.session.phase == Phase.PREFILL:
            for earlier in range(layer_idx):  # re-evicted (cascading) or compressed after the last layer
                cache.note_memory(earlier)
    return out


def _inject_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    cache = kwargs.get("past_key_values")
    if isinstance(cache, BudgetCache):
        cache.attention_attached = True
        kwargs["kvbudget_cache"] = cache
        session = cache.session
        if getattr(session, "wants_attention_inputs", False):  # profile recorders are sessions too
            session.before_attention(module, args[0] if args else kwargs["hidden_states"])
    elif isinstance(cache, JoinedCache):
        for r, row in enumerate(cache.rows):
            row.attention_attached = True
            if getattr(row.session, "wants_attention_inputs", False):  # row r's slice of the batch
                hidden = args[0] if args else kwargs["hidden_states"]
                row.session.before_attention(module, hidden[r : r + 1])
        kwargs["kvbudget_cache"] = cache
    elif isinstance(cache, StaticBudgetCache):
        kwargs["kvbudget_cache"] = cache
    return args, kwargs


def _attention_modules(model: PreTrainedModel) -> list[nn.Module]:
    """The decoder's attention modules: those with a ``layer_idx`` and separate ``q_proj``/``k_proj``
    projections or a fused ``qkv_proj`` (Phi-3)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx")
        and ((hasattr(m, "q_proj") and hasattr(m, "k_proj")) or hasattr(m, "qkv_proj"))
    ]


def check_supported(model: PreTrainedModel) -> None:
    """Raise :class:`UnsupportedModelError` unless the model's architecture is in
    ``SUPPORTED_MODEL_TYPES`` (decoders whose attention calls transformers' attention interface)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = (
            " (multimodal Gemma 3 is not: its image tokens attend bidirectionally; use a text-only "
            "gemma3_text checkpoint)"
            if model_type == "gemma3"
            else ""
        )
        raise UnsupportedModelError(
            f"unsupported architecture '{model_type}': kvbudget supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}{hint}"
        )


def is_attached(model: PreTrainedModel) -> bool:
    return hasattr(model, "_kvbudget_hooks")


def attach(model: PreTrainedModel) -> PreTrainedModel:
    """Route the model's attention through kvbudget (idempotent). Returns the model."""
    check_supported(model)
    if is_attached(model):
        return model
    AttentionInterface.register(ATTENTION_NAME, kvbudget_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvbudget_mask)
    modules = _attention_modules(model)
    if not modules:
        raise UnsupportedModelError(
            f"no attention modules with q_proj/k_proj found in {type(model).__name__}"
        )
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    model._kvbudget_hooks = [m.register_forward_pre_hook(_inject_cache, with_kwargs=True) for m in modules]
    model._kvbudget_previous_attention = previous
    return model


def detach(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`attach`: remove the hooks and restore the previous attention implementation."""
    if not is_attached(model):
        return model
    for handle in model._kvbudget_hooks:
        handle.remove()
    model.set_attn_implementation(model._kvbudget_previous_attention)
    del model._kvbudget_hooks
    del model._kvbudget_previous_attention
    return model


@contextmanager
def attached(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Context manager form of :func:`attach`/:func:`detach` (detaches only if it attached)."""
    was_attached = is_attached(model)
    attach(model)
    try:
        yield model
    finally:
        if not was_attached:
            detach(model)
