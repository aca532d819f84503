"""``select_keep`` keeps what a stable descending sort's first ``budget`` entries would be.

The reference sorts every entry (ties to the earlier slot, protected entries first, invalid ones
last); ``select_keep`` finds the same set from ``topk`` thresholds without the full sort."""

from __future__ import annotations

import pytest
import torch

from conftest import seeded
from kvbudget.selection import select_keep


def sorted_reference(scores, budgets, valid, protected) -> list[list[list[int]]]:
    b, h, n = scores.shape
    out = []
    for r in range(b):
        row = []
        for head in range(h):
            # rank key: protected first (among them the earlier slot), then score descending, then
            # the earlier slot; invalid entries never
            def key(j: int, r: int = r, head: int = head) -> tuple:
                if protected[r, head, j]:
                    return (0, 0.0, j)
                return (1, -float(scores[r, head, j]), j)

            ranked = sorted((j for j in range(n) if valid[r, head, j]), key=key)
            count = min(int(budgets[r, head]), len(ranked))
            row.append(sorted(ranked[:count]))
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_select_keep_equals_a_stable_sort_with_ties_padding_and_protection(seed: int) -> None:
    g = seeded(seed)
    b, h, n = 2, 4, 60
    scores = torch.randint(-3, 4, (b, h, n), generator=g).float()  # many exact ties
    valid = torch.rand(b, h, n, generator=g) > 0.15
    protected = valid & (torch.rand(b, h, n, generator=g) > 0.85)
    budgets = torch.randint(0, n + 5, (b, h), generator=g)  # zero, typical, above the valid count
    budgets[0, 0] = 0
    budgets[1, 1] = max(int(protected[1, 1].sum()) - 1, 0)  # fewer than the protected: earliest ones
    got = [[idx.tolist() for idx in row] for row in select_keep(scores, budgets, valid, protected)]
    assert got == sorted_reference(scores, budgets, valid, protected)


def test_select_keep_with_nan_scores_keeps_the_stable_sort_s_choice() -> None:
    scores = torch.tensor([[[0.5, float("nan"), 0.1, 0.9, 0.9]]])
    valid = torch.ones(1, 1, 5, dtype=torch.bool)
    protected = torch.zeros_like(valid)
    expected = torch.sort(scores[0, 0], descending=True, stable=True).indices[:2].sort().values
    got = select_keep(scores, torch.tensor([[2]]), valid, protected)[0][0]
    assert got.tolist() == expected.tolist()
