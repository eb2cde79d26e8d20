"""One sampling unit (certkv/core/sampling_unit.py): requests and contexts behind one interface.

Both units are checked against what they compute, from outside certkv: the request unit against
scipy's binomial and statsmodels' Clopper–Pearson interval, the context unit against scipy over
contexts, MAPIE's Hoeffding–Bentkus p-value and the betting p-value written out by hand. The
figures pinned below were produced by the code before certify, strata, pilot and validation went
through the unit (each had its own ``spec.grouping is None`` branches), so a refactor that moves
a certificate, a p-value or a validation figure fails here; the last test keeps those branches
from coming back.
"""

from __future__ import annotations

import hashlib
import inspect
import re
from pathlib import Path

import numpy as np
import pytest
from mapie.risk_control.methods import compute_hoeffding_bentkus_p_value
from scipy.stats import binom
from statsmodels.stats.proportion import proportion_confint
from test_grouped import _betting_by_hand
from test_grouped_certify import by_context, clustered_rows
from test_validation import loss_rows

from certkv.core import certify as certify_module
from certkv.core import pilot as pilot_module
from certkv.core import strata as strata_module
from certkv.core import validation as validation_module
from certkv.core.certify import certify
from certkv.core.loss_table import LossTable
from certkv.core.pilot import draw_pilot, draw_pilot_groups
from certkv.core.sampling_unit import ContextUnit, RequestUnit, SamplingUnit, SplitBlock, UnitCounts, sampling_unit
from certkv.core.spec import CertificationSpec, GroupingConfig
from certkv.core.validation import calibration_masks, validate
from certkv.errors import CertkvError

POLICIES = ["p@0.70", "p@0.30"]
RISK = 0.1


def spec_of(**extra) -> CertificationSpec:
    return CertificationSpec(tolerance=0.0, risk=RISK, confidence=0.9, sequences=[POLICIES], **extra)


@pytest.fixture(scope="module")
def grouped_table() -> LossTable:
    return LossTable.from_records(clustered_rows(contexts=150, seed=0))


def violations_of(table: LossTable) -> np.ndarray:
    return table.loss[[table.index_of(p) for p in POLICIES]] > 0


UNITS = [
    ("request", {"independent_requests": True}),
    ("any_question", {"grouping": {"measure": "any_question"}}),
    ("per_context", {"grouping": {"measure": "per_context", "bound": "hoeffding_bentkus"}}),
    ("per_question", {"grouping": {"measure": "per_question", "bound": "hoeffding_bentkus"}}),
    ("betting", {"grouping": {"measure": "per_context", "bound": "betting"}}),
]


@pytest.mark.parametrize(("name", "extra"), UNITS, ids=[u[0] for u in UNITS])
def test_both_units_satisfy_one_interface(grouped_table, name, extra):
    spec = spec_of(**extra)
    unit = sampling_unit(spec)
    assert isinstance(unit, SamplingUnit) and isinstance(unit, RequestUnit if name == "request" else ContextUnit)
    unit.check(grouped_table)
    counts = unit.tally(grouped_table, violations_of(grouped_table))
    assert isinstance(counts, UnitCounts) and counts.k.shape == (2, unit.count(grouped_table)) == (2, counts.sizes.size)
    assert int(counts.k.sum()) == int(violations_of(grouped_table).sum())  # violations stay integers over questions
    p = unit.p_values(counts, RISK)
    levels = np.array([0.05, 0.05])
    bounds = unit.upper_bounds(counts, p, levels, RISK)
    assert p.shape == bounds.shape == (2,) and ((0 < p) & (p <= 1)).all() and ((0 <= bounds) & (bounds <= 1)).all()
    assert np.array_equal(p <= levels, bounds <= RISK)  # the bound reports the test's decision
    assert len(unit.candidate_fields(counts)) == 2
    split = unit.draw_pilot(grouped_table, 0.25, seed=3, min_certification=1)
    assert len(split.pilot_ids) + len(split.certification_ids) == grouped_table.n_requests
    block = unit.split_evidence(grouped_table, np.array([grouped_table.index_of(p) for p in POLICIES]), spec, n_cal=40)(
        calibration_masks(np.random.default_rng(0), 3, unit.count(grouped_table), 40)
    )
    assert isinstance(block, SplitBlock) and block.p.shape == block.k_cal.shape == block.empirical.shape == (3, 2)
    assert all(len(part) == 3 for part in block.score(np.array([0, -1, 1])))
    assert unit.guarantee(spec).startswith("With probability ≥ 0.9 over the calibration draw")


def test_the_request_unit_is_scipys_binomial_and_statsmodels_clopper_pearson(grouped_table):
    unit = RequestUnit(independent=True)
    counts = unit.tally(grouped_table, violations_of(grouped_table))
    k, n = counts.k.sum(axis=1), grouped_table.n_requests
    p = unit.p_values(counts, RISK)
    assert p == pytest.approx(binom.cdf(k, n, RISK), rel=1e-12)
    levels = np.array([0.01, 0.002])
    # a one-sided bound at level α is the upper end of the two-sided 1 − 2α interval
    expected = [proportion_confint(int(kj), n, alpha=2 * lv, method="beta")[1] for kj, lv in zip(k, levels)]
    assert unit.upper_bounds(counts, p, levels, RISK) == pytest.approx(expected, rel=1e-9)
    assert unit.candidate_fields(counts) == [{}, {}]


def test_the_context_unit_is_scipy_mapie_and_the_betting_wealth_over_contexts(grouped_table):
    rows = clustered_rows(contexts=150, seed=0)
    violations = violations_of(grouped_table)
    for i, policy in enumerate(POLICIES):
        pairs = by_context(rows, policy)  # (k_g, n_g) in the order certify bets in
        shares = [k / n for k, n in pairs]
        unit = ContextUnit(GroupingConfig(measure="any_question"))
        hits = sum(k > 0 for k, _ in pairs)
        assert unit.p_values(unit.tally(grouped_table, violations), RISK)[i] == pytest.approx(binom.cdf(hits, 150, RISK))
        unit = ContextUnit(GroupingConfig(measure="per_context", bound="hoeffding_bentkus"))
        mapie = compute_hoeffding_bentkus_p_value(np.array([np.mean(shares)]), 150, RISK)[0, 0]
        assert unit.p_values(unit.tally(grouped_table, violations), RISK)[i] == pytest.approx(float(mapie), rel=1e-9)
        unit = ContextUnit(GroupingConfig(measure="per_context", bound="betting"))
        assert unit.p_values(unit.tally(grouped_table, violations), RISK)[i] == pytest.approx(_betting_by_hand(shares, RISK))
        fields = unit.candidate_fields(unit.tally(grouped_table, violations))[i]
        assert fields == {"n_contexts": 150, "grouped_risk": pytest.approx(np.mean(shares), rel=1e-12)}


def test_certificates_are_what_they_were_before_the_unit(grouped_table):
    """Pinned from the code before the refactor: a grouped (betting, per_context) and a pooled (Holm) certificate."""
    op = certify(grouped_table, spec_of(grouping={"measure": "per_context", "bound": "betting"}))
    got = [(c.policy, c.p_value, c.risk_upper_bound, c.grouped_risk, c.n_contexts, c.violations, c.n) for c in op.candidates]
    assert got == [
        ("p@0.70", 2.2369559326855016e-05, 0.03124627444584771, 0.006388888888888888, 150, 5, 720),
        ("p@0.30", 0.010807760033603765, 0.06669149822926901, 0.04, 150, 36, 720),
    ]
    rows = loss_rows(n=600)
    names = list(dict.fromkeys(r["policy"] for r in rows))
    spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[names[:2], names[2:]], procedure="holm")
    op = certify(LossTable.from_records(rows), spec)
    assert [(c.p_value, c.risk_upper_bound, c.violations) for c in op.candidates] == [
        (4.306883985257408e-14, 0.007276772869199006, 0),
        (0.00012548769815573854, 0.03604010931726411, 12),
        (0.0062054401834796815, 0.04497772635255595, 17),
        (0.9999844454481525, 0.11158868192874212, 54),
    ]
    assert op.policy == "p@0.40" and op.n_contexts is None


def test_validation_figures_are_what_they_were_before_the_unit(grouped_table):
    """Pinned from the two split loops validation had before one loop went through the unit."""
    result = validate(grouped_table, spec_of(grouping={"measure": "per_context", "bound": "betting"}), n_splits=60, seed=7)
    certkv, empirical = result.methods["certkv"], result.methods["empirical_thresholding"]
    assert (result.n_calibration, result.n_test) == (75, 75)
    assert (certkv.exceed_count, certkv.mean_kv_retained, certkv.chosen) == (0, 0.42, {"p@0.30": 42, "p@0.70": 18})
    assert sum(certkv.test_risks) == pytest.approx(2.0461111111111103, rel=1e-12)
    assert (empirical.exceed_count, empirical.mean_kv_retained, empirical.chosen) == (0, 0.3, {"p@0.30": 60})
    assert sum(empirical.test_risks) == pytest.approx(2.373333333333333, rel=1e-12)
    rows = loss_rows(n=600)
    names = list(dict.fromkeys(r["policy"] for r in rows))
    spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[names[:2], names[2:]], procedure="holm")
    result = validate(LossTable.from_records(rows), spec, n_splits=300, seed=7)  # more than one block of 256 splits
    certkv, empirical = result.methods["certkv"], result.methods["empirical_thresholding"]
    assert certkv.chosen == {"p@0.40": 91, "p@0.60": 148, "p@0.80": 61} and certkv.exceed_count == 0
    assert certkv.mean_kv_retained == 0.5800000000000088 and empirical.mean_kv_retained == 0.4000000000000075
    assert sum(certkv.test_risks) == pytest.approx(6.269999999999996, rel=1e-12)
    assert sum(empirical.test_risks) == pytest.approx(8.456666666666667, rel=1e-12)


@pytest.mark.parametrize(("name", "extra"), UNITS[:3], ids=[u[0] for u in UNITS[:3]])
def test_a_validation_split_decides_on_what_certify_would_see(grouped_table, name, extra):
    """A split's calibration p-values are the unit's p-values of the calibration units alone."""
    spec = spec_of(**extra)
    unit = sampling_unit(spec)
    n_units = unit.count(grouped_table)
    rows = np.array([grouped_table.index_of(p) for p in POLICIES])
    masks = calibration_masks(np.random.default_rng(5), 4, n_units, n_units // 2)
    block = unit.split_evidence(grouped_table, rows, spec, n_units // 2)(masks)
    codes = np.arange(grouped_table.n_requests) if name == "request" else _group_codes(grouped_table)
    for s, mask in enumerate(masks):
        half = grouped_table.take_requests(np.flatnonzero(mask[codes] > 0))
        assert block.p[s] == pytest.approx(unit.p_values(unit.tally(half, violations_of(half)), RISK), rel=1e-12)
        assert block.k_cal[s].tolist() == violations_of(half).sum(axis=1).tolist()


def _group_codes(table: LossTable) -> np.ndarray:
    from certkv.core.grouped import Groups

    return Groups.of(table.groups).codes


#: (size, sha256 of the comma-joined ids)[:16] of the pilots the code before the sampling unit drew on
#: `grouped_table` at share 0.25, seed 2: by request ``draw_pilot(ids, 0.25, 2)``, by context
#: ``draw_pilot(ids, 0.25, 2, min_certification=1, groups=groups)`` (its signature then).
PINNED_PILOTS = {"request": (180, "e9ee28dc66989142"), "context": (187, "a762a0fe15d69db4")}


def _fingerprint(split) -> tuple[int, str]:
    return len(split.pilot_ids), hashlib.sha256(",".join(split.pilot_ids).encode()).hexdigest()[:16]


def test_pilots_are_drawn_over_the_unit_as_before(grouped_table):
    by_request = RequestUnit(independent=True).draw_pilot(grouped_table, 0.25, seed=2)
    assert _fingerprint(by_request) == PINNED_PILOTS["request"]
    assert _same_split(by_request, draw_pilot(grouped_table.request_ids, 0.25, 2))
    by_context = ContextUnit(GroupingConfig()).draw_pilot(grouped_table, 0.25, seed=2, min_certification=1)
    assert _fingerprint(by_context) == PINNED_PILOTS["context"]
    assert _same_split(by_context, draw_pilot_groups(grouped_table.request_ids, grouped_table.groups, 0.25, 2, 1))
    pilot_groups = {grouped_table.groups[int(i)] for i in by_context.pilot_columns}
    assert not pilot_groups & {grouped_table.groups[int(i)] for i in by_context.certification_columns}  # whole contexts
    with pytest.raises(CertkvError, match="strictly between 0 and 1"):
        ContextUnit(GroupingConfig()).draw_pilot(grouped_table, 1.5, seed=2)


def _same_split(a, b) -> bool:
    return a.pilot_ids == b.pilot_ids and np.array_equal(a.certification_columns, b.certification_columns)


def test_checks_and_words_are_the_units():
    rows = [{"request_id": f"r{i}", "policy": "p@0.70", "kv_retained": 0.7, "loss": 0.0, "group": f"d{i // 2}"} for i in range(4)]
    table = LossTable.from_records(rows)
    with pytest.raises(CertkvError, match="requests share contexts"):
        RequestUnit().check(table)
    RequestUnit(independent=True).check(table)
    bare = LossTable.from_records([{k: v for k, v in r.items() if k != "group"} for r in rows])
    with pytest.raises(CertkvError, match="no group column"):
        ContextUnit(GroupingConfig()).check(bare)
    spec = spec_of(grouping={})
    assert "contexts drawn as in calibration" in sampling_unit(spec).guarantee(spec)
    assert sampling_unit(spec_of()).validation_note() == "" and "Split by context" in sampling_unit(spec).validation_note()
    with pytest.raises(CertkvError, match="test contexts out of 2; both halves need at least one context"):
        validate(table, CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.70"]], grouping={}),
                 n_splits=2, calibration_fraction=0.1)


def test_certify_strata_pilot_and_validation_never_ask_which_unit():
    """The factory is the one reader of ``spec.grouping``; the modules that use the unit hold no branch on it."""
    for module in (certify_module, strata_module, pilot_module, validation_module):
        source = Path(inspect.getfile(module)).read_text(encoding="utf-8")
        code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(">>>"))
        assert not re.search(r"\.grouping\b", code), f"{module.__name__} reads spec.grouping"
