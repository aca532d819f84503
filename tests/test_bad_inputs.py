"""Bad input to every command ends in one line and exit code 2, before any model or data set loads.

Each case runs the real CLI (``kvbudget.cli.app``) with the model loaders, artifact fetchers, data
readers and benchmark workers replaced by stubs that record the call and fail: a case passes only
when the command stopped before any of them. Every case also checks that an existing results folder
and the working directory are left byte for byte as they were (no folder created, nothing
truncated or appended).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbudget.cli import app

ROWS = [
    {"key": "k1", "model": "m", "task": "needle", "label": "full", "score": 1.0},
    {"key": "k2", "model": "m", "task": "needle", "label": "snapkv", "score": 0.0},
]
RESULTS_TEXT = "".join(json.dumps(r) + "\n" for r in ROWS)
TORN = '{"key": "k3", "model": "m", "task": "nee'  # a row cut by a kill mid-write (no newline)
PDF = (
    b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nstream\n\x78\x9c\xff\xfe\x00\x01endstream\n"
)
RANDOM = bytes(range(256)) * 4
DATA_READERS = ("essay_text", "ruler_essays", "squad", "hotpotqa", "words", "austen_novels", "gsm8k")


class Loaded(Exception):
    """Raised by the stubs: something heavy was started."""


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Paths the cases refer to as ``{name}``, the stubs' call log and the folders to keep intact."""
    calls: list[str] = []

    def stub(name: str):
        def fail(*args, **kwargs):
            calls.append(name)
            raise Loaded(name)

        return fail

    import transformers

    import kvbudget
    import kvbudget.bench.bandwidth
    import kvbudget.bench.grid
    import kvbudget.data
    import kvbudget.demo
    import kvbudget.models

    for module, attr in [
        (kvbudget.models, "load_model"), (kvbudget.models, "fetch_model"), (kvbudget.demo, "load_model"),
        (kvbudget.demo, "fetch_model"), (kvbudget.demo, "fetch_data"), (kvbudget.data, "fetch_data"),
        (kvbudget.bench.grid, "run_worker"), (kvbudget.bench.bandwidth, "measure_bandwidth"),
        *[(kvbudget.data, reader) for reader in DATA_READERS],
    ]:  # fmt: skip
        monkeypatch.setattr(module, attr, stub(f"{module.__name__}.{attr}"))
    monkeypatch.setattr(kvbudget, "load_model", stub("kvbudget.load_model"), raising=False)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", stub(f"{auto.__name__}.from_pretrained"))

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("KVBUDGET_HOME", str(home))  # no model or data fetched: any other read fails too
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # default output folders (runs/eval, demo-out, ...) would land here

    def folder(name: str, files: dict[str, bytes | str]) -> Path:
        path = tmp_path / name
        path.mkdir()
        for rel, content in files.items():
            target = path / rel
            if isinstance(content, str):
                target.write_text(content, encoding="utf-8")
            else:
                target.write_bytes(content)
        return path

    results = folder("results", {"results.jsonl": RESULTS_TEXT, "config.json": "{}", "report.md": "# old\n"})
    model = folder("model", {"config.json": json.dumps({"model_type": "llama"})})
    gpt2 = folder("gpt2", {"config.json": json.dumps({"model_type": "gpt2"})})
    files = {
        "text": "A context about foxes.\n",
        "bin": RANDOM,
        "pdf": PDF,
        "empty": b"",
        "blank": " \n\t\n",
        "profile": "{not json",
        "foreign.jsonl": '{"role": "user", "content": "hi"}\n',
    }
    paths = {}
    for name, content in files.items():
        path = tmp_path / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        paths[name] = path
    python = tmp_path / "peer-python"  # stands for a kvpress environment's Python (never run)
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    paths["python"] = python
    torn = folder("torn", {"results.jsonl": TORN})
    foreign = folder("foreign", {"results.jsonl": '{"role": "user", "content": "hi"}\n{"role": "bot"}\n'})
    binary = folder("binary", {"results.jsonl": RANDOM})
    corrupt = folder(
        "corrupt", {"results.jsonl": json.dumps(ROWS[0]) + "\n{oops\n" + json.dumps(ROWS[1]) + "\n"}
    )
    nested = folder("nested", {})
    (nested / "results.jsonl").mkdir()
    empty_results = folder("empty_results", {"results.jsonl": ""})
    gz_foreign = folder("gz_foreign", {"results.jsonl.gz": gzip.compress(b'["not", "a", "row"]\n')})
    names = {
        "results": results, "model": model, "gpt2": gpt2, "torn": torn, "foreign": foreign, "binary": binary,
        "corrupt": corrupt, "nested": nested, "empty_results": empty_results, "gz_foreign": gz_foreign,
        "missing": tmp_path / "missing", "tmp": tmp_path, **paths,
    }  # fmt: skip
    keep = [results, torn, foreign, binary, corrupt, nested, empty_results, gz_foreign, cwd, home, model]
    return {"names": {k: str(v) for k, v in names.items()}, "calls": calls, "keep": keep}


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (``None``) under ``root``."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


M = ["--model", "{model}"]  # a local model folder that passes validation (loading it is stubbed)
P = ["--prompts", "builtin-text"]  # a profile prompt that needs no data
PEER = ["bench", "peer", "--model", "{model}", "--peer-python", "{python}"]
GEN = ["generate", "--context-file", "{text}", *M]
EVAL = ["eval", "--out", "{results}", *M, "--tasks", "needle", "--methods", "snapkv", "--budgets", "64"]
PROC = "/proc/kvbudget-no-such/out"

# (id, argv, words that must all be on the one error line)
CASES: list[tuple[str, list[str], list[str]]] = [
    # ---- generate: the context file
    ("gen-binary-file", ["generate", "--context-file", "{bin}", *M], ["{bin}", "not UTF-8 text"]),
    ("gen-pdf-file", ["generate", "--context-file", "{pdf}", *M], ["{pdf}", "PDF", "plain text"]),
    ("gen-empty-file", ["generate", "--context-file", "{empty}", *M], ["{empty}", "is empty"]),
    ("gen-whitespace-file", ["generate", "--context-file", "{blank}", *M], ["{blank}", "is empty"]),
    ("gen-missing-file", ["generate", "--context-file", "{missing}", *M], ["{missing}", "not found"]),
    ("gen-folder-as-file", ["generate", "--context-file", "{results}", *M], ["{results}", "is a folder"]),
    ("gen-no-context-file", ["generate", *M], ["Missing option", "--context-file"]),
    # ---- generate: numbers and names
    ("gen-budget-not-int", [*GEN, "--budget", "abc"], ["--budget", "'abc'"]),
    ("gen-budget-zero", [*GEN, "--budget", "0"], ["--budget", "positive", "0"]),
    ("gen-ratio-above-1", [*GEN, "--ratio", "1.5"], ["--ratio", "(0, 1]", "1.5"]),
    ("gen-ratio-zero", [*GEN, "--ratio", "0"], ["--ratio", "(0, 1]"]),
    ("gen-ratio-not-number", [*GEN, "--ratio", "half"], ["--ratio", "'half'"]),
    ("gen-budget-and-ratio", [*GEN, "--budget", "64", "--ratio", "0.5"], ["either --budget or --ratio"]),
    ("gen-max-new-tokens-zero", [*GEN, "--max-new-tokens", "0"], ["--max-new-tokens", "≥ 1", "0"]),
    ("gen-unknown-method", [*GEN, "--method", "snapkvv"], ["unknown method 'snapkvv'"]),
    ("gen-opt-no-equals", [*GEN, "--opt", "window"], ["--opt expects key=value"]),
    ("gen-opt-bad-value", [*GEN, "--opt", "window=-1"], ["window must be an integer ≥ 0"]),
    ("gen-opt-unknown", [*GEN, "--opt", "colour=red"], ["unknown option(s) colour"]),
    ("gen-dtype", [*GEN, "--dtype", "float64"], ["float64", "float32"]),
    ("gen-unknown-model", ["generate", "--context-file", "{text}", "--model", "llama-7b"], ["'llama-7b'"]),
    ("gen-model-not-fetched", ["generate", "--context-file", "{text}"], ["smollm2-135m", "not fetched"]),
    ("gen-model-unsupported", ["generate", "--context-file", "{text}", "--model", "{gpt2}"], ["gpt2"]),
    ("gen-misspelt-option", [*GEN, "--budgte", "64"], ["--budgte"]),
    # ---- eval: the output folder and its results file
    ("eval-out-under-proc", ["eval", "--out", PROC, *M], [PROC, "cannot"]),
    ("eval-out-is-a-file", ["eval", "--out", "{text}", *M], ["{text}", "not a folder"]),
    ("eval-out-under-a-file", ["eval", "--out", "{text}/run", *M], ["{text}", "is a file"]),
    ("eval-results-foreign", ["eval", "--out", "{foreign}", *M], ["{foreign}", "line 1", "not a kvbudget"]),
    ("eval-results-binary", ["eval", "--out", "{binary}", *M], ["{binary}", "not UTF-8"]),
    ("eval-results-corrupt", ["eval", "--out", "{corrupt}", *M], ["{corrupt}", "line 2", "not JSON"]),
    ("eval-results-folder", ["eval", "--out", "{nested}", *M], ["results.jsonl", "is a folder"]),
    ("eval-results-gz-foreign", ["eval", "--out", "{gz_foreign}", *M], ["results.jsonl.gz", "line 1"]),
    # ---- eval: names and numbers
    ("eval-unknown-suite", [*EVAL, "--suite", "quick"], ["unknown suite 'quick'", "smoke"]),
    ("eval-unknown-task", [*EVAL, "--tasks", "needel"], ["unknown task 'needel'"]),
    ("eval-unknown-method", [*EVAL, "--methods", "snapkv,fastgen"], ["unknown method 'fastgen'"]),
    ("eval-method-bad-option", [*EVAL, "--methods", "snapkv:window=abc"], ["window", "'abc'"]),
    ("eval-budgets-not-int", [*EVAL, "--budgets", "64,lots"], ["--budgets", "lots"]),
    ("eval-budgets-zero", [*EVAL, "--budgets", "0"], ["budgets", "positive", "0"]),
    ("eval-ratio-one", [*EVAL, "--compression-ratios", "1.0"], ["compression ratio", "[0, 1)", "1.0"]),
    ("eval-ratio-not-number", [*EVAL, "--compression-ratios", "x"], ["--compression-ratios", "x"]),
    ("eval-lengths-zero", [*EVAL, "--lengths", "0"], ["--lengths", "positive", "0"]),
    ("eval-limit-zero", [*EVAL, "--limit", "0"], ["--limit", "≥ 1", "0"]),
    ("eval-limit-not-int", [*EVAL, "--limit", "five"], ["--limit", "'five'"]),
    ("eval-max-new-tokens-zero", [*EVAL, "--max-new-tokens", "0"], ["--max-new-tokens", "≥ 1"]),
    ("eval-dtype", [*EVAL, "--dtype", "fp64"], ["fp64", "float32"]),
    ("eval-unknown-model", ["eval", "--out", "{results}", "--model", "gpt-5"], ["unknown model 'gpt-5'"]),
    ("eval-model-not-fetched", ["eval", "--out", "{results}", "--tasks", "needle"], ["not fetched"]),
    ("eval-unknown-press", [*EVAL, "--peer-presses", "snapk"], ["unknown kvpress press 'snapk'"]),
    (
        "eval-no-peer-python",
        [*EVAL, "--compression-ratios", "0.5", "--peer-presses", "snapkv", "--peer-python", "{missing}"],
        ["no kvpress environment", "{missing}"],
    ),  # fmt: skip
    # ---- report
    ("report-missing-folder", ["report", "{missing}"], ["{missing}", "does not exist"]),
    ("report-file-not-folder", ["report", "{text}"], ["{text}", "not a folder"]),
    ("report-torn-only-line", ["report", "{torn}"], ["{torn}", "line 1", "torn"]),
    ("report-foreign", ["report", "{foreign}"], ["{foreign}", "line 1", "not a kvbudget"]),
    ("report-binary", ["report", "{binary}"], ["{binary}", "not UTF-8"]),
    ("report-corrupt", ["report", "{corrupt}"], ["line 2", "not JSON"]),
    ("report-results-folder", ["report", "{nested}"], ["results.jsonl", "is a folder"]),
    ("report-empty-results", ["report", "{empty_results}"], ["no results", "kvbudget eval"]),
    ("report-resamples-zero", ["report", "{results}", "--resamples", "0"], ["--resamples", "0"]),
    ("report-resamples-not-int", ["report", "{results}", "--resamples", "many"], ["--resamples", "'many'"]),
    ("pack-missing-folder", ["pack", "{missing}"], ["{missing}", "does not exist"]),
    ("pack-file-not-folder", ["pack", "{text}"], ["{text}", "not a folder"]),
    ("pack-torn-only-line", ["pack", "{torn}"], ["no rows", "kvbudget eval"]),
    ("pack-foreign", ["pack", "{foreign}"], ["{foreign}", "line 1", "not a kvbudget"]),
    ("pack-empty-results", ["pack", "{empty_results}"], ["no rows", "kvbudget eval"]),
    ("pack-gz-foreign", ["pack", "{gz_foreign}"], ["results.jsonl.gz", "line 1", "not a kvbudget"]),
    # ---- profile
    ("profile-missing-prompt", ["profile", *M, "--prompts", "{missing}"], ["{missing}", "not a file"]),
    ("profile-binary-prompt", ["profile", *M, "--prompts", "{bin}"], ["{bin}", "not UTF-8 text"]),
    ("profile-empty-prompt", ["profile", *M, "--prompts", "{empty}"], ["{empty}", "is empty"]),
    ("profile-prompt-tokens", ["profile", *M, "--prompts", "builtin-text:1"], ["at least 2 tokens"]),
    ("profile-no-stdlib-file", ["profile", *M, "--prompts", "stdlib/nope.py"], ["stdlib/nope.py"]),
    ("profile-out-under-proc", ["profile", *M, *P, "--out", PROC + ".json"], [PROC, "cannot"]),
    ("profile-out-is-folder", ["profile", *M, *P, "--out", "{results}"], ["{results}", "is a folder"]),
    ("profile-dtype", ["profile", *M, *P, "--dtype", "half-ish"], ["half-ish", "float32"]),
    ("profile-unknown-model", ["profile", *P, "--model", "nope"], ["unknown model 'nope'"]),
    # ---- tune
    ("tune-no-ratio", ["tune", *M], ["Missing option", "--ratio"]),
    ("tune-ratio-above-1", ["tune", *M, "--ratio", "1.5"], ["--ratio", "(0, 1)", "1.5"]),
    ("tune-ratio-not-number", ["tune", *M, "--ratio", "a"], ["--ratio", "'a'"]),
    ("tune-untunable", ["tune", *M, "--ratio", "0.5", "--method", "snapkv"], ["cannot tune 'snapkv'"]),
    (
        "tune-missing-profile",
        ["tune", *M, "--ratio", "0.5", "--profile", "{missing}"],
        ["{missing}", "not found"],
    ),  # fmt: skip
    ("tune-binary-profile", ["tune", *M, "--ratio", "0.5", "--profile", "{bin}"], ["{bin}", "not UTF-8"]),
    ("tune-not-json-profile", ["tune", *M, "--ratio", "0.5", "--profile", "{profile}"], ["not valid JSON"]),
    ("tune-length-zero", ["tune", *M, "--ratio", "0.5", "--length", "0"], ["--length", "≥ 1"]),
    ("tune-passages-zero", ["tune", *M, "--ratio", "0.5", "--passages", "0"], ["--passages", "≥ 1"]),
    ("tune-chunk-zero", ["tune", *M, "--ratio", "0.5", "--chunk", "0"], ["--chunk", "≥ 1"]),
    ("tune-t-not-number", ["tune", *M, "--ratio", "0.5", "--t", "low"], ["--t", "low"]),
    ("tune-r-above-1", ["tune", *M, "--ratio", "0.5", "--r", "1.5"], ["--r", "[0, 1]", "1.5"]),
    ("tune-dtype", ["tune", *M, "--ratio", "0.5", "--dtype", "f32"], ["f32", "float32"]),
    # ---- fetch
    ("fetch-unknown-kind", ["fetch", "weights"], ["unknown artifact kind 'weights'"]),
    ("fetch-unknown-model", ["fetch", "model", "llama-70b"], ["unknown model 'llama-70b'"]),
    ("fetch-unknown-data", ["fetch", "data", "wikipedia"], ["unknown data artifact 'wikipedia'"]),
    # ---- bench
    ("bench-unknown-method", ["bench", *M, "--methods", "snapkv,nope"], ["unknown method 'nope'"]),
    ("bench-budgets-not-int", ["bench", *M, "--budgets", "big"], ["--budgets", "big"]),
    ("bench-repeats-zero", ["bench", *M, "--repeats", "0"], ["repeats", "≥ 1"]),
    ("bench-lengths-zero", ["bench", *M, "--lengths", "0"], ["lengths", "positive"]),
    ("bench-new-tokens-one", ["bench", *M, "--new-tokens", "1"], ["new_tokens", "≥ 2"]),
    ("bench-threads-zero", ["bench", *M, "--threads", "0"], ["--threads", "≥ 1"]),
    ("bench-dtype", ["bench", *M, "--dtype", "int8"], ["int8", "float32"]),
    ("bench-unknown-model", ["bench", "--model", "nope"], ["unknown model 'nope'"]),
    ("bench-out-under-proc", ["bench", *M, "--out", PROC], [PROC, "cannot"]),
    ("bench-out-is-a-file", ["bench", *M, "--out", "{text}"], ["{text}", "not a folder"]),
    ("peer-unknown-method", [*PEER, "--methods", "h2o2"], ["h2o2"]),
    ("peer-unknown-task", [*PEER, "--tasks", "needel"], ["unknown task 'needel'"]),
    ("peer-lengths-zero", [*PEER, "--lengths", "0"], ["lengths", "positive"]),
    ("peer-limit-zero", [*PEER, "--limit", "0"], ["limit", "≥ 1"]),
    ("peer-no-python", ["bench", "peer", *M, "--peer-python", "{missing}"], ["no kvpress environment"]),
    ("peer-out-under-proc", [*PEER, "--out", PROC], [PROC, "cannot"]),
    ("peer-dtype", [*PEER, "--dtype", "x"], ["'x'", "float32"]),
    ("tp-memory-cap", ["bench", "throughput", *M, "--memory-cap", "lots"], ["--memory-cap", "'lots'"]),
    ("tp-cap-on", ["bench", "throughput", *M, "--cap-on", "both"], ["--cap-on", "'both'"]),
    ("tp-unknown-model", ["bench", "throughput", "--model", "nope"], ["unknown model 'nope'"]),
    ("tp-model-not-fetched", ["bench", "throughput"], ["qwen2.5-coder-0.5b", "not fetched"]),
    ("tp-out-under-proc", ["bench", "throughput", *M, "--out", PROC], [PROC, "cannot"]),
    # ---- serve
    ("serve-memory-cap", ["serve", *M, "--memory-cap", "plenty"], ["--memory-cap", "'plenty'"]),
    ("serve-memory-cap-zero", ["serve", *M, "--memory-cap", "0"], ["--memory-cap", "positive"]),
    ("serve-unknown-method", ["serve", *M, "--method", "nope"], ["unknown method 'nope'"]),
    ("serve-budget-zero", ["serve", *M, "--budget", "0"], ["--budget", "positive"]),
    (
        "serve-kv-bits-twice",
        ["serve", *M, "--method", "snapkv:kv_bits=4", "--kv-bits", "8"],
        ["kv_bits is given twice", "--method snapkv:kv_bits=4"],
    ),
    (
        "serve-memory-and-ratio",
        ["serve", *M, "--method", "snapkv:memory=0.125", "--ratio", "0.5"],
        ["memory", "ratio"],
    ),
    ("serve-ratio-above-1", ["serve", *M, "--ratio", "1.5"], ["--ratio", "(0, 1]"]),
    # the default method (the full cache at 4 bits) keeps every entry: a size would be ignored
    ("serve-ratio-without-method", ["serve", *M, "--ratio", "0.5"], ["--ratio needs a method that evicts"]),
    ("serve-memory-without-method", ["serve", *M, "--memory", "0.125"], ["--memory needs", "--method snap"]),
    ("serve-full-with-budget", ["serve", *M, "--method", "full", "--budget", "64"], ["--budget needs"]),
    ("serve-port", ["serve", *M, "--port", "70000"], ["--port", "70000"]),
    ("serve-queue-zero", ["serve", *M, "--max-queue", "0"], ["--max-queue", "≥ 1"]),
    ("serve-unknown-model", ["serve", "--model", "nope"], ["unknown model 'nope'"]),
    ("serve-dtype", ["serve", *M, "--dtype", "int4"], ["int4", "float32"]),
    ("bench-serve-clients-zero", ["bench", "serve", *M, "--clients", "0"], ["--clients", "≥ 1"]),
    ("bench-serve-cap", ["bench", "serve", *M, "--memory-cap", "big"], ["--memory-cap", "'big'"]),
    ("bench-serve-out-under-proc", ["bench", "serve", *M, "--out", PROC], [PROC, "cannot"]),
    # ---- demo
    ("demo-unknown-model", ["demo", "--model", "qwen-9000"], ["unknown model 'qwen-9000'"]),
    ("demo-dtype", ["demo", *M, "--dtype", "float8"], ["float8", "float32"]),
    ("demo-length-zero", ["demo", *M, "--length", "0"], ["--length", "≥"]),
    ("demo-out-under-proc", ["demo", *M, "--out", PROC], [PROC, "cannot"]),
    ("demo-out-is-a-file", ["demo", *M, "--out", "{text}"], ["{text}", "not a folder"]),
    # ---- methods and the command itself
    ("methods-extra-argument", ["methods", "snapkv"], ["unexpected extra argument", "snapkv"]),
    ("unknown-command", ["evaluate"], ["No such command 'evaluate'"]),
]


@pytest.mark.parametrize(("argv", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2_before_any_load(argv: list[str], words: list[str], world: dict):
    names = world["names"]
    argv = [a.format(**names) for a in argv]
    words = [w.format(**names) for w in words]
    before = {str(folder): snapshot(folder) for folder in world["keep"]}
    result = CliRunner().invoke(app, argv)
    output = result.output
    assert not world["calls"], f"loaded before validating: {world['calls']}\n{output}"
    assert "Traceback" not in output and not isinstance(result.exception, Exception), (
        f"{result.exception!r}\n{output}"
    )
    assert result.exit_code == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    for folder in world["keep"]:
        assert snapshot(folder) == before[str(folder)], f"{folder} changed"


def test_the_matrix_is_large_and_covers_every_command():
    commands = {c[1][0] if c[1][0] != "bench" or c[1][1] != "peer" else "bench peer" for c in CASES}
    assert {
        "generate",
        "eval",
        "report",
        "pack",
        "profile",
        "tune",
        "fetch",
        "bench",
        "bench peer",
        "demo",
    } <= commands
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


def test_eval_over_a_torn_last_line_keeps_every_complete_row_and_says_it_dropped_the_torn_one(
    world, monkeypatch
):
    import kvbudget.eval.runner
    from kvbudget.eval.store import ResultStore

    out = Path(world["names"]["tmp"]) / "resume"
    out.mkdir()
    (out / "results.jsonl").write_text(RESULTS_TEXT + TORN, encoding="utf-8")
    seen = {}

    def fake_run_eval(config, path, **kwargs):  # what the runner does first: open the store
        store = ResultStore(Path(path) / "results.jsonl")
        seen.update(keys=[r["key"] for r in store.rows], dropped=store.dropped)
        return Path(path) / "results.jsonl"

    monkeypatch.setattr(kvbudget.eval.runner, "run_eval", fake_run_eval)
    result = CliRunner().invoke(
        app, ["eval", "--out", str(out), *[a.format(**world["names"]) for a in EVAL[3:]], "--no-report"]
    )
    assert result.exit_code == 0, result.output
    assert "line 3 is torn" in result.output and "dropped" in result.output
    assert seen["keys"] == ["k1", "k2"] and "line 3 is torn" in seen["dropped"]
    assert (out / "results.jsonl").read_text(encoding="utf-8") == RESULTS_TEXT  # complete rows, byte for byte


def test_a_complete_last_row_without_its_newline_is_kept(tmp_path):
    from kvbudget.eval.store import ResultStore

    row = {"key": "k3", "model": "m", "task": "needle", "label": "tova", "score": 0.5}
    path = tmp_path / "results.jsonl"
    path.write_text(RESULTS_TEXT + json.dumps(row), encoding="utf-8")
    store = ResultStore(path)
    assert [r["key"] for r in store.rows] == ["k1", "k2", "k3"] and store.dropped == ""
    assert path.read_text(encoding="utf-8") == RESULTS_TEXT + json.dumps(row) + "\n"


def test_load_rows_skips_a_torn_line_and_writes_nothing(tmp_path):
    from kvbudget.eval.store import load_rows

    path = tmp_path / "results.jsonl"
    path.write_text(RESULTS_TEXT + TORN, encoding="utf-8")
    assert load_rows(path) == ROWS
    assert path.read_text(encoding="utf-8") == RESULTS_TEXT + TORN


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('{"role": "user"}\n', "line 1 is not a kvbudget results row"),
        (RESULTS_TEXT + "[1, 2]\n", "line 3 is not a kvbudget results row"),
        (RESULTS_TEXT + "oops\n" + RESULTS_TEXT, "line 3 is not JSON"),
    ],
)
def test_the_store_refuses_a_foreign_or_damaged_file_and_leaves_it_alone(content, words, tmp_path):
    from kvbudget.errors import ResultsFileError
    from kvbudget.eval.store import ResultStore

    path = tmp_path / "results.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ResultsFileError, match=words) as info:
        ResultStore(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert path.read_text(encoding="utf-8") == content
