"""kvpress's presses as leaderboard rows (``kvbudget eval --peer-presses``, issue #20 item 4).

The report's best-vs-best table is checked on hand-made rows (no model); the sample export against
the prompt ids kvbudget's runner really prefills (tiny random model and character tokenizer). The
end-to-end tests run kvpress in its own environment (``make peer`` → ``.venv-peer``) on a tiny
random Llama saved to a temporary directory, and are skipped only when that environment is absent,
as in ``test_kvpress_oracle.py``.

Bootstrap bounds in the hand-made rows: all-equal scores give a zero-width interval; a task's
{1, 1, 0, 0} resamples to k/4 with k ~ Binomial(4, 1/2), whose 2.5 % / 97.5 % quantiles are 0 and 4
(P(k = 0) = P(k = 4) = 1/16 > 2.5 %); {1, 0, 0, 0} to k ~ Binomial(4, 1/4): quantiles 0 and 3
(P(k = 0) = 0.32, P(k ≥ 3) = 0.051 > 2.5 % > P(k = 4) = 0.004). The mean over two tasks is the
mean of the two tasks' means (tasks fixed, samples resampled within each).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_model, tiny_tokenizer
from kvbudget.bench.peer import peer_python_path
from kvbudget.cli import app
from kvbudget.errors import KVBudgetError
from kvbudget.eval.report import across_tasks, best_versus_best, best_versus_best_lines, write_report
from kvbudget.eval.store import load_rows

PEER = peer_python_path(Path(__file__).resolve().parents[1] / ".venv-peer" / "bin" / "python")
needs_peer = pytest.mark.skipif(PEER is None, reason="no kvpress environment (.venv-peer): run `make peer`")
VERSIONS = "kvpress 0.5.5 / transformers 5.2.0"
#: kvbudget's snapkv with kvpress's SnapKVPress settings (the oracle test: the same kept entries)
SNAP_AS_KVPRESS = "snapkv:window=64,kernel=5,pooling=avg,reduce_rows=mean"


# ---------------------------------------------------------------------------------------- report


def _row(task: str, label: str, sample: int, score: float, ratio: float | None = None, budget=None) -> dict:
    row = {
        "key": f"{task}-{label}-{sample}-{ratio}-{budget}", "model": "tiny", "dtype": "float32",
        "task": task, "family": "ruler", "metric": "string_match_all", "length": 1024, "sample": sample,
        "method": label, "label": label, "options": {}, "budget": budget, "compression_ratio": ratio,
        "meta": {}, "score": score, "full_score": 1.0, "agreement": None, "kl": None,
        "selection_layer": None, "error": None, "ttft_s": 0.5, "compress_s": 0.01, "tpot_s": 0.02,
        "logical_bytes": 2**20, "physical_bytes": 2**20,
    }  # fmt: skip
    if ratio is not None:
        row["budget"] = 100
    if label.startswith("kvpress:"):
        row["peer"] = {"library": "kvpress", "versions": VERSIONS}
    return row


def _grid() -> list[dict]:
    scores = {  # (task, label, ratio or ("B", budget)) → per-sample scores
        ("t1", "full", None): [1, 1, 1, 1],
        ("t2", "full", None): [1, 1, 1, 1],
        # r=0.5: A (1 + 0.5) / 2 = 0.75 [0.5, 1]; kvpress:x (1 + 0.25) / 2 = 0.625 [0.5, 0.875]: overlap
        ("t1", "A", 0.5): [1, 1, 1, 1],
        ("t2", "A", 0.5): [1, 1, 0, 0],
        ("t1", "B", 0.5): [0, 0, 0, 0],
        ("t2", "B", 0.5): [1, 1, 1, 1],
        ("t1", "kvpress:x", 0.5): [1, 1, 1, 1],
        ("t2", "kvpress:x", 0.5): [1, 0, 0, 0],
        ("t1", "kvpress:y", 0.5): [0, 0, 0, 0],
        ("t2", "kvpress:y", 0.5): [0, 0, 0, 0],
        ("t1", "kvpress:z", 0.5): [1, 1, 1, 1],  # never ran on t2: not ranked, so never the best
        # r=0.75: A 1.0 [1, 1] vs kvpress:x (0 + 0.5) / 2 = 0.25 [0, 0.5]: disjoint, kvbudget ahead
        ("t1", "A", 0.75): [1, 1, 1, 1],
        ("t2", "A", 0.75): [1, 1, 1, 1],
        ("t1", "B", 0.75): [0, 0, 0, 0],
        ("t2", "B", 0.75): [0, 0, 0, 0],
        ("t1", "kvpress:x", 0.75): [0, 0, 0, 0],
        ("t2", "kvpress:x", 0.75): [1, 1, 0, 0],
        ("t1", "kvpress:y", 0.75): [0, 0, 0, 0],
        ("t2", "kvpress:y", 0.75): [0, 0, 0, 0],
        # r=0.875: A and B tie at 0, kvpress:x and kvpress:y tie at 1: disjoint, kvpress ahead
        ("t1", "A", 0.875): [0, 0, 0, 0],
        ("t2", "A", 0.875): [0, 0, 0, 0],
        ("t1", "B", 0.875): [0, 0, 0, 0],
        ("t2", "B", 0.875): [0, 0, 0, 0],
        ("t1", "kvpress:x", 0.875): [1, 1, 1, 1],
        ("t2", "kvpress:x", 0.875): [1, 1, 1, 1],
        ("t1", "kvpress:y", 0.875): [1, 1, 1, 1],
        ("t2", "kvpress:y", 0.875): [1, 1, 1, 1],
        # B=64: kvbudget's methods only: no kvpress line there
        ("t1", "A", ("B", 64)): [1, 1, 1, 1],
        ("t2", "A", ("B", 64)): [1, 1, 1, 1],
    }
    rows = []
    for (task, label, column), values in scores.items():
        budget = column[1] if isinstance(column, tuple) else None
        ratio = column if isinstance(column, float) else None
        rows += [_row(task, label, i, float(v), ratio, budget) for i, v in enumerate(values)]
    return rows


def test_best_versus_best_per_ratio_from_hand_made_rows():
    rows = _grid()
    pairs = {pair.column: pair for pair in best_versus_best(across_tasks(rows), rows)}
    assert set(pairs) == {("r", 0.5), ("r", 0.75), ("r", 0.875)}  # not B=64: no kvpress row there
    half = pairs[("r", 0.5)]
    assert (half.ours, half.theirs) == (["A"], ["kvpress:x"])  # kvpress:z (1.0 on t1 alone) left out
    assert (half.ours_score.mean, half.ours_score.low, half.ours_score.high) == (0.75, 0.5, 1.0)
    assert (half.theirs_score.mean, half.theirs_score.low, half.theirs_score.high) == (0.625, 0.5, 0.875)
    # paired: t1 differs by 0 on every sample, t2 by [0, 1, 0, 0]: (0 + 0.25) / 2; a resample of t2
    # draws no 1 with chance (3/4)^4 ≈ 0.32 (the low end 0) and three or more with chance ≈ 0.051
    # (the high end (0 + 3/4) / 2)
    assert half.difference.difference.mean == 0.125 and half.difference.difference.low == 0.0
    assert half.verdict == "no clear difference (the interval holds 0)"
    three = pairs[("r", 0.75)]
    assert (three.ours, three.theirs) == (["A"], ["kvpress:x"])
    assert (three.theirs_score.mean, three.theirs_score.low, three.theirs_score.high) == (0.25, 0.0, 0.5)
    # t1 differs by 1 on every sample, t2 by [0, 0, 1, 1]: the mean 0.75, never below (1 + 0) / 2
    assert three.difference.difference.mean == 0.75 and three.difference.difference.low >= 0.5
    assert three.verdict == "kvbudget ahead"
    tight = pairs[("r", 0.875)]
    assert (tight.ours, tight.theirs) == (["A", "B"], ["kvpress:x", "kvpress:y"])
    d = tight.difference.difference
    assert (d.mean, d.low, d.high) == (-1.0, -1.0, -1.0) and tight.verdict == "kvpress ahead"
    assert best_versus_best(across_tasks(rows))[0].verdict == "–"  # without the rows: no difference

    lines = best_versus_best_lines(across_tasks(rows), rows)
    assert lines[-3:] == [
        "| r=0.5 | A | 75.0 [50.0, 100.0] | kvpress:x | 62.5 [50.0, 87.5] | +12.5 [+0.0, +37.5] "
        "| no clear difference (the interval holds 0) |",
        "| r=0.75 | A | 100.0 [100.0, 100.0] | kvpress:x | 25.0 [0.0, 50.0] | +75.0 [+50.0, +100.0] "
        "| kvbudget ahead |",
        "| r=0.875 | A, B | 0.0 [0.0, 0.0] | kvpress:x, kvpress:y | 100.0 [100.0, 100.0] "
        "| -100.0 [-100.0, -100.0] | kvpress ahead |",
    ]
    ours_only = [r for r in rows if not r["label"].startswith("kvpress:")]
    assert best_versus_best_lines(across_tasks(ours_only), ours_only) == []


def test_best_versus_best_leaves_out_methods_that_keep_more_than_the_budget():
    """PyramidInfer keeps the full cache below its cut (``exceeds_budget``): it scores 1 everywhere
    at r = 0.5 but kvbudget's best held to the budget is still A, and the table says who was left out."""
    from kvbudget.eval.report import beyond_budget_labels

    extra = [_row(t, "pyramidinfer", i, 1.0, 0.5) for t in ("t1", "t2") for i in range(4)]
    rows = _grid() + extra
    beyond = beyond_budget_labels(rows)
    assert beyond == {"pyramidinfer"}
    summary = across_tasks(rows)
    assert summary.scores[("r", 0.5)]["pyramidinfer"].mean == 1.0  # it is ranked, just not the best
    half = {p.column: p for p in best_versus_best(summary, rows, beyond)}[("r", 0.5)]
    assert half.ours == ["A"]
    assert {p.column: p for p in best_versus_best(summary, rows)}[("r", 0.5)].ours == ["pyramidinfer"]
    lines = best_versus_best_lines(summary, rows, beyond)
    assert lines[-1].endswith("(they keep more than the budget by design): pyramidinfer.")


def test_report_marks_kvpress_rows_and_says_where_the_best_stand(tmp_path):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _grid()))
    text = write_report(tmp_path).read_text()
    assert f"Rows labelled `kvpress:NAME` are NVIDIA kvpress's presses ({VERSIONS}," in text
    across = text.split("## Across tasks")[1].split("\n## ")[0]
    assert "### kvbudget's best method vs kvpress's best press" in across
    assert "| r=0.75 | A | 100.0 [100.0, 100.0] | kvpress:x | 25.0 [0.0, 50.0] | +75.0 [+50.0, +100.0] |" in (
        across
    )
    t1 = text.split("\n## t1\n")[1].split("\n## ")[0]  # columns B=64, r=0.5, r=0.75, r=0.875
    assert "\n| kvpress:x | – | 100.0 [100.0, 100.0] | 0.0 [0.0, 0.0] | 100.0 [100.0, 100.0] | 4 |" in t1
    assert "\n| kvpress:z | – | 100.0 [100.0, 100.0] | – | – | 4 | 100.0 [100.0, 100.0] | – | – |" in t1
    ours = [r for r in _grid() if not r["label"].startswith("kvpress:")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ours))
    text = write_report(tmp_path).read_text()
    assert "Rows labelled `kvpress:" not in text and "kvpress's best press" not in text


# ---------------------------------------------------------------------------------------- presses, errors


def test_press_names_accept_aliases_and_all_and_refuse_unknown_ones():
    from kvbudget.eval.peer_rows import PRESSES, press_names

    everything = press_names(["all"])
    assert everything[:9] == [
        "snapkv", "streaming_llm", "knorm", "tova", "keydiff", "expected_attention", "observed_attention",
        "adakv_snapkv", "pyramidkv",
    ]  # fmt: skip
    assert everything == [name for name in PRESSES if name != "no_press"] and "finch" in everything
    assert {"kvzip", "kvzip_plus", "chunkkv", "lagkv", "compactor", "snapkv@paper"} <= set(everything)
    given = ["streamingllm", "adakv", "kvpress:snapkv", "snapkv", "no-press"]
    assert press_names(given) == ["streaming_llm", "adakv_snapkv", "snapkv", "no_press"]
    given = ["Ada-SnapKV@paper", "kvpress:PyramidKV@paper", "KVzip+", "non-causal-attn"]
    assert press_names(given) == ["adakv_snapkv@paper", "pyramidkv@paper", "kvzip_plus", "non_causal_attn"]
    with pytest.raises(KVBudgetError, match="unknown kvpress press 'h2o': expected some of snapkv,"):
        press_names(["h2o"])
    with pytest.raises(KVBudgetError, match="unknown kvpress press 'snapkv@lava'"):
        press_names(["snapkv@lava"])


def test_some_presses_run_question_aware_only():
    """FINCH's window is the question; PyramidKV and KVCompose leave the layers different lengths, on
    which the question's forward fails after a question-agnostic prefill. A question-agnostic ``all``
    leaves them out (and only them), and naming one there is a one-line error with the reason."""
    from kvbudget.eval.peer_rows import QUESTION_AWARE_ONLY, make_jobs, press_names

    aware, agnostic = press_names(["all"]), press_names(["all"], question_aware=False)
    assert [name for name in aware if name not in agnostic] == [
        "pyramidkv",
        "finch",
        "kvcompose",
        "pyramidkv@paper",
    ]
    assert set(QUESTION_AWARE_ONLY) == {"pyramidkv", "finch", "kvcompose", "pyramidkv@paper"}
    with pytest.raises(KVBudgetError) as err:
        press_names(["snapkv", "finch"], question_aware=False)
    assert str(err.value) == (
        "kvpress press 'finch' runs question-aware only: its window is the question, which a "
        "question-agnostic run leaves out of the compressed prefill"
    )
    with pytest.raises(
        KVBudgetError, match="'PyramidKV' runs question-aware only: its layers keep different"
    ):
        press_names(["PyramidKV"], question_aware=False)
    assert press_names(["finch", "pyramidkv@paper"]) == ["finch", "pyramidkv@paper"]  # question-aware
    (job,) = make_jobs(["finch"], [0.5], question_aware=True)
    assert job["press"] == "FinchPress" and job["question_delimiter"] is True and job["question_aware"]


def test_presses_that_cannot_run_here_are_refused_with_their_reason():
    import re

    from kvbudget.eval.peer_rows import PRESSES, UNAVAILABLE_PRESSES, press_names

    assert not set(UNAVAILABLE_PRESSES) & set(PRESSES)
    for name, reason in UNAVAILABLE_PRESSES.items():
        with pytest.raises(KVBudgetError) as err:
            press_names(["snapkv", name.upper()])
        assert str(err.value) == f"kvpress press '{name.upper()}' cannot run here: {reason}"
        assert "\n" not in reason and re.match(r"\w+Press\b", reason), name  # it names the class first
    for name in ("qfilter", "fastkvzip", "restorekv", "kvzap_mlp", "expected_attention_stats"):
        assert "from the hub" in UNAVAILABLE_PRESSES[name]
    assert "kvbudget's own `qfilter`" in UNAVAILABLE_PRESSES["qfilter"]
    assert "while decoding" in UNAVAILABLE_PRESSES["cam_knorm"]
    with pytest.raises(KVBudgetError, match="cannot run here: RestoreKVPress loads"):
        press_names(["RestoreKV+"])


def test_cli_refuses_a_press_that_cannot_run_here_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path / "out"), "--peer-presses", "qfilter"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: kvpress press 'qfilter' cannot run here: QFilterPress loads the authors' trained Q-filters "
        "from the hub (nthngdy/<model>_qfilt) on entering the press; it takes no filters of ours "
        "(kvbudget's own `qfilter` computes them locally)"
    ]
    assert not (tmp_path / "out").exists()


def test_paper_variants_carry_the_snapkv_papers_settings():
    """SnapKV's paper: observation window 32, pooling kernel 7 (its max pooling kvpress cannot set);
    PyramidKV's β = 20. The variants' rows are keyed apart from the defaults' (window 64, kernel 5)."""
    from kvbudget.eval.peer_rows import PRESSES, PressSpec, make_jobs

    paper = {"window_size": 32, "kernel_size": 7}
    assert PRESSES["snapkv@paper"] == {"press": "SnapKVPress", "kwargs": paper}
    assert PRESSES["adakv_snapkv@paper"] == {
        "press": "AdaKVPress",
        "inner": {"press": "SnapKVPress", "kwargs": paper},
    }
    assert PRESSES["pyramidkv@paper"] == {"press": "PyramidKVPress", "kwargs": {**paper, "beta": 20}}
    for name in ("snapkv", "adakv_snapkv", "pyramidkv"):
        default, variant = PressSpec.of(name), PressSpec.of(f"{name}@paper")
        assert variant.name == f"kvpress:{name}@paper" and variant.options != default.options
    assert dict(PressSpec.of("snapkv@paper").options)["kwargs"] == '{"kernel_size": 7, "window_size": 32}'
    (job,) = make_jobs(["pyramidkv@paper"], [0.5], question_aware=False)
    assert job["kwargs"] == {**paper, "beta": 20} and job["method"] == "kvpress:pyramidkv@paper"


#: builds every press of ``jobs`` (argv[1], name → job) with the kvpress runner's own ``make_press``
#: at ratio 0.5 and prints what kvpress made of it, with every press class kvpress exports
_BUILD = """
import json, sys
sys.path.insert(0, sys.argv[2])
import kvpress
from kvpress_runner import finch_prompt, make_press, rerotates_keys

def fields(press):
    names = ("window_size", "kernel_size", "beta", "chunk_length", "block_size", "kvzip_plus_normalization",
             "structured", "epsilon", "use_vnorm")
    return {n: getattr(press, n) for n in names if hasattr(press, n)}

built = {}
for name, job in json.loads(sys.argv[1]).items():
    press = make_press({**job, "compression_ratio": 0.5}, 100)
    inner = getattr(press, "press", None)
    built[name] = {
        "class": type(press).__name__, "ratio": press.compression_ratio, "fields": fields(press),
        "inner": None if inner is None else {"class": type(inner).__name__, "fields": fields(inner)},
    }
class Embeddings:
    num_embeddings = 50
class Model:
    def get_input_embeddings(self):
        return Embeddings()
finch = make_press({"press": "FinchPress", "compression_ratio": 0.5}, 10)
ids = finch_prompt(finch, Model(), {"context_ids": [3, 4, 5], "question_ids": [6, 7]})[0].tolist()
try:
    finch_prompt(finch, Model(), {"context_ids": [3, 49], "question_ids": [6]})
    clash = None
except ValueError as err:
    clash = str(err)
snap = make_press({"press": "SnapKVPress", "compression_ratio": 0.5}, 10)
classes = sorted(
    n for n, c in vars(kvpress).items() if isinstance(c, type) and issubclass(c, kvpress.BasePress)
)
print(json.dumps({
    "built": built, "classes": classes,
    "finch": {"ids": ids, "delimiter": finch.delimiter_token_id, "clash": clash},
    "rerotates": [rerotates_keys(finch), rerotates_keys(snap), rerotates_keys(None)],
}))
"""


@pytest.fixture(scope="module")
def built_presses() -> dict:
    """What kvpress 0.5.5 builds from every ``PRESSES`` job (one subprocess in its environment)."""
    import subprocess

    from kvbudget.bench.peer import runner_script
    from kvbudget.eval.peer_rows import PRESSES, _peer_env

    jobs = {name: job for name, job in PRESSES.items() if job["press"] is not None}
    command = [str(PEER), "-P", "-c", _BUILD, json.dumps(jobs), str(runner_script().parent)]
    proc = subprocess.run(command, capture_output=True, text=True, env=_peer_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_peer
def test_every_press_is_built_by_kvpress_with_its_settings_and_the_ratio(built_presses):
    """Each job names kvpress classes that exist and options they take (``make_press`` raises
    otherwise); the ratio reaches the scorer through any wrapper; the settings are the registry's."""
    from kvbudget.eval.peer_rows import PRESSES

    built = built_presses["built"]
    assert set(built) == {name for name, job in PRESSES.items() if job["press"] is not None}
    for name, made in built.items():
        job = PRESSES[name]
        assert made["class"] == job["press"] and made["ratio"] == 0.5, name
        for key, value in job.get("kwargs", {}).items():
            assert made["fields"][key] == value, (name, key)
        if "inner" in job:
            assert made["inner"]["class"] == job["inner"]["press"], name
            for key, value in job["inner"].get("kwargs", {}).items():
                assert made["inner"]["fields"][key] == value, (name, key)
    assert built["snapkv"]["fields"] == {"window_size": 64, "kernel_size": 5}  # kvpress's defaults
    assert built["snapkv@paper"]["fields"] == {"window_size": 32, "kernel_size": 7}
    assert built["adakv_snapkv@paper"]["inner"]["fields"] == {"window_size": 32, "kernel_size": 7}
    assert built["pyramidkv@paper"]["fields"] == {"window_size": 32, "kernel_size": 7, "beta": 20}
    assert built["chunkkv"]["fields"]["chunk_length"] == 20 and built["kvzip_plus"]["fields"] == {
        "kvzip_plus_normalization": True
    }


@needs_peer
def test_every_kvpress_press_class_runs_or_is_refused_with_a_reason(built_presses):
    """A press kvpress adds later fails here until it is run (``PRESSES``) or refused with a reason
    that names it (``UNAVAILABLE_PRESSES``)."""
    import re

    from kvbudget.eval.peer_rows import PRESSES, UNAVAILABLE_PRESSES

    run = {job["press"] for job in PRESSES.values()} | {
        job["inner"]["press"] for job in PRESSES.values() if "inner" in job
    }
    refused = {c for reason in UNAVAILABLE_PRESSES.values() for c in re.findall(r"\b\w+Press\b", reason)}
    classes = set(built_presses["classes"]) - {"BasePress", "ScorerPress"}
    assert len(classes) == 44  # kvpress 0.5.5's (46 with BasePress and ScorerPress)
    assert classes - run - refused == set()
    assert refused <= classes and not run & {"QFilterPress", "FastKVzipPress", "RestoreKVPress", "KVzapPress"}


@needs_peer
def test_finch_prompt_puts_a_delimiter_between_context_and_question(built_presses):
    finch = built_presses["finch"]
    assert finch["ids"] == [3, 4, 5, 49, 6, 7] and finch["delimiter"] == 49
    assert finch["clash"] == "the delimiter id 49 (the embeddings' last row) occurs in the prompt"
    assert built_presses["rerotates"] == [True, False, False]


def test_a_missing_peer_python_is_a_one_line_error_before_any_model_loads(tmp_path, monkeypatch):
    import kvbudget.models

    monkeypatch.setattr(kvbudget.models, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    missing = tmp_path / "no-venv" / "bin" / "python"
    result = CliRunner().invoke(app, [
        "eval", "--out", str(tmp_path / "out"), "--model", "no-such-model", "--compression-ratios", "0.5",
        "--peer-presses", "snapkv", "--peer-python", str(missing),
    ])  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: no kvpress environment at {missing}: run `make peer` first (or give --peer-python)"
    ]
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path / "out"), "--peer-presses", "nope"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "unknown kvpress press 'nope'" in result.stderr


# ---------------------------------------------------------------------------------------- sample export


@pytest.mark.parametrize("agnostic", [False, True])
def test_sample_export_is_what_the_runner_prefills(tmp_path, monkeypatch, agnostic):
    """The exported ids are the ids kvbudget's runner prefills for the same config, split where its
    compressed part ends: the kvpress runner compresses context + question (aware) or the context
    alone (agnostic), so both sides' ratios apply to the same token count."""
    from kvbudget.eval import runner as runner_module
    from kvbudget.eval.peer_rows import eval_tasks_only, export_sample
    from kvbudget.eval.runner import EvalConfig, Runner
    from kvbudget.eval.tasks import get_task

    seen = []
    real = runner_module.prefill_inputs

    def spy(prompts, pad_id, compress_context_only=False):
        inputs = real(prompts, pad_id, compress_context_only)
        seen.append((inputs.ids[0].tolist(), inputs.compressed_until))
        return inputs

    monkeypatch.setattr(runner_module, "prefill_inputs", spy)
    config = EvalConfig(
        model="tiny", tasks=["needle_filler", "kv_retrieval", "perplexity"], lengths=[320, 400],
        methods=["full"], budgets=[], limit=2, seed=3, compress_context_only=agnostic, max_new_tokens=3,
    )  # fmt: skip
    runner = Runner(config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(True), progress=False)
    exported = [export_sample(runner, *entry) for entry in eval_tasks_only(runner)]
    runner.run()
    assert len(seen) == len(exported) == 2 * 2 * 2  # perplexity prefills no prompt and is not exported
    for sample, (ids, compressed) in zip(exported, seen, strict=True):
        assert sample["context_ids"] + sample["question_ids"] == ids
        assert sample["question_ids"], "the chat template's tail is the question part"
        n = len(sample["context_ids"]) if agnostic else len(ids)
        assert compressed == n
        assert sample["max_new_tokens"] == 3 and 1 in sample["eos_ids"]  # [EOS] is id 1
    first = ["needle_filler/320/0", "needle_filler/320/1", "needle_filler/400/0"]
    assert [s["id"] for s in exported[:3]] == first
    own = get_task("needle_filler").make_samples(tiny_tokenizer(True), 320, 2, 3)[0]
    assert own.max_new_tokens > 3  # so the cap is what the export carries


# ---------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", seed=3).save_pretrained(path)
    tiny_tokenizer(True).save_pretrained(path)
    return path


def _eval(tiny_dir: Path, out: Path, agnostic: bool, presses: str):
    args = [
        "eval", "--model", str(tiny_dir), "--out", str(out), "--tasks", "needle_filler", "--lengths", "200",
        "--limit", "2", "--methods", f"full,{SNAP_AS_KVPRESS}", "--compression-ratios", "0.5,0.75",
        "--peer-presses", presses, "--peer-python", str(PEER),
    ]  # fmt: skip
    return CliRunner().invoke(app, [*args, "--compress-context-only"] if agnostic else args)


@needs_peer
@pytest.mark.parametrize("agnostic", [False, True])
def test_kvpress_rows_join_the_results_and_resume(tiny_dir, tmp_path, agnostic):
    """Question-agnostic runs leave AdaKV out: on this tiny random model (head dim 16) kvpress's
    attention patch finds no fake key that every question token's query ignores (its
    ``search_hyperplane`` raises), which would make those rows error rows."""
    out = tmp_path / "run"
    pressed = ("snapkv", "knorm") if agnostic else ("snapkv", "knorm", "adakv_snapkv")
    result = _eval(tiny_dir, out, agnostic, presses=",".join([*pressed, "no_press"]))
    assert result.exit_code == 0, result.output + str(result.exception)
    rows = load_rows(out / "results.jsonl")
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]]
    peer = [r for r in rows if r["label"].startswith("kvpress:")]
    assert sorted((r["label"], r["sample"], r["compression_ratio"]) for r in peer) == sorted(
        [(f"kvpress:{p}", s, ratio) for p in pressed for s in (0, 1) for ratio in (0.5, 0.75)]
        + [("kvpress:no_press", s, None) for s in (0, 1)]
    )  # fmt: skip
    samples = [json.loads(line) for line in (out / "kvpress" / "samples.jsonl").read_text().splitlines()]
    ours = {(r["sample"], r["compression_ratio"]): r for r in rows if r["label"] == SNAP_AS_KVPRESS}
    full = {r["sample"]: r for r in rows if r["label"] == "full"}
    model = tiny_model("llama", seed=3)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    compared = 0
    for r in peer:
        sample = samples[r["sample"]]
        n = len(sample["context_ids"]) + (0 if agnostic else len(sample["question_ids"]))
        assert r["mode"] == ("agnostic" if agnostic else "aware") and r["compressed_tokens"] == n
        assert r["prompt_tokens"] == len(sample["context_ids"]) + len(sample["question_ids"])
        assert r["full_score"] == full[r["sample"]]["score"]
        assert r["peer"]["library"] == "kvpress" and r["peer"]["versions"].startswith("kvpress 0.5.5")
        if r["compression_ratio"] is None:  # no press: the full cache, the same answer as ours
            assert r["budget"] is None and r["kept_entries"] == layers * heads * n
            assert r["prediction"] == full[r["sample"]]["prediction"]
            continue
        kept = int(n * (1 - r["compression_ratio"]))  # kvpress's count, by hand
        assert r["budget"] == kept == ours[(r["sample"], r["compression_ratio"])]["budget"]
        assert r["kept_entries"] == layers * heads * kept  # AdaKV: the same total, spread over heads
        # the same samples, ratio and mode: SnapKV's answer is ours — where the budget exceeds the
        # window of 64 (below it, kvpress breaks ties among the window's equal scores its own way)
        if r["label"] == "kvpress:snapkv" and kept > 64:
            mine = ours[(r["sample"], r["compression_ratio"])]
            assert (r["prediction"], r["score"]) == (mine["prediction"], mine["score"])
            compared += 1
    assert compared >= 2
    assert len({r["prediction"] for r in peer if r["compression_ratio"] == 0.75}) > 1  # presses differ

    again = _eval(tiny_dir, out, agnostic, presses=",".join(pressed))
    assert again.exit_code == 0 and "kvpress rows added: 0" in again.output
    assert len(load_rows(out / "results.jsonl")) == len(rows)
    if agnostic:
        return  # adding a press to a finished run: once is enough (the aware case below)
    more = _eval(tiny_dir, out, agnostic, presses="snapkv,tova")
    assert "kvpress rows added: 4" in more.output  # only tova's: 2 samples × 2 ratios
    text = (out / "report.md").read_text()
    assert "| kvpress:tova |" in text and "### kvbudget's best method vs kvpress's best press" in text
    assert "| r=0.5 |" in text.split("kvpress's best press")[1]


@needs_peer
def test_a_press_that_raises_is_an_error_row_and_the_grid_goes_on(tiny_dir, tmp_path, monkeypatch):
    from kvbudget.eval import peer_rows
    from kvbudget.eval.runner import EvalConfig

    bad = {"press": "SnapKVPress", "kwargs": {"window_size": 10_000}}  # longer than any prompt here
    monkeypatch.setitem(peer_rows.PRESSES, "bad", bad)
    config = EvalConfig(model=str(tiny_dir), tasks=["needle_filler"], lengths=[200], methods=["full"],
                        budgets=[], compression_ratios=[0.5], limit=2)  # fmt: skip
    added = peer_rows.run_peer_rows(config, tmp_path, ["bad", "knorm"], PEER, progress=False)
    assert added == 2 * 2
    rows = {(r["label"], r["sample"]): r for r in load_rows(tmp_path / "results.jsonl")}
    for sample in (0, 1):
        error = rows[("kvpress:bad", sample)]["error"]
        assert error.startswith("AssertionError: Query length") and "\n" not in error
        assert rows[("kvpress:bad", sample)]["score"] is None
        assert rows[("kvpress:knorm", sample)]["error"] is None
    assert peer_rows.run_peer_rows(config, tmp_path, ["bad", "knorm"], PEER, progress=False) == 0


# ---------------------------------------------------------------------------------------- shared context
SHARED_CONTEXT_TEXT = "The cat sat on the mat. " * 6 + "Key alpha is 417. " + "Rain fell in the hills. " * 6


def _shared_samples(tokenizer, length, num_samples, seed):
    from kvbudget.eval.sample import FollowUp, Sample

    follow = [FollowUp("Where did the cat sit?", ["mat"], "A:", 6), FollowUp("What fell?", ["rain"], "A:", 6)]
    return [
        Sample(SHARED_CONTEXT_TEXT, "What is key alpha?" + " " * i, ["417"], "A:", 6, {}, follow_ups=follow)
        for i in range(num_samples)
    ]


@needs_peer
def test_kvpress_answers_a_shared_context_as_separate_requests_like_ours(tiny_dir, tmp_path, monkeypatch):
    from kvbudget.eval import peer_rows
    from kvbudget.eval import runner as runner_module
    from kvbudget.eval.metrics import string_match_all
    from kvbudget.eval.runner import EvalConfig, Runner
    from kvbudget.eval.tasks.base import TaskSpec

    task = TaskSpec("tiny_shared", "shared-context", _shared_samples, string_match_all, "string_match_all")
    monkeypatch.setattr(runner_module, "get_task", lambda name: task)
    config = EvalConfig(
        model=str(tiny_dir), tasks=["tiny_shared"], lengths=[0], methods=["full", SNAP_AS_KVPRESS],
        budgets=[], compression_ratios=[0.5], limit=2, compress_context_only=True,
    )  # fmt: skip
    Runner(config, tmp_path, progress=False).run()
    added = peer_rows.run_peer_rows(config, tmp_path, ["snapkv", "no_press"], PEER, progress=False)
    assert added == 2 * 2
    rows = load_rows(tmp_path / "results.jsonl")
    peer = [r for r in rows if r["label"].startswith("kvpress:")]
    assert all(r["error"] is None and r["conversation"] == "multi-request" for r in peer)
    ours = {(r["label"], r["sample"]): r for r in rows if r.get("conversation") == "multi-request"}
    for r in peer:
        assert [t["turn"] for t in r["turns"]] == [1, 2, 3]
        assert r["score"] == pytest.approx(sum(t["score"] for t in r["turns"]) / 3)
        counterpart = "full" if r["label"] == "kvpress:no_press" else SNAP_AS_KVPRESS
        mine = ours[(counterpart, r["sample"])]
        assert [t["prediction"] for t in r["turns"]] == [t["prediction"] for t in mine["turns"]], r["label"]
        assert [t["full_prediction"] for t in r["turns"]] == [
            t["prediction"] for t in ours[("full", r["sample"])]["turns"]
        ]
    # question-aware: kvpress's pipeline does not share a context it compressed with a question
    aware = EvalConfig(**{**config.__dict__, "compress_context_only": False})
    assert peer_rows.run_peer_rows(aware, tmp_path / "aware", ["snapkv"], PEER, progress=False) == 0


@needs_peer
def test_a_shared_context_on_transformers_quantized_cache_answers_each_request_from_the_same_context(
    tmp_path, monkeypatch
):
    """The equal-bytes anchors on the shared-context tasks: each later question a request on a copy
    of the context's QuantizedCache (quanto's tensors cannot be deep-copied). The same question
    asked second and fourth gets the same answer: no request leaves anything in the context's cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY
    from kvbudget.eval import peer_rows
    from kvbudget.eval import runner as runner_module
    from kvbudget.eval.metrics import string_match_all
    from kvbudget.eval.runner import EvalConfig
    from kvbudget.eval.sample import FollowUp, Sample
    from kvbudget.eval.tasks.base import TaskSpec

    torch.manual_seed(3)
    model_dir = tmp_path / "tiny64"
    LlamaForCausalLM(LlamaConfig(**{**TINY, "head_dim": 64}, initializer_range=0.2)).save_pretrained(
        model_dir
    )
    tiny_tokenizer(True).save_pretrained(model_dir)

    def samples(tokenizer, length, num_samples, seed):
        cat, rain = (
            FollowUp("Where did the cat sit?", ["mat"], "A:", 6),
            FollowUp("What fell?", ["rain"], "A:", 6),
        )
        return [
            Sample(
                SHARED_CONTEXT_TEXT * 8,
                "What is key alpha?",
                ["417"],
                "A:",
                6,
                {},
                follow_ups=[cat, rain, cat],
            )
        ]

    task = TaskSpec("tiny_shared", "shared-context", samples, string_match_all, "string_match_all")
    monkeypatch.setattr(runner_module, "get_task", lambda name: task)
    config = EvalConfig(
        model=str(model_dir), tasks=["tiny_shared"], lengths=[0], methods=["full"], budgets=[],
        compression_ratios=[0.5], limit=1, compress_context_only=True,
    )  # fmt: skip
    added = peer_rows.run_peer_rows(
        config, tmp_path / "run", ["no_press+quanto4", "no_press"], PEER, progress=False
    )
    assert added == 2
    rows = {r["label"]: r for r in load_rows(tmp_path / "run" / "results.jsonl")}
    four, plain = rows["kvpress:no_press+quanto4"], rows["kvpress:no_press"]
    assert four["error"] is None, four["error"]
    assert [t["turn"] for t in four["turns"]] == [1, 2, 3, 4]
    assert four["turns"][1]["prediction"] == four["turns"][3]["prediction"]
    assert four["physical_bytes"] < plain["physical_bytes"]


def test_a_press_on_transformers_quantized_cache_is_named_with_its_cache():
    from kvbudget.eval import peer_rows

    assert peer_rows.press_names(["SnapKV+quanto4", "no-press+quanto2"]) == [
        "snapkv+quanto4",
        "no_press+quanto2",
    ]
    spec = peer_rows.PressSpec.of("snapkv+quanto4")
    assert spec.press == "snapkv" and spec.kv_bits == 4 and spec.label == "kvpress:snapkv+quanto4"
    assert ("cache", json.dumps(peer_rows.CACHES["quanto4"], sort_keys=True)) in spec.options
    (job,) = peer_rows.make_jobs(["no_press+quanto2"], [0.5], question_aware=False)
    assert job["cache"]["nbits"] == 2 and job["compression_ratio"] is None
    for bad, why in (("snapkv+quanto3", "unknown cache 'quanto3'"), ("all+quanto4", "one by one"),
                     ("nopress+quanto4", "unknown kvpress press")):  # fmt: skip
        with pytest.raises(KVBudgetError, match=why):
            peer_rows.press_names([bad])


@needs_peer
def test_transformers_quantized_cache_rows_store_fewer_bytes(tmp_path):
    """The equal-bytes anchors: transformers' QuantizedCache (quanto) alone and under a press, in
    kvpress's environment; a row's bytes are the cache's as stored, codes, scales and shifts. Heads
    of 64 channels: quanto's groups of 64 along axis 0 must divide a layer's tokens × channels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY

    torch.manual_seed(3)
    model_dir = tmp_path / "tiny64"
    LlamaForCausalLM(LlamaConfig(**{**TINY, "head_dim": 64}, initializer_range=0.2)).save_pretrained(
        model_dir
    )
    tiny_tokenizer(True).save_pretrained(model_dir)
    out = tmp_path / "run"
    result = _eval(model_dir, out, True, presses="no_press,no_press+quanto4,no_press+quanto2,snapkv+quanto4")
    assert result.exit_code == 0, result.output + str(result.exception)
    rows = load_rows(out / "results.jsonl")
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]]
    by = {(r["label"], r["sample"], r["compression_ratio"]): r for r in rows}
    for s in (0, 1):
        plain = by[("kvpress:no_press", s, None)]
        four, two = by[("kvpress:no_press+quanto4", s, None)], by[("kvpress:no_press+quanto2", s, None)]
        assert four["kv_bits"] == 4 and "QuantizedCache" in four["peer"]["cache"]
        assert four["kept_entries"] == plain["kept_entries"]  # every entry kept, quantized
        # the context's entries: float32 against 4-bit codes with a float32 scale and shift per group
        # of 64 numbers (0.156 of the bytes); the question's entries follow in full precision in all three
        context = plain["kept_entries"] * 2 * 64 * 4
        question = plain["physical_bytes"] - context
        assert four["physical_bytes"] - question == pytest.approx(context * (0.5 + 8 / 64) / 4, rel=0.01)
        assert two["physical_bytes"] - question == pytest.approx(context * (0.25 + 8 / 64) / 4, rel=0.01)
        pressed = by[("kvpress:snapkv+quanto4", s, 0.75)]
        assert (
            pressed["kept_entries"] < four["kept_entries"]
            and pressed["physical_bytes"] < four["physical_bytes"]
        )
