"""Compressed caches on disk (kvbudget.save_cache / load_cache): a loaded cache decodes exactly as
the one that was saved; another model's, a torn or a foreign file is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

import kvbudget
from conftest import seeded, tiny_model, tiny_tokenizer
from kvbudget.errors import KVBudgetError, PathError
from method_matrix import small


def _decode(model, cache, ids: torch.Tensor, steps: int = 6) -> list[torch.Tensor]:
    """Greedy steps from ``cache``, starting with ``ids``: each step's logits."""
    out, token = [], ids
    with torch.no_grad():
        for _ in range(steps):
            logits = model(token, past_key_values=cache).logits[0, -1]
            out.append(logits)
            token = logits.argmax().view(1, 1)
    return out


@pytest.mark.parametrize(
    "name,bits", [("snapkv", None), ("ada-snapkv", None), ("full", 4), ("ada-snapkv", 2), ("kvzip", 8)]
)
def test_a_loaded_cache_decodes_as_the_saved_one(name, bits, tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 90, (1, 120), generator=seeded(7))
    cache = kvbudget.compress(model, ids[:, :-1], method=small(name), budget=70, kv_bits=bits)
    kept = copy.deepcopy(cache)
    path = kvbudget.save_cache(cache, tmp_path / "doc.safetensors")
    loaded = kvbudget.load_cache(path, model)
    assert loaded.physical_bytes() <= kept.physical_bytes()  # the saved cache's storage room is not kept
    assert [layer.head_lengths().tolist() for layer in loaded.layers] == [
        layer.head_lengths().tolist() for layer in kept.layers
    ]
    assert loaded.source.token_ids == ids[0, :-1].tolist() and loaded.source.kv_bits == bits
    for got, want in zip(_decode(model, loaded, ids[:, -1:]), _decode(model, kept, ids[:, -1:]), strict=True):
        assert got.equal(want)
    assert list(tmp_path.iterdir()) == [path]  # written through a temporary file, renamed into place


@pytest.mark.parametrize("name", ["snapkv", "kvzip"])
def test_a_byte_budgets_two_precisions_round_trip(name, tmp_path):
    """``memory=``: each head's two segments (8 and 4 bits) are saved and loaded as they are."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    context = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 4
    out = kvbudget.generate(model, tokenizer, context, "What?", method=small(name), memory=0.3,
                            compress_context_only=True, max_new_tokens=1, return_cache=True)  # fmt: skip
    cache = out.cache
    assert cache.byte_budget is not None
    kept = copy.deepcopy(cache)
    ids = torch.tensor([[5]])
    source = kvbudget.cache_files.source_of(model, cache, list(range(cache.layers[0].seen)))
    loaded = kvbudget.load_cache(kvbudget.save_cache(cache, tmp_path / "doc.safetensors", source), model)
    assert loaded.source.memory == 0.3
    for mine, theirs in zip(loaded.layers, kept.layers, strict=True):
        for a, b in zip(mine.quant, theirs.quant, strict=True):
            assert type(a) is type(b) and a.high.bits == b.high.bits == 8 and a.low.bits == b.low.bits
            assert all(torch.equal(x, y) for x, y in zip(a.dequantize(), b.dequantize(), strict=True))
    for got, want in zip(_decode(model, loaded, ids), _decode(model, kept, ids), strict=True):
        assert got.equal(want)


def test_another_models_cache_or_dtype_is_refused_in_one_line(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 90, (1, 60), generator=seeded(8))
    path = kvbudget.save_cache(
        kvbudget.compress(model, ids, method="snapkv", budget=40), tmp_path / "c.safetensors"
    )
    for other in (tiny_model("llama", seed=1), tiny_model("qwen2")):
        with pytest.raises(KVBudgetError, match="a cache of another model") as err:
            kvbudget.load_cache(path, other)
        assert "\n" not in str(err.value)
    with pytest.raises(KVBudgetError, match="holds a float32 cache, the model runs in bfloat16"):
        kvbudget.load_cache(path, tiny_model("llama").to(torch.bfloat16))


def test_torn_foreign_and_missing_files_are_refused_in_one_line(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 90, (1, 60), generator=seeded(9))
    path = kvbudget.save_cache(
        kvbudget.compress(model, ids, method="snapkv", budget=40), tmp_path / "c.safetensors"
    )
    whole = path.read_bytes()
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(whole[: len(whole) // 2])
    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(3)}, str(foreign))
    noise = tmp_path / "noise.safetensors"
    noise.write_bytes(bytes(range(256)) * 8)
    for bad in (torn, foreign, noise):
        with pytest.raises(KVBudgetError, match="is not a kvbudget cache file") as err:
            kvbudget.load_cache(bad, model)
        assert "\n" not in str(err.value)
    with pytest.raises(PathError, match="no cache file"):
        kvbudget.load_cache(tmp_path / "absent.safetensors", model)


def test_caches_save_cannot_describe_are_refused(tmp_path, llama):
    ids = torch.randint(3, 90, (1, 80), generator=seeded(10))
    with pytest.raises(KVBudgetError, match="h2o evicts while decoding"):
        kvbudget.save_cache(
            kvbudget.compress(llama, ids, method="h2o", budget=40), tmp_path / "a.safetensors"
        )
    run = kvbudget.generate(llama, tiny_tokenizer(), "a context " * 10, "q?", budget=40, return_cache=True)
    with pytest.raises(KVBudgetError, match="save_cache needs to know what the cache is of"):
        kvbudget.save_cache(run.cache, tmp_path / "b.safetensors")
    assert not list(tmp_path.iterdir())
