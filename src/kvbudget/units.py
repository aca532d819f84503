"""Human-readable quantities for tables and messages."""

from __future__ import annotations

import re


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB (binary units), e.g. ``"1.5 MiB"``; whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


#: multipliers of the size suffixes :func:`parse_bytes` takes (binary and decimal)
_SIZE_UNITS = {
    "": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "k": 1024, "m": 1024**2, "g": 1024**3,
}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``"1000000"`` as bytes; :class:`InputError` (one line)
    for anything else or a size ≤ 0."""
    from kvbudget.errors import InputError

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise InputError(
            f"a memory size is a number with an optional unit (B, KiB, MiB, GiB, KB, MB, GB), got {text!r}"
        )
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise InputError(f"a memory size must be positive, got {text!r}")
    return size
