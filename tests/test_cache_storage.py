"""BudgetLayer's rectangular storage: appends write in place, never into storage another layer sees."""

from __future__ import annotations

import copy

import torch

from kvbudget.cache import BudgetLayer

B, H, D = 2, 3, 4


def _kv(q: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
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
    assert layer.physical_bytes() == 2 * B * H * 40 * D * 4  # a prefill is stored exactly
    _append(layer, keys, values, 1)  # the first step grows the storage with room
    storage = layer._storage.keys.data_ptr()
    capacity = layer._storage.capacity
    assert capacity == 41 + 32
    assert layer.physical_bytes() == 2 * B * H * capacity * D * 4  # the room is allocated memory
    for step in range(2, capacity - 40 + 1):  # fills the storage exactly
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
