"""Qwen3, Gemma 2, Gemma 3 and Phi-3: tiny random models built from configs (no download).

What each architecture adds to the Llama layout, and what these tests pin down:

* Qwen3 and Gemma 3 normalise queries and keys per head (``q_norm``/``k_norm``) before RoPE;
  Gemma 3 rotates local layers with another base than global ones.
* Gemma 2 and Gemma 3 mix sliding-window (local) and global layers; Gemma 2 soft-caps attention
  logits (``c · tanh(x / c)``) and final logits. Phi-3 fuses the projections into ``qkv_proj``
  and slides a window over every layer when its config sets one.

The references are the models' own eager attention (transformers' implementation, including its
sliding-window mask and soft-capping), an independent masked eager attention written here, and
queries rebuilt by hand from the attention modules' own projections and norms with a hand-written
RoPE.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AttentionInterface,
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import kvbudget
from conftest import seeded
from kvbudget.architectures import ARCHITECTURES, SUPPORTED_MODEL_TYPES
from kvbudget.cache import WINDOW_SLACK, BudgetCache
from kvbudget.errors import UnsupportedModelError
from kvbudget.methods.registry import make_method
from kvbudget.observation import Observation
from kvbudget.prefill.pruned import run_layers
from kvbudget.session import CompressionSession
from method_matrix import ALL_METHODS, MERGING_METHODS, PRUNE_METHODS, small

KINDS = ["qwen3", "gemma2", "gemma3", "phi3"]
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
)
#: the tiny models' windows: shorter than the prompts below, so the windows matter
GEMMA_WINDOW, PHI3_WINDOW = 16, 24
GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def tiny_arch(kind: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random model of ``kind`` (4 layers, 4 query / 2 KV heads, head_dim 16) in eval mode,
    running transformers' eager attention (the reference: Gemma 2's soft-capping lives there)."""
    torch.manual_seed(seed)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16))
    elif kind == "gemma2":  # layers alternate local (0, 2) and global (1, 3)
        config = Gemma2Config(**TINY, head_dim=16, sliding_window=GEMMA_WINDOW, query_pre_attn_scalar=16)
        model = Gemma2ForCausalLM(config)
    elif kind == "gemma3":  # one global layer (1); the last layer is local
        config = Gemma3TextConfig(
            **TINY,
            head_dim=16,
            sliding_window=GEMMA_WINDOW,
            query_pre_attn_scalar=16,
            layer_types=GEMMA3_TYPES,
        )
        model = Gemma3ForCausalLM(config)
    elif kind == "phi3":  # every layer slides
        model = Phi3ForCausalLM(
            Phi3Config(**TINY, sliding_window=PHI3_WINDOW, pad_token_id=0, eos_token_id=1)
        )
    else:
        raise ValueError(kind)
    model.set_attn_implementation("eager")
    return model.eval()


def windows(model: PreTrainedModel) -> list[int | None]:
    """Each layer's sliding window according to the config (``None`` = global)."""
    config = model.config
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    if config.model_type == "phi3":
        return [config.sliding_window] * config.num_hidden_layers
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


def _logits(model, ids, mask=None, cache=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, past_key_values=cache, use_cache=cache is not None).logits


def _ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 90, (batch, n), generator=seeded(seed))


# ----------------------------------------------------------------------------- the attention hook
@pytest.mark.parametrize("kind", KINDS)
def test_hook_equals_the_models_own_attention(kind):
    """No cache, a BudgetCache (whole, or a prefill in two chunks), transformers' own DynamicCache
    (sliding layers that keep only the window): the model's own attention within 1e-5, left padding
    included. The model's own is its sdpa attention, or eager for Gemma 2 (where transformers
    soft-caps). Decoding token by token changes float32 reduction orders: within 5e-5."""
    model = tiny_arch(kind)
    if kind != "gemma2":
        model.set_attn_implementation("sdpa")
    own = model.config._attn_implementation
    ids = _ids(64, 0, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    reference = _logits(model, ids, mask)
    layers = model.config.num_hidden_layers
    with kvbudget.attached(model):
        no_cache = _logits(model, ids, mask)
        whole = _logits(model, ids, mask, BudgetCache(layers))
        dynamic = _logits(model, ids, mask, DynamicCache(config=model.config))
        cache = BudgetCache(layers)
        chunked = [_logits(model, ids[:, :30], mask[:, :30], cache), _logits(model, ids[:, 30:], mask, cache)]
        cache = BudgetCache(layers)
        steps = [_logits(model, ids[:, :40], mask[:, :40], cache)]
        steps += [_logits(model, ids[:, t : t + 1], mask[:, : t + 1], cache) for t in range(40, 64)]
    assert model.config._attn_implementation == own  # detached: the model's own attention again
    real = mask.bool()
    for out in (no_cache, whole, dynamic, torch.cat(chunked, dim=1)):
        assert torch.allclose(out[real], reference[real], atol=1e-5), (out - reference)[real].abs().max()
    decoded = torch.cat(steps, dim=1)
    assert torch.allclose(decoded[real], reference[real], atol=5e-5), (decoded - reference)[real].abs().max()
    # the windows matter at this length: without them the model's own answer differs
    if any(w is not None for w in windows(model)):
        model.config.sliding_window = 10**6
        for module in model.modules():
            if getattr(module, "sliding_window", None):
                module.sliding_window = 10**6
        assert not torch.allclose(_logits(model, ids, mask)[real], reference[real], atol=1e-3)


def test_only_supported_architectures_attach():
    assert {"qwen3", "gemma2", "gemma3_text", "phi3"} <= set(SUPPORTED_MODEL_TYPES) == set(ARCHITECTURES)
    model = tiny_arch("gemma3")
    model.config.model_type = "gemma3"  # the multimodal Gemma 3 (image tokens attend both ways)
    with pytest.raises(UnsupportedModelError, match=r"'gemma3'.*gemma3_text") as raised:
        kvbudget.attach(model)
    assert "\n" not in str(raised.value)


# ----------------------------------------------------------------------------- queries
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE by hand (the half-split layout of Llama-family checkpoints): ``x: [b, h, n, d]``."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = positions.double()[:, None, :, None] * inv_freq  # [b, 1, n, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return (x.double() * cos + _rotate_half(x.double()) * sin).float()


def _rope_base(model: PreTrainedModel, layer_idx: int) -> float:
    params = model.config.rope_parameters
    if "rope_theta" not in params:  # Gemma 3: one set per layer type
        params = params[model.config.layer_types[layer_idx]]
    return float(params["rope_theta"])


def _own_queries(model: PreTrainedModel, ids: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer, the query each attention module computes for ``ids`` (one row, positions 0..n−1),
    rebuilt from the module's own projection (``q_proj``, or the query part of Phi-3's fused
    ``qkv_proj``) and query norm, captured with forward hooks, then rotated by hand. Also the
    query without the norm (``raw``) and without RoPE (``unrotated``)."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):

            def hook(mod, args, kwargs, i=module.layer_idx):
                captured[i] = kwargs.get("hidden_states", args[0] if args else None)

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        _logits(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    heads, d = model.config.num_attention_heads, 16
    out = {}
    for module in model.modules():
        if not (hasattr(module, "layer_idx") and hasattr(module, "o_proj")):
            continue
        i, hidden = module.layer_idx, captured[module.layer_idx]
        with torch.no_grad():
            if hasattr(module, "qkv_proj"):
                raw = module.qkv_proj(hidden)[..., : heads * d]
            else:
                raw = module.q_proj(hidden)
            raw = raw.view(*hidden.shape[:2], heads, d).transpose(1, 2)
            normed = module.q_norm(raw) if hasattr(module, "q_norm") else raw
        positions = torch.arange(ids.shape[1])[None]
        base = _rope_base(model, i)
        out[i] = {
            "query": _rope(normed, positions, base),
            "raw": _rope(raw, positions, base),
            "unrotated": normed,
        }
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_window_queries_are_the_models_queries(kind):
    """The queries a method scores with (what the hook hands the session, the observation window's
    rows) are the model's own: after the query norm (Qwen3, Gemma 3) and RoPE (Gemma 3: the local
    or global base of the layer). Skipping the norm or RoPE would be caught."""
    model = tiny_arch(kind)
    ids = _ids(40, 1)
    session = CompressionSession(make_method("full"), model.config.num_hidden_layers, budget=8)
    session.begin_record()  # keep every layer's queries, compress nothing
    with kvbudget.attached(model):
        _logits(model, ids, cache=BudgetCache(model.config.num_hidden_layers, session))
    own = _own_queries(model, ids)
    for i, expected in own.items():
        recorded = session.recorded_queries[i]
        assert recorded.shape == (1, 4, 40, 16)
        assert torch.allclose(recorded, expected["query"], atol=1e-4), (
            (recorded - expected["query"]).abs().max()
        )
        assert not torch.allclose(recorded, expected["unrotated"], atol=1e-2)  # RoPE applied
        if kind in ("qwen3", "gemma3"):
            assert not torch.allclose(recorded, expected["raw"], atol=1e-2)  # the query norm applied


@pytest.mark.parametrize("kind", KINDS)
def test_lookahead_pseudo_queries_are_the_models_queries(kind):
    """LAQ's pseudo queries (the lookahead decoded on an uncompressed clone, so the model's full
    forward over prompt + pseudo tokens computes the same queries) are the model's own queries of
    those tokens at their true positions."""
    model = tiny_arch(kind)
    ids = _ids(60, 2)
    method = make_method("laq", kernel=3, steps=3, lookahead_window=4, lookahead_method="full")
    cache = kvbudget.compress(model, ids, method=method, budget=24)
    record = cache.session.run.lookahead
    assert record.tokens.shape == (1, 3) and record.positions[0].tolist() == [60, 61, 62]
    own = _own_queries(model, torch.cat([ids, record.tokens], dim=1))
    for i, expected in own.items():
        pseudo = record.queries[i]
        assert pseudo.shape == (1, 4, 3, 16)
        assert torch.allclose(pseudo, expected["query"][:, :, 60:], atol=1e-4), i


# ----------------------------------------------------------------------------- scores
@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3"])
def test_observation_probabilities_are_the_models_attention(kind):
    """What window scorers and H2O read (window rows, column sums) equals the attention weights of
    the model's own eager attention: windows, soft-capping and norms included."""
    model = tiny_arch(kind)
    ids = _ids(48, 3)
    layers = model.config.num_hidden_layers
    session = CompressionSession(make_method("full"), layers, budget=8)
    session.begin_record()
    cache = BudgetCache(layers, session)
    with kvbudget.attached(model):
        _logits(model, ids, cache=cache)
    with torch.no_grad():
        own = model(ids, output_attentions=True).attentions  # per layer [1, q_heads, n, n]
    for i in range(layers):
        layer = cache.layers[i]
        assert layer.sliding_window == windows(model)[i]
        assert layer.softcap == (50.0 if kind == "gemma2" else None)
        obs = Observation(i, layers, session.recorded_queries[i], layer, session.scaling)
        assert torch.allclose(obs.window_probs(8), own[i][:, :, -8:], atol=1e-5)
        assert torch.allclose(obs.column_sums(), own[i].sum(2), atol=1e-4)
        if layer.sliding_window is not None:  # the last query sees only its window
            assert obs.last_row_probs()[..., : 48 - layer.sliding_window].eq(0).all()


# ----------------------------------------------------------------------------- decode after eviction
def _masked_reference(kept: dict[int, list[torch.Tensor]]):
    """Eager attention over the full sequence, written here: scaled logits, soft-capped when the model
    asks, causal, the sliding window ``kv > q − W`` when the model asks; the LAST query sees only
    the kept entries of its KV head (and itself)."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        hq, hk, q, n = query.shape[1], key.shape[1], query.shape[2], key.shape[2]
        group = hq // hk
        k = key.repeat_interleave(group, 1).double()
        v = value.repeat_interleave(group, 1).double()
        logits = query.double() @ k.transpose(-1, -2) * scaling
        if kwargs.get("softcap") is not None:
            logits = torch.tanh(logits / kwargs["softcap"]) * kwargs["softcap"]
        rows, cols = torch.arange(n - q, n)[:, None], torch.arange(n)[None, :]
        allowed = cols <= rows
        if kwargs.get("sliding_window") is not None:
            allowed = allowed & (cols > rows - kwargs["sliding_window"])
        allowed = allowed.expand(hq, q, n).clone()
        for h in range(hk):
            last = torch.zeros(n, dtype=torch.bool)
            last[kept[module.layer_idx][h]] = True
            last[n - 1] = True
            allowed[h * group : (h + 1) * group, -1] &= last
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        return (probs @ v).to(query.dtype).transpose(1, 2).contiguous(), None

    return attention


def _compress_or_refused(
    model: PreTrainedModel, ids: torch.Tensor, name: str, budget: int
) -> BudgetCache | None:
    """``kvbudget.compress`` with ``small(name)``; ``None`` when the method refuses the architecture,
    which it must do with a one-line :class:`UnsupportedModelError` saying why (before any cache
    is built)."""
    try:
        return kvbudget.compress(model, ids, method=small(name), budget=budget)
    except UnsupportedModelError as exc:
        message = str(exc)
        assert "\n" not in message and len(message) > 20, message
        return None


def head_stale(layer, h: int, limit: int) -> int:
    """Valid entries of KV head ``h`` (fullest batch row) at positions ``≤ limit``."""
    positions = layer.head(h)[2]
    return int(((positions >= 0) & (positions <= limit)).sum(-1).max())


DECODE_REFERENCE_METHODS = [m for m in ALL_METHODS if m not in MERGING_METHODS + PRUNE_METHODS]


@pytest.mark.parametrize("name", DECODE_REFERENCE_METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_decode_step_after_eviction_equals_masked_full_sequence(kind, name):
    """Exact attention over the kept entries, inside each layer's window (merging and prune-stage
    methods have no masked full-sequence reference: see tests/test_methods_matrix.py)."""
    model = tiny_arch(kind)
    ids = _ids(80, 4)
    cache = _compress_or_refused(model, ids[:, :-1], name, 20)
    if cache is None:
        return
    kept = {}
    for i, layer in enumerate(cache.layers):
        kept[i] = []
        for h in range(layer.num_heads):
            positions = layer.head(h)[2][0]
            kept[i].append(positions[positions >= 0])
    with torch.no_grad():
        logits = model(ids[:, -1:], past_key_values=cache).logits[0, -1]
        kvbudget.detach(model)
        AttentionInterface.register("kvbudget_arch_reference", _masked_reference(kept))
        model.set_attn_implementation("kvbudget_arch_reference")
        reference = model(ids).logits[0, -1]
    assert torch.allclose(logits, reference, atol=1e-4), (logits - reference).abs().max()


# ----------------------------------------------------------------------------- every method
@pytest.mark.parametrize("name", ALL_METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_method_runs_within_the_windows(kind, name):
    """Every registered method compresses and decodes on every architecture (or is refused with a
    one-line error). Sliding-window layers are compressed within their window: after decoding,
    they hold fewer entries their window cannot reach than the trimming slack."""
    model = tiny_arch(kind)
    ids = _ids(90, 5)
    cache = _compress_or_refused(model, ids[:, :-1], name, 24)
    if cache is None:
        return
    token = ids[:, -1:]
    with torch.no_grad():
        for _ in range(3):
            logits = model(token, past_key_values=cache).logits[:, -1]
            assert torch.isfinite(logits).all()
            token = logits.argmax(-1, keepdim=True)
    seen = cache.get_seq_length()
    for layer, window in zip(cache.layers, windows(model), strict=True):
        assert layer.sliding_window == window
        if window is not None:  # entries no later query can see: fewer than the slack (+ this step's)
            stale = [head_stale(layer, h, seen - window) for h in range(layer.num_heads)]
            assert min(stale) <= min(WINDOW_SLACK, window), stale


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3"])
def test_sliding_layers_are_kept_whole_within_their_window(kind):
    """The decision for sliding-window layers: a method compresses them like any layer, within
    their window. With a budget at least the window (SnapKV's window queries score every key
    inside it above any key outside), a local layer ends up holding exactly its window — every
    in-window entry, nothing older — while global layers hold the budget from the whole prompt."""
    model = tiny_arch(kind)
    ids = _ids(120, 6)
    method = make_method("snapkv", window=4, kernel=1)
    cache = kvbudget.compress(model, ids[:, :-1], method=method, budget=60)
    with torch.no_grad():
        model(ids[:, -1:], past_key_values=cache)
    for layer, window in zip(cache.layers, windows(model), strict=True):
        for h in range(layer.num_heads):
            positions = sorted(layer.head(h)[2][0].tolist())
            if window is None:
                assert len(positions) == 61 and positions[0] < 120 - 60
            else:
                assert positions == list(range(120 - window, 120))


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3"])
def test_full_cache_drops_what_left_the_window(kind):
    """Without compression too, a local layer stops holding entries its window cannot reach: they
    are dropped at the next forward (once the slack has accumulated), global layers keep all."""
    model = tiny_arch(kind)
    ids = _ids(100, 7)
    cache = kvbudget.compress(model, ids[:, :-1], method="full", budget=512)
    assert all(layer.keys.shape[2] == 99 for layer in cache.layers)
    with torch.no_grad():
        model(ids[:, -1:], past_key_values=cache)
    for layer, window in zip(cache.layers, windows(model), strict=True):
        held = layer.positions[0, 0].tolist()
        assert held == (list(range(100)) if window is None else list(range(100 - window, 100)))


# ----------------------------------------------------------------------------- the prune stage
@pytest.mark.parametrize("kind", KINDS)
def test_layer_by_layer_forward_reproduces_the_model(kind):
    """The prune stage's manual forward (per-layer-type RoPE for Gemma 3, Gemma 2's final logit
    soft-capping) gives the model's logits when nothing is pruned."""
    model = tiny_arch(kind)
    ids = _ids(50, 8, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    reference = _logits(model, ids, mask)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = run_layers(model, ids, mask, positions, BudgetCache(4), all_logits=True)
    kvbudget.detach(model)
    real = mask.bool()
    assert torch.allclose(out[real], reference[real], atol=1e-4), (out - reference)[real].abs().max()


def test_kvbudget_methods_lists_the_architectures():
    from typer.testing import CliRunner

    from kvbudget.cli import app

    result = CliRunner().invoke(app, ["methods"], terminal_width=400)
    assert result.exit_code == 0, result.output
    listed = result.output.split("Supported architectures:")[1]
    for name in ("Llama", "Qwen2", "Mistral", "Qwen3", "Gemma 2", "Gemma 3", "Phi-3"):
        assert name in listed
