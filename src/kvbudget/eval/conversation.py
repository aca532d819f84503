"""Several questions on one compressed context: SCBench's two modes (arXiv 2412.10319, §3).

A shared-context sample (:class:`~kvbudget.eval.sample.Sample` with ``follow_ups``) is one
context and several questions. Its first prompt (context + question 1) is prefilled and compressed
once, as the track says — the whole prompt with the question in view (question-aware), or the
context alone with the question appended uncompressed (question-agnostic) — and turn 1 is answered
from that cache. The later questions then reuse it in one of two modes:

* ``multi-turn``: one conversation. Each question is appended after the model's own earlier
  answers (the chat template's turn boundaries between them), the cache carried over: what the
  compression kept for question 1 is all later turns have of the context.
* ``multi-request``: each question a new request on the same context. The cache as compressed for
  turn 1 is rewound to the context (:meth:`BudgetCache.rewind` drops the entries of question 1 a
  method kept, wherever they are; the context entries it chose with question 1 in view stay), and
  the question is appended uncompressed — the prefix reuse of a server, on a compressed prefix.

Appended turns are uncompressed and outside the budget (:meth:`CompressionSession.note_appended`),
as the question of a question-agnostic run; decode-stage methods trim while decoding as usual.
Prune-stage methods are refused (they prefill context and question in one run of their own layer
loop and decode from re-indexed positions, so there is no context cache to carry over).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvbudget.cache import BudgetCache
from kvbudget.engine import decode_loop
from kvbudget.errors import KVBudgetError
from kvbudget.eval.draft import decode_with_draft
from kvbudget.eval.sample import FollowUp
from kvbudget.phases import Stage
from kvbudget.prefill.common import Prompt, forward_last_logits

#: the two ways later questions reuse the first one's cache
MODES = ("multi-turn", "multi-request")

#: stands for the assistant's answer when the chat template renders a follow-up's boundaries
_SENTINEL = "\u2063KVBUDGET-ANSWER\u2063"


@dataclass
class TurnOutcome:
    """One answered question of a conversation.

    Attributes:
        token_ids: the greedy answer (EOS included when generated); text: decoded, EOS removed.
        ttft_s: from the turn's start (its tokens appended; for turn 1, after the prefill) to the
            first answer token. decode_s: the rest of the answer.
        kv_bytes: the cache's physical bytes once the answer is done (what the conversation holds).
        entries: entries per KV head over the cache's layers and heads at that point (mean).
        draft_accepted: leading answer tokens verified from the full cache's answer (the draft).
    """

    token_ids: list[int]
    text: str
    ttft_s: float
    decode_s: float
    kv_bytes: int
    entries: float
    draft_accepted: int = 0


def follow_up_text(tokenizer: PreTrainedTokenizerBase, question: str, answer_prefix: str = "") -> str:
    """The text after an assistant's answer that closes it and asks ``question``: the chat
    template's boundaries (rendered around a placeholder answer), or, without a template, a blank
    line, the question and a new line — :func:`kvbudget.engine.build_prompt`'s plain format."""
    if not tokenizer.chat_template:
        return f"\n\n{question}\n{answer_prefix}"
    messages = [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": _SENTINEL},
        {"role": "user", "content": question},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered.count(_SENTINEL) != 1:
        raise KVBudgetError(
            "the chat template does not render an assistant's answer: cannot continue a conversation"
        )
    return rendered.split(_SENTINEL, 1)[1] + answer_prefix


def join_turn(conversation: list[int], follow: list[int], eos: set[int]) -> list[int]:
    """``conversation`` (ending with an answer) followed by the next turn's tokens ``follow``; an
    answer that ended on the very token the template closes it with (``<|im_end|>``) has it once."""
    if conversation and conversation[-1] in eos and follow and follow[0] == conversation[-1]:
        follow = follow[1:]
    return conversation + follow


def check_shareable(method_stages: frozenset[Stage] | set[Stage], name: str) -> None:
    """One-line error for a method whose compressed context cannot be carried to later questions."""
    if Stage.PRUNE in method_stages:
        raise KVBudgetError(
            f"{name} cannot carry one compressed context to later questions: a prune-stage method prefills "
            "context and question in one run of its own layer loop"
        )


def _entries(cache: BudgetCache) -> float:
    per_layer = [layer.logical_entries().float().mean() for layer in cache.layers if layer.is_initialized]
    return float(torch.stack(per_layer).mean()) if per_layer else 0.0


def _append(model: PreTrainedModel, cache: BudgetCache, ids: list[int]) -> torch.Tensor:
    """Feed ``ids`` after everything the cache has seen, uncompressed and outside the budget;
    the last position's logits ``[1, vocab]``."""
    session = cache.session
    if session is not None:
        session.stop()
    seen = cache.get_seq_length()
    device = model.device
    mask = torch.ones((1, seen + len(ids)), dtype=torch.long, device=device)
    positions = torch.arange(seen, seen + len(ids), device=device)[None]
    logits = forward_last_logits(model, torch.tensor([ids], device=device), mask, positions, cache)
    if session is not None:
        session.note_appended([len(ids)])
    return logits


class Conversation:
    """Answers a sample's turns from one compressed cache, in both modes.

    Args:
        model, tokenizer: the model and its tokenizer.
        eos: the ids that end an answer.
        step_by_step: the method trims the cache while decoding (``Stage.DECODE``): a draft is then
            fed token by token (:func:`kvbudget.eval.draft.decode_with_draft`).
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eos: set[int], step_by_step: bool
    ) -> None:
        self.model, self.tokenizer, self.eos, self.step_by_step = model, tokenizer, eos, step_by_step

    def _copy(self, cache: BudgetCache) -> BudgetCache:
        return copy.deepcopy(cache, {id(self.model): self.model})

    def _answer(
        self, cache: BudgetCache, logits: torch.Tensor, turn: FollowUp, draft: list[int] | None, start: float,
        mask: torch.Tensor | None = None, last_pos: torch.Tensor | None = None,
    ) -> tuple[TurnOutcome, BudgetCache]:  # fmt: skip
        """Greedy answer from ``logits`` (the turn's last prompt position); ``start``: when the turn
        began. Also the cache the answer ended in (every answer token but the last in it)."""
        if mask is None or last_pos is None:
            seen = cache.get_seq_length()
            mask = torch.ones((1, seen), dtype=torch.long, device=self.model.device)
            last_pos = torch.tensor([seen - 1], device=self.model.device)
        first = time.perf_counter()
        if draft is None:
            decoded = decode_loop(
                self.model, cache, logits, mask, last_pos, self.eos, turn.max_new_tokens, trace=False
            )
            ids, accepted, seconds = decoded.generated[0], 0, decoded.seconds
            first_token = first + decoded.first_token_seconds
            ended = cache
        else:
            drafted = decode_with_draft(
                self.model, cache, logits, draft, mask, last_pos, self.eos, turn.max_new_tokens,
                self.step_by_step,
            )  # fmt: skip
            ids, accepted, seconds, first_token = drafted.token_ids, drafted.accepted, drafted.seconds, first
            ended = drafted.cache if drafted.cache is not None else cache
        text_ids = ids[:-1] if ids and ids[-1] in self.eos else ids
        outcome = TurnOutcome(
            token_ids=ids,
            text=self.tokenizer.decode(text_ids, skip_special_tokens=True),
            ttft_s=first_token - start,
            decode_s=seconds,
            kv_bytes=ended.physical_bytes(),
            entries=_entries(ended),
            draft_accepted=accepted,
        )
        return outcome, ended

    @torch.inference_mode()
    def run(
        self,
        cache: BudgetCache,
        logits: torch.Tensor,
        mask: torch.Tensor,
        last_pos: torch.Tensor,
        prompts: list[Prompt],
        turns: list[FollowUp],
        drafts: dict[str, list[list[int]]] | None = None,
    ) -> dict[str, list[TurnOutcome]]:
        """Every turn in both modes, from ``cache`` holding the first prompt (compressed as the
        track says; ``logits: [1, vocab]``, ``mask``, ``last_pos`` what decoding continues from).

        ``prompts[i]``: turn ``i``'s single-question prompt (its ``context_ids`` the same for every
        turn); ``drafts[mode][i]``: the full cache's answer to turn ``i`` in that mode (a draft, or
        ``None``: plain greedy decoding). Returns ``{mode: [turn 1, turn 2, …]}``; turn 1 is
        answered once and is the same object in both modes. ``cache`` is consumed.
        """
        if len(prompts) != len(turns):
            raise KVBudgetError(f"{len(prompts)} prompts for {len(turns)} turns")
        context = len(prompts[0].context_ids)
        if any(p.context_ids != prompts[0].context_ids for p in prompts):
            raise KVBudgetError(
                "the context tokenises differently before different questions: cannot share it"
            )
        seen, first_prompt = cache.get_seq_length(), len(prompts[0].ids)
        if seen != first_prompt:
            raise KVBudgetError(f"the cache has seen {seen} tokens, the first prompt has {first_prompt}")
        draft = (lambda mode, i: drafts[mode][i]) if drafts is not None else (lambda mode, i: None)
        shared_context = self._copy(cache)  # before anything decodes into it
        shared_context.rewind(context)
        if shared_context.session is not None:
            shared_context.session.forget_appended()

        start = time.perf_counter()
        first, cache = self._answer(cache, logits, turns[0], draft(MODES[0], 0), start, mask, last_pos)
        outcomes: dict[str, list[TurnOutcome]] = {mode: [first] for mode in MODES}
        conversation = list(prompts[0].ids) + first.token_ids
        for i, turn in enumerate(turns[1:], 1):
            start = time.perf_counter()
            follow = self.tokenizer(
                follow_up_text(self.tokenizer, turn.question, turn.answer_prefix), add_special_tokens=False
            )["input_ids"]
            conversation = join_turn(conversation, follow, self.eos)
            seen = cache.get_seq_length()
            if seen > len(conversation):
                raise KVBudgetError(
                    f"the cache has seen {seen} tokens, the conversation has {len(conversation)}"
                )
            logits = _append(self.model, cache, conversation[seen:])
            outcome, cache = self._answer(cache, logits, turn, draft("multi-turn", i), start)
            outcomes["multi-turn"].append(outcome)
            conversation += outcome.token_ids

        for i, turn in enumerate(turns[1:], 1):
            start = time.perf_counter()
            request = self._copy(shared_context)
            logits = _append(self.model, request, list(prompts[i].question_ids))
            outcome, _ = self._answer(request, logits, turn, draft("multi-request", i), start)
            outcomes["multi-request"].append(outcome)
        return outcomes
