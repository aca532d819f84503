"""Chunked prefill in the server (:mod:`kvbudget.serve.chunked_prefill`): a prompt read a layer at a
time makes the tokens an unchunked prefill makes, for every kind of method; in the scheduler the
running conversations keep decoding while it is read, and a request dropped while it is read frees
what it held."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.serve.batcher import Compression, decode_step, make_sequence, prefill_sequence
from kvbudget.serve.chunked_prefill import can_chunk, prefill_steps
from kvbudget.serve.scheduler import Metrics, Scheduler

PROMPT = torch.randint(3, 90, (220,), generator=seeded(11)).tolist()
#: prompt-only, full, per-head ragged, decode-stage, post-prefill + merging, lookahead, quantized,
#: a byte budget
COMPRESSIONS = [
    Compression("snapkv:window=8", budget=24),
    Compression("full"),
    Compression("ada-snapkv:window=8", ratio=0.5),
    Compression("h2o", budget=32),
    Compression("d2o", budget=32),
    Compression("kvzip:chunk=48,overlap=8", ratio=0.5),
    Compression("snapkv:window=8", budget=40, kv_bits=4),
    Compression("snapkv:window=8", memory=0.3),
]


def _answer(model, seq, steps: int = 6) -> list[int]:
    while len(seq.generated) < steps:
        decode_step(model, [seq])
    return seq.generated


@pytest.mark.parametrize("compression", COMPRESSIONS, ids=lambda c: c.label())
@pytest.mark.parametrize("layers", [1, 3])
def test_a_prompt_read_in_pieces_answers_as_one_read_at_once(compression, layers) -> None:
    model = tiny_model("llama")
    whole = make_sequence(PROMPT, 6, set(), compression)
    prefill_sequence(model, whole, 0)
    pieces = make_sequence(PROMPT, 6, set(), compression)
    assert can_chunk(pieces)
    yielded = list(prefill_steps(model, pieces, 0, layers))
    assert yielded == list(range(layers, model.config.num_hidden_layers, layers))  # a piece at a time
    assert [layer.head_lengths().tolist() for layer in pieces.cache.layers] == [
        layer.head_lengths().tolist() for layer in whole.cache.layers
    ]
    assert _answer(model, pieces) == _answer(model, whole)


def test_prune_stage_methods_are_read_at_once() -> None:
    seq = make_sequence(PROMPT, 2, set(), Compression("gemfilter", budget=32))
    assert not can_chunk(seq)


class _Steps(Metrics):
    """When each decode step ended (the scheduler's TPOT hook)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def tpot(self, seconds: float) -> None:
        self.ends.append(time.perf_counter())


def _collect(events: list, done: threading.Event):
    def sink(event: dict) -> None:
        events.append(event)
        if "finish_reason" in event or "error" in event:
            done.set()

    return sink


def test_running_conversations_keep_decoding_while_a_long_prompt_is_read() -> None:
    model = tiny_model("llama")
    steps = _Steps()
    scheduler = Scheduler(
        model, tiny_tokenizer(), 64 << 20, Compression("snapkv:window=8", 24), metrics=steps,
        chunk_tokens=200, keep_turns=False,
    )  # fmt: skip
    scheduler.start()
    try:
        short_events, short_done = [], threading.Event()
        scheduler.submit(PROMPT[:60], _collect(short_events, short_done), max_tokens=40, ignore_eos=True)
        while not short_events:
            time.sleep(0.01)
        long_events, long_done = [], threading.Event()
        long_job = scheduler.submit(PROMPT, _collect(long_events, long_done), max_tokens=4, ignore_eos=True)
        assert long_done.wait(120) and short_done.wait(120)
        first = long_job.first_token_at
        # decode steps of the short conversation ran while the long prompt was read, one a piece
        during = [t for t in steps.ends if long_job.submitted < t < first]
        assert len(during) >= model.config.num_hidden_layers - 1
    finally:
        scheduler.stop()
    whole = make_sequence(PROMPT, 4, set(), Compression("snapkv:window=8", 24))
    prefill_sequence(model, whole, 0)
    assert long_job.seq.generated == _answer(model, whole, 4)


def test_a_request_dropped_while_its_prompt_is_read_frees_it() -> None:
    model = tiny_model("llama")
    scheduler = Scheduler(model, tiny_tokenizer(), 64 << 20, Compression("snapkv:window=8", 24),
                          chunk_tokens=200, keep_turns=False)  # fmt: skip
    scheduler.start()
    try:
        events, done = [], threading.Event()
        short = scheduler.submit(PROMPT[:60], _collect(events, done), max_tokens=400, ignore_eos=True)
        while not events:
            time.sleep(0.01)
        long_job = scheduler.submit(PROMPT, lambda event: None, max_tokens=4, ignore_eos=True)
        while scheduler._reading is not long_job:
            time.sleep(0.001)
        long_job.cancel()
        deadline = time.monotonic() + 60
        while (
            scheduler._reading is not None or long_job in scheduler._active
        ) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler._reading is None and long_job not in scheduler._active
        assert long_job.steps is None and long_job.seq.cache is None
        stats = scheduler.stats()
        assert stats["active"] == 1 and stats["reserved_bytes"] == short.reserved
        short.cancel()
    finally:
        scheduler.stop()
