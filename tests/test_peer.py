"""`kvbudget bench peer`: our side's runs, the jobs, the summary (accuracy, wall mean ± sd), the
serving runners, and one interleaved run against kvpress (skipped only without `.venv-peer`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import tiny_model, tiny_tokenizer
from kvbudget.bench.peer import (
    AGNOSTIC_PEERS,
    PEERS,
    PeerConfig,
    make_jobs,
    ours_server,
    peer_python_path,
    run_ours,
    summarise,
    with_surrogates,
)
from kvbudget.bench.peer import markdown as peer_markdown
from kvbudget.cli import app
from kvbudget.errors import KVBudgetError

PEER = peer_python_path(Path(__file__).resolve().parents[1] / ".venv-peer" / "bin" / "python")
needs_peer = pytest.mark.skipif(PEER is None, reason="no kvpress environment (.venv-peer): run `make peer`")

CONTEXT, QUESTION = list(range(3, 90)) * 2, [5, 6, 7, 8]  # 174 context tokens


def _sample(max_new_tokens: int) -> dict:
    return {"id": "x", "context_ids": CONTEXT, "question_ids": QUESTION, "eos_ids": [],
            "max_new_tokens": max_new_tokens}  # fmt: skip


def test_ours_compresses_in_the_prefill_only() -> None:
    model = tiny_model("llama")
    row = run_ours(model, _sample(6), "streamingllm", 40)
    per_token = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert row["kept_entries"] == per_token * 40  # the compressed context
    assert len(row["token_ids"]) == 6 and row["wall_s"] > row["prefill_s"] > 0
    # the question and 5 decoded tokens stay: a decode-stage method does not trim here
    assert row["final_entries"] == per_token * (40 + len(QUESTION) + 5)


def test_ours_question_aware_compresses_the_question_too() -> None:
    model = tiny_model("llama")
    row = run_ours(model, _sample(6), "snapkv", 40, question_aware=True)
    per_token = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert row["kept_entries"] == per_token * 40
    assert row["final_entries"] == per_token * (40 + 5)


def test_ours_full_keeps_the_whole_prompt() -> None:
    model = tiny_model("llama")
    row = run_ours(model, _sample(4), "full", None)
    per_token = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert row["kept_entries"] == per_token * len(CONTEXT)
    assert row["final_entries"] == per_token * (len(CONTEXT) + len(QUESTION) + 3)


def test_jobs_run_full_once_without_a_budget_and_last() -> None:
    jobs = make_jobs(PeerConfig(methods=["full", "snapkv", "knorm"], budgets=[64, 128], question_aware=True))
    assert [(j["method"], j["budget"]) for j in jobs] == [
        ("snapkv", 64), ("snapkv", 128), ("knorm", 64), ("knorm", 128), ("full", None),
    ]  # fmt: skip
    assert jobs[-1]["press"] is None and all(j["question_aware"] for j in jobs)
    assert jobs[0]["press"] == "SnapKVPress" and jobs[0]["kwargs"] == {"window_size": 64, "kernel_size": 5}


def test_the_question_agnostic_family_runs_on_request_with_the_leaderboards_press_settings(
    tmp_path, monkeypatch
) -> None:
    """kvzip … kvzap pair with the leaderboard's ``kvpress:NAME`` settings; they are not in the
    default list (KVzip's passes are slow, KVzap needs a trained surrogate), and KVzap's job gets the
    model's surrogate file, or a one-line refusal when there is none."""
    from kvbudget.eval.peer_rows import PRESSES
    from kvbudget.methods.kvzap_surrogate import default_surrogate_path

    assert not set(AGNOSTIC_PEERS) & set(PeerConfig().methods)
    assert PEERS["kvzip+"][1] == PRESSES["kvzip_plus"] and PEERS["leverage"][1]["seed"] == 0
    jobs = make_jobs(PeerConfig(methods=["kvzip", "kvzap-linear"], budgets=[64]))
    pairs = [(j["method"], j["press"]) for j in jobs]
    assert pairs == [("kvzip", "KVzipPress"), ("kvzap-linear", "KVzapPress")]
    monkeypatch.setenv("KVBUDGET_HOME", str(tmp_path))
    model = tiny_model("llama")
    with pytest.raises(KVBudgetError, match=r"^kvzap-linear: no trained linear KVzap surrogate .* first$"):
        with_surrogates(jobs, model)
    path = default_surrogate_path(model, "linear")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert with_surrogates(jobs, model)[1]["kvzap_weights"] == str(path)


def test_config_rejects_bad_settings() -> None:
    with pytest.raises(KVBudgetError, match="no kvpress counterpart for cake"):
        PeerConfig(methods=["cake"]).validate()
    for bad in (PeerConfig(repeats=0), PeerConfig(limit=0), PeerConfig(budgets=[0])):
        with pytest.raises(KVBudgetError):
            bad.validate()


def test_cli_errors_are_one_line() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "peer", "--peer-python", "/nonexistent/python"])
    assert result.exit_code == 2 and "make peer" in result.output
    result = runner.invoke(app, ["bench", "peer", "--methods", "lava"])
    assert result.exit_code == 2 and "no kvpress counterpart for lava" in result.output


def test_summary_scores_both_sides_with_our_metric() -> None:
    tok = tiny_tokenizer()
    samples = [{"id": f"s{i}", "task": "needle", "length": 300, "answers": ["4711"], "eos_ids": [1]}
               for i in range(3)]  # fmt: skip
    right, wrong = tok.encode("4711"), tok.encode("0000")
    ours = [{"sample": f"s{i}", "method": "snapkv", "budget": 64, "token_ids": ids + [1], "wall_s": 1.0}
            for i, ids in enumerate([right, right, wrong])]  # fmt: skip
    theirs = [{**r, "token_ids": ids, "wall_s": 2.0}
              for r, ids in zip(ours, [right + [1], wrong, wrong + [1]], strict=True)]  # fmt: skip
    (row,) = summarise(samples, ours, theirs, tok)
    assert row["ours_accuracy"] == pytest.approx(2 / 3) and row["kvpress_accuracy"] == pytest.approx(1 / 3)
    assert row["same_answer"] == pytest.approx(2 / 3)  # s0 and s2 decoded the same ids
    assert row["wall_ratio"] == pytest.approx(0.5) and row["ours_wall_sd"] == 0.0
    assert row["press"] == "SnapKVPress" and row["ours_spec"] == PEERS["snapkv"][0]
    assert row["runs"] == row["samples"] == 3


def _timed_rows(rng: np.random.Generator, repeats: int) -> list[dict]:
    """Rows for 2 samples × (snapkv@64, full) × ``repeats`` with random wall times."""
    return [
        {"sample": f"s{i}", "method": method, "budget": budget, "repeat": rep, "token_ids": [5, 6, 1],
         "wall_s": float(rng.uniform(0.5, 3.0))}
        for rep in range(repeats) for i in range(2) for method, budget in (("snapkv", 64), ("full", None))
    ]  # fmt: skip


def test_summary_gives_wall_mean_and_spread_over_paired_runs() -> None:
    rng = np.random.default_rng(0)
    ours, theirs = _timed_rows(rng, 3), _timed_rows(rng, 3)
    theirs = theirs[:-1]  # kvpress's last run (s1/full, repeat 2) is missing: ours is left out too
    samples = [{"id": f"s{i}", "task": "needle", "length": 300, "answers": ["x"], "eos_ids": [1]}
               for i in (0, 1)]  # fmt: skip
    rows = summarise(samples, ours, theirs, tiny_tokenizer())
    assert [r["method"] for r in rows] == ["full", "snapkv"]  # the reference first
    by_method = {r["method"]: r for r in rows}
    assert by_method["full"]["budget"] is None and by_method["full"]["press"] == "no press"
    assert by_method["full"]["runs"] == 5 and by_method["snapkv"]["runs"] == 6
    for method, row in by_method.items():
        paired = {(r["sample"], r["repeat"]) for r in theirs if r["method"] == method}
        for name, side in (("ours", ours), ("kvpress", theirs)):
            walls = [r["wall_s"] for r in side
                     if r["method"] == method and (r["sample"], r["repeat"]) in paired]  # fmt: skip
            assert row[f"{name}_wall_s"] == pytest.approx(np.mean(walls))
            assert row[f"{name}_wall_sd"] == pytest.approx(np.std(walls, ddof=1))
        assert row["wall_ratio"] == pytest.approx(row["ours_wall_s"] / row["kvpress_wall_s"])
        assert row["same_answer"] == 1.0

    text = peer_markdown(PeerConfig(repeats=3), rows, "versions")
    header = next(line for line in text.splitlines() if line.startswith("| task"))
    full = next(line for line in text.splitlines() if line.startswith("| needle") and "no press" in line)
    cells = [c.strip() for c in full.strip("|").split("|")]
    assert len(cells) == len(header.strip("|").split("|"))
    r = by_method["full"]
    assert cells[:6] == ["needle", "300", "`full`", "no press", "—", "5"]
    assert cells[-3:] == [
        f"{r['ours_wall_s']:.2f} ± {r['ours_wall_sd']:.2f}",
        f"{r['kvpress_wall_s']:.2f} ± {r['kvpress_wall_sd']:.2f}",
        f"{r['wall_ratio']:.2f}",
    ]


def test_our_runner_serves_the_rows_run_ours_makes(tmp_path: Path) -> None:
    """`bench peer`'s own side runs in a serving process (like kvpress's runner): its rows decode
    what `run_ours` decodes in this process."""
    model_dir = tmp_path / "model"
    model = tiny_model("llama", seed=3)
    model.save_pretrained(model_dir)
    tiny_tokenizer(chat_template=True).save_pretrained(model_dir)
    (tmp_path / "samples.jsonl").write_text(json.dumps(_sample(5)) + "\n")
    jobs = make_jobs(PeerConfig(methods=["snapkv", "full"], budgets=[40]))
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    server = ours_server(str(model_dir), tmp_path / "samples.jsonl", tmp_path / "jobs.json", "float32")
    try:
        served = [server.run(0, j) for j in range(len(jobs))]
    finally:
        server.close()
    assert server.proc.returncode == 0
    for job, row in zip(jobs, served, strict=True):
        here = run_ours(model, _sample(5), job["method"], job["budget"])
        assert row["token_ids"] == here["token_ids"] and row["kept_entries"] == here["kept_entries"]
        assert row["wall_s"] > 0


def test_our_runner_that_cannot_start_raises_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "samples.jsonl").write_text("")
    (tmp_path / "jobs.json").write_text("[]")
    with pytest.raises(KVBudgetError, match="the kvbudget runner stopped") as failure:
        ours_server(str(tmp_path / "none"), tmp_path / "samples.jsonl", tmp_path / "jobs.json", "float32")
    assert "none" in str(failure.value)  # the runner's own error names the missing model


def test_kvpress_runner_refuses_presses_on_a_transformers_they_do_not_support(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """kvpress 0.5.5's presses need transformers < 5.3 (the main environment's is newer): only the
    `full` pair may run there; a press job is refused in one line before the model loads."""
    import sys
    import types

    import transformers

    from kvbudget.peer import kvpress_runner

    assert tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 3)  # the main env's
    monkeypatch.setitem(sys.modules, "kvpress", types.ModuleType("kvpress"))
    jobs = make_jobs(PeerConfig(methods=["full", "snapkv"], budgets=[64]))
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "samples.jsonl").write_text("")
    args = ["--model", str(tmp_path / "no-model"), "--samples", str(tmp_path / "samples.jsonl")]
    code = kvpress_runner.main([*args, "--jobs", str(tmp_path / "jobs.json"), "--serve"])
    err = capsys.readouterr().err
    assert code == 2 and "need transformers < 5.3" in err and "snapkv" in err and "full" in err


@needs_peer
def test_bench_peer_interleaves_the_sides_and_matches_answers(tmp_path: Path, monkeypatch) -> None:
    """Each (repeat, sample, job) runs on both sides back to back, the first side alternating; `full`
    (no press ↔ our `full`) and SnapKV with kvpress's settings decode the same tokens on both sides;
    the summary's wall mean is that of the saved runs."""
    from kvbudget.bench import peer

    model_dir = tmp_path / "model"
    tiny_model("llama", seed=3).save_pretrained(model_dir)
    tiny_tokenizer(chat_template=True).save_pretrained(model_dir)
    calls: list[tuple[str, int, int]] = []
    real_run = peer.RunnerServer.run

    def recorded_run(self, sample: int, job: int) -> dict:
        calls.append((self.name, sample, job))
        return real_run(self, sample, job)

    monkeypatch.setattr(peer.RunnerServer, "run", recorded_run)
    monkeypatch.setattr(peer, "SETTLE_S", 0.0)
    config = peer.PeerConfig(
        model=str(model_dir), tasks=["needle_filler"], lengths=[300], limit=2, methods=["full", "snapkv"],
        budgets=[96], peer_python=str(PEER), repeats=2,
    )  # fmt: skip
    out = tmp_path / "out"
    result = json.loads(peer.run_peer(config, out).read_text())
    assert len(calls) == 2 * 2 * 2 * 2  # repeats × samples × jobs × sides (warm-ups are inside the runners)
    for n in range(0, len(calls), 2):
        (first, s, j), (second, s2, j2) = calls[n], calls[n + 1]
        assert (s, j) == (s2, j2) and {first, second} == {"kvpress", "kvbudget"}
        rep = n // 8
        assert first == ("kvpress" if (rep + s + j) % 2 == 0 else "kvbudget")

    sides = {name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
             for name in ("ours", "kvpress")}  # fmt: skip
    answers = {}
    for name, rows in sides.items():
        assert sorted((r["repeat"], r["sample"], r["method"]) for r in rows) == sorted(
            (rep, f"needle_filler/300/{i}", m) for rep in (0, 1) for i in (0, 1) for m in ("snapkv", "full")
        )
        answers[name] = {(r["repeat"], r["sample"], r["method"]): r["token_ids"] for r in rows}
    assert answers["ours"] == answers["kvpress"]
    by_method = {r["method"]: r for r in result["rows"]}
    for method, row in by_method.items():
        assert row["runs"] == 4 and row["samples"] == 2 and row["same_answer"] == 1.0
        assert row["ours_accuracy"] == row["kvpress_accuracy"]
        walls = [r["wall_s"] for r in sides["kvpress"] if r["method"] == method]
        assert row["kvpress_wall_s"] == pytest.approx(np.mean(walls))
    assert "| needle_filler | 300 | `full` | no press | — | 4 |" in (out / "peer.md").read_text()
    assert (out / "ours.log").exists() and (out / "kvpress.log").exists()


@needs_peer
def test_kvpress_server_that_cannot_start_raises_a_clear_error(tmp_path: Path) -> None:
    from kvbudget.bench.peer import kvpress_server

    (tmp_path / "samples.jsonl").write_text("")
    (tmp_path / "jobs.json").write_text("[]")
    with pytest.raises(KVBudgetError, match="the kvpress runner stopped"):
        kvpress_server(PEER, tmp_path / "none", tmp_path / "samples.jsonl", tmp_path / "jobs.json", "float32")
    assert (tmp_path / "kvpress.log").read_text()  # the runner's traceback is kept
