"""docs/leaderboard.md's equal-bytes block: byte budgets against eviction alone at the same entries'
share, by the rule written before the 20-sample rows (docs/leaderboard.md, "Equal bytes").

Each comparison is ``M:memory=0.125 − M`` at r = 0.875 (bf16), paired per sample: later turns (turns
2–4) in one mode for the shared-context family, the score for the one-question families; each
task's mean difference, then the mean over tasks, with a simultaneous 95% interval (Bonferroni over
the family: each interval at ``1 − 0.05 / m``). **ahead** when the interval lies above 0, **behind**
when below, **level** otherwise. A comparison is shown once every task it covers has the same
samples on both sides (the most any task has); until then "running". Bytes: each row's
``physical_bytes`` over its sample's full bf16 cache's ``logical_bytes`` (the question's tail
included on both sides), the mean over tasks.

The ``equal-bytes-small`` block is the same rule at 6.25% of the bytes (docs/leaderboard.md, "At
6.25%", written before its 20-sample rows): ``M:memory=0.0625`` against ``M`` at r = 0.9375 and
against quantization alone at its smallest (``full:kv_bits=2``, every entry kept: about 20% of the
bytes, as 6.25% is out of its reach), Bonferroni over each family's comparisons of both kinds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvbudget.eval.intervals import bootstrap_mean_over_groups
from kvbudget.eval.store import load_rows
from kvbudget.eval.turns_report import is_conversation, later_turns

from .common import has_results

LEVEL = 0.05
SAMPLES = 20  # a task's samples in the grid (lab/scripts/byte_budget_grid.sh)
MEMORY = 0.125
RATIO = 0.875
SC_TASKS = ("sc_keys", "sc_code", "sc_vt")
CORE = ("needle", "niah_single_2", "niah_multikey_1", "niah_multikey_2", "vt", "lcc")


@dataclass(frozen=True)
class Against:
    """What a byte budget is compared with: ``label`` at ``ratio`` (``label`` ``None``: the method
    itself, evicting alone in bf16)."""

    name: str
    label: str | None
    ratio: float | None

    def matches(self, row: dict, method: str) -> bool:
        return row["label"] == (self.label or method) and row.get("compression_ratio") == self.ratio


EVICTION = Against(f"eviction r = {RATIO}", None, RATIO)


@dataclass(frozen=True)
class Family:
    """One family of the rule: its methods, tasks and modes (``None``: one-question rows), the byte
    budget's share and what it is compared with."""

    name: str
    methods: tuple[str, ...]
    tasks: tuple[str, ...]
    modes: tuple[str | None, ...]
    memory: float = MEMORY
    against: tuple[Against, ...] = (EVICTION,)

    @property
    def comparisons(self) -> int:
        return len(self.methods) * len(self.modes) * len(self.against)


SC_NAME, AGNOSTIC_NAME, AWARE_NAME = (
    "shared context, question-agnostic", "one question, question-agnostic", "one question, question-aware",
)  # fmt: skip
FAMILIES = (
    Family(SC_NAME, ("kvzip", "expected-attention", "snapkv"), SC_TASKS, ("multi-turn", "multi-request")),
    Family(AGNOSTIC_NAME, ("kvzip", "expected-attention"), CORE, (None,)),
    Family(AWARE_NAME, ("snapkv",), CORE, (None,)),
)
SMALL_MEMORY = 0.0625
SMALL_AGAINST = (
    Against("eviction r = 0.9375", None, 0.9375),
    Against("2-bit, every entry", "full:kv_bits=2", None),
)
#: the grid runs no SnapKV byte budget at 6.25% on the shared-context tasks (it keeps almost nothing
#: useful without the question at 12.5%)
SMALL_FAMILIES = (
    Family(SC_NAME, ("kvzip", "expected-attention"), SC_TASKS, ("multi-turn", "multi-request"), SMALL_MEMORY,
           SMALL_AGAINST),
    Family(AGNOSTIC_NAME, ("kvzip", "expected-attention"), CORE, (None,), SMALL_MEMORY, SMALL_AGAINST),
    Family(AWARE_NAME, ("snapkv",), CORE, (None,), SMALL_MEMORY, SMALL_AGAINST),
)  # fmt: skip


def verdict(low: float, high: float) -> str:
    """The rule's verdict for a difference's interval ``[low, high]``."""
    if low > 0:
        return "ahead"
    if high < 0:
        return "behind"
    return "level"


def _value(mode: str | None) -> Callable[[dict], float]:
    return later_turns if mode is not None else (lambda r: r["score"])


def _by_sample(rows: list[dict], wanted: Callable[[dict], bool]) -> dict[tuple[str, int], dict]:
    return {(r["task"], r["sample"]): r for r in rows if wanted(r)}


def _paired(
    rows: list[dict],
    method: str,
    mode: str | None,
    tasks: tuple[str, ...],
    memory: float = MEMORY,
    against: Against = EVICTION,
) -> tuple[dict[tuple[str, int], dict], dict[str, list[tuple[dict, dict, dict]]]]:
    """The full cache's rows by (task, sample), and per task the (byte budget, ``against``, full) rows
    of each sample all three have, in ``mode`` (``None``: one-question rows)."""
    here = [r for r in rows if r["task"] in tasks and r.get("error") is None]
    if mode is not None:
        here = [r for r in here if is_conversation(r) and r["conversation"] == mode]
    full = _by_sample(here, lambda r: r["label"] == "full")
    budget = _by_sample(here, lambda r: r["label"] == f"{method}:memory={memory:g}")
    evict = _by_sample(here, lambda r: against.matches(r, method))
    per_task: dict[str, list[tuple[dict, dict, dict]]] = defaultdict(list)
    for key in sorted(set(budget) & set(evict) & set(full)):
        per_task[key[0]].append((budget[key], evict[key], full[key]))
    return full, per_task


def progress(rows: list[dict], method: str, mode: str | None, tasks: tuple[str, ...], **which) -> str:
    """A comparison still running: per task, the samples both sides and the full cache have."""
    per_task = _paired(rows, method, mode, tasks, **which)[1]
    return ", ".join(f"{t} {len(per_task.get(t, ()))}" for t in tasks) + f" of {SAMPLES}"


def comparison(
    rows: list[dict], method: str, mode: str | None, tasks: tuple[str, ...], level: float, **which
):
    """(difference interval, byte budget's score, the other side's score, their bytes shares, tasks, n)
    for ``method`` in ``mode``, or ``None`` while a task is incomplete; ``which``: the byte budget's
    ``memory`` and what it is compared ``against`` (default: 0.125 against eviction at r = 0.875)."""
    full, per_task = _paired(rows, method, mode, tasks, **which)
    value = _value(mode)
    samples = {t: len({s for (task, s) in full if task == t}) for t in tasks}
    if not per_task or any(len(per_task.get(t, ())) < samples[t] or samples[t] == 0 for t in tasks):
        return None
    groups = [[value(b) - value(e) for b, e, _ in per_task[t]] for t in tasks]
    interval = bootstrap_mean_over_groups(groups, level=level)

    def over_tasks(pick: Callable[[tuple[dict, dict, dict]], float]) -> float:
        return sum(sum(map(pick, per_task[t])) / len(per_task[t]) for t in tasks) / len(tasks)

    return (
        interval,
        over_tasks(lambda p: value(p[0])),
        over_tasks(lambda p: value(p[1])),
        over_tasks(lambda p: p[0]["physical_bytes"] / p[2]["logical_bytes"]),
        over_tasks(lambda p: p[1]["physical_bytes"] / p[2]["logical_bytes"]),
        len(tasks),
        min(samples.values()),
    )


def equal_bytes_table(
    sc_rows: list[dict],
    aware_rows: list[dict],
    agnostic_rows: list[dict],
    families: tuple[Family, ...] = FAMILIES,
) -> list[str]:
    """The block's lines: one row per comparison of each family, its verdict by the rule."""
    sources = {SC_NAME: sc_rows, AGNOSTIC_NAME: agnostic_rows, AWARE_NAME: aware_rows}
    several = any(len(f.against) > 1 for f in families)
    against = "against: score, bytes %" if several else "eviction r = 0.875: score, bytes %"
    column = " against |" if several else ""
    lines = [
        f"| family | method | mode |{column} byte budget: score, bytes % | {against} "
        f"| budget − {'against' if several else 'eviction'} [simultaneous 95% CI] | verdict | tasks × n |",
        "|---|---|---|" + ("---|" if several else "") + "---|---|---|---|---|",
    ]
    for family in families:
        for method in family.methods:
            for mode in family.modes:
                for other in family.against:
                    which = {"memory": family.memory, "against": other}
                    rows = sources[family.name]
                    found = comparison(
                        rows, method, mode, family.tasks, 1 - LEVEL / family.comparisons, **which
                    )
                    where = f"{mode or 'one question'} |" + (f" {other.name} |" if several else "")
                    if found is None:
                        done = progress(rows, method, mode, family.tasks, **which)
                        lines.append(f"| {family.name} | {method} | {where} running ({done}) | | | | |")
                        continue
                    d, a, b, a_bytes, b_bytes, n_tasks, n = found
                    lines.append(
                        f"| {family.name} | {method} | {where} {100 * a:.1f}, {100 * a_bytes:.1f}% "
                        f"| {100 * b:.1f}, {100 * b_bytes:.1f}% "
                        f"| {100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}] "
                        f"| {verdict(d.low, d.high)} | {n_tasks} × {n} |"
                    )
    return lines


def equal_bytes_blocks(sc: Path, aware: Path, agnostic: Path) -> dict[str, list[str]]:
    """The ``equal-bytes`` and ``equal-bytes-small`` blocks from their three folders."""

    def rows(folder: Path) -> list[dict]:
        return load_rows(folder / "results.jsonl") if has_results(folder) else []

    found = rows(sc), rows(aware), rows(agnostic)
    return {
        "equal-bytes": equal_bytes_table(*found),
        "equal-bytes-small": equal_bytes_table(*found, families=SMALL_FAMILIES),
    }
