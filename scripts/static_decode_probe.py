"""Time decode steps over a static compressed cache on a GPU, beside transformers' fastest full cache.

    python scripts/static_decode_probe.py --out DIR [--lengths 32768,131072] [--deadline-s 300]

A Qwen2.5-7B-sized model with random weights (bf16, built on the device from
``scripts/random_model_dir.py``'s config; no files, no hub), then, writing each row to
``DIR/static.jsonl`` as soon as it is measured (a run cut short keeps what it finished):

1. ``bandwidth``: the device's copy bandwidth and the weights' bytes (``kvbudget.bench.bandwidth``).
2. ``static`` rows, at each length: a :class:`~kvbudget.static_cache.StaticBudgetCache` filled with
   random entries — ``full`` (every token), ``snapkv`` (``--ratio`` of the prompt evicted, the same
   per head), ``lava`` (the same total with ragged, skewed per-head budgets, padded to each layer's
   longest head), ``snapkv-1024`` (1024 per head, as the earlier runs) — decoded by
   :class:`~kvbudget.static_decode.StaticDecoder` eagerly and as a CUDA graph: ms per token, the
   kernels one eager step launches (torch.profiler), the bandwidth bound of the bytes a step reads.
3. ``static-compiled`` rows: the static step through ``torch.compile``, then as a CUDA graph
   (snapkv and full at the first length): ms per token, kernels per replay, compilation time.
4. ``batch`` rows: the ``static`` rows at batch 8 and the first length (aggregate tokens per second).
5. ``attention`` rows: one layer's decode attention, 28 calls, by each candidate kernel: the static
   one (one SDPA call per layer, group as queries, length mask), SDPA with ``enable_gqa`` and a mask,
   today's per-head loop, FlexAttention with a block mask, ``varlen_attn`` (where torch has it).
6. ``hf`` rows: transformers' ``StaticCache`` with the model's SDPA attention, as a CUDA graph
   captured by hand and through ``torch.compile(mode="reduce-overhead")``, and its
   ``DynamicCache`` eagerly: the fair full-cache baselines.

With random weights the tokens mean nothing; the figures are the costs of the machinery.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

CUDA = torch.autograd.DeviceType.CUDA
#: where everything runs: DEV, or "cpu" for ``--dry-run`` (a tiny model, no graphs: checks the script)
DEV = "cuda"


class Rows:
    def __init__(self, path: Path, deadline: float) -> None:
        self.path, self.deadline = path, deadline
        self.start = time.perf_counter()
        self.first_length = 0

    def left(self) -> float:
        return self.deadline - (time.perf_counter() - self.start)

    def write(self, **row) -> None:
        row["t"] = round(time.perf_counter() - self.start, 1)
        line = json.dumps(row)
        print(line, flush=True)
        with self.path.open("a") as fh:
            fh.write(line + "\n")

    def guarded(self, what: str, fn: Callable[[], None], need_s: float) -> None:
        if self.left() < need_s:
            self.write(phase="skipped", what=what, left_s=round(self.left(), 1))
            return
        try:
            fn()
        except Exception as exc:  # a failed variant is a finding, not the end of the run
            self.write(phase="error", what=what, error=f"{type(exc).__name__}: {exc}"[:600],
                       where=traceback.format_exc().splitlines()[-3:])  # fmt: skip
            reset_peak()


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call of ``fn``, ``repeats`` calls after one more as warm-up, one sync at the end."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def kernels(fn: Callable[[], object], steps: int) -> dict:
    """Device kernels (and copies) launched and device milliseconds, per call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()
    events = prof.key_averages()
    count = sum(e.count for e in events if e.device_type == CUDA)
    device_us = sum(e.self_device_time_total for e in events if e.device_type == CUDA)
    top = sorted((e for e in events if e.device_type == CUDA), key=lambda e: -e.self_device_time_total)[:6]
    return {"kernels_per_step": count / steps, "device_ms_per_step": device_us / steps / 1000,
            "top_kernels": [(e.key[:80], e.count // steps, round(e.self_device_time_total / steps / 1000, 3))
                            for e in top]}  # fmt: skip


def build_model(dtype: torch.dtype, tiny: bool = False):
    from random_model_dir import CONFIGS
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(CONFIGS["qwen2.5-7b"])
    spec["max_position_embeddings"] = 262144
    if tiny:
        spec.update(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            vocab_size=1024,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def head_lengths(kind: str, length: int, ratio: float, layers: int, heads: int, batch: int, seed: int = 0):
    """Per-layer ``[batch, heads]`` kept entries for a synthetic cache of ``kind``."""
    if kind == "full":
        return [torch.full((batch, heads), length, dtype=torch.long) for _ in range(layers)]
    if kind == "snapkv-1024":
        return [torch.full((batch, heads), min(1024, length), dtype=torch.long) for _ in range(layers)]
    keep = max(1, round(length * (1 - ratio)))
    if kind == "snapkv":
        return [torch.full((batch, heads), keep, dtype=torch.long) for _ in range(layers)]
    # lava: layer budgets and head budgets skewed (log-normal shares), the same total as snapkv
    gen = torch.Generator().manual_seed(seed)
    layer_share = torch.exp(0.5 * torch.randn(layers, generator=gen))
    layer_share = layer_share / layer_share.sum() * layers
    out = []
    for share in layer_share:
        head_share = torch.exp(torch.randn(batch, heads, generator=gen))
        head_share = head_share / head_share.sum(-1, keepdim=True) * heads
        out.append((keep * share * head_share).round().long().clamp(16, length))
    return out


def peak_mib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if DEV == "cuda" else None


def reset_peak() -> None:
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.empty_cache()


def fill_random(cache) -> None:
    for k, v in zip(cache.keys, cache.values, strict=True):
        k.normal_()
        v.normal_()


def static_rows(rows: Rows, model, bw: float, weights: int, length: int, kind: str, batch: int,
                ratio: float, new_tokens: int, profile: bool) -> None:  # fmt: skip
    from kvbudget.static_cache import StaticBudgetCache
    from kvbudget.static_decode import StaticDecoder

    reset_peak()
    cfg = model.config
    lengths = head_lengths(kind, length, ratio, cfg.num_hidden_layers, cfg.num_key_value_heads, batch)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache = StaticBudgetCache.allocate(
        lengths, head_dim, 2 * new_tokens + 16, torch.bfloat16, DEV, seen=length
    )
    fill_random(cache)
    logical, physical = cache.logical_bytes(), cache.physical_bytes()
    start_token = torch.zeros(batch, dtype=torch.long)
    row = {"phase": "batch" if batch > 1 else "static", "kind": kind, "length": length, "batch": batch,
           "ratio": None if kind == "full" else ratio, "kv_logical_mib": logical / 2**20,
           "kv_physical_mib": physical / 2**20, "padding_mib": cache.padding_bytes() / 2**20,
           "bound_ms": 1000 * (weights + logical) / bw,
           "bound_physical_ms": 1000 * (weights + physical) / bw}  # fmt: skip
    eager = StaticDecoder(model, cache, start_token, graph=False)
    row["eager_ms"] = 1000 * timed(eager.step, 4)
    if profile:
        row["eager_profile"] = kernels(eager.step, 2)
    graph = StaticDecoder(model, cache, start_token, graph=DEV == "cuda")
    graph.step()  # warm-up
    graph.step()  # capture + replay
    row["graph_ms"] = 1000 * timed(graph.step, new_tokens)
    row["graph_tokens_per_s"] = batch / (row["graph_ms"] / 1000)
    row["graph_over_bound"] = row["graph_ms"] / row["bound_ms"]
    if profile:
        row["graph_profile"] = kernels(graph.step, 4)
    row["peak_gpu_mib"] = peak_mib()
    rows.write(**row)
    del eager, graph, cache
    reset_peak()


def compiled_static_row(rows: Rows, model, bw: float, weights: int, length: int, kind: str, ratio: float,
                        new_tokens: int) -> None:  # fmt: skip
    """The static step through ``torch.compile`` (norms, RoPE, activations fused), then captured as a
    CUDA graph: ms per token against the bound, the kernels a replay launches, the compilation time."""
    from kvbudget.static_cache import StaticBudgetCache
    from kvbudget.static_decode import StaticDecoder

    reset_peak()
    cfg = model.config
    lengths = head_lengths(kind, length, ratio, cfg.num_hidden_layers, cfg.num_key_value_heads, 1)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache = StaticBudgetCache.allocate(
        lengths, head_dim, 2 * new_tokens + 16, torch.bfloat16, DEV, seen=length
    )
    fill_random(cache)
    logical = cache.logical_bytes()
    start = time.perf_counter()
    decoder = StaticDecoder(
        model, cache, torch.zeros(1, dtype=torch.long), graph=DEV == "cuda", compiled=True
    )
    decoder.step()  # compile + warm-up
    decoder.step()  # capture + replay
    torch.cuda.synchronize() if DEV == "cuda" else None
    row = {"phase": "static-compiled", "kind": kind, "length": length, "batch": 1,
           "ratio": None if kind == "full" else ratio, "compile_s": time.perf_counter() - start,
           "bound_ms": 1000 * (weights + logical) / bw}  # fmt: skip
    row["graph_ms"] = 1000 * timed(decoder.step, new_tokens)
    row["graph_over_bound"] = row["graph_ms"] / row["bound_ms"]
    row["graph_profile"] = kernels(decoder.step, 4)
    row["peak_gpu_mib"] = peak_mib()
    rows.write(**row)
    del decoder, cache
    reset_peak()


def attention_rows(rows: Rows, config, length: int, ratio: float) -> None:
    """One decode step's attention (``layers`` calls) by each candidate kernel, ragged heads."""
    import torch.nn.functional as F

    from kvbudget.attention import _cudnn_sdpa_off, attend_static
    from kvbudget.static_cache import StaticBudgetCache

    layers = config.num_hidden_layers
    b, hq, hk = 1, config.num_attention_heads, config.num_key_value_heads
    d = config.hidden_size // hq
    lens = head_lengths("lava", length, ratio, layers, hk, b)
    cache = StaticBudgetCache.allocate(lens, d, 64, torch.bfloat16, DEV, seen=length)
    fill_random(cache)
    q = torch.randn(b, hq, 1, d, device=DEV, dtype=torch.bfloat16)
    scale = d**-0.5
    heads_k = [[cache.keys[i][:, h, : int(lens[i][0, h])] for h in range(hk)] for i in range(layers)]
    heads_v = [[cache.values[i][:, h, : int(lens[i][0, h])] for h in range(hk)] for i in range(layers)]
    group = hq // hk

    def static() -> None:
        for i in range(layers):
            attend_static(q, cache, i, scale)

    def static_grouped() -> None:
        for i in range(layers):
            attend_static(q, cache, i, scale, grouped_queries=True)

    def gqa_mask() -> None:
        for i in range(layers):
            mask = (cache._slots[i] < cache.lengths[i][..., None])[:, :, None, :]
            mask = mask.repeat_interleave(group, dim=1)
            F.scaled_dot_product_attention(q, cache.keys[i], cache.values[i], attn_mask=mask, scale=scale,
                                           enable_gqa=True)  # fmt: skip

    def per_head() -> None:
        with _cudnn_sdpa_off():
            for i in range(layers):
                outs = [
                    F.scaled_dot_product_attention(
                        q[:, h * group : (h + 1) * group],
                        heads_k[i][h][:, None],
                        heads_v[i][h][:, None],
                        scale=scale,
                    )
                    for h in range(hk)
                ]
                torch.cat(outs, dim=1)

    variants = {"static-sdpa": static, "static-grouped": static_grouped, "gqa-mask": gqa_mask,
                "per-head-loop": per_head}  # fmt: skip
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        masks = []
        for i in range(layers):
            n = cache.lengths[i]

            def mod(bi, hi, qi, ki, n=n):
                return ki < n[bi, hi // group]

            masks.append(create_block_mask(mod, b, hq, 1, cache.keys[i].shape[2], device=DEV))

        def flex_all() -> None:
            for i in range(layers):
                flex(q, cache.keys[i], cache.values[i], block_mask=masks[i], scale=scale, enable_gqa=True)

        variants["flex"] = flex_all
    except Exception as exc:
        rows.write(
            phase="attention", variant="flex", length=length, error=f"{type(exc).__name__}: {exc}"[:300]
        )
    try:
        from torch.nn.attention.varlen import varlen_attn

        # each (row, KV head) one sequence: its query group as heads, its entries packed flat
        flat_k = [
            torch.cat([cache.keys[i][0, h, : int(lens[i][0, h])] for h in range(hk)])[:, None].contiguous()
            for i in range(layers)
        ]
        flat_v = [
            torch.cat([cache.values[i][0, h, : int(lens[i][0, h])] for h in range(hk)])[:, None].contiguous()
            for i in range(layers)
        ]
        cu_k = [
            torch.tensor([0] + torch.cumsum(lens[i][0], 0).tolist(), dtype=torch.int32, device=DEV)
            for i in range(layers)
        ]
        # the query group as that sequence's ``group`` query tokens, one head (no enable_gqa needed)
        cu_q = group * torch.arange(hk + 1, dtype=torch.int32, device=DEV)
        qv = q.reshape(hk * group, 1, d)
        max_k = [int(lens[i].max()) for i in range(layers)]

        def varlen() -> None:
            for i in range(layers):
                varlen_attn(qv, flat_k[i], flat_v[i], cu_q, cu_k[i], group, max_k[i])

        variants["varlen"] = varlen
    except Exception as exc:
        rows.write(
            phase="attention", variant="varlen", length=length, error=f"{type(exc).__name__}: {exc}"[:300]
        )
    for name, fn in variants.items():
        try:
            eager_ms = 1000 * timed(fn, 10)
            graph_ms = None
            try:
                if DEV != "cuda":
                    raise RuntimeError("no CUDA graphs on the CPU")
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                graph_ms = 1000 * timed(graph.replay, 20)
            except Exception as exc:
                graph_ms = f"{type(exc).__name__}: {exc}"[:200]
            prof = kernels(fn, 2)
            rows.write(phase="attention", variant=name, length=length, calls=layers, eager_ms=eager_ms,
                       graph_ms=graph_ms, kernels=prof["kernels_per_step"],
                       device_ms=prof["device_ms_per_step"],
                       top=prof["top_kernels"][:3])  # fmt: skip
        except Exception as exc:
            rows.write(
                phase="attention", variant=name, length=length, error=f"{type(exc).__name__}: {exc}"[:300]
            )


def hf_static_rows(
    rows: Rows, model, bw: float, weights: int, length: int, new_tokens: int, compiled: bool
) -> None:
    """transformers' StaticCache filled with random entries up to ``length``, decoded greedily."""
    from transformers import StaticCache

    from kvbudget.attention import detach

    detach(model)  # the static rows attached kvbudget's attention: these rows run transformers' SDPA
    reset_peak()
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=length + 2 * new_tokens + 8)
    ids = torch.zeros((1, 1), dtype=torch.long, device=DEV)
    pos = torch.zeros((1, 1), dtype=torch.long, device=DEV)
    cp = torch.zeros((1,), dtype=torch.long, device=DEV)
    with torch.inference_mode():
        model(input_ids=ids, position_ids=pos, cache_position=cp, past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            layer.keys.normal_()
            layer.values.normal_()
    cp.fill_(length)
    pos.fill_(length)
    kv = (
        2
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * (cfg.hidden_size // cfg.num_attention_heads)
        * 2
        * length
    )
    forward = model.forward
    if compiled:
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def step() -> None:
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        out = forward(input_ids=ids, position_ids=pos, cache_position=cp, past_key_values=cache,
                      use_cache=True, logits_to_keep=1)  # fmt: skip
        ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        cp.add_(1)
        pos.add_(1)

    row = {"phase": "hf", "kind": "static-compiled" if compiled else "static-graph", "length": length,
           "batch": 1,
           "kv_logical_mib": kv / 2**20, "bound_ms": 1000 * (weights + kv) / bw}  # fmt: skip
    with torch.inference_mode():
        start = time.perf_counter()
        if compiled:
            for _ in range(3):
                step()
            sync()
            row["compile_s"] = time.perf_counter() - start
            row["ms"] = 1000 * timed(step, new_tokens)
        else:
            row["eager_ms"] = 1000 * timed(step, 4)
            if length == rows.first_length:
                row["eager_profile"] = kernels(step, 2)
            if DEV != "cuda":
                row["ms"] = row["eager_ms"]
                row["over_bound"] = row["ms"] / row["bound_ms"]
                rows.write(**row)
                return
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            row["ms"] = 1000 * timed(graph.replay, new_tokens)
    row["over_bound"] = row["ms"] / row["bound_ms"]
    row["peak_gpu_mib"] = peak_mib()
    rows.write(**row)
    reset_peak()


def hf_dynamic_row(rows: Rows, model, length: int) -> None:
    """transformers' DynamicCache after a real prefill of ``length`` tokens, eager decode steps."""
    from transformers import DynamicCache

    from kvbudget.attention import detach

    detach(model)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        ids = torch.randint(0, 1000, (1, length), device=DEV)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)

        def step() -> None:
            nonlocal token
            token = (
                model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
                .logits[:, -1]
                .argmax(-1, keepdim=True)
            )

        ms = 1000 * timed(step, 8)
    rows.write(phase="hf", kind="dynamic-eager", length=length, batch=1, ms=ms)
    reset_peak()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--ratio", type=float, default=0.875)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--deadline-s", type=float, default=300)
    parser.add_argument("--skip", default="", help="comma-separated phases to leave out")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: checks the script")
    args = parser.parse_args(argv)
    global DEV
    if args.dry_run:
        DEV = "cpu"
    elif not torch.cuda.is_available():
        print("static_decode_probe.py needs a CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = Rows(args.out / "static.jsonl", args.deadline_s)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows.first_length = lengths[0]
    skip = set(args.skip.split(","))
    import transformers

    from kvbudget.bench.bandwidth import measure_bandwidth, weight_bytes

    model = build_model(torch.bfloat16, tiny=args.dry_run)
    bw = measure_bandwidth(device=DEV)
    weights = weight_bytes(model)
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    rows.write(phase="bandwidth", copy=bw.copy, read=bw.read, weights=weights, device=device,
               torch=torch.__version__, transformers=transformers.__version__)  # fmt: skip
    nt = args.new_tokens
    if "static" not in skip:
        for length in lengths:
            for kind in ("snapkv", "lava", "full", "snapkv-1024"):
                rows.guarded(
                    f"static {kind} {length}",
                    lambda length=length, kind=kind: static_rows(
                        rows,
                        model,
                        bw.copy,
                        weights,
                        length,
                        kind,
                        1,
                        args.ratio,
                        nt,
                        profile=length == lengths[0],
                    ),
                    8,
                )
    if "static-compiled" not in skip:  # our step compiled (#49): the eager step's GPU work is the gap
        for kind in ("snapkv", "full"):
            rows.guarded(
                f"static-compiled {kind} {lengths[0]}",
                lambda kind=kind: compiled_static_row(
                    rows, model, bw.copy, weights, lengths[0], kind, args.ratio, nt
                ),
                120,
            )
    if "batch" not in skip:
        for kind in ("snapkv", "lava", "full"):
            rows.guarded(
                f"batch {kind}",
                lambda kind=kind: static_rows(
                    rows, model, bw.copy, weights, lengths[0], kind, 8, args.ratio, nt, profile=False
                ),
                10,
            )
    if "hf" not in skip:
        for length in lengths:
            rows.guarded(
                f"hf static-graph {length}",
                lambda length=length: hf_static_rows(rows, model, bw.copy, weights, length, nt, False),
                10,
            )
    if "attention" not in skip:
        rows.guarded("attention", lambda: attention_rows(rows, model.config, lengths[0], args.ratio), 30)
    if "compiled" not in skip:
        for length in lengths:
            rows.guarded(
                f"hf static-compiled {length}",
                lambda length=length: hf_static_rows(rows, model, bw.copy, weights, length, nt, True),
                90,
            )
    if "dynamic" not in skip:
        rows.guarded(f"hf dynamic {lengths[0]}", lambda: hf_dynamic_row(rows, model, lengths[0]), 20)
    rows.write(phase="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
