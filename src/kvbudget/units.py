"""Human-readable quantities for tables and messages."""

from __future__ import annotations

import re

from kvbudget.errors import KVBudgetError


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB (binary units), e.g. ``"1.5 MiB"``; whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "tb": 1000**4}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, option: str = "--memory-cap") -> int:
    """``"2GiB"`` → ``2147483648``; ``"500MB"`` → ``500000000``; a bare number is bytes. ``option``
    names the size in the error.

    Raises :class:`KVBudgetError` for anything else, or a size that is not positive.
    """
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise KVBudgetError(
            f"{option} expects a size such as 2GiB, 512MiB or 1500000000 (bytes), got {text!r}"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise KVBudgetError(f"{option} must be positive, got {text!r}")
    return size
