"""``kvbudget bench throughput``: the largest batch under a memory cap, and its tokens per second."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import TINY, tiny_model, tiny_tokenizer
from kvbudget.bench.throughput import ThroughputConfig, find_batch, fit_line, measure_all, parse_size
from kvbudget.cli import app
from kvbudget.errors import KVBudgetError

HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]


def _kv_bytes_per_entry_all_layers() -> int:
    """Key + value bytes of one token in every layer and KV head of the tiny model, float32."""
    return TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * 2 * HEAD_DIM * 4


# ---------------------------------------------------------------------------- sizes and options
def test_parse_size_reads_binary_and_decimal_units() -> None:
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512 MiB") == 512 * 1024**2
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_size("64kib") == 64 * 1024


@pytest.mark.parametrize("bad", ["0", "0GiB", "-1GiB", "lots", "2XB", "", "1e9", "0.0001KiB"])
def test_parse_size_rejects_what_is_not_a_positive_size(bad: str) -> None:
    with pytest.raises(KVBudgetError) as err:
        parse_size(bad)
    assert "--memory-cap" in str(err.value) and "\n" not in str(err.value)


def test_config_validation_rejects_bad_options() -> None:
    bad = [
        ThroughputConfig(memory_cap=0),
        ThroughputConfig(cap_on="prefill"),
        ThroughputConfig(max_batch=0),
        ThroughputConfig(budgets=[0]),
        ThroughputConfig(budgets=[4]),  # below h2o's sinks + window
        ThroughputConfig(lengths=[-5]),
        ThroughputConfig(methods=["nope"]),
        ThroughputConfig(methods=[]),
        ThroughputConfig(new_tokens=1),
        ThroughputConfig(repeats=0),
        ThroughputConfig(dtype="float8"),
        ThroughputConfig(device="tpu"),
        ThroughputConfig(task="nope"),
    ]
    for config in bad:
        with pytest.raises(KVBudgetError):
            config.validate()
    ThroughputConfig().validate()
    cases = ThroughputConfig(methods=["full", "h2o"], budgets=[64, 128], lengths=[256, 512]).cases()
    assert cases == [
        ("full", 256, None), ("h2o", 256, 64), ("h2o", 256, 128),
        ("full", 512, None), ("h2o", 512, 64), ("h2o", 512, 128),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["--memory-cap", "0"],
        ["--memory-cap", "-3GiB"],
        ["--memory-cap", "plenty"],
        ["--memory-cap", "2XB"],
        ["--cap-on", "prefill"],
        ["--max-batch", "0"],
        ["--methods", "full,nope"],
        ["--budgets", "0"],
    ],
)
def test_cli_bad_options_are_one_line_errors_before_the_model_loads(
    args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvbudget.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(kvbudget.models, "load_model", no_load)
    result = CliRunner().invoke(app, ["bench", "throughput", "--model", "/nonexistent/model", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output


# ---------------------------------------------------------------------------- the search
class Recorder:
    """A synthetic memory curve ``{key: f(batch)}`` that records which batches were run."""

    def __init__(self, f) -> None:
        self.f, self.batches = f, []

    def __call__(self, batch: int) -> dict:
        self.batches.append(batch)
        return {"batch": batch, "m": self.f(batch)}


def test_find_batch_on_a_line_never_runs_beyond_the_answer() -> None:
    measure = Recorder(lambda b: 1000 + 300 * b)
    search = find_batch(measure, cap=4000, key="m", max_batch=64)
    assert search.batch == 10 and search.limited_by == "cap" and search.converged  # 1000 + 3000 = cap
    assert 1000 + 300 * 11 > 4000
    assert max(measure.batches) <= 10  # nothing beyond the answer is run
    assert search.fit.per_row == pytest.approx(300) and search.fit.fixed == pytest.approx(1000)
    assert search.fit.at(11) > 4000
    checked = Recorder(lambda b: 1000 + 300 * b)
    search = find_batch(checked, cap=4000, key="m", max_batch=64, check_next=True)
    assert search.batch == 10 and search.runs[11]["m"] > 4000 and max(checked.batches) == 11


def test_find_batch_with_only_one_row_fitting_measures_two() -> None:
    measure = Recorder(lambda b: 700 * b)
    search = find_batch(measure, cap=1000, key="m", max_batch=64)
    assert search.batch == 1 and sorted(measure.batches) == [1, 2]


def test_find_batch_when_one_row_does_not_fit_or_max_batch_binds() -> None:
    search = find_batch(Recorder(lambda b: 5000 * b), cap=1000, key="m", max_batch=64)
    assert search.batch == 0 and search.limited_by == "one row exceeds the cap"
    measure = Recorder(lambda b: 10 * b)
    search = find_batch(measure, cap=10_000, key="m", max_batch=6)
    assert search.batch == 6 and search.limited_by == "max_batch" and max(measure.batches) == 6


@pytest.mark.parametrize(
    "curve", [lambda b: 100 * b + 7 * b * b, lambda b: 900 + 150 * b + (37 * b) % 11, lambda b: 400 * b**0.8]
)
def test_find_batch_finds_the_largest_fitting_batch_off_a_line(curve) -> None:
    cap = 5000
    truth = max(b for b in range(1, 200) if curve(b) <= cap)
    measure = Recorder(curve)
    search = find_batch(measure, cap=cap, key="m", max_batch=200, max_runs=12, check_next=True)
    assert search.batch == truth and curve(truth + 1) > cap and search.converged
    assert search.runs[truth + 1]["m"] > cap and len(measure.batches) <= 9
    assert all(search.runs[b]["m"] <= cap for b in search.runs if b <= search.batch)


def test_find_batch_treats_a_run_out_of_memory_as_not_fitting() -> None:
    runs = []

    def measure(batch: int) -> dict:
        runs.append(batch)
        return {"batch": batch, "m": None if batch > 6 else 100 * batch}  # OOM past 6 rows

    search = find_batch(measure, cap=10_000, key="m", max_batch=64, max_runs=20)
    assert search.batch == 6


def test_fit_line_is_least_squares_and_through_the_origin_for_one_point() -> None:
    one = fit_line({3: 600})
    assert (one.fixed, one.per_row) == (0.0, 200.0)
    fit = fit_line({1: 110, 2: 190, 3: 310})  # least squares: slope 100, intercept 3.33
    assert fit.per_row == pytest.approx(100) and fit.fixed == pytest.approx(10 / 3)
    assert fit.largest_under(403) == 3 and fit.largest_under(404) == 4


# ---------------------------------------------------------------------------- a tiny model
@pytest.fixture(scope="module")
def tight_result() -> dict:
    """full, h2o, streamingllm and d2o at a cap of about 3.4 full rows (200-token prompt, 8 new)."""
    model, tokenizer = tiny_model("qwen2"), tiny_tokenizer(chat_template=True)
    full_row = (200 + 8) * _kv_bytes_per_entry_all_layers()  # the full cache's kept entries, one row
    config = ThroughputConfig(
        model="tiny", methods=["full", "h2o", "streamingllm", "d2o"], budgets=[32], lengths=[200],
        new_tokens=8, memory_cap=int(3.4 * full_row), dtype="float32", check_next=True,
    )  # fmt: skip
    config.validate()
    return measure_all(model, tokenizer, config)


def test_the_chosen_batch_is_the_largest_that_fits(tight_result: dict) -> None:
    cap = tight_result["memory"]["cap_bytes"]
    assert tight_result["memory"]["kind"] == "kv_peak_physical_bytes"
    for row in tight_result["rows"]:
        runs = {r["batch"]: r for r in row["runs"]}
        b = row["batch"]
        assert b >= 1 and row["fits"]
        assert runs[b]["run_peak_bytes"] <= cap < runs[b + 1]["run_peak_bytes"], row["method"]
        assert row["next_batch_bytes"] == runs[b + 1]["run_peak_bytes"]
        assert row["memory_bytes"] == runs[b]["run_peak_bytes"]
        # the KV cache's bytes grow exactly with the rows (the same prompt in every row)
        for batch, run in runs.items():
            assert run["run_peak_bytes"] == batch * runs[1]["run_peak_bytes"]
            assert run["decode_steps"] == 7 and run["decode_tok_s"] > 0


def test_memory_counts_the_cache_the_method_holds(tight_result: dict) -> None:
    rows = {r["method"]: r for r in tight_result["rows"]}
    per_entry = _kv_bytes_per_entry_all_layers()
    prompt = rows["full"]["prompt_tokens"]
    full_one = rows["full"]["runs"][0]
    # the full cache holds every prompt and decoded token (the last token is never fed back)
    assert full_one["decode_peak_bytes"] >= (prompt + 7) * per_entry
    h2o_one = rows["h2o"]["runs"][0]
    # h2o holds its budget while decoding: 32 entries per head and layer, plus the slot a new token takes
    assert 32 * per_entry <= h2o_one["decode_peak_bytes"] < full_one["decode_peak_bytes"] / 2
    # d2o keeps the whole prompt until its layer budgets are set (after the last layer), then its budget
    d2o_one = rows["d2o"]["runs"][0]
    assert d2o_one["prefill_peak_bytes"] >= prompt * per_entry
    assert d2o_one["decode_peak_bytes"] < full_one["decode_peak_bytes"] / 2


def test_a_compressing_method_fits_a_larger_batch_than_full(tight_result: dict) -> None:
    rows = {r["method"]: r for r in tight_result["rows"]}
    assert rows["full"]["batch"] in (2, 3)
    for method in ("h2o", "streamingllm"):
        assert rows[method]["batch"] > 2 * rows["full"]["batch"], method
        assert rows[method]["batch_vs_full"] == rows[method]["batch"] / rows["full"]["batch"]
    # d2o's prefill holds the whole prompt: under a cap on the whole run it gains little over full,
    # under a cap on the decoding alone it fits what its budget allows
    assert rows["d2o"]["batch"] <= rows["full"]["batch"] + 1
    assert rows["d2o"]["batch_if_cap_on_decode"] > 2 * rows["full"]["batch_if_cap_on_decode"]


def test_cap_on_decode_runs_the_batch_its_decoding_fits() -> None:
    model, tokenizer = tiny_model("qwen2"), tiny_tokenizer(chat_template=True)
    full_row = (200 + 8) * _kv_bytes_per_entry_all_layers()
    config = ThroughputConfig(
        model="tiny", methods=["full", "d2o"], budgets=[32], lengths=[200], new_tokens=8,
        memory_cap=int(3.4 * full_row), cap_on="decode", dtype="float32", check_next=True,
    )  # fmt: skip
    rows = {r["method"]: r for r in measure_all(model, tokenizer, config)["rows"]}
    d2o = rows["d2o"]
    runs = {r["batch"]: r for r in d2o["runs"]}
    assert (
        runs[d2o["batch"]]["decode_peak_bytes"]
        <= config.memory_cap
        < runs[d2o["batch"] + 1]["decode_peak_bytes"]
    )
    assert d2o["batch"] > 2 * rows["full"]["batch"]


def test_cli_writes_json_markdown_and_plot(tmp_path: Path) -> None:
    model, tokenizer = tiny_model("qwen2"), tiny_tokenizer(chat_template=True)
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cap = 3 * (150 + 4) * _kv_bytes_per_entry_all_layers()
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["bench", "throughput", "--model", str(model_dir), "--dtype", "float32", "--methods", "full,h2o",
         "--budgets", "32", "--lengths", "150", "--new-tokens", "4", "--memory-cap", str(cap),
         "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads((out / "throughput.json").read_text())
    assert data["memory"]["cap_bytes"] == cap and data["memory"]["cap_on"] == "run"
    assert data["memory"]["kind"] == "kv_peak_physical_bytes" and data["machine"]["device"] == "cpu"
    assert data["weight_bytes"] > 0 and data["config"]["methods"] == ["full", "h2o"]
    fields = {
        "method", "budget", "length", "prompt_tokens", "new_tokens", "batch", "fits", "limited_by",
        "bytes_per_row", "memory_bytes", "predicted_next_bytes", "decode_tok_s", "total_tok_s", "tpot_s",
        "prefill_s", "decode_s", "batch_vs_full", "decode_tok_s_vs_full", "batch_if_cap_on_run",
        "batch_if_cap_on_decode", "batch1_decode_tok_s", "runs",
    }  # fmt: skip
    for row in data["rows"]:
        assert fields <= set(row), fields - set(row)
        assert row["memory_bytes"] <= cap < row["predicted_next_bytes"]
    full, h2o = data["rows"]
    assert full["method"] == "full" and full["budget"] is None and h2o["budget"] == 32
    assert h2o["batch"] > full["batch"] and full["decode_tok_s_vs_full"] == 1.0
    report = (out / "throughput.md").read_text()
    assert "| h2o | 32 |" in report and "kv_peak_physical_bytes" in report
    assert (out / "throughput.png").stat().st_size > 0
