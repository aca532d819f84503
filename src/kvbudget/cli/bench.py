"""The benchmarks: ``kvbudget bench`` (latency and memory) and its ``peer``, ``serve`` and
``throughput`` commands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvbudget.cli import checks as check
from kvbudget.cli.base import console, user_errors
from kvbudget.cli.option_values import int_values, split_values
from kvbudget.cli.options import (
    BenchMethodsOption,
    BenchModelOption,
    BudgetsOption,
    DeviceOption,
    DtypeOption,
    LengthsOption,
)
from kvbudget.errors import InputError, KVBudgetError
from kvbudget.extras import needs_extra
from kvbudget.serve import defaults


@user_errors
def bench(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="Model (registry name or local path).")] = "smollm2-135m",
    methods: BenchMethodsOption = None,
    budgets: BudgetsOption = None,
    lengths: LengthsOption = None,
    repeats: Annotated[int, typer.Option(help="Runs per configuration (each a fresh process).")] = 3,
    new_tokens: Annotated[int, typer.Option(help="Tokens decoded per run (TPOT is their mean).")] = 64,
    dtype: DtypeOption = "float32",
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
    config.methods = split_values(methods) or config.methods
    config.budgets = int_values(budgets, "budgets") or config.budgets
    config.lengths = int_values(lengths, "lengths") or config.lengths
    config.validate()
    check.at_least(threads, 1, "--threads")
    config.dtype = check.dtype(dtype)
    check.model_source(model)
    check.output_dir(out, "--out")
    from kvbudget.models import resolve_device

    resolve_device(device)  # an unknown device or a missing GPU: one line, before any run
    path = run_bench(config, out, progress=console.print)
    console.print(f"results: [bold]{path}[/bold]  report: [bold]{out / 'bench.md'}[/bold]")


@user_errors
@needs_extra("eval", "kvbudget bench peer")
def bench_peer(
    model: BenchModelOption = "smollm2-135m",
    tasks: Annotated[list[str] | None, typer.Option(help="Tasks whose generators make the samples.")] = None,
    lengths: LengthsOption = None,
    limit: Annotated[int, typer.Option(help="Samples per task and length.")] = 5,
    methods: Annotated[
        list[str] | None,
        typer.Option(
            help="Our methods with a kvpress counterpart (default: the prefill-scoring ones; kvzip, "
            "kvzip+, kvgrad, leverage, compactor, expected-attention, kvzap and kvzap-linear on "
            "request); `full` (no compression on either side) is the accuracy ceiling."
        ),
    ] = None,
    budgets: BudgetsOption = None,
    dtype: DtypeOption = "float32",
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
    config.tasks = split_values(tasks) or config.tasks
    config.lengths = int_values(lengths, "lengths") or config.lengths
    config.methods = split_values(methods) or config.methods
    config.budgets = int_values(budgets, "budgets") or config.budgets
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


@user_errors
@needs_extra("eval", "kvbudget bench serve")
def bench_serve(
    model: BenchModelOption = "qwen2.5-coder-0.5b",
    methods: BenchMethodsOption = None,
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
    dtype: DtypeOption = "bfloat16",
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
    workload: Annotated[
        str,
        typer.Option(
            help="needle: --requests prompts per method, as above; shared / multiturn: --clients clients "
            "asking one document's questions (separate requests / one conversation each), served as a shared "
            "compressed document, a shared full one and per request (docs/serving.md)."
        ),
    ] = "needle",
    modes: Annotated[
        str,
        typer.Option(
            help="--workload shared/multiturn: document, document:reload, document:full, per-request "
            "(comma-separated)."
        ),
    ] = "document,document:reload,document:full,per-request",
    document_method: Annotated[
        str, typer.Option(help="--workload shared/multiturn: the shared document's method and size.")
    ] = defaults.DOCUMENT_METHOD,
    sample: Annotated[
        int, typer.Option(help="--workload shared/multiturn: which of the task's samples is the document.")
    ] = 0,
    chunk_tokens: Annotated[
        int, typer.Option(help="Read prompts this long a layer at a time while others decode (0: never).")
    ] = 1024,
    llama_server: Annotated[
        Path | None,
        typer.Option(
            help="llama.cpp's server (`make llama`, .llama/bin/llama-server): adds a row per "
            "--llama-cache-types, the same prompts served from the model's GGUF file with as many slots "
            "as the cap holds."
        ),
    ] = None,
    llama_cache_types: Annotated[
        str, typer.Option(help="llama.cpp KV cache types, comma-separated: f16, q8_0, q4_0.")
    ] = "f16,q8_0,q4_0",
    device: DeviceOption = "cpu",
    random_weights: Annotated[
        bool,
        typer.Option(
            help="Build the model from its config.json with random weights (a size not on disk): sequences "
            "held, memory and speed; every request decodes --max-tokens and no accuracy is reported."
        ),
    ] = False,
    soak: Annotated[
        float | None,
        typer.Option(
            help="Instead of the benchmark, a soak of SECONDS after a warm-up of a third of it (600 s in "
            "all at most): --clients send random chats, streams they drop, follow-ups and bad requests "
            "with --methods under --memory-cap (default "
            "64MiB); checks no 5xx, nothing lost, KV back to the kept turns, memory back to the warm-up's."
        ),
    ] = None,
) -> None:
    """Load `kvbudget serve` with concurrent clients: sequences held at once, tokens/s, TTFT/TPOT and
    accuracy, full cache vs compressed methods under one KV cap (docs/serving.md)."""
    with needs_extra("serve", "kvbudget bench serve"):
        from kvbudget.bench.serve_load import ServeBenchConfig, run_serve_bench
    from kvbudget.units import parse_size

    if soak is not None:
        bench_soak(model, methods, memory_cap, clients, soak, check.dtype(dtype), device, out)
        return
    check.at_least(chunk_tokens, 0, "--chunk-tokens")
    check.at_least(sample, 0, "--sample")
    if workload != "needle":
        from kvbudget.bench.serve_shared import SharedBenchConfig, run_shared_bench

        per_request = [m for m in split_values(methods) if m != "full"] or ["snapkv"]
        config = SharedBenchConfig(
            model=model, dtype=check.dtype(dtype), workload=workload,
            task=task if task != "needle" else "sc_keys", length=length, sample=sample, clients=clients,
            document_method=document_method, per_request_method=per_request[0],
            modes=split_values([modes]),
            ratio=ratio, cap_bytes=parse_size(memory_cap) if memory_cap else 1 << 30, time_limit_s=time_limit,
            device=device,
        )  # fmt: skip
        report = run_shared_bench(config, out, progress=lambda line: print(line, file=sys.stderr))
        console.print(report.read_text())
        return
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
        methods=split_values(methods) or ["full", "snapkv", "ada-snapkv"], ratio=ratio,
        cap_bytes=parse_size(memory_cap) if memory_cap else None, clients=clients, requests=requests,
        max_tokens=max_tokens, ignore_eos=ignore_eos, time_limit_s=time_limit,
        openvino_python=str(openvino) if openvino else None,
        openvino_model=str(openvino_model) if openvino_model else None, device=device,
        random_weights=random_weights, llama_server=str(llama_server) if llama_server else None,
        llama_cache_types=split_values([llama_cache_types]) or [], chunk_tokens=chunk_tokens or None,
    )  # fmt: skip
    report = run_serve_bench(config, out, progress=lambda line: print(line, file=sys.stderr))
    console.print(report.read_text())


def bench_soak(
    model: str, methods: list[str] | None, memory_cap: str | None, clients: int, seconds: float, dtype: str,
    device: str, out: Path,
) -> None:  # fmt: skip
    """``kvbudget bench serve --soak``: :func:`kvbudget.bench.serve_soak.run_soak`; exit code 1 when a
    check fails."""
    with needs_extra("serve", "kvbudget bench serve --soak"):
        from kvbudget.bench.serve_soak import SoakConfig, run_soak, write_soak
    from kvbudget.models import load_model, resolve_device
    from kvbudget.units import parse_size

    config = SoakConfig(seconds=seconds, clients=clients)
    if methods:
        config.methods = split_values(methods)
    if memory_cap:
        config.cap_bytes = parse_size(memory_cap)
    config.check()
    check.model_source(model)
    check.output_dir(out, "--out")
    resolve_device(device)
    lm, tokenizer = load_model(model, dtype=dtype, device=device)
    result = run_soak(lm, tokenizer, config, progress=lambda line: print(line, file=sys.stderr))
    command = " ".join(["kvbudget", *sys.argv[1:]]) if sys.argv else "kvbudget bench serve --soak"
    report = write_soak(result, out, f"{model} ({dtype})", command)
    console.print(report.read_text())
    if not result["ok"]:
        raise typer.Exit(1)


@user_errors
@needs_extra("eval", "kvbudget bench throughput")
def bench_throughput(
    model: BenchModelOption = "qwen2.5-coder-0.5b",
    methods: BenchMethodsOption = None,
    budgets: BudgetsOption = None,
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
    dtype: DtypeOption = "bfloat16",
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
    config.methods = split_values(methods) or config.methods
    config.budgets = int_values(budgets, "budgets") or config.budgets
    config.lengths = int_values(lengths, "lengths") or config.lengths
    config.validate()
    check.model_source(model)
    check.output_dir(out, "--out")
    path = run_throughput(config, out, progress=console.print)
    console.print(f"results: [bold]{path}[/bold]  report: [bold]{out / 'throughput.md'}[/bold]")


def bench_commands() -> typer.Typer:
    """The ``kvbudget bench`` group: ``bench`` itself runs :func:`bench`, then its commands."""
    group = typer.Typer(help="Latency, memory and scaling benchmarks; `bench peer` compares with kvpress.")
    group.callback(invoke_without_command=True)(bench)
    group.command("peer")(bench_peer)
    group.command("serve")(bench_serve)
    group.command("throughput")(bench_throughput)
    return group
