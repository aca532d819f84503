"""The shared-context tasks: one long context, four questions about different parts of it.

After SCBench (Li et al., "SCBench: A KV Cache-Centric Analysis of Long-Context Methods", arXiv
2412.10319): a sample's first question is ``Sample.question`` and the other three are
``Sample.follow_ups``; the runner asks them one after another in one conversation (multi-turn) or
each as its own request on the same context (multi-request), so a cache compressed for the first
question is judged on what the later ones need. Each question is answerable from the context
alone; the items asked about are planted in different parts of the context, and asked in a
shuffled order (:mod:`kvbudget.eval.tasks.sc_common`).

| task | context | planted | a turn asks | max new |
|---|---|---|---|---|
| sc_keys | RULER essays | 4 needles (key → 7-digit number), one per quarter | one key's number | 32 |
| sc_vt | RULER noise lines | 4 variable chains of 4 hops, one per quarter | one chain's variables | 30 |
| sc_code | stdlib source | 4 functions ``return <5 digits>``, one per quarter | one function's value | 32 |
| sc_aggregate | RULER essays | 4 keys × 4 numbers, one per sixteenth | all of one key's numbers | 64 |

Every metric is RULER's ``string_match_all`` (an aggregate turn scores the fraction of its four
values found). ``length`` counts the context in the model's tokens, met within 2%.
"""

from __future__ import annotations

from kvbudget.eval.metrics import string_match_all
from kvbudget.eval.tasks import sc_aggregate, sc_code, sc_keys, sc_vt
from kvbudget.eval.tasks.base import SHARED_CONTEXT, SampleMaker, TaskSpec

_ESSAY_DATA = ("long-context-eval", "wonderwords")


def _spec(name: str, make_samples: SampleMaker, data: tuple[str, ...]) -> TaskSpec:
    return TaskSpec(name, SHARED_CONTEXT, make_samples, string_match_all, "string_match_all", data)


TASKS: dict[str, TaskSpec] = {
    "sc_keys": _spec("sc_keys", sc_keys.make_samples, _ESSAY_DATA),
    "sc_vt": _spec("sc_vt", sc_vt.make_samples, ()),
    "sc_code": _spec("sc_code", sc_code.make_samples, ()),
    "sc_aggregate": _spec("sc_aggregate", sc_aggregate.make_samples, _ESSAY_DATA),
}
