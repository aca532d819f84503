"""Chunked prefill: a long prompt read a few decoder layers at a time, between the decode steps of
the conversations already running, so they keep decoding while it is read.

Why layers, not token chunks (vLLM's): kvbudget compresses each layer right after its attention
over the whole prompt (the layer-wise prefill). A prompt fed in token chunks would either compress
each layer before its later tokens exist — changing what every method that scores the prompt keeps
— or hold every layer's whole prompt until the last chunk, the peak the layer-wise prefill avoids.
Running the same forward one layer at a time with the model's own modules (the prune stage's loop,
:func:`kvbudget.prefill.pruned.decoder_parts`) changes neither: each layer sees the whole prompt and
is compressed as it would be, and the answer is the unchunked prefill's. The price is granularity:
a piece is one layer of the prompt, about 1/24 of a 0.5B model's prefill, so the others' decode
steps come that far apart while it is read (not a minute apart, as an unchunked 8K prefill makes
them). Prune-stage methods, which reshape the prompt between layers, prefill at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from kvbudget.attention import PaddingInfo, attach
from kvbudget.cache import BudgetCache
from kvbudget.phases import Stage
from kvbudget.prefill.common import Prompt, prefill_inputs, run_lookahead
from kvbudget.prefill.pruned import decoder_parts
from kvbudget.serve.batcher import Sequence, new_session, sample_token


def can_chunk(seq: Sequence) -> bool:
    """Whether ``seq``'s method can be prefilled a layer at a time (not a prune-stage method)."""
    return Stage.PRUNE not in seq.method.stages


def prefill_steps(model: PreTrainedModel, seq: Sequence, pad_id: int, layers: int = 1) -> Iterator[int]:
    """Prefill ``seq`` as :func:`~kvbudget.serve.batcher.prefill_sequence` does (no reuse), yielding
    after every ``layers`` decoder layers (the layer count so far); when it ends, ``seq`` holds its
    cache, session and position and its first token is sampled (``seq.generated[0]``). Closing the
    generator early drops the partial cache."""
    with torch.inference_mode():
        attach(model)
        session = new_session(model, seq)
        session.bind(model)
        inputs = prefill_inputs([Prompt(seq.prompt_ids, [])], pad_id)
        parts = decoder_parts(model)
        cache = BudgetCache(model.config.num_hidden_layers, session)
        session.begin_prefill()
        device = parts.embed.weight.device
        ids, positions = inputs.ids.to(device), inputs.positions.to(device)
        hidden = parts.embed(ids)
        rotary = parts.rope(hidden, positions)
        info = PaddingInfo(None, ids.shape[1])
    for index, layer in enumerate(parts.layers):
        with torch.inference_mode():
            out = layer(hidden, attention_mask=info, position_ids=positions, past_key_values=cache,
                        use_cache=True, position_embeddings=rotary[index])  # fmt: skip
            hidden = out[0] if isinstance(out, tuple) else out
        if (index + 1) % layers == 0 and index + 1 < len(parts.layers):
            yield index + 1
    with torch.inference_mode():
        logits = parts.logits(hidden[:, -1:])[:, -1]
        run_lookahead(model, inputs, cache, logits, set(seq.eos))
        cache.quantize(seq.compression.kv_bits)
        seq.session, seq.cache, seq.last_pos = session, cache, int(inputs.positions[0, -1])
        session.begin_decode()
        sample_token(seq, logits)
