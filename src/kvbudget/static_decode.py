"""Greedy decoding over a :class:`~kvbudget.static_cache.StaticBudgetCache`, optionally as a CUDA graph.

A decode step is a manual forward built from the model's own modules (as the prune stage's, see
:func:`kvbudget.prefill.pruned.decoder_parts`): embed the current token → RoPE at each row's ``seen`` →
every decoder layer (its attention writes into the static buffers and attends in one call per
layer, :func:`kvbudget.attention.attend_static`) → norm → LM head → argmax written back into the
input buffer. Every tensor it reads or writes lives at a fixed address and has a fixed shape, and
nothing in it waits for the device, so on CUDA the step is captured once as a
``torch.cuda.CUDAGraph`` and replayed: one launch per token instead of one per kernel
(docs/architecture.md, "Static GPU decode: count launches, not FLOPs"). On the CPU (or with
``graph=False``) the same step runs eagerly.

The decoder is greedy and reads no logits processors; methods that evict while decoding need their
own decode policy and are not served by this path.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import PreTrainedModel

from kvbudget.attention import attach
from kvbudget.cache import BudgetCache, BudgetLayer
from kvbudget.phases import Stage
from kvbudget.prefill.pruned import decoder_parts
from kvbudget.static_cache import StaticBudgetCache


def static_refusal(method: Any, cache: BudgetCache, temperature: float = 0.0) -> str | None:
    """Why a run cannot decode over a static cache (``None``: it can). The reasons are the
    static path's limits, not errors: such a run decodes eagerly over its ``BudgetCache``.

    - a decode-stage method evicts while decoding (StreamingLLM, H2O, TOVA, D2O, CAKE, R-KV,
      KeyDiff, Q-Filters, CaM, BaKlaVa/SqueezeAttention, ...): its eviction reads scores and picks
      entries on the host each step;
    - sampling (``temperature > 0``) draws each token from a host generator;
    - quantized storage (``kv_bits``): the static buffers hold the model's dtype only (not yet
      measured on a GPU);
    - a layer stores one head per query head (LAQ's ``budget_per="query-head"``), which the
      model's KV-head writes do not fill.
    """
    if Stage.DECODE in method.stages:
        return f"{method.name} evicts while decoding (its eviction runs on the host every step)"
    if cache.kv_bits is not None:
        return f"the cache stores {cache.kv_bits}-bit entries, which the static buffers (bf16) do not hold"
    if temperature > 0:
        return "sampling draws each token on the host"
    layers = cache.layers
    model_heads = {layer.num_heads for layer in layers}
    if any(type(layer) is not BudgetLayer for layer in layers) or len(model_heads) != 1:
        return "a layer stores its heads in another layout (one per query head)"
    return None


class StaticDecoder:
    """Greedy decode steps over ``cache`` for ``model``, starting from ``token: [batch]``.

    ``graph``: capture the step as a CUDA graph (default: when the model is on CUDA). ``compiled``:
    the step's forward through ``torch.compile`` (TorchInductor, static shapes) first — its norms,
    RoPE and activations fused into a few kernels, which the CUDA graph then captures; the first
    step pays the compilation (``setup_seconds``). ``tokens`` after :meth:`run` holds every
    generated token ``[batch, steps]``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cache: StaticBudgetCache,
        token: torch.Tensor,
        graph: bool | None = None,
        compiled: bool = False,
    ) -> None:
        self.model, self.cache = model, cache
        self.parts = decoder_parts(model)
        device = self.parts.embed.weight.device
        self.device = device
        self.input = token.reshape(-1, 1).to(device=device, dtype=torch.long).clone()  # [b, 1]
        self.logits: torch.Tensor | None = None
        self.use_graph = device.type == "cuda" if graph is None else graph
        self._graph: torch.cuda.CUDAGraph | None = None
        self._forward = torch.compile(self._forward_eager, dynamic=False) if compiled else self._forward_eager
        self._compiling = compiled  # until the first step has run (and compiled)
        #: what :meth:`run` spent before its steps settled: the eager warm-up and the capture (and
        #: with ``compiled``, the compilation in the first step)
        self.setup_seconds, self.setup_steps = 0.0, 0
        attach(model)

    def _forward_eager(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``tokens, positions: [b, 1]`` → the last position's logits ``[b, vocab]``; every layer's
        attention writes its entry into the static buffers (what ``compiled`` traces)."""
        parts, cache = self.parts, self.cache
        hidden = parts.embed(tokens)
        rotary = parts.rope(hidden, positions)
        for index, layer in enumerate(parts.layers):
            out = layer(
                hidden, attention_mask=None, position_ids=positions, past_key_values=cache,
                use_cache=True, position_embeddings=rotary[index],
            )  # fmt: skip
            hidden = out[0] if isinstance(out, tuple) else out
        return parts.logits(hidden)[:, -1]

    @torch.inference_mode()
    def _step(self) -> None:
        """One token for every row: writes the cache, ``self.logits [b, vocab]`` and the next input."""
        cache = self.cache
        logits = self._forward(self.input, cache.rope[:, None])
        if self.logits is None:
            self.logits = logits
        else:
            self.logits.copy_(logits)
        self.input.copy_(logits.argmax(-1, keepdim=True))
        cache.advance(1)

    def _warm_up(self) -> None:
        """The first step, eager on a side stream (the allocator, cuBLAS and attention kernels
        settle before capture, as CUDA graphs require)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _capture(self) -> None:
        """Record one step into a CUDA graph (recording runs nothing: :meth:`step` replays it)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self._graph = graph

    def step(self) -> torch.Tensor:
        """Decode one token for every row. Returns the input buffer ``[b, 1]``, which now holds each
        row's next token (copy it to keep it: the next step overwrites it)."""
        self.cache.reserve(1)
        if not self.use_graph:
            self._step()
        elif self.logits is None:
            self._warm_up()
        else:
            if self._graph is None:
                self._capture()
            self._graph.replay()
        return self.input

    def run(self, steps: int) -> torch.Tensor:
        """``steps`` greedy tokens per row, ``[batch, steps]``: each step's token is copied into a
        device buffer, read once at the end (one host sync for the whole run; with a CUDA graph one
        more after the warm-up and the capture, which times them apart: ``setup_seconds``, as the
        compiling first step of a ``compiled`` decoder)."""
        out = torch.empty((self.input.shape[0], steps), dtype=torch.long, device=self.device)
        start = time.perf_counter()
        if self.use_graph and self._graph is None:
            settle = min(steps, 2)
        else:
            settle = min(steps, 1) if self._compiling else 0
        self._compiling = False
        for i in range(steps):
            out[:, i : i + 1].copy_(self.step())
            if i + 1 == settle:  # warm-up, compilation and capture done: timed apart (one sync on a GPU)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.setup_seconds, self.setup_steps = time.perf_counter() - start, settle
        return out
