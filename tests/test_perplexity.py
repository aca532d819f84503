"""Chunked perplexity with a fixed cache."""

from __future__ import annotations

import pytest
import torch

from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.eval.tasks.perplexity import chunked_perplexity, scored_from
from kvbudget.methods.registry import make_method

IDS = torch.randint(3, 90, (1, 200), generator=seeded(0))


def _reference_nll(model, ids, start):
    """Mean NLL of ids[start:] by explicit log-softmax gathering over a plain forward."""
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return -sum(float(logp[t - 1, ids[0, t]]) for t in range(start, ids.shape[1])) / (ids.shape[1] - start)


def test_full_cache_nll_matches_an_independent_computation():
    model = tiny_model()
    result = chunked_perplexity(model, IDS, make_method("full"), None, chunk=16, first_chunk=40)
    assert result.tokens == 160
    assert result.nll == pytest.approx(_reference_nll(model, IDS, 40), abs=1e-4)


@pytest.mark.parametrize("name", ["snapkv", "streamingllm", "h2o", "tova"])
def test_budget_covering_the_text_equals_the_full_cache(name):
    model = tiny_model()
    method = make_method(name, window=4) if name == "snapkv" else make_method(name)
    result = chunked_perplexity(model, IDS, method, budget=400, chunk=16, first_chunk=40)
    assert result.nll == pytest.approx(_reference_nll(model, IDS, 40), abs=1e-4)


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "tova", "d2o", "cam"])
def test_decode_methods_hold_the_cache_at_the_budget(name):
    model = tiny_model()
    result = chunked_perplexity(model, IDS, make_method(name), budget=48, chunk=16)
    assert result.max_entries_per_head == 48
    assert result.tokens == 200 - 48
    assert result.nll > 0


def test_prefill_methods_compress_each_prefix():
    model = tiny_model()
    small = chunked_perplexity(model, IDS, make_method("snapkv", window=4, kernel=3), budget=24, chunk=32)
    assert small.max_entries_per_head == 24 + 32  # compressed prefix + the scored chunk
    full = chunked_perplexity(model, IDS, make_method("full"), None, chunk=32, first_chunk=32)
    assert small.tokens == full.tokens
    assert small.nll != pytest.approx(full.nll, abs=1e-6)


@pytest.mark.parametrize("name", ["fastkv", "gemfilter"])
def test_prune_methods_score_chunks_on_their_pruned_prefix(name):
    model = tiny_model()
    method = make_method(name, window=4, kernel=3) if name == "fastkv" else make_method(name, kernel=3)
    same = chunked_perplexity(model, IDS, method, budget=400, chunk=16, first_chunk=40)
    assert same.nll == pytest.approx(_reference_nll(model, IDS, 40), abs=1e-4)  # nothing pruned
    pruned = chunked_perplexity(model, IDS, method, budget=24, chunk=32)
    assert pruned.max_entries_per_head == 24 + 32 and pruned.tokens == 200 - 32  # first chunk: 32


def test_lookahead_methods_compress_each_prefix_after_looking_ahead(monkeypatch):
    """A lookahead method compresses after the prefill (its lookahead stage), so each prefix is held
    at the budget like a prefill-stage method's, and the answer differs from the full cache's."""
    model = tiny_model()
    method = make_method("laq", kernel=3, lookahead_window=4, steps=4)
    lookaheads = []
    real = type(method).pseudo_decode

    def spy(self, *args, **kwargs):
        record = real(self, *args, **kwargs)
        lookaheads.append(record)
        return record

    monkeypatch.setattr(type(method), "pseudo_decode", spy)
    small = chunked_perplexity(model, IDS, method, budget=24, chunk=32)
    assert small.max_entries_per_head == 24 + 32  # compressed prefix + the scored chunk
    assert lookaheads and all(r.tokens.shape == (1, 4) for r in lookaheads)  # each prefix looked ahead
    full = chunked_perplexity(model, IDS, make_method("full"), None, chunk=32, first_chunk=32)
    assert small.tokens == full.tokens
    assert small.nll != pytest.approx(full.nll, abs=1e-6)


def test_a_profiled_method_looks_parameters_up_at_the_passages_ratio(monkeypatch):
    """Each prefill sees budget / prefix tokens; the lookup uses budget / T (or the given ratio),
    pinned in the call's own runs."""
    from kvbudget.methods.profiled import ProfiledMethod

    seen = []
    real = ProfiledMethod.resolved_p
    monkeypatch.setattr(
        ProfiledMethod, "resolved_p", lambda self, run, ratio: seen.append(ratio) or real(self, run, ratio)
    )
    model = tiny_model()
    for name in ("squeezeattention", "baklava"):
        method = make_method(name)
        seen.clear()
        chunked_perplexity(model, IDS, method, budget=50, chunk=16)  # 50 / 200
        assert seen and set(seen) == {0.25}, name
        seen.clear()
        chunked_perplexity(model, IDS, method, budget=50, chunk=16, ratio=0.3)
        assert seen and set(seen) == {0.3}, name
        assert method == make_method(name)  # the pins lived in the call's runs, not on the method


@pytest.mark.parametrize("ratio", [0, 1.5, -0.1, "0.3"])
def test_a_bad_ratio_is_a_one_line_error(ratio):
    from kvbudget.errors import BudgetError

    with pytest.raises(BudgetError, match=r"compression ratio must be in \(0, 1\], got"):
        chunked_perplexity(tiny_model(), IDS, make_method("baklava"), budget=50, ratio=ratio)


def test_the_evaluation_scores_every_method_on_the_same_tokens(tmp_path):
    """Every row of a passage — the full cache's and each ratio's — scores the passage's second half
    (issue #45: the full cache had scored every token after the first chunk and each compressed run
    its last length − budget tokens, so their perplexities were read on different text)."""
    from kvbudget.eval.runner import EvalConfig, Runner
    from kvbudget.eval.store import load_rows

    config = EvalConfig(
        model="tiny", tasks=["perplexity"], lengths=[320], methods=["full", "streamingllm", "snapkv"],
        budgets=[], compression_ratios=[0.5, 0.75], limit=1,
    )  # fmt: skip
    runner = Runner(config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(), progress=False)
    rows = load_rows(runner.run())
    assert len(rows) == 5 and all(r["error"] is None for r in rows)
    (length,) = {r["prompt_tokens"] for r in rows}
    assert scored_from(length) == length // 2
    assert {r["scored_tokens"] for r in rows} == {length - length // 2}  # before: 288, 160 and 240
    assert {r["scored_from"] for r in rows} == {length // 2}
    full = next(r for r in rows if r["label"] == "full")
    assert all(r["full_score"] == full["score"] for r in rows)
    assert scored_from(2048) == 1024 and scored_from(100, chunk=64) == 64  # at least one chunk


def test_the_novels_are_tokenised_once_per_tokenizer_pipeline():
    """Another copy of one tokenizer (a chat template does not change the pipeline) reuses the ids
    (the same object, no second pass over ~4 M characters); another vocabulary is another pipeline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvbudget.data import austen_novels
    from kvbudget.eval.tasks.perplexity import austen_ids, tokenizer_fingerprint

    first = austen_ids(tiny_tokenizer())
    assert austen_ids(tiny_tokenizer(chat_template=True)) is first
    opening = next(iter(austen_novels().values()))[:200]
    direct = tuple(tiny_tokenizer()(opening, add_special_tokens=False)["input_ids"])
    assert len(direct) > 150 and first[: len(direct)] == direct
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "and": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    words = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    plain = tokenizer_fingerprint(tiny_tokenizer())
    assert tokenizer_fingerprint(words) != plain == tokenizer_fingerprint(tiny_tokenizer(chat_template=True))
