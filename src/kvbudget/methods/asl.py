"""ASL: adaptive selection layer for layer-wise token pruning (one pass, full-KV and two-pass)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbudget.errors import MethodOptionError
from kvbudget.methods.prune_base import PruneMethod, PruneRun, context_slots, top_slots, window_slots
from kvbudget.observation import Observation
from kvbudget.scoring import pool_keys, window_scores


def token_scores(obs: Observation, window: int, kernel: int) -> torch.Tensor:
    """ASL's pooled window attention summed over all heads: ``[b, n]`` (paper §4.1's formula; the authors'
    ``sum_attn_cache``). Alg. 1 line 6 sums only within each GQA group; the token ranks need one
    order over all heads, which §4.1's formula and the authors' code take.

    Attention of the last ``window`` queries (softmax over all keys, causal in the window block),
    summed over the window rows, average-pooled along the keys (kernel ``kernel``, zero padding),
    summed over every query head. The window's own columns are 0.
    """
    probs = obs.window_probs(window)  # [b, hq, w, n]
    w, n = probs.shape[2], probs.shape[3]
    rows = probs.sum(2)  # [b, hq, n]
    pooled = pool_keys(rows[..., : n - w], kernel, "avg")
    scores = torch.zeros(rows.shape[0], n, dtype=torch.float32, device=rows.device)
    scores[:, : n - w] = pooled.sum(1)
    return scores


def ranks_desc(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each entry of ``scores: [m]`` by descending score, 1 = best; ties to the earlier entry."""
    order = torch.sort(scores.float(), descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(1, order.numel() + 1, device=order.device)
    return ranks


def rank_variance(ranks: torch.Tensor, k: int) -> float:
    """``var_top`` of the paper (§4.1, Alg. 2 lines 4–8) for ``ranks: [layers, T]``.

    U = union over the layers of each layer's ``k`` best tokens (smallest ranks); the result is the
    mean over ``j ∈ U`` of the population variance over layers of ``ranks[:, j]``.
    """
    k = min(k, ranks.shape[1])
    if k <= 0:
        return 0.0
    best = torch.topk(-ranks, k, dim=1).indices  # [layers, k]
    union = torch.unique(best.flatten())
    chosen = ranks[:, union].double()
    return float(chosen.var(dim=0, unbiased=False).mean())


@dataclass
class ASLRun(PruneRun):
    """An ASL run: per batch row the token ranks of the last ``l_obs`` layers, the first tested
    layer's rank variance, every tested layer's relative variance (for inspection and plots), and
    the rows where no layer met ``tau`` and the 2-pass variant selected at the last layer."""

    rank_cache: list[list[torch.Tensor]] = field(default_factory=list)
    initial_variance: list[float | None] = field(default_factory=list)
    relative_variances: list[list[tuple[int, float]]] = field(default_factory=list)
    fallback_rows: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class ASL(PruneMethod):
    """ASL: pick the selection layer where attention ranks stop moving, then prune (one pass).

    From layer ``l_min`` on, each layer's context tokens are ranked by their pooled window attention
    summed over all heads (:func:`token_scores`). With ``X`` the ranks of the last ``l_obs`` layers
    and ``U`` the union of their top ``k − w`` tokens, ``var = mean_{j∈U} var_layers(X[:, j])``; the
    variance at ``l_min`` is ``V0``. The first layer with ``var / V0 < tau`` is the selection layer:
    its top ``k − w`` tokens plus the window are kept (sorted), the cut happens after the layer's
    attention and MLP, and deeper layers run on those tokens at their original positions. Layers
    whose cache exceeds the budget are compressed with SnapKV (window ``window``, average pooling
    ``kernel``, sum over each GQA group, per-KV-head top-k), so every layer's cache is ``k`` (the
    paper's ASL + SnapKV one-pass setting). If no layer qualifies nothing is cut, and every layer
    still holds ``k`` through that SnapKV compression — as in the authors' code, where
    ``customized_cache.py`` ``prefilling_score_update`` returns ``compress_kv``'s per-head indices
    at every layer whether or not a selection layer was found.

    Reference: Taniguchi et al., "Adaptive Layer Selection for Layer-Wise Token Pruning in LLM
    Inference" (ASL), §4, Algorithms 1–2, §5 "Methods" and App. C.2. Repo: TANIGUCHIREI/ASL
    (``baseline/asl/customized_cache.py``: ``sum_attn_cache``, ``selecting_select_layer``,
    ``compress_kv``; ``adaptive_select_layer_utils.py``: ``relative_normalized_variance``).

    Args:
        tau: relative-variance threshold (0.3, §5). l_min: first layer tested (-1 → ``layers // 3``:
            10 of 32 for Llama-3.1-8B and 9 of 28 for Qwen2.5-7B, the paper's §5 values).
        l_obs: layers whose ranks form ``X`` (8, §5; ``use_layer_num=8`` in the authors' scripts).
        window: observation window, always kept (32, App. C.2). kernel: average-pooling kernel
            (7, App. C.2; the authors' scripts run ``pooling=avgpool``).

    GQA: the token score sums the pooled attention over every query head (the authors'
    ``sum_attn_cache`` sums each GQA group, then the KV heads); the SnapKV cache compression sums
    each group and keeps a top-k per KV head (their ``compress_kv``). Average pooling divides by
    the kernel with zero padding (``F.avg_pool1d``'s default, as theirs).

    Choices where the paper is silent: ranks are computed from layer ``max(0, l_min − l_obs + 1)``
    so ``X`` has ``l_obs`` layers at ``l_min`` (fewer in models with few layers; the authors' code
    indexes layer ``l_min − l_obs + 1`` and fails below 0); ``V0 = 0`` (ranks identical across
    those layers) counts as relative variance 0 at later layers when their variance is 0, else
    infinity (the authors' code divides by it). Ties in scores go to the earlier token (theirs:
    ``torch.argsort`` / ``topk`` order). In a batch each row selects its own layer from its own
    tokens (the authors' code runs batch size 1).
    """

    name: ClassVar[str] = "asl"
    paper: ClassVar[str] = "ASL (Taniguchi et al.), github.com/TANIGUCHIREI/ASL"
    summary: ClassVar[str] = (
        "adaptive selection layer: where attention ranks stop moving (relative rank variance < τ), "
        "keep the top `k` tokens for all deeper layers; SnapKV before"
    )
    code: ClassVar[str] = "TANIGUCHIREI/ASL"
    #: tau > 1 selects at l_min (relative variance 1 there): the tiny tests really prune
    small_options: ClassVar[dict[str, Any]] = {"window": 4, "kernel": 3, "tau": 1.5}
    window: int = 32
    kernel: int = 7
    tau: float = 0.3
    l_min: int = -1
    l_obs: int = 8

    def validate(self) -> None:
        super().validate()
        if not (isinstance(self.tau, (int, float)) and self.tau > 0):
            raise MethodOptionError(f"{self.name}: tau must be > 0, got {self.tau!r}")
        if not isinstance(self.l_obs, int) or self.l_obs < 1:
            raise MethodOptionError(f"{self.name}: l_obs must be an integer ≥ 1, got {self.l_obs!r}")
        if not isinstance(self.l_min, int) or self.l_min < -1:
            raise MethodOptionError(
                f"{self.name}: l_min must be ≥ 0 (or -1 for layers // 3), got {self.l_min!r}"
            )

    def first_tested_layer(self, num_layers: int) -> int:
        """``L_min`` (``layers // 3`` by default), clamped to the model's last layer."""
        return min(num_layers // 3 if self.l_min < 0 else self.l_min, num_layers - 1)

    def start(self, model: object = None) -> ASLRun:
        return ASLRun()

    def begin_prune(self, run: ASLRun, batch_size: int, num_layers: int) -> None:
        super().begin_prune(run, batch_size, num_layers)
        run.rank_cache = [[] for _ in range(batch_size)]
        run.initial_variance = [None] * batch_size
        run.relative_variances = [[] for _ in range(batch_size)]
        run.fallback_rows = set()

    def score(self, obs: Observation) -> torch.Tensor:
        """SnapKV scores for the cache compression before the selection layer: ``[b, kv_heads, n]``."""
        return window_scores(obs, self.window, self.kernel, "avg", "sum", "sum")

    def observe_layer(self, obs: Observation, targets: list[int | None]) -> None:
        layer = obs.layer_idx
        l_min = self.first_tested_layer(obs.num_layers)
        if layer < l_min - self.l_obs + 1:
            return
        run = self.run_of(obs)
        rows = [r for r, t in enumerate(targets) if t is not None and r not in run.selected]
        if not rows:
            return
        scores = token_scores(obs, self.window, self.kernel)
        for r in rows:
            context = context_slots(obs, r, self.window)
            row_scores = scores[r, context]
            cache = run.rank_cache[r]
            cache.append(ranks_desc(row_scores))
            del cache[: -self.l_obs]
            if layer < l_min:
                continue
            k = targets[r] - self.window
            var = rank_variance(torch.stack(cache), k)
            relative = self._relative(run, r, var)
            run.relative_variances[r].append((layer, relative))
            fallback = self.two_pass and relative >= self.tau and layer == obs.num_layers - 1
            if relative < self.tau or fallback:
                if fallback:
                    run.fallback_rows.add(r)
                keep = top_slots(row_scores, context, k)
                run.request_cut(r, layer, torch.cat([keep, window_slots(obs, r, self.window)]))
                run.rank_cache[r] = []  # released (Alg. 2 line 12)

    def _relative(self, run: ASLRun, row: int, var: float) -> float:
        v0 = run.initial_variance[row]
        if v0 is None:
            run.initial_variance[row] = var
            return 1.0
        if v0 == 0.0:
            return 0.0 if var == 0.0 else float("inf")
        return var / v0


@dataclass(frozen=True)
class ASLFullKV(ASL):
    """ASL with the full cache before the selection layer (the paper's "Full (before selection) &
    k (after selection)" rows): no SnapKV compression; layers up to the selection layer keep every
    token, deeper layers the ``k`` selected ones.

    If no layer is selected the cache stays full at every layer. This follows the authors' code:
    without ``cache_k`` their ``compress_kv`` (``customized_cache.py``) returns ``None``, so
    ``update`` stores every token, and ``selecting_select_layer`` never sets ``select_idx``, so
    the decoder layers never cut; no fallback selection exists in their one-pass path. Reports
    should read such rows as full-cache runs (``selection_layer`` is ``None``).
    """

    name: ClassVar[str] = "asl-fullkv"
    summary: ClassVar[str] = "ASL with the full cache before the selection layer"
    exceeds_budget: ClassVar[bool] = True
    compress_cache: ClassVar[bool] = False


@dataclass(frozen=True)
class ASL2Pass(ASL):
    """ASL with GemFilter's two passes: pass 1 runs until ASL's selection layer (full attention,
    its cache discarded); pass 2 runs the whole model on the selected tokens with re-indexed
    positions ``0..k−1``, so every layer's cache is ``k``.

    If no layer meets ``tau``, pass 1 reaches the last layer and selects there with the same
    score: its top ``k − w`` tokens plus the window (the row is listed in ``fallback_rows`` and
    its selection layer is the last one). This is the authors' code: in
    ``baseline/gemfilter/gemfilter_utils.py`` ``get_layer_context_asl``, when ``select_idx`` is
    unset, the tokens are the top-k of ``prefilling_score_cache[gemfilter_select_layer]`` (the
    ranks of the last layer pass 1 ran, set per layer in ``llama_hijack_4_45.py``) plus the
    window indices, and the second pass runs on them.
    """

    name: ClassVar[str] = "asl-2pass"
    summary: ClassVar[str] = "ASL with a second pass over the selected tokens"
    two_pass: ClassVar[bool] = True
