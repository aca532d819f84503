"""Run exported samples through NVIDIA kvpress presses (executed by ``.venv-peer/bin/python``).

A standalone script: it imports nothing from kvbudget (the peer environment has another
transformers), reads ``samples.jsonl`` (token ids already built by kvbudget's task generators and
chat template) and ``jobs.json`` (press name, options, budget), and writes one JSON line per
(sample, job) to ``--out``. The decode mirrors kvpress's own pipeline: the context is prefilled
by the model body inside ``with press(model)``, then the question is fed at its true positions
and tokens are chosen greedily until an EOS id (given by the caller) or ``max_new_tokens``. A job
with ``"question_aware": true`` prefills context and question together inside the press instead
(the press then sees the question: its window holds the question's tokens). A job whose
``"press"`` is null runs the same loop without any press (plain generation, the full cache).

Timing, as kvbudget's side measures it: ``prefill_s`` runs from the start to the prompt's last
logits (context prefill with compression, plus the question's forward when question-agnostic),
``decode_s`` from there to the last token (first token's argmax included), ``wall_s`` is their
sum; ``compress_s`` is the time spent in the press's ``compress`` (scoring, selection, gathering
the kept entries), summed over the layers, plus what the press does on leaving its context after
the prefill (KVzip's and KVgrad's replay of the context, KVCompose's selection; next to nothing for
the others); ``step_s`` each decode step's seconds (its forward and the choice of its token).
Counting the cache's entries is not timed.

A job with ``"question_delimiter": true`` (FINCH, question-aware only) prefills the context, a
delimiter id and the question (:func:`finch_prompt`). After a press that re-rotates the kept keys
(FINCH, ``KeyRerotationPress``) the question and the answer continue at the cache's length, as in
kvpress's pipeline.

``--serve`` keeps the process: after loading the model (and the warm-up) it prints ``READY``, then
answers one request per stdin line, ``{"sample": i, "job": j}`` (indices into the samples and
jobs files), with one line ``ROW <json>`` on stdout, until stdin closes — so a caller can run
one (sample, job) at a time without reloading the model (``bench peer``, which alternates it with
kvbudget's own runner, :mod:`kvbudget.bench.ours_runner`, through the same :func:`serve`; and
:mod:`kvbudget.eval.peer_rows`).

Eval jobs (:mod:`kvbudget.eval.peer_rows`, leaderboard rows marked as kvpress's) give
``"compression_ratio"`` instead of ``"budget"``: the press gets that ratio unchanged, so it keeps
kvpress's own ``max(1, int(n · (1 − ratio)))`` of the ``n`` compressed tokens (the context, or the
context and question when question-aware); the row records the ratio and ``compressed_tokens``
(``n``). With ``--keep-going`` a run that raises answers a row with ``"error"`` (its one-line
message) instead of ending the process. Scoring stays on kvbudget's side.

A job with ``"cache"`` (``{"backend": "quanto", "nbits": 4, ...}``) prefills into transformers'
``QuantizedCache`` with those settings instead of a ``DynamicCache``, as kvpress's pipeline takes a
``cache=``: the press compresses each layer and kvpress stores what it keeps quantized. The row then
has ``"kv_bytes"``, the cache's bytes as stored after the context's prefill (:func:`cache_bytes`).

A job with ``"kvzap_weights"`` (a kvbudget surrogate file) gives ``KVzapPress`` that surrogate instead
of the hub download it would make (:func:`bind_kvzap`).

A job with ``"seed"`` seeds torch's global generator with it right before the press's prefill
(:func:`seed_draws`): presses that draw from it (``LeverageScorePress``'s and ``CompactorPress``'s
sketches) then draw the same numbers in every run, and kvbudget's ``leverage`` and ``compactor`` with
that ``seed`` draw them too.

A bf16 model on a CPU without a native bf16 GEMM multiplies its linear layers through fp32, as
kvbudget's ``load_model`` does there (:func:`match_bf16_matmul`), so both libraries compute alike.

``--indices`` instead prefills each sample's context once with the press and once without, and
writes, per layer and KV head, the positions the press kept (found by matching the kept keys
against the full cache's, or from AdaKV's masked indices) — the oracle test compares them with
kvbudget's selection.

A sample with ``"follow_ups"`` (``[{"question_ids": [...], "max_new_tokens": n}, ...]``, a
shared-context task's later questions; question-agnostic jobs only) is answered as kvpress's
pipeline answers several questions about one context: the context is compressed once and each
later question is fed after it alone (a copy of the context's cache), its answer greedy; the row's
``"follow_ups"`` holds each one's ``token_ids``, ``prefill_s`` (the question's forward) and
``step_s``.

Usage: python -P kvpress_runner.py --model DIR --samples S.jsonl --jobs J.json
       (--out O.jsonl [--indices] | --serve) [--warmup] [--keep-going]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from collections.abc import Callable

import torch

#: the fewest rows a bf16 linear layer's input needs to multiply through fp32 (kvbudget.cpu_matmul's rule)
FP32_MATMUL_MIN_ROWS = 32


class Fp32MatmulLinear(torch.nn.Linear):
    """A bf16 linear layer on a CPU without a native bf16 GEMM, computed as kvbudget's side computes
    it (:mod:`kvbudget.cpu_matmul`, not importable here): fp32 products of the bf16 operands,
    rounded to bf16, for inputs of at least ``FP32_MATMUL_MIN_ROWS`` rows; else the layer's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype is torch.bfloat16
            and self.weight.dtype is torch.bfloat16
            and x.device.type == "cpu"
            and x.numel() >= FP32_MATMUL_MIN_ROWS * self.in_features
        ):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(x.float(), self.weight.float(), bias).to(torch.bfloat16)
        return super().forward(x)


def match_bf16_matmul(model) -> int:
    """kvbudget's ``load_model(bf16_matmul="auto")`` on kvpress's model: a bf16 model on a CPU whose
    oneDNN has no bf16 GEMM gets :class:`Fp32MatmulLinear` layers (in place); returns how many."""
    param = next(model.parameters())
    if param.dtype is not torch.bfloat16 or param.device.type != "cpu":
        return 0
    try:
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return 0
    except (AttributeError, RuntimeError):
        if torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "SVE")):
            return 0
    switched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = Fp32MatmulLinear
            switched += 1
    return switched


def make_press(job: dict, k_len: int):
    """The kvpress press of ``job`` with a compression ratio that keeps ``budget`` entries per head
    (None when the job has no press: the full-cache reference); a job with ``compression_ratio``
    passes that ratio to the press as it is.

    kvpress keeps ``int(k_len · (1 − ratio))`` (PyramidKV's fallback rounds it); a ratio of
    ``1 − (budget + 0.25) / k_len`` makes both equal ``budget`` exactly.
    """
    import kvpress

    if job.get("press") is None:
        return None
    if job.get("compression_ratio") is not None:
        ratio = float(job["compression_ratio"])
    else:
        budget = job["budget"]
        ratio = 0.0 if budget >= k_len else 1.0 - (budget + 0.25) / k_len
    cls = getattr(kvpress, job["press"])
    if "inner" in job:  # a wrapper press (AdaKV, ChunkKV, CriticalKV, Merging, Block) around a scorer
        inner_cls = getattr(kvpress, job["inner"]["press"])
        inner = inner_cls(compression_ratio=ratio, **job["inner"].get("kwargs", {}))
        return cls(press=inner, **job.get("kwargs", {}))
    return cls(compression_ratio=ratio, **job.get("kwargs", {}))


def bind_kvzap(press, job: dict, model) -> None:
    """Give a ``KVzapPress`` (bare, or inside a wrapper) the surrogate of the job's ``"kvzap_weights"``
    (a kvbudget surrogate file: ``kvbudget train kvzap``) instead of the hub download it would make:
    kvpress names the hub model after ``model``'s name and loads it on entering the press unless the
    press already holds a model under that name, so both are set here."""
    path = job.get("kvzap_weights")
    if not path:
        return
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
    from safetensors import safe_open

    inner = getattr(press, "press", press)
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    linear = "weight" in tensors
    first = tensors["weight"] if linear else tensors["w1"]
    kv = tensors["bias"].shape[1] if linear else tensors["b2"].shape[1]
    config = KVzapConfig(input_dim=first.shape[2], output_dim=kv, n_modules=first.shape[0],
                         hidden_dim=None if linear else first.shape[1])  # fmt: skip
    surrogate = KVzapModel(config)
    with torch.no_grad():
        for i, module in enumerate(surrogate.layers):
            if linear:
                module.weight.copy_(tensors["weight"][i])
                module.bias.copy_(tensors["bias"][i])
            else:
                module[0].weight.copy_(tensors["w1"][i])
                module[0].bias.copy_(tensors["b1"][i])
                module[2].weight.copy_(tensors["w2"][i])
                module[2].bias.copy_(tensors["b2"][i])
    inner.kvzap_model = surrogate.eval()
    inner.kvzap_model_name = f"nvidia/KVzap-{inner.model_type}-{model.config.name_or_path.split('/')[-1]}"


def seed_draws(job: dict) -> None:
    """Seed torch's global generator with the job's ``"seed"``, if it gives one (call it right before
    the press's prefill, so the press's random draws are the first after the seeding)."""
    if job.get("seed") is not None:
        torch.manual_seed(int(job["seed"]))


def _layer_entries(layer) -> int:
    """Entries (KV heads × tokens) one cache layer holds: a ``QuantizedLayer``'s quantized ones and
    its full-precision residual, else its keys'."""
    quantized = getattr(layer, "_quantized_keys", None)
    if quantized is None:
        return layer.keys.shape[1] * layer.keys.shape[2]
    residual = layer.keys.shape[2] if layer.keys.dim() == 4 else 0
    return quantized.shape[1] * (quantized.shape[2] + residual)


def _tensor_bytes(t) -> int:
    """Bytes a tensor holds, a quantized tensor subclass (optimum-quanto's) through its parts."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def cache_bytes(cache) -> int | None:
    """A ``QuantizedCache``'s bytes as stored (codes, scales, shifts and the residual), else ``None``."""
    if not any(hasattr(layer, "_quantized_keys") for layer in cache.layers):
        return None
    return sum(
        _tensor_bytes(layer._quantized_keys) + _tensor_bytes(layer._quantized_values)
        + _tensor_bytes(layer.keys) + _tensor_bytes(layer.values)
        for layer in cache.layers
    )  # fmt: skip


def make_cache(job: dict, model):
    """The job's cache: transformers' ``QuantizedCache`` with the job's ``"cache"`` settings
    (backend, nbits, q_group_size, residual_length), else a ``DynamicCache``."""
    from transformers import DynamicCache, QuantizedCache

    settings = job.get("cache")
    if settings is None:
        return DynamicCache()
    return QuantizedCache(config=model.config, **settings)


def cache_entries(cache, model) -> tuple[int, int]:
    """(kept entries, allocated entries) summed over layers and KV heads."""
    allocated = sum(_layer_entries(layer) for layer in cache.layers)
    masked = 0
    for layer in model.model.layers:
        idx = getattr(layer.self_attn, "masked_key_indices", None)
        if idx is not None:
            masked += int(idx[0].numel())
    return allocated - masked, allocated


def _timed(compress: Callable, total: list[float]) -> Callable:
    """``compress`` (a press's bound method) adding its seconds to ``total[0]`` — every press
    compresses each layer through ``self.compress`` from its forward hook."""

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return compress(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    return timed


def finch_prompt(press, model, sample: dict) -> torch.Tensor:
    """FINCH's prefill ids: context, a delimiter id, question. FinchPress takes the ids after the
    delimiter (the question) as its window and drops the delimiter from the embeddings before the
    first layer, so any id the embedding table holds and the prompt lacks serves: the table's last
    row (past the tokenizer's vocabulary in Qwen2.5 and Llama 3; kvpress's pipeline adds a token to
    the tokenizer and resizes the embeddings instead)."""
    ids = sample["context_ids"] + sample["question_ids"]
    delimiter = model.get_input_embeddings().num_embeddings - 1
    if delimiter in ids:
        raise ValueError(f"the delimiter id {delimiter} (the embeddings' last row) occurs in the prompt")
    press.delimiter_token_id = delimiter
    return torch.tensor([sample["context_ids"] + [delimiter] + sample["question_ids"]])


def rerotates_keys(press) -> bool:
    """Whether ``press`` moves the kept keys to positions 0 … k − 1, so that the tokens after the
    compressed prefill continue at the cache's length (kvpress's pipeline makes the same test)."""
    import kvpress

    return isinstance(press, kvpress.KeyRerotationPress) or (
        isinstance(press, kvpress.FinchPress) and press.rerotate_keys
    )


def copy_cache(cache):
    """A copy of ``cache`` that one request may extend without touching the original. A
    ``QuantizedCache`` layer's quantized keys and values (quanto's tensors, which cannot be
    deep-copied) are shared: a layer replaces them when it quantizes again, never writes into them."""
    memo = {}
    for layer in getattr(cache, "layers", []):
        for name in ("_quantized_keys", "_quantized_values"):
            tensor = getattr(layer, name, None)
            if tensor is not None:
                memo[id(tensor)] = tensor
    return copy.deepcopy(cache, memo)


@torch.inference_mode()
def run_one(model, sample: dict, job: dict) -> dict:
    ctx = torch.tensor([sample["context_ids"]])
    question = torch.tensor([sample["question_ids"]])
    eos = set(sample["eos_ids"])
    aware = bool(job.get("question_aware"))
    if aware:
        ctx, question = torch.cat([ctx, question], 1), question[:, :0]
    press = make_press(job, ctx.shape[1])
    prefill_ids = ctx
    if job.get("question_delimiter"):
        if not aware:
            raise ValueError(f"{job['press']} needs the question in the prefill: run it question-aware")
        prefill_ids = finch_prompt(press, model, sample)
    bind_kvzap(press, job, model)
    compress_s = [0.0]
    if press is not None:
        press.compress = _timed(press.compress, compress_s)  # this instance only
    model.set_attn_implementation(job.get("attn", "sdpa"))
    cache = make_cache(job, model)
    seed_draws(job)
    start = time.perf_counter()
    with press(model) if press is not None else contextlib.nullcontext():
        if aware:  # the prompt's last logits come from the compressed prefill itself
            out = model(input_ids=prefill_ids, past_key_values=cache, logits_to_keep=1)
        else:
            model.model(input_ids=prefill_ids, past_key_values=cache)
        prefilled_context = time.perf_counter()
    context_s = time.perf_counter() - start  # the compressed context prefill
    compress_s[0] += context_s - (prefilled_context - start)  # the press's work on leaving its context
    kept, allocated = cache_entries(cache, model)  # not timed
    stored_bytes = cache_bytes(cache)
    next_position = cache.get_seq_length() if rerotates_keys(press) else ctx.shape[1]
    follow_ups = sample.get("follow_ups") or []
    if follow_ups and aware:
        raise ValueError("later questions share the compressed context question-agnostically only")
    context_cache = copy_cache(cache) if follow_ups else None  # before the question (not timed)
    resumed = time.perf_counter()
    if aware:
        positions = torch.tensor([[next_position - 1]])
    else:
        positions = torch.arange(next_position, next_position + question.shape[1])[None]
        out = model(input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1)
    prefilled = time.perf_counter()
    generated, step_s = greedy(
        model, cache, out.logits[0, -1], positions[:, -1:], eos, sample["max_new_tokens"]
    )
    end = time.perf_counter()
    prefill_s = context_s + prefilled - resumed
    turns = []
    for follow in follow_ups:  # kvpress's pipeline with several questions: the context's cache, each alone
        request = copy_cache(context_cache)
        ids = torch.tensor([follow["question_ids"]])
        positions = torch.arange(next_position, next_position + ids.shape[1])[None]
        turn_start = time.perf_counter()
        out = model(input_ids=ids, past_key_values=request, position_ids=positions, logits_to_keep=1)
        first = time.perf_counter()
        tokens, steps = greedy(
            model, request, out.logits[0, -1], positions[:, -1:], eos, follow["max_new_tokens"]
        )
        turns.append({"token_ids": tokens, "prefill_s": first - turn_start, "step_s": steps})
    for layer in model.model.layers:  # AdaKV leaves its masks on the modules
        layer.self_attn.masked_key_indices = None
    return {
        "sample": sample["id"], "method": job["method"], "budget": job.get("budget"), "token_ids": generated,
        "compression_ratio": job.get("compression_ratio"), "compressed_tokens": ctx.shape[1],
        "prefill_s": prefill_s, "decode_s": end - prefilled, "wall_s": prefill_s + end - prefilled,
        "compress_s": compress_s[0], "step_s": step_s, "kept_entries": kept,
        "allocated_entries": allocated, "kv_bytes": stored_bytes,
        **({"follow_ups": turns} if follow_ups else {}),
    }  # fmt: skip


def greedy(
    model, cache, logits, position, eos: set[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens from ``logits`` (the prompt's last, ``[vocab]``) until an EOS id or
    ``max_new_tokens``, each fed at the next position after ``position`` (``[1, 1]``); the tokens
    and each decode step's seconds."""
    token = logits.argmax()
    generated = [int(token)]
    step_s = []
    for _ in range(max_new_tokens - 1):
        if generated[-1] in eos:
            break
        step_start = time.perf_counter()
        position = position + 1
        out = model(input_ids=token.view(1, 1), past_key_values=cache, position_ids=position)
        token = out.logits[0, -1].argmax()
        generated.append(int(token))
        step_s.append(time.perf_counter() - step_start)
    return generated, step_s


@torch.inference_mode()
def kept_indices(model, sample: dict, job: dict) -> dict:
    """Per layer and KV head, the sorted context positions the press kept."""
    from transformers import DynamicCache

    ctx = torch.tensor([sample["context_ids"]])
    model.set_attn_implementation(job.get("attn", "sdpa"))
    full = DynamicCache()
    model.model(input_ids=ctx, past_key_values=full)
    press = make_press(job, ctx.shape[1])
    bind_kvzap(press, job, model)
    cache = make_cache(job, model)
    seed_draws(job)
    with press(model):
        model.model(input_ids=ctx, past_key_values=cache)
    layers = []
    for li, (layer, attn) in enumerate(zip(cache.layers, model.model.layers, strict=True)):
        full_keys = full.layers[li].keys[0]  # [h, n, d]
        kept_keys = layer.keys[0]  # [h, k, d]
        masked = getattr(attn.self_attn, "masked_key_indices", None)
        heads = []
        for h in range(full_keys.shape[0]):
            dist = torch.cdist(kept_keys[h].double(), full_keys[h].double())  # [k, n]
            best = dist.min(-1)
            if float(best.values.max()) > 1e-6 * float(full_keys[h].norm(dim=-1).max()):
                worst = int(best.values.argmax())
                raise RuntimeError(
                    f"{job['method']}: layer {li} head {h}: kept key {worst} of {kept_keys.shape[1]} "
                    f"matches no key of the full cache ({float(best.values.max()):.3g} from its nearest, "
                    f"key norms up to {float(full_keys[h].norm(dim=-1).max()):.3g})"
                )
            idx = set(best.indices.tolist())
            if masked is not None:
                b, hh, s = masked
                idx -= {int(p) for p, head in zip(s.tolist(), hh.tolist(), strict=True) if head == h}
            heads.append(sorted(idx))
        layers.append(heads)
        attn.self_attn.masked_key_indices = None
    return {"sample": sample["id"], "method": job["method"], "budget": job["budget"], "indices": layers}


def keep_going(run: Callable[[dict, dict], dict], model) -> Callable[[dict, dict], dict]:
    """``run`` answering a run that raises with an error row (sample, method, budget, ratio and the
    one-line ``error``) instead of raising; the masks AdaKV may have left on the modules are
    cleared."""

    def guarded(sample: dict, job: dict) -> dict:
        try:
            return run(sample, job)
        except Exception as err:  # reported to the caller as a row
            for layer in model.model.layers:
                layer.self_attn.masked_key_indices = None
            lines = str(err).strip().splitlines()
            error = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
            return {"sample": sample["id"], "method": job["method"], "budget": job.get("budget"),
                    "compression_ratio": job.get("compression_ratio"), "error": error}  # fmt: skip

    return guarded


def serve(run: Callable[[dict, dict], dict], samples: list[dict], jobs: list[dict]) -> int:
    """Answer ``{"sample": i, "job": j}`` lines from stdin with ``ROW <json>`` lines on stdout, each
    ``run(samples[i], jobs[j])``'s row. Shared by kvbudget's own runner
    (:mod:`kvbudget.bench.ours_runner`), so both sides of ``bench peer`` answer the same way."""
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        row = run(samples[request["sample"]], jobs[request["job"]])
        print("ROW " + json.dumps(row), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--jobs", required=True)
    parser.add_argument("--out")
    parser.add_argument("--serve", action="store_true", help="answer requests from stdin (see the docstring)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--indices", action="store_true")
    parser.add_argument("--warmup", action="store_true", help="run the first job once untimed first")
    parser.add_argument("--keep-going", action="store_true", help="a run that raises answers an error row")
    args = parser.parse_args(argv)
    if not args.serve and not args.out:
        parser.error("--out is required unless --serve")

    import kvpress  # noqa: F401  (fails early when the peer environment is broken)
    import transformers
    from transformers import AutoModelForCausalLM

    with open(args.jobs) as fh:
        jobs = json.load(fh)
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    pressed = sorted({job["method"] for job in jobs if job.get("press") is not None})
    if (major, minor) >= (5, 3) and pressed:  # its presses' hooks read kwargs newer releases dropped
        print(f"error: kvpress 0.5.5's presses need transformers < 5.3, this environment has "
              f"{transformers.__version__}: only the `full` pair (no press) runs here, "
              f"not {', '.join(pressed)}", file=sys.stderr)  # fmt: skip
        return 2

    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), local_files_only=True
    ).eval()
    match_bf16_matmul(model)
    config = model.config
    if getattr(config, "head_dim", None) is None:  # Qwen2's config leaves it out (its attention computes
        config.head_dim = config.hidden_size // config.num_attention_heads  # it so); CriticalKV reads it
    with open(args.samples) as fh:
        samples = [json.loads(line) for line in fh if line.strip()]

    def run(sample: dict, job: dict) -> dict:
        return run_one(model, sample, job)

    if args.keep_going:
        run = keep_going(run, model)

    if args.warmup and samples and jobs and not args.indices:
        run({**samples[0], "max_new_tokens": 2}, jobs[0])
    if args.indices and samples:  # the process's first forward is thrown away: in about one process in
        # fifty here it differed from every later one by up to 1e-4 (relative) in the layer-0 keys
        # already, so a kept key matched no key of the full cache it is compared with
        with torch.no_grad():
            model.model(input_ids=torch.tensor([samples[0]["context_ids"]]))
    if args.serve:
        return serve(run, samples, jobs)
    with open(args.out, "w") as out:
        for sample in samples:
            for job in jobs:
                row = kept_indices(model, sample, job) if args.indices else run(sample, job)
                out.write(json.dumps(row) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
