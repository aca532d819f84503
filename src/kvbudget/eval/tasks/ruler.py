"""RULER (Hsieh et al., 2024): the 13 synthetic long-context tasks, built to its published spec.

Task configurations, prompt templates, answer prefixes, generation budgets and metrics follow
RULER's ``synthetic.yaml`` and generators (as shipped in ``nvidia-long-context-eval`` 26.3); the
code is our own. Each sample's ``context`` holds the template's instruction and the haystack (and,
for vt and cwe, RULER's solved example before them), ``question`` the query sentence,
``answer_prefix`` RULER's answer prefix (its leading/trailing spaces dropped: the engine places it
after the chat template's generation prompt). ``length`` counts the whole context in the model's
tokens; it is met within 1% (2% at worst) by fitting the haystack size.

| task | haystack | keys / values | needles | max new |
|---|---|---|---|---|
| niah_single_1 | repeated noise | words / 7-digit numbers | 1 | 128 |
| niah_single_2 | essays | words / numbers | 1 | 128 |
| niah_single_3 | essays | words / UUIDs | 1 | 128 |
| niah_multikey_1 | essays | words / numbers | 4 keys, 1 asked | 128 |
| niah_multikey_2 | other needles | words / numbers | 1 among many | 128 |
| niah_multikey_3 | other needles | UUIDs / UUIDs | 1 among many | 128 |
| niah_multivalue | essays | words / numbers | 1 key, 4 values | 128 |
| niah_multiquery | essays | words / numbers | 4 keys, all asked | 128 |
| vt | noise lines | 1 chain, 4 hops | 5 variables | 30 |
| cwe | numbered word list | 10 common x30, others x3 (x6/x1 below 4096) | top 10 | 120 |
| fwe | Zipf coded words | alpha 2.0 | top 3 | 50 |
| qa_1 / qa_2 | SQuAD / HotpotQA paragraphs | | | 32 |

Deliberate differences from RULER: ``length`` is the context alone (RULER's budget also counts
the chat-free template and the tokens to generate); a coarse haystack (UUID needles, documents)
is completed by part of one more unit (a needle line cut at a space or hyphen at its start, a
distractor paragraph cut at a word) to hit the length; sentences are split by a regex, not NLTK;
wonderwords entries with spaces are left out; SQuAD distractors are drawn at random (RULER draws
the same article's paragraphs first; the loader does not keep articles); questions are taken in
a seeded order, skipping (qa_2 below ~2K tokens) those whose own paragraphs overflow the length;
distractor needle keys never repeat a real key; cwe's main list avoids its example's words; vt's
solved example is capped at half the length (matters below ~940 tokens).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from kvbudget.eval.metrics import string_match_all, string_match_part
from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.base import TaskSpec
from kvbudget.eval.tasks.ruler_niah import CONFIGS, niah_sample
from kvbudget.eval.tasks.ruler_qa import qa_samples
from kvbudget.eval.tasks.ruler_vt import vt_sample
from kvbudget.eval.tasks.ruler_words import cwe_sample, fwe_sample

_RULER_DATA = "long-context-eval"
_WORDS = "wonderwords"


def _per_index(task: str, sample_fn):
    def make_samples(
        tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
    ) -> list[Sample]:
        return [sample_fn(tokenizer, task, length, seed, index) for index in range(num_samples)]

    return make_samples


def _qa(task: str):
    def make_samples(
        tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
    ) -> list[Sample]:
        return qa_samples(tokenizer, task, length, num_samples, seed)

    return make_samples


def _niah_data(task: str) -> tuple[str, ...]:
    cfg = CONFIGS[task]
    needs = []
    if cfg.haystack == "essay":
        needs.append(_RULER_DATA)
    if "words" in (cfg.key_type, cfg.value_type):
        needs.append(_WORDS)
    return tuple(needs)


def _specs() -> dict[str, TaskSpec]:
    specs = {
        name: TaskSpec(name, "ruler", _per_index(name, niah_sample), string_match_all, "string_match_all",
                       _niah_data(name))
        for name in CONFIGS
    }  # fmt: skip
    specs["vt"] = TaskSpec("vt", "ruler", _per_index("vt", vt_sample), string_match_all, "string_match_all")
    for name, fn in (("cwe", cwe_sample), ("fwe", fwe_sample)):
        data = (_WORDS,) if name == "cwe" else ()
        specs[name] = TaskSpec(
            name, "ruler", _per_index(name, fn), string_match_all, "string_match_all", data
        )
    for name in ("qa_1", "qa_2"):
        specs[name] = TaskSpec(
            name, "ruler", _qa(name), string_match_part, "string_match_part", (_RULER_DATA,)
        )
    return specs


TASKS: dict[str, TaskSpec] = _specs()
