"""The values of list options, which may be repeated or comma-separated (``--budgets 64,128``,
``--methods snapkv --methods tova``), as lists of strings, integers or numbers."""

from __future__ import annotations

from kvbudget.errors import KVBudgetError


def split_values(values: list[str] | None) -> list[str]:
    """``["a,b", "c"]`` → ``["a", "b", "c"]`` (options may be repeated or comma-separated).

    Method specs keep their own options: ``snapkv:window=64,kernel=5`` stays one item.
    """
    items: list[str] = []
    for value in values or []:
        for part in value.split(","):
            if "=" in part and ":" not in part and items:
                items[-1] += "," + part  # an option of the previous method spec
            elif part.strip():
                items.append(part.strip())
    return items


def int_values(values: list[str] | None, what: str) -> list[int] | None:
    """The integers of option ``--what`` (``None`` when none were given)."""
    try:
        return [int(v) for v in split_values(values)] or None
    except ValueError:
        raise KVBudgetError(f"--{what} expects integers, got {values}") from None


def float_values(values: list[str] | None, what: str) -> list[float] | None:
    """The numbers of option ``--what`` (``None`` when none were given)."""
    try:
        return [float(v) for v in split_values(values)] or None
    except ValueError:
        raise KVBudgetError(f"--{what} expects numbers, got {values}") from None
