"""Short prompts in ``kvbudget serve``: "hi" with the README's ``serve`` flags (the real default model)
and every prompt length from 1 to 80 tokens under every prune- and prefill-stage method at several
ratios and budgets get an answer or a one-line 400 naming the method's minimum — the same check and
message as ``kvbudget.generate`` and the CLI — never a 500 and never a budget silently raised."""

from __future__ import annotations

import httpx
import pytest

from conftest import tiny_model, tiny_tokenizer
from kvbudget.engine import check_ratio_budgets
from kvbudget.errors import KVBudgetError
from kvbudget.methods.registry import make_method, method_info, method_names
from kvbudget.phases import Stage
from kvbudget.serve.app import create_app, serving
from kvbudget.serve.batcher import Compression, decode_step, prefill_sequence
from kvbudget.serve.scheduler import Scheduler

#: the README's `kvbudget serve --method snapkv --ratio 0.125`
README_DEFAULT = Compression("snapkv", None, 0.125)
SIZES = [(None, 0.1), (None, 0.5), (8, None), (40, None)]
LENGTHS = range(1, 81)


#: every registered method that compresses during the prefill or prunes it, with its defaults
PREFILL_AND_PRUNE = [n for n in method_names() if {Stage.PREFILL, Stage.PRUNE} & set(make_method(n).stages)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer(chat_template=True)


@pytest.mark.integration
def test_hi_with_the_readme_serve_flags_gets_a_one_line_400_naming_the_minimum(real_model) -> None:
    model, tokenizer = real_model
    scheduler = Scheduler(model, tokenizer, memory_cap=256 << 20, default=README_DEFAULT)
    with serving(create_app(scheduler, "smollm2")) as base:
        hi = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        refused = httpx.post(base + "/v1/chat/completions", json=hi, timeout=120)
        answered = httpx.post(base + "/v1/chat/completions", timeout=120,
                              json={**hi, "kvbudget": {"budget": 128}})  # fmt: skip
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    ids = tokenizer.apply_chat_template(hi["messages"], add_generation_prompt=True, tokenize=True)
    n = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with pytest.raises(KVBudgetError) as cli:  # what `kvbudget generate` says of the same prompt
        check_ratio_budgets(make_method("snapkv"), 0.125, [n])
    assert message == str(cli.value) and "33 entries snapkv always keeps" in message
    assert answered.status_code == 200
    usage = answered.json()["usage"]
    assert usage["kvbudget"]["budget"] == 128 and usage["completion_tokens"] >= 1


def test_every_short_prompt_over_http_gets_an_answer_or_a_400(tiny) -> None:
    model, tokenizer = tiny
    scheduler = Scheduler(model, tokenizer, memory_cap=64 << 20, default=Compression("snapkv", None, 0.5))
    statuses: dict[int, int] = {}
    with serving(create_app(scheduler, "tiny")) as base, httpx.Client(base_url=base, timeout=120) as http:
        for budget, ratio in SIZES:
            size = {"budget": budget} if budget else {"ratio": ratio}
            for n in LENGTHS:
                body = {"model": "tiny", "prompt": [5 + i % 80 for i in range(n)], "max_tokens": 2,
                        "kvbudget": {"method": "snapkv", **size}}  # fmt: skip
                response = http.post("/v1/completions", json=body)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code == 400:
                    message = response.json()["error"]["message"]
                    assert "\n" not in message
                    assert "33 entries snapkv always keeps" in message or "must be ≥ 33 for snapkv" in message
                else:
                    assert response.status_code == 200, response.text
    assert set(statuses) == {200, 400}


def kept_per_head(seq) -> float:
    layers = [layer for layer in seq.cache.layers if layer.is_initialized]
    return sum(int(layer.head_lengths()[0].sum()) for layer in layers) / sum(
        layer.head_lengths().shape[-1] for layer in layers
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", PREFILL_AND_PRUNE)
def test_every_length_from_1_to_80_under_every_prefill_and_prune_method(tiny, name) -> None:
    model, tokenizer = tiny
    scheduler = Scheduler(model, tokenizer, memory_cap=1 << 30, default=Compression(name, 1000))
    # pyramid layer budgets floor every layer at the window: at the smallest budgets they hold a little
    # more than the total (issue #76 counts those rows); every other method is held to it here
    pyramid = getattr(make_method(name), "layer_alloc", None) == "pyramid"
    held_to_budget = not method_info(name).exceeds_budget and not pyramid
    answered = refused = 0
    for budget, ratio in SIZES:
        for n in LENGTHS:
            ids = [5 + (7 * i) % 80 for i in range(n)]
            try:
                job = scheduler.submit(ids, lambda event: None, max_tokens=2,
                                       compression=Compression(name, budget, ratio))  # fmt: skip
            except KVBudgetError as exc:  # refused before any model work, naming the minimum
                message = str(exc)
                assert "\n" not in message and ("always keeps" in message or "must be ≥" in message), message
                refused += 1
                continue
            scheduler._queue.clear()  # run here, on the worker's own functions
            seq = job.seq
            prefill_sequence(model, seq, tokenizer.pad_token_id)
            target = budget if budget is not None else max(1, round(ratio * n))
            kept = kept_per_head(seq)
            assert kept <= n
            if held_to_budget and target < n:
                assert kept <= target, (
                    f"{name}: {kept} entries per head kept for a target of {target} (n={n})"
                )
            tokens = decode_step(model, [seq])
            assert isinstance(tokens[0], int)
            answered += 1
    assert answered > 0
