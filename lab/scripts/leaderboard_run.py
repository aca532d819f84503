"""Run the leaderboard grid (``LEADERBOARD`` in src/kvbudget/eval/suites.py) task by task, resumable.

    .venv/bin/python lab/scripts/leaderboard_run.py OUT [--compression-ratios 0.875] [--budgets 128]
        [--tasks needle,vt] [--agnostic] [--methods all] [--dtype float32] [--peer-presses all]
        [--limit 3]

The model loads once for every task. Without budget options it runs the committed plan,
``LEADERBOARD_PLAN``: ratio 0.875 on every task, then 0.5 on ``LEADERBOARD_CORE_TASKS``, then 0.75
and 0.25 on those but lcc (docs/leaderboard-analysis.md says why); ``--tasks`` narrows each part to the tasks
it names. With budget options (and ``--tasks``), only what they name.
``--limit N`` runs each task's first N samples only (the same samples the full grid starts with, so a
later run without it adds the rest; not for needle, whose depths spread over the limit).
``--agnostic`` runs the question-agnostic track (the context is compressed before the question).
``KVBUDGET_LOCK``, if set, names a file locked (flock) around each sample, so that other torch work
on the machine (a test run) waits at most one sample instead of a whole task. The runner skips
finished rows, so the command resumes and a method registered later adds only its rows. After
each task the rows are packed into the gzip parts a commit takes (``kvbudget pack OUT``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import kvbudget
from kvbudget.artifacts import file_lock
from kvbudget.errors import KVBudgetError
from kvbudget.eval.peer_rows import run_peer_rows
from kvbudget.eval.report import write_report
from kvbudget.eval.runner import EvalConfig, Runner
from kvbudget.eval.store import pack_results
from kvbudget.eval.suites import LEADERBOARD_PLAN, suite
from kvbudget.methods.kvzap_surrogate import trained_surrogate_path
from kvbudget.methods.spec import MethodSpec


def missing_surrogate(methods: list[str], model) -> str | None:
    """Why ``methods`` cannot make leaderboard rows on ``model``, or ``None``: a ``kvzap`` without a
    ``surrogate=`` option uses the model's trained surrogate of its kind; without one it would fall
    back to a linear surrogate fitted on the bundled prompts (a warning only), and its rows would
    not say so."""
    for text in methods:
        method = MethodSpec.parse(text).build()
        if method.name == "kvzap" and not method.surrogate:
            try:
                trained_surrogate_path(model, method.kind, text)
            except KVBudgetError as err:
                return str(err)
    return None


@contextlib.contextmanager
def machine_lock(path: str | None) -> Iterator[None]:
    if not path:
        yield
        return
    with file_lock(Path(path)):
        yield
    time.sleep(1.0)  # lets a waiting job take the lock before the next sample


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--compression-ratios", default=None)
    parser.add_argument("--budgets", default=None)
    parser.add_argument("--tasks", default=None)
    parser.add_argument("--methods", default=None)
    parser.add_argument("--agnostic", action="store_true")
    parser.add_argument("--dtype", default=None, help="override the suite's dtype (e.g. float32)")
    parser.add_argument("--limit", type=int, default=None, help="each task's first N samples only")
    parser.add_argument(
        "--peer-presses",
        default=None,
        help="kvpress presses (`all` or names; needs `make peer`) instead of methods",
    )
    args = parser.parse_args()

    config = suite("leaderboard")
    parts: list[tuple[list[float], list[str]]] = []  # (ratios, tasks) run one after the other
    if args.compression_ratios is not None or args.budgets is not None:
        ratios = [float(r) for r in (args.compression_ratios or "").split(",") if r]
        budgets = [int(b) for b in (args.budgets or "").split(",") if b]
        config = dataclasses.replace(config, compression_ratios=ratios, budgets=budgets)
        parts.append((ratios, args.tasks.split(",") if args.tasks else config.tasks))
    else:
        named = args.tasks.split(",") if args.tasks else None
        for ratios, planned in LEADERBOARD_PLAN:
            tasks = planned if planned is not None else config.tasks
            parts.append((ratios, [t for t in tasks if named is None or t in named]))
    if args.methods:
        config = dataclasses.replace(config, methods=args.methods.split(","))
    config = dataclasses.replace(config, compress_context_only=args.agnostic)
    if args.dtype:
        config = dataclasses.replace(config, dtype=args.dtype)
    if args.limit is not None:
        if any("needle" in tasks for _, tasks in parts):
            parser.error("--limit: needle's depths spread over the limit, so its first N samples differ")
        config = dataclasses.replace(config, limit=args.limit)

    lock = os.environ.get("KVBUDGET_LOCK")
    with machine_lock(lock):
        model, tokenizer = kvbudget.load_model(config.model, dtype=config.dtype)
    whole = dataclasses.asdict(Runner(config, None, model=model, tokenizer=tokenizer, progress=False).config)
    if not args.peer_presses and (problem := missing_surrogate(whole["methods"], model)):
        parser.error(problem)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "config.json"
    if path.exists():  # the union of every part run into this folder
        before = json.loads(path.read_text(encoding="utf-8"))
        for name in ("tasks", "methods", "budgets", "compression_ratios"):
            whole[name] = before.get(name, []) + [v for v in whole[name] if v not in before.get(name, [])]
    path.write_text(json.dumps(whole, indent=2), encoding="utf-8")
    for ratios, tasks in parts:
        for task in tasks:
            run_task(
                args,
                dataclasses.replace(config, tasks=[task], compression_ratios=ratios),
                model,
                tokenizer,
                lock,
            )
    write_report(args.out)


def run_task(args: argparse.Namespace, config: EvalConfig, model, tokenizer, lock: str | None) -> None:
    """One task of ``config`` (its methods, or kvpress's presses), a sample at a time under the lock."""
    started = time.time()
    runner = Runner(
        config, args.out, model=model, tokenizer=tokenizer, sample_guard=lambda: machine_lock(lock)
    )
    if args.peer_presses:  # kvpress's own process runs the task's samples; the lock is held throughout
        with machine_lock(lock):
            run_peer_rows(
                runner.config, args.out, args.peer_presses.split(","), model=model, tokenizer=tokenizer
            )
    else:
        runner.run()
    pack_results(args.out / "results.jsonl")
    minutes = (time.time() - started) / 60
    print(
        f"{time.strftime('%H:%M:%S')} {config.tasks[0]} {config.compression_ratios} done in {minutes:.1f} min"
    )


if __name__ == "__main__":
    main()
