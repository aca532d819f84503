"""Human-readable quantities for tables and messages."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB (binary units), e.g. ``"1.5 MiB"``; whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
