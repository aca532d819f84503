"""KVzap while decoding too: every generated token scored by the surrogate, DMS's sliding window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.errors import KVBudgetError
from kvbudget.methods.kvzap import KVzap, KVzapRun
from kvbudget.observation import Observation
from kvbudget.phases import Stage
from kvbudget.selection import protected_mask, select_keep

#: the per-entry state holding each kept entry's predicted score (its token's hidden state is gone)
SCORE_STATE = "kvzap_score"


@dataclass
class KVzapDecodingRun(KVzapRun):
    """A run of :class:`KVzapDecoding`: also where the compressed prompt ended (the first slot of
    what is appended after it uncompressed, the question; ``None`` before the prefill)."""

    prompt_end: int | None = None


@dataclass(frozen=True)
class KVzapDecoding(KVzap):
    """KVzap in both stages, as the paper runs it: the prompt pruned at the prefill, then every
    token the model appends (the question, the generated tokens) scored by the same surrogate.

    Scores: ``score[l, h, i] = f_l(x_i)[h]`` as in :class:`~kvbudget.methods.kvzap.KVzap`, computed
    once, when entry ``i`` enters the cache (``x_i``: the attention module's input at that token,
    ``[b, q, hidden]``, for the prompt at the prefill and for each new token at its decode step),
    and kept as per-entry state (``layer.state["kvzap_score"]``, ``[b, kv_heads, n]``) for as long
    as the entry stays: no hidden state of an older token is needed again. Eviction while decoding
    (Jegou et al., arXiv:2601.07891, §3 "inference"; kvpress's ``DMSPress(KVzapPress(),
    decoding=True)``):

    * ``threshold=T``: an entry is evicted once it leaves the sliding window of the last
      ``threshold_window`` (128) entries of its row, if its score is below ``T``; the cache grows
      or shrinks with the input (the paper's adaptive mode).
    * the question appended after the compression (question-agnostic runs) is outside the budget
      and never evicted, in both modes (it is kvbudget's protocol, not a token the model produced);
    * at a budget (no threshold): every layer holds ``B`` entries per head plus what was appended
      after the compression, like KeyDiff or H2O's decode stage; each step the lowest-scored entry
      outside the sliding window (``min(threshold_window, B)`` newest) leaves.

    Deviations: *ours* — the budget mode while decoding (the paper decodes by threshold only) and
    the window capped at the budget there. kvpress's ``DMSPress`` masks evicted entries (AdaKV's
    fake keys) and frees nothing; here they leave the cache.

    Args: as :class:`~kvbudget.methods.kvzap.KVzap`.
    """

    name: ClassVar[str] = "kvzap-decoding"
    summary: ClassVar[str] = (
        "KVzap at the prefill and while decoding: each new token scored by the surrogate when it "
        "enters, evicted once it leaves a 128-entry sliding window (by threshold, or held at the budget)"
    )
    kvpress: ClassVar[str] = "DMSPress"
    stages: ClassVar[tuple[Stage, ...]] = (Stage.PREFILL, Stage.DECODE)

    def start(self, model: Any = None) -> KVzapDecodingRun:
        return KVzapDecodingRun(surrogate=super().start(model).surrogate)

    def compress_layer(self, obs: Observation, targets: list[int | None]) -> torch.Tensor:
        self.run_of(obs).prompt_end = obs.layer.seen
        return super().compress_layer(obs, targets)

    def observe(self, obs: Observation) -> None:
        """Score the entries this forward appended (the last ``q`` of every row and head) into the state."""
        if obs.attention_input is None:
            raise KVBudgetError(
                f"{self.name} scores every appended token from its attention input, which this forward did "
                "not record: run it through kvbudget.generate, compress or the eval runner"
            )
        new = super().score(obs).float()  # [b, kv_heads, q]
        layer = obs.layer
        layer.init_state(SCORE_STATE)
        q = new.shape[-1]
        state = layer.state[SCORE_STATE]  # the forward appended q zeros last (a new tensor: a copy of the
        # layer may share the old one, so it is replaced rather than written)
        if layer.is_ragged:  # one [b, n_h] tensor per head
            layer.state[SCORE_STATE] = [
                torch.cat([s[:, : s.shape[1] - q], new[:, h]], 1) for h, s in enumerate(state)
            ]
        else:  # [b, kv_heads, n]
            layer.state[SCORE_STATE] = torch.cat([state[..., : state.shape[-1] - q], new], -1)

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.layer.state[SCORE_STATE]

    def decode_step(self, obs: Observation, row_budgets: list[int]) -> None:
        """Score the appended tokens, then evict per KV head (the heads may hold different counts)."""
        self.observe(obs)
        layer = obs.layer
        run = self.run_of(obs)
        start = run.prompt_end if isinstance(run, KVzapDecodingRun) and run.prompt_end is not None else 0
        keep: list[list[torch.Tensor]] = [[] for _ in row_budgets]
        evicts = False
        for h in range(layer.num_heads):
            positions = layer.head(h)[2][:, None]  # [b, 1, n_h]
            scores = layer.head_state(SCORE_STATE, h)[:, None]
            valid = positions >= 0
            lengths = valid.sum(-1).cpu()  # [b, 1]
            budgets = lengths.clone()
            protected = torch.zeros_like(valid)
            for r, budget in enumerate(row_budgets):
                appended = (positions[r] >= start) & (positions[r] < start + run.appended_to(r))
                if self.threshold is not None:
                    protected[r] = protected_mask(positions[r : r + 1], self.threshold_window, self.sinks)[0]
                    protected[r] |= appended
                    budgets[r] = ((protected[r] | (scores[r] >= self.threshold)) & valid[r]).sum(-1).cpu()
                elif int(lengths[r]) > budget:
                    window = min(self.threshold_window, budget)
                    protected[r] = protected_mask(positions[r : r + 1], window, self.sinks)[0] | appended
                    budgets[r] = budget
            evicts = evicts or bool((budgets < lengths).any())
            for r, kept in enumerate(select_keep(scores, budgets, valid, protected)):
                keep[r].append(kept[0])
        if evicts:
            layer.keep(keep)
