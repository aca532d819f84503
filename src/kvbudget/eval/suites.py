"""Named evaluation suites (docs/architecture.md, "Evaluation harness"): smoke (seconds), demo
(minutes), standard (hours), leaderboard (hours; its grid is :data:`LEADERBOARD`, the one place to
edit it; docs/leaderboard.md)."""

from __future__ import annotations

import copy
from typing import Any

from kvbudget.errors import KVBudgetError
from kvbudget.eval.runner import EvalConfig
from kvbudget.methods.registry import method_names

#: Seed methods shown in the demo as soon as they are registered (LAVa, LAQ, D2O, ASL, BaKlaVa).
SEED_METHODS = ("lava", "laq++", "d2o", "asl", "baklava")

#: The ``leaderboard`` suite's grid (``kvbudget eval --suite leaderboard``): edit it here. Chosen by
#: a pilot (docs/leaderboard.md): on qwen2.5-coder-0.5b in bf16 at 2K tokens the full cache scores
#: 80–100 on needle, RULER's NIAH family, passkey and kv_retrieval, 68 on vt, 67 on fwe and 51 on lcc
#: (edit similarity), and 0–33 on cwe, qa_1 and qa_2 (left out: nothing to retain). 4K is cut for
#: compute (each generation costs about 2.5× the 2K one; the NIAH tasks stay at ceiling there).
#: Methods: every registered one (``all`` is expanded at run time, so a method registered later is
#: added by rerunning the command). Budgets: kvpress's leaderboard compression ratios (fraction of
#: the tokens removed; 0.875 keeps 256 of 2048). Entries-per-head budgets are cut: 128 entries is
#: r ≈ 0.94 here, and at 64 entries 27 of 32 methods scored 0 in the pilot.
LEADERBOARD: dict[str, Any] = {
    "model": "qwen2.5-coder-0.5b",
    "dtype": "bfloat16",
    "tasks": [
        "needle",
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multivalue", "niah_multiquery", "vt", "fwe",
        "kv_retrieval", "passkey",
        "lcc",
    ],
    "lengths": [2048],
    "methods": ["all"],
    "budgets": [],
    "compression_ratios": [0.875, 0.75, 0.5, 0.25],
    "limit": 20,
}  # fmt: skip

#: The tasks the leaderboard runs at the ratios other than 0.875, in the question-agnostic track
#: and for kvpress's presses: the whole grid is about 4 h per ratio on a 2-core CPU, so these six
#: (needle, one single and two multikey NIAH tasks, variable tracking, code) stand for it; chosen at
#: r = 0.875 as tasks that separate methods without running wrong answers to long token caps
#: (niah_single_3 and kv_retrieval cost 45 min each there and nearly every method scores 0).
LEADERBOARD_CORE_TASKS = ["needle", "niah_single_2", "niah_multikey_1", "niah_multikey_2", "vt", "lcc"]

#: The question-aware plan ``lab/scripts/leaderboard_run.py`` runs without budget options, part after
#: part: (ratios, tasks). r = 0.875 on every task; 0.5 (the ratio of the question-agnostic track) on
#: the core tasks; 0.75 and 0.25 on the core tasks but lcc, where every attention-scored method lands
#: between 35 and 52 at r = 0.875 while a task costs about 40% of a ratio's time (docs/leaderboard.md).
LEADERBOARD_PLAN: list[tuple[list[float], list[str] | None]] = [
    ([0.875], None),  # None: every task of the suite
    ([0.5], LEADERBOARD_CORE_TASKS),
    ([0.75, 0.25], [t for t in LEADERBOARD_CORE_TASKS if t != "lcc"]),
]

SUITES = ("smoke", "demo", "standard", "leaderboard")


def suite(name: str, model: str | None = None) -> EvalConfig:
    """The :class:`EvalConfig` of a named suite."""
    registered = set(method_names())
    seeds = [m for m in SEED_METHODS if m in registered]
    if name == "smoke":
        return EvalConfig(
            model=model or "smollm2-135m", tasks=["needle_filler"], lengths=[512],
            methods=["full", "snapkv", "ada-snapkv"], budgets=[64], limit=2,
        )  # fmt: skip
    if name == "demo":  # a few minutes: where methods separate (see kvbudget.demo)
        return EvalConfig(
            model=model or "qwen2.5-coder-0.5b", tasks=["needle", "niah_multikey_2"], lengths=[2048],
            methods=["full", "snapkv", "ada-snapkv", *seeds], budgets=[128], compression_ratios=[0.875, 0.75],
            limit=3, dtype="bfloat16",
        )  # fmt: skip
    if name == "standard":
        from kvbudget.eval.tasks import task_names

        return EvalConfig(
            model=model or "qwen2.5-coder-0.5b",
            tasks=[t for t in task_names() if not t.startswith("longbench")],
            lengths=[2048, 4096], methods=method_names(), budgets=[64, 128, 256, 512],
            limit=25, dtype="bfloat16",
        )  # fmt: skip
    if name == "leaderboard":
        grid = copy.deepcopy(LEADERBOARD)
        grid["model"] = model or grid["model"]
        return EvalConfig(**grid)
    raise KVBudgetError(f"unknown suite '{name}': expected one of {', '.join(SUITES)}")
