"""The grouped certificate's statistics (certkv.core.grouped), checked against independent computations.

The Hoeffding–Bentkus p-value is compared with MAPIE's implementation of the same formula and
with a direct scipy evaluation of its two terms; the any-question measure with the exact binomial
test; and a seeded simulation at the boundary of the hypothesis shows each p-value valid (the
rejection rate at δ stays within δ plus Monte-Carlo error) where the per-request binomial test,
on questions that fail together, is not.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mapie.risk_control.methods import compute_hoeffding_bentkus_p_value
from scipy.special import rel_entr
from scipy.stats import binom

from certkv.core.binomial import binomial_p_value, clopper_pearson_upper
from certkv.core.grouped import (
    Groups,
    betting_p_value,
    group_values,
    grouped_estimate,
    grouped_p_values,
    grouped_upper_bound,
    hoeffding_bentkus_p_value,
)


def test_hoeffding_bentkus_matches_mapie():
    rng = np.random.default_rng(0)
    for m in (1, 7, 60, 500):
        means = rng.uniform(0.0, 0.4, size=50)
        for risk in (0.02, 0.1, 0.3):
            ours = hoeffding_bentkus_p_value(means, m, risk)
            theirs = compute_hoeffding_bentkus_p_value(means, m, risk)[:, 0]
            np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0.0)


def test_hoeffding_bentkus_matches_its_two_terms_computed_directly():
    for mean, m, risk in [(0.0, 59, 0.05), (0.03, 200, 0.05), (0.125, 40, 0.1), (0.5, 10, 0.2)]:
        x = min(mean, risk)
        kl = float(rel_entr(x, risk) + rel_entr(1 - x, 1 - risk))
        expected = min(math.exp(-m * kl), math.e * float(binom.cdf(math.ceil(round(m * mean, 9)), m, risk)))
        assert float(hoeffding_bentkus_p_value(mean, m, risk)) == pytest.approx(expected, rel=1e-12)


def test_any_question_is_the_exact_binomial_test_on_contexts():
    k = np.array([0, 3, 0, 1, 0, 0, 2, 0, 0, 0] * 10)
    n = np.full(k.size, 4)
    hits = int((k > 0).sum())
    assert float(grouped_p_values(k, n, "any_question", 0.3)) == pytest.approx(binomial_p_value(hits, k.size, 0.3), rel=1e-12)
    assert float(grouped_upper_bound(k, n, "any_question", 0.9)) == pytest.approx(clopper_pearson_upper(hits, k.size, 0.9))
    assert float(grouped_upper_bound(np.ones(5, dtype=int), np.ones(5, dtype=int), "any_question", 0.9)) == 1.0


@pytest.mark.parametrize("measure", ["per_context", "per_question"])
def test_one_question_per_context_is_never_bolder_than_the_binomial_test(measure):
    ones = np.ones(200, dtype=int)
    for violated in range(0, 40, 3):
        k = np.r_[np.ones(violated, dtype=int), np.zeros(200 - violated, dtype=int)]
        for risk in (0.05, 0.1, 0.2):
            # At k = 0 Hoeffding's term is (1 − ε)^m, the binomial p-value itself: equal up to rounding.
            assert grouped_p_values(k, ones, measure, risk) >= binomial_p_value(violated, 200, risk) * (1 - 1e-12)


def test_per_question_tests_the_ratio_through_w():
    rng = np.random.default_rng(1)
    n = rng.integers(1, 9, size=80)
    k = rng.binomial(n, 0.05)
    big = int(n.max())
    w = (k + 0.1 * (big - n)) / big
    expected = hoeffding_bentkus_p_value(w.mean(), n.size, 0.1)
    assert float(grouped_p_values(k, n, "per_question", 0.1)) == pytest.approx(float(expected), rel=1e-12)
    # E[W] − ε = (E[k] − ε E[n]) / N: the sample version of the equivalence the test rests on.
    assert w.mean() - 0.1 == pytest.approx((k.mean() - 0.1 * n.mean()) / big)
    assert float(grouped_estimate(k, n, "per_question")) == pytest.approx(k.sum() / n.sum())


def test_equal_context_sizes_make_per_question_and_per_context_one_test():
    rng = np.random.default_rng(2)
    n = np.full(60, 5)
    k = rng.binomial(n, 0.04)
    assert grouped_p_values(k, n, "per_question", 0.1) == pytest.approx(grouped_p_values(k, n, "per_context", 0.1))


@pytest.mark.parametrize("measure", ["per_context", "per_question"])
def test_the_bound_is_the_edge_of_rejection(measure):
    rng = np.random.default_rng(3)
    n = rng.integers(1, 9, size=150)
    k = rng.binomial(n, 0.03)
    bound = float(grouped_upper_bound(k, n, measure, 0.9))
    assert grouped_p_values(k, n, measure, bound) <= 0.1 < grouped_p_values(k, n, measure, bound - 1e-6)
    assert bound > float(grouped_estimate(k, n, measure))
    # Vectorised over candidates and confidences at once, each bound as computed alone.
    both = grouped_upper_bound(np.stack([k, 2 * k.clip(max=n // 2)]), n, measure, np.array([0.9, 0.99]))
    assert both[0] == pytest.approx(bound)
    assert both[1] == pytest.approx(float(grouped_upper_bound(2 * k.clip(max=n // 2), n, measure, 0.99)))


def test_group_counts_are_per_group_sums():
    labels = ["c", "a", "b", "a", "c", "c"]
    groups = Groups.of(labels)
    flags = np.array([[1, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0]], dtype=bool)
    expected = [[sum(f for f, g in zip(row, labels) if g == name) for name in groups.names] for row in flags.tolist()]
    assert groups.counts(flags).tolist() == expected
    assert groups.sizes.tolist() == [labels.count(name) for name in groups.names]


def _boundary_draws(rng, draws: int, contexts: int, risk: float, together: bool):
    """Violations (draws, contexts) and sizes of clustered tables at the hypothesis's boundary.

    Sizes 1..8; a context's questions violate with a context-level rate of mean ε (all of them
    at once with probability ε when `together`, else a Beta rate), so every measure's true value
    is ε (per_context and per_question: E[rate] = ε, independent of the size)."""
    n = rng.integers(1, 9, size=(draws, contexts))
    if together:
        return n * (rng.random((draws, contexts)) < risk), n
    rate = rng.beta(0.5, 0.5 * (1 - risk) / risk, size=(draws, contexts))
    return rng.binomial(n, rate), n


@pytest.mark.parametrize("measure", ["per_context", "per_question"])
def test_hoeffding_bentkus_p_values_are_valid_at_the_boundary(measure):
    rng = np.random.default_rng(4)
    risk, delta, draws = 0.1, 0.1, 2000
    k, n = _boundary_draws(rng, draws, 60, risk, together=False)
    p = np.array([float(grouped_p_values(k[d], n[d], measure, risk, n_max=8)) for d in range(draws)])
    limit = delta + 3 * math.sqrt(delta * (1 - delta) / draws)
    assert (p <= delta).mean() <= limit


def test_naive_binomial_overpromises_where_the_grouped_test_holds():
    rng = np.random.default_rng(5)
    risk, delta, draws = 0.1, 0.1, 2000
    k, n = _boundary_draws(rng, draws, 100, risk, together=True)  # every question of a failing context fails
    naive = binom.cdf(k.sum(axis=1), n.sum(axis=1), risk)
    grouped = np.array([float(grouped_p_values(k[d], n[d], "per_question", risk, n_max=8)) for d in range(draws)])
    any_question = binom.cdf((k > 0).sum(axis=1), 100, risk)
    limit = delta + 3 * math.sqrt(delta * (1 - delta) / draws)
    assert (naive <= delta).mean() > 2 * delta  # questions that fail together: the per-request test is far off
    assert (grouped <= delta).mean() <= limit
    assert (any_question <= delta).mean() <= limit


def test_group_values_reject_an_unknown_measure():
    from certkv.errors import CertkvError

    with pytest.raises(CertkvError, match="grouping measure 'mean' is not one of"):
        group_values(np.zeros(2), np.ones(2), "mean")


@pytest.mark.parametrize("measure", ["per_context", "per_question", "any_question"])
def test_resamples_with_their_own_context_sizes_match_one_call_each(measure):
    rng = np.random.default_rng(6)
    n = rng.integers(1, 9, size=(4, 1, 50))  # 4 resamples, each with its own sizes
    k = rng.binomial(np.broadcast_to(n, (4, 3, 50)), 0.05)  # 3 candidates
    p = grouped_p_values(k, n, measure, 0.1)
    bound = grouped_upper_bound(k, n, measure, 0.9)
    for b in range(4):
        for c in range(3):
            assert p[b, c] == pytest.approx(float(grouped_p_values(k[b, c], n[b, 0], measure, 0.1)), rel=1e-12)
            assert bound[b, c] == pytest.approx(float(grouped_upper_bound(k[b, c], n[b, 0], measure, 0.9)), rel=1e-9)


def _betting_by_hand(x, risk, cap=0.75):
    """The betting p-value step by step in plain Python: running mean and variance with the
    (1/2, 1/4) pseudo-observation, the clipped bet, the wealth and its maximum."""
    total, squares, wealth, best = 0.5, 0.25, 1.0, 1.0
    mean_before, var_before = 0.5, 0.25
    for i, xi in enumerate(x, start=1):
        gap = risk - mean_before
        bet = min(max(gap / (var_before + gap * gap), 0.0), cap / (1 - risk))
        wealth *= 1 + bet * (risk - xi)
        best = max(best, wealth)
        total += xi
        mean_before = total / (i + 1)
        squares += (xi - mean_before) ** 2
        var_before = squares / (i + 1)
    return 1 / best


def test_betting_p_value_matches_a_step_by_step_computation():
    rng = np.random.default_rng(7)
    for size, risk in [(1, 0.1), (30, 0.05), (200, 0.1), (120, 0.3)]:
        x = rng.binomial(8, risk * 0.6, size=size) / 8
        assert float(betting_p_value(x, risk)) == pytest.approx(_betting_by_hand(x.tolist(), risk), rel=1e-10)
    batch = rng.random((3, 40)) * 0.2
    np.testing.assert_allclose(betting_p_value(batch, np.array([0.1, 0.2, 0.3])),
                               [_betting_by_hand(row.tolist(), r) for row, r in zip(batch, (0.1, 0.2, 0.3))], rtol=1e-10)


@pytest.mark.parametrize("measure", ["per_context", "per_question"])
@pytest.mark.parametrize("together", [True, False])
def test_betting_p_values_are_valid_at_the_boundary(measure, together):
    rng = np.random.default_rng(8)
    risk, delta, draws = 0.1, 0.1, 2000
    k, n = _boundary_draws(rng, draws, 80, risk, together=together)
    p = grouped_p_values(k, n, measure, risk, n_max=8, bound="betting")
    limit = delta + 3 * math.sqrt(delta * (1 - delta) / draws)
    assert (p <= delta).mean() <= limit


def test_betting_sees_low_variance_contexts_that_hoeffding_bentkus_cannot():
    rng = np.random.default_rng(9)
    n = np.full((500, 200), 8)
    k = rng.binomial(n, 0.06)  # questions fail independently: a context's share varies little
    bet = grouped_p_values(k, n, "per_question", 0.1, bound="betting")
    hb = grouped_p_values(k, n, "per_question", 0.1)
    assert (bet <= 0.05).mean() > 0.5 > 0.25 > (hb <= 0.05).mean()
    bound = grouped_upper_bound(k[0], n[0], "per_question", 0.95, bound="betting")
    assert grouped_p_values(k[0], n[0], "per_question", float(bound), bound="betting") <= 0.05
