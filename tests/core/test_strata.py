"""Strata and the coverage envelope (issue 17): certification per stratum, the two readings of δ,
the pooled summary, strata in contracts, loss tables and stores, the envelope's checks, and the
bad-input rules. Torch-free: synthetic loss tables and a synthetic store.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import certify_without_torch, run_main

from certkv.calibration.store import CalibrationStore
from certkv.contract.loading import load_contract, parse_contract
from certkv.contract.spec import certification_spec
from certkv.core.binomial import binomial_p_value
from certkv.core.certify import certify
from certkv.core.coverage import Coverage
from certkv.core.loss_table import LossTable, read_loss_table, records_sha256
from certkv.core.operating_point import OperatingPoint, load_operating_point
from certkv.core.spec import CertificationSpec, StrataConfig
from certkv.core.strata import fewest_requests, stratum_spec
from certkv.errors import CertkvError
from certkv.requests.request_set import Request, check_strata

POLICIES = ("snapkv@0.70", "snapkv@0.50", "snapkv@0.30")
#: True violation rates per stratum and candidate: "easy" supports compression, "hard" does not.
RATES = {"easy": (0.01, 0.02, 0.3), "hard": (0.2, 0.3, 0.6), "tiny": (0.0, 0.0, 0.0)}
SIZES = {"easy": 500, "hard": 400, "tiny": 40}
SPEC = {"tolerance": 0.0, "risk": 0.05, "confidence": 0.95, "sequences": [list(POLICIES)]}


def strata_rows(seed: int = 0, sizes=None, store: bool = False) -> list[dict]:
    """Synthetic records: each stratum's violations drawn at its known rates; contexts 200-599."""
    rng = np.random.default_rng(seed)
    rows = []
    for task, n in (sizes or SIZES).items():
        for i in range(n):
            rid = f"{task}-{i:04d}"
            full = dict(request_id=rid, task=task, policy="full", kv_retained=1.0, loss=0.0,
                        context_tokens=int(rng.integers(200, 600)))
            if store:
                full.update(press=None, utility=1.0, utility_full=1.0, answer="a")
            rows.append(full)
            for policy, rate in zip(POLICIES, RATES[task]):
                bad = bool(rng.random() < rate)
                row = dict(request_id=rid, task=task, policy=policy, press="snapkv", kv_retained=float(policy[-4:]),
                           loss=1.0 if bad else 0.0)
                if store:
                    row.update(utility=0.0 if bad else 1.0, utility_full=1.0, answer="b" if bad else "a")
                rows.append(row)
    return rows


@pytest.fixture(scope="module")
def table():
    return LossTable.from_records(strata_rows())


def spec_of(**strata) -> CertificationSpec:
    return CertificationSpec.parse({**SPEC, "strata": {"by": "task", **strata}})


def stratum_table(table: LossTable, name: str) -> LossTable:
    return table.take_requests([i for i, t in enumerate(table.tasks) if t == name])


# ----------------------------------------------------------------------------- certification


@pytest.mark.parametrize("simultaneous", [False, True])
def test_each_stratum_is_certified_on_its_own_requests(table, simultaneous):
    op = certify(table, spec_of(simultaneous=simultaneous))
    assert op.is_stratified and sorted(op.strata.entries) == ["easy", "hard", "tiny"]
    per = stratum_spec(spec_of(simultaneous=simultaneous), 3)
    assert per.confidence == pytest.approx(1 - 0.05 / 3 if simultaneous else 0.95)
    assert op.strata.confidence == per.confidence and op.strata.simultaneous is simultaneous
    for name in ("easy", "hard"):
        alone = certify(stratum_table(table, name), per)
        entry = op.strata.entries[name]
        assert (entry.policy, entry.n, entry.violations, entry.fallback) == (
            alone.policy, alone.n, alone.violations, alone.fallback)
        assert [c.p_value for c in entry.candidates] == [c.p_value for c in alone.candidates]
        assert [c.level for c in entry.candidates] == pytest.approx([per.delta] * 3)
    assert op.strata.entries["easy"].policy == "snapkv@0.50"
    assert op.strata.entries["hard"].fallback


def test_the_pooled_contract_falls_back_where_a_stratum_certifies(table):
    pooled = certify(table, CertificationSpec.parse(SPEC))
    assert pooled.fallback and pooled.mean_kv_retained == 1.0
    stratified = certify(table, spec_of())
    assert stratified.strata.entries["easy"].kv_retained <= 0.7 and stratified.mean_kv_retained < 1.0


def test_the_summary_sums_counts_and_pools_memory(table):
    op = certify(table, spec_of())
    entries = op.strata.entries.values()
    assert op.policy == op.base_policy == op.press == "stratified" and op.candidates == [] and op.p_value is None
    assert op.n == sum(e.n for e in entries) == table.n_requests
    assert op.violations == sum(e.violations for e in entries)
    assert op.mean_kv_retained == pytest.approx(sum(e.n * e.mean_kv_retained for e in entries) / op.n)
    assert op.risk_upper_bound == max(e.risk_upper_bound for e in entries) <= 0.05
    assert not op.fallback and op.per_task["easy"].n == SIZES["easy"]
    assert "per stratum" in op.guarantee or "on its own" in op.guarantee
    assert "at once" in certify(table, spec_of(simultaneous=True)).guarantee


def test_a_stratum_too_small_to_certify_falls_back_with_that_reason(table):
    op = certify(table, spec_of())
    tiny = op.strata.entries["tiny"]
    need = fewest_requests(stratum_spec(spec_of(), 3))
    assert tiny.fallback and tiny.n == SIZES["tiny"] < need
    assert "too small" in tiny.reason and f"fewer than the {need}" in tiny.reason
    assert any("tiny" in note and "too small" in note for note in op.notes)


@pytest.mark.parametrize("procedure,m", [("fixed_sequence", 1), ("bonferroni", 3), ("pilot_ordered", 1)])
def test_fewest_requests_is_the_smallest_zero_violation_count_that_passes(procedure, m):
    spec = CertificationSpec.parse({**SPEC, "procedure": procedure if procedure != "pilot_ordered" else "holm"})
    need = fewest_requests(spec)
    level = 0.05 / m
    assert binomial_p_value(0, need, 0.05) <= level < binomial_p_value(0, need - 1, 0.05)


def test_certified_sets_equal_mapie_fwer_control_on_each_stratum(table):
    """Per stratum, the certified candidates are MAPIE's family-wise rejections on the same exact
    binomial p-values (Bonferroni, Holm, and fixed-sequence testing), at δ or δ/S."""
    control_fwer = pytest.importorskip("mapie.risk_control.fwer_control").control_fwer
    for procedure, mapie_name in (("bonferroni", "bonferroni"), ("holm", "bonferroni_holm"),
                                  ("fixed_sequence", "fixed_sequence")):
        for simultaneous in (False, True):
            spec = CertificationSpec.parse({**SPEC, "procedure": procedure,
                                            "strata": {"by": "task", "simultaneous": simultaneous}})
            op = certify(table, spec)
            delta = stratum_spec(spec, 3).delta
            for name in ("easy", "hard"):
                entry = op.strata.entries[name]
                sub = stratum_table(table, name)
                k = (sub.loss[[sub.index_of(p) for p in POLICIES]] > 0).sum(axis=1)
                p = np.array([binomial_p_value(int(kj), sub.n_requests, 0.05) for kj in k])
                expected = sorted(int(i) for i in control_fwer(p, delta, mapie_name))
                assert [i for i, c in enumerate(entry.candidates) if c.certified] == expected


def test_operating_point_json_round_trip(table, tmp_path):
    op = certify(table, spec_of())
    path = op.write_json(tmp_path / "op.json")
    back = load_operating_point(path)
    assert back == op and back.entry_for("easy").policy == op.strata.entries["easy"].policy
    assert back.entry_for("nope") is None and back.entry_for(None) is None
    data = json.loads(path.read_text())
    assert data["strata"]["by"] == "task" and "coverage" in data["strata"]["entries"]["easy"]


def test_a_stratum_under_another_protocol_does_not_load(table, tmp_path):
    """Every stratum of a point deploys the top level's protocol; a file whose entry says otherwise
    (edited by hand, or stitched from two certifications) is refused in one line naming it."""
    data = certify(table, spec_of()).to_dict()
    data["strata"]["entries"]["easy"]["query_aware"] = True
    path = tmp_path / "op.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CertkvError, match="stratum 'easy' has query_aware true but the operating point has false") as info:
        load_operating_point(path)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- strata labels


def test_a_stratum_column_overrides_the_task(tmp_path):
    rows = strata_rows(sizes={"easy": 300, "hard": 300})
    for r in rows:
        r["stratum"] = "x" if r["request_id"].endswith(("0", "2", "4")) else "y"
    table = LossTable.from_records(rows)
    assert table.strata is not None and records_sha256(table) != records_sha256(LossTable.from_records(strata_rows(
        sizes={"easy": 300, "hard": 300})))
    op = certify(table, CertificationSpec.parse({**SPEC, "strata": {"by": "metadata.group"}}))
    assert sorted(op.strata.entries) == ["x", "y"] and op.coverage.by == "metadata.group"
    path = tmp_path / "t.csv"
    import csv

    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    assert read_loss_table(path).strata == table.strata


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda r: r.pop("stratum") if r["request_id"] == "easy-0003" else None, "has no metadata.group value"),
        (lambda r: r.update(stratum="") if r["request_id"] == "easy-0003" else None, "has no metadata.group value"),
        (lambda r: r.pop("stratum"), "needs a stratum column"),
    ],
)
def test_missing_or_empty_stratum_values_are_one_line_errors(change, match):
    rows = strata_rows(sizes={"easy": 200})
    for r in rows:
        r["stratum"] = "g"
    for r in rows:
        change(r)
    with pytest.raises(CertkvError, match=match) as err:
        certify(LossTable.from_records(rows), CertificationSpec.parse({**SPEC, "strata": {"by": "metadata.group"}}))
    assert "\n" not in str(err.value)


def test_by_must_name_the_task_or_a_metadata_key():
    with pytest.raises(Exception, match="must be 'task' or 'metadata.<key>'"):
        StrataConfig(by="context")
    assert StrataConfig(by="metadata.domain").by == "metadata.domain"


def _request(i, **fields):
    return Request(id=f"r{i}", context="c", question="q", answers=["a"], **fields)


def test_check_strata_names_what_is_wrong():
    assert check_strata([_request(1, task="a"), _request(2, task="b")], "task") == ["a", "b"]
    with pytest.raises(CertkvError, match="request 'r2' does not give it"):
        check_strata([_request(1, task="a"), _request(2)], "task")
    with pytest.raises(CertkvError, match="no request has this field; requests offer: task, metadata.lang"):
        check_strata([_request(1, metadata={"lang": "en"})], "metadata.domain")
    with pytest.raises(CertkvError, match="empty value"):
        check_strata([_request(1, metadata={"d": " "}), _request(2, metadata={"d": "x"})], "metadata.d")
    assert check_strata([_request(1, metadata={"d": 3})], "metadata.d") == ["3"]


def test_requests_without_metadata_serialise_and_hash_as_before():
    r = _request(1, task="a")
    assert "metadata" not in r.as_record() and _request(2, metadata={"k": "v"}).as_record()["metadata"] == {"k": "v"}


# ----------------------------------------------------------------------------- coverage


def test_every_operating_point_records_its_envelope(table):
    pooled = certify(table, CertificationSpec.parse({**SPEC, "max_new_tokens": 8, "context_margin": 0.1}))
    cov = pooled.coverage
    assert cov.strata == ["easy", "hard", "tiny"] and not cov.stratum_required and cov.max_new_tokens == 8
    lengths = table.context_tokens
    assert cov.context_tokens == (int(lengths.min()), int(lengths.max())) and cov.context_margin == 0.1
    stratified = certify(table, spec_of())
    assert stratified.coverage.stratum_required and stratified.coverage.strata == ["easy", "hard", "tiny"]
    easy = stratified.strata.entries["easy"].coverage
    assert easy.strata == ["easy"] and easy.by == "task"


def test_coverage_says_why_a_request_is_outside_it():
    cov = Coverage(by="task", strata=["a", "b"], stratum_required=True, context_tokens=(100, 200))
    assert cov.uncovered("a", 150) is None
    assert "names no stratum" in cov.uncovered(None, 150)
    assert "task 'c' was not calibrated; calibrated: a, b" == cov.uncovered("c", 150)
    assert "outside the calibrated 100-200 tokens" in cov.uncovered("a", 201)
    assert cov.uncovered("a", 99) is not None
    wide = cov.model_copy(update={"context_margin": 0.1})
    assert wide.uncovered("a", 220) is None and wide.uncovered("a", 90) is None and wide.uncovered("a", 221)
    pooled = Coverage(by="task", strata=["a"], context_tokens=None)
    assert pooled.uncovered(None, 10**6) is None and pooled.uncovered("z", 1) is not None


def test_older_operating_points_without_coverage_still_load(table):
    data = certify(table, CertificationSpec.parse(SPEC)).to_dict()
    data.pop("coverage")
    assert OperatingPoint.model_validate(data).coverage is None


# ----------------------------------------------------------------------------- contract and CLI

CONTRACT = {
    "name": "strata",
    "requests": {"source": "builtin:demo", "limit": 940},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.05,
    "confidence": 0.95,
    "policies": [{"press": "snapkv", "kv_retained": [0.7, 0.5, 0.3]}],
    "strata": {"by": "task"},
    "coverage": {"context_margin": 0.25},
    "store": "store",
}


def test_contract_strata_and_coverage_reach_the_spec():
    contract = parse_contract(CONTRACT, "test")
    spec = certification_spec(contract)
    assert spec.strata == StrataConfig(by="task") and spec.context_margin == 0.25
    plain = parse_contract({k: v for k, v in CONTRACT.items() if k not in ("strata", "coverage")}, "test")
    assert "strata" not in json.loads(plain.canonical_json()) and plain.sha256() != contract.sha256()


@pytest.mark.parametrize(
    "change,match",
    [
        ({"strata": {"by": "context"}}, "must be 'task' or 'metadata.<key>'"),
        ({"strata": {"by": "task", "simultanous": True}}, "simultanous"),
        ({"coverage": {"context_margin": -0.1}}, "context_margin"),
    ],
)
def test_bad_strata_in_a_contract_is_exit_2_with_one_line(tmp_path, capsys, change, match):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**CONTRACT, **change}, sort_keys=False))
    assert run_main("certify", str(path)) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1


@pytest.fixture(scope="module")
def strata_store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("strata")
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump(CONTRACT, sort_keys=False))
    contract = load_contract(path)
    rows = strata_rows(store=True)
    with CalibrationStore.open(contract.resolved_store_path(), contract) as store:
        for rid in dict.fromkeys(r["request_id"] for r in rows):
            store.write_request(rid, [{k: v for k, v in r.items() if k != "request_id"}
                                      for r in rows if r["request_id"] == rid])
    return path, rows


def test_certify_command_writes_a_stratified_operating_point(strata_store, tmp_path):
    path, rows = strata_store
    out = tmp_path / "op.json"
    assert run_main("certify", str(path), "-o", str(out)) == 0
    data = json.loads(out.read_text())
    loaded = load_contract(path)
    expected = certify(LossTable.from_records(rows), certification_spec(loaded), contract_sha256=loaded.sha256()).to_dict()
    for key in ("policy", "n", "violations", "mean_kv_retained", "coverage"):
        assert data[key] == expected[key]
    assert {k: v["policy"] for k, v in data["strata"]["entries"].items()} == {
        k: v["policy"] for k, v in expected["strata"]["entries"].items()}
    assert data["coverage"]["context_margin"] == 0.25


def test_export_then_certify_the_csv_keeps_the_strata(strata_store, tmp_path):
    path, _ = strata_store
    csv_path = tmp_path / "records.csv"
    assert run_main("export", str(path), "-o", str(csv_path)) == 0
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run_main("certify", str(path), "-o", str(a)) == 0
    certify_without_torch(str(path), "--records", str(csv_path), "-o", str(b))
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    assert da["records_sha256"] == db["records_sha256"]
    for name, entry in da["strata"]["entries"].items():
        assert entry["policy"] == db["strata"]["entries"][name]["policy"]
        assert entry["candidates"] == db["strata"]["entries"][name]["candidates"]


def test_a_stratum_whose_pilot_draws_nothing_falls_back():
    rows = strata_rows(sizes={"easy": 500, "hard": 150})
    spec = CertificationSpec.parse({**SPEC, "strata": {"by": "task"}, "pilot": {"share": 0.003, "min_certification": 1}})
    op = certify(LossTable.from_records(rows), spec)
    assert op.strata.entries["hard"].fallback and "draws no pilot request" in op.strata.entries["hard"].reason
    assert not op.strata.entries["easy"].fallback


def test_by_task_reads_the_task_even_when_a_stratum_column_exists():
    rows = strata_rows(sizes={"easy": 300, "hard": 300})
    for r in rows:
        r["stratum"] = "x"
    op = certify(LossTable.from_records(rows), spec_of())
    assert sorted(op.strata.entries) == ["easy", "hard"]


def test_simultaneous_levels_never_sum_above_delta():
    from certkv.core.spec import delta_of

    for delta in (0.05, 0.2, 0.1):
        for s in range(2, 9):
            spec = CertificationSpec.parse({**SPEC, "confidence": 1 - delta, "strata": {"by": "task", "simultaneous": True}})
            assert s * delta_of(stratum_spec(spec, s).confidence) <= spec.delta


def test_a_too_small_stratum_still_counts_its_tasks(table):
    op = certify(table, spec_of())
    assert op.strata.entries["tiny"].per_task["tiny"].n == SIZES["tiny"]
    assert sum(t.n for t in op.per_task.values()) == op.n
