"""One benchmark measurement: one method, one context length, one budget, in this process.

Run it in a fresh process per measurement (``python -m kvbudget.bench.measure SPEC_JSON``, as
:mod:`kvbudget.bench.grid` does): the model is loaded, warmed up, the peak-RSS high-water mark is
reset (:mod:`kvbudget.bench.memory`), then the prompt is prefilled with layer-wise compression
and ``new_tokens`` tokens are decoded greedily, never stopping at EOS so every run decodes the
same number of steps. The worker prints one JSON line (the row) as its last line of output.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvbudget.bench.bandwidth import weight_bytes
from kvbudget.bench.memory import current_rss_bytes, peak_rss_bytes, reset_peak

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvbudget.cache import BudgetCache
    from kvbudget.engine import Prompt
    from kvbudget.session import CompressionSession

#: the prefix of the worker's result line on stdout
RESULT_PREFIX = "KVBUDGET_BENCH_ROW "


@dataclass
class MeasureSpec:
    """What one measurement runs.

    Attributes:
        model: registry name, local HF directory or .gguf file.
        method: method spec, ``name`` or ``name:key=value,...`` (``full`` = no compression;
            ``kv_bits=4`` among the pairs stores the cache at 4 bits).
        length: prompt length in tokens, template and question included (:func:`fit_prompt`), capped
            so the prompt and ``new_tokens`` fit the model's context (8192 − 64 for smollm2-135m).
        budget: entries per KV head (ignored by ``full``).
        new_tokens: tokens generated after the prompt (TPOT is the mean over the last
            ``new_tokens − 1``; the first comes from the prefill's logits).
        dtype: model dtype (``float32`` or ``bfloat16``).
        task: task whose generator makes the prompt (``needle``: an essay haystack with a question).
        seed: sample seed; repeat: index of this repetition (recorded only).
        batch: rows decoded together (the same prompt in every row, so nothing is padded): a
            decode step reads the weights once for all rows and each row's cache, so the larger
            the batch, the more of a step is cache reads. TPOT is per step (every row's token).
        device: where the model runs (``cpu``, ``cuda``, ``auto``; see :func:`kvbudget.load_model`).
            On a GPU the prefill's clock stops after a synchronize, and the row adds
            ``gpu_peak_bytes``: the allocator's peak over the measured prefill and decode.
        random_weights: build the model from its ``config.json`` with random weights
            (:func:`kvbudget.load_model`): the speed and memory of a size not on disk.
        decode: ``eager`` (over the ``BudgetCache``) or ``static`` (static buffers, one attention
            call per layer, a CUDA graph per step on a GPU: :func:`kvbudget.engine.static_decode_loop`);
            a method the static path does not serve decodes eagerly and the row's ``decode_path``
            says so (``static_refusal``); ``static-compiled``: the static step through
            ``torch.compile`` (compiled in the warm-up, so the row times the compiled step).
    """

    model: str = "smollm2-135m"
    method: str = "snapkv"
    length: int = 1024
    budget: int = 128
    new_tokens: int = 64
    dtype: str = "float32"
    task: str = "needle"
    seed: int = 0
    repeat: int = 0
    batch: int = 1
    device: str = "cpu"
    random_weights: bool = False
    decode: str = "eager"


def fit_prompt(tokenizer, task: str, length: int, seed: int = 0):
    """A prompt of the task's first sample, ``length`` tokens long in all (template and question too).

    The generator sizes the context; the context is shortened by what the chat template, the
    question and the answer prefix add (within a few tokens: the generators cut at sentences).
    """
    from kvbudget.engine import build_prompt
    from kvbudget.eval.tasks import get_task

    maker = get_task(task).make_samples
    sample = maker(tokenizer, length, 1, seed)[0]
    prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    excess = len(prompt.ids) - length
    if excess > 0:
        sample = maker(tokenizer, length - excess, 1, seed)[0]
        prompt = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    return prompt


def timed_prefill(
    model: PreTrainedModel, prompts: list[Prompt], session: CompressionSession, pad_id: int
) -> tuple[BudgetCache, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Prefill ``prompts`` with ``session`` as the bench times it: on a GPU the clock stops after
    the queued work, and the session's timers wait for it (``CompressionSession.synchronize``) so
    its compress time is the method's own; they stop waiting once the prefill is done (a decode
    loop is timed as a whole: each step reads its token). Returns ``prefill``'s cache, logits,
    mask and last positions, then the wall seconds."""
    from kvbudget.engine import prefill

    on_gpu = model.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize(model.device)
    session.synchronize = True
    start = time.perf_counter()
    out = prefill(model, prompts, session, pad_id)
    if on_gpu:
        torch.cuda.synchronize(model.device)
    wall = time.perf_counter() - start
    session.synchronize = False
    return (*out, wall)


def measure(spec: MeasureSpec) -> dict[str, Any]:
    """Run ``spec`` in this process and return its row (see :mod:`kvbudget.bench.grid`)."""
    from kvbudget.engine import RunTimes, decode_loop, prefill, static_decode_loop
    from kvbudget.eval.runner import MethodSpec
    from kvbudget.models import load_model
    from kvbudget.session import CompressionSession
    from kvbudget.static_decode import static_refusal

    model, tokenizer = load_model(
        spec.model, dtype=spec.dtype, device=spec.device, random_weights=spec.random_weights
    )
    on_gpu = model.device.type == "cuda"
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    prompt = fit_prompt(tokenizer, spec.task, min(spec.length, max_context - spec.new_tokens), spec.seed)
    parsed = MethodSpec.parse(spec.method)  # ``name:kv_bits=4``: the cache stored at 4 bits
    method, kv_bits = parsed.build(), parsed.kv_bits
    budget = spec.budget
    method.check_budget(budget)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    layers = model.config.num_hidden_layers

    # warm-up: one short prefill and two decode steps with the same method (kernels, allocator)
    warm = type(prompt)(prompt.ids[: min(len(prompt.ids), 2 * budget + 64)], [])
    session = CompressionSession(parsed.build(), layers, budget=budget, kv_bits=kv_bits)
    cache, logits, mask, last = prefill(model, [warm] * spec.batch, session, pad_id)
    cache.quantize(kv_bits)
    refusal = static_refusal(session.method, cache) if spec.decode != "eager" else "eager asked for"
    compiled = spec.decode == "static-compiled"
    if refusal is None:
        static_decode_loop(model, cache, logits, last, set(), 3, compiled)
    else:
        decode_loop(model, cache, logits, mask, last, set(), 3, trace=False)
    del cache, logits, session
    gc.collect()

    rss_before = current_rss_bytes()
    reset_ok = reset_peak()
    if on_gpu:
        torch.cuda.synchronize(model.device)
        torch.cuda.reset_peak_memory_stats(model.device)
    session = CompressionSession(method, layers, budget=budget, kv_bits=kv_bits)
    cache, logits, mask, last, prefill_wall = timed_prefill(model, [prompt] * spec.batch, session, pad_id)
    start = time.perf_counter()
    cache.quantize(kv_bits)  # before the first decode step: part of the prefill's wall time
    prefill_wall += time.perf_counter() - start
    after_prefill = cache.stats()
    if refusal is None:
        decoded = static_decode_loop(model, cache, logits, last, set(), spec.new_tokens, compiled)
    else:
        decoded = decode_loop(model, cache, logits, mask, last, set(), spec.new_tokens, trace=False)
    times = RunTimes.of(prefill_wall, session, decoded)
    after_decode = cache.stats()
    peak = peak_rss_bytes()
    gpu = {"gpu_peak_bytes": torch.cuda.max_memory_allocated(model.device)} if on_gpu else {}
    return {
        **asdict(spec),
        "prompt_tokens": len(prompt.ids),
        "decode_path": spec.decode if refusal is None else "eager",
        **({"static_refusal": refusal} if spec.decode != "eager" and refusal is not None else {}),
        "ttft_s": times.ttft,
        "tpot_s": times.tpot,
        "tpot_steady_s": decoded.steady_step_seconds,
        "static_setup_s": decoded.setup_seconds,
        "compress_s": times.compress,
        "prefill_s": times.prefill,
        "decode_steps": decoded.steps,
        "decode_trim_s": session.decode_seconds,
        "peak_rss_bytes": peak,
        "rss_before_bytes": rss_before,
        "peak_rss_reset": reset_ok,
        "kv_peak_bytes": after_decode.extra["peak_physical_bytes"],
        "logical_bytes": after_prefill.logical_bytes,
        "physical_bytes": after_prefill.physical_bytes,
        "decode_kv_bytes": sum(layer.held_bytes() for layer in cache.layers),  # what a step reads
        "decode_kv_allocated_bytes": after_decode.physical_bytes,
        "weight_bytes": weight_bytes(model),
        "threads": torch.get_num_threads(),
        **gpu,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbudget.bench.measure '{"method": "snapkv", ...}'``: print the row as JSON."""
    args = sys.argv[1:] if argv is None else argv
    try:
        spec = MeasureSpec(**json.loads(args[0]))
        row = measure(spec)
    except Exception as exc:  # the grid records the failure as a row and goes on
        row = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(RESULT_PREFIX + json.dumps(row), flush=True)
        return 1
    print(RESULT_PREFIX + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
