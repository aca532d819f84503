"""The ``kvbudget`` command line (typer): methods, models, generate, fetch, eval, report, demo, bench.

User errors (unknown method or model, bad budget, missing artifact, a file that is not text, an
output folder that cannot be written, ...) print one line to stderr and exit with code 2; every
argument is checked (:mod:`kvbudget.cli.checks`) before a model or data set loads. Usage errors
found by the parser (a misspelt option, a value of the wrong type) are one line too.

The commands of the evaluation harness and the benchmarks (eval, report, pack, tune, demo, bench)
import them inside the command, under :func:`~kvbudget.extras.needs_extra`: without
``kvbudget[eval]`` they stop with one line naming the extra.

One module per group of commands (:mod:`~kvbudget.cli.catalog`, :mod:`~kvbudget.cli.generate`,
:mod:`~kvbudget.cli.evaluation`, :mod:`~kvbudget.cli.profiling`, :mod:`~kvbudget.cli.serve`,
:mod:`~kvbudget.cli.bench`); the options several commands share are typed once in
:mod:`~kvbudget.cli.options`. The command table is here, in the order ``kvbudget --help`` lists it.
"""

from __future__ import annotations

import typer

from kvbudget.cli import bench, catalog, evaluation, generate, profiling, serve
from kvbudget.cli.base import OneLineErrors

__all__ = ["app", "main"]

app = typer.Typer(
    help="KV-cache compression for Hugging Face LLMs under a memory budget.",
    no_args_is_help=True,
    cls=OneLineErrors,
)
app.command()(catalog.methods)
app.command()(generate.generate)
app.command()(catalog.models)
app.command()(catalog.fetch)
app.command("eval")(evaluation.evaluate)
app.command()(profiling.profile)
app.command()(profiling.tune)
app.add_typer(profiling.train_commands(), name="train")
app.command()(serve.serve)
app.command("report")(evaluation.report_command)
app.command("pack")(evaluation.pack_command)
app.command()(evaluation.demo)
app.add_typer(bench.bench_commands(), name="bench")


def main() -> None:  # pragma: no cover - console entry point
    app()
