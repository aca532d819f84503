"""R-KV: importance minus redundancy, re-selected every ``buffer`` decoded tokens at a fixed cache size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbudget.errors import MethodOptionError
from kvbudget.methods.base import Method, RunState
from kvbudget.observation import Observation
from kvbudget.phases import Stage
from kvbudget.scoring import pool_keys
from kvbudget.selection import keep_within_limits, protected_mask

#: rows of the similarity matrix computed at a time (memory ``block × n`` per head)
SIMILARITY_BLOCK = 256


@dataclass
class RKVRun(RunState):
    """An R-KV run: each layer's last ``window`` post-RoPE queries ``[b, q_heads, w, d]``."""

    queries: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class RKV(Method):
    """R-KV: keep the entries that are attended to and not redundant, while the answer is generated.

    **Cache size** (§3.1): the cache holds at most ``B + buffer`` entries per KV head. The prompt is
    compressed to ``B`` at the prefill when longer; new tokens are appended until a head holds
    ``B + buffer`` entries, then the layer is compressed back to ``B`` (after that step's attention),
    so memory stays within ``B + buffer`` whatever the answer's length.

    **Importance** (§3.2): the last ``window`` (α = 8) queries the layer received (the prompt's last
    ones, then each decoded token's; post-RoPE, as the attention used them) attend to the entries
    before the last ``window``: logits ``s·q·k``, GQA max over each group's logits (the authors'
    ``compute_attention_scores``), softmax over those entries (fp32), mean over the ``window`` rows,
    max-pooled along the entries (kernel 7): ``I_i``.

    **Redundancy** (§3.3): per KV head the cosine similarity ``S = K̂K̂ᵀ`` of all held keys (unit
    keys, diagonal 0); for each entry ``i`` its most recent highly similar entry (largest slot ``j``
    with ``S_ij > threshold``, 0.5) is spared (``S_ij := 0``, β = 1: the latest copy of a repeated
    content is kept); ``R_j = softmax_j(mean_i S_ij)``.

    **Selection** (§3.4): ``Z = λ·I − (1 − λ)·R`` (λ = ``mix_lambda`` 0.1), each head keeps its top
    ``B − window`` entries plus the last ``window``. Uniform budgets (every head keeps ``B``).

    Shapes: window queries ``[b, q_heads, α, d]``; keys ``[b, kv_heads, n, d]``; ``S`` per head
    ``[n, n]``, computed :data:`SIMILARITY_BLOCK` rows at a time; scores ``[b, kv_heads, n]``.

    Deviations from the authors' code (Zefan-Cai/R-KV, ``rkv/compression/r1_kv.py``,
    ``rkv/utils.py::cal_similarity``, ``rkv/modeling.py``): λ = 0.1 (the paper's and README's
    default; ``run_math.py`` uses 0.07); the code compresses when the model's global token count is
    a multiple of 128 — we when a head holds ``B + buffer`` entries (the same period once the prompt
    is compressed, independent of the prompt's length); an entry with no similar entry spares
    nothing (the code then zeroes its similarity to slot 0, favouring the first token); batches of
    several rows (the code handles one), each row scored on its own valid entries. In a
    question-agnostic run the question's tokens are appended unobserved, so the first decode
    compressions see the context's last queries and the decoded ones.

    Reference: Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models"
    (arXiv:2505.24133).

    Args:
        window: α, observation queries and recent entries always kept (8). kernel: max-pool (7).
        buffer: decoded tokens added before re-selecting (128). mix_lambda: λ (0.1).
        threshold: cosine similarity above which two keys are redundant (0.5). sinks: first entries
            always kept (0).
    """

    name: ClassVar[str] = "r-kv"
    paper: ClassVar[str] = "arXiv:2505.24133"
    summary: ClassVar[str] = (
        "attention of the last 8 queries minus key-similarity redundancy (latest copy spared); the "
        "cache grows by a 128-token buffer, then is cut back to the budget"
    )
    code: ClassVar[str] = "Zefan-Cai/R-KV"
    #: re-selects after every decoded token: the cache stays at the budget
    small_options: ClassVar[dict[str, Any]] = {"buffer": 1}
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL, Stage.DECODE)
    window: int = 8
    kernel: int = 7
    buffer: int = 128
    mix_lambda: float = 0.1
    threshold: float = 0.5

    def validate(self) -> None:
        super().validate()
        if isinstance(self.buffer, bool) or not isinstance(self.buffer, int) or self.buffer < 1:
            raise MethodOptionError(f"{self.name}: buffer must be an integer ≥ 1, got {self.buffer!r}")
        if self.window < 1:
            raise MethodOptionError(
                f"{self.name}: window must be ≥ 1 (its queries score the entries), got {self.window}"
            )
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise MethodOptionError(f"{self.name}: mix_lambda must be in [0, 1], got {self.mix_lambda}")
        if not -1.0 <= self.threshold <= 1.0:
            raise MethodOptionError(f"{self.name}: threshold must be in [-1, 1], got {self.threshold}")

    # ------------------------------------------------------------------ observation queries
    def start(self, model: object = None) -> RKVRun:
        return RKVRun()

    def _remember(self, obs: Observation) -> None:
        """Keep the layer's last ``window`` queries (a prefill's last ones, then each decoded one)."""
        queries = self.run_of(obs).queries
        previous = queries.get(obs.layer_idx) if obs.query.shape[2] < obs.keys.shape[2] else None
        recent = obs.query if previous is None else torch.cat([previous, obs.query], dim=2)
        queries[obs.layer_idx] = recent[:, :, -self.window :]

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        self._remember(obs)
        return super().compress_layer(obs, targets)

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        self._remember(obs)
        layer = obs.layer
        lengths = layer.head_lengths().cpu()
        limits = [b if int(lengths[r].max()) >= b + self.buffer else None for r, b in enumerate(row_budgets)]
        if all(limit is None for limit in limits):
            return
        chosen = keep_within_limits(
            layer.positions, lengths, limits, self.score(obs), self.window_for, self.sinks
        )
        if chosen is not None:
            layer.keep(chosen[0])

    # ------------------------------------------------------------------ scores
    def score(self, obs: Observation) -> torch.Tensor:
        return self.mix_lambda * self.importance(obs) - (1 - self.mix_lambda) * self.redundancy(obs)

    def importance(self, obs: Observation) -> torch.Tensor:
        """``I: [b, kv_heads, n]``, 0 on the window and invalid entries."""
        query = self.run_of(obs).queries[obs.layer_idx].float()  # [b, hq, w, d]
        keys, valid = obs.keys.float(), obs.valid
        b, heads, n, d = keys.shape
        w = query.shape[2]
        grouped = query.reshape(b, heads, obs.group_size * w, d)
        logits = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(obs.scaling)
        logits = logits.view(b, heads, obs.group_size, w, n).amax(2)  # GQA max of the logits
        window = protected_mask(obs.positions, self.window, 0)
        candidates = valid & ~window
        logits = logits.masked_fill(~candidates[:, :, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0).mean(2)  # rows without candidates: 0
        return pool_keys(probs, self.kernel, "max")

    def redundancy(self, obs: Observation) -> torch.Tensor:
        """``R: [b, kv_heads, n]`` (softmax over each row's valid entries, 0 elsewhere)."""
        keys, valid = obs.keys.float(), obs.valid
        b, heads, n, _ = keys.shape
        unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
        unit = unit * valid[..., None]
        slots = torch.arange(n, device=keys.device)
        sums = torch.zeros((b, heads, n), dtype=torch.float32, device=keys.device)
        for a in range(0, n, SIMILARITY_BLOCK):
            z = min(a + SIMILARITY_BLOCK, n)
            sim = torch.matmul(unit[:, :, a:z], unit.transpose(-1, -2))  # [b, h, rows, n]
            diagonal = slots[a:z, None] == slots[None, :]
            sim = sim.masked_fill(diagonal, 0.0)
            similar = (sim > self.threshold) & valid[:, :, None, :] & ~diagonal
            last = torch.where(similar, slots, -1).amax(-1)  # most recent similar entry per row
            spared = (slots == last[..., None]) & similar
            sim = sim.masked_fill(spared, 0.0) * valid[:, :, a:z, None]
            sums += sim.sum(2)
        count = valid.sum(-1, keepdim=True).clamp(min=1)
        mean = (sums / count).masked_fill(~valid, float("-inf"))
        return torch.softmax(mean, dim=-1).nan_to_num_(0.0)
