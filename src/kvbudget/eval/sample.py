"""The unit every task yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One prompt of a task.

    Attributes:
        context: the long text to compress. question: asked after it.
        answers: acceptable reference answers. answer_prefix: text the answer starts with
            (placed after the chat template's generation prompt; small models need it).
        max_new_tokens: generation budget. meta: task-specific details (length, depth, ...).
    """

    context: str
    question: str
    answers: list[str]
    answer_prefix: str = ""
    max_new_tokens: int = 32
    meta: dict[str, Any] = field(default_factory=dict)
