"""Greedy decoding that reuses the full cache's answer as a draft — the harness's fast path.

Every compressed run of the evaluation needs two things: the teacher-forced log-probabilities of
the full cache's answer (the KL fidelity) and its own greedy answer. Both begin by feeding the
same tokens whenever the method agrees with the full cache, so one pass gives both up to the
first position where the method's greedy token differs from the draft; only from there on does
the method decode token by token. Correct answers — the common case at generous budgets — cost
one forward instead of one per token.

* Prefill-stage methods (nothing changes the cache while decoding) feed the draft in **one
  forward**; at a divergence the fed tokens after it are dropped from the cache
  (:meth:`BudgetCache.drop_last`). Greedy tokens then come from a multi-token forward, whose
  floating-point sums may differ in the last bits from one-token steps, so on a near-tie the
  answer can differ from :func:`kvbudget.generate`'s; shared and separate prefill use this same
  procedure, so they stay identical to each other.
* Decode-stage methods (the cache is trimmed after every token) feed the draft **one token at a
  time**, exactly as :func:`kvbudget.engine.decode_loop` would, and copy the cache at the
  divergence to continue from; their answers equal plain greedy decoding.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvbudget.cache import BudgetCache
from kvbudget.engine import decode_loop


@dataclass
class DraftDecoded:
    """Outcome of :func:`decode_with_draft` for a batch of one.

    Attributes:
        token_ids: the method's greedy answer (EOS included when generated).
        logprobs: ``[T, vocab]`` log-probabilities at the draft's ``T`` positions under teacher forcing.
        accepted: leading answer tokens taken from the draft (the method agreed with them).
        steps: one-token decode steps run after the draft; ``seconds``: their total time.
    """

    token_ids: list[int]
    logprobs: torch.Tensor
    accepted: int
    steps: int
    seconds: float


def _extend(mask: torch.Tensor, count: int) -> torch.Tensor:
    return torch.cat([mask, torch.ones((mask.shape[0], count), dtype=mask.dtype)], 1)


def _first_divergence(rows: torch.Tensor, draft: list[int]) -> int:
    """First position where ``rows.argmax(-1)`` differs from ``draft`` (``len(draft)`` if none)."""
    greedy = rows.argmax(-1).tolist()
    return next((i for i, (g, d) in enumerate(zip(greedy, draft, strict=True)) if g != d), len(draft))


@torch.inference_mode()
def decode_with_draft(
    model: PreTrainedModel,
    cache: BudgetCache,
    logits: torch.Tensor,
    draft: list[int],
    mask: torch.Tensor,
    last_pos: torch.Tensor,
    eos: set[int],
    max_new_tokens: int,
    step_by_step: bool,
) -> DraftDecoded:
    """Greedy answer and teacher-forced log-probs of ``draft``, sharing the forwards they have in common.

    Args:
        cache: the compressed prompt cache (batch of one); consumed.
        logits: ``[1, vocab]`` at the prompt's last position.
        draft: the full cache's answer (at least one token; it ends with EOS or at ``max_new_tokens``).
        mask, last_pos: ``[1, n]`` prompt attention mask and ``[1]`` last logical position.
        step_by_step: feed one token at a time (decode-stage methods).
    """
    if not draft:
        raise ValueError("decode_with_draft needs a draft of at least one token")
    if cache.session is not None:
        cache.session.phase = "decode"
    feed = torch.tensor([draft[:-1]], dtype=torch.long)
    positions = last_pos[:, None] + 1 + torch.arange(feed.shape[1])[None]
    fed_mask = _extend(mask, feed.shape[1])
    rows = [logits[0]]
    resume: BudgetCache | None = None  # the cache holding prompt + draft[:divergence]
    divergence = len(draft)
    if step_by_step:
        for i in range(feed.shape[1] + 1):
            if divergence == len(draft) and int(rows[i].argmax()) != draft[i]:
                divergence, resume = i, copy.deepcopy(cache)
            if i == feed.shape[1]:
                break
            out = model(
                input_ids=feed[:, i : i + 1], attention_mask=fed_mask[:, : mask.shape[1] + i + 1],
                position_ids=positions[:, i : i + 1], past_key_values=cache, use_cache=True,
            )  # fmt: skip
            rows.append(out.logits[0, -1])
        stacked = torch.stack(rows)
    else:
        if feed.shape[1]:
            out = model(
                input_ids=feed, attention_mask=fed_mask, position_ids=positions,
                past_key_values=cache, use_cache=True,
            )  # fmt: skip
            rows.extend(out.logits[0])
        stacked = torch.stack(rows)
        divergence = _first_divergence(stacked, draft)
        if divergence < len(draft):
            cache.drop_last(feed.shape[1] - divergence)
            resume = cache
    logprobs = torch.log_softmax(stacked.float(), dim=-1)
    if divergence == len(draft):
        # The method agreed with every draft token; the draft ended with EOS or at the limit.
        if draft[-1] in eos or len(draft) >= max_new_tokens:
            return DraftDecoded(list(draft), logprobs, len(draft), 0, 0.0)
        divergence, resume = len(draft) - 1, cache  # (unreachable for a greedy draft) go on decoding
    decoded = decode_loop(
        model, resume, stacked[divergence : divergence + 1], _extend(mask, divergence),
        last_pos + divergence, eos, max_new_tokens - divergence,
    )  # fmt: skip
    tokens = list(draft[:divergence]) + decoded.generated[0]
    return DraftDecoded(tokens, logprobs, divergence, decoded.steps, decoded.seconds)
