"""Named evaluation suites (EVALUATION.md): smoke (seconds), demo (minutes), standard (hours)."""

from __future__ import annotations

from kvbudget.errors import KVBudgetError
from kvbudget.eval.runner import EvalConfig
from kvbudget.methods.registry import method_names

#: Seed methods shown in the demo as soon as they are registered (LAVa, LAQ, D2O, ASL, BaKlaVa).
SEED_METHODS = ("lava", "laq++", "d2o", "asl", "baklava")


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
    raise KVBudgetError(f"unknown suite '{name}': expected smoke, demo or standard")
