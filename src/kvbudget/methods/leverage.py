"""Leverage: keep the keys that are statistical outliers of the layer's key matrix (approximate leverage)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbudget.errors import BudgetError, KVBudgetError, MethodOptionError, UnsupportedModelError
from kvbudget.methods.base import RunState
from kvbudget.methods.composable import Composable
from kvbudget.methods.expected_attention import rope_angles, rotate_half
from kvbudget.observation import Observation
from kvbudget.selection import protected_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def leverage_scores(keys: torch.Tensor, sketch: torch.Tensor, ridge: float) -> torch.Tensor:
    """Ridge leverage of each row of the centred, sketched keys ``X = (K − mean K) Φ``.

    ``ℓ_i = x_iᵀ (XᵀX + λI)⁺ x_i`` (clamped at 0), with ``K: [h, m, d]`` the keys of one KV head per
    ``h`` (float64), ``Φ: [h, d, k]`` the sketch and ``λ = ridge``. Returns ``[h, m]`` float64.
    """
    centred = keys - keys.mean(dim=1, keepdim=True)
    x = centred @ sketch  # [h, m, k]
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    inverse = torch.linalg.pinv(x.transpose(1, 2) @ x + ridge * eye, hermitian=True)  # [h, k, k]
    return torch.einsum("hmk,hkl,hml->hm", x, inverse, x).clamp_min(0.0)


def unrotated_keys(
    keys: torch.Tensor, rope: torch.Tensor, inv_freq: torch.Tensor, scale: float
) -> torch.Tensor:
    """Pre-RoPE keys from post-RoPE ``keys: [h, m, d]`` at RoPE positions ``rope: [m]`` (float64).

    RoPE at minus each position, over the first ``2·len(inv_freq)`` dims (``rotate_half``'s layout),
    divided by the RoPE type's attention scaling ``scale`` (which multiplies only the rotated dims).
    """
    rot = 2 * inv_freq.numel()
    cos, sin = rope_angles(rope, inv_freq.to(rope.device))  # [m, rot]
    k = keys.double()
    plain = k.clone()
    plain[..., :rot] = (k[..., :rot] * cos - rotate_half(k, rot)[..., :rot] * sin) / scale
    return plain


@dataclass
class LeverageRun(RunState):
    """A leverage run: the model's RoPE (``inv_freq``, ``rope_scale``; ``None``: no model bound) and the
    sketches drawn so far, one per layer in layer order from one generator seeded with ``seed``."""

    inv_freq: torch.Tensor | None = None
    rope_scale: float = 1.0
    generator: torch.Generator | None = None
    sketches: list[torch.Tensor] = field(default_factory=list)
    #: per batch row, the blending weight of the layer being compressed (Compactor)
    blends: list[float] | None = None


@dataclass(frozen=True)
class Leverage(Composable):
    """Leverage: keep the entries whose pre-RoPE keys have the highest approximate leverage scores.

    The leverage score of row ``i`` of a matrix ``K`` is ``ℓ_i = k_iᵀ (KᵀK)⁺ k_i``, the ``i``-th
    diagonal entry of the projector onto ``K``'s column space: how far a key lies outside the
    directions most keys share. Compactor approximates it on a right Gaussian sketch. Per batch
    row, layer and KV head, over the candidate entries (valid, neither sink nor window): the pre-RoPE
    keys ``K: [m, d]`` are centred over the sequence, sketched ``X = (K − K̄) Φ`` with
    ``Φ: [d, k]`` of i.i.d. ``N(0, 1/k)`` entries, and scored ``ℓ_i = x_iᵀ (XᵀX + λI)⁻¹ x_i`` with a
    small ridge ``λ``. Each KV head keeps its top ``B`` (uniform allocators by default). No query and
    no attention is used: the selection does not depend on the question. The nearest registered
    method, ``keydiff``, also ranks keys by their geometry alone, by the cosine to the mean key; the
    leverage is another score, not a setting of it, hence a class.

    The sketch of layer ``l`` is the ``(l + 1)``-th draw of ``torch.randn((1, kv_heads, d, k))`` in
    float32 from a CPU generator seeded with ``seed``, times ``1/√k``: the same matrices on every
    device, and the ones kvpress's ``LeverageScorePress`` draws when torch's global generator is
    seeded with ``seed`` before the prefill of a float32 model (it draws in the keys' dtype; its
    oracle in ``tests/test_kvpress_oracle.py`` seeds it so). When ``k ≥ d`` the sketch has full row
    rank and, but for the ridge, the scores are the exact leverage of the centred keys, whatever
    the draw.

    Shapes: keys ``[b, kv_heads, n, d]``; ``Φ: [kv_heads, d, k]``; scores ``[b, kv_heads, n]``.

    Deviations from kvpress 0.5.5's ``LeverageScorePress`` (*code*): it recomputes the pre-RoPE keys
    from the hidden states; we un-rotate the keys the attention used (RoPE at minus their position,
    from the model's ``rotary_emb``, its ``attention_scaling`` divided out; the same vectors up to
    float rounding). It scores in the model's
    dtype with a Cholesky solve, the ridge raised tenfold if the factorisation fails; we score in
    float64 with a pseudo-inverse (``ridge=0`` is the plain leverage). It draws one sketch per batch
    row; we draw one per layer, shared by the rows, so a prompt keeps the same entries alone or in a
    batch. It z-scores the scores over the layer, an affine map that changes no selection within a
    layer; we return the leverage itself. Against the paper (*paper*): the authors' engine
    (``vnchari/compactor-vllm``) scores blocks of 512 keys and a ridge of 5e-3; we follow kvpress.

    Reference: Chari and Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
    Approximate Leverage Scores" (arXiv:2507.08143); the scores as kvpress 0.5.5's
    ``LeverageScorePress`` computes them (written by the first author).

    Args:
        sketch: the sketch's columns ``k`` (48). ridge: ``λ`` (0.01, kvpress's first jitter).
        seed: seeds the sketches' generator (0).
        window: recent entries always kept (0). sinks: first entries always kept (0).
        layer_alloc, head_alloc, beta, floor_alpha: the allocators (uniform by default;
            :class:`~kvbudget.methods.composable.Composable`). A layer budget below
            ``window + sinks + 1`` (PyramidKV's schedule at a small budget with sinks) is refused.
    """

    name: ClassVar[str] = "leverage"
    paper: ClassVar[str] = "arXiv:2507.08143"
    summary: ClassVar[str] = (
        "keys' approximate leverage scores (centred pre-RoPE keys on a seeded Gaussian sketch): the "
        "key-space outliers; query-free"
    )
    code: ClassVar[str] = "NVIDIA/kvpress"
    kvpress: ClassVar[str] = "LeverageScorePress"
    window: int = 0
    sketch: int = 48
    ridge: float = 0.01
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        if isinstance(self.sketch, bool) or not isinstance(self.sketch, int) or self.sketch < 1:
            raise MethodOptionError(f"{self.name}: sketch must be an integer ≥ 1, got {self.sketch!r}")
        if isinstance(self.ridge, bool) or not isinstance(self.ridge, (int, float)) or not self.ridge >= 0:
            raise MethodOptionError(f"{self.name}: ridge must be ≥ 0, got {self.ridge!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise MethodOptionError(f"{self.name}: seed must be an integer, got {self.seed!r}")

    def start(self, model: PreTrainedModel | None = None) -> LeverageRun:
        """A run with the model's RoPE bound (``rotary_emb.inv_freq`` and ``attention_scaling``)."""
        if model is None:
            return LeverageRun()
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
        rotary = getattr(decoder, "rotary_emb", None)
        inv_freq = getattr(rotary, "inv_freq", None)
        if inv_freq is None:
            raise UnsupportedModelError(
                f"{self.name} needs the model's rotary embedding (rotary_emb.inv_freq) to recover the "
                f"pre-RoPE keys, which {type(model).__name__} does not have"
            )
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        return LeverageRun(inv_freq=inv_freq.detach().float().cpu(), rope_scale=scale)

    def layer_budget(self, budget: int, length: int, layer_idx: int, num_layers: int) -> int:
        """The allocator's budget, refused in one line where it is below what the layer always keeps
        (PyramidKV's schedule floors at the window, leaving the sinks out)."""
        allotted = super().layer_budget(budget, length, layer_idx, num_layers)
        floor = min(length, self.window + self.sinks + 1)
        if allotted < floor:
            raise BudgetError(
                f"{self.name}: layer_alloc={self.layer_alloc} gives layer {layer_idx} {allotted} entries per "
                f"head, below the {floor} it always keeps (window {self.window} + sinks {self.sinks} + 1); "
                "use a larger budget, fewer sinks or layer_alloc=uniform"
            )
        return allotted

    def sketch_of(self, run: LeverageRun, layer_idx: int, heads: int, dim: int) -> torch.Tensor:
        """``Φ: [heads, dim, k]`` (float32, CPU) of layer ``layer_idx``: the run's ``(layer_idx + 1)``-th
        draw (earlier layers' sketches are drawn first if they were not yet)."""
        if run.generator is None:
            run.generator = torch.Generator().manual_seed(self.seed)
        while len(run.sketches) <= layer_idx:
            draw = torch.randn((1, heads, dim, self.sketch), generator=run.generator, dtype=torch.float32)
            run.sketches.append(draw[0] * (1 / math.sqrt(self.sketch)))
        return run.sketches[layer_idx]

    def candidates(self, obs: Observation) -> torch.Tensor:
        """``[b, n]`` bool: the entries scored (valid, neither sink nor window); heads share them."""
        return (obs.valid & ~protected_mask(obs.positions, self.window, self.sinks))[:, 0]

    def row_leverage(self, obs: Observation, row: int, slots: torch.Tensor) -> torch.Tensor:
        """``[kv_heads, m]`` float64: the leverage of row ``row``'s entries ``slots: [m]`` among them."""
        run = self.run_of(obs)
        if run.inv_freq is None:
            raise KVBudgetError(
                f"{self.name}: start the run with the model, method.start(model) "
                "(kvbudget.compress and generate do)"
            )
        keys = obs.keys[row][:, slots]  # [h, m, d]
        heads, _, d = keys.shape
        if 2 * run.inv_freq.numel() > d:
            raise UnsupportedModelError(
                f"{self.name}: rotary dims {2 * run.inv_freq.numel()} exceed head dim {d}"
            )
        rope = (obs.valid[row, 0].long().cumsum(0) - 1)[slots]  # each entry's RoPE position
        plain = unrotated_keys(keys, rope, run.inv_freq, run.rope_scale)
        sketch = self.sketch_of(run, obs.layer_idx, heads, d).to(device=keys.device, dtype=torch.float64)
        return leverage_scores(plain, sketch, float(self.ridge))

    def score(self, obs: Observation) -> torch.Tensor:
        candidates = self.candidates(obs)
        scores = torch.zeros(obs.positions.shape, dtype=torch.float32, device=obs.keys.device)
        for r in range(scores.shape[0]):
            slots = candidates[r].nonzero().flatten()
            if slots.numel():
                scores[r][:, slots] = self.row_leverage(obs, r, slots).float()
        return scores
