"""The architectures kvbudget's attention hook serves (``config.model_type``).

The attention hook (:func:`kvbudget.attention.check_supported`), the model loader
(:mod:`kvbudget.models`) and the CLI's checks read them from here.
"""

from __future__ import annotations

#: Architectures (``config.model_type``) whose attention kvbudget's hook can serve.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "mistral",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
)

#: The supported architectures by name, with what the attention hook handles for each (for listings
#: such as ``kvbudget methods``; see docs/architecture.md, "Supported architectures").
ARCHITECTURES: dict[str, str] = {
    "llama": "Llama",
    "qwen2": "Qwen2 (sliding-window layers too)",
    "mistral": "Mistral (sliding window)",
    "qwen3": "Qwen3 (query/key norms)",
    "gemma2": "Gemma 2 (local/global layers, logit soft-capping)",
    "gemma3_text": "Gemma 3 text (local/global layers, query/key norms)",
    "phi3": "Phi-3 (fused QKV, sliding window)",
}
