"""The evaluation harness's commands: ``kvbudget eval``, ``report``, ``pack`` and ``demo``.

Each imports the harness inside the command, under :func:`~kvbudget.extras.needs_extra`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvbudget.cli import checks as check
from kvbudget.cli.base import console, user_errors
from kvbudget.cli.option_values import float_values, int_values, split_values
from kvbudget.cli.options import (
    BudgetsOption,
    DeviceOption,
    DtypeOption,
    GpusPerWorkerOption,
    LengthsOption,
    RayAddressOption,
    ResultsFolderArgument,
    ThreadsPerWorkerOption,
)
from kvbudget.errors import BudgetError, KVBudgetError
from kvbudget.extras import needs_extra


@user_errors
@needs_extra("eval", "kvbudget eval")
def evaluate(
    out: Annotated[Path, typer.Option(help="Results directory (results.jsonl, report).")] = Path("runs/eval"),
    suite: Annotated[str | None, typer.Option(help="smoke, demo, standard or leaderboard.")] = None,
    model: Annotated[str | None, typer.Option(help="Model (default smollm2-135m).")] = None,
    tasks: Annotated[list[str] | None, typer.Option(help="Tasks (comma-separated or repeated).")] = None,
    methods: Annotated[
        list[str] | None,
        typer.Option(help="Methods, e.g. snapkv or snapkv:window=64; `all` = every registered method."),
    ] = None,
    budgets: BudgetsOption = None,
    compression_ratios: Annotated[
        list[str] | None,
        typer.Option(
            help="Compression ratios as kvpress: the fraction of the compressed tokens removed, in [0, 1) "
            "(0.75 keeps a quarter); run beside --budgets (given alone, without --suite, no budgets run)."
        ),
    ] = None,
    kv_bits: Annotated[
        list[str] | None,
        typer.Option(
            "--kv-bits",
            help="Run every method with its cache stored at each of these precisions: 2, 4, 8 (KIVI "
            "groups) or 16 (the model's dtype), e.g. 4,16; a method's rows at b bits are labelled "
            "NAME:kv_bits=b.",
        ),
    ] = None,
    memories: Annotated[
        list[str] | None,
        typer.Option(
            "--memories",
            help="Also run every compressing method under each of these byte budgets: the share of the "
            "full cache's bytes its cache may take, in (0, 1], e.g. 0.25,0.125 (rows NAME:memory=f, run "
            "once each: the budget sets the entries and their precision).",
        ),
    ] = None,
    lengths: LengthsOption = None,
    limit: Annotated[int | None, typer.Option(help="Samples per task and length.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sample seed.")] = None,
    compress_context_only: Annotated[bool, typer.Option(help="Question-agnostic compression.")] = False,
    shared: Annotated[bool, typer.Option(help="Share one prefill per sample across methods.")] = True,
    dtype: Annotated[str | None, typer.Option(help="float32 or bfloat16.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Cap on every task's answer length.")] = None,
    report: Annotated[bool, typer.Option(help="Write the report when done.")] = True,
    peer_presses: Annotated[
        list[str] | None,
        typer.Option(
            help="Also run these kvpress presses on the same samples at the same compression ratios, as "
            "rows labelled kvpress:NAME (needs `make peer`): snapkv, streaming_llm, knorm, tova, keydiff, "
            "expected_attention, observed_attention, adakv_snapkv, pyramidkv, no_press, or all."
        ),
    ] = None,
    peer_python: Annotated[
        Path, typer.Option(help="Python of the kvpress environment (`make peer`), for --peer-presses.")
    ] = Path(".venv-peer/bin/python"),
    device: DeviceOption = "auto",
    workers: Annotated[
        int | None,
        typer.Option(help="Run on Ray with this many worker actors (a local cluster unless --ray-address)."),
    ] = None,
    ray_address: RayAddressOption = None,
    gpus_per_worker: GpusPerWorkerOption = 0.0,
    threads_per_worker: ThreadsPerWorkerOption = 1,
) -> None:
    """Run an evaluation grid into OUT/results.jsonl (resumes; errors become rows), then report.

    With --workers or --ray-address the samples run on Ray actors (docs/distributed.md); the rows
    and the file are the same as a local run's, and either kind of run resumes the other's file."""
    from kvbudget.eval.runner import EvalConfig, run_eval
    from kvbudget.eval.suites import suite as named_suite

    distributed = workers is not None or ray_address is not None
    if distributed:  # before anything else: Ray is an optional extra
        from kvbudget.eval.distributed import RayOptions, require_ray

        require_ray()
        options = RayOptions(
            workers=workers, address=ray_address, gpus_per_worker=gpus_per_worker,
            threads_per_worker=threads_per_worker, device=device,
        )  # fmt: skip
        options.validate()

    presses: list[str] = []
    if peer_presses:  # checked before any model loads
        from kvbudget.eval.peer_rows import peer_python as check_peer_python
        from kvbudget.eval.peer_rows import press_names

        presses = press_names(split_values(peer_presses))
        check_peer_python(peer_python)
    config = named_suite(suite, model) if suite else EvalConfig()

    overrides = {
        "model": model, "tasks": split_values(tasks) or None, "methods": split_values(methods) or None,
        "budgets": int_values(budgets, "budgets"), "lengths": int_values(lengths, "lengths"),
        "compression_ratios": float_values(compression_ratios, "compression-ratios"),
        "limit": limit, "seed": seed, "dtype": dtype, "max_new_tokens": max_new_tokens,
    }  # fmt: skip
    if not suite and overrides["compression_ratios"] and overrides["budgets"] is None:
        overrides["budgets"] = []  # ratios alone: not the default budgets too
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    base_methods = list(config.methods)
    if kv_bits:
        config.methods = _at_precisions(config.methods, int_values(kv_bits, "kv-bits"))
    if memories:
        config.methods = [*config.methods, *_under_memories(base_methods, float_values(memories, "memories"))]
    config.compress_context_only = compress_context_only or config.compress_context_only
    config.shared = shared
    if not config.compression_ratios and any(p != "no_press" for p in presses):
        raise KVBudgetError("--peer-presses run at compression ratios: give --compression-ratios")
    _check_eval(config, out)
    if distributed:
        from kvbudget.eval.distributed import run_eval_distributed

        results = run_eval_distributed(config, out, options)
    else:
        results = run_eval(config, out, device=device)
    console.print(f"results: [bold]{results}[/bold]")
    if presses:
        from kvbudget.eval.peer_rows import run_peer_rows

        added = run_peer_rows(config, out, presses, peer_python)
        console.print(f"kvpress rows added: {added}")
    if report:
        from kvbudget.eval.report import write_report

        console.print(f"report: [bold]{write_report(out)}[/bold]")


@needs_extra("eval", "kvbudget eval")
def _at_precisions(methods: list[str], bits: list[int]) -> list[str]:
    """Each method at each precision: ``snapkv`` at 4 and 16 bits → ``snapkv:kv_bits=4``, ``snapkv``."""
    from kvbudget.cache import check_kv_bits
    from kvbudget.eval.runner import expand_methods

    for b in bits:
        check_kv_bits(b)
    out = []
    for method in expand_methods(methods):
        for b in bits:
            out.append(method if b == 16 else f"{method}{',' if ':' in method else ':'}kv_bits={b}")
    return out


@needs_extra("eval", "kvbudget eval")
def _under_memories(methods: list[str], memories: list[float]) -> list[str]:
    """Each compressing method under each byte budget: ``snapkv`` at 0.25 → ``snapkv:memory=0.25``
    (the full cache has no entries to choose, so no byte budget)."""
    from kvbudget.byte_budget import check_memory
    from kvbudget.eval.runner import expand_methods

    for m in memories:
        check_memory(m, None, None, None)
    return [
        f"{method}{',' if ':' in method else ':'}memory={m:g}"
        for method in expand_methods(methods)
        if method.split(":", 1)[0] != "full" and "kv_bits=" not in method
        for m in memories
    ]


@needs_extra("eval", "kvbudget eval")
def _check_eval(config: Any, out: Path) -> None:
    """Every field of an ``EvalConfig``, the model, the output folder and its results file, before
    ``run_eval`` creates the folder or loads the model. A torn last row is reported (it is dropped
    when the run starts, and its run redone)."""
    from kvbudget.eval.runner import MethodSpec, expand_methods
    from kvbudget.eval.store import scan_results
    from kvbudget.eval.tasks import get_task

    for task in config.tasks:
        get_task(task)
    for method in expand_methods(config.methods):
        MethodSpec.parse(method)
    check.positive(config.budgets, "--budgets", "entries per KV head")
    for ratio in config.compression_ratios:
        if not 0.0 <= ratio < 1.0:
            raise BudgetError(
                "compression ratio must be in [0, 1) (the fraction of tokens removed, as kvpress), "
                f"got {ratio!r}"
            )
    if not config.budgets and not config.compression_ratios and any(m != "full" for m in config.methods):
        raise BudgetError("no budgets: give budgets (entries per KV head) or compression ratios")
    check.positive(config.lengths, "--lengths", "context lengths in tokens")
    check.at_least(config.limit, 1, "--limit")
    check.at_least(config.max_new_tokens, 1, "--max-new-tokens")
    check.dtype(config.dtype)
    check.model_source(config.model)
    check.output_dir(out, "--out")
    scan = scan_results(out / "results.jsonl")
    if scan.torn_line is not None:
        print(f"note: {scan.torn_note()}: it is dropped and its run is redone", file=sys.stderr)


@user_errors
@needs_extra("eval", "kvbudget report")
def report_command(
    out: ResultsFolderArgument,
    resamples: Annotated[
        int,
        typer.Option(min=1, help="Bootstrap resamples per 95% interval (seeded; fewer = faster, noisier)."),
    ] = 2000,
) -> None:
    """Write OUT/report.md and plots from OUT/results.jsonl; every score with its 95% bootstrap interval."""
    from kvbudget.eval.report import write_report

    check.results_folder(out)
    console.print(f"report: [bold]{write_report(out, resamples=resamples)}[/bold]")


@user_errors
@needs_extra("eval", "kvbudget pack")
def pack_command(
    out: ResultsFolderArgument,
) -> None:
    """Gzip OUT/results.jsonl into OUT/results.NNN.jsonl.gz parts (under 1 MB each) to commit.

    A clone without results.jsonl reads the parts (`kvbudget report`), and a rerun resumes from
    them; after new rows only the last parts change.
    """
    from kvbudget.eval.store import pack_results

    check.results_folder(out)
    parts = pack_results(out / "results.jsonl")
    size = sum(part.stat().st_size for part in parts)
    names = (
        f"{len(parts)} part: {parts[0].name}" if len(parts) == 1 else f"{len(parts)} parts: {parts[0].name} …"
    )
    console.print(f"packed {out / 'results.jsonl'} ({size / 1e6:.1f} MB) into {names}")


@user_errors
@needs_extra("eval", "kvbudget demo")
def demo(
    model: Annotated[str, typer.Option(help="Model to run the demo on.")] = "qwen2.5-coder-0.5b",
    length: Annotated[int, typer.Option(help="Needle prompt length in tokens.")] = 2048,
    out: Annotated[Path, typer.Option(help="Directory for the report.")] = Path("demo-out"),
    dtype: DtypeOption = "bfloat16",
) -> None:
    """Needle demo: full, snapkv and ada-snapkv at several budgets; writes DIR/demo.md."""
    from kvbudget.demo import run_demo

    dtype = check.dtype(dtype)
    check.at_least(length, 64, "--length (tokens of the needle prompt)")
    check.model_source(model, fetched=False)  # a registry model is fetched by the demo
    check.output_dir(out, "--out")
    run_demo(model=model, length=length, out=out, console=console, dtype=dtype)
