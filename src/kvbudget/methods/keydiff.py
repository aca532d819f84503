"""KeyDiff: keep the keys least similar to the mean key (attention-free, question-agnostic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvbudget.methods.base import Method
from kvbudget.observation import Observation
from kvbudget.phases import Stage


def keydiff_scores(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KeyDiff's score ``s_i = −cos(k_i, μ)`` with the anchor ``μ`` the mean of the normalised keys.

    Args:
        keys: ``[b, kv_heads, n, d]``; valid: ``[b, kv_heads, n]`` bool (the anchor averages the
            valid entries of each batch row and KV head only, so padding does not move it).
    Returns:
        ``[b, kv_heads, n]`` fp32 (higher = more distinctive = keep); invalid entries get any value.
    """
    unit = F.normalize(keys.float(), p=2, dim=-1) * valid[..., None]
    count = valid.sum(-1, keepdim=True).clamp(min=1)  # [b, h, 1]
    anchor = unit.sum(-2) / count  # [b, h, d]
    return -F.cosine_similarity(keys.float(), anchor[:, :, None, :], dim=-1)


@dataclass(frozen=True)
class KeyDiff(Method):
    """KeyDiff: evict the keys most similar to the cache's mean direction.

    Score (Park et al., the anchor form of KeyDiff): ``s_i = −cos(k_i, μ)`` with
    ``μ = (1/n) Σ_j k_j / ‖k_j‖`` over the layer's cached keys of one KV head (post-RoPE keys,
    ``[b, kv_heads, n, d]``), computed in fp32; each KV head keeps its top ``B`` entries. No
    attention and no query is used, so the selection does not depend on the question. The
    anchor averages only the valid entries of a batch row.

    Reference: Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
    Inference in Resource-Constrained Environments" (arXiv:2504.15364).

    Deviations: the paper processes a long prompt block by block, evicting down to ``B`` after
    each block (the anchor is the mean over the cache plus the new block); kvbudget prefills the
    whole prompt and evicts once, with the anchor over the whole prompt (kvpress's
    ``KeyDiffPress`` reading, which its oracle test matches). While decoding the cache is held at
    ``B`` as in the paper's memory-bounded generation: after each step the anchor is recomputed
    over the held entries and the least distinctive one is evicted.

    Args:
        window: recent entries always kept (default 0: the paper's score decides alone).
        sinks: first entries always kept (default 0).
    """

    name: ClassVar[str] = "keydiff"
    paper: ClassVar[str] = "arXiv:2504.15364"
    summary: ClassVar[str] = "keys least similar (cosine) to the mean key; query-free"
    kvpress: ClassVar[str] = "KeyDiffPress"
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL, Stage.DECODE)
    window: int = 0

    def score(self, obs: Observation) -> torch.Tensor:
        return keydiff_scores(obs.keys, obs.valid)

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        self.trim_to(obs, row_budgets)
