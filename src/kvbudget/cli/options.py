"""Option types that several commands share, each defined once with its help text.

A command declares ``dtype: DtypeOption = "float32"``; the default stays with the command, since
the commands differ in it. Options whose help differs between commands are declared there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

#: ``--model`` of generate and serve
ModelOption = Annotated[str, typer.Option(help="Registry name, local HF directory or .gguf file.")]
#: ``--model`` of profile, tune and train kvzap
ModelSourceOption = Annotated[str, typer.Option(help="Registry name, local HF directory or .gguf.")]
#: ``--model`` of the benchmarks against kvpress, under load and of throughput
BenchModelOption = Annotated[str, typer.Option(help="Model (registry name or local HF directory).")]

#: ``--dtype`` of every command that loads a model with a default dtype
DtypeOption = Annotated[str, typer.Option(help="float32 or bfloat16.")]

#: ``--device`` of generate, eval and the bench commands
DeviceOption = Annotated[
    str, typer.Option(help="Where the model runs: cpu, cuda[:index] or auto (the GPU when there is one).")
]

#: ``--kv-bits`` of generate and serve
KvBitsOption = Annotated[
    int,
    typer.Option(
        "--kv-bits",
        help="Bits each stored key/value number takes after the prefill: 2, 4 or 8 (KIVI groups), "
        "16 = the model's dtype.",
    ),
]

#: ``--methods`` of the speed benchmarks
BenchMethodsOption = Annotated[
    list[str] | None, typer.Option(help="Methods (comma-separated); `full` is the uncompressed baseline.")
]
#: ``--budgets`` of eval and the benchmarks
BudgetsOption = Annotated[list[str] | None, typer.Option(help="Budgets: entries per KV head.")]
#: ``--lengths`` of eval and the benchmarks
LengthsOption = Annotated[list[str] | None, typer.Option(help="Context lengths in tokens.")]

#: ``--ray-address``, ``--gpus-per-worker`` and ``--threads-per-worker`` of eval and tune
RayAddressOption = Annotated[
    str | None,
    typer.Option(help="Join a running Ray cluster (auto or host:port) instead of starting one."),
]
GpusPerWorkerOption = Annotated[float, typer.Option(help="GPUs each Ray worker requests.")]
ThreadsPerWorkerOption = Annotated[int, typer.Option(help="CPUs (torch threads) per Ray worker.")]

#: the results folder of report and pack
ResultsFolderArgument = Annotated[Path, typer.Argument(help="Results directory of `kvbudget eval`.")]
