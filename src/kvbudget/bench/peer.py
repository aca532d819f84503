"""Side by side with NVIDIA kvpress: accuracy and wall time of matching (method, press) pairs.

Samples come from kvbudget's task generators and are exported as token ids (chat template,
context / question split) to ``DIR/samples.jsonl``, so both libraries read identical tokens. Both
sides compress in the prefill only and decode greedily to the same EOS ids: question-agnostic by
default, as kvpress's pipeline (the context prefilled and compressed, the question appended
uncompressed); ``question_aware`` compresses context and question together. Our decode-stage
methods run with the session detached after the prefill, since kvpress presses do not evict while
decoding. The ``full`` pair (our ``full`` ↔ no press) is the accuracy ceiling; it runs once per
sample, without a budget.

kvpress runs in its own environment (``make peer`` → ``.venv-peer``) through the standalone
:mod:`kvbudget.peer.kvpress_runner`; ours runs in :mod:`kvbudget.bench.ours_runner`, a process of
the same layout. Each serves one (sample, job) per request after one untimed warm-up run, and
every (repeat, sample, job) runs on both sides back to back, the side that goes first alternating:
the machine's speed drifts over minutes, which whole passes per side would turn into a bias.
Wall time runs from the start of the prefill to the last token (counting the cache is not timed).

:data:`PEERS` pairs each of our methods with the press and options that match it; where the
algorithms still differ, ``docs/benchmarks.md`` says how.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvbudget.errors import KVBudgetError
from kvbudget.eval.peer_rows import PRESSES
from kvbudget.peer.environment import RunnerServer, peer_python_path, runner_script

#: our method spec ↔ kvpress press (name, options; ``inner`` for wrapper presses; ``attn`` when
#: the press needs another attention implementation). kvpress's SnapKV defaults: window 64,
#: kernel 5, average pooling, mean over window rows, GQA mean.
_SNAP = {"window_size": 64, "kernel_size": 5}
_OUR_SNAP = "window=64,kernel=5,pooling=avg,reduce_rows=mean"
PEERS: dict[str, tuple[str, dict[str, Any]]] = {
    "snapkv": (f"snapkv:{_OUR_SNAP}", {"press": "SnapKVPress", "kwargs": _SNAP}),
    "streamingllm": ("streamingllm:sinks=4", {"press": "StreamingLLMPress", "kwargs": {"n_sink": 4}}),
    "knorm": ("knorm", {"press": "KnormPress"}),
    "pyramidkv": (
        f"pyramidkv:{_OUR_SNAP},beta=20",
        {"press": "PyramidKVPress", "kwargs": {**_SNAP, "beta": 20}},
    ),
    "ada-snapkv": (
        f"ada-snapkv:{_OUR_SNAP},floor_alpha=0.2",
        {
            "press": "AdaKVPress",
            "inner": {"press": "SnapKVPress", "kwargs": _SNAP},
            "kwargs": {"alpha_safeguard": 0.2},
        },
    ),  # fmt: skip
    "tova": ("tova", {"press": "TOVAPress"}),
    "h2o": ("h2o:heavy_fraction=1.0", {"press": "ObservedAttentionPress", "attn": "eager"}),
    "full": ("full", {"press": None}),  # the reference: no compression on either side
}
#: the question-agnostic family (issue #48), each paired as its kvpress oracle test pairs it
#: (``tests/test_kvpress_oracle.py``: same kept positions): the presses' settings are those of the
#: leaderboard's ``kvpress:NAME`` rows (:data:`kvbudget.eval.peer_rows.PRESSES`); ``seed``: the
#: runner seeds the sketches' generator; ``kvzap_weights``: the model's trained surrogate of that
#: kind (``kvbudget train kvzap``), handed to both sides
AGNOSTIC_PEERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (our spec, kvpress press name, extra job fields)
    "kvzip": ("kvzip", "kvzip", {}),
    "kvzip+": ("kvzip+", "kvzip_plus", {}),
    "kvgrad": ("kvgrad", "kvgrad", {}),
    "leverage": ("leverage", "leverage", {"seed": 0}),
    "compactor": ("compactor", "compactor", {"seed": 0}),
    "expected-attention": ("expected-attention:floor=kvpress", "expected_attention", {}),
    "kvzap": ("kvzap", "kvzap", {"kvzap_weights": "mlp"}),
    "kvzap-linear": ("kvzap:kind=linear", "kvzap", {"kvzap_weights": "linear"}),
}


def _agnostic_peers() -> dict[str, tuple[str, dict[str, Any]]]:
    kvzap = {"kvzap": {"press": "KVzapPress", "kwargs": {"model_type": "mlp"}},
             "kvzap-linear": {"press": "KVzapPress", "kwargs": {"model_type": "linear"}}}  # fmt: skip
    return {
        name: (spec, {**(kvzap[name] if press == "kvzap" else PRESSES[press]), **extra})
        for name, (spec, press, extra) in AGNOSTIC_PEERS.items()
    }


PEERS.update(_agnostic_peers())

#: seconds between two timed runs, a precaution: the side that just finished may still have
#: OpenMP threads spin-waiting on the cores as the other side starts
SETTLE_S = 0.3


@dataclass
class PeerConfig:
    model: str = "smollm2-135m"
    tasks: list[str] = field(default_factory=lambda: ["needle"])
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    limit: int = 5
    methods: list[str] = field(default_factory=lambda: [m for m in PEERS if m not in AGNOSTIC_PEERS])
    budgets: list[int] = field(default_factory=lambda: [128, 256, 512])
    dtype: str = "float32"
    seed: int = 0
    peer_python: str = ".venv-peer/bin/python"
    question_aware: bool = False
    repeats: int = 1

    def validate(self) -> None:
        unknown = [m for m in self.methods if m not in PEERS]
        if unknown:
            raise KVBudgetError(
                f"no kvpress counterpart for {', '.join(unknown)}: expected some of {', '.join(PEERS)}"
            )
        if self.limit < 1:
            raise KVBudgetError(f"limit must be ≥ 1, got {self.limit}")
        if self.repeats < 1:
            raise KVBudgetError(f"repeats must be ≥ 1, got {self.repeats}")
        if not self.budgets or any(b <= 0 for b in self.budgets):
            raise KVBudgetError(f"budgets must be positive integers, got {self.budgets}")


def export_samples(config: PeerConfig, tokenizer, eos: set[int], path: Path) -> list[dict[str, Any]]:
    """Generate the samples with our task generators and write them as token ids (JSONL)."""
    from kvbudget.engine import build_prompt
    from kvbudget.eval.tasks import get_task

    rows = []
    for task_name in config.tasks:
        task = get_task(task_name)
        for length in config.lengths:
            for i, s in enumerate(task.make_samples(tokenizer, length, config.limit, config.seed)):
                prompt = build_prompt(tokenizer, s.context, s.question, s.answer_prefix)
                rows.append({
                    "id": f"{task_name}/{length}/{i}", "task": task_name, "length": length,
                    "context_ids": prompt.context_ids, "question_ids": prompt.question_ids,
                    "answers": s.answers, "max_new_tokens": s.max_new_tokens, "eos_ids": sorted(eos),
                })  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def make_jobs(config: PeerConfig) -> list[dict[str, Any]]:
    """One job per (method, budget) — ``full`` once, with budget None — compressed methods first
    (both sides warm up on the first job)."""
    methods = sorted(config.methods, key=lambda m: m == "full")
    return [
        {**PEERS[m][1], "method": m, "budget": b, "question_aware": config.question_aware}
        for m in methods
        for b in ([None] if m == "full" else config.budgets)
    ]


def with_surrogates(jobs: list[dict[str, Any]], model) -> list[dict[str, Any]]:
    """KVzap's jobs with the path of ``model``'s trained surrogate of their kind (both sides load it);
    refused in one line when the model has none."""
    from kvbudget.methods.kvzap_surrogate import trained_surrogate_path

    out = []
    for job in jobs:
        kind = job.get("kvzap_weights")
        if kind in ("linear", "mlp"):
            job = {**job, "kvzap_weights": str(trained_surrogate_path(model, kind, job["method"]))}
        out.append(job)
    return out


def run_ours(
    model, sample: dict[str, Any], method: str, budget: int | None, question_aware: bool = False
) -> dict[str, Any]:
    """One sample through our method, compression in the prefill only; ``budget`` None: ``full``.

    The row: the decoded ``token_ids``, ``wall_s`` (prefill to last token), ``prefill_s`` (the
    compressed prefill and the appended question: the time to the first token's logits),
    ``kept_entries`` after the prefill (the compressed prompt: question-agnostic, the context alone,
    as kvpress counts) and ``final_entries`` after decoding (every entry, the question and decoded
    tokens included).
    """
    import torch

    from kvbudget.engine import Prompt, decode_loop, prefill
    from kvbudget.eval.runner import MethodSpec
    from kvbudget.session import CompressionSession

    method_obj = MethodSpec.parse(PEERS[method][0]).build()
    prompt = Prompt(sample["context_ids"], sample["question_ids"])
    limit = budget if budget is not None else len(prompt.context_ids) + len(prompt.question_ids)
    session = CompressionSession(method_obj, model.config.num_hidden_layers, budget=limit)
    with torch.inference_mode():
        start = time.perf_counter()
        cache, logits, mask, last = prefill(
            model, [prompt], session, 0, compress_context_only=not question_aware
        )
        prefill_s = time.perf_counter() - start
        kept = cache.stats().logical_bytes  # not timed
        cache.session = None  # kvpress presses evict only in the prefill
        resumed = time.perf_counter()
        eos = set(sample["eos_ids"])
        decoded = decode_loop(model, cache, logits, mask, last, eos, sample["max_new_tokens"], trace=False)
        wall_s = prefill_s + time.perf_counter() - resumed
    entry = cache.layers[0].entry_bytes()
    appended = 0 if question_aware else len(sample["question_ids"])
    question = model.config.num_hidden_layers * model.config.num_key_value_heads * appended
    return {
        "sample": sample["id"], "method": method, "budget": budget, "token_ids": decoded.generated[0],
        "wall_s": wall_s, "prefill_s": prefill_s, "kept_entries": kept // entry - question,
        "final_entries": cache.stats().logical_bytes // entry,
    }  # fmt: skip


def _runner_args(model: str | Path, samples: Path, jobs_path: Path, dtype: str) -> list[str]:
    """The arguments both runners take to serve (warm-up on)."""
    return ["--model", str(model), "--samples", str(samples), "--jobs", str(jobs_path), "--dtype", dtype,
            "--warmup"]  # fmt: skip


def kvpress_server(python: Path, model_dir: Path, samples: Path, jobs_path: Path, dtype: str) -> RunnerServer:
    """kvpress's runner, serving, in the peer environment (``python -P`` and no ``PYTHONPATH``: this
    checkout's kvbudget stays off its path); its log is ``kvpress.log`` beside ``jobs_path``."""
    command = [str(python), "-P", str(runner_script()), *_runner_args(model_dir, samples, jobs_path, dtype)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return RunnerServer("kvpress", [*command, "--serve"], jobs_path.with_name("kvpress.log"), env)


def ours_server(model: str, samples: Path, jobs_path: Path, dtype: str) -> RunnerServer:
    """Our runner, serving, with this process's Python and environment; its log is ``ours.log``."""
    args = _runner_args(model, samples, jobs_path, dtype)
    command = [sys.executable, "-m", "kvbudget.bench.ours_runner", *args]
    return RunnerServer("kvbudget", command, jobs_path.with_name("ours.log"), dict(os.environ))


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(
    samples: list[dict[str, Any]], ours: list[dict[str, Any]], theirs: list[dict[str, Any]], tokenizer
) -> list[dict[str, Any]]:
    """Per (task, length, method, budget), over every run (samples × repeats) that both sides made:
    each side's accuracy (our task's metric on the decoded text), the share of runs whose token ids
    are identical, each side's wall seconds per run (mean and standard deviation) and the ratio of
    the means, ours / kvpress."""
    from kvbudget.eval.tasks import get_task

    by_id = {s["id"]: s for s in samples}

    def score(row: dict[str, Any]) -> float:
        sample = by_id[row["sample"]]
        ids = row["token_ids"]
        ids = ids[:-1] if ids and ids[-1] in sample["eos_ids"] else ids
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return float(get_task(sample["task"]).metric(text, sample["answers"]))

    def key(r: dict[str, Any]) -> tuple:
        return r["sample"], r["method"], r["budget"], r.get("repeat", 0)

    theirs_by = {key(r): r for r in theirs}
    groups: dict[tuple[str, int, str, int | None], list[tuple[dict, dict]]] = {}
    for r in ours:
        if key(r) in theirs_by:
            sample = by_id[r["sample"]]
            groups.setdefault((sample["task"], sample["length"], r["method"], r["budget"]), []).append(
                (r, theirs_by[key(r)])
            )
    rows = []
    for (task, length, method, budget), pairs in groups.items():
        press = PEERS[method][1]
        label = "no press" if press["press"] is None else press["press"]
        row: dict[str, Any] = {
            "task": task, "length": length, "method": method, "budget": budget, "runs": len(pairs),
            "samples": len({a["sample"] for a, _ in pairs}), "ours_spec": PEERS[method][0],
            "press": label + (f"({press['inner']['press']})" if "inner" in press else ""),
            "ours_accuracy": statistics.mean(score(a) for a, _ in pairs),
            "kvpress_accuracy": statistics.mean(score(b) for _, b in pairs),
            "same_answer": sum(a["token_ids"] == b["token_ids"] for a, b in pairs) / len(pairs),
        }  # fmt: skip
        for side, runs in (("ours", [a for a, _ in pairs]), ("kvpress", [b for _, b in pairs])):
            row[f"{side}_wall_s"], row[f"{side}_wall_sd"] = _mean_sd([r["wall_s"] for r in runs])
        row["wall_ratio"] = row["ours_wall_s"] / row["kvpress_wall_s"]
        rows.append(row)
    # per task and length: the full-cache reference first, then methods and budgets
    return sorted(
        rows, key=lambda r: (r["task"], r["length"], r["method"] != "full", r["method"], r["budget"] or 0)
    )


def markdown(config: PeerConfig, rows: list[dict[str, Any]], versions: str) -> str:
    """``peer.md``: one line per row of :func:`summarise` (in its order)."""
    lines = [
        "# kvbudget vs kvpress",
        "",
        f"Model `{config.model}` ({config.dtype}); {config.limit} samples per task and length; "
        f"{'question-aware' if config.question_aware else 'question-agnostic'}, compression in the "
        f"prefill only, greedy; {config.repeats} repeat(s), the sides interleaved run by run. {versions}.",
        "",
        "Accuracy: our task metric on each side's answers, over every run. Same answer: runs whose "
        "token ids are identical on both sides. Wall: seconds per run from the prefill to the last "
        "token, mean ± standard deviation; ratio = ours / kvpress of the means. `full` (no "
        "compression, no press) is the accuracy ceiling.",
        "",
        "| task | length | ours | kvpress | budget | runs | accuracy ours / kvpress | same answer "
        "| wall s ours | wall s kvpress | wall ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = "—" if r["budget"] is None else str(r["budget"])
        lines.append(
            f"| {r['task']} | {r['length']} | `{r['ours_spec']}` | {r['press']} | {budget} | {r['runs']} | "
            f"{100 * r['ours_accuracy']:.0f} / {100 * r['kvpress_accuracy']:.0f} | "
            f"{100 * r['same_answer']:.0f}% | {r['ours_wall_s']:.2f} ± {r['ours_wall_sd']:.2f} | "
            f"{r['kvpress_wall_s']:.2f} ± {r['kvpress_wall_sd']:.2f} | {r['wall_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _versions(python: Path) -> str:
    import transformers

    code = (
        "import importlib.metadata as m\n"
        "print('kvpress', m.version('kvpress'), '/ transformers', m.version('transformers'))"
    )
    peer = subprocess.run([str(python), "-P", "-c", code], capture_output=True, text=True).stdout.strip()
    return f"{peer} vs ours on transformers {transformers.__version__}"


def run_peer(config: PeerConfig, out: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Export samples; run every (repeat, sample, method, budget) on both sides, interleaved; write
    each side's runs to ``kvpress.jsonl`` / ``ours.jsonl`` (field ``repeat``), the summary to
    ``peer.json`` and ``peer.md``; returns the path of ``peer.json``."""
    from kvbudget.engine import eos_ids
    from kvbudget.models import load_model, resolve_source

    config.validate()
    python = peer_python_path(config.peer_python)
    if python is None:
        raise KVBudgetError(f"no kvpress environment at {config.peer_python}: run `make peer` first")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _msg: None)
    model, tokenizer = load_model(config.model, dtype=config.dtype)
    samples = export_samples(config, tokenizer, eos_ids(model, tokenizer), out / "samples.jsonl")
    jobs = with_surrogates(make_jobs(config), model)
    del model  # the runners load their own copies
    (out / "jobs.json").write_text(json.dumps(jobs, indent=1))
    rows: dict[str, list[dict[str, Any]]] = {"kvpress": [], "ours": []}
    servers = {"kvpress": kvpress_server(python, resolve_source(config.model), out / "samples.jsonl",
                                         out / "jobs.json", config.dtype)}  # fmt: skip
    try:
        servers["ours"] = ours_server(config.model, out / "samples.jsonl", out / "jobs.json", config.dtype)
        for rep in range(config.repeats):
            say(f"kvpress ↔ kvbudget, repeat {rep + 1}/{config.repeats}: {len(samples) * len(jobs)} runs")
            for i in range(len(samples)):
                for j in range(len(jobs)):
                    kvpress_first = (rep + i + j) % 2 == 0
                    for side in ("kvpress", "ours") if kvpress_first else ("ours", "kvpress"):
                        time.sleep(SETTLE_S)
                        rows[side].append({**servers[side].run(i, j), "repeat": rep})
                for side, side_rows in rows.items():  # saved after every sample
                    (out / f"{side}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in side_rows))
    finally:
        for server in servers.values():
            server.close()
    versions = _versions(python)
    summary = summarise(samples, rows["ours"], rows["kvpress"], tokenizer)
    path = out / "peer.json"
    path.write_text(json.dumps({"config": asdict(config), "versions": versions, "rows": summary}, indent=1))
    (out / "peer.md").write_text(markdown(config, summary, versions))
    return path
