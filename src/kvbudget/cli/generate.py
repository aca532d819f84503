"""``kvbudget generate``: compress one context's KV cache and answer a question."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvbudget.cli import checks as check
from kvbudget.cli.base import console, user_errors
from kvbudget.cli.options import DeviceOption, DtypeOption, KvBitsOption, ModelOption
from kvbudget.units import format_bytes


@user_errors
def generate(
    context_file: Annotated[Path, typer.Option("--context-file", help="Text file with the long context.")],
    question: Annotated[str, typer.Option(help="Question asked after the context.")] = "",
    answer_prefix: Annotated[
        str, typer.Option(help="Text the answer starts with (after the generation prompt).")
    ] = "",
    model: ModelOption = "smollm2-135m",
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
    kv_bits: KvBitsOption = 16,
    memory: Annotated[
        float | None,
        typer.Option(
            help="A byte budget instead of --budget/--ratio/--kv-bits: the share of the full cache's bytes "
            "the prompt's cache may take, in (0, 1]; the method's best entries at 8 bits, the next at 4."
        ),
    ] = None,
    dtype: DtypeOption = "float32",
    device: DeviceOption = "auto",
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
    from kvbudget.cache import check_kv_bits

    bits = check_kv_bits(kv_bits)
    from kvbudget.byte_budget import check_memory

    check_memory(memory, budget, ratio, bits)
    check.at_least(max_new_tokens, 1, "--max-new-tokens")
    dtype = check.dtype(dtype)
    check.model_source(model)
    lm, tokenizer = load_model(model, dtype=dtype, device=device)
    result = run(
        lm, tokenizer, context, question, answer_prefix, method=method_obj, budget=budget, ratio=ratio,
        max_new_tokens=max_new_tokens, compress_context_only=compress_context_only, kv_bits=bits,
        memory=memory,
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
        ("stored at", _precision(bits, after.extra.get("byte_budget"))),
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


def _precision(bits: int | None, chosen: dict | None) -> str:
    """How the cache stores its entries: the dtype, one precision, or a byte budget's two."""
    if chosen is not None:
        (high, low), n_high, n_low = chosen["tiers"], sum(chosen["high"]), sum(chosen["low"])
        return f"{n_high} entries at {high} bits, {n_low} at {low} (scales included)"
    return f"{bits} bits (scales included)" if bits else "the model's dtype"
