"""Task registry: every task module's ``TASKS`` merged; :func:`get_task` and :func:`task_names`."""

from __future__ import annotations

import importlib

from kvbudget.errors import KVBudgetError
from kvbudget.eval.tasks.base import TaskSpec

_MODULES = ("needle", "perplexity", "ruler", "infinitebench", "code", "gsm8k", "shared_context")


def all_tasks() -> dict[str, TaskSpec]:
    tasks: dict[str, TaskSpec] = {}
    for module in _MODULES:
        tasks.update(importlib.import_module(f"kvbudget.eval.tasks.{module}").TASKS)
    return tasks


def task_names() -> list[str]:
    return list(all_tasks())


def get_task(name: str) -> TaskSpec:
    tasks = all_tasks()
    if name not in tasks:
        raise KVBudgetError(f"unknown task '{name}': expected one of {', '.join(tasks)}")
    return tasks[name]
