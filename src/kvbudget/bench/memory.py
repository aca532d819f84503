"""Process memory: peak resident set size with a resettable high-water mark (Linux).

``ru_maxrss`` only grows over a process's life, so it says nothing about a run that follows a
bigger one (or the model load). On Linux, writing ``5`` to ``/proc/self/clear_refs`` resets the
high-water mark ``VmHWM`` to the current RSS; :func:`reset_peak` does that and
:func:`peak_rss_bytes` reads it back. Where that is impossible the functions fall back to
``ru_maxrss`` and say so (``PeakMeter.resettable``).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_bytes() -> int | None:
    """Resident set size now (``VmRSS``), or None off Linux."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def ru_maxrss_bytes() -> int:
    """``getrusage`` peak RSS of this process (kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak() -> bool:
    """Reset the peak-RSS high-water mark to the current RSS; False when the OS does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def peak_rss_bytes() -> int:
    """Peak RSS since the last :func:`reset_peak` (``VmHWM``), else the process's ``ru_maxrss``."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else ru_maxrss_bytes()
