"""Shared string metrics: ``metric(prediction, answers) -> score in [0, 1]`` (reports show ×100).

- :func:`string_match_all`, :func:`string_match_part`: RULER's metrics (case-insensitive substring).
- :func:`normalize_answer`, :func:`f1_tokens`, :func:`qa_f1`: SQuAD/LongBench token F1.
- :func:`edit_similarity`: LongBench's code similarity (``fuzz.ratio / 100``) on the first line.
- :func:`last_number`, :func:`normalize_number`: final-number extraction for GSM8K-style answers.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

from rapidfuzz import fuzz


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of reference answers found in the prediction.

    Case-insensitive substring test; 0 when there are no answers.
    """
    if not answers:
        return 0.0
    text = prediction.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_part``: 1 if any reference answer is found (case-insensitive)."""
    text = prediction.lower()
    return float(any(answer.lower() in text for answer in answers))


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation (LongBench's ``normalize_answer``).

    Lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace.
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


_PUNCTUATION = frozenset(string.punctuation)


def f1_tokens(prediction: Sequence[str], reference: Sequence[str]) -> float:
    """Token-bag F1 between two token lists (LongBench's ``f1_score``); 0 when nothing is shared."""
    common = Counter(prediction) & Counter(reference)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction)
    recall = same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: Sequence[str]) -> float:
    """Best token F1 of the normalised prediction against any normalised answer."""
    tokens = normalize_answer(prediction).split()
    return max((f1_tokens(tokens, normalize_answer(answer).split()) for answer in answers), default=0.0)


def first_code_line(prediction: str) -> str:
    """The first non-empty line of a prediction, stripped; Markdown fence lines (```) are skipped."""
    for line in prediction.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("```"):
            return stripped
    return ""


def edit_similarity(prediction: str, answers: Sequence[str]) -> float:
    """Edit similarity of the prediction's first code line to the answer line (LongBench LCC style).

    ``rapidfuzz.fuzz.ratio / 100`` (normalised Indel similarity) between the first non-empty,
    non-fence line of the prediction and each answer, both stripped; the best over answers.
    """
    line = first_code_line(prediction)
    return max((fuzz.ratio(line, answer.strip()) / 100 for answer in answers), default=0.0)


# A number: an optional sign (not when glued to a preceding word/digit, as in "16-3"), digits with
# optional thousands separators, optional decimals.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def normalize_number(text: str) -> str:
    """Canonical form of a number string: commas removed, trailing decimal zeros stripped.

    ``"1,234.50"`` → ``"1234.5"``, ``"18.0"`` → ``"18"``, ``"-0"`` → ``"0"``.
    """
    text = text.strip().replace(",", "").lstrip("+")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    if text in ("-0", ""):
        return "0" if text else ""
    return text


def numbers(text: str) -> list[str]:
    """All numbers in a text, normalised with :func:`normalize_number`, in order."""
    return [normalize_number(m.group(0)) for m in _NUMBER.finditer(text)]


def last_number(text: str) -> str | None:
    """The last number in a text, normalised (commas removed, trailing ``.0`` stripped), or None."""
    found = numbers(text)
    return found[-1] if found else None
