"""``kvbudget serve``: the OpenAI-compatible server over one model (docs/serving.md)."""

from __future__ import annotations

import logging.config
from pathlib import Path
from typing import Annotated

import typer

from kvbudget.cli import checks as check
from kvbudget.cli.base import user_errors
from kvbudget.cli.options import DtypeOption, ModelOption
from kvbudget.errors import InputError
from kvbudget.extras import needs_extra
from kvbudget.serve import defaults


@user_errors
@needs_extra("serve", "kvbudget serve")
def serve(
    model: ModelOption = "smollm2-135m",
    method: Annotated[
        str | None,
        typer.Option(
            help="Default method of a request that names none (`name` or `name:key=value,...`); without it, "
            f"{defaults.METHOD}: every entry kept, stored at 4 bits (chosen from the shared-context rows, "
            "docs/leaderboard.md)."
        ),
    ] = None,
    budget: Annotated[int | None, typer.Option(help="Default entries per KV head.")] = None,
    ratio: Annotated[
        float | None, typer.Option(help="Default fraction of the prompt kept, in (0, 1].")
    ] = defaults.RATIO,
    kv_bits: Annotated[
        int | None,
        typer.Option(
            "--kv-bits",
            help="Bits each stored key/value number takes after the prefill: 2, 4 or 8 (KIVI groups), 16 = "
            "the model's dtype; without it, the method's own (16, or 4 for the default method).",
        ),
    ] = None,
    memory: Annotated[
        float | None,
        typer.Option(
            help="Default byte budget instead of --budget/--ratio/--kv-bits: the share of the full cache's "
            "bytes a prompt's cache may take, in (0, 1]."
        ),
    ] = None,
    document_method: Annotated[
        str,
        typer.Option(
            help="How a shared document (POST /v1/kvbudget/documents) is compressed when its creator names "
            "no method: a spec with its size (`kvzip:kv_bits=4`, the default, keeps half at 4 bits; "
            "`kvzip:memory=0.125` is a byte budget)."
        ),
    ] = defaults.DOCUMENT_METHOD,
    memory_cap: Annotated[
        str, typer.Option(help="KV cache bytes the server may hold, all conversations together (e.g. 2GiB).")
    ] = "2GiB",
    share_prefix_tokens: Annotated[
        int,
        typer.Option(
            help="A chat's leading system messages of at least this many tokens, followed by fewer, are "
            "compressed once with --document-method and shared by every request that begins with them "
            "(0: never)."
        ),
    ] = 512,
    chunk_tokens: Annotated[
        int,
        typer.Option(
            help="While others decode, read prompts of at least this many tokens a few layers at a time "
            "between their steps (0: never)."
        ),
    ] = 1024,
    chunk_layers: Annotated[int, typer.Option(help="Decoder layers a piece of such a prompt.")] = 1,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            help="Also write shared documents here; found again after a restart and by other servers of "
            "the same model pointed at it."
        ),
    ] = None,
    cache_dir_cap: Annotated[
        str, typer.Option(help="Bytes --cache-dir may hold (least recently used documents deleted first).")
    ] = "10GiB",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    device: Annotated[
        str, typer.Option(help="cpu, cuda[:index] or auto (the GPU when there is one).")
    ] = "auto",
    dtype: DtypeOption = "bfloat16",
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
    max_body: Annotated[
        str, typer.Option(help="Largest request body (e.g. 1MiB); a larger one gets 413 before it is parsed.")
    ] = "1MiB",
    max_prompt_tokens: Annotated[
        int | None,
        typer.Option(
            help="Most tokens a prompt may have, counted while tokenizing (default: the model's context)."
        ),
    ] = None,
    log_level: Annotated[
        str, typer.Option(help="critical, error, warning, info (one access line a request) or debug.")
    ] = "info",
) -> None:
    """Serve the model with an OpenAI-compatible API: many conversations under one KV memory cap,
    each compressed with its own method (docs/serving.md)."""
    import uvicorn

    from kvbudget.methods.spec import MethodSpec
    from kvbudget.models import load_model
    from kvbudget.serve.app import create_app, prometheus_metrics
    from kvbudget.serve.batcher import Compression, full_cache_size_refusal
    from kvbudget.serve.logs import LEVELS, log, log_config
    from kvbudget.serve.scheduler import Scheduler
    from kvbudget.units import format_bytes, parse_size

    cap = parse_size(memory_cap)
    document_dir = None
    if cache_dir is not None:
        from kvbudget.serve.document_dir import DocumentDir

        document_dir = DocumentDir(cache_dir, parse_size(cache_dir_cap, "--cache-dir-cap"))
    body_limit = parse_size(max_body, "--max-body")
    from kvbudget.engine import check_size

    check_size(budget, ratio, "--")
    from kvbudget.cache import check_kv_bits

    method, kv_bits, memory = _storage_in_method(_method_or_default(method, kv_bits), kv_bits, memory)
    refusal = full_cache_size_refusal(method, budget, ratio, memory, prefix="--")
    if refusal is not None:
        raise InputError(refusal)
    bits = check_kv_bits(kv_bits)
    from kvbudget.byte_budget import check_memory

    check_memory(memory, budget, ratio, bits)
    check.at_least(max_queue, 1, "--max-queue")
    check.at_least(chunk_tokens, 0, "--chunk-tokens")
    check.at_least(share_prefix_tokens, 0, "--share-prefix-tokens")
    check.at_least(chunk_layers, 1, "--chunk-layers")
    check.at_least(max_prompt_tokens, 1, "--max-prompt-tokens")
    if log_level not in LEVELS:
        raise InputError(f"--log-level must be one of {', '.join(LEVELS)}, got {log_level!r}")
    if not 0 < port < 65536:
        raise InputError(f"--port must be in 1..65535, got {port}")
    dtype = check.dtype(dtype)
    check.model_source(model)
    default = Compression(method, budget, ratio, bits, memory)
    MethodSpec.parse(method)  # a bad method fails before the model loads
    document_default = Compression.for_document(document_method)
    from kvbudget.phases import Stage

    if Stage.DECODE in MethodSpec.parse(document_method).build().stages:
        raise InputError(f"--document-method {document_method} compresses while decoding: a shared "
                         "document's method must compress the prompt only")  # fmt: skip
    lm, tokenizer = load_model(model, dtype=dtype, device=device)
    registry, metrics = prometheus_metrics()
    scheduler = Scheduler(
        lm,
        tokenizer,
        cap,
        default,
        max_queue=max_queue,
        metrics=metrics,
        document_default=document_default,
        document_dir=document_dir,
        chunk_tokens=chunk_tokens or None,
        chunk_layers=chunk_layers,
    )
    name = served_name or model
    logging.config.dictConfig(log_config(log_level))  # the line below in the server's format too
    if lm.device.type == "cpu":  # built (once per machine) before the first request, not during it
        from kvbudget.quantized_read import kernel

        kernel()
    log.info("serving %s on http://%s:%s/v1 — default %s, KV cap %s", name, host, port, default.label(),
             format_bytes(cap))  # fmt: skip
    app = create_app(
        scheduler,
        name,
        registry,
        api_key,
        max_body=body_limit,
        max_prompt_tokens=max_prompt_tokens,
        share_prefix_tokens=share_prefix_tokens or None,
    )
    uvicorn.run(app, host=host, port=port, log_config=log_config(log_level), access_log=False)


def _method_or_default(method: str | None, kv_bits: int | None) -> str:
    """``--method``, else the server's default (:data:`kvbudget.serve.defaults.METHOD`), whose own
    precision ``--kv-bits`` replaces."""
    if method is not None:
        return method
    from kvbudget.methods.spec import split_storage

    return defaults.METHOD if kv_bits is None else split_storage(defaults.METHOD)[0]


def _storage_in_method(
    method: str, kv_bits: int | None, memory: float | None
) -> tuple[str, int, float | None]:
    """``--method NAME:kv_bits=b`` or ``NAME:memory=f`` read as ``--kv-bits b`` or ``--memory f``, the
    method left without it; given both ways, refused. No ``--kv-bits``: 16, the model's dtype."""
    from kvbudget.methods.spec import split_storage

    name, bits, share = split_storage(method)
    if bits is not None and kv_bits is not None:
        raise InputError(f"kv_bits is given twice: in --method {method} and as --kv-bits")
    if share is not None and memory is not None:
        raise InputError(f"memory is given twice: in --method {method} and as --memory")
    if bits is None:
        bits = 16 if kv_bits is None else kv_bits
    return name, bits, memory if share is None else share
