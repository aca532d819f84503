"""The ``kvbudget`` attention function, its mask function, and explicit attachment.

``attach(model)`` registers (once, by name, in transformers' ``AttentionInterface`` and
``AttentionMaskInterface``) an attention function that computes exact attention over whatever a
:class:`~kvbudget.cache.BudgetCache` layer holds — rectangular or per-head, with invalid slots
masked — and then hands the cache's compression session the layer's post-RoPE queries. Nothing
happens at import; ``detach(model)`` restores the model's previous attention implementation.

The cache reaches the attention function through a forward pre-hook on each attention module that
copies the module's ``past_key_values`` argument into the ``kvbudget_cache`` keyword (transformers
forwards extra keywords to the attention function).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from kvbudget.cache import BudgetCache, BudgetLayer
from kvbudget.errors import UnsupportedModelError
from kvbudget.models import SUPPORTED_MODEL_TYPES

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


def _causal_visibility(n_keys: int, q: int, device: torch.device) -> torch.Tensor:
    """``[q, n_keys]`` bool: old keys visible to every new query, new keys causally."""
    n_old = n_keys - q
    cols = torch.arange(n_keys, device=device)
    rows = torch.arange(q, device=device)
    return (cols[None, :] < n_old) | (cols[None, :] - n_old <= rows[:, None])


def attention_mask_for(positions: torch.Tensor, q: int, has_invalid: bool) -> torch.Tensor | None:
    """Boolean attention mask for ``q`` new queries over keys whose positions are ``positions``.

    Args:
        positions: ``[b, n]`` or ``[b, h, n]`` logical positions of the keys (``-1`` = invalid);
            the last ``q`` keys are the new tokens.
        q: number of new queries.
        has_invalid: whether any key may be invalid.

    Returns:
        ``None`` when no mask is needed, else a bool mask broadcastable to ``[b, heads, q, n]``
        (True = attend). Invalid queries attend to themselves only, avoiding empty rows.
    """
    n = positions.shape[-1]
    if not has_invalid and q == 1:
        return None
    mask = _causal_visibility(n, q, positions.device)
    if has_invalid:
        valid = positions >= 0
        if valid.dim() == 2:
            valid = valid[:, None, None, :]
        else:
            valid = valid[:, :, None, :]
        diagonal = torch.zeros_like(mask)
        diagonal[:, n - q :] = torch.eye(q, dtype=torch.bool, device=mask.device)
        mask = (mask & valid) | diagonal
    return mask


def attend_layer(query: torch.Tensor, layer: BudgetLayer, scaling: float) -> torch.Tensor:
    """Exact attention of ``query: [b, q_heads, q, d]`` over all entries of ``layer``.

    The last ``q`` entries of every head are the queries' own tokens (they were just appended).
    Returns ``[b, q_heads, q, d_v]``.
    """
    q = query.shape[2]
    if not layer.is_ragged:
        if not layer.has_invalid and q == layer.keys.shape[2]:
            return F.scaled_dot_product_attention(
                query, layer.keys, layer.values, is_causal=q > 1, scale=scaling, enable_gqa=True
            )
        mask = attention_mask_for(layer.positions, q, layer.has_invalid)
        if mask is not None and mask.dim() == 4 and mask.shape[1] > 1:
            mask = mask.repeat_interleave(query.shape[1] // mask.shape[1], dim=1)
        return F.scaled_dot_product_attention(
            query, layer.keys, layer.values, attn_mask=mask, scale=scaling, enable_gqa=True
        )
    heads = layer.num_heads
    group = query.shape[1] // heads
    outputs = []
    for h in range(heads):
        k, v, pos = layer.head(h)
        mask = attention_mask_for(pos, q, layer.has_invalid)
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, h * group : (h + 1) * group],
                k[:, None],
                v[:, None],
                attn_mask=mask,
                scale=scaling,
                enable_gqa=True,
            )
        )
    return torch.cat(outputs, dim=1)


def _plain_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, info: Any, scaling: float
) -> torch.Tensor:
    """Exact attention for caches that are not BudgetCaches (or no cache): causal + padding."""
    q, n = query.shape[2], key.shape[2]
    if isinstance(info, torch.Tensor) and info.dim() == 4:
        mask = info
    else:
        padding = info.padding if isinstance(info, PaddingInfo) else None
        if padding is None and (q == n or q == 1):
            return F.scaled_dot_product_attention(
                query, key, value, is_causal=q > 1 and q == n, scale=scaling, enable_gqa=True
            )
        mask = _causal_visibility(n, q, query.device)[None, None]
        if padding is not None:
            padding = padding[:, -n:].to(torch.bool)
            diagonal = torch.zeros_like(mask)
            diagonal[..., n - q :] = torch.eye(q, dtype=torch.bool, device=mask.device)
            mask = (mask & padding[:, None, None, :]) | diagonal
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


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
        query: ``[b, q_heads, q, d]`` post-RoPE queries; key/value: what the cache returned.
        attention_mask: the :class:`PaddingInfo` from :func:`kvbudget_mask` (or a user 4-D mask).

    Returns:
        ``([b, q, q_heads, d], None)`` as transformers expects.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = kwargs.get("kvbudget_cache")
    if not isinstance(cache, BudgetCache):
        out = _plain_attention(query, key, value, attention_mask, scale)
        return out.transpose(1, 2).contiguous(), None
    layer_idx = module.layer_idx
    layer = cache.layers[layer_idx]
    if isinstance(attention_mask, PaddingInfo):
        valid = attention_mask.new_token_valid()
        if valid is not None:
            layer.invalidate_new_tokens(valid)
    out = attend_layer(query, layer, scale)
    if cache.session is not None:
        cache.session.after_attention(layer_idx, query, layer, scale, cache.layers)
        cache.note_memory(layer_idx)
        if cache.session.method.edits_earlier_layers and cache.session.phase == "prefill":
            for earlier in range(layer_idx):  # re-evicted (cascading) or compressed after the last layer
                cache.note_memory(earlier)
    return out.transpose(1, 2).contiguous(), None


def _inject_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    cache = kwargs.get("past_key_values")
    if isinstance(cache, BudgetCache):
        cache.attention_attached = True
        kwargs["kvbudget_cache"] = cache
    return args, kwargs


def _attention_modules(model: PreTrainedModel) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "q_proj") and hasattr(m, "k_proj")
    ]


def check_supported(model: PreTrainedModel) -> None:
    """Raise :class:`UnsupportedModelError` unless the model is a Llama-like decoder."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported architecture '{model_type}': kvbudget supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(model.config, "use_sliding_window", False):
        raise UnsupportedModelError(f"sliding-window attention ({model_type}) is not supported")


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
