"""Side by side with NVIDIA kvpress: the same samples, matching settings, one run.

Samples come from kvbudget's task generators and are exported as token ids (chat template,
context / question split) to ``DIR/samples.jsonl``, so both libraries read identical tokens.
Both run question-agnostic by default, as kvpress's pipeline does: the context is prefilled and
compressed, the question appended uncompressed, then greedy decoding with the same EOS ids
(``question_aware``: context and question are prefilled and compressed together) — and compression
happens only in the prefill (our decode-stage methods are run with the session detached after
the prefill, since kvpress presses do not evict while decoding). kvpress runs in its own
environment (``make peer`` → ``.venv-peer``) through the standalone
:mod:`kvbudget.bench.kvpress_runner` script; ours runs in a process of the same layout,
:mod:`kvbudget.bench.ours_runner` (this Python and environment), never at the same time as
kvpress's. Both sides warm up on one untimed run first; this process only exports the samples,
sends requests and writes the reports, so neither side's timings carry this process's history
(allocations, page-fault state) — each row records its run's ``minor_faults``.

``interleave`` (the default) alternates the sides run by run: one runner process per side stays up
(serving requests, warmed up once) and each (sample, method, budget) runs on both
sides back to back, the side that goes first alternating — the machine's speed drifts by ±10%
over minutes, which whole passes per side turn into a bias. Without it, ``repeats`` alternates
whole passes (kvpress pass, ours pass, kvpress pass, …; each kvpress pass one runner process with
its own warm-up, our passes one serving runner). Every repetition's rows are kept; the summary takes,
per (sample, method, budget), the median time over repeats, and checks that each side decoded the
same token ids in every repeat (greedy decoding should be deterministic). Time is split the same
way on both sides: ``prefill_s`` from the start to the prompt's last logits (compression
included; the question's forward too when question-agnostic), ``decode_s`` from there to the last
token, ``wall_s`` = their sum. The ``full`` pair (our ``full`` method ↔ no press, plain
generation) is the accuracy ceiling: it runs once per sample, without a budget.

:data:`PEERS` pairs each of our methods with the press and options that match it; where the
algorithms still differ (allocation formulas, score normalisation), ``docs/benchmarks.md``
says how.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvbudget.errors import KVBudgetError

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

#: the times split per run (seconds), aggregated by median over repeats
TIMES = ("wall_s", "prefill_s", "decode_s")
#: per-run measures rows may lack (older runs): compression seconds inside the prefill (ours: the
#: session's; kvpress: its press's ``compress``) and the runner's minor page faults
OPTIONAL = ("compress_s", "minor_faults")


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


@dataclass
class PeerConfig:
    model: str = "smollm2-135m"
    tasks: list[str] = field(default_factory=lambda: ["needle"])
    lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    limit: int = 5
    methods: list[str] = field(default_factory=lambda: list(PEERS))
    budgets: list[int] = field(default_factory=lambda: [128, 256, 512])
    dtype: str = "float32"
    seed: int = 0
    peer_python: str = ".venv-peer/bin/python"
    question_aware: bool = False
    repeats: int = 1
    interleave: bool = True

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


def run_ours(
    model, sample: dict[str, Any], method: str, budget: int | None, question_aware: bool = False
) -> dict[str, Any]:
    """One sample through our method: question-agnostic prefill (or ``question_aware``: context and
    question compressed together), compression in the prefill only. ``budget`` None: ``full``."""
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
        stats = cache.stats()  # not timed
        cache.session = None  # kvpress presses evict only in the prefill
        eos = set(sample["eos_ids"])
        resumed = time.perf_counter()
        decoded = decode_loop(model, cache, logits, mask, last, eos, sample["max_new_tokens"], trace=False)
        decode_s = time.perf_counter() - resumed
        final = cache.stats()
    # question-agnostic: count the compressed context only (kvpress counts before the question is fed)
    entry = cache.layers[0].entry_bytes()
    appended = 0 if question_aware else len(sample["question_ids"])
    question = model.config.num_hidden_layers * model.config.num_key_value_heads * appended
    return {
        "sample": sample["id"], "method": method, "budget": budget, "token_ids": decoded.generated[0],
        "prefill_s": prefill_s, "decode_s": decode_s, "wall_s": prefill_s + decode_s,
        "compress_s": session.compress_seconds, "step_s": decoded.step_seconds,
        "kept_entries": stats.logical_bytes // entry - question,
        "allocated_entries": stats.physical_bytes // entry - question,
        "final_entries": final.logical_bytes // entry,
    }  # fmt: skip


def _peer_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the peer environment must not see this checkout's kvbudget
    return env


def _runner_args(
    model: str | Path, samples: Path, jobs: list[dict[str, Any]], jobs_path: Path, dtype: str
) -> list[str]:
    """Write ``jobs`` to ``jobs_path``; the arguments both runners take (warm-up on), without a mode."""
    jobs_path.write_text(json.dumps(jobs, indent=1))
    return ["--model", str(model), "--samples", str(samples), "--jobs", str(jobs_path), "--dtype", dtype,
            "--warmup"]  # fmt: skip


def _runner_command(
    python: Path, model_dir: Path, samples: Path, jobs: list[dict[str, Any]], jobs_path: Path, dtype: str
) -> list[str]:
    """The kvpress runner's command line (``python -P``: the checkout stays off its path)."""
    args = _runner_args(model_dir, samples, jobs, jobs_path, dtype)
    return [str(python), "-P", str(runner_script()), *args]


#: seconds between two timed runs of the interleaved mode, a precaution: the side that just
#: finished may still have OpenMP threads spin-waiting on the 2 cores as the other side starts
SETTLE_S = 0.3


class RunnerServer:
    """A runner process serving one (sample, job) per request — kvpress's (``kvpress_runner.py
    --serve``) or ours (:mod:`kvbudget.bench.ours_runner`) — so the sides can alternate run by run.
    Its stderr goes to ``log``; ``name`` names it in errors."""

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


def kvpress_server(
    python: Path, model_dir: Path, samples: Path, jobs: list[dict[str, Any]], log: Path, dtype: str
) -> RunnerServer:
    """kvpress's runner, serving, in the peer environment (without this checkout on its path)."""
    command = _runner_command(python, model_dir, samples, jobs, log.with_name("jobs.json"), dtype)
    return RunnerServer("kvpress", [*command, "--serve"], log, _peer_env())


def ours_server(model: str, samples: Path, jobs: list[dict[str, Any]], log: Path, dtype: str) -> RunnerServer:
    """Our runner, serving, with this process's Python and environment."""
    args = _runner_args(model, samples, jobs, log.with_name("jobs.json"), dtype)
    command = [sys.executable, "-m", "kvbudget.bench.ours_runner", *args]  # it only serves
    return RunnerServer("kvbudget", command, log, dict(os.environ))


def run_kvpress(
    python: Path, model_dir: Path, samples: Path, jobs: list[dict[str, Any]], out: Path, dtype: str
) -> list[dict[str, Any]]:
    command = _runner_command(python, model_dir, samples, jobs, out.with_name("jobs.json"), dtype)
    proc = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, env=_peer_env())
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise KVBudgetError(f"the kvpress runner failed (exit {proc.returncode}):\n{tail}")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _median_or_none(values: list[float | None]) -> float | None:
    return None if None in values else statistics.median(values)  # type: ignore[type-var]


def run_pairs(
    ours: list[dict[str, Any]], theirs: list[dict[str, Any]]
) -> dict[tuple[str, str, int | None], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Per (sample, method, budget): every (ours, kvpress) pair of runs of the same repeat."""
    by_key = {(r["sample"], r["method"], r["budget"], r.get("repeat", 0)): r for r in theirs}
    pairs: dict[tuple[str, str, int | None], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for r in ours:
        other = by_key.get((r["sample"], r["method"], r["budget"], r.get("repeat", 0)))
        if other is not None:
            pairs.setdefault((r["sample"], r["method"], r["budget"]), []).append((r, other))
    return pairs


def paired_ratio(pairs: list[tuple[dict[str, Any], dict[str, Any]]], key: str = "wall_s") -> dict[str, Any]:
    """Geometric mean of the run-by-run ratios ours / kvpress of ``key`` with its standard error
    (of the log ratios, as a factor: the ratio is known to × / ÷ ``se_factor``), and a verdict:
    ``faster`` / ``slower`` when the ratio is more than two standard errors below / above 1,
    else ``parity`` (``n``: paired runs; one pair gives no error and no verdict)."""
    logs = [math.log(a[key] / b[key]) for a, b in pairs if a[key] > 0 and b[key] > 0]
    if not logs:
        return {"n": 0, "ratio": None, "se_factor": None, "verdict": None}
    mean = statistics.mean(logs)
    if len(logs) < 2:
        return {"n": 1, "ratio": math.exp(mean), "se_factor": None, "verdict": None}
    se = statistics.stdev(logs) / math.sqrt(len(logs))
    verdict = "faster" if mean + 2 * se < 0 else "slower" if mean - 2 * se > 0 else "parity"
    return {"n": len(logs), "ratio": math.exp(mean), "se_factor": math.exp(se), "verdict": verdict}


#: pairs that run the same algorithm on both sides (the others differ by design, see the docs)
SAME_ALGORITHM = ("full", "snapkv", "streamingllm", "knorm", "tova")


def pooled_wall(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """:func:`paired_ratio` of the wall time over every paired run of the pairs that run the same
    algorithm on both sides, and over every pair but H2O (kvpress's side needs eager attention)."""
    pairs = run_pairs(ours, theirs)
    groups = {
        f"same algorithm ({', '.join(SAME_ALGORITHM)})": lambda m: m in SAME_ALGORITHM,
        "every pair but h2o": lambda m: m != "h2o",
    }
    out = {}
    for label, member in groups.items():
        runs = [p for (_, method, _), group in pairs.items() if member(method) for p in group]
        if runs:
            out[label] = paired_ratio(runs)
    return out


def over_repeats(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int | None], dict[str, Any]]:
    """Per (sample, method, budget): the first repeat's row with each of :data:`TIMES` (and of
    :data:`OPTIONAL`, None unless every row has it) replaced by its median over the repeats, plus
    ``repeats`` (how many rows) and ``deterministic`` (every repeat decoded the same token ids).
    Rows without a ``repeat`` field count as repeat 0."""
    groups: dict[tuple[str, str, int | None], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["sample"], r["method"], r["budget"]), []).append(r)
    merged = {}
    for key, runs in groups.items():
        runs = sorted(runs, key=lambda r: r.get("repeat", 0))
        first = runs[0]
        merged[key] = {
            **first, **{t: statistics.median(r[t] for r in runs) for t in TIMES}, "repeats": len(runs),
            "deterministic": all(r["token_ids"] == first["token_ids"] for r in runs),
            **{m: _median_or_none([r.get(m) for r in runs]) for m in OPTIONAL},
        }  # fmt: skip
    return merged


def _press_label(method: str) -> str:
    press = PEERS[method][1]
    if press["press"] is None:
        return "no press"
    return press["press"] + (f"({press['inner']['press']})" if "inner" in press else "")


def summarise(
    samples: list[dict[str, Any]], ours: list[dict[str, Any]], theirs: list[dict[str, Any]], tokenizer
) -> list[dict[str, Any]]:
    """Per (task, length, method, budget): accuracy of each side, answers that agree, whether each
    side decoded the same tokens in every repeat, and wall / prefill / decode seconds (sums over
    the samples of each sample's median over repeats) with their ratios ours / kvpress, and
    ``wall_paired``: the run-by-run wall ratio with its error and verdict (:func:`paired_ratio`).
    Accuracy and answers are the first repeat's."""
    from kvbudget.eval.tasks import get_task

    by_id = {s["id"]: s for s in samples}
    eos = set(samples[0]["eos_ids"]) if samples else set()

    def score(row: dict[str, Any]) -> float:
        ids = row["token_ids"]
        ids = ids[:-1] if ids and ids[-1] in eos else ids
        sample = by_id[row["sample"]]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return float(get_task(sample["task"]).metric(text, sample["answers"]))

    theirs_by = over_repeats(theirs)
    run_by_run = run_pairs(ours, theirs)
    groups: dict[tuple[str, int, str, int | None], list[tuple[dict, dict]]] = {}
    for key, r in over_repeats(ours).items():
        other = theirs_by.get(key)
        if other is not None:
            sample = by_id[r["sample"]]
            group = (sample["task"], sample["length"], r["method"], r["budget"])
            groups.setdefault(group, []).append((r, other))
    rows = []
    for (task, length, method, budget), pairs in groups.items():
        ours_scores = [score(a) for a, _ in pairs]
        peer_scores = [score(b) for _, b in pairs]
        row: dict[str, Any] = {
            "task": task, "length": length, "method": method, "budget": budget, "samples": len(pairs),
            "ours_spec": PEERS[method][0], "press": _press_label(method),
            "ours_accuracy": sum(ours_scores) / len(pairs), "kvpress_accuracy": sum(peer_scores) / len(pairs),
            "accuracy_diff_samples": sum(ours_scores) - sum(peer_scores),
            "same_answer": sum(a["token_ids"] == b["token_ids"] for a, b in pairs) / len(pairs),
            "repeats": min(min(a["repeats"], b["repeats"]) for a, b in pairs),
            "ours_deterministic": all(a["deterministic"] for a, _ in pairs),
            "kvpress_deterministic": all(b["deterministic"] for _, b in pairs),
            "ours_tokens": sum(len(a["token_ids"]) for a, _ in pairs),
            "kvpress_tokens": sum(len(b["token_ids"]) for _, b in pairs),
        }  # fmt: skip
        for t in TIMES:
            mine, peer = sum(a[t] for a, _ in pairs), sum(b[t] for _, b in pairs)
            row[f"ours_{t}"], row[f"kvpress_{t}"] = mine, peer
            row[f"{t.removesuffix('_s')}_ratio"] = mine / peer if peer > 0 else float("nan")
        for m in OPTIONAL:
            mine_, peer_ = ([r[m] for r in side] for side in zip(*pairs, strict=True))
            row[f"ours_{m}"] = None if None in mine_ else sum(mine_)
            row[f"kvpress_{m}"] = None if None in peer_ else sum(peer_)
        for field_ in ("kept_entries", "allocated_entries"):
            row[f"ours_{field_}"] = statistics.median(a[field_] for a, _ in pairs)
            row[f"kvpress_{field_}"] = statistics.median(b[field_] for _, b in pairs)
        runs = [p for a, _ in pairs for p in run_by_run.get((a["sample"], method, budget), [])]
        row["wall_paired"] = paired_ratio(runs)
        rows.append(row)
    return rows


def _row_order(r: dict[str, Any]) -> tuple:
    """Per task and length: the full-cache reference first, then methods and budgets."""
    return r["task"], r["length"], r["method"] != "full", r["method"], r["budget"] or 0


def markdown(
    config: PeerConfig,
    rows: list[dict[str, Any]],
    versions: str,
    pooled: dict[str, dict[str, Any]] | None = None,
) -> str:
    """``peer.md``: the table of ``rows`` (:func:`summarise`), then the ``pooled`` ratios
    (:func:`pooled_wall`)."""

    def identical(r: dict[str, Any], side: str) -> str:
        return "—" if r["repeats"] < 2 else ("yes" if r[f"{side}_deterministic"] else "**NO**")

    def thousands(faults: float | None) -> str:
        return "—" if faults is None else f"{faults / 1000:.0f}"

    def compression(r: dict[str, Any]) -> str:
        mine, peer = r["ours_compress_s"], r["kvpress_compress_s"]
        if mine is None or peer is None:
            return "—"
        return f"{mine:.2f} / {peer:.2f}" + (f" ({mine / peer:.2f})" if peer > 0 else "")

    def paired(stats: dict[str, Any]) -> str:
        if stats["se_factor"] is None:
            return "—"
        return f"{stats['ratio']:.3f} ×/÷ {stats['se_factor']:.3f} ({stats['verdict']}, {stats['n']} runs)"

    def seconds(r: dict[str, Any], phase: str) -> str:
        return f"{r[f'ours_{phase}_s']:.1f} / {r[f'kvpress_{phase}_s']:.1f} ({r[f'{phase}_ratio']:.2f})"

    lines = [
        "# kvbudget vs kvpress",
        "",
        f"Model `{config.model}` ({config.dtype}); tasks {', '.join(config.tasks)}; lengths "
        f"{', '.join(map(str, config.lengths))}; {config.limit} samples each; "
        f"{'question-aware' if config.question_aware else 'question-agnostic'}, compression "
        f"in the prefill only, greedy; {config.repeats} repeat(s), "
        + (
            "interleaved run by run (the side that goes first alternates)"
            if config.interleave
            else "sides alternating in whole passes (kvpress first)"
        )
        + f". {versions}.",
        "",
        "Seconds are sums over the n samples of each sample's median over the repeats; ratio = "
        "ours / kvpress. Prefill: start to the prompt's last logits (compression included; the "
        "question's forward too when question-agnostic). Decode: from there to the last token. "
        "Wall = prefill + decode. `full` (no compression, no press) is the accuracy ceiling. "
        "Compression: the part of the prefill spent scoring, selecting and gathering (ours: the "
        "session's compression; kvpress: its press's `compress`), same sums. "
        "Same tokens over repeats: whether each side decoded identical ids in every repeat. Page "
        "faults: minor faults of each side's runner process during its runs (same sums), memory the "
        "kernel had to map and zero — an allocator cost that varies with a process's history. "
        "Wall, run by run: the geometric mean of the paired runs' ratios ours / kvpress ×/÷ its "
        "standard error; faster / slower when more than two standard errors from 1, else parity.",
        "",
        "| task | length | ours | kvpress | budget | n | accuracy ours / kvpress | Δ samples | same answer "
        "| same tokens over repeats ours / kvpress | wall s ours / kvpress (ratio) | wall, run by run "
        "| prefill s ours / kvpress (ratio) | decode s ours / kvpress (ratio) "
        "| compression s ours / kvpress (ratio) | tokens ours / kvpress "
        "| entries kept ours / kvpress | allocated ours / kvpress | page faults ours / kvpress (k) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=_row_order):
        budget = "—" if r["budget"] is None else str(r["budget"])
        lines.append(
            f"| {r['task']} | {r['length']} | `{r['ours_spec']}` | {r['press']} | {budget} | "
            f"{r['samples']} | "
            f"{100 * r['ours_accuracy']:.0f} / {100 * r['kvpress_accuracy']:.0f} | "
            f"{r['accuracy_diff_samples']:+.0f} | {100 * r['same_answer']:.0f}% | "
            f"{identical(r, 'ours')} / {identical(r, 'kvpress')} | {seconds(r, 'wall')} | "
            f"{paired(r['wall_paired'])} | "
            f"{seconds(r, 'prefill')} | {seconds(r, 'decode')} | {compression(r)} | "
            f"{r['ours_tokens']} / {r['kvpress_tokens']} | "
            f"{r['ours_kept_entries']:.0f} / {r['kvpress_kept_entries']:.0f} | "
            f"{r['ours_allocated_entries']:.0f} / {r['kvpress_allocated_entries']:.0f} | "
            f"{thousands(r['ours_minor_faults'])} / {thousands(r['kvpress_minor_faults'])} |"
        )
    if pooled:
        lines += ["", "Wall, run by run, pooled over pairs:"]
        lines += [f"- {label}: {paired(stats)}" for label, stats in pooled.items()]
    unstable = [
        f"{r['method']}@{r['budget']} ({r['task']} {r['length']}, "
        + " and ".join(s for s in ("ours", "kvpress") if not r[f"{s}_deterministic"])
        + ")"
        for r in sorted(rows, key=_row_order)
        if not (r["ours_deterministic"] and r["kvpress_deterministic"])
    ]
    if unstable:
        lines += ["", f"**Greedy decoding was not deterministic across repeats** for: {'; '.join(unstable)}."]
    return "\n".join(lines) + "\n"


def _save_rows(out: Path, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    for name, side in (("kvpress.jsonl", theirs), ("ours.jsonl", ours)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in side))


def _run_passes(
    config: PeerConfig, python: Path, samples: list[dict[str, Any]], jobs: list[dict[str, Any]],
    out: Path, ours: list[dict[str, Any]], theirs: list[dict[str, Any]], say: Callable[[str], None],
) -> None:  # fmt: skip
    """Whole passes per side, alternating (kvpress pass, ours pass, …): each kvpress pass is one
    runner process, our passes share one serving runner; rows are saved after every pass."""
    from kvbudget.models import _resolve_source

    server = ours_server(config.model, out / "samples.jsonl", jobs, out / "ours.log", config.dtype)
    try:
        for rep in range(config.repeats):
            tag = f" (repeat {rep + 1}/{config.repeats})" if config.repeats > 1 else ""
            say(f"kvpress: {len(samples)} samples × {len(jobs)} presses{tag}")
            rows = run_kvpress(python, _resolve_source(config.model), out / "samples.jsonl", jobs,
                               out / f"kvpress.{rep}.jsonl", config.dtype)  # fmt: skip
            theirs += [{**r, "repeat": rep} for r in rows]
            say(f"kvbudget: {len(samples)} samples × {len(jobs)} methods{tag}")
            for i in range(len(samples)):
                for j in range(len(jobs)):
                    ours.append({**server.run(i, j), "repeat": rep})
            _save_rows(out, ours, theirs)
    finally:
        server.close()


def _run_interleaved(
    config: PeerConfig, python: Path, samples: list[dict[str, Any]], jobs: list[dict[str, Any]],
    out: Path, ours: list[dict[str, Any]], theirs: list[dict[str, Any]], say: Callable[[str], None],
) -> None:  # fmt: skip
    """Every (repeat, sample, job) on both sides back to back, the first side alternating; rows are
    saved after every sample."""
    from kvbudget.models import _resolve_source

    samples_path = out / "samples.jsonl"
    servers = {
        "kvpress": kvpress_server(python, _resolve_source(config.model), samples_path, jobs,
                                  out / "kvpress.log", config.dtype),
    }  # fmt: skip
    try:
        servers["ours"] = ours_server(config.model, samples_path, jobs, out / "ours.log", config.dtype)
        rows = {"kvpress": theirs, "ours": ours}
        for rep in range(config.repeats):
            tag = f" (repeat {rep + 1}/{config.repeats})" if config.repeats > 1 else ""
            say(f"kvpress ↔ kvbudget, interleaved: {len(samples)} samples × {len(jobs)} methods{tag}")
            for i in range(len(samples)):
                for j in range(len(jobs)):
                    kvpress_first = (rep + i + j) % 2 == 0
                    for side in ("kvpress", "ours") if kvpress_first else ("ours", "kvpress"):
                        time.sleep(SETTLE_S)
                        first = kvpress_first == (side == "kvpress")
                        rows[side].append({**servers[side].run(i, j), "repeat": rep, "first": first})
                _save_rows(out, ours, theirs)
    finally:
        for server in servers.values():
            server.close()


def run_peer(config: PeerConfig, out: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Export samples; run every (sample, method, budget) through kvpress (its environment) and
    ours, ``config.repeats`` times, interleaved run by run or in alternating passes
    (``config.interleave``); write every run to ``kvpress.jsonl`` / ``ours.jsonl`` (field
    ``repeat``) and the summary to ``peer.json`` and ``peer.md``."""
    from kvbudget.engine import eos_ids
    from kvbudget.models import load_model

    config.validate()
    python = peer_python_path(config.peer_python)
    if python is None:
        raise KVBudgetError(f"no kvpress environment at {config.peer_python}: run `make peer` first")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _msg: None)
    model, tokenizer = load_model(config.model, dtype=config.dtype)
    eos = eos_ids(model, tokenizer)
    samples = export_samples(config, tokenizer, eos, out / "samples.jsonl")
    jobs = make_jobs(config)
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    run_sides = _run_interleaved if config.interleave else _run_passes
    del model  # the runners load their own copies
    run_sides(config, python, samples, jobs, out, ours, theirs, say)
    rows = summarise(samples, ours, theirs, tokenizer)
    versions = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print('kvpress', m.version('kvpress'), "
         "'/ transformers', m.version('transformers'), 'vs ours on transformers', end=' ')"],
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    import transformers

    versions += transformers.__version__
    pooled = pooled_wall(ours, theirs)
    result = {"config": asdict(config), "versions": versions, "rows": rows, "pooled_wall": pooled}
    path = out / "peer.json"
    path.write_text(json.dumps(result, indent=1))
    (out / "peer.md").write_text(markdown(config, rows, versions, pooled))
    return path
