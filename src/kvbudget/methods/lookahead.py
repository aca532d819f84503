"""Lookahead Q-Cache: select the prompt's entries with the queries of a cheap pseudo answer.

LAQ (Wang et al., "Lookahead Q-Cache: Achieving More Consistent KV Cache Eviction via Pseudo
Query", §4, Eq. 4–5) prefills with the full cache, then *looks ahead*: it clones the cache,
compresses the clone with a cheap method (SnapKV at the main budget by default), greedily decodes
``n`` pseudo answer tokens on the clone from the first real output token (argmax of the full-cache
logits), and keeps each layer's post-RoPE query of every pseudo token. Those queries — alone
(``laq``, Eq. 4) or after the last ``w2`` prompt queries (``laq++``, Eq. 5) — are the observation
window that re-scores the **full** cache; each layer keeps its top ``B − w2`` entries plus the
last ``w2`` prompt tokens. The clone and the pseudo tokens are then dropped and decoding starts
for real from the first output token at the true position after the prompt.

The lookahead queries are an observation window like any other: :class:`LookaheadObservation`
serves them through :meth:`~kvbudget.observation.Observation.window_probs`, so any window scorer
and allocator runs on them unchanged: ``laq`` takes SnapKV's allocator options (``laq-ada`` is
``laq++`` with AdaKV's head budgets, ``--opt layer_alloc=pyramid`` gives pyramid layers), and
``laq-lava`` is LAVa's score with its cascading layer and head budgets (and LAVa's options).

The engine calls :meth:`LookaheadMixin.run_lookahead` right after the prefill (and
:func:`kvbudget.prefill.derived.derive` after deriving a full cache from a shared prefill, so the
evaluation runner's shared-prefill path gives the same cache as a layer-wise run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbudget.cache import BudgetCache, BudgetLayer
from kvbudget.errors import BudgetError, KVBudgetError, MethodOptionError
from kvbudget.masks import in_window
from kvbudget.methods.base import Method
from kvbudget.methods.combinations import COMBINATIONS
from kvbudget.methods.full import FullCache
from kvbudget.methods.lava import LAVa
from kvbudget.methods.snapkv import SnapKV
from kvbudget.methods.streamingllm import StreamingLLM
from kvbudget.observation import Observation
from kvbudget.phases import Stage
from kvbudget.session import CompressionSession, replay_prefill

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: methods that may compress the lookahead clone (they need at most the prompt's last queries)
LOOKAHEAD_METHODS = ("snapkv", "pyramidkv", "ada-snapkv", "ada-pyramidkv", "streamingllm", "full")
#: the classes those names build (a named combination: its base's class with its options)
_CLONE_CLASSES: dict[str, type[Method]] = {"snapkv": SnapKV, "streamingllm": StreamingLLM, "full": FullCache}
#: of those, the ones whose observation window ``lookahead_window`` sets
WINDOWED_LOOKAHEAD = ("snapkv", "pyramidkv", "ada-snapkv", "ada-pyramidkv")
#: what a budget counts: entries per KV head (ours, the default) or per query head (the authors' code)
BUDGET_GRANULARITIES = ("kv-head", "query-head")


@dataclass
class LookaheadObservation(Observation):
    """A prompt layer's full cache observed by the window queries and the lookahead queries.

    Attributes:
        query: ``[b, q_heads, w2, d]`` post-RoPE queries of the last ``w2`` prompt tokens (may be
            empty), the tokens of the layer's last ``w2`` entries.
        pseudo_query: ``[b, q_heads, m, d]`` post-RoPE queries of the ``m`` pseudo tokens.
        pseudo_valid: ``[b, m]`` bool, False for steps after a row's lookahead stopped at EOS.
        pseudo_positions: ``[b, m]`` the pseudo tokens' positions; ``None``: right after each row's
            last prompt position (``1 + max position``, then one more per step), as decoded.
    """

    pseudo_query: torch.Tensor | None = None
    pseudo_valid: torch.Tensor | None = None
    pseudo_positions: torch.Tensor | None = None

    def window_keys(self, window: int) -> int:
        """Only the ``w2`` window queries are tokens of the cache; pseudo tokens are not."""
        return self.query.shape[2]

    def window_probs(self, window: int) -> torch.Tensor:
        """Observation rows over all of the layer's keys: ``[b, q_heads, w2 + m, n]`` (fp32).

        The ``w2`` window rows are causal inside the bottom-right ``w2 × w2`` block (as any
        window); the ``m`` pseudo rows see **every** valid prompt key — the authors' code applies
        one causal mask to the whole ``w2 + m`` block, hiding the last prompt keys from the
        pseudo queries; we do not reproduce that bug. On a sliding-window layer (window ``W``) the
        pseudo query at position ``p`` sees only the keys at positions ``> p − W``, as the model's
        own attention would. The softmax runs over the prompt's keys only (pseudo keys were never
        in this cache); a pseudo row whose window holds no prompt key is 0. Rows of steps after
        EOS are 0. ``window`` is ignored: the rows are fixed by the lookahead.
        """
        if "lookahead" not in self._memo:
            n = self.keys.shape[2]
            rows = [self._probs(self.query, n)] if self.query.shape[2] else []
            if self.pseudo_query is not None and self.pseudo_query.shape[2]:
                rows.append(self._pseudo_probs())
            if not rows:
                rows.append(self.query.new_zeros((*self.query.shape[:2], 0, n), dtype=torch.float32))
            self._memo["lookahead"] = torch.cat(rows, dim=2)
        return self._memo["lookahead"]

    def _pseudo_probs(self) -> torch.Tensor:
        b, hq, m, _ = self.pseudo_query.shape
        heads, n = self.num_kv_heads, self.keys.shape[2]
        logits = self.scaled_logits(self.pseudo_query, n)
        valid = self.valid
        if not bool(valid.all()):
            logits.view(b, heads, hq // heads, m, n).masked_fill_(~valid[:, :, None, None, :], float("-inf"))
        window = self.layer.sliding_window
        if window is not None:
            positions = self.positions  # [b, heads, n]; invalid (-1) entries are hidden already
            at = self.pseudo_positions
            if at is None:
                last = positions.amax(dim=(1, 2))  # [b]
                at = last[:, None] + 1 + torch.arange(m, device=positions.device)[None]
            seen = in_window(positions, at.to(positions.device)[:, None], window)  # [b, heads, m, n]
            logits.view(b, heads, hq // heads, m, n).masked_fill_(~seen[:, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if window is not None:  # a row that sees no prompt key attends to nothing here
            probs = probs.nan_to_num_(0.0)
        if self.pseudo_valid is not None:
            probs = probs * self.pseudo_valid[:, None, :, None].to(probs.device, probs.dtype)
        return probs


class QueryHeadLayer(BudgetLayer):
    """A layer that stores one head per *query* head: the authors' cache granularity on GQA models.

    Head ``j`` starts as a copy of KV head ``j // group`` (``repeat_kv``'s order), so each of a
    group's query heads can keep its own selection and attends to exactly that; every token
    appended later has its KV heads repeated the same way. Any layout and accounting of
    :class:`~kvbudget.cache.BudgetLayer` applies with ``q_heads`` heads: ``keys: [b, q_heads, n, d]``
    (rectangular) or ``q_heads`` per-head tensors, and ``logical_entries()`` counts ``[q_heads]``.
    The ``kvbudget`` attention serves it unchanged (it groups query heads by the layer's own head
    count, here one query head per stored head); a model's own attention would repeat the heads
    again and fail on the shapes, so the model must stay attached (``kvbudget.compress`` and
    ``generate`` attach it).

    Args:
        group: query heads per KV head (``g = q_heads / kv_heads``).
    """

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group

    @classmethod
    def repeated(cls, layer: BudgetLayer, group: int) -> QueryHeadLayer:
        """A new layer whose head ``j`` holds ``layer``'s KV head ``j // group`` (a copy, ``group``
        times the layer's bytes); ``layer`` (rectangular: ``keys: [b, kv_heads, n, d]``) is not changed."""
        if layer.is_ragged:
            raise KVBudgetError("only a rectangular (uncompressed) layer can be repeated to its query heads")
        new = cls(group)
        new.__dict__.update(layer.__dict__)
        new.group = group
        new.keys = layer.keys.repeat_interleave(group, dim=1)
        new.values = layer.values.repeat_interleave(group, dim=1)
        new.positions = layer.positions.repeat_interleave(group, dim=1)
        new.state = {name: s.repeat_interleave(group, dim=1) for name, s in layer.state.items()}
        new._release_storage()
        return new

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[b, kv_heads, q, d]`` states, each KV head repeated to its ``group`` query heads."""
        return super().update(
            key_states.repeat_interleave(self.group, dim=1),
            value_states.repeat_interleave(self.group, dim=1),
            *args,
            **kwargs,
        )

    def shallow_copy(self) -> QueryHeadLayer:
        layer = QueryHeadLayer(self.group)
        layer.__dict__.update(self.__dict__)
        layer.state = dict(self.state)
        return layer


class QueryCapture(CompressionSession):
    """The lookahead clone's session: compresses like any session and, while ``capturing``,
    appends each layer's post-RoPE queries to ``captured[layer]``."""

    def __init__(self, method: Method, num_layers: int, budget: int | None, ratio: float | None):
        super().__init__(method, num_layers, budget=budget, ratio=ratio)
        self.capturing = False
        self.captured: dict[int, list[torch.Tensor]] = {i: [] for i in range(num_layers)}

    def after_attention(self, layer_idx: int, query: torch.Tensor, layer: Any, scaling: float, layers=None):
        if self.capturing:
            self.captured[layer_idx].append(query)
        super().after_attention(layer_idx, query, layer, scaling, layers)


@dataclass
class Lookahead:
    """What one lookahead produced (kept in the run state as ``lookahead`` for inspection:
    ``cache.session.run.lookahead``).

    Attributes:
        tokens: ``[b, m]`` the pseudo tokens fed to the clone (the first is the first real output token).
        positions: ``[b, m]`` their RoPE positions (right after each row's prompt).
        valid: ``[b, m]`` bool, False once a row's lookahead stopped at EOS.
        queries: per layer, ``[b, q_heads, m, d]`` post-RoPE queries of the pseudo tokens.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    queries: dict[int, torch.Tensor]


@dataclass(frozen=True)
class LookaheadMixin:
    """The lookahead stage; combined with a window method (scorer + allocator) it makes LAQ.

    Args:
        steps: pseudo tokens decoded (default 8, the paper's); stops early at EOS.
        lookahead_method: the cheap method compressing the clone (``snapkv``; one of
            :data:`LOOKAHEAD_METHODS`; ``full`` decodes on the uncompressed clone).
        lookahead_budget: the clone's budget in entries per head (0 = the main budget or ratio).
        lookahead_window: observation window of a windowed lookahead method (32, SnapKV's).
        budget_per: what the budget ``B`` counts, ``"kv-head"`` (default) or ``"query-head"``.

    Budget granularity (``budget_per``). The paper (Eq. 4–5) keeps "the top ``B``" without naming
    the head it counts per. The authors' code repeats the KV heads to the query heads before caching
    (``repeat_kv`` before the cache update in ``LlamaFlashAttention2_forward_LAQ``,
    ``pyramidkv/llama_model.py``; the same in ``mistral_model.py`` and ``qwen2_model.py``), so
    both the clone's SnapKV (``select_KV_lookahead_stage``) and the re-selection
    (``SnapKVCluster.update_kv_LAQ``, ``pyramidkv/pyramidkv_utils.py``) take a top-``k`` per
    *query* head over that head's own scores (no GQA reduction) and each query head attends to
    its own ``B`` entries — ``g = q_heads / kv_heads`` times the memory of ``B`` per KV head (4× on
    Llama-3.1-8B and Mistral-7B, 7× on Qwen2.5-7B, 3× on SmolLM2-135M; the code's baselines repeat
    too). ``"kv-head"`` (ours, the default): each KV head keeps ``B`` entries scored by its GQA
    group's reduction (``reduce_heads``) — the same memory as every other method here at the same
    budget, the fair comparison. ``"query-head"`` reproduces the authors' granularity exactly: each
    layer is replaced by a :class:`QueryHeadLayer` (its KV heads repeated to the query heads) right
    before it is compressed, in the clone and in the re-selection, so any scorer and allocator runs
    with one query head per head (``reduce_heads`` then has nothing to reduce); the final cache and
    its accounting (``stats().entries: [layers, q_heads]``, logical bytes) hold ``g·B`` entries per
    KV group. Repeating costs ``g`` times one layer's full cache at a time, on top of the full
    cache (the authors' code holds the repeated full cache of every layer). A prompt that fits its
    budget is repeated too (``g·n`` entries, ``n ≤ B``), as the authors' cache would hold it, so
    every prompt's stats and ``budgets`` count query heads; the lookahead clone is repeated only
    when its method evicts something (its pseudo tokens are the same either way). Decode steps
    append each new token's KV heads repeated to the query heads (:meth:`QueryHeadLayer.update`).
    On a model without GQA (``g = 1``) both settings run the very same code.
    """

    stages: ClassVar[tuple[Stage, ...]] = (Stage.LOOKAHEAD,)

    steps: int = 8
    lookahead_method: str = "snapkv"
    lookahead_budget: int = 0
    lookahead_window: int = 32
    budget_per: str = "kv-head"

    def validate(self) -> None:
        super().validate()
        for name in ("steps", "lookahead_budget", "lookahead_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise MethodOptionError(f"{self.name}: option {name} must be an integer ≥ 0, got {value!r}")
        if self.budget_per not in BUDGET_GRANULARITIES:
            raise MethodOptionError(
                f"{self.name}: budget_per must be one of {', '.join(BUDGET_GRANULARITIES)}, "
                f"got {self.budget_per!r}"
            )
        if self.lookahead_method not in LOOKAHEAD_METHODS:
            raise MethodOptionError(
                f"{self.name}: lookahead_method must be one of {', '.join(LOOKAHEAD_METHODS)}, "
                f"got {self.lookahead_method!r}"
            )
        if self.steps == 0 and self.window == 0:
            raise MethodOptionError(
                f"{self.name}: steps=0 with window=0 leaves no observation queries; "
                "give steps ≥ 1 or a window"
            )
        self.clone_method()  # the clone's method validates its own options now, not mid-run

    def clone_method(self) -> Method:
        """A fresh object of the clone's method (built here from :data:`LOOKAHEAD_METHODS`' classes and
        the named combinations' options, as the registry would build it)."""
        name = self.lookahead_method
        combination = COMBINATIONS.get(name)
        base, options = (combination.base, dict(combination.options)) if combination else (name, {})
        if name in WINDOWED_LOOKAHEAD:
            options["window"] = self.lookahead_window
        return _CLONE_CLASSES[base].named(name, **options)

    def min_budget(self) -> int:
        own = super().min_budget()
        return own if self.lookahead_budget else max(own, self.clone_method().min_budget())

    def check_budget(self, budget: int) -> None:
        own = super().min_budget()
        if budget < own:
            raise BudgetError(
                f"budget must be ≥ {own} for {self.name} "
                f"(window {self.window} + sinks {self.sinks} + 1), got {budget}"
            )
        look = self.clone_method()
        clone_budget = self.lookahead_budget or budget
        if clone_budget < look.min_budget():
            raise BudgetError(
                f"{self.name}: the lookahead clone's budget {clone_budget} is below the {look.min_budget()} "
                f"entries {self.lookahead_method} needs (window {look.window} + sinks {look.sinks} + 1); "
                f"raise the budget, set lookahead_budget, or a smaller lookahead_window"
            )

    def queries_to_record(self) -> int:
        """The prompt's last queries needed: the stage-2 window and the clone method's window."""
        look = self.clone_method()
        return max(1, self.window, look.window if self.lookahead_method in WINDOWED_LOOKAHEAD else 0)

    def repeat_group(self, layer: BudgetLayer, q_heads: int) -> int:
        """How many times to repeat each of ``layer``'s heads for a model of ``q_heads`` query heads:
        ``q_heads / kv_heads`` for ``budget_per="query-head"``, else 1 (keep the layer as it is)."""
        return 1 if self.budget_per == "kv-head" else q_heads // layer.num_heads

    @staticmethod
    def to_query_heads(cache: BudgetCache, layer_idx: int, group: int) -> None:
        """Replace ``cache``'s layer ``layer_idx`` (rectangular, ``[b, kv_heads, n, d]``) by its
        :class:`QueryHeadLayer` (``[b, kv_heads · group, n, d]``) and account its size."""
        cache.layers[layer_idx] = QueryHeadLayer.repeated(cache.layers[layer_idx], group)
        cache.note_memory(layer_idx)

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
        """Look ahead on a compressed clone, then re-select ``cache`` with the pseudo queries."""
        session = cache.session
        if all(t is None for t in session.targets):  # every prompt fits its budget: nothing to select
            q_heads = session.recorded_queries[0].shape[1]
            group = self.repeat_group(cache.layers[0], q_heads)
            if group > 1:  # the authors' cache holds query heads whatever the prompt's length
                layers = len(cache.layers)
                session.kept = torch.zeros((session.kept.shape[0], layers, q_heads), dtype=torch.long)
                for layer_idx in range(layers):
                    self.to_query_heads(cache, layer_idx, group)
                    session.kept[:, layer_idx] = cache.layers[layer_idx].head_lengths().cpu()
            session.recorded_queries.clear()
            return
        start = session.clock(logits.device)
        record = self.pseudo_decode(model, cache, logits, mask, last_pos, eos)
        middle = session.clock(logits.device)
        self.reselect(cache, record)
        end = session.clock(logits.device)
        session.lookahead_seconds += middle - start
        session.reselect_seconds += end - middle
        session.compress_seconds += end - start
        session.run.lookahead = record

    def pseudo_decode(
        self,
        model: PreTrainedModel,
        cache: BudgetCache,
        logits: torch.Tensor,
        mask: torch.Tensor,
        last_pos: torch.Tensor,
        eos: set[int],
    ) -> Lookahead:
        """Clone ``cache`` (sharing its tensors), compress the clone, greedily decode the pseudo tokens.

        ``logits: [b, vocab]`` of the prompt's last token give the first pseudo token; ``mask:
        [b, T]`` and ``last_pos: [b]`` are the prompt's padding mask and last positions. A row
        stops before feeding an EOS token; decoding stops when every row has.
        """
        session = cache.session
        num_layers = len(cache.layers)
        if self.lookahead_budget:
            budget, ratio = self.lookahead_budget, None
        else:
            budget, ratio = session.budget, session.ratio
        capture = QueryCapture(self.clone_method(), num_layers, budget=budget, ratio=ratio)
        # The clone's prefill observations are the prompt's last queries over the same full layers:
        # a shared prefill's window probabilities serve them too (memo keys name the query rows).
        capture.observation_memos = session.observation_memos
        clone = BudgetCache(num_layers, capture)
        group = self.repeat_group(cache.layers[0], session.recorded_queries[0].shape[1])
        if group > 1:  # repeat the clone's heads only if it evicts anything
            capture.resolve(cache.layers[0].head_lengths()[:, 0].cpu())
            if self.lookahead_method == "full" or all(t is None for t in capture.targets):
                group = 1

        def copy(layer: BudgetLayer) -> BudgetLayer:  # one layer at a time: at most one repeated full layer
            return QueryHeadLayer.repeated(layer.shallow_copy(), group) if group > 1 else layer.shallow_copy()

        for _ in replay_prefill(clone, cache.layers, session.recorded_queries, session.scaling, copy):
            pass  # compress the clone as its prefill would have
        capture.begin_decode()
        capture.capturing = True
        device = logits.device
        stop = torch.tensor(sorted(eos), dtype=torch.long, device=device)
        token = logits.argmax(-1)
        active = torch.ones_like(token, dtype=torch.bool)
        tokens, positions, valid = [], [], []
        for _ in range(self.steps):
            active = active & ~torch.isin(token, stop)
            if not bool(active.any()):
                break
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            last_pos = last_pos + 1
            tokens.append(token)
            positions.append(last_pos)
            valid.append(active)
            out = model(
                input_ids=token[:, None].to(model.device), attention_mask=mask.to(model.device),
                position_ids=last_pos[:, None].to(model.device), past_key_values=clone, use_cache=True,
                logits_to_keep=1,
            )  # fmt: skip
            token = out.logits[:, -1].argmax(-1).to(device)
        b = token.shape[0]

        def stacked(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            return torch.stack(parts, 1) if parts else torch.zeros((b, 0), dtype=dtype, device=device)

        queries = {
            i: torch.cat(q, dim=2) if q else session.recorded_queries[i][:, :, :0]
            for i, q in capture.captured.items()
        }
        return Lookahead(
            stacked(tokens, torch.long), stacked(positions, torch.long), stacked(valid, torch.bool), queries
        )

    def reselect(self, cache: BudgetCache, record: Lookahead) -> None:
        """Compress every layer of the full ``cache`` observed by the window + pseudo queries.

        Runs this method's own compression (scorer, allocators, selector; cascading re-eviction
        for cascading bases) layer by layer, as its prefill would, then drops the recorded queries.
        With ``budget_per="query-head"`` each layer is first replaced by its :class:`QueryHeadLayer`
        and ``session.kept`` becomes ``[b, layers, q_heads]``.
        """
        session = cache.session
        num_layers = len(cache.layers)
        q_heads = session.recorded_queries[0].shape[1]
        group = self.repeat_group(cache.layers[0], q_heads)
        if group > 1:
            session.kept = torch.zeros((session.kept.shape[0], num_layers, q_heads), dtype=torch.long)
        for layer_idx in range(num_layers):
            recorded = session.recorded_queries[layer_idx]
            if group > 1:  # the repeated full layer counts toward the peak
                self.to_query_heads(cache, layer_idx, group)
            layer = cache.layers[layer_idx]
            w2 = min(self.window, recorded.shape[2])
            obs = LookaheadObservation(
                layer_idx, num_layers, recorded[:, :, recorded.shape[2] - w2 :], layer, session.scaling,
                pseudo_query=record.queries[layer_idx], pseudo_valid=record.valid,
                pseudo_positions=record.positions, run=session.run,
            )  # fmt: skip
            session.kept[:, layer_idx] = self.compress_layer(obs, session.targets)
            if self.cascading:
                self.rebalance(cache.layers[: layer_idx + 1], session.targets, session.run)
                for earlier in range(layer_idx):
                    session.kept[:, earlier] = cache.layers[earlier].head_lengths().cpu()
            for noted in range(layer_idx + 1) if self.cascading else (layer_idx,):
                cache.note_memory(noted)
        session.recorded_queries.clear()


@dataclass(frozen=True)
class LAQ(LookaheadMixin, SnapKV):
    """LAQ: the pseudo queries alone are the observation window (Eq. 4); no window is protected.

    Score (SnapKV's form): the attention of the ``n`` pseudo queries over all prompt keys (softmax
    over the prompt's keys, fp32), summed over the pseudo rows, averaged over each GQA group,
    max-pooled (kernel 7) along the keys; each KV head keeps its top ``B``. Uniform budgets. With
    ``budget_per="query-head"`` (the authors' granularity, ``g`` times the memory on GQA models; see
    :class:`LookaheadMixin`) nothing is averaged: each query head keeps its own top ``B``.

    Differences from the authors' code (noforit/Lookahead_Q-Cache): the pseudo queries see every
    prompt key (the code's causal mask over the last ``w2 + n`` keys hides the last prompt keys
    from them — a bug); a row whose first token is EOS has no pseudo query, scores 0 everywhere
    and keeps its earliest entries (its answer is empty anyway). In a batch, rows that stopped at
    EOS earlier get zero rows; scorers that average rows (``reduce_rows="mean"`` as in ``laq-ada``;
    ``laq-lava``) then divide
    by the batch's row count — a constant per row that does not change its ranking.

    Reference: Wang et al., "Lookahead Q-Cache: Achieving More Consistent KV Cache Eviction via
    Pseudo Query", EMNLP 2025 (arXiv:2505.20334), §4.

    ``laq++`` (Eq. 5) is ``laq`` with ``window=8``: the last 8 prompt queries join the pseudo
    queries and the last 8 prompt tokens are always kept. ``laq-ada`` is ``laq++`` with AdaKV's
    head budgets (``head_alloc="ada"``, floor 0.2) and the window rows averaged
    (``reduce_rows="mean"``).

    Args:
        window: stage-2 window ``w2`` — the last prompt queries joining the observation and the
            last prompt tokens always kept (0 for ``laq``, 8 for ``laq++``).
        kernel, pooling, reduce_rows, reduce_heads: SnapKV's scoring options (7, max, sum, mean).
        layer_alloc, head_alloc, beta, floor_alpha: SnapKV's allocators (uniform by default;
            :class:`~kvbudget.methods.composable.Composable`).
        steps, lookahead_method, lookahead_budget, lookahead_window, budget_per: see
            :class:`LookaheadMixin` (``budget_per``: ``"kv-head"`` default, ``"query-head"`` the authors').
    """

    name: ClassVar[str] = "laq"
    paper: ClassVar[str] = "arXiv:2505.20334"
    summary: ClassVar[str] = (
        "8 pseudo answer tokens decoded on a SnapKV clone; their queries re-score the full cache (Eq. 4)"
    )
    code: ClassVar[str] = "noforit/Lookahead_Q-Cache"
    kvpress: ClassVar[str] = ""
    small_options: ClassVar[dict[str, Any]] = {"kernel": 3, "steps": 3, "lookahead_window": 4}
    window: int = 0


@dataclass(frozen=True)
class LAQLava(LookaheadMixin, LAVa):
    """LAQ with LAVa's score and budgets: the laq++ observation (last 8 prompt queries + the pseudo
    queries) replaces LAVa's window in Eq. 6; LAVa's flattened head budgets and cascading entropy
    layer budgets (run over the layers in order after the lookahead) decide what each head keeps;
    the last 8 tokens are kept. Options as :class:`~kvbudget.methods.lava.LAVa` and
    :class:`LookaheadMixin`."""

    name: ClassVar[str] = "laq-lava"
    paper: ClassVar[str] = "arXiv:2505.20334"
    summary: ClassVar[str] = "the laq++ observation with LAVa's score and budgets"
    code: ClassVar[str] = "noforit/Lookahead_Q-Cache"
    small_options: ClassVar[dict[str, Any]] = {"window": 4, "kernel": 3, "steps": 3, "lookahead_window": 4}
    window: int = 8
