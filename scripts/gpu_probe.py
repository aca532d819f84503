"""Time plain transformers decoding beside kvbudget's, in one process, and profile a few steps.

    python scripts/gpu_probe.py MODEL_DIR --out DIR [--lengths 32768,131072] [--methods ...]

One model load (random weights from ``MODEL_DIR/config.json``, bf16, on cuda when there is one),
then for each length, in order of what matters most when time is short:

1. ``hf``: the model's own forward with transformers' ``DynamicCache`` (what ``model.generate``
   runs, without its logits processors): TTFT and TPOT, greedy, ``--new-tokens`` tokens;
2. each kvbudget method (``full`` first) through ``kvbudget.engine.prefill`` and ``decode_loop``,
   as ``kvbudget bench`` measures it, at ``--budget`` entries per head;
3. at the first length only, ``torch.profiler`` over five decode steps of ``hf``, three of each
   method, and one prefill of each compressing method at ``--profile-length`` tokens (0: none):
   kernels launched per step, the top operators by host and by device time, and the Python call
   sites with the most host time (``profiles.txt``).

Every row is appended to ``DIR/probe.jsonl`` as soon as it is measured, so a run cut short by a
time limit keeps what it finished. docs/gpu.md reads the rows; what the model generates means
nothing (random weights).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch

CUDA = torch.autograd.DeviceType.CUDA


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_run(model, ids: list[int], new_tokens: int) -> dict:
    """Greedy decoding with transformers' own cache and attention: TTFT, TPOT (seconds)."""
    from transformers import DynamicCache

    from kvbudget.attention import detach

    detach(model)  # kvbudget's prefill attached its attention; the next one attaches it again
    dev = model.device
    x = torch.tensor([ids], device=dev)
    sync(dev)
    start = time.perf_counter()
    cache = DynamicCache(config=model.config)
    out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    token.tolist()
    ttft = time.perf_counter() - start
    pos = len(ids)
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1,
                    position_ids=torch.tensor([[pos]], device=dev))  # fmt: skip
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        token.tolist()  # the stopping check every decoding loop makes
        pos += 1
    tpot = (time.perf_counter() - start) / max(new_tokens - 1, 1)
    return {"ttft_s": ttft, "tpot_s": tpot, "cache": cache}


def ours_run(model, prompt, method: str, budget: int, new_tokens: int) -> dict:
    """kvbudget's prefill and decode loop, as ``kvbudget bench`` times them."""
    from kvbudget.bench.measure import timed_prefill
    from kvbudget.engine import RunTimes, decode_loop
    from kvbudget.eval.runner import MethodSpec
    from kvbudget.session import CompressionSession

    session = CompressionSession(
        MethodSpec.parse(method).build(), model.config.num_hidden_layers, budget=budget
    )
    cache, logits, mask, last, wall = timed_prefill(model, [prompt], session, pad_id=0)
    decoded = decode_loop(model, cache, logits, mask, last, set(), new_tokens, trace=False)
    times = RunTimes.of(wall, session, decoded)
    held = sum(layer.held_bytes() for layer in cache.layers)
    return {"ttft_s": times.ttft, "tpot_s": times.tpot, "compress_s": times.compress,
            "kv_held_bytes": held, "cache": cache, "logits": logits, "mask": mask, "last": last}  # fmt: skip


def profile(fn, path: Path, title: str, steps: int) -> dict:
    """Run ``fn`` under torch.profiler; append the top operators, and the Python call sites that
    spend the most host time, under ``title`` to ``path``; returns kernels and time per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities, with_stack=True) as prof:
        fn()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == CUDA)
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    cuda_total = sum(e.self_device_time_total for e in events if e.device_type == CUDA)
    text = [f"=== {title}",
            f"kernels per step {kernels / steps:.0f}, aten calls per step {aten / steps:.0f}, "
            f"device time per step {cuda_total / steps / 1000:.2f} ms"]  # fmt: skip
    text.append(events.table(sort_by="self_cpu_time_total", row_limit=25))
    if torch.cuda.is_available():
        text.append(events.table(sort_by="self_cuda_time_total", row_limit=25))
    text.append(events.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=90))
    with path.open("a") as fh:
        fh.write("\n".join(text) + "\n")
    return {"kernels_per_step": kernels / steps, "aten_per_step": aten / steps,
            "device_ms_per_step": cuda_total / steps / 1000}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--methods", default="full,snapkv,lava,asl")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--profile-length", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)

    from kvbudget.attention import detach
    from kvbudget.bench.measure import fit_prompt
    from kvbudget.engine import decode_loop, prefill
    from kvbudget.eval.runner import MethodSpec
    from kvbudget.models import load_model
    from kvbudget.session import CompressionSession

    args.out.mkdir(parents=True, exist_ok=True)
    rows = (args.out / "probe.jsonl").open("a")
    t0 = time.perf_counter()

    def log(row: dict) -> None:
        row = {k: v for k, v in row.items() if k not in ("cache", "logits", "mask", "last")}
        row["at_s"] = round(time.perf_counter() - t0, 1)
        rows.write(json.dumps(row) + "\n")
        rows.flush()
        print(json.dumps(row), flush=True)

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, random_weights=True)
    dev = model.device
    sync(dev)
    log({"phase": "load", "device": str(dev), "torch": torch.__version__})
    methods = args.methods.split(",")
    warm = fit_prompt(tokenizer, "needle", 2 * args.budget + 64)
    hf_run(model, warm.ids, 3)
    for m in methods:
        ours_run(model, warm, m, args.budget, 3)
    log({"phase": "warm-up"})

    for i, length in enumerate(int(x) for x in args.lengths.split(",")):
        max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        prompt = fit_prompt(tokenizer, "needle", min(length, max_context - args.new_tokens))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        got = hf_run(model, prompt.ids, args.new_tokens)
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        log({"phase": "run", "method": "hf", "length": len(prompt.ids), **got, "gpu_peak_bytes": peak})
        if i == 0:
            cache, pos = got["cache"], len(prompt.ids)

            @torch.inference_mode()
            def hf_steps(cache=cache, pos=pos) -> None:
                token = torch.zeros((1, 1), dtype=torch.long, device=dev)
                for s in range(5):
                    out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1,
                                position_ids=torch.tensor([[pos + s]], device=dev))  # fmt: skip
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    token.tolist()

            detach(model)
            log({"phase": "profile", "method": "hf", "what": "5 decode steps",
                 **profile(hf_steps, args.out / "profiles.txt", "hf: 5 decode steps", 5)})  # fmt: skip
            del hf_steps, cache  # the peaks after this count only what each run holds
        del got
        for m in methods:
            budget = args.budget
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            got = ours_run(model, prompt, m, budget, args.new_tokens)
            peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
            log({"phase": "run", "method": m, "budget": budget, "length": len(prompt.ids), **got,
                 "gpu_peak_bytes": peak})  # fmt: skip
            if i == 0:
                c, logits, mask, last = got["cache"], got["logits"], got["mask"], got["last"]
                steps = partial(decode_loop, model, c, logits, mask, last, set(), 4, trace=False)
                log({"phase": "profile", "method": m, "what": "3 decode steps",
                     **profile(steps, args.out / "profiles.txt", f"{m}: 3 decode steps", 3)})  # fmt: skip
                del c, logits, mask, last, steps
            del got
        if i == 0 and args.profile_length:
            short = fit_prompt(tokenizer, "needle", args.profile_length)
            for m in methods:
                if m == "full":
                    continue
                session = CompressionSession(MethodSpec.parse(m).build(), model.config.num_hidden_layers,
                                             budget=args.budget)  # fmt: skip

                def run_prefill(session=session, short=short) -> None:
                    prefill(model, [short], session, pad_id=0)
                    sync(dev)

                what = f"prefill {len(short.ids)}"
                log({"phase": "profile", "method": m, "what": what,
                     **profile(run_prefill, args.out / "profiles.txt", f"{m}: {what}", 1)})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
