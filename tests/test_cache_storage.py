"""BudgetLayer's rectangular storage: appends write in place, never into storage another layer sees."""

from __future__ import annotations

import copy
import gc
import weakref

import torch

from conftest import seeded
from kvbudget.cache import BudgetLayer

B, H, D = 2, 3, 4


def _kv(q: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = seeded(seed)
    return torch.randn(B, H, q, D, generator=g), torch.randn(B, H, q, D, generator=g)


def _filled(n: int = 40) -> tuple[BudgetLayer, list[torch.Tensor], list[torch.Tensor]]:
    layer = BudgetLayer()
    k, v = _kv(n, 0)
    layer.update(k, v)
    return layer, [k], [v]


def _append(layer: BudgetLayer, keys: list, values: list, seed: int, q: int = 1) -> None:
    k, v = _kv(q, seed)
    layer.update(k, v)
    keys.append(k)
    values.append(v)


def _assert_holds(layer: BudgetLayer, keys: list, values: list) -> None:
    expected_k, expected_v = torch.cat(keys, 2), torch.cat(values, 2)
    n = expected_k.shape[2]
    assert torch.equal(layer.keys, expected_k) and torch.equal(layer.values, expected_v)
    assert torch.equal(layer.positions, torch.arange(n).expand(B, H, n))
    assert layer.seen == n


def test_decode_steps_append_in_place_and_account_the_room():
    layer, keys, values = _filled(40)
    storage = layer._storage.keys.data_ptr()
    capacity = layer._storage.capacity
    assert capacity == 40 + 32  # a prefill gets room for the decode steps that follow it
    assert layer.physical_bytes() == 2 * B * H * capacity * D * 4  # the room is allocated memory
    for step in range(1, capacity - 40 + 1):  # fills the storage exactly
        _append(layer, keys, values, step)
        assert layer._storage.keys.data_ptr() == storage  # no copy while the room lasts
    _assert_holds(layer, keys, values)
    _append(layer, keys, values, 99)  # full: grows again, contents kept
    assert layer._storage.keys.data_ptr() != storage and layer._storage.capacity > capacity
    _assert_holds(layer, keys, values)


def test_a_shallow_copy_never_writes_into_the_originals_storage():
    layer, keys, values = _filled(10)
    _append(layer, keys, values, 1)  # the original now has room after slot 11
    copy_keys, copy_values = list(keys), list(values)
    clone = layer.shallow_copy()
    _append(clone, copy_keys, copy_values, 2)
    _append(layer, keys, values, 3)  # same slot as the clone's token
    _assert_holds(layer, keys, values)
    _assert_holds(clone, copy_keys, copy_values)
    assert clone._storage.owner is clone and clone._storage.keys.data_ptr() != layer._storage.keys.data_ptr()


def test_a_deep_copy_owns_its_storage():
    layer, keys, values = _filled(10)
    _append(layer, keys, values, 1)
    twin = copy.deepcopy(layer)
    twin_keys, twin_values = list(keys), list(values)
    _append(twin, twin_keys, twin_values, 2)
    _append(layer, keys, values, 3)
    _assert_holds(layer, keys, values)
    _assert_holds(twin, twin_keys, twin_values)


def test_dropped_tokens_are_overwritten_by_the_next_append():
    layer, keys, values = _filled(10)
    _append(layer, keys, values, 1, q=4)
    _append(layer, keys, values, 2, q=1)
    layer.drop_last(3)
    keys[-2], values[-2] = keys[-2][:, :, :2], values[-2][:, :, :2]
    del keys[-1], values[-1]
    _append(layer, keys, values, 5, q=2)
    _assert_holds(layer, keys, values)


def test_a_compressed_layer_gets_fresh_exact_storage():
    layer, keys, values = _filled(20)
    _append(layer, keys, values, 1)
    kept = [[torch.arange(0, 21, 2)] * H for _ in range(B)]
    layer.keep(kept)
    assert layer.physical_bytes() == 2 * B * H * 11 * D * 4
    before = layer.keys.clone()
    k, v = _kv(1, 7)
    layer.update(k, v)
    assert torch.equal(layer.keys, torch.cat([before, k], 2))
    assert layer.physical_bytes() == 2 * B * H * 12 * D * 4  # first append after a compression: exact


def _per_head(n: int = 30, counts: tuple[int, ...] = (5, 12, 8)) -> tuple[BudgetLayer, list[list]]:
    """A per-head layer: head ``h`` keeps the first ``counts[h]`` even slots of every row;
    returns it and each head's expected keys (a list of ``[B, n_h, D]`` pieces)."""
    layer, keys, _ = _filled(n)
    kept = [[torch.arange(0, 2 * c, 2) for c in counts] for _ in range(B)]
    layer.keep(kept)
    assert layer.is_ragged
    return layer, [[keys[0][:, h, 0 : 2 * c : 2]] for h, c in enumerate(counts)]


def test_per_head_decode_steps_append_in_place_per_head():
    layer, expected = _per_head()
    layer.update(*_kv(1, 1))  # first step after the compression: exact
    layer.update(*_kv(1, 2))  # second: grows every head's storage with room
    pointers = [s.keys.data_ptr() for s in layer._head_storage]
    for h, piece in enumerate(expected):
        piece += [_kv(1, 1)[0][:, h], _kv(1, 2)[0][:, h]]
    for step in range(3, 20):
        k, v = _kv(1, step)
        layer.update(k, v)
        for h, piece in enumerate(expected):
            piece.append(k[:, h])
        assert [s.keys.data_ptr() for s in layer._head_storage] == pointers  # no copies
    seen = layer.seen
    for h, piece in enumerate(expected):
        keys, _, positions = layer.head(h)
        assert torch.equal(keys, torch.cat(piece, 1))
        n_new = 19
        assert torch.equal(positions[:, -n_new:], torch.arange(seen - n_new, seen).expand(B, n_new))
    capacity = sum(s.capacity for s in layer._head_storage)
    assert layer.physical_bytes() == 2 * B * capacity * D * 4 > layer.held_bytes()


def test_per_head_shallow_copy_never_writes_into_the_originals_storage():
    layer, _ = _per_head()
    layer.update(*_kv(1, 1))
    layer.update(*_kv(1, 2))  # the original now has room
    before = [layer.head(h)[0].clone() for h in range(H)]
    clone = layer.shallow_copy()
    k_clone, _ = _kv(1, 3)
    clone.update(k_clone, k_clone)
    k_orig, _ = _kv(1, 4)
    layer.update(k_orig, k_orig)  # the same slot as the clone's token
    for h in range(H):
        assert torch.equal(layer.head(h)[0], torch.cat([before[h], k_orig[:, h]], 1))
        assert torch.equal(clone.head(h)[0], torch.cat([before[h], k_clone[:, h]], 1))
    assert all(s.owner is clone for s in clone._head_storage)


def test_head_lengths_from_shapes_match_counting_valid_entries():
    layer, _ = _per_head()
    assert not layer.has_invalid
    assert torch.equal(layer.head_lengths(), torch.tensor([[5, 12, 8]] * B))
    rect, _, _ = _filled(7)
    assert torch.equal(rect.head_lengths(), torch.full((B, H), 7))
    padded = BudgetLayer()
    padded.update(*_kv(6, 0))
    first_is_pad = [[False] + [True] * 5] * (B - 1) + [[True] * 6]
    padded.invalidate_new_tokens(torch.tensor(first_is_pad))
    assert padded.has_invalid
    assert torch.equal(padded.head_lengths(), torch.tensor([[5] * H] * (B - 1) + [[6] * H]))


def test_compression_frees_the_storage_of_the_uncompressed_layer():
    """The prefill's full-length storage must go with the tensors it backed, or a compressed cache
    would hold as much memory as the full one."""
    layer, _, _ = _filled(50)
    rectangular = weakref.ref(layer._storage.keys)
    layer.keep([[torch.arange(0, 50, 5)] * H for _ in range(B)])
    gc.collect()
    assert rectangular() is None
    layer.update(*_kv(1, 1))
    per_head = weakref.ref(layer._storage.keys)
    layer.keep([[torch.arange(c) for c in (3, 5, 7)] for _ in range(B)])
    layer.update(*_kv(1, 2))
    layer.update(*_kv(1, 3))
    head_storage = [weakref.ref(s.keys) for s in layer._head_storage]
    layer.keep([[torch.arange(2)] * H for _ in range(B)])  # back to rectangular
    gc.collect()
    assert per_head() is None and all(ref() is None for ref in head_storage)


def test_the_prefill_gets_room_unless_the_session_compresses_it_right_after():
    from kvbudget.cache import BudgetCache
    from kvbudget.methods.registry import make_method
    from kvbudget.session import CompressionSession

    def first_fill(method: str | None) -> int:
        cache = BudgetCache(1)
        if method is not None:
            cache.session = CompressionSession(make_method(method), 1, budget=8)
        cache.update(*_kv(40, 0), 0)
        return cache.layers[0]._storage.capacity

    assert first_fill(None) == first_fill("full") == 40 + 32  # decoding follows: room
    assert first_fill("snapkv") == 40  # about to be compressed: no room to drop again


def test_storage_filled_in_inference_mode_is_copied_not_written_outside_it():
    layer = BudgetLayer()
    k, v = _kv(40, 0)
    with torch.inference_mode():  # as kvbudget.compress prefills
        layer.update(k, v)
    prefill_storage = layer._storage.keys
    keys, values = [k], [v]
    with torch.no_grad():  # a caller decoding on outside inference mode
        _append(layer, keys, values, 1)
        assert not layer._storage.keys.is_inference() and layer._storage.keys is not prefill_storage
        storage = layer._storage.keys.data_ptr()
        _append(layer, keys, values, 2)  # the copy has room: in place again
        assert layer._storage.keys.data_ptr() == storage
    _assert_holds(layer, keys, values)
