"""What the reported times add up to: ``RunTimes`` and the times ``generate`` reports."""

from __future__ import annotations

import math

import pytest
import torch

from kvbudget.engine import Decoded, RunTimes, generate
from kvbudget.methods.registry import make_method
from kvbudget.session import CompressionSession


def test_run_times_split_the_prefill_and_the_first_token():
    times = RunTimes(prefill_wall=3.0, compress=1.0, first_token=0.5, decode=2.0, steps=4)
    assert times.prefill == 2.0  # the forward passes alone
    assert times.ttft == 3.5  # prefill with compression, then the first token
    assert times.tpot == 0.5
    assert math.isnan(RunTimes(1.0, 0.0, 0.1, 0.0, 0).tpot)


def test_run_times_of_a_session_and_a_decode_take_their_parts():
    class Session:
        compress_seconds = 0.25

    decoded = Decoded([[1, 2]], steps=1, seconds=0.75, first_token_seconds=0.125)
    times = RunTimes.of(2.0, Session(), decoded)
    assert (times.prefill, times.compress, times.first_token, times.decode, times.steps) == (
        1.75,
        0.25,
        0.125,
        0.75,
        1,
    )


def test_the_steady_step_time_leaves_the_static_setup_out():
    """A graph's warm-up and capture (the first two steps and the move into static buffers) are
    one-off: the steady step time is the rest over the rest."""
    decoded = Decoded([[1]], steps=12, seconds=1.3, setup_seconds=0.3, setup_steps=2)
    assert decoded.steady_step_seconds == pytest.approx(0.1)
    assert Decoded([[1]], steps=4, seconds=2.0).steady_step_seconds == 0.5  # eager: every step
    assert math.isnan(
        Decoded([[1]], steps=2, seconds=1.0, setup_seconds=1.0, setup_steps=2).steady_step_seconds
    )


def test_generate_reports_times_that_add_up(llama, chat_tokenizer):
    context = " ".join(f"word{i}" for i in range(60))
    result = generate(
        llama,
        chat_tokenizer,
        context,
        "which word?",
        method=make_method("snapkv", window=4),
        budget=16,
        max_new_tokens=5,
    )
    timings = result.timings
    assert timings["compress"] == result.compress_s > 0
    assert timings["prefill"] > 0
    # ttft = prefill + compress + choosing the first token (a few microseconds to milliseconds)
    first_token = result.ttft_s - timings["prefill"] - timings["compress"]
    assert 0 < first_token < 0.5 * result.ttft_s
    steps = len(result.token_ids) - 1
    assert steps >= 1 and result.tpot_s == pytest.approx(timings["decode"] / steps)


def test_a_synchronizing_session_waits_for_the_device_before_each_reading(monkeypatch):
    """On a GPU the session's timers would count attention still queued; ``synchronize`` waits."""
    waited: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    session = CompressionSession(make_method("snapkv"), num_layers=2, budget=8)
    cuda = torch.device("cuda")  # a device object; no GPU is touched (synchronize is replaced)
    session.clock(cuda)
    assert waited == []  # off by default: the host runs ahead
    session.synchronize = True
    before = session.clock(torch.device("cpu"))
    assert waited == []  # nothing to wait for on the CPU
    assert session.clock(cuda) >= before
    assert waited == [cuda]
