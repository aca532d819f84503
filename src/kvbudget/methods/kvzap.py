"""KVzap: KVzip+'s scores predicted from the attention inputs by a small per-layer surrogate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbudget.errors import KVBudgetError, MethodOptionError
from kvbudget.methods.base import Method, RunState
from kvbudget.methods.kvzap_surrogate import KINDS, Surrogate, resolve_surrogate
from kvbudget.observation import Observation


@dataclass
class KVzapRun(RunState):
    """A run of :class:`KVzap`: the model's surrogate (``None``: no model bound)."""

    surrogate: Surrogate | None = None


@dataclass(frozen=True)
class KVzap(Method):
    """KVzap: prune the prompt by a surrogate of KVzip+'s scores, without KVzip's second pass.

    KVzip+ (:class:`~kvbudget.methods.kvzip_plus.KVzipPlus`) scores entry ``i`` of KV head ``h`` in
    layer ``l`` by a reconstruction pass over the context. KVzap (Jegou et al., arXiv:2601.07891)
    trains, per layer, a model ``f_l`` of the attention input ``x_i`` (the decoder layer's normalised
    hidden state at the entry's token, ``[hidden]``) that predicts ``log S[l, h, i]`` for every KV
    head at once; at inference ``score[l, h, i] = f_l(x_i)[h]`` costs one small matrix product per
    layer during the prefill. The surrogate (``linear`` ridge or ``mlp``, see
    :mod:`~kvbudget.methods.kvzap_surrogate`) is trained by ``kvbudget train kvzap`` on the
    registry's texts and stored per model; a model without one gets a linear surrogate fitted on
    the bundled prompts (with a warning).

    Two ways to keep (shapes: ``obs.attention_input [b, n, hidden]`` → scores ``[b, kv_heads, n]``):

    * at a budget (default): every KV head keeps its ``B`` best-scored entries (kvpress's
      ``KVzapPress`` at a compression ratio, a ``ScorerPress``);
    * ``threshold=T`` (the paper's inference, DMS): every entry scoring below ``T`` is evicted,
      whatever the budget, except the last ``threshold_window`` (128) — so each head keeps what its
      scores say and the row's compression ratio follows from the input (the result rows record the
      entries kept). A prompt the budget covers is still kept whole.

    Deviations: *ours* — the targets are kvbudget's KVzip+ scores (KVzip's chunked pass with its
    own request text after the chat template's prefix), not kvpress's single unchunked pass; the
    training texts are the registry's (essays, Austen, standard-library code), not Nemotron's
    pretraining sample; the prefill stage only (the paper also scores decoded tokens:
    :class:`~kvbudget.methods.kvzap_decoding.KVzapDecoding`).
    kvpress's ``KVzapPress`` loads its surrogates from a model hub by the model's name; its oracle
    (``tests/test_kvpress_oracle.py``) hands it the same local surrogate (the runner sets the model it
    would have downloaded) and both keep the same positions at a budget, for either kind (layer 0
    as the same tokens: there a repeated token's attention input, hence its score, ties).

    Args:
        kind: ``mlp`` (the paper's default) or ``linear``.
        surrogate: a surrogate file (``kvbudget train kvzap --out``); empty = the model's default file.
        threshold: ``None`` (keep the budget) or the log-score below which entries are evicted.
        threshold_window: recent entries the threshold never evicts (DMS's sliding window).
        window, sinks: recent and first entries always kept at a budget (0 and 0, as kvpress).
    """

    name: ClassVar[str] = "kvzap"
    paper: ClassVar[str] = "arXiv:2601.07891"
    summary: ClassVar[str] = (
        "KVzip+'s scores predicted from each token's attention input by a per-layer linear or MLP "
        "surrogate trained here (`kvbudget train kvzap`); per-head top-k, or a score threshold"
    )
    code: ClassVar[str] = "NVIDIA/kvpress"
    kvpress: ClassVar[str] = "KVzapPress"
    wants_attention_inputs: ClassVar[bool] = True
    small_options: ClassVar[dict[str, Any]] = {"kind": "linear"}
    fixed_allocation: ClassVar[str] = "each head keeps its budget, or what the threshold leaves"

    window: int = 0
    sinks: int = 0
    kind: str = "mlp"
    surrogate: str = ""
    threshold: float | None = None
    threshold_window: int = 128

    def validate(self) -> None:
        super().validate()
        if self.kind not in KINDS:
            raise MethodOptionError(f"kvzap: kind must be {' or '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.surrogate, str):
            raise MethodOptionError(f"kvzap: surrogate must be a path string, got {self.surrogate!r}")
        if self.threshold is not None and not isinstance(self.threshold, (int, float)):
            raise MethodOptionError(f"kvzap: threshold must be a number, got {self.threshold!r}")
        if not isinstance(self.threshold_window, int) or self.threshold_window < 0:
            raise MethodOptionError(
                f"kvzap: threshold_window must be an integer ≥ 0, got {self.threshold_window!r}"
            )

    def start(self, model: Any = None) -> KVzapRun:
        """A run with the model's surrogate bound."""
        if model is None:
            return KVzapRun()
        surrogate = resolve_surrogate(model, self.surrogate, self.kind)
        return KVzapRun(surrogate=surrogate.on(next(model.parameters()).device))

    def score(self, obs: Observation) -> torch.Tensor:
        surrogate = getattr(self.run_of(obs), "surrogate", None)
        if surrogate is None:
            raise KVBudgetError(
                "kvzap has no surrogate bound: start the run with the model, method.start(model) "
                "(kvbudget.generate, compress and the eval runner do)"
            )
        if obs.attention_input is None:
            raise KVBudgetError(
                "kvzap scores from the attention modules' inputs, which this prefill did not record: run it "
                "through kvbudget.generate, kvbudget.compress or a snapshot taken with attention_inputs=True"
            )
        return surrogate.predict(obs.layer_idx, obs.attention_input).transpose(1, 2)  # [b, kv_heads, n]

    def window_for(self, budget: int) -> int:
        """The threshold never evicts its last ``threshold_window``; a budget keeps ``window``."""
        return self.window if self.threshold is None else self.threshold_window

    def head_budgets(
        self, scores: torch.Tensor, layer_budget: int, protected: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """At a budget each head keeps ``layer_budget``; with a threshold, what scores at least it
        (and what is protected), whatever the budget."""
        if self.threshold is None:
            return super().head_budgets(scores, layer_budget, protected, valid)
        return ((protected | (scores >= self.threshold)) & valid).sum(-1).cpu()
