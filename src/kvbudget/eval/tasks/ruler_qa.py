"""RULER's QA tasks: qa_1 (SQuAD v2 dev, answerable) and qa_2 (HotpotQA dev, distractor setting).

The question's own paragraphs (SQuAD: its paragraph; HotpotQA: all of its 2-10 paragraphs, the
two supporting ones among them, as RULER) plus paragraphs of other questions, shuffled, each as
"Document N:\\n{text}" and separated by blank lines, up to the length. Score: ``string_match_part``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from kvbudget import data
from kvbudget.errors import InputError
from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.ruler_common import TOLERANCE, count_tokens, fit_context, rng_for

INSTRUCTION = (
    "Answer the question based on the given documents. "
    "Only give me the answer and do not output any other words."
)
HEAD = f"{INSTRUCTION}\n\nThe following are given documents.\n\n"
ANSWER_PREFIX = "Answer:"
MAX_NEW_TOKENS = 32
DATASETS = {"qa_1": "squad", "qa_2": "hotpotqa"}


@dataclass(frozen=True)
class QaPool:
    """All distinct paragraphs (sorted) and every question as (text, answers, own paragraph ids)."""

    docs: tuple[str, ...]
    questions: tuple[tuple[str, tuple[str, ...], tuple[int, ...]], ...]


@lru_cache(maxsize=2)
def qa_pool(dataset: str) -> QaPool:
    """The paragraphs and questions of ``squad`` or ``hotpotqa`` (HotpotQA paragraphs: "title\\ntext")."""
    if dataset == "squad":
        rows = data.squad()
        own = [[row["context"]] for row in rows]
    elif dataset == "hotpotqa":
        rows = data.hotpotqa()
        own = [[f"{title}\n{text}" for title, text in row["paragraphs"]] for row in rows]
    else:
        raise InputError(f"unknown QA dataset '{dataset}': expected squad or hotpotqa")
    docs = tuple(sorted({doc for docs in own for doc in docs}))
    ids = {doc: i for i, doc in enumerate(docs)}
    questions = tuple(
        (row["question"], tuple(row["answers"]), tuple(dict.fromkeys(ids[d] for d in docs)))
        for row, docs in zip(rows, own, strict=True)
        if row["answers"]
    )
    return QaPool(docs, questions)


def question_text(question: str) -> str:
    return f"{INSTRUCTION}\n\nQuestion: {question}"


def qa_sample(
    tokenizer: PreTrainedTokenizerBase, task: str, length: int, seed: int, index: int, question: int
) -> Sample | None:
    """Sample ``index`` built on question number ``question``; None if its own paragraphs overflow."""
    pool = qa_pool(DATASETS[task])
    text, answers, gold = pool.questions[question]
    rng = rng_for(task, seed, index)
    drawn = rng.sample(range(len(pool.docs)), min(len(pool.docs), length // 10 + 20))
    distractors = [i for i in drawn if i not in gold]

    def docs_of(n: int, k: int) -> list[str]:
        docs = [pool.docs[i] for i in (*gold, *distractors[:n])]
        if k:
            docs.append(" ".join(pool.docs[distractors[n]].split(" ")[:k]))
        rng_for(task, seed, index, f"shuffle/{n}/{k > 0}").shuffle(docs)
        return docs

    def build(n: int, k: int) -> str:
        return HEAD + "\n\n".join(f"Document {i + 1}:\n{doc}" for i, doc in enumerate(docs_of(n, k)))

    def pieces(n: int) -> int:
        return len(pool.docs[distractors[n]].split(" ")) - 1 if n < len(distractors) else 0

    if count_tokens(tokenizer, build(0, 0)) > length * (1 + TOLERANCE):
        return None
    guess = length // (160 if task == "qa_1" else 110)
    fitted = fit_context(tokenizer, build, length, 0, len(distractors), guess, pieces=pieces, task=task)
    order = docs_of(fitted.units, fitted.pieces)
    own = [order.index(pool.docs[i]) + 1 for i in gold]
    return Sample(
        context=fitted.text,
        question=question_text(text),
        answers=list(answers),
        answer_prefix=ANSWER_PREFIX,
        max_new_tokens=MAX_NEW_TOKENS,
        meta={
            "task": task, "length": length, "index": index, "dataset": DATASETS[task],
            "question_id": question, "question_documents": own, "num_documents": len(order),
            "partial_words": fitted.pieces, "tokens": fitted.tokens,
        },
    )  # fmt: skip


def qa_samples(tokenizer: PreTrainedTokenizerBase, task: str, length: int, num_samples: int, seed: int):
    """``num_samples`` samples on distinct questions, in a seeded order; questions whose own
    paragraphs do not fit the length are skipped."""
    pool = qa_pool(DATASETS[task])
    order = list(range(len(pool.questions)))
    random.Random(f"ruler/{task}/{seed}/questions").shuffle(order)
    samples: list[Sample] = []
    candidates = iter(order)
    for index in range(num_samples):
        for question in candidates:
            sample = qa_sample(tokenizer, task, length, seed, index, question)
            if sample is not None:
                samples.append(sample)
                break
        else:
            raise InputError(f"{task}: too few questions fit in {length} tokens")
    return samples
