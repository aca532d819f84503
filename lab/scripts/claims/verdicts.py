"""The ``verdicts`` block: each paper's pre-registered headline family (:data:`FAMILIES`), its
comparisons' bootstrap p-values corrected together by Holm (kvbudget.eval.paired.holm_adjust), and
the verdict of :func:`family_verdict` by docs/claims.md's rule; the 1.5B check's families too."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from kvbudget.eval.paired import PairedDifference, holm_adjust, row_column
from kvbudget.eval.suites import LEADERBOARD_CORE_TASKS

from .common import EVERY_RATIO, MIN_SAMPLES, p_text, paired_on_finished_tasks

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


def measure_comparison(sources: dict[str, list[dict]], c: Comparison) -> PairedDifference | None:
    """``c`` measured on its source's rows (``None`` until both sides finished a task)."""
    rows = sources.get(c.source, [])
    if c.a_ratio is not None:  # a's rows at another ratio, moved into b's column
        moved = [{**r, "label": c.a_label, "compression_ratio": c.column[1]} for r in rows
                 if r["label"] == c.a and row_column(r) == ("r", c.a_ratio)]  # fmt: skip
        rows = moved + [r for r in rows if r["label"] == c.b]
    found = paired_on_finished_tasks(
        rows, c.a_label, c.b, c.column, list(c.tasks) if c.tasks else None, c.min_samples
    )
    if found is not None and c.every_task and c.tasks and not set(c.tasks) <= set(found.tasks):
        return None
    return found


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
            measured_once[c] = measure_comparison(sources, c)
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
                    f"{mean} [{low}, {high}] | {len(m.tasks)} | {p_text(m.p_value)} | {p_text(h)}"
                )
            tail = f"{verdict} | {pending or '–'} |" if i == 0 else " | |"
            lines.append(head + f"{c.name}{sign} | {cells} | {tail}")
    return lines
