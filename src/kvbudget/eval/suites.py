"""Named evaluation suites (EVALUATION.md): smoke (seconds), demo (minutes), standard (hours),
leaderboard (hours; issue #20 — its grid is :data:`LEADERBOARD`, the one place to edit it)."""

from __future__ import annotations

import copy
from typing import Any

from kvbudget.errors import KVBudgetError
from kvbudget.eval.runner import EvalConfig
from kvbudget.methods.registry import method_names

#: Seed methods shown in the demo as soon as they are registered (LAVa, LAQ, D2O, ASL, BaKlaVa).
SEED_METHODS = ("lava", "laq++", "d2o", "asl", "baklava")

#: The ``leaderboard`` suite's grid (``kvbudget eval --suite leaderboard``): edit it here. Tasks
#: where the full cache scores well on the 0.5B model in bf16 — needle, RULER's NIAH family, vt,
#: cwe/fwe, qa_1/qa_2, InfiniteBench kv_retrieval/passkey, LongBench-style code completion (lcc) —
#: at 2K and 4K tokens; every registered method (``all`` is expanded at run time, so a method
#: registered later is added by rerunning the command); budgets as entries per KV head and as
#: kvpress's leaderboard compression ratios (fraction of the tokens removed). The grid is sized by a
#: pilot (docs/leaderboard.md says what was cut and why).
LEADERBOARD: dict[str, Any] = {
    "model": "qwen2.5-coder-0.5b",
    "dtype": "bfloat16",
    "tasks": [
        "needle",
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multivalue", "niah_multiquery",
        "vt", "cwe", "fwe", "qa_1", "qa_2",
        "kv_retrieval", "passkey",
        "lcc",
    ],
    "lengths": [2048, 4096],
    "methods": ["all"],
    "budgets": [64, 128, 256],
    "compression_ratios": [0.25, 0.5, 0.75, 0.875],
    "limit": 20,
}  # fmt: skip

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
    if name == "demo":
        return EvalConfig(
            model=model or "smollm2-135m", tasks=["needle", "niah_single_2"], lengths=[1024, 2048],
            methods=["full", "snapkv", "ada-snapkv", *seeds], budgets=[64, 128], limit=2, max_new_tokens=16,
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
