"""Percentile-bootstrap confidence intervals of mean scores, resampling samples.

:func:`bootstrap_mean` — the interval of a mean over ``n`` samples: draw ``resamples`` sets of
``n`` samples with replacement, take each set's mean, and report the ``(1 − level)/2`` and
``(1 + level)/2`` quantiles of those means (the percentile interval; Efron & Tibshirani, *An
Introduction to the Bootstrap*, 1993, §13.3). Quantiles interpolate linearly between the sorted
resample means (numpy's default), as ``scipy.stats.bootstrap(method="percentile")`` does.

:func:`bootstrap_mean_over_groups` — the interval of a mean over tasks, each task the mean of its
own samples (every task weighs the same whatever its sample count): each resample redraws every
task's samples with replacement within that task (a stratified bootstrap), averages each task,
then averages the task means. Tasks are fixed; only the samples vary.

Both are seeded (a :class:`numpy.random.Generator` from ``seed``): the same inputs give the same
interval. All-equal values give a zero-width interval; one sample gives its own value as both bounds.

:func:`bootstrap_p_value_over_groups` — the two-sided p-value of "the mean over groups is 0" from the
same resamples (same seed, same draws) as :func:`bootstrap_mean_over_groups`'s interval: the test that
the percentile interval inverts (p is about the smallest ``1 − level`` whose interval reaches 0). With
``c`` the number of resampled means on the side of 0 where fewer fall (a mean within ``1e-12`` of 0
counts on both sides), ``p = min(1, 2 (c + 1) / (resamples + 1))``: never 0 (the smallest is
``2 / (resamples + 1)``, 0.001 at 2,000 resamples), and below ``1 − level`` where the interval at
``level`` excludes 0, up to one resample at the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbudget.errors import KVBudgetError

#: Resamples per interval unless told otherwise.
DEFAULT_RESAMPLES = 2000
#: Coverage of the interval.
DEFAULT_LEVEL = 0.95
#: Seed of the resampling generator.
DEFAULT_SEED = 0
#: A resampled mean this close to 0 counts on both sides of it in :func:`bootstrap_p_value_over_groups`
#: (sums of per-task means that are exactly 0 in real numbers can be ±1e-17 in floating point).
ZERO_TOLERANCE = 1e-12


@dataclass(frozen=True)
class Interval:
    """A mean with its bootstrap interval ``[low, high]`` over ``n`` samples (all tasks together)."""

    mean: float
    low: float
    high: float
    n: int


def _check(resamples: int, level: float) -> None:
    if not (isinstance(resamples, int) and resamples >= 1):
        raise KVBudgetError(f"resamples must be an integer ≥ 1, got {resamples!r}")
    if not 0.0 < level < 1.0:
        raise KVBudgetError(f"level must be in (0, 1), got {level!r}")


def _as_array(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise KVBudgetError(f"{what} needs at least one value, got {len(values)}")
    if not np.all(np.isfinite(array)):
        raise KVBudgetError(f"{what} needs finite values, got {values!r}")
    return array


def _percentile_bounds(means: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def bootstrap_mean(
    values: Sequence[float],
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> Interval:
    """The mean of ``values`` (one per sample, shape ``[n]``) and its percentile-bootstrap interval."""
    _check(resamples, level)
    array = _as_array(values, "bootstrap_mean")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, array.size, size=(resamples, array.size))  # [resamples, n]
    low, high = _percentile_bounds(array[picks].mean(axis=1), level)
    return Interval(float(array.mean()), low, high, int(array.size))


def _group_resample_means(
    groups: Sequence[Sequence[float]], resamples: int, seed: int, what: str
) -> tuple[list[np.ndarray], np.ndarray]:
    """The groups as arrays and the ``[resamples]`` stratified bootstrap means over them (each
    resample redraws every group's samples with replacement, averages each group, then the groups)."""
    if not groups:
        raise KVBudgetError(f"{what} needs at least one group")
    arrays = [_as_array(g, what) for g in groups]
    rng = np.random.default_rng(seed)
    group_means = np.empty((resamples, len(arrays)))  # [resamples, groups]
    for g, array in enumerate(arrays):
        picks = rng.integers(0, array.size, size=(resamples, array.size))
        group_means[:, g] = array[picks].mean(axis=1)
    return arrays, group_means.mean(axis=1)


def bootstrap_mean_over_groups(
    groups: Sequence[Sequence[float]],
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> Interval:
    """The mean over ``groups`` (tasks) of each group's mean, with its stratified bootstrap interval.

    ``groups[g]`` holds task ``g``'s per-sample scores (shape ``[n_g]``); ``n`` of the result is the
    total sample count. With one group this is :func:`bootstrap_mean` of that group.
    """
    _check(resamples, level)
    arrays, means = _group_resample_means(groups, resamples, seed, "bootstrap_mean_over_groups")
    low, high = _percentile_bounds(means, level)
    mean = float(np.mean([a.mean() for a in arrays]))
    return Interval(mean, low, high, int(sum(a.size for a in arrays)))


def bootstrap_p_value_over_groups(
    groups: Sequence[Sequence[float]],
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> float:
    """Two-sided bootstrap p-value of "the mean over ``groups`` of each group's mean is 0".

    ``groups[g]``: task ``g``'s per-sample values (shape ``[n_g]``; for a paired comparison, each
    sample's difference). The resamples are :func:`bootstrap_mean_over_groups`'s with the same
    ``resamples`` and ``seed``, so the p-value and the interval come from one bootstrap:
    ``min(1, 2 (c + 1) / (resamples + 1))`` with ``c`` the resampled means on the rarer side of 0.
    """
    _check(resamples, DEFAULT_LEVEL)
    _, means = _group_resample_means(groups, resamples, seed, "bootstrap_p_value_over_groups")
    at_or_below = int(np.count_nonzero(means <= ZERO_TOLERANCE))
    at_or_above = int(np.count_nonzero(means >= -ZERO_TOLERANCE))
    rarer = min(at_or_below, at_or_above)
    return min(1.0, 2.0 * (rarer + 1) / (resamples + 1))
