"""KVzap's surrogate: per layer, a small model from an entry's attention input to its KVzip+ score.

KVzap (arXiv:2601.07891, §3) replaces KVzip+'s reconstruction pass by a model of each layer's
attention input ``x_i`` (the decoder layer's normalised hidden state at the entry's token, the
input of ``q_proj``/``k_proj``/``v_proj``) that predicts ``log S[l, h, i]``, the entry's KVzip+
score in every KV head ``h`` (:class:`~kvbudget.methods.kvzip_plus.KVzipPlus`). Two kinds, as the
paper and its code: ``linear`` (ridge regression, one ``[kv_heads, hidden]`` map per layer) and
``mlp`` (``Linear(hidden, 512) → GELU → Linear(512, kv_heads)`` per layer, trained with AdamW on the
squared error).

This module holds the surrogate (:class:`Surrogate`), its file (safetensors, keyed by the model's
config hash like the profiles: :func:`default_surrogate_path`), the training pairs of one prompt
(:func:`kvzip_plus_pairs`: our KVzip+ scores of the prompt's context and the attention inputs of
its prefill), the two fits (:func:`fit_linear`, :func:`fit_mlp`) and the held-out rank
correlation (:func:`rank_correlation`). ``kvbudget train kvzap`` (:mod:`kvbudget.kvzap_training`)
builds a model's surrogate from the registry's texts; :func:`resolve_surrogate` finds the one a run
uses, or fits a linear one on the bundled prompts when the model has none (the tiny test models).
"""

from __future__ import annotations

import json
import math
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvbudget.errors import ProfileError
from kvbudget.methods.kvzip_plus import KVzipPlus
from kvbudget.prefill.record import hand_over, record_prefill
from kvbudget.profiles import config_hash, kvbudget_version

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from transformers import PreTrainedModel

KINDS = ("linear", "mlp")
#: the MLP's hidden width (the paper's and kvpress's)
MLP_WIDTH = 512
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → {(path, kind): Surrogate}


@dataclass
class Surrogate:
    """One model's surrogate: per layer, ``x: [..., hidden] → log KVzip+ score: [..., kv_heads]``.

    Attributes:
        kind: ``linear`` (``weight [L, kv, hidden]``, ``bias [L, kv]``) or ``mlp`` (``w1 [L, 512,
            hidden]``, ``b1 [L, 512]``, ``w2 [L, kv, 512]``, ``b2 [L, kv]``).
        tensors: the parameters above, fp32.
        meta: the model's config hash, the kvbudget version, and how it was trained (texts,
            tokens, seconds, held-out rank correlation per layer).
    """

    kind: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    _moved: dict[str, Surrogate] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return int(next(iter(self.tensors.values())).shape[0])

    def on(self, device: torch.device | str) -> Surrogate:
        """This surrogate with its parameters on ``device`` (moved once, then kept: a prefill on a GPU
        copies nothing per layer)."""
        device = torch.device(device)
        if all(t.device == device for t in self.tensors.values()):
            return self
        key = str(device)
        if key not in self._moved:
            self._moved[key] = Surrogate(
                self.kind, {k: v.to(device) for k, v in self.tensors.items()}, self.meta
            )
        return self._moved[key]

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``x: [..., hidden]`` → ``[..., kv_heads]`` predicted log scores (fp32, on ``x``'s device; never
        differentiated: a forward under autograd does not track them)."""
        t = {k: v[layer].to(x.device) for k, v in self.tensors.items()}  # a no-op once :meth:`on` moved them
        with torch.no_grad():
            x = x.float()
            if self.kind == "linear":
                return x @ t["weight"].T + t["bias"]
            return F.gelu(x @ t["w1"].T + t["b1"]) @ t["w2"].T + t["b2"]

    def check_model(self, model: PreTrainedModel, where: str) -> None:
        """Refuse a surrogate trained for another model (config hash), in one line."""
        expected = config_hash(model.config)
        if self.meta.get("config_hash") != expected:
            raise ProfileError(
                f"{where} was trained for another model (config hash "
                f"{str(self.meta.get('config_hash'))[:16]}, "
                f"this model's {expected[:16]}); train one with `kvbudget train kvzap --model ...`"
            )


# ---------------------------------------------------------------------------- files
def surrogates_dir() -> Path:
    """``$KVBUDGET_HOME/kvzap``."""
    from kvbudget.artifacts import kvbudget_home

    return kvbudget_home() / "kvzap"


def default_surrogate_path(model: PreTrainedModel, kind: str) -> Path:
    """Where ``kvbudget train kvzap`` saves and ``kvzap`` looks first:
    ``kvzap/<hash16>-<kind>.safetensors``."""
    return surrogates_dir() / f"{config_hash(model.config)[:16]}-{kind}.safetensors"


def trained_surrogate_path(model: PreTrainedModel, kind: str, who: str) -> Path:
    """``model``'s trained surrogate file of ``kind`` (:func:`default_surrogate_path`); refused in
    one line naming ``who`` when there is none, for runs that must not fall back to the bundled
    prompts' fit."""
    path = default_surrogate_path(model, kind)
    if not path.is_file():
        raise ProfileError(
            f"{who}: no trained {kind} KVzap surrogate for this model at {path}: "
            "run `kvbudget train kvzap --model ...` first"
        )
    return path


def save_surrogate(surrogate: Surrogate, path: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"kind": surrogate.kind, "meta": json.dumps(surrogate.meta)}
    save_file(
        {k: v.float().contiguous().cpu() for k, v in surrogate.tensors.items()}, str(path), metadata=meta
    )
    return path


def load_surrogate(path: str | Path, model: PreTrainedModel | None = None) -> Surrogate:
    """Read a surrogate file; with ``model``, also check it was trained for that model."""
    from safetensors import safe_open

    path = Path(path)
    where = f"KVzap surrogate {path}"
    if not path.is_file():
        raise ProfileError(f"{where} does not exist; run `kvbudget train kvzap --model ...` to create it")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        surrogate = Surrogate(meta.get("kind", ""), tensors, json.loads(meta.get("meta", "{}")))
    except (OSError, ValueError, json.JSONDecodeError) as err:
        raise ProfileError(f"cannot read {where}: {err}") from None
    needed = {"linear": {"weight", "bias"}, "mlp": {"w1", "b1", "w2", "b2"}}.get(surrogate.kind)
    if needed is None or set(tensors) != needed:
        raise ProfileError(
            f"{where} is not a KVzap surrogate (kind {surrogate.kind!r}, tensors {sorted(tensors)})"
        )
    if model is not None:
        surrogate.check_model(model, where)
    return surrogate


def resolve_surrogate(model: PreTrainedModel, path: str, kind: str) -> Surrogate:
    """The surrogate a run on ``model`` uses: ``path`` (checked against the model), else the model's
    default file (:func:`default_surrogate_path`), else one fitted now on the bundled prompts
    (:func:`builtin_surrogate`, with a warning). Memoised per model object."""
    memo = _MEMO.setdefault(model, {})
    key = (path, kind, config_hash(model.config))
    if key not in memo:
        if path:
            memo[key] = load_surrogate(path, model)
        elif default_surrogate_path(model, kind).is_file():
            memo[key] = load_surrogate(default_surrogate_path(model, kind), model)
        else:
            warnings.warn(
                f"no trained KVzap surrogate for this model ({default_surrogate_path(model, kind)}); kvzap "
                "uses a linear one fitted on the bundled prompts — run `kvbudget train kvzap --model ...`",
                stacklevel=3,
            )
            memo[key] = builtin_surrogate(model)
    return memo[key]


def builtin_surrogate(model: PreTrainedModel) -> Surrogate:
    """A linear surrogate fitted on the two bundled prompts (KVzip+ pairs of each), for a model
    without a trained one. Tokenised with the model's stored tokenizer, or the bytes folded into
    the vocabulary (the tiny test models), as the built-in profile."""
    from kvbudget.profile_prompts import BUILTIN_CODE, BUILTIN_TEXT
    from kvbudget.profiles import folded_prompt, local_tokenizer, prompt_from_spec

    tokenizer = local_tokenizer(model)
    if tokenizer is not None:
        prompts = [prompt_from_spec(f"builtin-{kind}:512", tokenizer) for kind in ("text", "code")]
    else:
        vocab = int(model.config.vocab_size)
        prompts = [folded_prompt(f"builtin-{kind}", text, kind, vocab) for kind, text in
                   (("text", BUILTIN_TEXT), ("code", BUILTIN_CODE))]  # fmt: skip
    xs, ys = zip(*(kvzip_plus_pairs(model, prompt.ids) for prompt in prompts), strict=True)
    surrogate = fit_linear(torch.cat(xs, dim=1), torch.cat(ys, dim=1))
    surrogate.meta = {"config_hash": config_hash(model.config), "kvbudget_version": kvbudget_version(),
                      "trained_on": "the bundled prompts (builtin-text, builtin-code)"}  # fmt: skip
    return surrogate


# ---------------------------------------------------------------------------- training pairs
@torch.inference_mode()
def kvzip_plus_pairs(
    model: PreTrainedModel, ids: Sequence[int], skip: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training pairs of one prompt: per layer, each context entry's attention input and its
    KVzip+ log score.

    ``ids`` is the compressed part of a prompt (the chat template's prefix, if any, then the
    context); it is prefilled with the full cache, each attention module's input is kept, and
    :class:`~kvbudget.methods.kvzip_plus.KVzipPlus`'s reconstruction pass scores every entry. The
    entries KVzip keeps whole (the template's prefix, its sinks) and the first ``skip`` are left out.

    Returns:
        ``x: [layers, m, hidden]`` fp32 and ``y: [layers, m, kv_heads]`` fp32 (``log S``), on the CPU.
    """
    method = KVzipPlus()
    layers = model.config.num_hidden_layers
    tensor = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    recording = record_prefill(model, tensor, attention_inputs=True)
    cache = hand_over(recording, method, model)  # the reconstruction reads the run's prompts from it
    scores, anchors = method.row_scores(model, cache, 0, tensor[0].cpu(), len(ids) - 1)
    first = max(anchors, skip)
    x = torch.stack([recording.attention_inputs[i][0, first:].float().cpu() for i in range(layers)])
    y = torch.stack([s[:, first:].T.float().cpu() for s in scores]).clamp_min(1e-30).log()
    return x, y


# ---------------------------------------------------------------------------- fits
def fit_linear(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> Surrogate:
    """Ridge regression per layer (``alpha`` on the weights, not the intercept; scikit-learn's
    ``Ridge()``, the paper's linear surrogate): ``x: [L, m, hidden]``, ``y: [L, m, kv]``, solved in fp64."""
    weights, biases = [], []
    for layer in range(x.shape[0]):
        xl, yl = x[layer].double(), y[layer].double()
        mx, my = xl.mean(0), yl.mean(0)
        xc, yc = xl - mx, yl - my
        gram = xc.T @ xc + alpha * torch.eye(xc.shape[1], dtype=torch.float64)
        w = torch.linalg.solve(gram, xc.T @ yc).T  # [kv, hidden]
        weights.append(w)
        biases.append(my - w @ mx)
    return Surrogate("linear", {"weight": torch.stack(weights).float(), "bias": torch.stack(biases).float()})


def fit_mlp(
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int = 15,
    lr: float = 5e-3,
    batch: int = 512,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> Surrogate:
    """Every layer's two-layer MLP trained at once (KVzap's code: AdamW at ``lr`` with its default
    weight decay, cosine decay over ``epochs``, the gradient norm of all layers clipped at 1, mean
    squared error, shuffled batches of ``batch`` tokens; ``nn.Linear``'s initialisation).

    ``x: [L, m, hidden]``, ``y: [L, m, kv]``; ``progress(epoch, loss)`` after each epoch.
    """
    layers, m, hidden = x.shape
    kv = y.shape[2]
    gen = torch.Generator().manual_seed(seed)

    def uniform(*shape: int, fan_in: int) -> torch.nn.Parameter:
        bound = 1.0 / math.sqrt(fan_in)
        return torch.nn.Parameter((torch.rand(*shape, generator=gen) * 2 - 1) * bound)

    params = {
        "w1": uniform(layers, MLP_WIDTH, hidden, fan_in=hidden),
        "b1": uniform(layers, MLP_WIDTH, fan_in=hidden),
        "w2": uniform(layers, kv, MLP_WIDTH, fan_in=MLP_WIDTH),
        "b2": uniform(layers, kv, fan_in=MLP_WIDTH),
    }
    optimizer = torch.optim.AdamW(params.values(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    x, y = x.float(), y.float()
    with torch.enable_grad():
        for epoch in range(epochs):
            order = torch.randperm(m, generator=gen)
            total = 0.0
            for start in range(0, m, batch):
                idx = order[start : start + batch]
                xb, yb = x[:, idx], y[:, idx]  # [L, B, hidden], [L, B, kv]
                h = F.gelu(torch.baddbmm(params["b1"][:, None], xb, params["w1"].transpose(1, 2)))
                pred = torch.baddbmm(params["b2"][:, None], h, params["w2"].transpose(1, 2))
                loss = F.mse_loss(pred, yb)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
                optimizer.step()
                total += float(loss.detach()) * idx.numel()
            schedule.step()
            if progress is not None:
                progress(epoch + 1, total / m)
    return Surrogate("mlp", {k: v.detach().clone() for k, v in params.items()})


def rank_correlation(surrogate: Surrogate, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Per layer, Spearman's rank correlation between the predicted and the true log scores over
    the tokens of ``x: [L, m, hidden]`` / ``y: [L, m, kv]``, averaged over the KV heads."""
    out = []
    for layer in range(x.shape[0]):
        pred = surrogate.predict(layer, x[layer])  # [m, kv]
        out.append(sum(_spearman(pred[:, h], y[layer, :, h]) for h in range(y.shape[2])) / y.shape[2])
    return out


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.double().argsort().argsort().double()
    rb = b.double().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / denom if denom > 0 else 0.0
