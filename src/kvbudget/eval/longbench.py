"""LongBench (Bai et al. 2023): a loader for its data, its prompts and its official metrics.

LongBench's data cannot be fetched offline, so nothing here downloads by default: point
:func:`load_longbench` at a directory holding LongBench's JSONL files (``{dataset}.jsonl``, or
``{dataset}_e.jsonl`` for LongBench-E; each line has ``input``, ``context``, ``answers``,
``length``, ``dataset``, ``language``, ``all_classes``, ``_id``) — e.g. the unpacked ``data.zip``
of the ``THUDM/LongBench`` dataset. With network access, ``hub=True`` reads the same records
through the ``datasets`` library instead (imported only then).

Prompts (:data:`DATASET2PROMPT`) and generation lengths (:data:`DATASET2MAXLEN`) are LongBench's
``config/dataset2prompt.json`` and ``config/dataset2maxlen.json`` verbatim (typos included:
"asconcisely" in narrativeqa is the official prompt). :func:`longbench_score` is LongBench's
scorer: the best score over the reference answers, and for trec, triviaqa, samsum and lsht only
the first line of the prediction is scored.

Metrics follow LongBench's ``metrics.py`` with two documented substitutions:

- Chinese tokenisation: LongBench segments with ``jieba``, which is not available offline. Here
  Chinese text is split into single CJK characters, with runs of Latin letters or digits kept as
  one token (the InfiniteBench convention for Chinese F1, extended to keep numbers and English
  words whole, as jieba does). qa_f1_zh and rouge_zh scores can therefore differ slightly from
  the official ones.
- ROUGE-L: computed with Google's ``rouge-score`` (F-measure of ``rougeL``, no stemming) instead of
  the ``rouge`` package LongBench calls; both are LCS-based F-measures, but tokenisation differs
  (``rouge-score`` keeps only ``[a-z0-9]`` tokens), so values can differ in the second decimal.
- ``code_sim_score`` uses ``rapidfuzz``'s ``fuzz.ratio`` (the Indel similarity ``fuzzywuzzy``
  computes, unrounded) on the first prediction line without a backquote, ``#`` or ``//``.
"""

from __future__ import annotations

import json
import os
import random
import re
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rapidfuzz import fuzz
from transformers import PreTrainedTokenizerBase

from kvbudget.artifacts import kvbudget_home
from kvbudget.errors import InputError
from kvbudget.eval.metrics import f1_tokens, normalize_answer
from kvbudget.eval.sample import Sample
from kvbudget.eval.tasks.base import TaskSpec

DATASETS = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
)
#: Datasets in LongBench-E (the length-balanced subset, ``{dataset}_e.jsonl``).
DATASETS_E = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)

# LongBench config/dataset2prompt.json
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a "
        "question. Answer the question asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the "
        "question based on the story asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as "
        "concisely as you can, using a single phrase or sentence if possible. If the "
        "question cannot be answered based on the information in the article, write "
        '"unanswerable". If the question is a yes/no question, answer "yes", "no", '
        'or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n '
        "Answer the question based on the above article as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based "
        'on the information in the article, write "unanswerable". If the question is a '
        'yes/no question, answer "yes", "no", or "unanswerable". Do not provide any '
        "explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the "
        "following question based on the above text, only give me the answer and do not "
        "output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题："
        "{input}\n回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do "
        "not output any other words.\n\nThe following are given passages.\n{context}\n\n"
        "Answer the question based on the given passages. Only give me the answer and do "
        "not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do "
        "not output any other words.\n\nThe following are given passages.\n{context}\n\n"
        "Answer the question based on the given passages. Only give me the answer and do "
        "not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do "
        "not output any other words.\n\nThe following are given passages.\n{context}\n\n"
        "Answer the question based on the given passages. Only give me the answer and do "
        "not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n"
        "请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the "
        "report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\n"
        "Summary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or "
        "instruction. Answer the query in one or more sentences.\n\nTranscript:\n"
        "{context}\n\nNow, answer the query based on the above meeting transcript in one "
        "or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\n"
        "News:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": (
        "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结："
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of "
        "questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do "
        "not output any other words. The following are some examples.\n\n{context}\n\n"
        "{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some "
        "examples.\n\n{context}\n\n{input}"
    ),
    "lsht": ("请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}"),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be "
        "duplicates. Please carefully read these paragraphs and determine how many unique "
        "paragraphs there are after removing duplicates. In other words, how many "
        "non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the "
        "final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer "
        "is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine "
        "which paragraph the abstract is from.\n\n{context}\n\nThe following is an "
        "abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the "
        'abstract is from. The answer format must be like "Paragraph 1", "Paragraph '
        '2", etc.\n\nThe answer is: '
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n"
        "{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。"
        '答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": ("Please complete the code given below. \n{context}Next line of code:\n"),
    "repobench-p": ("Please complete the code given below. \n{context}{input}Next line of code:\n"),
}

# LongBench config/dataset2maxlen.json
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

#: Few-shot / completion datasets LongBench scores on the first line and prompts without a chat template.
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})


# --- metrics (LongBench metrics.py) ------------------------------------------------------------------

_ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～"
    "｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ALL_PUNCTUATION = frozenset(string.punctuation + _ZH_PUNCTUATION)
# CJK ideographs (unified, extension A, compatibility, supplementary planes)
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ffff"
# one CJK character, or a run of other word characters (Latin letters, digits), underscore excluded
_ZH_TOKEN = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+")


def normalize_zh_answer(text: str) -> str:
    """LongBench's Chinese normalisation: lower-case, drop Chinese/ASCII punctuation and all whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _ALL_PUNCTUATION)
    return "".join(text.split())


def zh_tokens(text: str) -> list[str]:
    """Character-level Chinese tokens (jieba's stand-in): each CJK character alone, runs of Latin
    letters or digits whole; lower-cased, punctuation and whitespace dropped."""
    return _ZH_TOKEN.findall(text.lower())


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Token F1 after SQuAD normalisation (lower, no punctuation, no articles, single spaces)."""
    return f1_tokens(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Chinese token F1 over :func:`zh_tokens` (character level; LongBench uses jieba words)."""
    return f1_tokens(zh_tokens(prediction), zh_tokens(ground_truth))


_ROUGE_SCORERS: dict[str, Any] = {}


class _ZhTokenizer:
    """``rouge-score`` tokenizer for Chinese: :func:`zh_tokens`."""

    def tokenize(self, text: str) -> list[str]:
        return zh_tokens(text)


def _rouge_l(prediction: str, ground_truth: str, zh: bool) -> float:
    key = "zh" if zh else "en"
    if key not in _ROUGE_SCORERS:
        from rouge_score import rouge_scorer

        tokenizer = _ZhTokenizer() if zh else None
        _ROUGE_SCORERS[key] = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False, tokenizer=tokenizer)
    if not prediction.strip() or not ground_truth.strip():
        return 0.0  # LongBench's rouge raises on empty text and scores 0
    return float(_ROUGE_SCORERS[key].score(ground_truth, prediction)["rougeL"].fmeasure)


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F-measure (``rouge-score``, no stemming)."""
    return _rouge_l(prediction, ground_truth, zh=False)


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F-measure over character-level Chinese tokens (:func:`zh_tokens`)."""
    return _rouge_l(prediction, ground_truth, zh=True)


def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """LongBench's classification score: 1/k when the true class is among the k classes named.

    Classes named in the prediction that are substrings of the true class (but not it) are dropped
    — removing from the list while iterating over it, exactly as LongBench's code does (which can
    skip the element after a removed one), so scores match the official ones.
    """
    all_classes = kwargs["all_classes"] or []
    matches = [name for name in all_classes if name in prediction]
    for term in matches:  # mutated while iterated, as in LongBench
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    if ground_truth in matches:
        return 1.0 / len(matches)
    return 0.0


def _id_score(prediction: str, gold_id: str) -> float:
    found = re.findall(r"\d+", prediction)
    if not found:
        return 0.0
    return sum(number == gold_id for number in found) / len(found)


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Fraction of the numbers in the prediction equal to the paragraph id in "Paragraph N"."""
    return _id_score(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Fraction of the numbers in the prediction equal to the paragraph id in "段落N"."""
    return _id_score(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Fraction of the numbers in the prediction equal to the true count."""
    return _id_score(prediction, str(ground_truth))


def code_sim_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """``fuzz.ratio / 100`` of the first prediction line without a backquote, ``#`` or ``//``."""
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz.ratio(line, ground_truth) / 100


Scorer = Callable[..., float]

DATASET2METRIC: dict[str, Scorer] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def _check_dataset(dataset: str) -> None:
    if dataset not in DATASET2PROMPT:
        raise InputError(f"unknown LongBench dataset '{dataset}': expected one of {', '.join(DATASETS)}")


def longbench_score(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """LongBench's per-sample score in [0, 1]: the best over ``answers``; first line only for
    trec/triviaqa/samsum/lsht."""
    _check_dataset(dataset)
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET2METRIC[dataset]
    return max((metric(prediction, answer, all_classes=all_classes) for answer in answers), default=0.0)


def longbench_scorer(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """LongBench's ``scorer``: the mean per-sample score ×100, rounded to 2 decimals."""
    if not predictions:
        return 0.0
    total = sum(
        longbench_score(dataset, p, a, all_classes) for p, a in zip(predictions, answers, strict=True)
    )
    return round(100 * total / len(predictions), 2)


def metric_for(dataset: str, all_classes: Sequence[str] | None = None) -> Callable[[str, list[str]], float]:
    """A task metric ``(prediction, answers) -> float`` for ``dataset`` (LongBench's scorer rule)."""
    _check_dataset(dataset)

    def metric(prediction: str, answers: list[str]) -> float:
        return longbench_score(dataset, prediction, answers, all_classes)

    return metric


# --- data --------------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """``$KVBUDGET_LONGBENCH_DIR``, else ``$KVBUDGET_HOME/data/longbench`` (``~/.cache/kvbudget``)."""
    if os.environ.get("KVBUDGET_LONGBENCH_DIR"):
        return Path(os.environ["KVBUDGET_LONGBENCH_DIR"]).expanduser()
    return kvbudget_home() / "data" / "longbench"


def read_jsonl(path: Path | str) -> list[dict]:
    """Records of a JSONL file (blank lines skipped)."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{number}: not JSON ({e.msg})") from None
    return records


_FIELDS = ("input", "context", "answers")


def load_longbench(
    dataset: str,
    data_dir: Path | str | None = None,
    *,
    e: bool = False,
    hub: bool = False,
    trust_remote_code: bool = False,
) -> list[dict]:
    """LongBench records of ``dataset``: from ``{data_dir}/{dataset}[_e].jsonl``, or the hub.

    ``data_dir`` defaults to :func:`default_data_dir`. ``hub=True`` loads ``THUDM/LongBench``
    through the ``datasets`` library (needs it installed and network access; THUDM/LongBench ships
    a loading script, which runs only when you opt in with ``trust_remote_code`` — off by default).
    Records keep LongBench's fields; ``all_classes`` is None for datasets without classes.
    """
    _check_dataset(dataset)
    if e and dataset not in DATASETS_E:
        raise InputError(f"'{dataset}' is not in LongBench-E: expected one of {', '.join(DATASETS_E)}")
    name = f"{dataset}_e" if e else dataset
    if hub:
        records = _load_from_hub(name, trust_remote_code)
    else:
        root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
        path = root / f"{name}.jsonl"
        if not path.is_file():
            raise InputError(
                f"LongBench file {path} not found: put LongBench's JSONL files ({name}.jsonl, from the "
                f"THUDM/LongBench dataset's data.zip) in {root}, pass data_dir, or use hub=True with network"
            )
        records = read_jsonl(path)
    for number, record in enumerate(records):
        missing = [k for k in _FIELDS if k not in record]
        if missing:
            raise InputError(f"LongBench {name} record {number} lacks {', '.join(missing)}")
        if isinstance(record["answers"], str):
            record["answers"] = [record["answers"]]
        record.setdefault("all_classes", None)
    return records


def _load_from_hub(name: str, trust_remote_code: bool = False) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise InputError(
            "loading LongBench from the hub needs the `datasets` package (pip install datasets) and network "
            "access; or download LongBench's data.zip and pass data_dir"
        ) from None
    try:
        rows = datasets.load_dataset(
            "THUDM/LongBench", name, split="test", trust_remote_code=trust_remote_code
        )
    except Exception as err:  # network, hub or script errors: say what to do instead
        raise InputError(
            f"could not load THUDM/LongBench '{name}' through datasets ({type(err).__name__}: {err}); "
            "download LongBench's data.zip and pass data_dir instead (its hub loader is a script: it needs "
            "the trust_remote_code opt-in, which is yours to give)"
        ) from err
    return [dict(row) for row in rows]


def format_prompt(dataset: str, record: dict) -> str:
    """The full LongBench prompt of a record (``DATASET2PROMPT[dataset].format(**record)``)."""
    _check_dataset(dataset)
    return DATASET2PROMPT[dataset].format(**record)


def split_prompt(dataset: str, record: dict) -> tuple[str, str]:
    """The prompt split for a :class:`Sample`: (instruction + context, the rest after the context).

    ``head + "\\n\\n" + tail`` differs from :func:`format_prompt` only in the whitespace between
    the context and the question (the engine joins them with a blank line).
    """
    _check_dataset(dataset)
    before, after = DATASET2PROMPT[dataset].split("{context}", 1)
    head = before.format(**record) + record["context"]
    tail = after.format(**record).lstrip("\n")
    return head, tail


def truncate_middle(tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int) -> str:
    """LongBench's truncation: keep the first and last ``max_tokens // 2`` tokens of a long text."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )


def to_sample(
    dataset: str,
    record: dict,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_context_tokens: int | None = None,
    index: int = 0,
) -> Sample:
    """A :class:`Sample` of a record: context = instruction + context (truncated in the middle to
    ``max_context_tokens`` when given), question = the rest of the prompt, no answer prefix (the
    official prompts end with e.g. "Answer:" inside the user turn)."""
    if max_context_tokens is not None:
        if tokenizer is None:
            raise InputError("max_context_tokens needs a tokenizer")
        record = {**record, "context": truncate_middle(tokenizer, record["context"], max_context_tokens)}
    head, tail = split_prompt(dataset, record)
    return Sample(
        context=head,
        question=tail,
        answers=list(record["answers"]),
        answer_prefix="",
        max_new_tokens=DATASET2MAXLEN[dataset],
        meta={
            "task": f"longbench/{dataset}",
            "dataset": dataset,
            "length": max_context_tokens,
            "longbench_length": record.get("length"),
            "index": index,
            "_id": record.get("_id"),
            "all_classes": record.get("all_classes"),
            "language": record.get("language"),
            "chat_template": dataset not in NO_CHAT_TEMPLATE,
        },
    )


def longbench_samples(
    dataset: str,
    data_dir: Path | str | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_context_tokens: int | None = None,
    num_samples: int | None = None,
    seed: int | None = None,
    e: bool = False,
    hub: bool = False,
) -> list[Sample]:
    """Samples of a LongBench dataset: all records in file order, or ``num_samples`` of them
    (the first ones, or a seeded choice when ``seed`` is given)."""
    records = load_longbench(dataset, data_dir, e=e, hub=hub)
    order = list(range(len(records)))
    if num_samples is not None:
        if num_samples < 1:
            raise InputError(f"num_samples must be at least 1, got {num_samples}")
        if seed is None:
            order = order[:num_samples]
        else:
            order = random.Random(f"longbench:{dataset}:{seed}").sample(order, min(num_samples, len(order)))
    samples = []
    for index, i in enumerate(order):
        sample = to_sample(dataset, records[i], tokenizer, max_context_tokens, index=index)
        sample.meta["record"] = i
        samples.append(sample)
    return samples


def longbench_task(dataset: str, data_dir: Path | str | None = None) -> TaskSpec:
    """A :class:`TaskSpec` (family ``longbench``) for one dataset read from ``data_dir``.

    ``make_samples(tokenizer, length, num_samples, seed)``: a seeded choice of records, each
    context truncated in the middle to ``length`` tokens (LongBench's truncation). The metric is
    LongBench's scorer rule; trec/lsht read their class list from the data on first use.
    """
    _check_dataset(dataset)
    classes: list[Sequence[str] | None] = []

    def make_samples(
        tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int = 0
    ) -> list[Sample]:
        return longbench_samples(
            dataset,
            data_dir,
            tokenizer=tokenizer,
            max_context_tokens=length,
            num_samples=num_samples,
            seed=seed,
        )

    def metric(prediction: str, answers: list[str]) -> float:
        if not classes:
            needs = dataset in ("trec", "lsht")
            classes.append(load_longbench(dataset, data_dir)[0]["all_classes"] if needs else None)
        return longbench_score(dataset, prediction, answers, classes[0])

    return TaskSpec(
        f"longbench/{dataset}", "longbench", make_samples, metric, DATASET2METRIC[dataset].__name__
    )
