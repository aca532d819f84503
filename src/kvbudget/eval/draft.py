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
  After diverging from the full cache's answer they also try *other* answers to the same prompt
  (the earlier methods' — compressed caches often ramble on identically): the first candidate
  extending the answer so far is verified in one forward, and so on (greedy speculative decoding
  with free drafts). Which candidates exist depends on which runs share the invocation, so a
  near-tie could in principle break differently after a resumed run; exact ties aside, the answer
  is the greedy one.
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
        cache: the cache the answer ended in — the prompt and every answer token but the last (a
            decode-stage method continues in a copy taken at the divergence; a conversation goes on
            from this one).
    """

    token_ids: list[int]
    logprobs: torch.Tensor
    accepted: int
    steps: int
    seconds: float
    cache: BudgetCache | None = None


def _extend(mask: torch.Tensor, count: int) -> torch.Tensor:
    return torch.cat([mask, torch.ones((mask.shape[0], count), dtype=mask.dtype, device=mask.device)], 1)


def _first_divergence(rows: torch.Tensor, draft: list[int]) -> int:
    """First position where ``rows.argmax(-1)`` differs from ``draft`` (``len(draft)`` if none)."""
    greedy = rows.argmax(-1).tolist()
    return next((i for i, (g, d) in enumerate(zip(greedy, draft, strict=True)) if g != d), len(draft))


def _feed(model: PreTrainedModel, cache: BudgetCache, tokens: list[int], mask, last_pos, start: int):
    """Forward ``tokens`` placed after ``start`` answer tokens; returns the logits ``[len, vocab]``."""
    device = model.device
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    positions = last_pos.to(device)[:, None] + 1 + start + torch.arange(len(tokens), device=device)[None]
    out = model(
        input_ids=ids, attention_mask=_extend(mask.to(device), start + len(tokens)), position_ids=positions,
        past_key_values=cache, use_cache=True,
    )  # fmt: skip
    return out.logits[0]


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
    candidates: list[list[int]] = (),
) -> DraftDecoded:
    """Greedy answer and teacher-forced log-probs of ``draft``, sharing the forwards they have in common.

    Args:
        cache: the compressed prompt cache (batch of one); consumed.
        logits: ``[1, vocab]`` at the prompt's last position.
        draft: the full cache's answer (at least one token; it ends with EOS or at ``max_new_tokens``).
        mask, last_pos: ``[1, n]`` prompt attention mask and ``[1]`` last logical position.
        step_by_step: feed one token at a time (decode-stage methods).
        candidates: other answers to the same prompt (e.g. earlier methods'); after diverging from
            ``draft``, a prefill-stage method verifies the first candidate that extends its answer
            in one forward (methods often ramble on identically), and so on until none does.
    """
    if not draft:
        raise ValueError("decode_with_draft needs a draft of at least one token")
    if cache.session is not None:
        cache.session.begin_decode()
    feed = draft[:-1]
    rows = [logits[0]]
    if step_by_step:
        resume: BudgetCache | None = None  # the cache holding prompt + draft[:divergence]
        divergence = len(draft)
        for i in range(len(feed) + 1):
            if divergence == len(draft) and int(rows[i].argmax()) != draft[i]:
                divergence, resume = i, copy.deepcopy(cache)
            if i < len(feed):
                rows.append(_feed(model, cache, feed[i : i + 1], mask, last_pos, i)[-1])
        stacked = torch.stack(rows)
    else:
        if feed:
            rows.extend(_feed(model, cache, feed, mask, last_pos, 0))
        stacked = torch.stack(rows)
        divergence = _first_divergence(stacked, draft)
        resume = cache
        if divergence < len(draft):
            cache.drop_last(len(feed) - divergence)
    logprobs = torch.log_softmax(stacked.float(), dim=-1)
    if divergence == len(draft):
        # The method agreed with every draft token; the draft ended with EOS or at the limit.
        if draft[-1] in eos or len(draft) >= max_new_tokens:
            return DraftDecoded(list(draft), logprobs, len(draft), 0, 0.0, cache)
        divergence, resume = len(draft) - 1, cache  # (unreachable for a greedy draft) go on decoding
    # `tokens` is the answer so far; the cache holds every token but the last, which is argmax(`row`).
    tokens = list(draft[:divergence]) + [int(stacked[divergence].argmax())]
    row = stacked[divergence]
    if not step_by_step:
        tokens, row = _follow_candidates(
            model, resume, tokens, row, candidates, mask, last_pos, eos, max_new_tokens
        )
    done = tokens[-1] in eos or len(tokens) >= max_new_tokens
    start = len(tokens) - 1
    if done:
        return DraftDecoded(tokens, logprobs, divergence, 0, 0.0, resume)
    decoded = decode_loop(
        model, resume, row[None], _extend(mask, start), last_pos + start, eos, max_new_tokens - start
    )
    answer = tokens[:-1] + decoded.generated[0]
    return DraftDecoded(answer, logprobs, divergence, decoded.steps, decoded.seconds, resume)


def _follow_candidates(
    model: PreTrainedModel,
    cache: BudgetCache,
    tokens: list[int],
    row: torch.Tensor,
    candidates: list[list[int]],
    mask: torch.Tensor,
    last_pos: torch.Tensor,
    eos: set[int],
    max_new_tokens: int,
) -> tuple[list[int], torch.Tensor]:
    """Extend ``tokens`` by verifying candidates that continue it (speculative decoding, greedy).

    The cache holds ``tokens[:-1]`` on entry and on return; ``row`` is the logits row whose argmax
    is ``tokens[-1]``.
    """
    while tokens[-1] not in eos and len(tokens) < max_new_tokens:
        k = len(tokens)
        match = next((c for c in candidates if len(c) > k and c[:k] == tokens), None)
        if match is None:
            break
        match = match[:max_new_tokens]
        verify = _feed(model, cache, match[k - 1 : -1], mask, last_pos, k - 1)
        greedy = verify.argmax(-1).tolist()
        accepted = next((j for j, g in enumerate(greedy) if g != match[k + j]), len(greedy))
        if accepted < len(greedy):  # diverged: keep the agreeing part and the method's own token
            tokens = match[: k + accepted] + [greedy[accepted]]
            cache.drop_last(len(match) - 1 - (k + accepted))
        else:
            tokens = list(match)
        row = verify[accepted if accepted < len(greedy) else -1]
    return tokens, row
