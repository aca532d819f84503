"""KVgrad: KVzip's reconstruction scores weighted by ‖W_O v‖ and by the gradient of the last states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvbudget.errors import KVBudgetError
from kvbudget.methods.kvzip import KVzip, KVzipRun, ReconstructionScores
from kvbudget.methods.kvzip_plus import value_output_norms
from kvbudget.profiles import decoder_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvbudget.cache import BudgetCache


class GradientReconstructionScores(ReconstructionScores):
    """KVzip's reconstruction session, scored after the pass's backward pass rather than during it.

    During the forward each layer's post-RoPE queries and its cache (the context followed by the
    pass's tokens, detached) are held; :meth:`score_held` then takes, per layer, the gradient norms
    ``‖∂Φ/∂o_t‖`` of the pass's tokens and the output projection, and scores the chunk with
    :meth:`weigh` multiplying each attention weight ``a_{g,t}[i]`` by ``‖W_O^{(h, g)} v_i‖ · ‖∂Φ/∂o_t‖``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[int, tuple[torch.Tensor, Any, float]] = {}  # layer → (query, layer, scaling)
        self.grad_norms: dict[int, torch.Tensor] = {}  # layer → [q] ‖∂Φ/∂o_t‖
        self.out_norms: dict[int, torch.Tensor] = {}  # layer → [kv_heads, group, m] ‖W_O^{(h, g)} v_i‖

    def after_attention(self, layer_idx: int, query: torch.Tensor, layer: Any, scaling: float, layers=None):
        held = layer.shallow_copy()
        held.keys, held.values = layer.keys.detach(), layer.values.detach()
        self.held[layer_idx] = (query.detach(), held, scaling)
        if layers is not None:  # the pass's copy lives on in `held` (and in the graph) until scored
            layers[layer_idx] = self.context[layer_idx].shallow_copy()

    def score_held(self, grad_norms: dict[int, torch.Tensor], o_proj: dict[int, torch.Tensor]) -> None:
        """Score every held layer: ``grad_norms[layer]: [q]``, ``o_proj[layer]: [hidden, q_heads · d]``."""
        _, start, end = self.span
        for layer_idx in sorted(self.held):
            query, layer, scaling = self.held.pop(layer_idx)
            values = layer.values[0][:, start:end]  # [h, m, d]
            group = query.shape[1] // values.shape[0]
            self.out_norms[layer_idx] = value_output_norms(o_proj[layer_idx], values, group)
            self.grad_norms[layer_idx] = grad_norms[layer_idx].float()
            self.score_pass(layer_idx, query, layer, scaling)
            del self.out_norms[layer_idx], self.grad_norms[layer_idx]

    def weigh(
        self, probs: torch.Tensor, layer_idx: int, layer: Any, rows: slice, columns: slice
    ) -> torch.Tensor:
        out_norms = self.out_norms[layer_idx].to(probs.device)  # [h, g, m]
        grads = self.grad_norms[layer_idx][rows].to(probs.device)  # [rows]
        return probs * out_norms[:, :, None, :] * grads[None, None, :, None]


def _attention_and_last(model: PreTrainedModel) -> tuple[list[nn.Module], nn.Module]:
    """The decoder layers' attention modules (each with ``o_proj``) and the last decoder layer."""
    layers = decoder_layers(model)
    modules = [layer.self_attn for layer in layers]
    if not all(isinstance(getattr(m, "o_proj", None), nn.Linear) for m in modules):
        raise KVBudgetError(
            f"kvgrad needs each attention's output projection (o_proj); {type(modules[0]).__name__} has none"
        )
    return list(modules), layers[-1]


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@dataclass(frozen=True)
class KVgrad(KVzip):
    """KVgrad: KVzip's reconstruction pass, each entry's attention weighted by what it writes into
    the residual stream and by how much the last hidden states depend on that stream.

    The passes, chunking, prefix and sinks, and budget levels are KVzip's (see
    :class:`~kvbudget.methods.kvzip.KVzip`). Each pass is also differentiated: with
    ``Φ = Σ_t ‖h_t^L‖²`` over the pass's ``q`` tokens (``h^L``: the last decoder layer's output,
    before the final norm) and ``o_t^l`` the output of layer ``l``'s attention module (after
    ``W_O``, what is added to the residual stream ``r_t^l = x_t^l + o_t^l``, so
    ``∂Φ/∂o_t^l = ∂Φ/∂r_t^l``), entry ``i`` of KV head ``h`` scores (input × gradient attribution)

    ``S[l, h, i] = max_{g, t} a_{g,t}[i] · ‖W_O^{(h, g)} v_i‖ · ‖∂Φ/∂o_t^l‖``

    with ``a_{g,t}`` KVzip's reconstruction attention of query head ``g`` of the group at the pass's
    token ``t`` and ``W_O^{(h, g)}`` the output projection's columns of that query head. Because the
    gradient is known only after the whole forward, each layer's queries and cache are held until
    the backward pass (``torch.autograd.grad`` of ``Φ`` with respect to the attention outputs
    alone), then scored. One top-k over every layer and head (``level="pair"``), as KVzip; it is a
    class rather than a setting of KVzip's or KVzip+'s scoring, which have no gradient.

    Autograd under inference: kvbudget prefills under ``torch.inference_mode``; each pass runs
    with inference mode off and gradients on, from the embeddings of its tokens (a leaf that needs a
    gradient, so the graph exists even if the model's parameters are frozen). The context's cached
    keys and values are constants; only the pass's own activations enter the graph. Gradients are
    taken with ``torch.autograd.grad``, so no parameter's ``.grad`` is written and no
    ``requires_grad`` flag is changed (kvpress freezes the parameters for the pass instead).

    Cost: per chunk, a forward and a backward (roughly two forwards) over ``q = chunk + request``
    tokens, plus KVzip's score; memory holds, until the backward, every layer's copy of the row's
    cache with the pass's tokens and the pass's activations (KVzip: one layer's copy at a time).
    Smaller chunks bound the activations (kvpress's default 512, against KVzip's 2048).

    Shapes: queries ``[1, q_heads, q, d]`` (post-RoPE) per layer, keys ``[kv_heads, lead + m + q, d]``,
    values ``[kv_heads, m, d]`` of the chunk's ``m`` entries, ``W_O: [hidden, q_heads · d]``,
    ``o^l: [1, q, hidden]``; scores ``[kv_heads, n]`` per layer and row.

    Deviations: *code* — kvpress 0.5.5's ``KVgradPress`` is the definition followed (its
    docstring names the OpenReview submission only, whose text was not at hand here); its default
    chunk of 512 is ours.
    *ours* — ``W_O v``, the gradient norms and the score are computed in fp32 (kvpress: the model's
    dtype for ``W_O v`` and the attention), and KVzip's own departures (template prefix kept whole,
    rows one at a time) apply. For architectures with a norm after the attention (Gemma 2 and 3),
    ``o_t`` is still the attention module's output, before that norm, as in kvpress.

    Reference: "KVgrad" (OpenReview, forum cg1wTCJjjk), as implemented by kvpress 0.5.5
    (``KVgradPress``); KVzip: Kim et al., arXiv:2505.23416.

    Args:
        sinks, window, overlap, level, repeat_prompt, continue_prompt: as KVzip.
        chunk: tokens reconstructed per pass and backward pass (512).
    """

    name: ClassVar[str] = "kvgrad"
    paper: ClassVar[str] = "KVgrad, openreview cg1wTCJjjk"
    summary: ClassVar[str] = (
        "KVzip's reconstruction attention times ‖W_O v‖ of the entry times the gradient norm of the "
        "last hidden states' squared norm at the attention output; one top-k over all layers and heads"
    )
    code: ClassVar[str] = "NVIDIA/kvpress"
    kvpress: ClassVar[str] = "KVgradPress"
    scores_session: ClassVar[type[ReconstructionScores]] = GradientReconstructionScores

    chunk: int = 512

    def start(self, model: PreTrainedModel | None = None) -> KVzipRun:
        """KVzip's run; a model whose attention has no output projection is refused first."""
        if model is not None:
            _attention_and_last(model)
        return super().start(model)

    def replay(
        self,
        model: PreTrainedModel,
        clone: BudgetCache,
        session: ReconstructionScores,
        feed: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """A reconstruction pass with its backward pass; ``session`` then scores the chunk."""
        assert isinstance(session, GradientReconstructionScores)
        modules, last = _attention_and_last(model)
        outputs: dict[int, torch.Tensor] = {}
        final: list[torch.Tensor] = []
        hooks = [
            m.register_forward_hook(lambda _m, _a, out, i=i: outputs.__setitem__(i, _first(out)))
            for i, m in enumerate(modules)
        ]
        hooks.append(last.register_forward_hook(lambda _m, _a, out: final.append(_first(out))))
        try:
            with torch.inference_mode(False), torch.enable_grad():
                with torch.no_grad():
                    embeds = model.get_input_embeddings()(feed)
                embeds = embeds.detach().requires_grad_(True)
                model(
                    inputs_embeds=embeds, position_ids=positions, past_key_values=clone,
                    use_cache=True, logits_to_keep=1,
                )  # fmt: skip
                objective = final[-1].float().square().sum()
                grads = torch.autograd.grad(objective, [outputs[i] for i in range(len(modules))])
        finally:
            for hook in hooks:
                hook.remove()
        norms = {i: g[0].float().norm(dim=-1) for i, g in enumerate(grads)}  # [q] per layer
        outputs.clear()  # the activations; the graph itself went with the backward pass
        session.score_held(norms, {i: m.o_proj.weight.detach() for i, m in enumerate(modules)})
