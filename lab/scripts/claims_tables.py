"""The tables of docs/claims.md, from committed results (no model runs):

    .venv/bin/python lab/scripts/claims_tables.py [--update docs/claims.md]
        [--leaderboard lab/results/leaderboard] [--baklava lab/results/claims-baklava]
        [--asl-ttft lab/results/claims-asl-ttft] [--dtype-check DIR]
        [--agnostic lab/results/leaderboard-agnostic] [--ea-floor lab/results/ea-kvpress]
        [--d2o-longgen lab/results/claims-d2o-longgen]

Without --update it prints every table in its ``<!-- claims:NAME -->`` block; with it, it rewrites
those blocks in the file.

Every difference is paired (the same samples for both methods; kvbudget.eval.paired) with its 95%
stratified bootstrap interval; ``ahead``/``behind`` only where the interval excludes 0.

The ``verdicts`` block applies docs/claims.md's rule: each paper's pre-registered headline family
(:data:`FAMILIES`), its comparisons' bootstrap p-values corrected together by Holm
(kvbudget.eval.paired.holm_adjust), and the verdict of :func:`family_verdict`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvbudget.errors import KVBudgetError
from kvbudget.eval.paired import PairedDifference, holm_adjust, paired_difference, row_column
from kvbudget.eval.report import PEER_PREFIX, across_tasks
from kvbudget.eval.store import archive_parts, load_rows
from kvbudget.eval.suites import LEADERBOARD_CORE_TASKS, LEADERBOARD_PLAN
from kvbudget.methods.registry import method_info, method_names

#: Methods that hold more than the budget by design (marked ¹ in docs/leaderboard-analysis.md): their classes'
#: ``exceeds_budget``.
BEYOND_BUDGET = tuple(name for name in method_names() if method_info(name).exceeds_budget)
HARD = ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "kv_retrieval")
#: The tasks the leaderboard plan runs at every ratio (0.875, 0.75, 0.5 and 0.25): a gain read across
#: ratios over these is read on one task set.
EVERY_RATIO = sorted(set.intersection(*(set(tasks) for _, tasks in LEADERBOARD_PLAN if tasks is not None)))


def _pct(value: float, scale: float = 100.0) -> str:
    return f"{scale * value:.1f}"


def _cell(result: PairedDifference | None, scale: float = 100.0) -> str:
    if result is None:
        return "–"
    d = result.difference
    return f"{scale * d.mean:+.1f} [{scale * d.low:+.1f}, {scale * d.high:+.1f}]"


def _columns(rows: list[dict]) -> list[tuple[str, float]]:
    found = {row_column(r) for r in rows} - {None}
    return sorted(found, key=lambda c: (c[0], c[1]))  # type: ignore[arg-type]


def _label(column: tuple[str, float]) -> str:
    return f"r={column[1]:g}" if column[0] == "r" else f"B={column[1]:g}"


#: Tasks count only where both methods have at least this many samples (a task still running is left out).
MIN_SAMPLES = 20


def _try(rows, a, b, column, tasks, min_samples: int = MIN_SAMPLES) -> PairedDifference | None:
    """``a − b`` over the tasks (of ``tasks``, if given) where both scored ``MIN_SAMPLES`` samples."""
    per_label = []
    for label in (a, b):
        seen = {(r["task"], r["sample"]) for r in rows if r["label"] == label and r.get("score") is not None
                and row_column(r) in (None, column)}  # fmt: skip
        per_label.append(Counter(task for task, _ in seen))
    complete = [
        t for t, n in per_label[0].items()
        if n >= min_samples and per_label[1][t] >= min_samples and (tasks is None or t in tasks)
    ]  # fmt: skip
    if not complete:
        return None
    try:
        return paired_difference(rows, a, b, column, tasks=complete, resamples=2000)
    except KVBudgetError:
        return None


def pairs_table(
    rows: list[dict],
    pairs: list[tuple[str, str]],
    tasks: list[str] | None = None,
    min_samples: int = MIN_SAMPLES,
    scale: float = 100.0,
) -> list[str]:
    """One row per pair, one column per compression column: mean(a) vs mean(b), a − b [95% CI].

    A column where no pair has a finished task yet (a ratio still running) is left out."""
    columns = _columns([r for r in rows if r["label"] in {x for p in pairs for x in p}])
    grid = {(pair, c): _try(rows, *pair, c, tasks, min_samples) for pair in pairs for c in columns}
    columns = [c for c in columns if any(grid[pair, c] is not None for pair in pairs)]
    lines = ["| a − b | " + " | ".join(_label(c) for c in columns) + " |", "|---|" + "---|" * len(columns)]
    for a, b in pairs:
        cells = []
        for column in columns:
            result = grid[(a, b), column]
            if result is None:
                cells.append("–")
                continue
            cells.append(
                f"{_pct(result.a.mean, scale)} vs {_pct(result.b.mean, scale)}: {_cell(result, scale)} "
                f"({len(result.tasks)} tasks)"
            )
        lines.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
    return lines


def selection_layers(rows: list[dict], methods: list[str]) -> list[str]:
    """Per task: each method's selection layers (median, range, share with none selected), on the
    (task, ratio) cells every method has finished (``MIN_SAMPLES`` samples)."""
    by = defaultdict(list)
    for r in rows:
        if r["method"] in methods and r.get("score") is not None and r.get("compression_ratio") is not None:
            by[(r["task"], r["method"], r["compression_ratio"])].append(r.get("selection_layer"))
    lines = ["| task | ratio | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    cells_done = {(t, c) for t, _, c in by if all(len(by.get((t, m, c), [])) >= MIN_SAMPLES for m in methods)}
    for task, ratio in sorted(cells_done):
        cells = []
        for m in methods:
            layers = by.get((task, m, ratio), [])
            chosen = [x for x in layers if x is not None]
            if not layers:
                cells.append("–")
                continue
            none = len(layers) - len(chosen)
            text = f"{statistics.median(chosen):g} ({min(chosen)}–{max(chosen)})" if chosen else "none"
            cells.append(text + (f", none in {none}/{len(layers)}" if none and chosen else ""))
        lines.append(f"| {task} | {ratio:g} | " + " | ".join(cells) + " |")
    return lines


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
    found = [(m, _try(rows, "d2o", m, column, None, min_samples=10)) for m in others]
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
            diff = f"{x.mean:+.3f} [{x.low:+.3f}, {x.high:+.3f}] | {_p(d.p_value)}"
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


def has_results(folder: Path) -> bool:
    """Whether ``folder`` holds a results file (``results.jsonl`` or its committed archive)."""
    return (folder / "results.jsonl").exists() or bool(archive_parts(folder / "results.jsonl"))


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
        result = _try(rows, "bfloat16", "float32", anywhere, wanted)
        if result is None:
            continue
        a, b = result.a, result.b
        pairs = [both for (task, _, _), both in answers.items() if task in wanted and len(both) == 2]
        same = sum(both["bfloat16"] == both["float32"] for both in pairs)
        lines.append(
            f"| {name} | {_pct(a.mean)} [{_pct(a.low)}, {_pct(a.high)}] | {_pct(b.mean)} [{_pct(b.low)}, "
            f"{_pct(b.high)}] | {_cell(result)} | {result.difference.n} | {same} of {len(pairs)} |"
        )
    return lines


# ------------------------------------------------------------------------------------------ verdicts

#: The level of every family's test, after Holm's correction (docs/claims.md, "The rule").
ALPHA = 0.05
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive at this scale"
#: A family one of whose comparisons has no finished rows yet: no verdict.
PENDING = "pending (not run)"


def family_verdict(findings: Sequence[tuple[int, float, float] | None], alpha: float = ALPHA) -> str:
    """The verdict of one headline family by docs/claims.md's rule.

    ``findings``: per comparison ``(direction, mean, adjusted_p)`` — ``direction`` +1 where the claim
    says ``a`` scores higher than ``b``, −1 where lower (perplexity, KL); ``mean`` the measured
    ``a − b``; ``adjusted_p`` its Holm-adjusted p-value — or ``None`` for a comparison not run yet.

    * **not reproduced**: some comparison is significant (adjusted p < ``alpha``) against the claim;
    * **reproduced**: every comparison is significant in the claimed direction;
    * **inconclusive at this scale**: otherwise;
    * **pending**: the family is empty or a comparison has not run (nothing is read from a part).
    """
    done = [f for f in findings if f is not None]
    if not done or len(done) < len(findings):
        return PENDING
    if any(p < alpha and direction * mean < 0 for direction, mean, p in done):
        return NOT_REPRODUCED
    if all(p < alpha and direction * mean > 0 for direction, mean, p in done):
        return REPRODUCED
    return INCONCLUSIVE


@dataclass(frozen=True)
class Comparison:
    """One comparison of a family: ``a − b`` at ``column`` over ``tasks`` (``None``: every task both
    finished) of the rows named ``source``, each task counting once both have ``min_samples``.

    ``direction``: +1 where the claim says ``a`` scores higher, −1 where lower. ``a_ratio``: take
    ``a``'s rows at this compression ratio instead of ``column``'s (a comparison at equal memory,
    where ``b`` holds more than its budget). ``every_task``: not measured (``None``) until every task
    of ``tasks`` is finished (a check whose verdict needs them all)."""

    a: str
    b: str
    column: tuple[str, float]
    direction: int = 1
    source: str = "leaderboard"
    tasks: tuple[str, ...] | None = None
    min_samples: int = MIN_SAMPLES
    a_ratio: float | None = None
    every_task: bool = False  # measured only once every task of ``tasks`` is finished

    @property
    def a_label(self) -> str:
        return self.a if self.a_ratio is None else f"{self.a} at r={self.a_ratio:g}"

    @property
    def name(self) -> str:
        return f"{self.a_label} − {self.b}"


@dataclass(frozen=True)
class Family:
    """A paper's headline family: the comparisons its claim names, at the setting here
    nearest the claim's own (``setting``, in words). ``pending``: where these rows stand in for the
    claim's exact setting, the run that would replace them (its verdict is provisional until then).
    ``final``: that run's comparisons (``final_setting`` in words), one per comparison, which decide
    the verdict in place of ``comparisons`` once each has every task it names (``tasks``; without
    them, every task its stand-in has)."""

    paper: str
    setting: str
    comparisons: tuple[Comparison, ...]
    pending: str = ""
    final: tuple[Comparison, ...] = ()
    final_setting: str = ""

    def decided_by(
        self, measure: Callable[[Comparison], PairedDifference | None]
    ) -> tuple[str, tuple[Comparison, ...], str]:
        """(setting, comparisons, pending) of the verdict: ``final``'s once all of it is measured on
        the tasks it names (else those the stand-ins have), else the stand-ins' (with ``pending``)."""
        if self.final:
            for stand_in, final in zip(self.comparisons, self.final, strict=True):
                after = measure(final)
                if final.tasks is not None:
                    needed = set(final.tasks)
                else:
                    before = measure(stand_in)
                    needed = set(before.tasks) if before is not None else set()
                if after is None or not needed <= set(after.tasks):
                    break
            else:
                return self.final_setting, self.final, ""
        return self.setting, self.comparisons, self.pending


#: Tasks of the RULER family among the leaderboard's (rows' ``family`` = "ruler").
RULER_FAMILY = "ruler"
#: Scale and decimals of each row source's scores in the verdicts table (×100 scores, KL as is).
SOURCE_FORMAT = {"leaderboard": (100.0, 1), "d2o-longgen-kl": (1.0, 3), "check-1.5b": (100.0, 1)}
AT_0875 = ("r", 0.875)
#: the profile BaKlaVa's tuned rows ran with (its ``tuned`` block: Algorithm 3 on perplexity)
BAKLAVA_PROFILE = "lab/results/claims-baklava/profile.json"
#: the leaderboard's core tasks: where the runs that replace stand-ins were cut to (compute)
CORE = tuple(LEADERBOARD_CORE_TASKS)

#: the baselines LAVa's claim names (Table 2)
LAVA_BASELINES = ("snapkv", "ada-snapkv", "pyramidkv", "ada-pyramidkv", "cake")

FAMILIES = (
    Family(
        "LAVa", "r = 0.875, 13 tasks (the smallest budget, where the claim puts its largest margin)",
        tuple(
            Comparison("lava", b, AT_0875)
            for b in LAVA_BASELINES
        ),
        pending="the baselines at LAVa's App. D settings (`@lava`)",
        final=tuple(
            Comparison("lava", f"{b}@lava", AT_0875, tasks=CORE)
            for b in LAVA_BASELINES
        ),
        final_setting="r = 0.875, the 6 core tasks, the baselines at LAVa's App. D settings (`@lava`)",
    ),
    Family(
        "ASL", "r = 0.875, 13 tasks; PyramidInfer at equal memory (it keeps ~81% of the prompt at "
        "every r; ASL at r = 0.25 keeps 75%), 5 tasks",
        (
            Comparison("asl", "fastkv", AT_0875),
            Comparison("asl", "gemfilter", AT_0875),
            Comparison("asl", "pyramidinfer", AT_0875, tasks=tuple(EVERY_RATIO), a_ratio=0.25),
        ),
        pending="FastKV and GemFilter at ASL's settings (`fastkv@asl`, `gemfilter@asl`)",
        final=(
            Comparison("asl", "fastkv@asl", AT_0875, tasks=CORE),
            Comparison("asl", "gemfilter@asl", AT_0875, tasks=CORE),
            Comparison("asl", "pyramidinfer", AT_0875, tasks=tuple(EVERY_RATIO), a_ratio=0.25),
        ),
        final_setting="r = 0.875, the 6 core tasks, FastKV and GemFilter at ASL's settings (App. C.2); "
        "PyramidInfer at equal memory (ASL at r = 0.25), 5 tasks",
    ),
    Family(
        "BaKlaVa", "r = 0.875 (high compression), 13 tasks; BaKlaVa untuned",
        (Comparison("baklava", "streamingllm", AT_0875), Comparison("baklava", "squeezeattention", AT_0875)),
        pending="BaKlaVa and SqueezeAttention with the perplexity-tuned profile (the paper's protocol)",
        final=(
            Comparison(f"baklava:profile={BAKLAVA_PROFILE}", "streamingllm", AT_0875, tasks=CORE),
            Comparison(
                f"baklava:profile={BAKLAVA_PROFILE}", f"squeezeattention:profile={BAKLAVA_PROFILE}", AT_0875,
                tasks=CORE,
            ),
        ),
        final_setting="r = 0.875, the 6 core tasks; BaKlaVa and SqueezeAttention with the profile "
        "tuned on perplexity (Algorithm 3, the paper's protocol)",
    ),
    Family(
        "Lookahead Q-Cache", "r = 0.875, lcc (the one LongBench task here)",
        tuple(Comparison(a, "snapkv", AT_0875, tasks=("lcc",)) for a in ("laq", "laq++")),
    ),
    Family(
        "D2O", "gsm8k chain of thought, 256 tokens, r = 0.5, 10 problems; KL(full ‖ method) per token",
        tuple(
            Comparison("d2o", b, ("r", 0.5), direction=-1, source="d2o-longgen-kl", min_samples=10)
            for b in ("h2o", "d2o-nomerge", "streamingllm", "cam")
        ),
    ),
)  # fmt: skip


#: The 1.5B check (docs/claims.md, pending run 5): the rows' folder, their samples a task.
CHECK_SOURCE, CHECK_SAMPLES = "check-1.5b", 10


def _checked(a: str, b: str, tasks: tuple[str, ...] = CORE) -> Comparison:
    return Comparison(
        a, b, AT_0875, source=CHECK_SOURCE, tasks=tasks, min_samples=CHECK_SAMPLES, every_task=True
    )


#: The families at 3× the model and 2× the length (qwen2.5-coder-1.5b at 4K tokens), question-aware,
#: r = 0.875, the core tasks: the 0.5B's final families (the baselines at LAVa's and ASL's settings),
#: with BaKlaVa and SqueezeAttention untuned (their perplexity-tuned profile is the 0.5B's; tuning one
#: for the 1.5B is cut for compute) and PyramidInfer and D2O's gsm8k family cut.
CHECK_FAMILIES = (
    Family("LAVa", "r = 0.875, 6 core tasks, the baselines at LAVa's App. D settings (`@lava`)",
           tuple(_checked("lava", f"{b}@lava") for b in LAVA_BASELINES)),
    Family("ASL", "r = 0.875, 6 core tasks, FastKV and GemFilter at ASL's settings",
           (_checked("asl", "fastkv@asl"), _checked("asl", "gemfilter@asl"))),
    Family("BaKlaVa", "r = 0.875, 6 core tasks; BaKlaVa untuned",
           (_checked("baklava", "streamingllm"), _checked("baklava", "squeezeattention"))),
    Family("Lookahead Q-Cache", "r = 0.875, lcc",
           tuple(_checked(a, "snapkv", ("lcc",)) for a in ("laq", "laq++"))),
)  # fmt: skip

#: Row timestamps further apart than this are a pause (a stopped queue, a session's end), not work.
PAUSE_S = 600.0


def machine_time(rows: list[dict]) -> float:
    """Seconds of work behind ``rows``: the sum of the gaps between consecutive rows' timestamps,
    gaps over :data:`PAUSE_S` left out."""
    stamps = sorted(datetime.fromisoformat(r["time"]).timestamp() for r in rows if r.get("time"))
    return sum(b - a for a, b in zip(stamps, stamps[1:], strict=False) if b - a <= PAUSE_S)


def check_block(rows: list[dict]) -> list[str]:
    """The 1.5B check: :data:`CHECK_FAMILIES`' verdicts by the rule, and the machine time of its rows."""
    lines = verdicts_table({CHECK_SOURCE: rows}, CHECK_FAMILIES)
    done = sorted({r["task"] for r in rows})
    hours, minutes = divmod(round(machine_time(rows) / 60), 60)
    lines += ["", f"{len(rows)} rows ({', '.join(done) or 'none yet'}): {hours} h {minutes:02d} min of "
              "this 2-core CPU (from the first row's timestamp to the last, pauses over 10 minutes left "
              "out; the model's load and the first prefill come before the first row)."]  # fmt: skip
    return lines


def _measure(sources: dict[str, list[dict]], c: Comparison) -> PairedDifference | None:
    """``c`` measured on its source's rows (``None`` until both sides finished a task)."""
    rows = sources.get(c.source, [])
    if c.a_ratio is not None:  # a's rows at another ratio, moved into b's column
        moved = [{**r, "label": c.a_label, "compression_ratio": c.column[1]} for r in rows
                 if r["label"] == c.a and row_column(r) == ("r", c.a_ratio)]  # fmt: skip
        rows = moved + [r for r in rows if r["label"] == c.b]
    found = _try(rows, c.a_label, c.b, c.column, list(c.tasks) if c.tasks else None, c.min_samples)
    if found is not None and c.every_task and c.tasks and not set(c.tasks) <= set(found.tasks):
        return None
    return found


def _p(p: float) -> str:
    return f"{p:.3f}" if p >= 0.0005 else "<0.001"


def verdicts_table(sources: dict[str, list[dict]], families: Sequence[Family] = FAMILIES) -> list[str]:
    """One row per comparison of every family: a and b's means, a − b [95% CI], its bootstrap p, the
    Holm-adjusted p within the family, and (on the family's first row) the verdict by the rule."""
    lines = [
        "| paper | family (setting here) | a − b | a vs b | a − b [95% CI] | tasks | p | Holm p | verdict "
        "| provisional until |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    measured_once: dict[Comparison, PairedDifference | None] = {}

    def measure(c: Comparison) -> PairedDifference | None:  # each bootstrap runs once
        if c not in measured_once:
            measured_once[c] = _measure(sources, c)
        return measured_once[c]

    for family in families:
        setting, comparisons, pending = family.decided_by(measure)
        measured = [measure(c) for c in comparisons]
        done = [m for m in measured if m is not None]
        adjusted = iter(holm_adjust([m.p_value for m in done]))
        holm = [None if m is None else next(adjusted) for m in measured]
        findings = [
            None if m is None else (c.direction, m.difference.mean, h)
            for c, m, h in zip(comparisons, measured, holm, strict=True)
        ]
        verdict = f"**{family_verdict(findings)}**"
        for i, (c, m, h) in enumerate(zip(comparisons, measured, holm, strict=True)):
            head = f"| {family.paper} | {setting} | " if i == 0 else "| | | "
            sign = "" if c.direction > 0 else " (lower is better)"
            if m is None:
                cells = "not run | – | – | – | – | –"
            else:
                scale, digits = SOURCE_FORMAT[c.source]
                d = m.difference
                mean, low, high = (f"{scale * x:+.{digits}f}" for x in (d.mean, d.low, d.high))
                cells = (
                    f"{scale * m.a.mean:.{digits}f} vs {scale * m.b.mean:.{digits}f} | "
                    f"{mean} [{low}, {high}] | {len(m.tasks)} | {_p(m.p_value)} | {_p(h)}"
                )
            tail = f"{verdict} | {pending or '–'} |" if i == 0 else " | |"
            lines.append(head + f"{c.name}{sign} | {cells} | {tail}")
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


def blocks(args: argparse.Namespace) -> dict[str, list[str]]:
    """Every table of docs/claims.md by name (the name of its ``<!-- claims:NAME -->`` block)."""
    rows = [r for r in load_rows(args.leaderboard / "results.jsonl") if r.get("error") is None]
    extraction = sorted(t for t in {r["task"] for r in rows} if t != "lcc")
    out: dict[str, list[str]] = {}
    if has_results(args.dtype_check):
        out["dtype"] = dtype_table(load_rows(args.dtype_check / "results.jsonl"))

    out["lava-baselines"] = pairs_table(rows, [("lava", b) for b in LAVA_BASELINES])
    ablations = [("lava", b) for b in ("lava-uniform", "lava-nohead", "lava-pyramid")]
    ablations += [("lava-pyramid", "lava-uniform")]  # the paper's Table 9 pair
    out["lava-ablations"] = pairs_table(rows, ablations)
    out["lava-ablations-code"] = pairs_table(rows, ablations, tasks=["lcc"])
    out["lava-ablations-extraction"] = pairs_table(rows, ablations, tasks=extraction)

    asl_pairs = [
        (a, b) for a in ("asl", "asl-2pass", "asl-fullkv") for b in ("fastkv", "gemfilter", "pyramidinfer")
    ]
    asl_pairs += [("asl", "snapkv")]
    out["asl"] = pairs_table(rows, asl_pairs)
    out["asl-hard"] = pairs_table(rows, asl_pairs, tasks=list(HARD))
    out["asl-layers"] = selection_layers(rows, ["asl", "asl-2pass", "fastkv", "gemfilter"])
    if (args.asl_ttft / "bench.json").exists():
        out["asl-ttft"] = asl_ttft(args.asl_ttft)

    bak = [("baklava", "streamingllm"), ("baklava", "squeezeattention"), ("baklava-snapkv", "snapkv")]
    out["baklava-tasks"] = pairs_table(rows, bak)
    if has_results(args.baklava):
        ppl = [r for r in load_rows(args.baklava / "results.jsonl") if r.get("error") is None]
        # The tuned rows name the folder's profile.json by the path their run was given (the
        # committed rows: results/claims-baklava/profile.json, from before the folder moved to lab/).
        recorded = sorted({r["label"] for r in ppl if r["label"].startswith("baklava:profile=")})
        default = ":profile=" + str(args.baklava / "profile.json")
        profile = recorded[0].removeprefix("baklava") if recorded else default
        tuned = {label: label + profile for label in ("baklava", "squeezeattention")}
        ppl_pairs = [
            (tuned["baklava"], "streamingllm"), (tuned["baklava"], tuned["squeezeattention"]),
            (tuned["baklava"], "baklava"), ("baklava", "streamingllm"), ("streamingllm", "full"),
        ]  # fmt: skip
        lines = pairs_table(ppl, ppl_pairs, min_samples=8, scale=1.0)
        out["baklava-perplexity"] = [line.replace(profile, " (tuned)") for line in lines]

    for ratio in (0.875, 0.75, 0.5, 0.25):
        out[f"leaderboard-{ratio:g}"] = leaderboard_table(rows, ratio)
        out[f"leaderboard-{ratio:g}-shared"] = leaderboard_table(rows, ratio, shared=True)
    out["leaderboard-kvpress"] = best_against_kvpress(rows, (0.875, 0.75, 0.5, 0.25))
    out["leaderboard-kvpress-same"] = pairs_table(rows, SAME_METHOD_PAIRS)
    if has_results(args.ea_floor):  # kvbudget's Expected Attention with kvpress's head floor
        floor_rows = [r for r in load_rows(args.ea_floor / "results.jsonl") if r.get("error") is None]
        ours, floored = "expected-attention", "expected-attention:floor=kvpress"
        floor_pairs = [(f"{PEER_PREFIX}expected_attention", floored), (floored, ours)]
        out["leaderboard-ea-floor"] = pairs_table(rows + floor_rows, floor_pairs)
    newer = [("chunkkv", "snapkv"), ("chunkkv", "laq"), ("kvzip", "snapkv"), ("kvzip", "cake"),
             ("r-kv", "snapkv"), ("expected-attention", "snapkv"), ("keydiff", "streamingllm"),
             ("lagkv", "streamingllm"), ("qfilter", "streamingllm")]  # fmt: skip
    out["leaderboard-newer"] = pairs_table(rows, newer)
    family = [("kvgrad", "laq"), ("kvgrad", "kvzip+"), ("kvzip+", "kvzip"), ("kvzap", "kvzip+"),
              ("kvzap:kind=linear", "kvzap"), ("leverage", "kvzip+"), ("compactor", "leverage")]  # fmt: skip
    out["leaderboard-2026"] = pairs_table(rows, family)  # issue #48's family, question-aware
    laq = [(m, "snapkv") for m in ("laq", "laq++", "laq-ada", "laq-lava")] + [("laq-ada", "ada-snapkv")]
    out["laq"] = pairs_table(rows, laq)
    out["laq-every-ratio"] = pairs_table(rows, laq, tasks=EVERY_RATIO)
    ruler = sorted({r["task"] for r in rows if r.get("family") == RULER_FAMILY})
    out["laq-ruler"] = pairs_table(rows, [("laq++", "snapkv"), ("laq", "snapkv")], tasks=ruler)
    out["laq-lcc"] = pairs_table(rows, [("laq", "snapkv"), ("laq++", "snapkv")], tasks=["lcc"])
    out["laq-overhead"] = laq_overhead(rows)
    pyramids = ("pyramidkv", "ada-pyramidkv", "lava-pyramid", "pyramidinfer", "asl-fullkv")
    out["over-budget"] = over_budget(rows, pyramids)
    sources = {"leaderboard": rows}
    if has_results(args.d2o_longgen):
        sources["d2o-longgen-kl"] = kl_rows(load_rows(args.d2o_longgen / "results.jsonl"))
        out["d2o-longgen"] = d2o_longgen(sources["d2o-longgen-kl"])
    out["verdicts"] = verdicts_table(sources)
    if has_results(args.check):
        out["check-1.5b"] = check_block(
            [r for r in load_rows(args.check / "results.jsonl") if r.get("error") is None]
        )
    out.update(agnostic_blocks(args.agnostic, rows))
    return name_tuned_profiles(out)


def name_tuned_profiles(out: dict[str, list[str]]) -> dict[str, list[str]]:
    """The tuned BaKlaVa rows' labels carry their profile's path: every table names them "(tuned)"."""
    tuned = f":profile={BAKLAVA_PROFILE}"
    return {name: [line.replace(tuned, " (tuned)") for line in lines] for name, lines in out.items()}


#: The question-agnostic track's pairs: the query-free scores (made for this track) against the
#: question-window scores that lose their question here, the seed methods against SnapKV, and the
#: KVzip family's gradient-weighted member against the other two.
AGNOSTIC_PAIRS = [
    ("keydiff", "snapkv"), ("keydiff", "streamingllm"), ("kvzip", "snapkv"), ("kvzip", "keydiff"),
    ("lagkv", "snapkv"), ("qfilter", "snapkv"), ("chunkkv", "snapkv"), ("lava", "snapkv"),
    ("laq", "snapkv"), ("expected-attention", "snapkv"), ("kvzip", "expected-attention"),
    ("kvgrad", "kvzip"), ("kvgrad", "kvzip+"),
]  # fmt: skip


#: kvpress's presses against kvbudget's implementation of the same method, same samples. SnapKV,
#: AdaKV and PyramidKV run at kvpress's defaults there (window 64) and at the papers' here.
SAME_METHOD_PAIRS = [
    (f"{PEER_PREFIX}{press}", ours)
    for press, ours in [
        ("expected_attention", "expected-attention"), ("keydiff", "keydiff"), ("knorm", "knorm"),
        ("tova", "tova"), ("observed_attention", "observed-attention"), ("streaming_llm", "streamingllm"),
        ("snapkv", "snapkv"), ("adakv_snapkv", "ada-snapkv"), ("pyramidkv", "pyramidkv"),
        ("compactor", "compactor"), ("snapkv@paper", "snapkv"), ("adakv_snapkv@paper", "ada-snapkv"),
        ("pyramidkv@paper", "pyramidkv"), ("chunkkv", "chunkkv"), ("kvgrad", "kvgrad"),
        ("leverage", "leverage"),
        # AdaKV's head split over Compactor's scores; the head floors differ (kvpress's safeguard,
        # AdaKV's n_h(1 − α) + α·B' here), so the kept positions are not the same
        ("adakv_compactor", "compactor:head_alloc=ada"),
    ]
]  # fmt: skip


#: kvbudget's compactor with other seeds of its random sketches against its default draw and
#: kvpress's Compactor: how far the draw alone moves a sketch scorer's score.
COMPACTOR_DRAW_PAIRS = [
    ("compactor:seed=1", "compactor"), ("compactor:seed=2", "compactor"),
    (f"{PEER_PREFIX}compactor", "compactor:seed=1"), (f"{PEER_PREFIX}compactor", "compactor:seed=2"),
]  # fmt: skip

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
            press_mean = "" if len(common) == len(keys) else f" (press {_pct(mean(label, common))} on these)"
            cells = f"{ours} | {_pct(mean(ours, common))}{press_mean} | {same} of {len(common)}"
        lines.append(f"| {label} | {len(keys)} | {_pct(mean(label, keys))} | {cells} |")
    return lines


def agnostic_blocks(folder: Path, aware: list[dict]) -> dict[str, list[str]]:
    """The question-agnostic track's tables (``agnostic-RATIO``: kvbudget's methods on the widest task
    set any finished, ``agnostic-kvpress``, ``agnostic-pairs``, ``agnostic-kvpress-same``,
    ``agnostic-compactor-draws``) from ``folder``'s rows, and ``tracks-0.5`` (against the
    question-aware rows ``aware``), or a line saying none ran yet."""
    ratios = (0.875, 0.75, 0.5, 0.25)
    rows = load_rows(folder / "results.jsonl") if has_results(folder) else []
    rows = [r for r in rows if r.get("error") is None]
    ours = [r for r in rows if not r["label"].startswith(PEER_PREFIX)]
    out = {f"agnostic-{ratio:g}": leaderboard_table(ours, ratio) for ratio in ratios}
    out["agnostic-kvpress"] = best_against_kvpress(rows, ratios)
    out["agnostic-pairs"] = pairs_table(rows, AGNOSTIC_PAIRS) if rows else ["(no rows yet)"]
    out["agnostic-kvpress-same"] = pairs_table(rows, SAME_METHOD_PAIRS) if rows else ["(no rows yet)"]
    out["agnostic-compactor-draws"] = pairs_table(rows, COMPACTOR_DRAW_PAIRS) if rows else ["(no rows yet)"]
    out["agnostic-screen"] = screen_table(rows)
    out["tracks-0.5"] = tracks_table(aware, rows, 0.5)
    return out


def tracks_table(aware: list[dict], agnostic: list[dict], ratio: float) -> list[str]:
    """Each kvbudget method at ``ratio`` in both tracks, on the same samples: its question-aware and
    question-agnostic means over the tasks both finished and the paired difference, best aware first."""
    column, tag = ("r", ratio), " (agnostic)"
    at_ratio = [r for r in aware if row_column(r) == column and not r["label"].startswith(PEER_PREFIX)]
    merged = at_ratio + [
        {**r, "label": r["label"] + tag} for r in agnostic
        if row_column(r) == column and not r["label"].startswith(PEER_PREFIX)
    ]  # fmt: skip
    labels = sorted({r["label"] for r in at_ratio})
    found = [(label, d) for label in labels if (d := _try(merged, label, label + tag, column, None))]
    if not found:
        return [f"(no task finished in both tracks at r={ratio:g} yet)"]
    lines = [
        "| method | question-aware | question-agnostic | aware − agnostic [95% CI] | tasks |",
        "|---|---|---|---|---|",
    ]
    for label, d in sorted(found, key=lambda item: (-item[1].a.mean, item[0])):
        mark = " ¹" if label in BEYOND_BUDGET else ""
        lines.append(f"| {label}{mark} | {_pct(d.a.mean)} | {_pct(d.b.mean)} | {_cell(d)} | {len(d.tasks)} |")
    return lines


def _complete_tasks(mine: list[dict], column: tuple[str, float]) -> dict[str, set[str]]:
    """Each label's tasks with ``MIN_SAMPLES`` scored samples at ``column`` (the full cache: any column)."""
    samples: dict[tuple[str, str], set[int]] = defaultdict(set)
    for r in mine:
        samples[(r["label"], r["task"])].add(r["sample"])
    labels = {r["label"] for r in mine if row_column(r) == column}
    tasks = {r["task"] for r in mine if row_column(r) == column}
    return {
        label: {t for t in tasks if len(samples[(label, t)]) >= MIN_SAMPLES} for label in [*labels, "full"]
    }


def leaderboard_table(rows: list[dict], ratio: float, shared: bool = False) -> list[str]:
    """Mean over tasks ×100 with its stratified interval, mean rank, then each task's mean.

    Default: the tasks the most complete labels share (the largest task set any label finished), and
    every label that finished all of them. ``shared``: every kvbudget method at ``ratio`` (methods
    added later included; kvpress's presses are in :func:`best_against_kvpress`) on the tasks all of
    them finished (a method with no finished task yet is left out). Methods at ``ratio`` left out
    (kvpress's aside) are named under the table."""
    column = ("r", ratio)
    mine = [r for r in rows if row_column(r) in (None, column) and r.get("score") is not None]
    complete = _complete_tasks(mine, column)
    if shared:  # kvpress's presses have their own block (best_against_kvpress)
        complete = {label: done for label, done in complete.items()
                    if not label.startswith(PEER_PREFIX) and (done or label == "full")}  # fmt: skip
        tasks = sorted(set.intersection(*complete.values())) if complete else []
        labels = [label for label in complete if label != "full"]
    else:
        widest = max((complete[label] & complete["full"] for label in complete if label != "full"),
                     key=len, default=set())  # fmt: skip
        tasks = sorted(widest)
        labels = [label for label in complete if label != "full" and widest <= complete[label]]
    if not tasks or not labels:
        return [f"(no task finished by every method at r={ratio:g} yet)"]
    left_out = sorted({r["label"] for r in mine if row_column(r) == column} - {*labels, *peers_of(mine)})
    keep = {*labels, "full"}
    mine = [r for r in mine if r["task"] in tasks and r["label"] in keep]
    summary = across_tasks(mine, resamples=2000)
    cell = summary.scores[column]
    order = sorted(cell, key=lambda label: -cell[label].mean)
    lines = [
        "| method | mean [95% CI] | mean rank | " + " | ".join(tasks) + " |",
        "|---|---|---|" + "---|" * len(tasks),
    ]
    for label in order:
        iv = cell[label]
        per_task = [
            statistics.mean(r["score"] for r in mine if r["task"] == t and r["label"] == label
                            and (row_column(r) == column or label in summary.reference))
            for t in tasks
        ]  # fmt: skip
        rank = summary.ranks[column].get(label)
        mark = " ¹" if label in BEYOND_BUDGET else ""
        lines.append(
            f"| {label}{mark} | {_pct(iv.mean)} [{_pct(iv.low)}, {_pct(iv.high)}] | "
            + ("–" if rank is None else f"{rank:.1f}")
            + " | "
            + " | ".join(f"{100 * v:.0f}" for v in per_task)
            + " |"
        )
    if left_out:
        lines += [
            "",
            f"Not in this table (fewer of these tasks or samples at r = {ratio:g}): "
            + ", ".join(left_out)
            + ".",
        ]
    return lines


def peers_of(rows: list[dict]) -> set[str]:
    """kvpress's labels among ``rows``."""
    return {r["label"] for r in rows if r["label"].startswith(PEER_PREFIX)}


def _mean_over_tasks(rows: list[dict], label: str, column: tuple[str, float], tasks: set[str]) -> float:
    """The mean over ``tasks`` of ``label``'s per-task mean at ``column`` (each task weighs the same)."""
    return statistics.mean(
        statistics.mean(
            r["score"] for r in rows if r["label"] == label and r["task"] == t and row_column(r) == column
        )
        for t in sorted(tasks)
    )


def _best(labels: list[str], means: dict[str, float]) -> str:
    """The label with the highest mean; ties go to the first name in sorted order, so every render
    prints the same row."""
    return min(labels, key=lambda label: (-means[label], label))


def _best_cell(best: str, labels: list[str], means: dict[str, float]) -> str:
    tied = sum(1 for label in labels if label != best and means[label] == means[best])
    return f"{best} {100 * means[best]:.1f}" + (f" (tied with {tied} more)" if tied else "")


@dataclass
class BestPair:
    """At one ratio: kvbudget's best method held to the budget (``ours``) and kvpress's best press
    (``peer``) over ``tasks``, every label's mean there, and the paired difference ours − peer."""

    ours: str
    peer: str
    our_labels: list[str]
    peer_labels: list[str]
    means: dict[str, float]
    diff: PairedDifference | None
    tasks: list[str]

    def cells(self) -> tuple[str, str]:
        ours = _best_cell(self.ours, self.our_labels, self.means)
        return ours, _best_cell(self.peer, self.peer_labels, self.means)


def held_to_budget(label: str) -> bool:
    """A kvbudget method that competes for "best held to the budget": not the full cache, not a
    kvpress press, not a method that keeps more than the budget by design."""
    return label not in ("full", *BEYOND_BUDGET) and not label.startswith(PEER_PREFIX)


def best_alone(rows: list[dict], ratio: float, peers: bool = False) -> tuple[str, int] | None:
    """kvbudget's best method held to the budget at ``ratio`` (kvpress's best press with ``peers``),
    for a ratio where the other side finished no task: its cell and the number of tasks, on the
    widest task set a method finished (every method that finished it competes); ``None`` when none
    did."""
    column = ("r", ratio)
    mine = [r for r in rows if row_column(r) in (None, column) and r.get("score") is not None]
    side = (lambda label: label.startswith(PEER_PREFIX)) if peers else held_to_budget
    complete = {label: done for label, done in _complete_tasks(mine, column).items()
                if side(label) and done}  # fmt: skip
    if not complete:
        return None
    tasks = max(complete.values(), key=lambda done: (len(done), sorted(done)))
    labels = [label for label, done in complete.items() if tasks <= done]
    means = {label: _mean_over_tasks(mine, label, column, tasks) for label in labels}
    return _best_cell(_best(labels, means), labels, means), len(tasks)


def best_pair(rows: list[dict], ratio: float) -> BestPair | None:
    """kvbudget's best against kvpress's best at ``ratio``, on the tasks both bests finished
    (``MIN_SAMPLES`` each): the largest task set a kvpress press finished, and every press that
    finished those tasks (a press screened on fewer samples or tasks is left out until it finishes
    them); ``None`` until such tasks exist."""
    column = ("r", ratio)
    mine = [r for r in rows if row_column(r) in (None, column) and r.get("score") is not None]
    complete = _complete_tasks(mine, column)
    finished = [complete[label] for label in complete if label.startswith(PEER_PREFIX) and complete[label]]
    if not finished:
        return None
    tasks = max(finished, key=lambda t: (len(t), sorted(t)))
    peers = [label for label in complete if label.startswith(PEER_PREFIX) and tasks <= complete[label]]
    ours = [label for label in complete if held_to_budget(label) and tasks <= complete[label]]
    if not tasks or not ours:
        return None
    means = {label: _mean_over_tasks(mine, label, column, tasks) for label in [*ours, *peers]}
    best_ours, best_peer = _best(ours, means), _best(peers, means)
    diff = _try(rows, best_ours, best_peer, column, sorted(tasks))
    return BestPair(best_ours, best_peer, ours, peers, means, diff, sorted(tasks))


def best_against_kvpress(rows: list[dict], ratios: tuple[float, ...]) -> list[str]:
    """At each ratio, kvbudget's best method held to the budget against kvpress's best press, on the
    tasks the most complete kvpress presses and both bests finished: their means and the paired
    difference."""
    lines = [
        "| ratio | kvbudget's best | kvpress's best | best − best [95% CI] | tasks |",
        "|---|---|---|---|---|",
    ]
    found = False
    for ratio in ratios:
        pair = best_pair(rows, ratio)
        if pair is None:
            continue
        ours, peer = pair.cells()
        lines.append(f"| {ratio:g} | {ours} | {peer} | {_cell(pair.diff)} | {len(pair.tasks)} |")
        found = True
    return lines if found else ["(no kvpress rows finished yet)"]


def update(path: Path, tables: dict[str, list[str]]) -> list[str]:
    """Replace each ``<!-- claims:NAME -->`` … ``<!-- /claims:NAME -->`` block of ``path`` with its
    table; returns the names written."""
    text = path.read_text(encoding="utf-8")
    written = []
    for name, lines in tables.items():
        pattern = re.compile(
            rf"(<!-- claims:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /claims:{re.escape(name)} -->)", re.S
        )
        body = "\n".join(lines) + "\n"
        text, n = pattern.subn(lambda m, body=body: m.group(1) + body + m.group(2), text)
        if n:
            written.append(name)
    path.write_text(text, encoding="utf-8")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--leaderboard", type=Path, default=Path("lab/results/leaderboard"))
    parser.add_argument("--baklava", type=Path, default=Path("lab/results/claims-baklava"))
    parser.add_argument("--asl-ttft", type=Path, default=Path("lab/results/claims-asl-ttft"))
    parser.add_argument("--dtype-check", type=Path, default=Path("lab/results/dtype-check"))
    parser.add_argument("--agnostic", type=Path, default=Path("lab/results/leaderboard-agnostic"))
    parser.add_argument("--ea-floor", type=Path, default=Path("lab/results/ea-kvpress"))
    parser.add_argument("--d2o-longgen", type=Path, default=Path("lab/results/claims-d2o-longgen"))
    parser.add_argument("--check", type=Path, default=Path("lab/results/check-1.5b"))
    parser.add_argument(
        "--update", type=Path, action="append", default=None,
        help="rewrite the tables of this file (repeatable: docs/claims.md, docs/leaderboard-analysis.md)",
    )  # fmt: skip
    args = parser.parse_args()
    tables = blocks(args)
    if args.update is not None:
        for path in args.update:
            print(f"{path}: " + ", ".join(update(path, tables)))
        return
    for name, lines in tables.items():
        print(f"<!-- claims:{name} -->\n" + "\n".join(lines) + f"\n<!-- /claims:{name} -->\n")


if __name__ == "__main__":
    main()
