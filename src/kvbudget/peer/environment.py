"""The kvpress environment (``make peer`` → ``.venv-peer``) as this process reaches it: its Python,
the standalone runner script it executes, and a runner process serving one (sample, job) per request.
Both the evaluation's kvpress rows (:mod:`kvbudget.eval.peer_rows`) and the side-by-side benchmark
(:mod:`kvbudget.bench.peer`) use it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kvbudget.errors import KVBudgetError


def runner_script() -> Path:
    """Path of the standalone kvpress runner (executed by the peer environment's Python)."""
    return Path(__file__).with_name("kvpress_runner.py")


def peer_python_path(path: str | os.PathLike[str]) -> Path | None:
    """``path`` if it is an executable Python of a kvpress environment, else None."""
    p = Path(path)
    if p.is_file() and os.access(p, os.X_OK):
        return p
    found = shutil.which(str(path)) if not p.is_absolute() and p.parent == Path() else None
    return Path(found) if found else None


class RunnerServer:
    """A runner process serving one (sample, job) per request — kvpress's (``kvpress_runner.py
    --serve``) or ours (:mod:`kvbudget.bench.ours_runner`). Its stderr goes to ``log``; ``name``
    names it in errors."""

    def __init__(self, name: str, command: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        self._stderr = log.open("w")
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env
        )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        """The next stdout line starting with ``prefix`` (other output is skipped)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        self.close()
        tail = "\n".join(self.log.read_text().strip().splitlines()[-8:])
        raise KVBudgetError(f"the {self.name} runner stopped (exit {self.proc.returncode}):\n{tail}")

    def run(self, sample: int, job: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"sample": sample, "job": job}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("ROW "))

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._stderr.close()
