"""Run prompts through OpenVINO GenAI's continuous-batching pipeline (executed by ``.venv-ov/bin/python``).

A standalone script: it imports nothing from kvbudget (``.venv-ov`` has OpenVINO, its own
transformers and no kvbudget), reads ``prompts.jsonl`` — one line per request, ``{"id", "input_ids",
"max_new_tokens", "eos_ids", "ignore_eos"}``: token ids already built by kvbudget's task generators
and chat template — and writes one JSON document (``--out``, or stdout) with one run per mode.

Each mode builds a ``ContinuousBatchingPipeline`` on the OpenVINO IR folder (``optimum-cli export
openvino --task text-generation-with-past``) whose KV pool is the cap: ``SchedulerConfig.num_kv_blocks``
= ``cap_bytes`` // the bytes of one block (``block_size`` tokens × 2 (K, V) × layers × KV heads × head
dim × the element size of ``--kv-precision``; its ``cache_size`` counts whole GB only). The KV cache's
element type is set through the CPU plugin's ``KEY_CACHE_PRECISION`` / ``VALUE_CACHE_PRECISION``
(OpenVINO's CPU default is u8, which would hold twice the tokens of a bf16 cache in the same bytes).

- ``full``: no eviction; every sequence holds its whole prompt and answer.
- ``eviction``: ``use_cache_eviction`` with a ``CacheEvictionConfig`` whose ``max_cache_size`` is
  ``keep_fraction`` of the longest prompt rounded to the nearest whole block (kvbudget's compressed
  methods at kvpress ratio 0.875 keep 0.125 of it), ``start_size`` one block, ``recent_size`` and
  ``snapkv_window_size`` the SnapKV observation window rounded up to a block (OpenVINO scores the
  prompt with the last ``snapkv_window_size`` queries, as SnapKV does, then keeps aggregating the
  scores while decoding: ``--aggregation``).

Requests are submitted ``--concurrency`` at a time (default: all at once) and the pipeline is
stepped by hand (``step()``), so each request's first and last token are timed at the step that
produced them: ``ttft_s`` from its submission, ``tpot_s`` the mean seconds between its later tokens.
After every step ``get_metrics()`` is read: ``held_at_once`` is the largest ``scheduled_requests``
(sequences in one step), ``peak_kv_bytes`` the largest ``cache_usage`` share of the pool. A request
the pool cannot hold is answered ``IGNORED`` by the pipeline and reported as an error. Before the
timed run one untimed request (the first prompt's first 64 tokens, 2 new tokens) warms the
pipeline up. Decoding is greedy.

Usage: python -P openvino_runner.py --model OV_DIR --prompts P.jsonl --cap-bytes N
       [--modes full,eviction] [--keep-fraction 0.125] [--window 32] [--concurrency C] [--out O.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
MODES = ("full", "eviction")


def kv_bytes_per_token(model_dir: Path, precision: str) -> int:
    """KV bytes one token takes across all layers (keys and values), from the model's config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * ELEMENT_BYTES[precision]


def eviction_sizes(keep_fraction: float, longest_prompt: int, block_size: int, window: int) -> dict[str, int]:
    """``CacheEvictionConfig`` sizes (tokens, whole blocks): the kept fraction of the longest prompt
    rounded to the nearest block, never below start + recent + one evictable block."""
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"--keep-fraction must be in (0, 1], got {keep_fraction}")
    start = block_size
    recent = math.ceil(window / block_size) * block_size
    kept = round(keep_fraction * longest_prompt / block_size) * block_size
    return {"start_size": start, "recent_size": recent, "snapkv_window_size": window,
            "max_cache_size": max(kept, start + recent + block_size)}  # fmt: skip


def scheduler_config(num_kv_blocks: int, eviction: dict | None, aggregation: str, max_batched_tokens: int):
    import openvino_genai as ov_genai

    config = ov_genai.SchedulerConfig()
    config.num_kv_blocks = num_kv_blocks
    config.max_num_batched_tokens = max_batched_tokens
    config.enable_prefix_caching = False  # each request prefills its own prompt, as kvbudget's server
    if eviction is not None:
        config.use_cache_eviction = True
        config.cache_eviction_config = ov_genai.CacheEvictionConfig(
            eviction["start_size"], eviction["recent_size"], eviction["max_cache_size"],
            getattr(ov_genai.AggregationMode, aggregation), apply_rotation=False,
            snapkv_window_size=eviction["snapkv_window_size"],
        )  # fmt: skip
    return config


def generation_config(pipe, prompt: dict):
    config = pipe.get_config()
    config.max_new_tokens = int(prompt["max_new_tokens"])
    config.do_sample = False
    if prompt.get("eos_ids"):
        config.stop_token_ids = set(prompt["eos_ids"])
    config.ignore_eos = bool(prompt.get("ignore_eos", False))
    return config


def run_requests(pipe, prompts: list[dict], concurrency: int, pool_bytes: int) -> dict:
    """Submit ``prompts`` ``concurrency`` at a time and step the pipeline until all are done."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    finished = {ov_genai.GenerationStatus.FINISHED, ov_genai.GenerationStatus.STOP}
    pending = list(enumerate(prompts))
    active: dict[int, dict] = {}
    done: list[dict] = []
    held, usage, steps = 0, 0.0, 0
    start = time.perf_counter()
    while pending or active:
        while pending and len(active) < concurrency:
            index, prompt = pending.pop(0)
            ids = ov.Tensor(np.asarray([prompt["input_ids"]], dtype=np.int64))
            handle = pipe.add_request(index, ids, generation_config(pipe, prompt))
            active[index] = {"prompt": prompt, "handle": handle, "submitted": time.perf_counter(),
                             "tokens": [], "first": None, "last": None}  # fmt: skip
        pipe.step()
        steps += 1
        now = time.perf_counter()
        metrics = pipe.get_metrics()
        held = max(held, metrics.scheduled_requests)
        usage = max(usage, metrics.cache_usage)
        for index, state in list(active.items()):
            handle = state["handle"]
            while handle.can_read():
                for output in handle.read().values():
                    if output.generated_ids:
                        state["first"] = now if state["first"] is None else state["first"]
                        state["last"] = now
                        state["tokens"].extend(int(t) for t in output.generated_ids)
            status = handle.get_status()
            if status == ov_genai.GenerationStatus.RUNNING:
                continue
            del active[index]
            row = {"id": state["prompt"].get("id", index), "prompt_tokens": len(state["prompt"]["input_ids"]),
                   "token_ids": state["tokens"], "status": status.name}  # fmt: skip
            if status not in finished:
                row["error"] = f"the pipeline answered {status.name} (the KV pool could not hold it)"
            first, last, n = state["first"], state["last"], len(state["tokens"])
            row["ttft_s"] = None if first is None else first - state["submitted"]
            row["tpot_s"] = (last - first) / (n - 1) if first is not None and n > 1 else None
            done.append(row)
    wall = time.perf_counter() - start
    done.sort(key=lambda r: r["id"])
    tokens = sum(len(r["token_ids"]) for r in done)
    return {"requests": done, "wall_s": wall, "steps": steps, "tokens": tokens,
            "tokens_per_s": tokens / wall if wall else None, "held_at_once": held,
            "peak_cache_usage": usage, "peak_kv_bytes": round(usage / 100.0 * pool_bytes)}  # fmt: skip


def warm_up(pipe, prompt: dict) -> None:
    run_requests(pipe, [{**prompt, "input_ids": prompt["input_ids"][:64], "max_new_tokens": 2}], 1, 0)


def run_mode(args, mode: str, prompts: list[dict]) -> dict:
    import openvino_genai as ov_genai

    model_dir = Path(args.model)
    per_token = kv_bytes_per_token(model_dir, args.kv_precision)
    block_bytes = per_token * args.block_size
    num_kv_blocks = args.cap_bytes // block_bytes
    longest = max(len(p["input_ids"]) for p in prompts)
    eviction = None
    if mode == "eviction":
        eviction = eviction_sizes(args.keep_fraction, longest, args.block_size, args.window)
    config = scheduler_config(num_kv_blocks, eviction, args.aggregation, args.max_batched_tokens)
    precision = args.kv_precision
    properties = {"KEY_CACHE_PRECISION": precision, "VALUE_CACHE_PRECISION": precision,
                  "INFERENCE_PRECISION_HINT": args.inference_precision}  # fmt: skip
    built = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(str(model_dir), config, args.device, properties)
    load_s = time.perf_counter() - built
    pool = pipe.get_metrics().kv_cache_size_in_bytes
    if args.warmup:
        warm_up(pipe, prompts[0])
    result = run_requests(pipe, prompts, args.concurrency or len(prompts), num_kv_blocks * block_bytes)
    metrics = pipe.get_metrics()
    del pipe
    gc.collect()
    return {"mode": mode, "num_kv_blocks": num_kv_blocks, "block_size": args.block_size,
            "kv_bytes_per_token": per_token, "pool_bytes": num_kv_blocks * block_bytes,
            "reported_pool_bytes": pool or metrics.kv_cache_size_in_bytes, "cache_eviction": eviction,
            "aggregation": args.aggregation if eviction else None, "load_s": load_s,
            "scheduler": config.to_string(), **result}  # fmt: skip


def read_prompts(path: str) -> list[dict]:
    with open(path) as fh:
        prompts = [json.loads(line) for line in fh if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="OpenVINO IR folder (optimum-cli export openvino)")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--cap-bytes", type=int, required=True, help="the KV pool, in bytes")
    parser.add_argument("--modes", default="full,eviction")
    parser.add_argument("--keep-fraction", type=float, default=0.125, help="of the longest prompt, eviction")
    parser.add_argument("--window", type=int, default=32, help="SnapKV observation window (recent, snapkv)")
    parser.add_argument("--aggregation", default="NORM_SUM", choices=["SUM", "NORM_SUM", "ADAPTIVE_RKV"])
    parser.add_argument("--block-size", type=int, default=32, help="KV block of the CPU plugin, in tokens")
    parser.add_argument("--kv-precision", default="bf16", choices=sorted(ELEMENT_BYTES))
    parser.add_argument("--inference-precision", default="bf16")
    parser.add_argument("--max-batched-tokens", type=int, default=256, help="tokens per step (prefill chunk)")
    parser.add_argument("--concurrency", type=int, default=0, help="requests in flight (0: all at once)")
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        parser.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")

    import openvino
    import openvino_genai

    prompts = read_prompts(args.prompts)
    runs = [run_mode(args, mode, prompts) for mode in modes]
    document = {"versions": {"openvino": openvino.__version__, "openvino_genai": openvino_genai.__version__},
                "device": args.device, "kv_precision": args.kv_precision,
                "inference_precision": args.inference_precision, "cap_bytes": args.cap_bytes,
                "runs": runs}  # fmt: skip
    text = json.dumps(document)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
