"""Grouped conformal scale factors: the definition, and the guarantee the pooled quantile lacks."""

import math

import numpy as np
import pytest
from conformal_scale import grouped_scale_factor, pooled_scale_factor


def _brute_force(groups, alpha):
    """Smallest candidate z (one of the ratios) with n/(n+1)·mean share above z + 1/(n+1) ≤ alpha."""
    n = len(groups)
    for z in sorted(np.concatenate(groups)):
        risk = np.mean([np.mean(g > z) for g in groups])
        if math.isfinite(z) and n / (n + 1) * risk + 1 / (n + 1) <= alpha:
            return z
    return math.inf


@pytest.mark.parametrize("seed", range(5))
def test_grouped_factor_matches_its_definition(seed):
    rng = np.random.default_rng(seed)
    groups = [np.round(rng.exponential(size=rng.integers(1, 12)) * rng.uniform(0.2, 5), 1) for _ in range(25)]
    groups[3][0] = np.inf  # a zero certificate with a nonzero error
    assert grouped_scale_factor(groups, 0.1) == _brute_force(groups, 0.1)


def test_grouped_factor_controls_a_new_groups_uncovered_share_where_pooling_does_not():
    """Groups whose pairs share a scale (a request-level effect, as pairs of one request do): the
    pooled 95% quantile leaves more than 5% of a new group's pairs uncovered on average (about 2
    in 31 with 30 calibration groups); the grouped factor stays below 5%."""
    rng = np.random.default_rng(2026)
    grouped, pooled = [], []
    for _ in range(4000):
        groups = [rng.uniform(0.9, 1.1, size=20) * s for s in rng.lognormal(0, 1.0, size=31)]
        calibration, new = groups[:30], groups[30]
        grouped.append(np.mean(new > grouped_scale_factor(calibration, 0.05)))
        pooled.append(np.mean(new > pooled_scale_factor(np.concatenate(calibration), 0.95)))
    assert np.mean(grouped) + 3 * np.std(grouped) / np.sqrt(len(grouped)) <= 0.05
    assert np.mean(pooled) - 3 * np.std(pooled) / np.sqrt(len(pooled)) > 0.05


def test_too_few_groups_or_too_many_infinite_ratios_give_no_finite_factor():
    assert grouped_scale_factor([np.ones(5)] * 8, 0.1) == math.inf  # 1/(n+1) > 0.1 leaves no room
    assert grouped_scale_factor([np.ones(5)] * 9, 0.1) == 1.0  # 1/(n+1) = 0.1: just enough
    assert grouped_scale_factor([np.array([np.inf, 1.0])] * 50, 0.1) == math.inf


def test_pooled_factor_is_the_conformal_rank():
    ratios = np.arange(1.0, 20.0)  # 19 ratios: rank ⌈20 · 0.9⌉ = 18
    assert pooled_scale_factor(ratios, 0.9) == 18.0
    assert pooled_scale_factor(ratios, 0.99) == math.inf


@pytest.mark.parametrize(
    "groups, alpha, message",
    [
        ([np.ones(3)], 0.0, "alpha"),
        ([np.ones(3)], True, "alpha"),
        ([], 0.1, "at least one"),
        ([np.array([])], 0.1, "at least one"),
        ([np.array([np.nan])], 0.1, "NaN"),
        ([np.array([-1.0])], 0.1, "nonnegative"),
    ],
)
def test_bad_input_is_named(groups, alpha, message):
    with pytest.raises(ValueError, match=message):
        grouped_scale_factor(groups, alpha)
