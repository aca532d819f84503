"""The ``<!-- claims:NAME -->`` blocks of a Markdown file, rewritten in place."""

from __future__ import annotations

import re
from pathlib import Path


def update(path: Path, tables: dict[str, list[str]]) -> list[str]:
    """Replace each ``<!-- claims:NAME -->`` … ``<!-- /claims:NAME -->`` block of ``path`` with its
    table; returns the names written."""
    text = path.read_text(encoding="utf-8")
    written = []
    for name, lines in tables.items():
        pattern = re.compile(
            rf"(<!-- claims:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /claims:{re.escape(name)} -->)", re.S
        )
        body = "\n".join(lines) + "\n"
        text, n = pattern.subn(lambda m, body=body: m.group(1) + body + m.group(2), text)
        if n:
            written.append(name)
    path.write_text(text, encoding="utf-8")
    return written
