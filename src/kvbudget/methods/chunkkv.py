"""ChunkKV: keep whole chunks of consecutive tokens, ranked by any scorer's summed scores."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import torch

from kvbudget.errors import MethodOptionError
from kvbudget.methods.base import Method, RunState, defined_classes
from kvbudget.methods.combinations import COMBINATIONS
from kvbudget.observation import Observation
from kvbudget.phases import Stage

#: options of the inner scorer that ChunkKV passes on when the scorer has them (SnapKV's defaults)
SCORER_OPTIONS: dict[str, Any] = {"kernel": 7, "pooling": "max", "reduce_rows": "sum", "reduce_heads": "mean"}
#: stages whose methods have no per-layer score to put in chunks
_NO_SCORE_STAGES = (Stage.PRUNE, Stage.POST_PREFILL, Stage.LOOKAHEAD)


def chunk_ranking(token_scores: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Rank ``c`` candidate tokens chunk by chunk: ``[c]`` fp32 scores, higher = kept first.

    Chunks are ``[0, s), [s, 2s), …`` (the last one may be shorter). A chunk's score is the sum
    of its tokens' scores, a shorter last chunk's scaled by ``s / length`` (its mean × ``s``, as
    kvpress does, so it is not penalised for its length). Chunks are ordered by score (ties to
    the earlier chunk), and inside a chunk tokens by their own score (ties to the earlier token);
    the returned value is ``c − rank`` in that order, so a top-``k`` takes whole chunks and, at the
    cut, the best tokens of the next chunk.
    """
    c = token_scores.numel()
    scores = token_scores.double()
    starts = torch.arange(0, c, chunk_size, device=scores.device)
    chunk_of = torch.arange(c, device=scores.device) // chunk_size
    sums = torch.zeros(starts.numel(), dtype=torch.float64, device=scores.device).index_add_(
        0, chunk_of, scores
    )
    lengths = torch.bincount(chunk_of, minlength=starts.numel()).double()
    chunk_scores = sums / lengths * chunk_size
    chunk_order = torch.sort(chunk_scores, descending=True, stable=True).indices
    chunk_rank = torch.empty_like(chunk_order)
    chunk_rank[chunk_order] = torch.arange(chunk_order.numel(), device=scores.device)
    # order tokens by (chunk rank ↑, token score ↓, position ↑): two stable sorts
    by_score = torch.sort(scores, descending=True, stable=True).indices
    order = by_score[torch.sort(chunk_rank[chunk_of[by_score]], stable=True).indices]
    ranking = torch.empty(c, dtype=torch.float32, device=scores.device)
    ranking[order] = torch.arange(c, 0, -1, dtype=torch.float32, device=scores.device)
    return ranking


@dataclass
class ChunkKVRun(RunState):
    """A ChunkKV run: the scorer's own run state, and the positions each selecting layer kept
    (for the layers that reuse them)."""

    inner: RunState = field(default_factory=RunState)
    kept: dict[int, list[torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkKV(Method):
    """ChunkKV: a scorer's token scores summed over chunks of ``chunk_size`` consecutive tokens;
    the best chunks are kept whole, one index set per layer.

    With ``B`` entries per KV head and window ``w``: the inner scorer (``scorer``, any registered
    method with a per-layer score, SnapKV by default) scores the layer, ``[b, kv_heads, n]``; the
    scores are summed over the KV heads (one selection per layer, shared by its heads, as
    kvpress's ``ChunkKVPress``); the ``n − w`` tokens before the window are cut into chunks
    (:func:`chunk_ranking`) and the top chunks fill ``B − w`` entries; the window is always kept.

    Layer-wise index reuse (the paper's second technique): with ``reuse = R > 1`` only layers ``0, R, 2R, …``
    select; each following layer of its group keeps the same positions. The default ``reuse = 1``
    selects in every layer: the reuse is the paper's efficiency variant (it saves the scoring of
    the reusing layers at some accuracy cost), and kvpress's ``ChunkKVPress``, the implementation
    the paper points to, has none.

    Reference: Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
    Long-Context LLM Inference" (arXiv:2502.00299): chunk selection and layer-wise index reuse.

    Deviations (ours): the paper keeps ``⌊(B − w)/c⌋`` chunks, so up to ``c − 1`` entries of the
    budget stay unused; kvbudget fills them with the best tokens (layer-summed score) of the next
    chunk, so every method holds exactly ``B``. kvpress's press chunks the whole prompt including
    its window (whose scores it sets to the maximum); kvbudget chunks only the tokens before the
    protected window and appends the window, as the paper's algorithm does. The settings can be
    matched when the window is a whole number of chunks (the oracle test does).

    Args:
        scorer: registered method whose ``score`` ranks the tokens (default ``snapkv``).
        chunk_size: tokens per chunk (default 10, the paper's default).
        reuse: layers sharing one selection (default 1 = no reuse; see above).
        window: recent entries always kept, also the scorer's observation window (default 32).
        sinks: first entries always kept (default 0).
        kernel, pooling, reduce_rows, reduce_heads: passed to a scorer that has these options
            (SnapKV's defaults 7, max, sum, mean); a non-default value for a scorer without the
            option is refused.
    """

    name: ClassVar[str] = "chunkkv"
    paper: ClassVar[str] = "arXiv:2502.00299"
    summary: ClassVar[str] = (
        "whole 10-token chunks ranked by a scorer's summed scores (SnapKV by default), one set per layer"
    )
    kvpress: ClassVar[str] = "ChunkKVPress"
    small_options: ClassVar[dict[str, Any]] = {"window": 4, "kernel": 3, "chunk_size": 5}
    fixed_allocation: ClassVar[str] = "ChunkKV keeps one chunk selection per layer, shared by its heads"
    window: int = 32
    scorer: str = "snapkv"
    chunk_size: int = 10
    reuse: int = 1
    kernel: int = 7
    pooling: str = "max"
    reduce_rows: str = "sum"
    reduce_heads: str = "mean"

    def validate(self) -> None:
        super().validate()
        for option in ("chunk_size", "reuse"):
            value = getattr(self, option)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MethodOptionError(f"chunkkv: option {option} must be an integer ≥ 1, got {value!r}")
        self._build_scorer()  # refuses a scorer that cannot serve, at construction

    def _build_scorer(self) -> Method:
        if not isinstance(self.scorer, str) or self.scorer in ("chunkkv", "full"):
            raise MethodOptionError(f"chunkkv: scorer must be another scoring method, got {self.scorer!r}")
        combination = COMBINATIONS.get(self.scorer)
        classes = defined_classes()
        cls = classes.get(combination.base if combination else self.scorer)
        if cls is None:
            known = ", ".join(sorted({*classes, *COMBINATIONS}))
            raise MethodOptionError(
                f"chunkkv: option scorer={self.scorer!r}: unknown method '{self.scorer}': "
                f"expected one of {known}"
            )
        if any(s in cls.stages for s in _NO_SCORE_STAGES) or cls.score is Method.score:
            raise MethodOptionError(self._no_score())
        fields = {f.name for f in dataclasses.fields(cls)}
        passed: dict[str, Any] = {"window": self.window, "sinks": self.sinks}
        for option, default in SCORER_OPTIONS.items():
            value = getattr(self, option)
            if option in fields:
                passed[option] = value
            elif value != default:
                raise MethodOptionError(f"chunkkv: scorer '{self.scorer}' has no option {option}")
        inner = cls.named(self.scorer, **{**(combination.options if combination else {}), **passed})
        if inner.cascading:  # LAVa's cascading layer allocator is an option: known once built
            raise MethodOptionError(self._no_score())
        return inner

    def _no_score(self) -> str:
        return (
            f"chunkkv: scorer '{self.scorer}' has no per-layer prefill score "
            "(prune, post-prefill, lookahead and cascading methods cannot be chunked)"
        )

    @cached_property
    def inner(self) -> Method:
        """The scorer object (built from the options; configuration, like the options)."""
        return self._build_scorer()

    def start(self, model: Any = None) -> ChunkKVRun:
        return ChunkKVRun(inner=self.inner.start(model))

    def _inner_obs(self, obs: Observation) -> Observation:
        """``obs`` as the scorer sees it: carrying the scorer's own run state."""
        run = self.run_of(obs)
        return dataclasses.replace(obs, run=run.inner) if isinstance(run, ChunkKVRun) else obs

    def observe(self, obs: Observation) -> None:
        self.inner.observe(self._inner_obs(obs))

    def score(self, obs: Observation) -> torch.Tensor:
        source = obs.layer_idx - obs.layer_idx % self.reuse
        run = self.run_of(obs)
        kept = run.kept.get(source) if source != obs.layer_idx and isinstance(run, ChunkKVRun) else None
        positions, valid = obs.positions[:, 0], obs.valid[:, 0]  # the prefill's rows are rectangular
        if kept is not None:  # a reusing layer: the source layer's positions, nothing else
            reused = torch.stack([torch.isin(positions[r], kept[r]) for r in range(len(kept))])
            return reused.float()[:, None].expand(-1, obs.num_kv_heads, -1)
        layer_scores = self.inner.score(self._inner_obs(obs)).float().sum(1)  # [b, n]
        scores = torch.zeros_like(layer_scores)
        for r in range(scores.shape[0]):
            slots = valid[r].nonzero().flatten()
            candidates = slots[: max(slots.numel() - self.window, 0)]
            if candidates.numel():
                scores[r, candidates] = chunk_ranking(layer_scores[r, candidates], self.chunk_size)
        return scores[:, None].expand(-1, obs.num_kv_heads, -1)

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        run = self.run_of(obs)
        if obs.layer_idx == 0:
            run.kept.clear()
        kept = super().compress_layer(obs, targets)
        if self.reuse > 1 and obs.layer_idx % self.reuse == 0:
            positions = obs.layer.head(0)[2]  # [b, n_kept]; every head keeps the same positions
            run.kept[obs.layer_idx] = [row[row >= 0] for row in positions]
        return kept
