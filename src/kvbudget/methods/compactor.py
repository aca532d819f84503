"""Compactor: approximate leverage of the keys blended with non-causal chunked attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kvbudget.errors import KVBudgetError, MethodOptionError
from kvbudget.methods.leverage import Leverage, LeverageRun
from kvbudget.observation import Observation


def non_causal_column_sums(query: torch.Tensor, keys: torch.Tensor, chunk: int) -> torch.Tensor:
    """Attention each key receives inside its chunk, every query of the chunk seeing every key of it.

    ``query: [q_heads, m, d]`` and ``keys: [kv_heads, m, d]`` are the same ``m`` tokens (post-RoPE);
    the tokens are cut into consecutive chunks of ``chunk``, and within a chunk
    ``a_{t,i} = softmax_i(q_t · k_i)`` — unscaled logits, no causal mask — is summed over the chunk's
    queries ``t``. A last chunk of ``c < chunk`` tokens attends within itself, and each of its
    ``chunk − c`` missing queries adds ``1/chunk`` to each of its keys. Returns ``[q_heads, m]`` fp32.
    """
    heads, m, d = keys.shape
    group = query.shape[0] // heads
    sums = torch.zeros((heads, group, m), dtype=torch.float32, device=keys.device)
    grouped = query.float().reshape(heads, group, m, d)
    for start in range(0, m, chunk):
        stop = min(start + chunk, m)
        k = keys[:, start:stop].float()  # [h, c, d]
        logits = grouped[:, :, start:stop] @ k[:, None].transpose(-1, -2)  # [h, g, c, c]
        sums[:, :, start:stop] = torch.softmax(logits, dim=-1).sum(dim=2) + (chunk - (stop - start)) / chunk
    return sums.reshape(heads * group, m)


def zscore(x: torch.Tensor) -> torch.Tensor:
    """``(x − mean) / max(std, 1e-6)`` over every element of ``x`` (unbiased std); zeros for one element."""
    if x.numel() < 2:
        return torch.zeros_like(x)
    return (x - x.mean()) / x.std().clamp_min(1e-6)


@dataclass(frozen=True)
class Compactor(Leverage):
    """Compactor: blend the keys' approximate leverage with the attention they receive non-causally.

    Two query-agnostic z-scored signals per entry, over the candidate entries of a batch row (valid,
    not among the first ``sinks`` or the last ``window``, which are always kept):

    * ``L``: the approximate leverage of the pre-RoPE keys, exactly as :class:`Leverage` (centred
      over the candidates, sketch ``Φ`` of layer ``l`` from ``seed``, ridge ``λ``);
    * ``A``: non-causal chunked attention — the candidates are cut into consecutive chunks of
      ``chunk`` tokens; inside a chunk each query attends to every key of the chunk, earlier or later
      (``softmax(q·k)``, unscaled logits, post-RoPE), and each key sums what it receives; averaged
      over the GQA group, times ``‖v‖``, then averaged over each entry and its two neighbours
      (kernel 3, zero-padded at the ends, divided by 3).

    Each is z-scored over the row's heads and candidates (``(x − mean)/std``), and
    ``score = β·z(L) + z(A)``; each KV head keeps its top ``B``. ``β = blending``; a negative value
    (the default) takes the fraction of the row the layer evicts, ``1 − B_l/n`` (kvpress's default,
    its ``compression_ratio``). Unlike :class:`Leverage` it reads the prompt's queries, so it is a
    class of its own, not a setting of ``leverage``.

    Shapes: queries ``[b, q_heads, n, d]``, keys and values ``[b, kv_heads, n, d]``; ``L`` and ``A``
    ``[kv_heads, m]`` per row over its ``m`` candidates; scores ``[b, kv_heads, n]``.

    A last chunk shorter than ``chunk`` (``c`` tokens) attends within itself, and each of its
    ``chunk − c`` missing queries adds ``1/chunk`` to each of its keys, as the authors' kernel does
    (``vnchari/compactor-vllm``). Deviations from kvpress 0.5.5's ``CompactorPress`` (*code*),
    besides :class:`Leverage`'s: it pads the short chunk with zero vectors whose padding queries give
    the same ``1/chunk``, but it gives the padding keys a logit of −1e-9 rather than masking them, so
    the short chunk's real queries also pay the padding ``e^0`` each in their softmax; with unscaled
    logits this is small (the oracle of ``tests/test_kvpress_oracle.py`` keeps kvpress's positions
    with a short chunk of 32 and of 88). It z-scores over the whole batch; we per row. Against the
    authors' engine (*paper*): it blends with a fixed ``β = 0.5``, leaves out ``‖v‖`` and the
    pooling, and uses chunks of 128; we follow kvpress.

    Reference: Chari and Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
    Approximate Leverage Scores" (arXiv:2507.08143); the scores as kvpress 0.5.5's ``CompactorPress``
    computes them with ``LeverageScorePress`` and ``NonCausalAttnPress`` (written by the first author).

    Args:
        sinks: first entries always kept (8; kvpress's ``sink_size_start``). window: last entries
            always kept (4; its ``sink_size_end``).
        chunk: tokens per chunk of the non-causal attention (256).
        blending: ``β`` (−1: the layer's eviction fraction ``1 − B_l/n``).
        sketch, ridge, seed: the leverage's (48, 0.01, 0; see :class:`Leverage`).
        layer_alloc, head_alloc, beta, floor_alpha: the allocators (uniform by default).
    """

    name: ClassVar[str] = "compactor"
    summary: ClassVar[str] = (
        "z-scored approximate leverage of the keys, weighted by the eviction ratio, plus z-scored "
        "non-causal attention within 256-token chunks times ‖v‖; 8 sinks, window 4; question-agnostic"
    )
    kvpress: ClassVar[str] = "CompactorPress"
    #: for the tiny tests' prompts: several chunks per prompt, the last one short, and sinks that
    #: PyramidKV's schedule at a budget of 24 still leaves room for (its top layer keeps 7)
    small_options: ClassVar[dict[str, Any]] = {"chunk": 32, "sinks": 2}
    window: int = 4
    sinks: int = 8
    chunk: int = 256
    blending: float = -1.0

    def validate(self) -> None:
        super().validate()
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise MethodOptionError(f"{self.name}: chunk must be an integer ≥ 1, got {self.chunk!r}")
        if isinstance(self.blending, bool) or not isinstance(self.blending, (int, float)):
            raise MethodOptionError(f"{self.name}: blending must be a number, got {self.blending!r}")

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        run = self.run_of(obs)
        lengths = obs.lengths.tolist()
        blends = []
        for r, target in enumerate(targets):
            budget = (
                None
                if target is None
                else self.layer_budget(target, lengths[r], obs.layer_idx, obs.num_layers)
            )
            blends.append(0.0 if budget is None else 1.0 - budget / max(lengths[r], 1))
        run.blends = blends
        try:
            return super().compress_layer(obs, targets)
        finally:
            run.blends = None

    def blend_of(self, run: LeverageRun, row: int) -> float:
        """``β`` of batch row ``row``: the option, or the eviction fraction :meth:`compress_layer` set."""
        if self.blending >= 0:
            return float(self.blending)
        if run.blends is None:
            raise KVBudgetError(
                f"{self.name}: blending follows the layer's eviction fraction, known only while compactor "
                "compresses the layer itself; give blending=<weight> to score it otherwise"
            )
        return run.blends[row]

    def score(self, obs: Observation) -> torch.Tensor:
        n, q = obs.keys.shape[2], obs.query.shape[2]
        if q != n:
            raise KVBudgetError(
                f"{self.name}: the non-causal attention needs a query for every entry (a whole prefill); "
                f"got {q} queries for {n} entries"
            )
        run = self.run_of(obs)
        candidates = self.candidates(obs)
        scores = torch.zeros(obs.positions.shape, dtype=torch.float32, device=obs.keys.device)
        for r in range(scores.shape[0]):
            slots = candidates[r].nonzero().flatten()
            if not slots.numel():
                continue
            leverage = zscore(self.row_leverage(obs, r, slots))  # [h, m]
            sums = non_causal_column_sums(obs.query[r][:, slots], obs.keys[r][:, slots], self.chunk)
            heads = obs.num_kv_heads
            attention = sums.view(heads, -1, slots.numel()).mean(1)  # [h, m]
            attention = attention * obs.values[r][:, slots].float().norm(dim=-1)
            attention = F.avg_pool1d(attention[:, None], kernel_size=3, stride=1, padding=1)[:, 0]
            blended = self.blend_of(run, r) * leverage + zscore(attention.double())
            scores[r][:, slots] = blended.float()
        return scores
