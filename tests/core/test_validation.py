"""Repeated-split validation, and a simulation with known true risks that checks the promise."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import yaml
from conftest import run_main
from scipy.stats import binom

from certkv.calibration.certification import load_records
from certkv.calibration.validation_file import read_validation
from certkv.contract.loading import load_contract
from certkv.core.binomial import binomial_p_value_table
from certkv.core.certify import certify, decide, select_candidates
from certkv.core.loss_table import LossTable
from certkv.core.spec import CertificationSpec
from certkv.core.strata import stratum_spec
from certkv.core.validation import ValidationResult, calibration_masks, empirical_eligible, stratum_seed, validate
from certkv.errors import CertkvError

# ----------------------------------------------------------------------------- simulation

# Nested candidates, conservative first. The 0.05 candidate sits exactly at ε (choosing it is NOT
# an error); 0.051 is the hardest bad candidate: just above ε, so an anti-conservative procedure
# picks it often.
TRUE_RISKS = np.array([0.01, 0.02, 0.035, 0.05, 0.051, 0.08, 0.15])
KV = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
NAMES = [f"sim@{kv:.2f}" for kv in KV]
N_SIM, REPS, EPS, DELTA = 500, 20_000, 0.05, 0.05
MC_LIMIT = DELTA + 3 * np.sqrt(DELTA * (1 - DELTA) / REPS)  # δ + 3 Monte-Carlo SE ≈ 0.0546


def simulate_uniforms(seed: int = 12345) -> np.ndarray:
    """One uniform per request and replication: a request violates candidate j when u < r_j, so
    a request violating a conservative candidate also violates every more aggressive one."""
    return np.random.default_rng(seed).random((REPS, N_SIM), dtype=np.float32)


def violation_counts(u: np.ndarray) -> np.ndarray:
    return np.stack([(u < r).sum(axis=1) for r in TRUE_RISKS], axis=1)  # (REPS, candidates)


def certkv_error_rate(k: np.ndarray, confidence: float) -> float:
    """Share of replications where the certifier's choice has true risk > ε."""
    spec = CertificationSpec(tolerance=0.0, risk=EPS, confidence=confidence, sequences=[NAMES])
    p = binomial_p_value_table(N_SIM, EPS)[k]
    _, chosen = decide(p, np.broadcast_to(KV, k.shape), k, spec)
    return bad_choice(chosen).mean()


def bad_choice(chosen: np.ndarray) -> np.ndarray:
    return (chosen >= 0) & (TRUE_RISKS[np.maximum(chosen, 0)] > EPS)


@pytest.fixture(scope="module")
def simulation():
    u = simulate_uniforms()
    return u, violation_counts(u)


def test_certify_controls_the_error_rate_and_thresholding_does_not(simulation):
    _, k = simulation
    certified = certkv_error_rate(k, confidence=1 - DELTA)
    thresholding = bad_choice(
        select_candidates(empirical_eligible(k, N_SIM, EPS), np.broadcast_to(KV, k.shape), k)
    ).mean()
    # Exact: certify errs iff the 0.051 candidate has k ≤ 16 (the largest k certified at n = 500;
    # nested counts make the 0.05 candidate pass then too), probability ≈ 0.028.
    k_star = int(np.flatnonzero(binomial_p_value_table(N_SIM, EPS) <= DELTA)[-1])
    exact = binom.cdf(k_star, N_SIM, 0.051)
    se = np.sqrt(exact * (1 - exact) / REPS)
    assert certified <= MC_LIMIT
    assert abs(certified - exact) < 5 * se
    # Thresholding picks a candidate with k/n ≤ ε: the 0.051 candidate about half the time.
    assert thresholding > DELTA + 10 * np.sqrt(DELTA * (1 - DELTA) / REPS)
    assert thresholding > 0.3


def test_the_simulation_catches_an_anti_conservative_procedure(simulation):
    # Testing at 2δ (confidence 0.90) overpromises: its error rate (≈ 0.073) breaks the same
    # limit, so the assertion above is able to fail.
    _, k = simulation
    assert certkv_error_rate(k, confidence=1 - 2 * DELTA) > MC_LIMIT


def test_certify_makes_the_same_choice_as_the_vectorised_core(simulation):
    u, k = simulation
    spec = CertificationSpec(tolerance=0.0, risk=EPS, confidence=1 - DELTA, sequences=[NAMES])
    p = binomial_p_value_table(N_SIM, EPS)[k[:25]]
    _, chosen = decide(p, np.broadcast_to(KV, p.shape), k[:25], spec)
    for rep in range(25):
        violated = u[rep][:, None] < TRUE_RISKS[None, :]
        rows = [
            {"request_id": str(i), "policy": name, "kv_retained": float(kv),
             "loss": float(violated[i, j])}
            for i in range(N_SIM) for j, (name, kv) in enumerate(zip(NAMES, KV))
        ]
        op = certify(LossTable.from_records(rows), spec)
        expected = "full" if chosen[rep] < 0 else NAMES[chosen[rep]]
        assert op.policy == expected, rep


# ----------------------------------------------------------------------------- validate()


def loss_rows(n: int = 300, risks=(0.0, 0.02, 0.04, 0.1), seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    u = rng.random(n)
    return [
        {"request_id": f"r{i:04d}", "policy": f"p@{1 - 0.2 * (j + 1):.2f}",
         "kv_retained": round(1 - 0.2 * (j + 1), 2), "loss": float(u[i] < r),
         "task": "a" if i % 3 else "b"}
        for i in range(n) for j, r in enumerate(risks)
    ]


def spec_for(rows, **kw) -> CertificationSpec:
    names = list(dict.fromkeys(r["policy"] for r in rows))
    return CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[names], **kw)


def test_validate_reports_both_methods():
    rows = loss_rows()
    result = validate(LossTable.from_records(rows), spec_for(rows), n_splits=300, seed=1)
    assert (result.n_requests, result.n_calibration, result.n_test) == (300, 150, 150)
    data = json.loads(json.dumps(result.to_dict()))
    assert set(data["methods"]) == {"certkv", "empirical_thresholding"}
    for method in data["methods"].values():
        assert len(method["test_risks"]) == 300
        assert method["exceed_count"] == sum(r > 0.05 for r in method["test_risks"])
        assert method["exceed_ci_low"] <= method["exceed_fraction"] <= method["exceed_ci_high"]
        assert sum(method["chosen"].values()) == 300
        assert 0.0 <= method["fallback_share"] <= 1.0
    # Thresholding keeps less cache and exceeds ε more often than the certificate.
    cert, emp = result.methods["certkv"], result.methods["empirical_thresholding"]
    assert emp.mean_kv_retained <= cert.mean_kv_retained
    assert emp.exceed_fraction >= cert.exceed_fraction


def test_validate_is_reproducible_per_seed():
    rows = loss_rows()
    a = validate(LossTable.from_records(rows), spec_for(rows), n_splits=50, seed=3).methods["certkv"].test_risks
    b = validate(LossTable.from_records(rows), spec_for(rows), n_splits=50, seed=3).methods["certkv"].test_risks
    c = validate(LossTable.from_records(rows), spec_for(rows), n_splits=50, seed=4).methods["certkv"].test_risks
    assert a == b and a != c


def test_validate_split_matches_certify_on_the_calibration_half():
    rows = loss_rows(n=200)
    spec = spec_for(rows)
    result = validate(LossTable.from_records(rows), spec, n_splits=5, seed=7)
    ids = sorted({r["request_id"] for r in rows})
    masks = calibration_masks(np.random.default_rng(7), 5, len(ids), 100)
    for split in range(5):
        cal = {ids[i] for i in np.flatnonzero(masks[split])}
        op = certify(LossTable.from_records([r for r in rows if r["request_id"] in cal]), spec)
        test = [r for r in rows if r["request_id"] not in cal and r["policy"] == op.policy]
        risk = 0.0 if op.fallback else sum(r["loss"] > 0 for r in test) / len(test)
        assert result.methods["certkv"].test_risks[split] == pytest.approx(risk)


def test_fallback_counts_as_safe():
    rows = loss_rows(risks=(0.3, 0.5))
    result = validate(LossTable.from_records(rows), spec_for(rows), n_splits=20)
    cert = result.methods["certkv"]
    assert cert.fallback_share == 1.0 and cert.mean_kv_retained == 1.0
    assert cert.test_risks == [0.0] * 20 and cert.exceed_count == 0
    assert cert.chosen == {"full": 20}


def test_validate_handles_several_blocks_of_splits():
    rows = loss_rows(n=60)
    result = validate(LossTable.from_records(rows), spec_for(rows, procedure="holm"), n_splits=600, seed=2)
    assert len(result.methods["empirical_thresholding"].test_risks) == 600


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n_splits": 0}, "n_splits"),
        ({"n_splits": 2.5}, "n_splits"),
        ({"calibration_fraction": 1.0}, "calibration_fraction"),
        ({"calibration_fraction": 0.001}, "both halves"),
    ],
)
def test_validate_input_errors(kwargs, match):
    rows = loss_rows(n=20)
    with pytest.raises(CertkvError, match=match):
        validate(LossTable.from_records(rows), spec_for(rows), **kwargs)


def test_validate_takes_a_table_and_a_spec_only():
    rows = loss_rows(n=20)
    with pytest.raises(CertkvError, match="records must be a LossTable"):
        validate(rows, spec_for(rows))
    with pytest.raises(CertkvError, match="spec must be a CertificationSpec"):
        validate(LossTable.from_records(rows), spec_for(rows).model_dump())


# ----------------------------------------------------------------------------- stratified validate()

#: Known violation rates per stratum of four nested candidates (snapkv@0.80 … @0.20): "easy" supports
#: @0.40 (0.03 < ε), "hard" @0.80 at most (0.02; @0.60 is at 0.06 > ε).
STRATUM_RISKS = {"easy": (0.0, 0.01, 0.03, 0.2), "hard": (0.02, 0.06, 0.15, 0.3)}


def stratum_rows(sizes=None, seed: int = 0) -> list[dict]:
    """Rows of requests in strata (the task column) whose violations are drawn at STRATUM_RISKS; a request that
    violates one candidate violates every more aggressive one."""
    sizes = sizes or {"easy": 400, "hard": 300}
    rng = np.random.default_rng(seed)
    rows = []
    for name, n in sizes.items():
        risks = STRATUM_RISKS.get(name, STRATUM_RISKS["easy"])
        for i, u in enumerate(rng.random(n)):
            rows += [{"request_id": f"{name}{i:04d}", "policy": f"snapkv@{0.8 - 0.2 * j:.2f}",
                      "kv_retained": round(0.8 - 0.2 * j, 2), "loss": float(u < r), "task": name}
                     for j, r in enumerate(risks)]
    return rows


def stratified_spec(rows, simultaneous: bool = False, **kw) -> CertificationSpec:
    return spec_for(rows, strata={"by": "task", "simultaneous": simultaneous}, **kw)


def comparable(result) -> dict:
    """A result without its note (a stratum's note may add why certkv cannot certify there)."""
    return {k: v for k, v in result.to_dict().items() if k != "note"}


@pytest.mark.parametrize("simultaneous", [False, True])
def test_each_stratum_is_validate_of_its_own_table(simultaneous):
    rows = stratum_rows()
    spec = stratified_spec(rows, simultaneous)
    result = validate(LossTable.from_records(rows), spec, n_splits=200, seed=5)
    assert result.by == "task" and sorted(result.strata) == ["easy", "hard"] and result.pilot is None
    per = stratum_spec(spec, 2)
    assert per.confidence == pytest.approx(0.975 if simultaneous else 0.95)
    for name, entry in result.strata.items():
        own = LossTable.from_records([r for r in rows if r["task"] == name])
        alone = validate(own, per, n_splits=200, seed=stratum_seed(5, name))
        assert entry.seed == stratum_seed(5, name) and entry.contract.confidence == per.confidence
        assert comparable(entry) == comparable(alone)
    # The known rates decide: easy always certifies a compressed candidate, hard mostly no more than @0.80.
    easy, hard = result.strata["easy"].methods["certkv"], result.strata["hard"].methods["certkv"]
    assert "full" not in easy.chosen and easy.mean_kv_retained < hard.mean_kv_retained
    assert hard.chosen.get("full", 0) + hard.chosen.get("snapkv@0.80", 0) > 0.8 * 200


def test_pooled_numbers_combine_the_strata_by_test_requests():
    rows = stratum_rows()
    result = validate(LossTable.from_records(rows), stratified_spec(rows), n_splits=300, seed=2)
    easy, hard = result.strata["easy"], result.strata["hard"]
    assert (result.n_requests, result.n_calibration, result.n_test) == (700, 350, 350)
    assert (easy.n_test, hard.n_test) == (200, 150)
    for method, pooled in result.methods.items():
        a, b = easy.methods[method], hard.methods[method]
        k = np.rint(np.asarray(a.test_risks) * 200).astype(int) + np.rint(np.asarray(b.test_risks) * 150).astype(int)
        assert pooled.test_risks == pytest.approx(list(k / 350))
        assert pooled.exceed_count == int((k > 0.05 * 350).sum())
        assert pooled.mean_kv_retained == pytest.approx((200 * a.mean_kv_retained + 150 * b.mean_kv_retained) / 350)
        assert pooled.fallback_share == pytest.approx((200 * a.fallback_share + 150 * b.fallback_share) / 350)
        assert pooled.chosen == {**{f"easy:{p}": c for p, c in a.chosen.items()},
                                 **{f"hard:{p}": c for p, c in b.chosen.items()}}
        assert sum(pooled.chosen.values()) == 2 * 300


def test_simultaneous_validates_each_stratum_at_delta_over_s():
    rows = stratum_rows(sizes={"easy": 400, "hard": 300, "easy2": 300})
    per_stratum = validate(LossTable.from_records(rows), stratified_spec(rows), n_splits=100, seed=1)
    joint = validate(LossTable.from_records(rows), stratified_spec(rows, simultaneous=True), n_splits=100, seed=1)
    assert [e.contract.confidence for e in joint.strata.values()] == pytest.approx([1 - 0.05 / 3] * 3)
    assert {e.contract.confidence for e in per_stratum.strata.values()} == {0.95}
    # A stricter level certifies no more aggressively on the very same splits.
    for name in joint.strata:
        assert (joint.strata[name].methods["certkv"].mean_kv_retained
                >= per_stratum.strata[name].methods["certkv"].mean_kv_retained)


def test_a_stratum_too_small_to_certify_gets_the_full_cache():
    rows = stratum_rows(sizes={"easy": 400, "tiny": 30})
    result = validate(LossTable.from_records(rows), stratified_spec(rows), n_splits=50, seed=0)
    tiny = result.strata["tiny"]
    # 15 calibration requests: at ε = δ = 0.05 a zero-violation certificate needs 59.
    assert tiny.n_calibration == 15 and tiny.methods["certkv"].chosen == {"full": 50}
    assert tiny.methods["certkv"].fallback_share == 1.0 and "full cache on every split" in tiny.note
    assert "59" in tiny.note
    assert "full" not in result.strata["easy"].methods["certkv"].chosen


@pytest.mark.parametrize(
    "sizes,pilot,match",
    [
        ({"easy": 400, "tiny": 1}, None, "split into 0 calibration and 1 test"),
        ({"easy": 400, "tiny": 60}, {"share": 0.25}, "fewer than the 100 a pilot must leave"),
    ],
)
def test_a_stratum_that_cannot_be_split_does_not_crash(sizes, pilot, match):
    rows = stratum_rows(sizes=sizes)
    result = validate(LossTable.from_records(rows), stratified_spec(rows, pilot=pilot), n_splits=40, seed=0)
    tiny = result.strata["tiny"]
    assert match in tiny.note and "too small to validate" in tiny.note and tiny.pilot is None
    for method in tiny.methods.values():
        assert method.chosen == {"full": 40} and method.test_risks == [0.0] * 40 and method.mean_kv_retained == 1.0
    easy = result.strata["easy"]
    assert (easy.pilot is not None) == (pilot is not None)
    assert result.n_test == easy.n_test + tiny.n_test


def test_stratified_result_round_trips_through_json():
    rows = stratum_rows()
    result = validate(LossTable.from_records(rows), stratified_spec(rows, pilot={"share": 0.25}), n_splits=30, seed=4)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["by"] == "task" and set(data["strata"]) == {"easy", "hard"}
    assert data["strata"]["easy"]["pilot"]["n_pilot"] == 100 and data["strata"]["easy"]["strata"] is None
    assert ValidationResult.model_validate(data) == result
    # An older validation.json (no by, no strata) still loads.
    old = validate(LossTable.from_records(rows), spec_for(rows), n_splits=10).to_dict()
    del old["by"], old["strata"]
    assert ValidationResult.model_validate(old).strata is None


def test_validate_command_writes_the_strata(tmp_path):
    rows = stratum_rows()
    records = tmp_path / "records.csv"
    with records.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    contract = {
        "name": "strata", "requests": {"source": "builtin:demo"}, "utility": "exact_match", "tolerance": 0.0,
        "risk": 0.05, "confidence": 0.95, "policies": [{"press": "snapkv", "kv_retained": [0.8, 0.6, 0.4, 0.2]}],
        "strata": {"by": "task", "simultaneous": True}, "store": "store",
    }
    path = tmp_path / "contract.yaml"
    path.write_text(yaml.safe_dump(contract, sort_keys=False))
    out = tmp_path / "v.json"
    assert run_main("validate", str(path), "--records", str(records), "--splits", "40", "-o", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["by"] == "task" and set(data["strata"]) == {"easy", "hard"}
    assert data["strata"]["hard"]["contract"]["confidence"] == pytest.approx(0.975)
    assert data["n_test"] == data["strata"]["easy"]["n_test"] + data["strata"]["hard"]["n_test"]
    # A report reuses this file; one an earlier certkv wrote (no format_version, no strata, same
    # hashes) is refused in one line that names the file, both versions and the command to re-run.
    contract = load_contract(path)
    evidence = load_records(contract, records)
    assert read_validation(out, contract, evidence).strata.keys() == {"easy", "hard"}
    assert data["format_version"] == 1
    del data["format_version"], data["by"], data["strata"]
    out.write_text(json.dumps(data))
    with pytest.raises(CertkvError) as err:
        read_validation(out, contract, evidence)
    assert str(err.value) == (f"{out}: format_version none (written by an earlier certkv build), this certkv reads 1; "
                              "re-run `certkv validate CONTRACT` to write it again")
    out.write_text(json.dumps({**data, "format_version": 2}))
    with pytest.raises(CertkvError, match="format_version 2, this certkv reads 1"):
        read_validation(out, contract, evidence)
