"""kvpress's screen: every press that runs offline on a few samples, beside kvbudget's same
method on those samples."""

from __future__ import annotations

import statistics
from collections import defaultdict

from kvbudget.eval.paired import row_column
from kvbudget.eval.report import PEER_PREFIX

from .common import pct

#: kvpress's presses screened on a few samples → kvbudget's implementation of the same method, where
#: one exists (its kept positions are checked against the press in tests/test_kvpress_oracle.py).
SCREEN_COUNTERPARTS = {
    "kvzip": "kvzip", "kvzip_plus": "kvzip+", "kvgrad": "kvgrad", "leverage": "leverage",
    "compactor": "compactor", "chunkkv": "chunkkv", "lagkv": "lagkv", "keydiff": "keydiff",
    "expected_attention": "expected-attention", "knorm": "knorm", "tova": "tova",
    "observed_attention": "observed-attention", "streaming_llm": "streamingllm", "snapkv": "snapkv",
    "adakv_snapkv": "ada-snapkv", "random": "random",
}  # fmt: skip


#: kvpress's screen: every press that runs offline, on the first ``SCREEN_LIMIT`` samples of these
#: tasks at this ratio, question-agnostic (lab/scripts/leaderboard_run.py … --limit 3 --peer-presses all).
SCREEN_TASKS, SCREEN_LIMIT, SCREEN_RATIO = ("niah_multikey_2", "vt"), 3, 0.5


def screen_rows(rows: list[dict]) -> dict[str, dict[tuple[str, int], dict]]:
    """The screen's scored rows: label → (task, sample) → row."""
    scored: dict[str, dict[tuple[str, int], dict]] = defaultdict(dict)
    for r in rows:
        if (
            r.get("score") is not None
            and row_column(r) == ("r", SCREEN_RATIO)
            and r["task"] in SCREEN_TASKS
            and r["sample"] < SCREEN_LIMIT
        ):
            scored[r["label"]][(r["task"], r["sample"])] = r
    return scored


def same_answers(scored: dict[str, dict[tuple[str, int], dict]], a: str, b: str, keys) -> int:
    """How many of the screen samples ``keys`` ``a`` and ``b`` answered with the same text."""
    return sum(scored[a][k]["prediction"].strip() == scored[b][k]["prediction"].strip() for k in keys)


def screen_table(rows: list[dict]) -> list[str]:
    """kvpress's screen (:func:`screen_rows`): every press's mean on the samples it ran, beside
    kvbudget's same method on those very samples and the number of samples where both answered the
    same text; best press first."""
    scored = screen_rows(rows)
    presses = [label for label in scored if label.startswith(PEER_PREFIX)]
    if not presses:
        return ["(no screen rows yet)"]

    def mean(label: str, keys) -> float:
        return statistics.mean(scored[label][k]["score"] for k in keys)

    lines = [
        "| press | samples | press mean | kvbudget's same method | its mean, same samples | same answer |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for label in sorted(presses, key=lambda p: (-mean(p, scored[p]), p)):
        keys = sorted(scored[label])
        ours = SCREEN_COUNTERPARTS.get(label.removeprefix(PEER_PREFIX))
        common = [k for k in keys if ours is not None and k in scored.get(ours, {})]
        if ours is None:
            cells = "– | – | –"
        elif not common:
            cells = f"{ours} | not run on these samples | –"
        else:
            same = same_answers(scored, label, ours, common)
            press_mean = "" if len(common) == len(keys) else f" (press {pct(mean(label, common))} on these)"
            cells = f"{ours} | {pct(mean(ours, common))}{press_mean} | {same} of {len(common)}"
        lines.append(f"| {label} | {len(keys)} | {pct(mean(label, keys))} | {cells} |")
    return lines
