"""Expected Attention: the attention future queries should pay, from the prompt queries' statistics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbudget.allocation import adaptive_head_budgets, safeguard_head_budgets
from kvbudget.errors import KVBudgetError, MethodOptionError, UnsupportedModelError
from kvbudget.methods.base import Method, RunState
from kvbudget.observation import Observation
from kvbudget.selection import protected_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def rotate_half(x: torch.Tensor, rot: int) -> torch.Tensor:
    """The RoPE partner of ``x[..., :rot]`` (``[−x₂, x₁]`` per half), zero beyond ``rot``."""
    half = rot // 2
    out = torch.zeros_like(x)
    out[..., :half] = -x[..., half:rot]
    out[..., half:rot] = x[..., :half]
    return out


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of the rotation at ``positions: [m]`` over the rotated dims: ``[m, 2·len(inv_freq)]``
    (float64; pure rotations, without a RoPE type's attention scaling)."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def average_rotation(start: int, count: int, inv_freq: torch.Tensor, dim: int) -> torch.Tensor:
    """``R̄ = mean_{τ = start … start+count−1} R_τ`` as a ``[dim, dim]`` float64 matrix (identity
    beyond the rotated dims): ``R_τ x = cos(τθ)·x + sin(τθ)·rotate_half(x)``."""
    rot = 2 * inv_freq.numel()
    cos, sin = rope_angles(torch.arange(start, start + count, device=inv_freq.device), inv_freq)
    c, s = cos.mean(0), sin.mean(0)
    matrix = torch.eye(dim, dtype=torch.float64, device=inv_freq.device)
    half = rot // 2
    idx = torch.arange(half, device=inv_freq.device)
    matrix[:rot, :rot] = torch.diag(c)
    matrix[idx + half, idx] = s[half:]  # (R x)[i + half] gets  sin · x[i]
    matrix[idx, idx + half] = -s[:half]  # (R x)[i] gets −sin · x[i + half]
    return matrix


@dataclass
class ExpectedAttentionRun(RunState):
    """An Expected Attention run: the model's RoPE frequencies (``None``: no model bound)."""

    inv_freq: torch.Tensor | None = None


@dataclass(frozen=True)
class ExpectedAttention(Method):
    """Expected Attention: keep the entries future queries are expected to attend to, weighted by ‖v‖.

    Queries are modelled as Gaussian (§3). Per batch row and query head, the prompt's queries —
    those the attention used, after the model's query norms and RoPE — are rotated back to their
    pre-RoPE form (RoPE at minus their position), their mean ``μ`` and covariance ``Σ`` (biased, over
    the valid queries after the first ``sinks``, or the last ``queries`` of them) are taken and moved
    to the future by the average rotation ``R̄ = mean_τ R_τ`` over the next ``future`` positions
    (Eq. 4–5): ``μ̄ = R̄μ``, ``Σ̄ = R̄ΣR̄ᵀ``. For a Gaussian query the expected unnormalised attention
    is closed-form (Eq. 6): ``z_i = exp(s·μ̄ᵀk_i + s²/2 · k_iᵀΣ̄k_i)`` with ``s`` the attention's scale
    (``1/√d``). Normalised over the valid non-sink keys (softmax), averaged over the GQA group and
    weighted by the value (Eq. 7, kvpress's ``use_vnorm``): ``score_i = (ā_i + ε)·‖v_i‖₂``.

    Budgets: head-adaptive (``adaptive=True``, the paper's setting and kvpress's leaderboard entry
    ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``): one top ``H·(B − sinks)`` over the layer's
    heads gives each head's winners ``n_h``, ``cap_h = n_h(1 − α) + (B − sinks)α`` (AdaKV's formula,
    as ``ada-snapkv``; floor ``α = 0.2``) — stored ragged. ``floor="kvpress"`` takes kvpress's floor
    instead (``AdaKVPress``'s ``alpha_safeguard``: each head keeps its own top ``int(α·B)``, sinks
    among them, and one top-k over the heads' remaining entries fills the layer), which keeps
    kvpress's leaderboard entry's positions exactly (``tests/test_kvpress_oracle.py``).
    ``adaptive=False`` keeps ``B`` per head (kvpress's bare ``ExpectedAttentionPress``). The first
    ``sinks`` entries are always kept.

    Shapes: queries ``[b, q_heads, n, d]``, keys and values ``[b, kv_heads, n, d]``; ``μ̄: [q_heads, d]``,
    ``Σ̄: [q_heads, d, d]`` per row; scores ``[b, kv_heads, n]``.

    Deviations: kvpress projects the hidden states again to get pre-RoPE queries; we un-rotate the
    queries the attention used (the same vectors up to float rounding; a RoPE type's attention scale
    cancels, as it scales both the queries and kvpress's ``R̄``). ``R̄`` comes from the model's
    ``rotary_emb.inv_freq`` (bound by :meth:`prepare`); its layout is ``rotate_half``'s (Llama,
    Qwen, Mistral, Gemma, Phi-3; partial rotary: the first ``2·len(inv_freq)`` dims). The default
    head floor is AdaKV's formula (as ``ada-snapkv``), not kvpress's safeguard (``floor="kvpress"``);
    with ``floor_alpha=0`` both are the plain top-k over the layer's heads. We score in float64;
    kvpress scores in the model's dtype, so in bf16 the two keep a few percent different entries
    even with the same floor (docs/leaderboard.md, ``lab/scripts/ea_kvpress_overlap.py``). The
    paper's value term ``‖W_o v‖`` is ``‖v‖`` here, as in kvpress. Prefill only (the paper's
    decoding variant is not implemented).

    Reference: Devoto, Jeblick and Jégou, "Expected Attention: KV Cache Compression by Estimating
    Attention from Future Queries Distribution" (arXiv:2510.00636); NVIDIA kvpress
    ``ExpectedAttentionPress`` (the authors' code).

    Args:
        sinks: first entries always kept and left out of the statistics and the softmax (4).
        window: recent entries always kept (0). future: future positions averaged (512).
        queries: statistics from the last ``queries`` prompt queries (0 = all after the sinks).
        covariance: use ``Σ̄`` (True). value_norm: weight by ``‖v‖₂`` (True). epsilon: ``ε`` (0.01).
        adaptive: head-adaptive budgets (True). floor_alpha: the head floor ``α`` (0.2).
        floor: ``"adakv"`` (AdaKV's ``n_h(1 − α) + α·B'``, the default) or ``"kvpress"`` (each head's
            own top ``int(α·B)`` first, as kvpress's ``AdaKVPress``).
    """

    name: ClassVar[str] = "expected-attention"
    paper: ClassVar[str] = "arXiv:2510.00636"
    summary: ClassVar[str] = (
        "attention expected from the prompt queries' mean and covariance moved to future RoPE "
        "positions (closed form), times ‖v‖; AdaKV head budgets, 4 sinks"
    )
    code: ClassVar[str] = "NVIDIA/kvpress"
    kvpress: ClassVar[str] = "ExpectedAttentionPress"
    fixed_allocation: ClassVar[str] = "its head split is its own adaptive option (with floor_alpha)"
    window: int = 0
    sinks: int = 4
    future: int = 512
    queries: int = 0
    covariance: bool = True
    value_norm: bool = True
    epsilon: float = 0.01
    adaptive: bool = True
    floor_alpha: float = 0.2
    floor: str = "adakv"

    #: the head floors ``floor`` names
    FLOORS: ClassVar[dict[str, Callable[[torch.Tensor, int, int, float], torch.Tensor]]] = {
        "adakv": adaptive_head_budgets,
        "kvpress": safeguard_head_budgets,
    }

    def validate(self) -> None:
        super().validate()
        for option, low in (("future", 1), ("queries", 0)):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise MethodOptionError(f"{self.name}: {option} must be an integer ≥ {low}, got {value!r}")
        if not isinstance(self.epsilon, (int, float)) or self.epsilon < 0:
            raise MethodOptionError(f"{self.name}: epsilon must be ≥ 0, got {self.epsilon!r}")
        if not 0.0 <= self.floor_alpha <= 1.0:
            raise MethodOptionError(f"{self.name}: floor_alpha must be in [0, 1], got {self.floor_alpha}")
        if self.floor not in self.FLOORS:
            raise MethodOptionError(
                f"{self.name}: floor must be one of {', '.join(self.FLOORS)}, got {self.floor!r}"
            )

    def start(self, model: PreTrainedModel | None = None) -> ExpectedAttentionRun:
        """A run with the model's RoPE frequencies bound (``rotary_emb.inv_freq`` of its decoder)."""
        if model is None:
            return ExpectedAttentionRun()
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
        inv_freq = getattr(getattr(decoder, "rotary_emb", None), "inv_freq", None)
        if inv_freq is None:
            raise UnsupportedModelError(
                f"{self.name} needs the model's rotary embedding (rotary_emb.inv_freq), "
                f"which {type(model).__name__} does not have"
            )
        return ExpectedAttentionRun(inv_freq=inv_freq.detach().float().cpu())

    def score(self, obs: Observation) -> torch.Tensor:
        inv_freq = self.run_of(obs).inv_freq
        if inv_freq is None:
            raise KVBudgetError(
                f"{self.name}: start the run with the model, method.start(model) "
                "(kvbudget.compress and generate do)"
            )
        keys, values, valid = obs.keys.float(), obs.values.float(), obs.valid
        b, heads, n, d = keys.shape
        query = obs.query.float()
        q, group = query.shape[2], obs.group_size
        if 2 * inv_freq.numel() > d:
            raise UnsupportedModelError(
                f"{self.name}: rotary dims {2 * inv_freq.numel()} exceed head dim {d}"
            )
        candidates = valid & ~protected_mask(obs.positions, 0, self.sinks)
        scores = torch.zeros((b, heads, n), dtype=torch.float32, device=keys.device)
        for r in range(b):
            slots = valid[r, 0]
            rope = (slots.long().cumsum(0) - 1)[n - q :]  # RoPE position of each query
            used = slots[n - q :] & (rope >= self.sinks)
            if self.queries and bool(used.any()):  # the last `queries` of them
                used &= rope > int(rope[used].max()) - self.queries
            if not bool(used.any()) or not bool(candidates[r].any()):
                continue
            mean, cov = self.future_statistics(query[r][:, used], rope[used], int(slots.sum()), inv_freq)
            k = keys[r].double()  # [h, n, d]
            mean_g = mean.view(heads, group, d)
            logits = torch.einsum("hgd,hnd->hgn", mean_g, k) * obs.scaling
            if self.covariance:
                cov_g = cov.view(heads, group, d, d)
                quad = torch.einsum("hnd,hgde,hne->hgn", k, cov_g, k)
                logits = logits + quad * (obs.scaling**2 / 2)
            logits = logits.masked_fill(~candidates[r][:, None, :], float("-inf"))
            expected = torch.softmax(logits, dim=-1).mean(1)  # [h, n]
            if self.value_norm:
                expected = (expected + self.epsilon) * values[r].double().norm(dim=-1)
            scores[r] = expected.float()
        return scores

    def future_statistics(
        self, query: torch.Tensor, rope: torch.Tensor, length: int, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``μ̄: [q_heads, d]`` and ``Σ̄: [q_heads, d, d]`` (float64) of one row's queries
        ``query: [q_heads, m, d]`` at RoPE positions ``rope: [m]``, moved to positions
        ``length … length + future − 1``."""
        d = query.shape[-1]
        rot = 2 * inv_freq.numel()
        cos, sin = rope_angles(rope.cpu(), inv_freq)  # [m, rot]
        q = query.double().cpu()
        plain = q.clone()  # un-rotate: RoPE at −position
        plain[..., :rot] = q[..., :rot] * cos - rotate_half(q, rot)[..., :rot] * sin
        mean = plain.mean(1)  # [hq, d]
        centred = plain - mean[:, None]
        cov = torch.einsum("hmi,hmj->hij", centred, centred) / plain.shape[1]
        rbar = average_rotation(length, self.future, inv_freq, d)
        device = query.device
        return (mean @ rbar.T).to(device), (rbar @ cov @ rbar.T).to(device)

    def head_budgets(
        self, scores: torch.Tensor, layer_budget: int, protected: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        if not self.adaptive:
            return super().head_budgets(scores, layer_budget, protected, valid)
        candidates = scores.float().masked_fill(protected | ~valid, float("-inf"))
        split = self.FLOORS[self.floor]
        return split(candidates, layer_budget, int(protected[0].sum()), self.floor_alpha)
