"""Offline importance profiles for BaKlaVa and SqueezeAttention, stored as plain JSON.

A profile is measured once per model from one or more prompts (BaKlaVa's Algorithm 1):

* **head similarity** — for every query head, the token-wise cosine similarity between the head's
  value input ``V`` (its KV head's values) and its output ``softmax(QKᵀ)V`` (the input of
  ``o_proj``), averaged over the prompt's tokens and mapped from ``[−1, 1]`` to ``[0, 1]``;
* **KV-cache importance** — ``1 −`` the mean head similarity over each GQA group (Alg. 1, step 2);
* **layer similarity** (SqueezeAttention) — the token-mean cosine similarity between a decoder
  layer's residual input and ``input + attention output`` (the residual after attention);
* **query filters** (Q-Filters) — per layer and KV head, the principal direction of the
  post-RoPE queries the model really uses (:func:`query_directions`).

With several prompts every value is the plain mean over the prompts (each prompt weighs the same;
the paper does not say how it combines prompts); the per-prompt values are kept too, so the
consistency between prompts can be checked from the file. Values are rounded to 6 decimals, and
the file holds no timestamps, so the same prompts give byte-identical JSON.

Capture uses forward hooks on ``v_proj`` (output), ``o_proj`` (input), each decoder layer (input)
and its ``self_attn`` (output), removed after the forward — no patching, any attention backend.
The queries for the filters come from a second forward through kvbudget's own attention
(:func:`capture_queries`), which hands over each layer's queries after the model's norms and RoPE.

A profile records the model's config hash (:func:`config_hash`); :func:`load_profile` refuses a
profile made for another model, and any corrupted or malformed file, with a :class:`ProfileError`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from kvbudget.errors import InputError, ProfileError
from kvbudget.phases import Phase
from kvbudget.version import __version__

FORMAT = "kvbudget-profile"
FORMAT_VERSION = 1
DECIMALS = 6

#: configuration keys that define a model's architecture and vocabulary (what a profile depends on)
_CONFIG_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta",
    "rope_scaling", "rope_parameters", "rms_norm_eps", "hidden_act", "attention_bias",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "sliding_window",
)  # fmt: skip


def config_hash(config: Any) -> str:
    """sha256 of the architecture-defining keys of a transformers config (dtype and attention
    backend excluded, so a bf16 or attached model keeps its hash)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    picked = {key: data.get(key) for key in _CONFIG_KEYS}
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()


def kvbudget_version() -> str:
    return __version__


# ---------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class ProfilePrompt:
    """One profiling prompt: a name, its kind (``text`` or ``code``), token ids, and the text's sha256."""

    name: str
    kind: str
    ids: tuple[int, ...]
    text_sha256: str

    def record(self) -> dict[str, Any]:
        ids_sha = hashlib.sha256(json.dumps(list(self.ids)).encode()).hexdigest()
        return {
            "name": self.name,
            "kind": self.kind,
            "tokens": len(self.ids),
            "text_sha256": self.text_sha256,
            "ids_sha256": ids_sha,
        }


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _tokenize(tokenizer: Any, text: str, limit: int | None) -> tuple[int, ...]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tuple(ids[:limit] if limit else ids)


def prompt_from_spec(spec: str, tokenizer: Any) -> ProfilePrompt:
    """Resolve a prompt spec ``SOURCE[:TOKENS]``.

    Sources: ``builtin-text`` / ``builtin-code`` (bundled short prompts), ``austen`` (the Austen
    novels from ``kvbudget fetch data janeaustenr``, from the start of *Emma*'s first chapter),
    ``stdlib/REL.py`` (a file of the interpreter's standard library, e.g. ``stdlib/argparse.py``),
    or a path to a text file (kind ``code`` for ``.py`` files, else ``text``). ``TOKENS`` keeps
    the first that many tokens.
    """
    source, limit = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isdigit():
        source, limit = head, int(tail)
        if limit < 2:
            raise InputError(f"profile prompt {spec!r}: at least 2 tokens are needed")
    if source in ("builtin-text", "builtin-code"):
        from kvbudget.profile_prompts import BUILTIN_CODE, BUILTIN_TEXT

        text = BUILTIN_TEXT if source == "builtin-text" else BUILTIN_CODE
        kind = source.split("-")[1]
    elif source == "austen":
        from kvbudget.data import austen_novels

        novels = austen_novels()
        text = novels.get("Emma") or next(iter(novels.values()))
        start = text.find("CHAPTER I")
        text = text[max(start, 0) :]
        kind = "text"
    elif source.startswith("stdlib/"):
        from kvbudget.data import stdlib_root

        path = stdlib_root() / source.removeprefix("stdlib/")
        if not path.is_file():
            raise InputError(f"profile prompt {spec!r}: no such standard-library file {path}")
        text, kind = path.read_text(encoding="utf-8"), "code"
    else:
        path = Path(source)
        if not path.is_file():
            raise InputError(
                f"profile prompt {spec!r}: not a file and not one of builtin-text, builtin-code, "
                "austen, stdlib/REL.py"
            )
        text, kind = path.read_text(encoding="utf-8"), "code" if path.suffix == ".py" else "text"
    ids = _tokenize(tokenizer, text, limit)
    if len(ids) < 2:
        raise InputError(f"profile prompt {spec!r} has {len(ids)} tokens; at least 2 are needed")
    return ProfilePrompt(spec, kind, ids, _sha(text))


def folded_prompt(name: str, text: str, kind: str, vocab_size: int, limit: int = 256) -> ProfilePrompt:
    """A prompt for a model without a tokenizer: the first ``limit`` UTF-8 bytes of the text folded
    into the vocabulary (``3 + byte mod (vocab − 3)``, skipping the usual special ids 0–2).
    Deterministic; meant for tiny test models — real models are profiled on real tokens."""
    span = max(vocab_size - 3, 1)
    raw = text.encode("utf-8")[:limit]
    ids = tuple(3 + b % span if vocab_size > 3 else b % vocab_size for b in raw)
    return ProfilePrompt(name + "-folded", kind, ids, _sha(text))


# ---------------------------------------------------------------------------- measuring
def decoder_layers(model: PreTrainedModel) -> Sequence[torch.nn.Module]:
    """The decoder layers of a Llama-like model (each with ``self_attn.v_proj`` — or Phi-3's fused
    ``qkv_proj``, values last — and ``o_proj``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ProfileError(f"cannot profile {type(model).__name__}: no decoder layers with self_attn")
    return layers


def _heads(model: PreTrainedModel) -> tuple[int, int, int]:
    config = model.config
    hq = config.num_attention_heads
    hk = getattr(config, "num_key_value_heads", None) or hq
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
    return hq, hk, head_dim


@torch.inference_mode()
def measure(model: PreTrainedModel, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt similarities of one prompt (batch of one, no padding).

    Returns:
        head similarity ``[layers, q_heads]`` in ``[0, 1]`` (``(mean_t cos(V_t, O_t) + 1) / 2``)
        and layer similarity ``[layers]`` (``mean_t cos(x_t, x_t + attn_t)``), float64.
    """
    layers = decoder_layers(model)
    hq, hk, d = _heads(model)
    group = hq // hk
    n_layers = len(layers)
    head_sim = torch.full((n_layers, hq), float("nan"), dtype=torch.float64)
    layer_sim = torch.full((n_layers,), float("nan"), dtype=torch.float64)
    values: dict[int, torch.Tensor] = {}
    inputs: dict[int, torch.Tensor] = {}

    def on_values(i: int, fused: bool = False):
        def hook(module, args, output):  # v_proj's output, or the value columns of a fused qkv_proj
            values[i] = (output[..., -hk * d :] if fused else output).detach()

        return hook

    def on_heads_output(i: int):
        def hook(module, args):
            out = args[0].detach().float()  # [1, T, hq·d]
            t = out.shape[1]
            o = out.reshape(t, hq, d)
            v = values.pop(i).float().reshape(t, hk, d).repeat_interleave(group, dim=1)
            head_sim[i] = (F.cosine_similarity(v, o, dim=-1).double().mean(0) + 1.0) / 2.0

        return hook

    def on_layer_input(i: int):
        def hook(module, args, kwargs):
            inputs[i] = (args[0] if args else kwargs["hidden_states"]).detach()

        return hook

    def on_attention_output(i: int):
        def hook(module, args, output):
            attn = (output[0] if isinstance(output, tuple) else output).detach().float()[0]
            x = inputs.pop(i).float()[0]
            layer_sim[i] = F.cosine_similarity(x, x + attn, dim=-1).double().mean()

        return hook

    handles = []
    try:
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            values_proj = attn.v_proj if hasattr(attn, "v_proj") else attn.qkv_proj  # Phi-3 fuses q, k, v
            handles.append(values_proj.register_forward_hook(on_values(i, fused=not hasattr(attn, "v_proj"))))
            handles.append(attn.o_proj.register_forward_pre_hook(on_heads_output(i)))
            handles.append(layer.register_forward_pre_hook(on_layer_input(i), with_kwargs=True))
            handles.append(attn.register_forward_hook(on_attention_output(i)))
        device = next(model.parameters()).device
        model(torch.tensor([list(ids)], device=device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if bool(torch.isnan(head_sim).any()) or bool(torch.isnan(layer_sim).any()):
        raise ProfileError("profiling captured no attention output for some layer (unsupported model?)")
    return head_sim, layer_sim


def kv_importance(head_similarity: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """BaKlaVa's Algorithm 1 step 2: ``I = 1 − mean`` of each GQA group's head similarities.

    ``head_similarity: [layers, q_heads]`` → ``[layers, kv_heads]``. Query heads ``g·h .. g·h+g−1``
    share KV head ``h`` (transformers' ``repeat_kv`` order).
    """
    layers, hq = head_similarity.shape
    return 1.0 - head_similarity.reshape(layers, num_kv_heads, hq // num_kv_heads).mean(-1)


class _QueryRecorder:
    """The :class:`~kvbudget.cache.CacheSession` of a profiling forward: the kvbudget attention hands
    it each layer's post-RoPE queries ``[1, q_heads, T, d]``; nothing is compressed."""

    phase = Phase.RECORD
    compresses = False
    edits_earlier_layers = False

    def __init__(self) -> None:
        self.queries: dict[int, torch.Tensor] = {}

    def after_attention(self, layer_idx: int, query: torch.Tensor, *args: Any) -> None:
        self.queries[layer_idx] = query.detach()


@torch.inference_mode()
def capture_queries(model: PreTrainedModel, ids: Sequence[int]) -> list[torch.Tensor]:
    """Per layer, the queries the model's attention really uses (after its norms and RoPE) for
    one prompt: ``[q_heads, T, d]`` each, in the model's dtype.

    Runs one forward through kvbudget's attention with a full :class:`~kvbudget.cache.BudgetCache`
    (the model is detached again afterwards if it was not attached before).
    """
    from kvbudget.attention import attached
    from kvbudget.cache import BudgetCache

    layers = len(decoder_layers(model))
    recorder = _QueryRecorder()
    cache = BudgetCache(layers, session=recorder)
    device = next(model.parameters()).device
    with attached(model):
        model(torch.tensor([list(ids)], device=device), past_key_values=cache, use_cache=True)
    if sorted(recorder.queries) != list(range(layers)):
        raise ProfileError("profiling captured no queries for some layer (unsupported model?)")
    return [recorder.queries[i][0] for i in range(layers)]


def query_directions(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Q-Filters' filter directions of one layer from its queries ``[q_heads, N, d]``.

    Per query head: the first right singular vector ``v`` of the ``N × d`` query matrix (not
    centred), oriented so that more than half of the queries project positively on it (the
    authors' ``make_filters.py`` orients by the sign of the first left singular vector, the same
    thing); then the mean over each GQA group's query heads (``repeat_kv`` order). Float64.

    Returns:
        ``[kv_heads, d]``: a key's projection on its head's direction estimates the attention
        logit it gets from a typical query (the Q-Filters score, higher = keep).
    """
    hq, _, d = queries.shape
    directions = torch.empty(hq, d, dtype=torch.float64)
    for h in range(hq):
        x = queries[h].double().cpu()
        v = torch.linalg.svd(x, full_matrices=False).Vh[0]
        positive = float((x @ v > 0).double().mean())
        directions[h] = v if positive > 0.5 else -v
    return directions.reshape(num_kv_heads, hq // num_kv_heads, d).mean(1)


def measure_query_filters(model: PreTrainedModel, prompts: Sequence[ProfilePrompt]) -> torch.Tensor:
    """Q-Filters' directions ``[layers, kv_heads, d]`` (float64) from all tokens of all ``prompts``
    (every token's query of every prompt is one sample of the SVD; the authors sample 3000 tokens
    of 2048-token web texts at random — here every token counts, so the result is deterministic)."""
    _, hk, _ = _heads(model)
    per_prompt = [capture_queries(model, p.ids) for p in prompts]
    layers = len(per_prompt[0])
    return torch.stack(
        [query_directions(torch.cat([q[i] for q in per_prompt], dim=1), hk) for i in range(layers)]
    )


# ---------------------------------------------------------------------------- the profile
def _rounded(t: torch.Tensor) -> list:
    return [_rounded(row) for row in t] if t.dim() > 1 else [round(float(x), DECIMALS) for x in t]


@dataclass
class Profile:
    """A model's offline importance profile.

    Attributes:
        model: ``name``, ``model_type``, ``config_hash``, ``num_layers``, ``num_attention_heads``,
            ``num_kv_heads``.
        prompts: one record per prompt (name, kind, tokens, hashes of text and ids).
        head_similarity: ``[layers][q_heads]``; kv_importance: ``[layers][kv_heads]``;
        layer_similarity: ``[layers]`` (means over the prompts).
        per_prompt: per prompt, its ``head_similarity`` and ``layer_similarity``.
        query_filters: ``[layers][kv_heads][head_dim]`` Q-Filters directions
            (:func:`query_directions`), or ``None`` in a profile made before they were measured
            (the model's ``head_dim`` is then absent too).
        tuned: parameter searches (``kvbudget tune``): ``tuned[method][ratio]`` with the grid and
            the best parameters.
        version: kvbudget version that measured it.
    """

    model: dict[str, Any]
    prompts: list[dict[str, Any]]
    head_similarity: list[list[float]]
    kv_importance: list[list[float]]
    layer_similarity: list[float]
    per_prompt: list[dict[str, Any]]
    tuned: dict[str, Any] = field(default_factory=dict)
    version: str = ""
    query_filters: list[list[list[float]]] | None = None

    @property
    def num_layers(self) -> int:
        return int(self.model["num_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.model["num_kv_heads"])

    def importance(self) -> torch.Tensor:
        """``[layers, kv_heads]`` float64."""
        return torch.tensor(self.kv_importance, dtype=torch.float64)

    def filters(self, source: str = "profile") -> torch.Tensor:
        """Q-Filters directions ``[layers, kv_heads, head_dim]`` float64 (:class:`ProfileError` when the
        profile predates them, naming the command that remakes it)."""
        if self.query_filters is None:
            name = self.model.get("name") or "MODEL"
            raise ProfileError(
                f"{source} has no query filters (made by an older kvbudget): run "
                f"`kvbudget profile --model {name} --out NEW.json` and pass profile=NEW.json"
            )
        return torch.tensor(self.query_filters, dtype=torch.float64)

    def to_json(self) -> str:
        data = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kvbudget_version": self.version,
            "model": self.model,
            "prompts": self.prompts,
            "head_similarity": self.head_similarity,
            "kv_importance": self.kv_importance,
            "layer_similarity": self.layer_similarity,
            "per_prompt": self.per_prompt,
            "tuned": self.tuned,
        }
        if self.query_filters is not None:
            data["query_filters"] = self.query_filters
        return json.dumps(data, indent=1, sort_keys=False, allow_nan=False) + "\n"

    def check_model(self, model: PreTrainedModel, source: str = "profile") -> None:
        """Raise :class:`ProfileError` unless this profile was measured on ``model``'s architecture."""
        expected = config_hash(model.config)
        if self.model.get("config_hash") != expected:
            name = getattr(model, "name_or_path", "") or type(model).__name__
            raise ProfileError(
                f"{source} was made for model '{self.model.get('name')}' (config hash "
                f"{str(self.model.get('config_hash'))[:12]}), not for '{name}' "
                f"(config hash {expected[:12]}); "
                f"run `kvbudget profile --model {name}` to profile it"
            )


def build_profile(model: PreTrainedModel, prompts: Sequence[ProfilePrompt], name: str = "") -> Profile:
    """Measure ``prompts`` on ``model`` (BaKlaVa's Algorithm 1, the layer similarities and the
    Q-Filters directions) and assemble the profile."""
    if not prompts:
        raise InputError("profiling needs at least one prompt")
    hq, hk, head_dim = _heads(model)
    per_prompt, heads, layers = [], [], []
    for prompt in prompts:
        head_sim, layer_sim = measure(model, prompt.ids)
        heads.append(head_sim)
        layers.append(layer_sim)
        per_prompt.append(
            {
                "name": prompt.name,
                "head_similarity": _rounded(head_sim),
                "layer_similarity": _rounded(layer_sim),
            }
        )
    head_mean = torch.stack(heads).mean(0)
    config = model.config
    return Profile(
        model={
            "name": name or getattr(model, "name_or_path", "") or type(model).__name__,
            "model_type": getattr(config, "model_type", ""),
            "config_hash": config_hash(config),
            "num_layers": len(decoder_layers(model)),
            "num_attention_heads": hq,
            "num_kv_heads": hk,
            "head_dim": head_dim,
        },
        prompts=[p.record() for p in prompts],
        head_similarity=_rounded(head_mean),
        kv_importance=_rounded(kv_importance(head_mean, hk)),
        layer_similarity=_rounded(torch.stack(layers).mean(0)),
        per_prompt=per_prompt,
        version=kvbudget_version(),
        query_filters=_rounded(measure_query_filters(model, prompts)),
    )


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` as JSON (atomically: a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(profile.to_json(), encoding="utf-8")
    os.replace(tmp, path)
    return path


def _matrix(data: dict, key: str, rows: int, cols: int | None, where: str) -> list:
    value = data.get(key)
    shape = f"[{rows}]" if cols is None else f"[{rows}][{cols}]"
    if not isinstance(value, list) or len(value) != rows:
        raise ProfileError(f"{where}: '{key}' must be a list of shape {shape}")
    cells = value if cols is None else value
    if cols is not None:
        if not all(isinstance(row, list) and len(row) == cols for row in value):
            raise ProfileError(f"{where}: '{key}' must be a list of shape {shape}")
        cells = [x for row in value for x in row]
    for x in cells:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ProfileError(f"{where}: '{key}' holds a non-numeric or non-finite value {x!r}")
        if not -1e-6 <= x <= 1 + 1e-6:
            raise ProfileError(f"{where}: '{key}' holds {x}, outside [0, 1]")
    return value


def _query_filters(data: dict, model: dict, layers: int, kv_heads: int, where: str) -> list | None:
    """The optional ``query_filters`` of a profile, validated: ``[layers][kv_heads][head_dim]``
    finite numbers in ``[−1, 1]`` (means of unit vectors), ``head_dim`` from ``model``."""
    value = data.get("query_filters")
    if value is None:
        return None
    try:
        head_dim = int(model["head_dim"])
    except (TypeError, KeyError, ValueError):
        raise ProfileError(f"{where}: 'query_filters' needs the model's head_dim") from None
    shape = f"[{layers}][{kv_heads}][{head_dim}]"
    rows = value if isinstance(value, list) and len(value) == layers else None
    if rows is None or not all(
        isinstance(heads, list) and len(heads) == kv_heads
        and all(isinstance(vec, list) and len(vec) == head_dim for vec in heads)
        for heads in rows
    ):  # fmt: skip
        raise ProfileError(f"{where}: 'query_filters' must be a list of shape {shape}")
    for x in (x for heads in rows for vec in heads for x in vec):
        if (
            isinstance(x, bool)
            or not isinstance(x, (int, float))
            or not math.isfinite(x)
            or abs(x) > 1 + 1e-6
        ):
            raise ProfileError(f"{where}: 'query_filters' holds {x!r}, not a number in [-1, 1]")
    return value


def profile_from_dict(data: Any, where: str = "profile") -> Profile:
    """Validate a parsed profile and build a :class:`Profile` (:class:`ProfileError` on any problem)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f'{where} is not a kvbudget profile (no "format": "{FORMAT}")')
    if data.get("format_version") != FORMAT_VERSION:
        raise ProfileError(
            f"{where} has format version {data.get('format_version')!r}; this kvbudget reads {FORMAT_VERSION}"
        )
    model = data.get("model")
    try:
        layers = int(model["num_layers"])
        hq = int(model["num_attention_heads"])
        hk = int(model["num_kv_heads"])
        str(model["config_hash"])
    except (TypeError, KeyError, ValueError):
        raise ProfileError(
            f"{where}: 'model' must give config_hash, num_layers, num_attention_heads, num_kv_heads"
        ) from None
    if layers < 1 or hk < 1 or hq < hk or hq % hk:
        raise ProfileError(f"{where}: bad head counts (layers {layers}, q heads {hq}, kv heads {hk})")
    tuned = data.get("tuned", {})
    prompts = data.get("prompts")
    per_prompt = data.get("per_prompt", [])
    if not isinstance(tuned, dict) or not isinstance(prompts, list) or not isinstance(per_prompt, list):
        raise ProfileError(f"{where}: 'tuned' must be an object, 'prompts' and 'per_prompt' lists")
    return Profile(
        model=dict(model),
        prompts=prompts,
        query_filters=_query_filters(data, model, layers, hk, where),
        head_similarity=_matrix(data, "head_similarity", layers, hq, where),
        kv_importance=_matrix(data, "kv_importance", layers, hk, where),
        layer_similarity=_matrix(data, "layer_similarity", layers, None, where),
        per_prompt=per_prompt,
        tuned=tuned,
        version=str(data.get("kvbudget_version", "")),
    )


def load_profile(path: str | os.PathLike[str], model: PreTrainedModel | None = None) -> Profile:
    """Read and validate a profile; with ``model``, also check it was made for that model."""
    path = Path(path)
    where = f"profile {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(f"{where} does not exist; run `kvbudget profile` to create it") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ProfileError(f"cannot read {where}: {err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ProfileError(f"{where} is not valid JSON ({err.msg} at line {err.lineno})") from None
    profile = profile_from_dict(data, where)
    if model is not None:
        profile.check_model(model, where)
    return profile


# ---------------------------------------------------------------------------- defaults
def profiles_dir() -> Path:
    """``$KVBUDGET_HOME/profiles``."""
    from kvbudget.artifacts import kvbudget_home

    return kvbudget_home() / "profiles"


def default_profile_path(model: PreTrainedModel) -> Path:
    """Where ``kvbudget profile`` saves by default and methods look first: ``profiles/<hash16>.json``."""
    return profiles_dir() / f"{config_hash(model.config)[:16]}.json"


_BUILTIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def local_tokenizer(model: PreTrainedModel) -> Any | None:
    """The tokenizer stored next to ``model``'s weights (its ``name_or_path`` folder), or ``None``."""
    source = getattr(model, "name_or_path", "") or ""
    if not source or not Path(source).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception:  # no tokenizer files next to the weights: fall back to folded bytes
        return None


def builtin_profile(model: PreTrainedModel) -> Profile:
    """A profile of the two bundled prompts, built on the fly and memoised per model object.

    The prompts are tokenised with the tokenizer stored next to the model's weights (registry and
    local models); models without one (tiny test models) get the bytes folded into the
    vocabulary (:func:`folded_prompt`).
    """
    key = config_hash(model.config)
    cached = _BUILTIN.get(model)
    if cached is not None and cached.model["config_hash"] == key:
        return cached
    from kvbudget.profile_prompts import BUILTIN_CODE, BUILTIN_TEXT

    tokenizer = local_tokenizer(model)
    if tokenizer is not None:
        prompts = [prompt_from_spec("builtin-text", tokenizer), prompt_from_spec("builtin-code", tokenizer)]
    else:
        vocab = model.config.vocab_size
        prompts = [
            folded_prompt("builtin-text", BUILTIN_TEXT, "text", vocab),
            folded_prompt("builtin-code", BUILTIN_CODE, "code", vocab),
        ]
    profile = build_profile(model, prompts)
    _BUILTIN[model] = profile
    return profile


def resolve_profile(model: PreTrainedModel, path: str = "") -> Profile:
    """The profile a method uses on ``model``.

    ``path`` given: that file (checked against the model). Otherwise the model's default file
    (:func:`default_profile_path`, written by ``kvbudget profile``) if it exists, else the
    built-in profile (:func:`builtin_profile`).
    """
    if path:
        return load_profile(path, model)
    default = default_profile_path(model)
    if default.is_file():
        return load_profile(default, model)
    return builtin_profile(model)
