"""What one layer exposes to a method: queries, keys, values, positions, attention probabilities.

Everything costly is computed on demand and memoised: window probabilities are cheap
(``w × n``), full-attention column sums are computed in query chunks so memory stays
``O(n · chunk)``.

The probabilities are the attention the model computes: the queries are the ones its attention
received (after query norms and RoPE), Gemma 2's logit soft-capping applies (``layer.softcap``)
and a sliding-window layer's queries see only the keys inside their window
(``layer.sliding_window``, as :func:`kvbudget.masks.attention_mask_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvbudget.cache import BudgetLayer
from kvbudget.masks import attention_mask_for

#: queries per block of :meth:`Observation.column_sums` (its logits stay in the CPU cache)
QUERY_BLOCK = 64


@dataclass
class Observation:
    """A layer right after its attention ran, before it is compressed.

    Attributes:
        layer_idx: decoder layer index; num_layers: decoder layers of the model.
        query: ``[b, q_heads, q, d]`` post-RoPE queries of the tokens of this forward.
        layer: the layer's cache (rectangular during a prefill: ``keys: [b, kv_heads, n, d]``).
        scaling: the attention's softmax scale.
        run: the method's :class:`~kvbudget.methods.base.RunState` for this run (what the method
            learned so far; set by the compression session), or ``None`` outside a run.
        attention_input: ``[b, q, hidden]`` the attention module's input for the tokens of this
            forward (the decoder layer's normalised hidden states), for a method that asks for it
            (``Method.wants_attention_inputs``) during a prefill; else ``None``.
    """

    layer_idx: int
    num_layers: int
    query: torch.Tensor
    layer: BudgetLayer
    scaling: float
    _memo: dict = field(default_factory=dict, repr=False)
    run: Any = field(default=None, repr=False)
    attention_input: torch.Tensor | None = field(default=None, repr=False)

    @property
    def keys(self) -> torch.Tensor:
        """``[b, kv_heads, n, d]``."""
        return self.layer.keys

    @property
    def values(self) -> torch.Tensor:
        """``[b, kv_heads, n, d]``."""
        return self.layer.values

    @property
    def positions(self) -> torch.Tensor:
        """``[b, kv_heads, n]`` logical positions (``-1`` = invalid)."""
        return self.layer.positions

    @property
    def valid(self) -> torch.Tensor:
        """``[b, kv_heads, n]`` bool."""
        return self.layer.positions >= 0

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def group_size(self) -> int:
        return self.query.shape[1] // self.num_kv_heads

    @property
    def lengths(self) -> torch.Tensor:
        """Valid entries per batch row: ``[b]``."""
        return self.valid[:, 0].sum(-1)

    def window_probs(self, window: int) -> torch.Tensor:
        """Attention of the last ``window`` queries over all keys: ``[b, q_heads, w, n]`` (fp32).

        Causal inside the bottom-right ``w × w`` block; invalid keys get probability 0; the window
        keys stay in the normaliser.
        """
        w = min(window, self.query.shape[2])
        key = ("window", w)
        if key not in self._memo:
            self._memo[key] = self._probs(self.query[:, :, -w:], self.keys.shape[2])
        return self._memo[key]

    def window_keys(self, window: int) -> int:
        """How many trailing keys are the observation window's own tokens (the columns a window
        scorer leaves out of its candidates): ``min(window, q)``. A lookahead observation, whose
        rows include queries of tokens that are not in the cache, overrides it."""
        return min(window, self.query.shape[2])

    def last_row_probs(self) -> torch.Tensor:
        """Attention of the last query: ``[b, q_heads, n]`` (fp32)."""
        return self.window_probs(1)[:, :, 0]

    def column_sums(self, chunk: int = 512) -> torch.Tensor:
        """Attention received by each key, summed over all queries of this forward: ``[b, q_heads, n]``.

        Computed at most ``chunk`` queries at a time (in blocks of :data:`QUERY_BLOCK` queries, whose
        ``q_heads × block × n`` logits stay in the CPU cache), so the full ``q × n`` matrix never
        exists. Queries of invalid (pad) tokens contribute nothing.

        Fast paths (same values up to float rounding, see ``tests/test_observation.py``): one query
        over valid keys (a decode step) is one softmax row, no mask; a block whose keys are all
        valid masks only its causal bottom-right ``m × m`` triangle, in place.
        """
        q = self.query.shape[2]
        n = self.keys.shape[2]
        key = ("colsum", chunk, q)  # an observation of fewer queries of the same layer sums fewer rows
        if key in self._memo:
            return self._memo[key]
        if q == 1 and not self._has_invalid(n):  # a decode step: the last query sees every key
            total = self._probs(self.query, n, has_invalid=False)[:, :, 0]
            self._memo[key] = total
            return total
        total = torch.zeros(
            (self.query.shape[0], self.query.shape[1], n), dtype=torch.float32, device=self.keys.device
        )
        query_valid = self.positions[:, 0, n - q :] >= 0  # [b, q]
        weigh = not bool(query_valid.all())
        step = max(1, min(chunk, QUERY_BLOCK))
        for start in range(0, q, step):
            stop = min(start + step, q)
            # keys visible to queries start..stop-1: everything up to their own token
            visible = n - q + stop
            probs = self._probs(self.query[:, :, start:stop], visible)
            if weigh:
                probs = probs * query_valid[:, None, start:stop, None]
            total[:, :, :visible] += probs.sum(dim=2)
        self._memo[key] = total
        return total

    def _has_invalid(self, visible: int) -> bool:
        """Whether any of the first ``visible`` keys of any row and head is invalid."""
        return bool((self.positions[:, :, :visible] < 0).any())

    def scaled_logits(self, query: torch.Tensor, visible: int) -> torch.Tensor:
        """``scaling · query · keyᵀ`` over the first ``visible`` keys, fp32: ``query: [b, q_heads, m, d]``
        → ``[b, q_heads, m, visible]``. Each GQA group's queries are multiplied with their KV head's
        keys in one matmul (``[b, kv_heads, group·m, d] @ [b, kv_heads, d, visible]``), so the keys
        are never repeated per query head."""
        b, hq, m, d = query.shape
        heads = self.num_kv_heads
        keys = self.keys[:, :, :visible].float()
        grouped = query.float().reshape(b, heads, (hq // heads) * m, d)
        logits = torch.matmul(grouped, keys.transpose(-1, -2)).view(b, hq, m, visible)
        logits.mul_(self.scaling)
        softcap = self.layer.softcap
        if softcap is not None:  # Gemma 2: c · tanh(logits / c)
            logits.div_(softcap).tanh_().mul_(softcap)
        return logits

    def _probs(self, query: torch.Tensor, visible: int, has_invalid: bool | None = None) -> torch.Tensor:
        """Softmax (fp32) over the first ``visible`` keys of ``query: [b, q_heads, m, d]``.

        The queries are the tokens of keys ``visible - m .. visible - 1``: causal inside that block,
        invalid keys masked (an invalid query attends to itself only), and on a sliding-window layer
        the keys outside each query's window. ``has_invalid``: whether any of those keys is invalid,
        when the caller already knows.

        The logits come from :meth:`scaled_logits` and are masked in place.
        """
        m = query.shape[2]
        logits = self.scaled_logits(query, visible)
        window = self.layer.sliding_window
        invalid = self._has_invalid(visible) if has_invalid is None else has_invalid
        if invalid or window is not None:
            mask = attention_mask_for(self.positions[:, :, :visible], m, has_invalid=invalid, window=window)
            if mask.shape[1] > 1:
                mask = mask.repeat_interleave(self.group_size, dim=1)
            logits.masked_fill_(~mask, float("-inf"))
        elif m > 1:  # all keys valid: only the queries' own block is causal
            future = torch.ones((m, m), dtype=torch.bool, device=logits.device).triu_(1)
            logits[..., visible - m :].masked_fill_(future, float("-inf"))
        return torch.softmax(logits, dim=-1)


def reduce_group(scores: torch.Tensor, num_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """Reduce ``[b, q_heads, n]`` over each GQA group to ``[b, kv_heads, n]`` (``mean``/``max``/``sum``)."""
    b, hq, n = scores.shape
    grouped = scores.view(b, num_kv_heads, hq // num_kv_heads, n)
    if how == "mean":
        return grouped.mean(2)
    if how == "max":
        return grouped.amax(2)
    if how == "sum":
        return grouped.sum(2)
    raise ValueError(f"unknown GQA reduction '{how}': expected mean, max or sum")
