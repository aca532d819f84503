"""SqueezeAttention: layer budgets from three clusters of layer similarity, StreamingLLM eviction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbudget.methods.profiled import ProfiledMethod


@dataclass(frozen=True)
class SqueezeAttention(ProfiledMethod):
    """SqueezeAttention: layers whose attention changes the residual stream least keep less.

    Layer similarity (from the profile): token-mean cosine similarity between a layer's residual
    input and ``input + attention output``. The layers are split into 3 clusters (exact 1-D
    k-means); each layer of the most-similar cluster keeps ``p·B`` entries per head, the other
    layers share the rest equally (``B·(n − n₃·p)/(n − n₃)``), so the model's total stays
    ``B·layers·heads`` (integerised exactly, never above the prompt). Inside each layer the cache
    is a StreamingLLM cache (4 sinks + the most recent tokens), at the prefill and every decode step.

    Deviations from the authors' code (hetailang/SqueezeAttention): the similarities come from an
    offline profile rather than from each prompt's own prefill (BaKlaVa's use of the heuristic);
    ``p`` is a fraction of the user's budget where the code gives it as a fraction of the prompt;
    k-means is the exact 1-D optimum (the code runs scikit-learn's randomly initialised KMeans);
    keys keep their true RoPE positions (no re-rotation). ``p`` defaults to 0.3 (the paper tunes it
    per model; ``kvbudget tune --method squeezeattention`` searches it by perplexity).

    Reference: Wang, Cui, Gan, "SqueezeAttention: 2D Management of KV-Cache in LLM Inference via
    Layer-wise Optimal Budget", ICLR 2025 (arXiv:2404.04793).

    Args:
        p: share of the uniform budget kept by the most-similar cluster (negative = tuned or 0.3).
        profile: profile path ("" = the model's default profile, else one built on the fly).
        sinks: first tokens always kept (4).
    """

    name: ClassVar[str] = "squeezeattention"
    paper: ClassVar[str] = "arXiv:2404.04793"
    summary: ClassVar[str] = (
        "layer budgets from 3 clusters of layer similarity (offline profile); StreamingLLM inside each layer"
    )
    code: ClassVar[str] = "hetailang/SqueezeAttention"
    granularity: ClassVar[str] = "layer"
