"""KVzip+: KVzip's reconstruction scores weighted by what each entry writes and each query reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from kvbudget.errors import KVBudgetError
from kvbudget.methods.kvzip import KVzip, ReconstructionScores


def value_output_norms(o_proj: torch.Tensor, values: torch.Tensor, group: int) -> torch.Tensor:
    """``‖W_O^{(h, g)} v_i‖`` for every query head ``g`` of each KV head ``h``: ``[kv_heads, group, m]``.

    ``o_proj: [hidden, q_heads · d]`` (the attention's output projection; query head ``h·group + g``
    reads columns ``(h·group + g)·d …``), ``values: [kv_heads, m, d]``.
    """
    heads, _, d = values.shape
    w = o_proj.float().reshape(o_proj.shape[0], heads, group, d)  # [hidden, h, g, d]
    return torch.einsum("jhgd,hmd->hgmj", w, values.float()).norm(dim=-1)


class NormalizedReconstructionScores(ReconstructionScores):
    """KVzip's reconstruction session, each attention weight ``a[t, i]`` of query head ``(h, g)``
    multiplied by ``‖W_O^{(h, g)} v_i‖ / ‖x_t‖`` before the maximum over queries and heads.

    ``x_t`` is the attention module's input at the pass's token ``t`` (the decoder layer's
    normalised hidden state); :meth:`before_attention` keeps its norms and the module's output
    projection for the layer about to attend.
    """

    wants_attention_inputs: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.input_norms: dict[int, torch.Tensor] = {}  # layer → [q] ‖x_t‖ of the pass's tokens
        self.o_proj: dict[int, torch.Tensor] = {}  # layer → [hidden, q_heads · d]
        #: the last chunk's ``‖W_O v‖`` ``[h, g, m]`` by (layer, columns): every query block of a
        #: pass over one chunk weighs the same entries, so it is computed once per chunk and layer
        self._out_norms: tuple[tuple[int, int, int], torch.Tensor] | None = None

    def before_attention(self, module: nn.Module, hidden_states: torch.Tensor) -> None:
        o_proj = getattr(module, "o_proj", None)
        if o_proj is None:
            raise KVBudgetError(
                f"kvzip+ needs the attention's output projection (o_proj); {type(module).__name__} has none"
            )
        layer_idx = int(module.layer_idx)
        self.input_norms[layer_idx] = hidden_states[0].float().norm(dim=-1)
        self.o_proj[layer_idx] = o_proj.weight

    def weigh(
        self, probs: torch.Tensor, layer_idx: int, layer: Any, rows: slice, columns: slice
    ) -> torch.Tensor:
        key = (layer_idx, columns.start, columns.stop)
        if self._out_norms is None or self._out_norms[0] != key:
            values = layer.values[0][:, columns]  # [h, m, d]
            norms = value_output_norms(self.o_proj[layer_idx], values, probs.shape[1]).to(probs.device)
            self._out_norms = (key, norms)  # [h, g, m]
        out_norms = self._out_norms[1]
        inv = 1.0 / self.input_norms[layer_idx][rows].to(probs.device)  # [rows]
        return probs * inv[None, None, :, None] * out_norms[:, :, None, :]


@dataclass(frozen=True)
class KVzipPlus(KVzip):
    """KVzip+: KVzip's context reconstruction, its attention weights normalised as in KVzap.

    KVzip scores entry ``i`` of KV head ``h`` by the most attention any query of the
    reconstruction pass pays it. KVzap (its KVzip+ score) notes that attention alone ignores what an entry
    adds to the output: query ``t`` attends with weight ``a[t, i]`` and writes
    ``a[t, i] · W_O v_i`` into the residual stream, whose scale is the layer's input ``x_t``. Its
    KVzip+ score is therefore
    ``S[l, h, i] = max_{g, t} a_{g,t}[i] · ‖W_O^{(h, g)} v_i‖ / ‖x_t‖``,
    with ``W_O^{(h, g)}`` the output projection's columns of query head ``g`` of the group. The
    passes, chunking, prefix handling, sinks and budget levels are KVzip's (see
    :class:`~kvbudget.methods.kvzip.KVzip`); the scores are the only change, and because they are
    not a setting of KVzip's scoring it is a class, not a named combination.

    Shapes: ``x: [q, hidden]`` (the attention module's input for the pass's ``q`` tokens),
    ``W_O: [hidden, q_heads · d]``, values ``[kv_heads, m, d]`` for the chunk's ``m`` entries.

    Deviations (*ours*): ``W_O v`` and the norms are computed in fp32 (kvpress in the model's
    dtype); like kvpress we take ``x_t`` as the attention module's input (after the decoder
    layer's input norm).

    Reference: Jegou and Jeblick, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning",
    arXiv:2601.07891 (KVzip+); KVzip: Kim et al., arXiv:2505.23416. kvpress 0.5.5:
    ``KVzipPress(kvzip_plus_normalization=True)``.
    """

    name: ClassVar[str] = "kvzip+"
    paper: ClassVar[str] = "arXiv:2601.07891"
    summary: ClassVar[str] = (
        "KVzip's reconstruction scores, each attention weight times ‖W_O v‖ of its entry over ‖x‖ of "
        "its query (KVzap's normalisation); one top-k over all layers and heads"
    )
    code: ClassVar[str] = "NVIDIA/kvpress"
    kvpress: ClassVar[str] = "KVzipPress"
    scores_session: ClassVar[type[ReconstructionScores]] = NormalizedReconstructionScores
