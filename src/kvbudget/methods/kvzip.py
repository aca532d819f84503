"""KVzip: query-agnostic importance from a context-reconstruction pass, head-level budgets."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbudget.cache import BudgetCache, BudgetLayer
from kvbudget.errors import KVBudgetError, MethodOptionError
from kvbudget.masks import in_window
from kvbudget.methods.base import Method, RunState
from kvbudget.phases import Stage
from kvbudget.selection import protected_mask, record_ranks, select_keep
from kvbudget.session import CompressionSession

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: queries per block of the reconstruction scoring (its logits are ``q_heads × block × keys``)
QUERY_BLOCK = 256
#: how the budget is split: one top-k over every layer and head, per layer over its heads, per head
LEVELS = ("pair", "layer", "head")
#: the marker a chat template is rendered around to find its prefix and its generation suffix
_MARK = "\x00kvzip-context\x00"
#: per model: the tokenised prompts (``prepare`` loads the tokenizer once per model object)
_PROMPTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class ReconstructionPrompts:
    """Token ids of the reconstruction inputs, from the tokenizer stored next to the model.

    Attributes:
        repeat: the first chunk's request; cont: later chunks' request (the previous chunk's last
            ``overlap`` tokens follow it); suffix: what the chat template puts between a user
            message and the answer (``"\\n"`` without a template); prefix: the template's tokens
            before the user message (kept whole, never reconstructed).
    """

    repeat: list[int]
    cont: list[int]
    suffix: list[int]
    prefix: list[int]


def _local_tokenizer(model: PreTrainedModel) -> Any | None:
    source = getattr(model, "name_or_path", "") or ""
    if not source or not Path(source).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception:  # weights without tokenizer files: the folded-bytes fallback
        return None


def _folded(text: str, vocab: int) -> list[int]:
    """Bytes of ``text`` folded into the vocabulary (``3 + byte mod (vocab − 3)``): tiny test models."""
    return [3 + b % max(vocab - 3, 1) for b in text.encode("utf-8")]


def reconstruction_prompts(model: PreTrainedModel, repeat: str, cont: str) -> ReconstructionPrompts:
    """Tokenise the requests and the chat template's parts with the model's own tokenizer.

    The template is rendered around a marker as one user message with the generation prompt; the
    text before the marker is the prefix, the text after it the suffix. A model without a stored
    tokenizer (tiny test models) gets the UTF-8 bytes folded into its vocabulary, suffix ``"\\n"``.
    """
    tokenizer = _local_tokenizer(model)
    if tokenizer is None:
        vocab = int(model.config.vocab_size)
        return ReconstructionPrompts(_folded(repeat, vocab), _folded(cont, vocab), _folded("\n", vocab), [])

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    prefix, suffix = "", "\n"
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True,
            enable_thinking=False,
        )  # fmt: skip
        prefix, suffix = rendered.split(_MARK, 1)
    return ReconstructionPrompts(encode(repeat), encode(cont), encode(suffix), encode(prefix))


class ReconstructionScores(CompressionSession):
    """The session of one reconstruction pass: after each layer's attention it scores the chunk.

    Each layer of its cache holds one batch row's context (``n`` entries, all valid) followed by the
    ``q`` tokens of the pass. ``scores[layer]: [kv_heads, n]`` receives, for the chunk's entries
    ``start .. end − 1``, the largest attention any query of the pass (and any query head of the GQA
    group) pays them, the softmax taken over the first ``lead`` entries, the chunk and the pass's
    own tokens (causal; on a sliding-window layer of window ``W`` a query at position ``p`` sees
    only the entries at positions ``> p − W``, as the model's own attention). The layer is then
    restored to the context alone, so the pass never holds more than one layer's copy.
    """

    def __init__(
        self, method: KVzip, num_layers: int, context: list[BudgetLayer], scores: list[torch.Tensor]
    ):
        super().__init__(method, num_layers, budget=1)
        self.begin_reconstruct()
        self.context = context
        self.scores = scores
        self.span = (0, 0, 0)  # lead, start, end

    def after_attention(self, layer_idx: int, query: torch.Tensor, layer: Any, scaling: float, layers=None):
        self.score_pass(layer_idx, query, layer, scaling)
        if layers is not None:  # drop this layer's copy with the pass's tokens: back to the context
            layers[layer_idx] = self.context[layer_idx].shallow_copy()

    def score_pass(self, layer_idx: int, query: torch.Tensor, layer: Any, scaling: float) -> None:
        """Score the chunk's entries of layer ``layer_idx`` from the pass's post-RoPE queries
        ``query: [1, q_heads, q, d]`` over ``layer`` (the context followed by the pass's tokens)."""
        lead, start, end = self.span
        n = self.context[layer_idx].keys.shape[2]
        keys = layer.keys[0].float()  # [h, n + q, d]
        q = query.shape[2]
        sub = torch.cat([keys[:, :lead], keys[:, start:end], keys[:, n:]], dim=1)  # [h, lead + m + q, d]
        window = getattr(layer, "sliding_window", None)
        if window is not None:  # positions of the scored keys and of the pass's queries
            pos = layer.positions[0].to(keys.device)  # [h, n + q]
            sub_pos = torch.cat([pos[:, :lead], pos[:, start:end], pos[:, n:]], dim=1)  # [h, lead + m + q]
        heads, group = sub.shape[0], query.shape[1] // sub.shape[0]
        m = end - start
        softcap = getattr(layer, "softcap", None)
        best = torch.full((heads, m), float("-inf"), device=keys.device)
        for a in range(0, q, QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, q)
            block = query[0, :, a:b].float().reshape(heads, group * (b - a), -1)
            logits = torch.matmul(block, sub.transpose(1, 2)).mul_(scaling)  # [h, g·rows, keys]
            if softcap is not None:
                logits.div_(softcap).tanh_().mul_(softcap)
            logits = logits.view(heads, group, b - a, -1)
            rows = torch.arange(a, b, device=keys.device)[:, None]
            future = torch.arange(q, device=keys.device)[None, :] > rows  # the pass's own tokens, causal
            logits[..., lead + m :].masked_fill_(future, float("-inf"))
            if window is not None:  # [h, rows, keys]: keys the query's window still holds
                seen = in_window(sub_pos, pos[:, n + a : n + b], window)
                logits.masked_fill_(~seen[:, None], float("-inf"))
            probs = torch.softmax(logits, dim=-1)[..., lead : lead + m]  # [h, g, rows, m]
            probs = self.weigh(probs, layer_idx, layer, slice(a, b), slice(start, end))
            best = torch.maximum(best, probs.amax(dim=(1, 2)))
        self.scores[layer_idx][:, start:end] = best.to(self.scores[layer_idx].device)

    def weigh(
        self, probs: torch.Tensor, layer_idx: int, layer: Any, rows: slice, columns: slice
    ) -> torch.Tensor:
        """The attention weights ``probs: [kv_heads, group, rows, m]`` of the pass's queries
        ``rows`` over the chunk's entries ``columns`` (slots of ``layer``), as the score takes them:
        unchanged here; KVzip+ weighs them (:mod:`kvbudget.methods.kvzip_plus`)."""
        return probs


def _row_layer(layer: BudgetLayer, row: int) -> BudgetLayer:
    """Batch row ``row`` of a rectangular prefill layer, its pad slots dropped (a view, batch of one)."""
    valid = layer.positions[row, 0] >= 0
    first = int(valid.nonzero()[0]) if bool(valid.any()) else valid.shape[0]
    new = layer.shallow_copy()
    new.keys = layer.keys[row : row + 1, :, first:]
    new.values = layer.values[row : row + 1, :, first:]
    new.positions = layer.positions[row : row + 1, :, first:]
    new.state = {}
    new.has_invalid = False
    new._release_storage()
    return new


@dataclass
class KVzipRun(RunState):
    """A KVzip run: the model's reconstruction prompts (``None``: no model bound)."""

    prompts: ReconstructionPrompts | None = None


@dataclass(frozen=True)
class KVzip(Method):
    """KVzip: keep the entries the model attends to most while it reconstructs the context.

    After the prefill (a lookahead stage: the full cache exists), each batch row's compressed part
    is fed again behind a request to repeat it — ``repeat_prompt`` + the chat template's
    generation suffix + the context's tokens, teacher-forced, at the positions right after the
    prompt — with the full cache. For each layer, KV head ``h`` and context entry ``i``, the score
    is the largest attention ``i`` receives from any query of that pass and any query head of the
    GQA group (§3.2, Eq. 2; the authors' ``KVScore._get_score``):
    ``S[l, h, i] = max_{g, t} softmax_j(q_{g,t} · k_j · scaling)[i]``.

    Chunking (§3.3, App. A Algorithm 1): the part after the template's prefix is cut into chunks
    of ``chunk`` tokens (2048, the paper's "2K"; the authors' code uses 2000, kvpress 2048), one
    pass per chunk. Chunk 1's input is ``repeat_prompt`` + suffix + chunk; chunk ``t > 1``'s is
    ``continue_prompt`` + the previous chunk's last ``overlap`` (8) tokens + suffix + chunk. Each
    pass attends to the whole context (the model's own forward), but its score's softmax runs only
    over the first ``lead`` entries, the chunk and the pass's own tokens (Algorithm 1's subsampled
    ``K̄``): ``lead`` = the template's prefix (the authors' "system prompt" sink) or ``sinks``,
    whichever is longer, capped at the chunk's start (kvpress: ``min(n_sink, start)``). A pass
    costs ``q × (lead + chunk + q)`` attention per head, computed :data:`QUERY_BLOCK` queries at a
    time; the cache is copied for one layer at a time.

    Budgets (``level``): ``pair`` (default, the paper's non-uniform head-level budgets, Fig. 3 and
    §4.1; kvpress's default ``layerwise=False``) keeps the top ``layers · H · B`` scores over every
    layer and KV head of the row, so layers and heads keep different counts and are stored ragged
    (one tensor per head: skewed budgets save real memory); ``layer`` keeps the top ``H · B`` over
    each layer's heads (kvpress's ``layerwise=True``); ``head`` keeps ``B`` per head (the authors'
    uniform level). The template's prefix tokens and the first ``sinks`` entries are always kept
    and count toward the budget (a budget below them keeps the earliest of them).

    Shapes: scores ``[kv_heads, n]`` per layer and row (valid entries only); the pass's queries
    ``[1, q_heads, q, d]`` (post norms and RoPE, what the model's attention used) over keys
    ``[kv_heads, lead + m + q, d]``.

    Deviations: the score's softmax runs in fp32 (the authors' code in the model dtype); kvpress
    scores the prefix tokens 0 (evicted first, its sinks aside), the authors keep the system prompt
    whole — we keep the template prefix whole, as the authors; the tokenizer is the one stored next
    to the weights (models without one, tiny test models, get the prompts' bytes folded into the
    vocabulary); in a question-aware run the reconstruction covers the whole compressed part
    (question included), in a question-agnostic run (``compress_context_only``) the context only,
    as the paper. Rows of a batch are reconstructed one at a time. Caches derived from one snapshot
    (:func:`kvbudget.prefill.derived.derive`: the evaluation runner's budgets and ratios of a sample)
    reconstruct each row once: the scores do not depend on the budget, so the snapshot keeps them
    (``session.lookahead_memo``) and each run still reports the pass's time, as if run alone.

    Reference: Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction", NeurIPS 2025 (arXiv:2505.23416).

    Args:
        sinks: first entries always kept (4, kvpress's ``n_sink``). window: recent entries always
            kept (0). chunk: tokens reconstructed per pass (2048). overlap: tokens of the previous
            chunk quoted in the next request (8). level: ``pair``, ``layer`` or ``head``.
        repeat_prompt, continue_prompt: the requests (the authors' texts; kvpress's continuation
            has no trailing space).
    """

    name: ClassVar[str] = "kvzip"
    paper: ClassVar[str] = "arXiv:2505.23416"
    summary: ClassVar[str] = (
        'the model re-reads the context after "Repeat the previous context"; each entry\'s score is '
        "the most attention that pass pays it; one top-k over all layers and heads (ragged heads)"
    )
    code: ClassVar[str] = "snu-mllab/KVzip"
    kvpress: ClassVar[str] = "KVzipPress"
    #: two or more reconstruction passes on the tiny prompts
    small_options: ClassVar[dict[str, Any]] = {"chunk": 48}
    stages: ClassVar[tuple[Stage, ...]] = (Stage.LOOKAHEAD,)
    fixed_allocation: ClassVar[str] = "its budgets come from its reconstruction scores (the level option)"
    #: the session that scores a reconstruction pass
    scores_session: ClassVar[type[ReconstructionScores]] = ReconstructionScores

    window: int = 0
    sinks: int = 4
    chunk: int = 2048
    overlap: int = 8
    level: str = "pair"
    repeat_prompt: str = "\n\nRepeat the previous context exactly."
    continue_prompt: str = "\n\nRepeat the part of the previous context exactly, starting with "

    def validate(self) -> None:
        super().validate()
        for option, low in (("chunk", 1), ("overlap", 0)):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise MethodOptionError(f"{self.name}: {option} must be an integer ≥ {low}, got {value!r}")
        if self.level not in LEVELS:
            raise MethodOptionError(
                f"{self.name}: level must be one of {', '.join(LEVELS)}, got {self.level!r}"
            )
        if not self.repeat_prompt.strip():
            raise MethodOptionError(f"{self.name}: repeat_prompt is empty")

    @property
    def dynamic_layers(self) -> bool:
        """Whether layers keep different budgets (``level="pair"``)."""
        return self.level == "pair"

    def start(self, model: PreTrainedModel | None = None) -> KVzipRun:
        """A run with the model's reconstruction prompts bound (built once per model)."""
        if model is None:
            return KVzipRun()
        key = (self.repeat_prompt, self.continue_prompt)
        per_model = _PROMPTS.setdefault(model, {})
        if key not in per_model:
            per_model[key] = reconstruction_prompts(model, self.repeat_prompt, self.continue_prompt)
        return KVzipRun(prompts=per_model[key])

    # ------------------------------------------------------------------ the stage
    @torch.inference_mode()
    def run_lookahead(
        self,
        model: PreTrainedModel,
        cache: BudgetCache,
        logits: torch.Tensor,
        mask: torch.Tensor,
        last_pos: torch.Tensor,
        eos: set[int],
    ) -> None:
        """Score every prompt entry by a reconstruction pass, then keep each row's budget."""
        session = cache.session
        if all(t is None for t in session.targets):
            return
        if session.prompt_ids is None or getattr(session.run, "prompts", None) is None:
            raise KVBudgetError(
                f"{self.name} needs the prompt's token ids and the model's prompts: run it through "
                "kvbudget.generate, kvbudget.compress or snapshot.derive"
            )
        start = session.clock(model.device)
        num_layers = len(cache.layers)
        n = cache.layers[0].keys.shape[2]
        shape = cache.layers[0].positions.shape
        scores = [torch.zeros(shape, dtype=torch.float32, device="cpu") for _ in range(num_layers)]
        anchors = [0] * len(session.targets)
        # runs derived from one snapshot share its rows' scores (they do not depend on the budget)
        memo = session.lookahead_memo if session.method is self else None
        reused = 0.0  # the memoised passes' own time: a row reports what the run alone would take
        for r, target in enumerate(session.targets):
            if target is None:
                continue
            known = None if memo is None else memo.get((self, r))
            if known is None:
                passed = session.clock(model.device)
                row, anchor = self.row_scores(model, cache, r, session.prompt_ids[r], int(last_pos[r]))
                known = (row, anchor, session.clock(model.device) - passed)
                if memo is not None:
                    memo[(self, r)] = known
            else:
                reused += known[2]
            row, anchors[r], _ = known
            first = n - row[0].shape[1]
            for layer_idx in range(num_layers):
                scores[layer_idx][r, :, first:] = row[layer_idx].cpu()
        self.keep(cache, scores, anchors, session)
        elapsed = session.clock(model.device) - start + reused
        session.lookahead_seconds += elapsed
        session.compress_seconds += elapsed

    def row_scores(
        self, model: PreTrainedModel, cache: BudgetCache, r: int, ids: torch.Tensor, last_pos: int
    ) -> tuple[list[torch.Tensor], int]:
        """Reconstruction scores of batch row ``r``: per layer ``[kv_heads, n_r]`` over its valid
        entries, and its always-kept anchor count (template prefix or sinks)."""
        prompts: ReconstructionPrompts = cache.session.run.prompts
        context = [_row_layer(layer, r) for layer in cache.layers]
        n_r = context[0].keys.shape[2]
        tokens = ids[ids.shape[0] - n_r :].tolist()
        prefix = len(prompts.prefix) if tokens[: len(prompts.prefix)] == prompts.prefix else 0
        anchors = self.anchor_count(prefix)
        device = context[0].keys.device
        scores = [torch.zeros((context[0].keys.shape[1], n_r), device=device) for _ in context]
        session = self.scores_session(self, len(context), context, scores)
        clone = BudgetCache(len(context), session)
        clone.attention_attached = True
        clone.layers = [layer.shallow_copy() for layer in context]
        for start in range(prefix, n_r, self.chunk):
            end = min(start + self.chunk, n_r)
            if start == prefix:
                request = prompts.repeat
            else:
                request = prompts.cont + tokens[max(prefix, start - self.overlap) : start]
            feed = torch.tensor([request + prompts.suffix + tokens[start:end]], dtype=torch.long)
            session.span = (min(anchors, start), start, end)
            positions = torch.arange(last_pos + 1, last_pos + 1 + feed.shape[1])[None]
            self.replay(model, clone, session, feed.to(model.device), positions.to(model.device))
            for i, layer in enumerate(context):  # a layer the pass did not reach is restored too
                clone.layers[i] = layer.shallow_copy()
        return scores, min(anchors, n_r)

    def anchor_count(self, prefix: int) -> int:
        """The leading entries a row's scores attend over and its selection always keeps: the chat
        template's ``prefix`` tokens, and at least ``sinks``."""
        return max(prefix, self.sinks)

    def replay(
        self,
        model: PreTrainedModel,
        clone: BudgetCache,
        session: ReconstructionScores,
        feed: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """One reconstruction pass: ``feed: [1, q]`` ids at ``positions: [1, q]`` over ``clone``
        (the row's context), scored by ``session`` after each layer's attention (KVgrad also runs a
        backward pass: :mod:`kvbudget.methods.kvgrad`)."""
        model(input_ids=feed, position_ids=positions, past_key_values=clone, use_cache=True, logits_to_keep=1)

    def keep(
        self, cache: BudgetCache, scores: list[torch.Tensor], anchors: list[int], session: CompressionSession
    ) -> None:
        """Keep each compressed row's budget: the anchors first, then the best scores at ``level``."""
        num_layers = len(cache.layers)
        layer0 = cache.layers[0]
        valid = (layer0.positions >= 0).cpu()  # [b, h, n], the same in every layer of a prefill
        heads = valid.shape[1]
        protected = torch.zeros_like(valid)
        budgets = [valid.sum(-1) for _ in range(num_layers)]  # [b, h] per layer: rows kept whole
        for r, target in enumerate(session.targets):
            if target is None:
                continue
            positions = layer0.positions[r : r + 1].cpu()
            protected[r] = protected_mask(positions, self.window_for(target), max(anchors[r], self.sinks))[0]
            ranked = [s[r].masked_fill(protected[r], float("inf")).masked_fill(~valid[r], float("-inf"))
                      for s in scores]  # fmt: skip
            if self.level == "pair":
                counts = _winners(torch.stack(ranked), num_layers * heads * target)  # [layers, h]
            elif self.level == "layer":
                counts = torch.stack([_winners(s[None], heads * target)[0] for s in ranked])
            else:
                counts = torch.full((num_layers, heads), target, dtype=torch.long)
            for layer_idx in range(num_layers):
                budgets[layer_idx][r] = counts[layer_idx]
        for layer_idx, layer in enumerate(cache.layers):
            record_ranks(layer, scores[layer_idx], protected)
            layer.keep(select_keep(scores[layer_idx], budgets[layer_idx], valid, protected))
            session.kept[:, layer_idx] = layer.head_lengths().cpu()
            cache.note_memory(layer_idx)


def _winners(ranked: torch.Tensor, total: int) -> torch.Tensor:
    """How many of the stable top-``total`` of ``ranked: [layers, h, n]`` fall in each (layer, head):
    ``[layers, h]`` int64 (exact ties to the earlier layer, head and slot)."""
    layers, heads, n = ranked.shape
    flat = ranked.reshape(-1)
    total = min(total, int((flat > float("-inf")).sum()))
    order = torch.sort(flat, descending=True, stable=True).indices[:total]
    return torch.bincount(order // n, minlength=layers * heads).view(layers, heads)
