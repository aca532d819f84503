"""Engine: prompt building, prefill with layer-wise compression, and the decode loop.

``generate`` prefills the whole prompt (question-aware, the papers' setting) or only the context
(``compress_context_only=True``, question-agnostic, then the question is appended uncompressed),
compressing each layer right after its attention, then decodes greedily (or with temperature /
top-p) while decode-stage methods keep the cache at budget. Lookahead methods
(:mod:`kvbudget.methods.lookahead`) compress the whole prefilled part at once, right after it
(:func:`kvbudget.prefill.common.run_lookahead`), before the question of a question-agnostic run is
appended. The prefill itself, with its strategies side by side, lives in :mod:`kvbudget.prefill`
(``engine.prefill``, ``prefill_batch`` and ``prefill_inputs`` are its layer-wise entry points).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvbudget.attention import attach, check_supported
from kvbudget.byte_budget import check_memory, method_budget
from kvbudget.cache import BudgetCache, CacheStats, check_kv_bits, full_cache_stats, model_entry_bytes
from kvbudget.errors import BudgetError, InputError, KVBudgetError
from kvbudget.methods.base import Method
from kvbudget.methods.registry import resolve_method
from kvbudget.prefill.common import PrefillInputs as PrefillInputs  # re-exported: the prefill's entry
from kvbudget.prefill.common import Prompt as Prompt  # points stay reachable as engine.prefill & co.
from kvbudget.prefill.common import eos_ids as eos_ids
from kvbudget.prefill.common import forward_last_logits
from kvbudget.prefill.common import prefill_inputs as prefill_inputs
from kvbudget.prefill.layerwise import prefill as prefill
from kvbudget.prefill.layerwise import prefill_batch as prefill_batch
from kvbudget.session import CompressionSession
from kvbudget.static_cache import StaticBudgetCache
from kvbudget.static_decode import StaticDecoder, static_refusal


@dataclass
class GenerationResult:
    """One sample's generation.

    Attributes:
        text: the answer (special tokens and the final EOS removed; the answer prefix not included).
        token_ids: generated token ids (EOS included when produced).
        ttft_s: time to first token (prefill + compression + first token).
        tpot_s: mean time per output token after the first.
        compress_s: compression time before the first token (scoring and selecting during the
            prefill; a lookahead method's lookahead and re-selection).
        cache_stats_before: an uncompressed cache of the prompt; cache_stats_after: after the prefill.
        budgets: ``[layers, kv_heads]`` entries kept per head after the prefill.
        timings: seconds — ``prefill`` (forward passes of the prompt), ``compress`` (all compression
            work before the first token: scoring and selecting, plus ``lookahead`` and ``reselect``
            for lookahead methods, 0 for others), ``lookahead`` (clone, compress the clone,
            pseudo decoding), ``reselect`` (re-scoring the full cache), ``decode`` (steps after the
            first token), ``decode_trim`` (decode-stage eviction inside ``decode``).
        prompt_tokens: prompt length in tokens.
        method: the method's name; options: its hyperparameters.
        selection_layer: the layer where a prune-stage method cut the prompt (None otherwise).
        cache: the cache after generation, when ``generate(..., return_cache=True)``.
        cache_trace: total logical entries (all layers and KV heads) of this row after each decode
            step — one per generated token fed back, so ``len(token_ids) − 1`` of them. Flat for a
            decode-stage method holding its budget, growing by ``layers × kv_heads`` per step otherwise.
    """

    text: str
    token_ids: list[int]
    ttft_s: float
    tpot_s: float
    compress_s: float
    cache_stats_before: CacheStats
    cache_stats_after: CacheStats
    budgets: torch.Tensor
    timings: dict[str, float]
    prompt_tokens: int
    method: str
    options: dict[str, Any] = field(default_factory=dict)
    selection_layer: int | None = None
    cache: BudgetCache | None = None
    cache_trace: list[int] = field(default_factory=list)


def build_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str = "",
    answer_prefix: str = "",
    mark: str | None = None,
) -> Prompt:
    """Tokenise ``context`` + ``question`` with the chat template (when the tokenizer has one).

    The user message is the context, a blank line and the question; the answer prefix follows the
    template's generation prompt. The prompt is tokenised in two pieces — up to the end of the
    context, and the rest — so question-aware and question-agnostic runs see identical tokens.
    """
    if not context or not context.strip():
        raise InputError("context is empty: give the text to compress")
    message = f"{context}\n\n{question}" if question else context
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        cut = rendered.index(context) + len(context)
        head, tail = rendered[:cut], rendered[cut:] + answer_prefix
        head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    else:
        head = context
        tail = (f"\n\n{question}\n" if question else "\n") + answer_prefix
        head_ids = tokenizer(head, add_special_tokens=True)["input_ids"]
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    marked: list[int] = []
    if mark:
        if mark not in context:
            raise InputError("mark must be a substring of the context")
        start = head.rindex(context) + context.index(mark)
        stop = start + len(mark)
        encoded = tokenizer(head, add_special_tokens=not tokenizer.chat_template, return_offsets_mapping=True)
        marked = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < stop and b > start]
    return Prompt(head_ids, tail_ids, marked)


def check_size(budget: int | None, ratio: float | None, flag: str = "") -> None:
    """One-line :class:`BudgetError` unless ``budget`` (entries per KV head, > 0) or ``ratio`` (the
    fraction kept, in (0, 1]), or neither, is given; ``flag`` prefixes the names (``"--"`` for the CLI)."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise BudgetError(f"{flag}budget must be a positive integer (entries per KV head), got {budget!r}")
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
        raise BudgetError(f"{flag}ratio must be in (0, 1] (the fraction of the prompt kept), got {ratio!r}")
    if budget is not None and ratio is not None:
        raise BudgetError(f"give either {flag}budget or {flag}ratio, not both (got {budget} and {ratio})")


def check_budget(method: Method, budget: int | None, ratio: float | None, max_context: int) -> None:
    if budget is not None and ratio is not None:
        raise BudgetError("give either budget or ratio, not both")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise BudgetError(f"budget must be a positive integer (entries per KV head), got {budget!r}")
        if budget > max_context:
            raise BudgetError(f"budget {budget} exceeds the model's context of {max_context} tokens")
        method.check_budget(budget)
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
        raise BudgetError(f"ratio must be in (0, 1], got {ratio!r}")


def check_ratio_budgets(method: Method, ratio: float | None, lengths: list[int]) -> None:
    if ratio is None:
        return
    for length in lengths:
        budget = max(1, round(ratio * length))
        if budget < length and budget < method.min_budget():
            raise BudgetError(
                f"ratio {ratio} keeps {budget} of a {length}-token prompt, below the {method.min_budget()} "
                f"entries {method.name} always keeps; use a larger ratio or budget"
            )


#: temperatures below this sample greedily (dividing the logits by a vanishing one overflows)
GREEDY_BELOW = 1e-5
#: entries per KV head when a call names neither a budget nor a ratio
DEFAULT_BUDGET = 128


def next_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> torch.Tensor:
    """``logits: [b, vocab]`` → ``[b]`` token ids (greedy when ``temperature`` is below
    :data:`GREEDY_BELOW`: its limit, where dividing by it would overflow, as vLLM does)."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    # drawn where the generator lives (a CPU one by default): the same seed gives the same tokens on
    # every device, and a GPU run needs no generator of its own
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(logits.device)


def selection_layer(session: CompressionSession, row: int) -> int | None:
    """The layer after which a prune-stage method's run cut batch row ``row`` (None: nothing pruned)."""
    layers = getattr(session.run, "selection_layers", None)
    return None if layers is None else layers[row]


def model_max_context(model: PreTrainedModel) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)


@dataclass
class Decoded:
    """Output of :func:`decode_loop`: per row the generated ids, plus step count and time.

    ``seconds``: wall time of the decode steps after the first token; ``first_token_seconds``: of
    choosing the first token from the prompt's logits.
    ``trace[r]``: row ``r``'s total logical entries after each decode step that fed it a token.
    ``step_seconds[i]``: wall time of decode step ``i`` (its forward and the choice of its token).
    ``setup_seconds``: the static path's one-off work inside ``seconds`` — moving the cache into
    static buffers and the first ``setup_steps`` steps (on CUDA the eager warm-up and the capture).
    """

    generated: list[list[int]]
    steps: int
    seconds: float
    trace: list[list[int]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    first_token_seconds: float = 0.0
    setup_seconds: float = 0.0
    setup_steps: int = 0

    @property
    def steady_step_seconds(self) -> float:
        """Mean seconds of the steps after the static path's setup (all steps on the eager path;
        NaN when none ran)."""
        steps = self.steps - self.setup_steps
        return (self.seconds - self.setup_seconds) / steps if steps > 0 else math.nan


@dataclass
class RunTimes:
    """Wall-clock seconds of one prefill and decode, as ``generate``, the evaluation rows and the
    benchmarks report them.

    Attributes:
        prefill_wall: the prefill, its compression included (``prefill`` + ``compress``).
        compress: the compression work inside it (the session's ``compress_seconds``).
        first_token: choosing the first token from the prompt's last logits.
        decode: the decode steps after the first token; steps: how many.
    """

    prefill_wall: float
    compress: float
    first_token: float
    decode: float
    steps: int

    @classmethod
    def of(cls, prefill_wall: float, session: CompressionSession, decoded: Decoded) -> RunTimes:
        """The times of a prefill that took ``prefill_wall`` with ``session``, then ``decoded``."""
        first, decode = decoded.first_token_seconds, decoded.seconds
        return cls(prefill_wall, session.compress_seconds, first, decode, decoded.steps)

    @property
    def prefill(self) -> float:
        """The prefill's forward passes alone."""
        return self.prefill_wall - self.compress

    @property
    def ttft(self) -> float:
        """Time to first token: the prefill with its compression, then the first token."""
        return self.prefill_wall + self.first_token

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (NaN when no step ran)."""
        return self.decode / self.steps if self.steps else math.nan


#: ``generate``'s decoding paths (its ``decode`` argument)
DECODE_PATHS = ("eager", "static", "static-compiled")


@torch.inference_mode()
def decode_loop(
    model: PreTrainedModel,
    cache: BudgetCache,
    logits: torch.Tensor,
    mask: torch.Tensor,
    last_pos: torch.Tensor,
    eos: set[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    trace: bool = True,
) -> Decoded:
    """Generate from ``logits: [b, vocab]`` (the prompt's last position) until EOS or the limit.

    The first token is chosen from ``logits``; the session (if any) is put in decode phase, so
    decode-stage methods trim after every step. ``Decoded.seconds`` excludes the first token.
    ``trace=False`` skips counting the cache's entries after every step (``Decoded.trace`` stays
    empty per row): the benchmarks time the decode loop without that bookkeeping.
    """
    first_start = time.perf_counter()
    generator = generator or torch.Generator().manual_seed(0)
    if cache.session is not None:
        cache.session.begin_decode()
    token = next_token(logits, temperature, top_p, generator)
    generated = [[int(t)] for t in token]
    finished = torch.tensor([int(t) in eos for t in token])
    traces: list[list[int]] = [[] for _ in generated]
    step_seconds: list[float] = []
    steps, start = 0, time.perf_counter()
    first_token_seconds = start - first_start
    for _ in range(max_new_tokens - 1):
        if bool(finished.all()):
            break
        step_start = time.perf_counter()
        mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=mask.device)], 1)
        last_pos = last_pos + 1
        logits = forward_last_logits(model, token[:, None], mask, last_pos[:, None], cache)
        token = next_token(logits, temperature, top_p, generator)
        steps += 1
        entries = _row_entries(cache) if trace else None
        for r, t in enumerate(token.tolist()):
            if not finished[r]:
                if entries is not None:
                    traces[r].append(entries[r])
                generated[r].append(t)
                finished[r] = t in eos
        step_seconds.append(time.perf_counter() - step_start)
    return Decoded(generated, steps, time.perf_counter() - start, traces, step_seconds, first_token_seconds)


@torch.inference_mode()
def static_decode_loop(
    model: PreTrainedModel,
    cache: BudgetCache,
    logits: torch.Tensor,
    last_pos: torch.Tensor,
    eos: set[int],
    max_new_tokens: int,
    compiled: bool = False,
) -> Decoded:
    """Greedy decoding as :func:`decode_loop`'s, over the compressed cache moved into a
    :class:`~kvbudget.static_cache.StaticBudgetCache` (one attention call per layer; on CUDA each
    step replays a captured CUDA graph). Only :func:`~kvbudget.static_decode.static_refusal`'s
    ``None`` runs may use it. The steps run without reading tokens back; rows are cut at their
    first EOS afterwards (the tokens a row would decode after its EOS are computed and dropped), so
    ``steps`` counts every step run and ``trace`` stays empty. ``compiled``: the step through
    ``torch.compile`` first (:class:`~kvbudget.static_decode.StaticDecoder`; its first step compiles).
    """
    first_start = time.perf_counter()
    if cache.session is not None:
        cache.session.begin_decode()
    token = logits.argmax(-1)
    first = token.tolist()
    first_token_seconds = time.perf_counter() - first_start
    steps = max_new_tokens - 1
    generated = [[t] for t in first]
    if steps == 0 or all(t in eos for t in first):
        return Decoded(generated, 0, 0.0, [[] for _ in first], [], first_token_seconds)
    start = time.perf_counter()
    static = StaticBudgetCache.from_budget_cache(cache, steps, rope=last_pos.to(torch.long) + 1)
    decoder = StaticDecoder(model, static, token, compiled=compiled)
    moved = time.perf_counter() - start
    tokens = decoder.run(steps).tolist()
    seconds = time.perf_counter() - start
    for row, more in zip(generated, tokens, strict=True):
        for t in more:
            if row[-1] in eos:
                break
            row.append(t)
    setup = moved + decoder.setup_seconds
    return Decoded(
        generated, steps, seconds, [[] for _ in first], [], first_token_seconds, setup, decoder.setup_steps
    )


def memory_budget(model: PreTrainedModel, method: Method, memory: float, prompt_tokens: int) -> int:
    """The entries per KV head ``method`` keeps on average under a byte budget of ``memory`` (see
    :func:`kvbudget.byte_budget.method_budget`), checked against what the method needs."""
    itemsize = model.dtype.itemsize
    head_dim = model_entry_bytes(model.config, model.dtype) // (2 * itemsize)
    budget = method_budget(memory, prompt_tokens, head_dim, itemsize)
    try:
        method.check_budget(budget)
    except KVBudgetError as err:
        raise BudgetError(
            f"memory={memory} leaves {budget} entries a KV head for {method.name}: {err}"
        ) from None
    return budget


def _row_entries(cache: BudgetCache) -> list[int]:
    """Total logical entries of each batch row over all layers and KV heads."""
    return torch.stack([layer.head_lengths().sum(-1) for layer in cache.layers]).sum(0).tolist()


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str | list[str],
    question: str | list[str] = "",
    answer_prefix: str | list[str] = "",
    method: str | Method = "snapkv",
    budget: int | None = None,
    ratio: float | None = None,
    max_new_tokens: int = 64,
    compress_context_only: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    return_cache: bool = False,
    decode: str = "eager",
    kv_bits: int | None = None,
    memory: float | None = None,
) -> GenerationResult | list[GenerationResult]:
    """Compress the prompt's KV cache with ``method`` and generate an answer.

    Args:
        context, question, answer_prefix: strings, or lists of equal length for a batch (prompts
            of different lengths are left-padded; each row is compressed on its own tokens).
        method: a registry name (``kvbudget.method_names()``) or a method object (``make_method``).
        budget: entries per KV head on average, window included (default 128); or
        ratio: fraction of each prompt to keep, in (0, 1].
        max_new_tokens: generation length limit (stops earlier at EOS).
        compress_context_only: question-agnostic mode — compress the context, then append the
            question uncompressed.
        temperature, top_p, seed: sampling (greedy when ``temperature == 0``).
        return_cache: keep the cache on the result (``result.cache``) for inspection.
        decode: ``"eager"`` (default) decodes over the ``BudgetCache``; ``"static"`` moves the
            compressed cache into static buffers and decodes with one attention call per layer
            (a CUDA graph per step on a GPU; :func:`static_decode_loop`), or eagerly where the run
            cannot (:func:`~kvbudget.static_decode.static_refusal`: decode-stage methods,
            sampling). ``result.cache`` then stays the compressed prompt's cache.
            ``"static-compiled"``: the same with the step through ``torch.compile`` (norms, RoPE and
            activations fused; each new cache shape compiles once, seconds on a CPU, more on a GPU).
        kv_bits: store the compressed cache at 2, 4 or 8 bits (KIVI groups, a full-precision tail
            of the latest tokens; :mod:`kvbudget.quantized_store`); 16 or ``None``: the model's
            dtype. The method scores in full precision during the prefill; what it keeps is
            quantized before decoding. Any method, budget or ratio composes with it.
        memory: a byte budget instead of ``budget``/``ratio``/``kv_bits``: the compressed prompt's
            cache takes this share of the full cache's bytes in the model's dtype (scales
            included), in two precisions (:mod:`kvbudget.byte_budget`: the method's highest-ranked
            kept entries at 8 bits, the rest at 4); one prompt at a time.

    Returns:
        A :class:`GenerationResult`, or a list of them for a batch.
    """
    check_supported(model)
    batch = isinstance(context, list)
    contexts = context if batch else [context]
    questions = question if isinstance(question, list) else [question] * len(contexts)
    prefixes = answer_prefix if isinstance(answer_prefix, list) else [answer_prefix] * len(contexts)
    if not (len(contexts) == len(questions) == len(prefixes)) or not contexts:
        raise InputError("context, question and answer_prefix lists must be non-empty and of equal length")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    if decode not in DECODE_PATHS:
        raise InputError(f"decode must be one of {', '.join(DECODE_PATHS)}, got {decode!r}")
    bits = check_kv_bits(kv_bits)
    check_memory(memory, budget, ratio, bits)
    if memory is not None and batch and len(contexts) > 1:
        raise InputError("memory= stores one sequence at a time; generate each prompt on its own")
    method_obj = resolve_method(method)
    if budget is None and ratio is None:
        budget = DEFAULT_BUDGET
    max_context = model_max_context(model)
    check_budget(method_obj, budget, ratio, max_context)
    prompts = [
        build_prompt(tokenizer, c, q, a) for c, q, a in zip(contexts, questions, prefixes, strict=True)
    ]
    lengths = [len(p.ids) for p in prompts]
    for length in lengths:
        if length + max_new_tokens > max_context:
            raise InputError(
                f"prompt of {length} tokens + {max_new_tokens} new tokens exceeds the model's context "
                f"of {max_context} tokens"
            )
    check_ratio_budgets(
        method_obj, ratio, [len(p.context_ids) if compress_context_only else len(p.ids) for p in prompts]
    )

    config = model.config
    if memory is not None:
        compressed_len = len(prompts[0].context_ids) if compress_context_only else len(prompts[0].ids)
        budget = memory_budget(model, method_obj, memory, compressed_len)
    session = CompressionSession(
        method_obj, config.num_hidden_layers, budget=budget, ratio=ratio, kv_bits=bits, memory=memory
    )
    if memory is not None:
        session.memory_tokens = compressed_len
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = eos_ids(model, tokenizer)
    generator = torch.Generator().manual_seed(seed)

    start = time.perf_counter()
    cache, logits, mask, last_pos = prefill(model, prompts, session, pad_id, compress_context_only, eos)
    cache.quantize(bits)
    prefill_wall = time.perf_counter() - start
    stats_after = [cache.stats(r) for r in range(len(prompts))]
    if decode != "eager" and static_refusal(method_obj, cache, temperature) is None:
        compiled = decode == "static-compiled"
        decoded = static_decode_loop(model, cache, logits, last_pos, eos, max_new_tokens, compiled)
    else:
        decoded = decode_loop(
            model, cache, logits, mask, last_pos, eos, max_new_tokens, temperature, top_p, generator
        )  # fmt: skip
    times = RunTimes.of(prefill_wall, session, decoded)
    generated = decoded.generated

    entry_bytes = cache.layers[0].entry_bytes()
    results = []
    for r, prompt in enumerate(prompts):
        ids = generated[r]
        text_ids = ids[:-1] if ids and ids[-1] in eos else ids
        compressed_len = len(prompt.context_ids) if compress_context_only else len(prompt.ids)
        budgets = session.kept[r]
        results.append(
            GenerationResult(
                text=tokenizer.decode(text_ids, skip_special_tokens=True),
                token_ids=ids,
                ttft_s=times.ttft,
                tpot_s=times.tpot,
                compress_s=times.compress,
                cache_stats_before=full_cache_stats(
                    config.num_hidden_layers, config.num_key_value_heads, compressed_len, entry_bytes
                ),
                cache_stats_after=stats_after[r],
                budgets=budgets,
                timings={
                    "prefill": times.prefill,
                    "compress": times.compress,
                    "lookahead": session.lookahead_seconds,
                    "reselect": session.reselect_seconds,
                    "decode": times.decode,
                    "decode_trim": session.decode_seconds,
                },
                prompt_tokens=len(prompt.ids),
                method=method_obj.name,
                options=method_obj.options(),
                selection_layer=selection_layer(session, r),
                cache=cache if return_cache else None,
                cache_trace=decoded.trace[r],
            )
        )
    return results if batch else results[0]


@torch.inference_mode()
def compress(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    method: str | Method = "snapkv",
    budget: int | None = None,
    ratio: float | None = None,
    attention_mask: torch.Tensor | None = None,
    kv_bits: int | None = None,
) -> BudgetCache:
    """Prefill ``input_ids: [b, T]`` and return the compressed cache (stored at ``kv_bits`` bits
    when given: see :func:`generate`).

    The cache stays in decode phase, so ``model.generate(full_ids, past_key_values=cache)``
    continues from it (decode-stage methods keep trimming). Pass the prompt without its last
    token here and the whole prompt to ``generate``.
    """
    check_supported(model)
    bits = check_kv_bits(kv_bits)
    method_obj = resolve_method(method)
    if budget is None and ratio is None:
        budget = DEFAULT_BUDGET
    check_budget(method_obj, budget, ratio, model_max_context(model))
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise InputError(
            f"input_ids must be [batch, tokens] with at least one token, got shape {tuple(input_ids.shape)}"
        )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_ratio_budgets(method_obj, ratio, attention_mask.sum(-1).tolist())
    attach(model)
    layers = model.config.num_hidden_layers
    session = CompressionSession(method_obj, layers, budget=budget, ratio=ratio, model=model, kv_bits=bits)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    inputs = PrefillInputs(input_ids, attention_mask, positions, input_ids.shape[1])
    cache, _, _ = prefill_batch(model, inputs, session)
    session.begin_decode()
    cache.quantize(bits)
    if input_ids.shape[0] == 1 and bool(attention_mask.all()):  # what kvbudget.save_cache records
        from kvbudget.cache_files import source_of

        cache.source = source_of(model, cache, input_ids[0].tolist())
    return cache
