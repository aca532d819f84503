"""The tables of single papers' claims: LAQ's lookahead overhead, D2O's long generation, ASL's
time to first token, the dtype check and the methods that keep more than their budget."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from .common import difference_cell, p_text, paired_on_finished_tasks, pct

#: The paper's two LongBench output lengths of its latency breakdown (LAQ §6.3, Fig. 6): the mean
#: answer of its short-output and of its long-output scenario, in tokens.
LAQ_OUTPUT_TOKENS = (11.2, 402.83)


def laq_overhead(rows: list[dict]) -> list[str]:
    """LAQ's lookahead time as a share of its time to first token (prefill + compression + lookahead)
    and, as the paper defines its overhead, of the total latency ``TTFT + (n − 1) · TPOT`` at the
    paper's two output lengths ``n`` (:data:`LAQ_OUTPUT_TOKENS`); TPOT is the mean over the method's
    rows that decoded one-token steps (the evaluation's other answer tokens come from the draft)."""
    shares = " | ".join(f"share of total at {n:g} tokens" for n in LAQ_OUTPUT_TOKENS)
    lines = [
        f"| method | lookahead s | TTFT s | TPOT s | share of TTFT | {shares} |",
        "|---|---|---|---|---|" + "---|" * len(LAQ_OUTPUT_TOKENS),
    ]
    for method in ("laq", "laq++", "laq-ada", "laq-lava"):
        mine = [r for r in rows if r["method"] == method and r.get("ttft_s")]
        steps = [r["tpot_s"] for r in mine if r.get("tpot_s")]
        if not mine or not steps:
            continue
        look = statistics.mean(r["lookahead_s"] for r in mine)
        ttft = statistics.mean(r["ttft_s"] for r in mine)
        tpot = statistics.mean(steps)
        totals = " | ".join(f"{100 * look / (ttft + (n - 1) * tpot):.1f}%" for n in LAQ_OUTPUT_TOKENS)
        lines.append(
            f"| {method} | {look:.2f} | {ttft:.2f} | {tpot:.3f} | {100 * look / ttft:.1f}% | {totals} |"
        )
    return lines


def kl_rows(rows: list[dict]) -> list[dict]:
    """``rows`` scored by their KL(full ‖ method) per answer token instead of their task score."""
    return [{**r, "score": r["kl"]} for r in rows if r.get("kl") is not None and r.get("error") is None]


def d2o_longgen(
    rows: list[dict], others: Sequence[str] = ("h2o", "d2o-nomerge", "cam", "streamingllm")
) -> list[str]:
    """D2O's long generation: each method's KL per answer token and ``d2o − method`` (paired)."""
    lines = ["| method | KL per token [95% CI] | d2o − method [95% CI] | p |", "|---|---|---|---|"]
    column = ("r", 0.5)
    found = [(m, paired_on_finished_tasks(rows, "d2o", m, column, None, min_samples=10)) for m in others]
    found = [(m, d) for m, d in found if d is not None]
    if not found:
        return ["(no rows)"]
    d2o = found[0][1].a
    listed = [(m, d.b, d) for m, d in found] + [("d2o", d2o, None)]
    for m, kl, d in sorted(listed, key=lambda item: item[1].mean):
        if d is None:
            diff = "– | –"
        else:
            x = d.difference
            diff = f"{x.mean:+.3f} [{x.low:+.3f}, {x.high:+.3f}] | {p_text(d.p_value)}"
        lines.append(f"| {m} | {kl.mean:.3f} [{kl.low:.3f}, {kl.high:.3f}] | {diff} |")
    return lines


def asl_ttft(path: Path) -> list[str]:
    """TTFT of each method relative to the full cache's, per length, from `kvbudget bench`'s
    bench.json (medians over the repeats, min–max in brackets)."""
    rows = json.loads((path / "bench.json").read_text(encoding="utf-8"))["rows"]
    ttft = {(r["method"], r["length"]): r for r in rows if r.get("ttft_s") is not None}
    lengths = sorted({length for _, length in ttft})
    methods = list(dict.fromkeys(m for m, _ in ttft))
    lines = [
        "| method | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for m in methods:
        cells = []
        for n in lengths:
            full, mine = ttft.get(("full", n)), ttft.get((m, n))
            if full is None or mine is None:
                cells.append("–")
                continue
            low, high = mine["ttft_s_spread"]
            cells.append(
                f"{mine['ttft_s']:.2f} s [{low:.2f}, {high:.2f}] ({mine['ttft_s'] / full['ttft_s']:.2f}×)"
            )
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def dtype_table(rows: list[dict]) -> list[str]:
    """Full-cache scores in bfloat16 and float32 on the same samples, per task and over tasks, and
    how many samples got the same answer, token for token, in both dtypes."""
    rows = [{**r, "label": r["dtype"]} for r in rows if r["method"] == "full" and r.get("score") is not None]
    tasks = sorted({r["task"] for r in rows})
    answers: dict[tuple[str, int, int], dict[str, str]] = defaultdict(dict)
    for r in rows:
        answers[(r["task"], r["length"], r["sample"])][r["dtype"]] = r["prediction"]
    lines = [
        "| task | bfloat16 | float32 | bf16 − fp32 | samples | identical answers |",
        "|---|---|---|---|---|---|",
    ]
    anywhere = ("r", 0.0)  # full-cache rows have no column: any column matches them
    for name, wanted in [*((t, [t]) for t in tasks), ("**mean over tasks**", tasks)]:
        result = paired_on_finished_tasks(rows, "bfloat16", "float32", anywhere, wanted)
        if result is None:
            continue
        a, b = result.a, result.b
        pairs = [both for (task, _, _), both in answers.items() if task in wanted and len(both) == 2]
        same = sum(both["bfloat16"] == both["float32"] for both in pairs)
        lines.append(
            f"| {name} | {pct(a.mean)} [{pct(a.low)}, {pct(a.high)}] | {pct(b.mean)} [{pct(b.low)}, "
            f"{pct(b.high)}] | {difference_cell(result)} | {result.difference.n} | {same} of {len(pairs)} |"
        )
    return lines


def over_budget(rows: list[dict], methods: Sequence[str]) -> list[str]:
    """Per method: rows whose kept entries (summed over layers and heads) exceed budget × layers ×
    heads, and the kept entries over the budget's (largest, mean), from the rows' ``budgets``."""
    lines = [
        "| method | rows over the budget | of rows | kept / budget, largest | mean |",
        "|---|---|---|---|---|",
    ]
    for method in methods:
        shares = []
        for r in rows:
            if r["label"] != method or not r.get("budgets") or r.get("budget") is None:
                continue
            kept = r["budgets"]
            shares.append(sum(map(sum, kept)) / (r["budget"] * len(kept) * len(kept[0])))
        if not shares:
            continue
        over = [x for x in shares if x > 1 + 1e-9]
        largest, mean = max(shares), statistics.mean(shares)
        lines.append(f"| {method} | {len(over)} | {len(shares)} | {largest:.3f}× | {mean:.3f}× |")
    return lines
