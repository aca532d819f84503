"""What a task is: a sample generator and a metric.

Every task module defines ``TASKS: dict[str, TaskSpec]``; :mod:`kvbudget.eval.tasks` merges them.
Generators are seeded and deterministic; ``length`` is measured in the model's tokens (the
context, within a few percent). Metrics return a score in [0, 1] (reports show ×100).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from kvbudget.eval.sample import Sample

#: the family of tasks whose samples are one context and several questions (``Sample.follow_ups``),
#: run as conversations (:mod:`kvbudget.eval.conversation`)
SHARED_CONTEXT = "shared-context"

#: ``make_samples(tokenizer, length, num_samples, seed) -> list[Sample]``
SampleMaker = Callable[[PreTrainedTokenizerBase, int, int, int], list[Sample]]
#: ``metric(prediction, answers) -> score in [0, 1]``
Metric = Callable[[str, list[str]], float]


@dataclass(frozen=True)
class TaskSpec:
    """A registered task.

    Attributes:
        name: registry name (``niah_single_1``, ``passkey``, ``lcc``, ...).
        family: ``needle``, ``ruler``, ``infinitebench``, ``code``, ``gsm8k``, ``perplexity``,
            ``longbench``, ``shared-context`` (:data:`SHARED_CONTEXT`).
        make_samples: the seeded generator.
        metric: scores one prediction against the sample's answers.
        metric_name: e.g. ``string_match_all``.
        data: data artifacts it reads (``kvbudget fetch data NAME``).
    """

    name: str
    family: str
    make_samples: SampleMaker
    metric: Metric
    metric_name: str
    data: tuple[str, ...] = ()
