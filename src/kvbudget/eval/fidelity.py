"""Fidelity to the full cache: greedy-token agreement and KL under teacher forcing.

Small models fail many long tasks even with the full cache, so every run is also compared with
the full cache's own answer: the fraction of greedy tokens identical to it, and the mean
KL(full ‖ compressed) of next-token distributions when both are fed the full-cache answer.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from kvbudget.cache import BudgetCache


@torch.inference_mode()
def teacher_forced_logprobs(
    model: PreTrainedModel,
    cache: BudgetCache,
    first_logits: torch.Tensor,
    tokens: list[int],
    mask: torch.Tensor,
    last_pos: torch.Tensor,
    step_by_step: bool,
) -> torch.Tensor:
    """Log-probabilities ``[T, vocab]`` of the next token at each of the ``T`` answer positions.

    Position 0 comes from ``first_logits: [1, vocab]`` (the prompt's last position); the others
    from feeding ``tokens[:-1]`` into ``cache`` (batch of one) — in one forward, or one token at a
    time when ``step_by_step`` (decode-stage methods trim after every step). ``cache`` is consumed.
    """
    rows = [first_logits[0].float()]
    if len(tokens) > 1:
        if cache.session is not None:
            cache.session.begin_decode()
        device = model.device
        feed = torch.tensor([tokens[:-1]], device=device)
        positions = last_pos.to(device)[:, None] + 1 + torch.arange(feed.shape[1], device=device)[None]
        full_mask = torch.cat(
            [mask.to(device), torch.ones((1, feed.shape[1]), dtype=mask.dtype, device=device)], 1
        )
        if step_by_step:
            for i in range(feed.shape[1]):
                out = model(
                    input_ids=feed[:, i : i + 1], attention_mask=full_mask[:, : mask.shape[1] + i + 1],
                    position_ids=positions[:, i : i + 1], past_key_values=cache, use_cache=True,
                )  # fmt: skip
                rows.append(out.logits[0, -1].float())
        else:
            out = model(
                input_ids=feed,
                attention_mask=full_mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            rows.extend(out.logits[0].float())
    return torch.log_softmax(torch.stack(rows), dim=-1)


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference ‖ other); both ``[T, vocab]`` log-probabilities."""
    kl = (reference.exp() * (reference - other)).sum(-1)
    return float(kl.mean())


def token_agreement(reference: list[int], other: list[int]) -> float:
    """Fraction of the reference's positions where ``other`` has the same token."""
    if not reference:
        return 1.0
    same = sum(1 for i, t in enumerate(reference) if i < len(other) and other[i] == t)
    return same / len(reference)
