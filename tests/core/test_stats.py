"""Exact binomial statistics and family-wise error control (certkv.core.binomial, certkv.core.procedures)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from scipy.stats import binomtest
from statsmodels.stats.proportion import proportion_confint

from certkv.core.binomial import (
    binomial_p_value,
    binomial_p_value_table,
    clopper_pearson_upper,
    count_violations,
    violation_mask,
)
from certkv.core.procedures import (
    REGISTRY,
    SequenceStop,
    candidate_levels,
    certified_mask,
    check_delta,
    check_lengths,
    check_procedure,
)
from certkv.errors import CertkvError

GRID = [(n, k) for n in (1, 2, 7, 50, 333, 1200) for k in sorted({0, 1, n // 20, n // 2, n - 1, n})
        if 0 <= k <= n]


# ----------------------------------------------------------------------------- p-values, bounds


@pytest.mark.parametrize("n,k", GRID)
@pytest.mark.parametrize("risk", [0.01, 0.05, 0.3])
def test_p_value_matches_scipy_binomtest(n, k, risk):
    expected = binomtest(k, n, risk, alternative="less").pvalue
    assert binomial_p_value(k, n, risk) == pytest.approx(expected, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("n,k", GRID)
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_upper_bound_matches_statsmodels_two_sided_at_twice_alpha(n, k, confidence):
    # statsmodels' "beta" interval is two-sided: its upper end at alpha = 2δ is the one-sided
    # upper bound at level 1 − δ.
    _, upper = proportion_confint(k, n, alpha=2 * (1 - confidence), method="beta")
    upper = 1.0 if k == n else upper  # statsmodels returns NaN at k == n; the bound is 1
    assert clopper_pearson_upper(k, n, confidence) == pytest.approx(upper, rel=1e-9, abs=1e-12)


def test_bound_is_one_when_every_request_violates():
    assert clopper_pearson_upper(10, 10, 0.95) == 1.0


def test_n1200_eps_delta_005_certifies_47_not_48():
    assert binomial_p_value(47, 1200, 0.05) <= 0.05 < binomial_p_value(48, 1200, 0.05)
    assert clopper_pearson_upper(47, 1200, 0.95) <= 0.05 < clopper_pearson_upper(48, 1200, 0.95)


@pytest.mark.parametrize("n", [20, 100, 1200])
def test_bound_below_risk_iff_p_value_below_delta(n):
    for k in range(n + 1):
        p_ok = binomial_p_value(k, n, 0.05) <= 0.05
        u_ok = clopper_pearson_upper(k, n, 0.95) <= 0.05
        assert p_ok == u_ok, k


def test_p_value_table_equals_scalar_p_values():
    table = binomial_p_value_table(300, 0.05)
    assert table.shape == (301,)
    for k in (0, 5, 15, 300):
        assert table[k] == binomial_p_value(k, 300, 0.05)


def test_numpy_integers_are_accepted():
    assert binomial_p_value(np.int64(3), np.int32(100), 0.05) == binomial_p_value(3, 100, 0.05)


@pytest.mark.parametrize(
    "k,n,match",
    [
        (47.0, 1200, "integer count"),  # even integral floats: they come from n * mean
        (47.5, 1200, "integer count"),
        (np.float64(3.0), 100, "integer count"),
        (True, 10, "boolean"),
        ("3", 10, "integer count"),
        (3, 0, "at least 1"),
        (-1, 10, "between 0 and n"),
        (11, 10, "between 0 and n"),
        (3, 10.0, "integer count"),
    ],
)
def test_bad_counts_are_rejected_with_one_line(k, n, match):
    with pytest.raises(CertkvError, match=match) as err:
        binomial_p_value(k, n, 0.05)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, 1.5, float("nan"), "0.05", None])
def test_bad_probabilities_are_rejected(value):
    with pytest.raises(CertkvError):
        binomial_p_value(1, 10, value)
    with pytest.raises(CertkvError):
        clopper_pearson_upper(1, 10, value)


# ----------------------------------------------------------------------------- violations


def test_float_arithmetic_never_flips_a_violation():
    losses = [0.3 - 0.2, 0.8 - 0.7, 0.7 - 0.6, 1.1 - 1.0, 0.1]
    assert 0.8 - 0.7 > 0.1  # the naive comparison would flip this one
    assert count_violations(losses, 0.1) == 0
    assert count_violations([0.3 - 0.2 + 1e-6], 0.1) == 1  # a real excess still counts
    assert count_violations([1 / 3 - 1 / 3, 0.2 - 0.2], 0.0) == 0


def test_counts_are_python_ints():
    k = count_violations(np.array([0.5, 0.0, 1.0]), 0.0)
    assert type(k) is int and k == 2
    assert violation_mask([0.2, -0.1], 0.0).tolist() == [True, False]


def test_negative_losses_are_never_violations():
    assert count_violations([-1.0, -0.5, 0.0], 0.0) == 0


def test_nan_losses_are_rejected_not_counted_as_safe():
    with pytest.raises(CertkvError, match="NaN"):
        count_violations([0.0, float("nan")], 0.0)


@pytest.mark.parametrize("tolerance", [float("nan"), float("inf"), "0.1", None])
def test_bad_tolerance_is_rejected(tolerance):
    with pytest.raises(CertkvError, match="tolerance"):
        count_violations([0.0], tolerance)


# ----------------------------------------------------------------------------- procedures


@dataclass(frozen=True)
class FwerResult:
    """One decision of :func:`control_fwer`: per-candidate flags (``certified[s][j]`` for position
    j of sequence s), levels, and where each sequence stopped."""

    procedure: str
    delta: float
    certified: tuple[tuple[bool, ...], ...]
    levels: tuple[tuple[float, ...], ...]
    sequences: tuple[SequenceStop, ...]


def control_fwer(p_values, delta: float, procedure: str) -> FwerResult:
    """The procedures' steps on nested p-values (one list per sequence, in test order), the
    decision in the same nested shape: the tests' one-shot view of certkv.core.procedures."""
    procedure = check_procedure(procedure)
    delta = check_delta(delta)
    lengths = check_lengths([len(seq) for seq in p_values])
    flat = np.array([float(x) for seq in p_values for x in seq], dtype=float)
    if not np.all(np.isfinite(flat)):
        raise CertkvError("p-values must be finite numbers in [0, 1]")
    proc = REGISTRY[procedure]
    flags, levels = proc.mask(flat, lengths, delta), proc.levels(flat, lengths, delta)
    stops = np.cumsum(lengths)
    segments = list(zip((stops - np.asarray(lengths)).tolist(), stops.tolist()))
    return FwerResult(procedure=procedure, delta=delta,
                      certified=tuple(tuple(bool(x) for x in flags[a:b]) for a, b in segments),
                      levels=tuple(tuple(float(x) for x in levels[a:b]) for a, b in segments),
                      sequences=proc.stops(flags, lengths, delta))


def is_prefix(flags) -> bool:
    """True when the certified flags form a prefix (all True, then all False)."""
    seen_false = False
    for flag in flags:
        if flag and seen_false:
            return False
        seen_false = seen_false or not flag
    return True



def test_fixed_sequence_stops_at_first_failure_and_certifies_a_prefix():
    p = [[0.001, 0.01, 0.2, 0.001, 0.001]]  # the later small p-values must NOT be certified
    result = control_fwer(p, 0.05, "fixed_sequence")
    assert result.certified == ((True, True, False, False, False),)
    stop = result.sequences[0]
    assert (stop.stopped_at, stop.tested, stop.certified, stop.level) == (2, 3, 2, 0.05)
    assert is_prefix(result.certified[0])


def test_fixed_sequence_all_pass_has_no_stop():
    result = control_fwer([[0.01, 0.02]], 0.05, "fixed_sequence")
    assert result.certified == ((True, True),)
    assert result.sequences[0].stopped_at is None and result.sequences[0].tested == 2


def test_fixed_sequence_splits_delta_across_sequences():
    # 0.03 passes at δ = 0.05 but not at δ/2 = 0.025 once a second sequence shares the level.
    alone = control_fwer([[0.001, 0.03]], 0.05, "fixed_sequence")
    shared = control_fwer([[0.001, 0.03], [0.02, 0.024, 0.026]], 0.05, "fixed_sequence")
    assert alone.certified == ((True, True),)
    assert shared.certified == ((True, False), (True, True, False))
    assert [s.level for s in shared.sequences] == [0.025, 0.025]
    assert [s.stopped_at for s in shared.sequences] == [1, 2]


def test_fixed_sequence_level_is_inclusive():
    assert control_fwer([[0.05]], 0.05, "fixed_sequence").certified == ((True,),)


def test_fixed_sequence_certified_set_is_always_a_prefix():
    rng = np.random.default_rng(1)
    p = rng.uniform(0, 0.1, size=(500, 9))
    flags = certified_mask(p, [4, 5], 0.05, "fixed_sequence")
    for row in flags:
        assert is_prefix(row[:4]) and is_prefix(row[4:])


def test_bonferroni_uses_delta_over_all_candidates():
    p = [[0.004, 0.006], [0.001, 0.02, 0.0049]]  # N = 5, level 0.01
    result = control_fwer(p, 0.05, "bonferroni")
    assert result.certified == ((True, True), (True, False, True))  # not a prefix: allowed
    assert all(s.level == pytest.approx(0.01) for s in result.sequences)
    assert result.sequences[1].stopped_at == 1 and result.sequences[1].certified == 2


def test_holm_certifies_more_than_bonferroni_on_a_hand_computed_example():
    # N = 4, δ = 0.05. Sorted p: 0.010 (≤ 0.05/4 = 0.0125 ✓), 0.015 (≤ 0.05/3 = 0.0167 ✓),
    # 0.020 (≤ 0.05/2 = 0.025 ✓), 0.060 (> 0.05/1 ✗). Bonferroni (0.0125) certifies 0.010 only.
    p = [[0.015, 0.060], [0.010, 0.020]]
    holm = control_fwer(p, 0.05, "holm")
    bonf = control_fwer(p, 0.05, "bonferroni")
    assert holm.certified == ((True, False), (True, True))
    assert bonf.certified == ((False, False), (True, False))
    assert holm.levels == ((pytest.approx(0.05 / 3), 0.05), (0.0125, 0.025))
    assert holm.sequences[0].level is None


def test_holm_stops_stepping_down_at_the_first_failure():
    # Sorted: 0.001 ✓ (≤ 0.0125), 0.03 ✗ (> 0.0167): 0.04 and 0.045 are not certified even
    # though 0.04 ≤ 0.05/2 and 0.045 ≤ 0.05/1.
    p = [[0.001, 0.03, 0.04, 0.045]]
    assert control_fwer(p, 0.05, "holm").certified == ((True, False, False, False),)


def test_holm_never_certifies_less_than_bonferroni():
    rng = np.random.default_rng(2)
    p = rng.uniform(0, 0.05, size=(2000, 6)) ** 2
    holm, bonf = certified_mask(p, [3, 3], 0.05, "holm"), certified_mask(p, [3, 3], 0.05, "bonferroni")
    assert np.all(holm >= bonf)


def test_vectorised_masks_agree_with_the_one_shot_interface():
    rng = np.random.default_rng(3)
    p = rng.uniform(0, 0.04, size=(200, 5))
    for procedure in ("fixed_sequence", "bonferroni", "holm"):
        batch = certified_mask(p, [2, 3], 0.05, procedure)
        for row, flags in zip(p, batch):
            one = control_fwer([row[:2], row[2:]], 0.05, procedure)
            assert list(one.certified[0] + one.certified[1]) == flags.tolist()


def test_single_interleaved_order_is_one_sequence_at_full_delta():
    levels = candidate_levels(np.array([0.01, 0.02, 0.03]), [3], 0.05, "fixed_sequence")
    assert levels.tolist() == [0.05, 0.05, 0.05]


@pytest.mark.parametrize(
    "p,delta,procedure,match",
    [
        ([[0.01]], 0.05, "bh", "procedure must be one of"),
        ([], 0.05, "holm", "at least one sequence"),
        ([[0.01], []], 0.05, "holm", r"sequences\[1\] is empty"),
        ([[0.01]], 0.0, "holm", "delta"),
        ([[1.5]], 0.05, "holm", "p-values"),
        ([[float("nan")]], 0.05, "holm", "p-values"),
    ],
)
def test_procedure_input_errors(p, delta, procedure, match):
    with pytest.raises(CertkvError, match=match):
        control_fwer(p, delta, procedure)
