"""CAKE: cascading and adaptive KV-cache eviction with layer preferences."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, ClassVar

import torch

from kvbudget.allocation import cake_preference
from kvbudget.errors import MethodOptionError, UnknownMethodError
from kvbudget.methods.layerwise import LayerwiseMethod, LayerwiseRun, pool_candidates
from kvbudget.observation import Observation, reduce_group
from kvbudget.phases import Stage
from kvbudget.scoring import pool_keys
from kvbudget.selection import protected_mask, record_ranks, select_keep

#: The CAKE authors' per-model temperatures (antgroup/cakekv,
#: ``experiments/LongBench/config/model2tau.json``): checkpoint (the folder names of their
#: ``model2path.json``) → budget ``B`` per head, window included (their ``--cache_size``) →
#: ``(τ1, τ2)``. Their ``pred_cake.py`` falls back to ``τ1 = τ2 = 1`` for any other model or budget.
AUTHORS_TAU: dict[str, dict[int, tuple[float, float]]] = {
    "Llama-2-7b-chat-hf": {128: (0.9, 2.3), 1024: (1.9, 1.8)},
    "Llama-2-13b-chat-hf": {128: (1.8, 2.0), 1024: (0.5, 0.4)},
    "Meta-Llama-3.1-8B-Instruct": {128: (1.6, 0.6), 1024: (1.6, 0.4)},
    "Mistral-7B-Instruct-v0.3": {128: (1.0, 0.8), 1024: (0.8, 0.5)},
    "Qwen2.5-7B-Instruct": {128: (0.4, 0.6), 1024: (1.5, 0.6)},
}

#: other names of an :data:`AUTHORS_TAU` checkpoint: the hub renamed
#: ``meta-llama/Meta-Llama-3.1-8B-Instruct`` to ``meta-llama/Llama-3.1-8B-Instruct``
AUTHORS_TAU_ALIASES: dict[str, str] = {"Llama-3.1-8B-Instruct": "Meta-Llama-3.1-8B-Instruct"}


def authors_checkpoint(name_or_path: str) -> str | None:
    """The :data:`AUTHORS_TAU` checkpoint a model's ``name_or_path`` names, or ``None``.

    A path component equal to a listed checkpoint or one of its :data:`AUTHORS_TAU_ALIASES`
    (case-insensitive) names it — a hub id ``Qwen/Qwen2.5-7B-Instruct``, a local
    ``/models/Qwen2.5-7B-Instruct``, or a hub cache folder ``models--Qwen--Qwen2.5-7B-Instruct``
    (or a path below it). Other checkpoints of a family (base models, other sizes, quantised
    copies) and kvbudget's own models (``smollm2-135m``, ``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``)
    are not listed.
    """
    listed = {name.lower(): name for name in AUTHORS_TAU}
    listed.update({alias.lower(): name for alias, name in AUTHORS_TAU_ALIASES.items()})
    for part in PurePath(str(name_or_path)).parts:
        for candidate in (part, part.split("--")[-1]):
            if candidate.lower() in listed:
                return listed[candidate.lower()]
    return None


@dataclass
class CAKERun(LayerwiseRun):
    """A CAKE run: the cascade's plan, the prefill's targets (a row's budget picks its
    temperatures), and the authors' temperatures for the model (``None``: no model bound)."""

    targets: list[int | None] = field(default_factory=list)
    authors_taus: dict[int, tuple[float, float]] | None = None
    authors_checkpoint: str | None = None


@dataclass(frozen=True)
class CAKE(LayerwiseMethod):
    """CAKE: layer budgets from each layer's attention dispersion and shift, decided while prefilling.

    With ``A`` the window attention (last ``w`` prompt queries, softmax over all keys, all query
    heads) on the ``L − w`` non-window keys:

    * **Preference** ``P_l = H_l^(1/τ1) · V_l^(1/τ2)``, ``H_l = −Σ A log(A + 1e-10)`` summed over
      heads, rows and columns, ``V_l = Σ_{heads, columns} var_rows(A)`` (unbiased).
    * **Eviction score** per key: ``mean_rows(A) + γ·var_rows(A)`` per query head, avgpool 5 over the
      non-window keys, mean over each GQA group; each head keeps its top ``B_l`` plus the window.
    * **Cascading budgets**: after each prefilled layer ``l``, ``B_i = P_i / Σ_{j≤l} P_j · T`` for all
      ``i ≤ l`` with ``T = (B − w)·layers`` entries per head, capped at ``L − w`` with the excess
      spread over the uncapped layers, integerised by largest remainder so they sum to exactly
      ``T``, never above a layer's previous budget; earlier layers are re-evicted from their stored
      scores, so at most one layer holds its full cache.
    * **Decode**: after every generated token each layer is trimmed back to ``B_l + w`` by the
      current query's attention (avgpool 5 over the non-window entries, GQA mean); the last ``w``
      entries are kept. Rows whose prompt fitted the budget are trimmed to the budget.

    Differences from the authors' code (antgroup/cakekv): budgets are rounded by largest remainder
    within the caps (the code truncates, spreads the excess evenly and fixes the sum on the first
    layers); scores are computed in fp32 whatever the model dtype; a prompt is compressed whenever
    it is longer than the budget (the code skips prompts up to ``B + w`` long); entropy and variance
    are per batch row (the code sums them over the batch); pooling at decode runs over each row's
    candidates only (identical for a batch of one).

    **Decode pooling by position** (our choice): at decode time we pool each entry with its
    neighbours in token order (the cache keeps entries sorted by position). The authors' code
    pools neighbours in *storage* order, which is score order: its eviction gathers the ``topk``
    indices unsorted (``cake/cake_cache.py``, ``CakeprefillKVCache.evcit_layer_kvcache`` at the
    prefill and ``CakeDecodingKVCache_LayerWise.__call__``, whose ``indices.sort()`` is commented
    out right after the ``topk``), and its ``avg_pool1d`` then smooths over entries adjacent in
    that order — neighbours in score, not in the text. Pooling smooths over nearby tokens
    (SnapKV's rationale), so we keep the positional order.

    **Temperatures**: ``tau1``/``tau2`` default to 1, the paper's default. With ``authors_tau``
    the authors' per-model values (:data:`AUTHORS_TAU`, from their ``model2tau.json``) replace them
    when the model is listed and the row's budget is one they tuned (128 or 1024); otherwise
    ``tau1``/``tau2`` stay (their ``pred_cake.py`` falls back to 1, 1 there, and never reads its
    ``--tau1``/``--tau2`` flags; ours keeps the options in force). The model is named by its
    config's ``name_or_path`` (:func:`authors_checkpoint`), bound by :meth:`start`. Listed:
    Llama-2-7b/13b-chat, Llama-3.1-8B-Instruct, Mistral-7B-Instruct-v0.3, Qwen2.5-7B-Instruct.

    Reference: Qin et al., "CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences",
    ICLR 2025 (openreview EQgEMAD4kv).

    Args:
        window: observation window, always kept (32; at least 2 for the variance).
        kernel: pooling kernel (5). pooling: ``avg`` (default) or ``max``.
        gamma: weight of the variance in the eviction score (200).
        tau1, tau2: temperatures of the entropy and the variance in the preference (1, 1).
        authors_tau: use the authors' per-model ``(τ1, τ2)`` where they publish them (False).
    """

    name: ClassVar[str] = "cake"
    paper: ClassVar[str] = "Qin et al., ICLR 2025, openreview EQgEMAD4kv"
    summary: ClassVar[str] = (
        "layer preference from attention entropy and variance; mean + γ·variance eviction"
    )
    code: ClassVar[str] = "antgroup/cakekv"
    small_options: ClassVar[dict[str, Any]] = {"window": 4}
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL, Stage.DECODE)
    cascading: ClassVar[bool] = True
    fixed_allocation: ClassVar[str] = "CAKE's layer budgets are its cascading preference split"
    state_name = "cake_score"

    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    gamma: float = 200.0
    tau1: float = 1.0
    tau2: float = 1.0
    authors_tau: bool = False

    def validate(self) -> None:
        super().validate()
        if self.window < 2:
            raise MethodOptionError(
                f"cake: window must be ≥ 2 (variance over the window rows), got {self.window}"
            )
        if not self.gamma >= 0.0:
            raise MethodOptionError(f"cake: gamma must be ≥ 0, got {self.gamma}")
        for name in ("tau1", "tau2"):
            if not getattr(self, name) > 0.0:
                raise MethodOptionError(f"cake: {name} must be > 0, got {getattr(self, name)}")

    # ------------------------------------------------------------------ temperatures
    def start(self, model: Any = None) -> CAKERun:
        """A run with the model's entry of :data:`AUTHORS_TAU` bound (``authors_tau`` only)."""
        if model is None:
            return CAKERun()
        config = getattr(model, "config", None)
        name = getattr(config, "_name_or_path", "") or getattr(model, "name_or_path", "") or ""
        checkpoint = authors_checkpoint(name)
        return CAKERun(authors_taus=AUTHORS_TAU.get(checkpoint, {}) if checkpoint else {},
                       authors_checkpoint=checkpoint)  # fmt: skip

    def taus(self, run: CAKERun, budget: int) -> tuple[float, float]:
        """``(τ1, τ2)`` for a row whose budget is ``budget`` (entries per head, window included)."""
        if not self.authors_tau:
            return self.tau1, self.tau2
        if run.authors_taus is None:
            raise UnknownMethodError(
                "cake: authors_tau needs the model's name: start the run with the model, "
                "method.start(model) (kvbudget.generate, compress and the eval runner do)"
            )
        return run.authors_taus.get(int(budget), (self.tau1, self.tau2))

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        self.run_of(obs).targets = list(targets)
        return super().compress_layer(obs, targets)

    def score(self, obs: Observation) -> torch.Tensor:
        probs = obs.window_probs(self.window)  # [b, hq, rows, n]
        w, n = obs.window_keys(self.window), probs.shape[3]
        stat = probs.mean(2) + self.gamma * probs.var(2, unbiased=True)
        pooled = torch.zeros_like(stat)
        pooled[..., : n - w] = pool_keys(stat[..., : n - w], self.kernel, self.pooling)
        return reduce_group(pooled, obs.num_kv_heads, "mean")

    # ------------------------------------------------------------------ budgets
    def model_total(self, target: int, protected: int, num_layers: int, num_heads: int) -> int:
        return (target - protected) * num_layers

    def layer_capacity(self, candidates: torch.Tensor) -> int:
        return int(candidates.sum(-1).min())

    def layer_weight(
        self, obs: Observation, scores: torch.Tensor, row: int, candidates: torch.Tensor
    ) -> float:
        columns = candidates[0].nonzero().flatten()  # the prefill layout: the same keys in every head
        probs = obs.window_probs(self.window)[row][:, :, columns]  # [hq, w, L − w]
        run = self.run_of(obs)
        return cake_preference(probs, *self.taus(run, run.targets[row]))

    def selection_order(self) -> str | None:
        return "head"  # every head keeps its own top ``total``: a prefix of its order

    def split(
        self, scores: torch.Tensor, candidates: torch.Tensor, total: int, bounds: torch.Tensor
    ) -> torch.Tensor:
        return torch.clamp(bounds.long(), max=int(total))

    # ------------------------------------------------------------------ decode
    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        lengths = obs.layer.head_lengths().cpu()  # [b, h]
        limits = []
        run = self.run_of(obs)
        for r, budget in enumerate(row_budgets):
            planned = self.row_budget(run, r, obs.layer_idx)
            limits.append(budget if planned is None else planned + run.appended_to(r))
        if all(int(lengths[r].max()) <= limit for r, limit in enumerate(limits)):
            return
        valid = obs.valid
        protected = torch.zeros_like(valid)
        budgets = lengths.clone()
        for r, limit in enumerate(limits):
            if int(lengths[r].max()) > limit:
                protected[r] = protected_mask(obs.positions[r : r + 1], self.window, self.sinks)[0]
                budgets[r] = limit
        candidates = (valid & ~protected).repeat_interleave(obs.group_size, dim=1)
        pooled = pool_candidates(obs.last_row_probs(), candidates, self.kernel, self.pooling)
        scores = reduce_group(pooled, obs.num_kv_heads, "mean")
        record_ranks(obs.layer, scores, protected)
        obs.layer.keep(select_keep(scores, budgets, valid, protected))
