"""The unit every task yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FollowUp:
    """A later question about the same context (the shared-context tasks' turns 2, 3, …).

    Attributes:
        question: asked after the earlier turns (multi-turn) or alone after the context
            (multi-request). answers, answer_prefix, max_new_tokens, meta: as :class:`Sample`'s.
    """

    question: str
    answers: list[str]
    answer_prefix: str = ""
    max_new_tokens: int = 32
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One prompt of a task.

    Attributes:
        context: the long text to compress. question: asked after it.
        answers: acceptable reference answers. answer_prefix: text the answer starts with
            (placed after the chat template's generation prompt; small models need it).
        max_new_tokens: generation budget. meta: task-specific details (length, depth, ...).
        follow_ups: the later questions of a shared-context task (``family == "shared-context"``),
            in the order they are asked; empty for every other task.
    """

    context: str
    question: str
    answers: list[str]
    answer_prefix: str = ""
    max_new_tokens: int = 32
    meta: dict[str, Any] = field(default_factory=dict)
    follow_ups: list[FollowUp] = field(default_factory=list)

    def turns(self) -> list[FollowUp]:
        """Every question of the sample as a turn: the first (``question``), then the follow-ups."""
        first = FollowUp(self.question, self.answers, self.answer_prefix, self.max_new_tokens, self.meta)
        return [first, *self.follow_ups]
