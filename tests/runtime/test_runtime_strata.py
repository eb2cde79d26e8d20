"""calibrate → certify per stratum → CertifiedRuntime: each request is answered by its stratum's
certified policy, exactly as calibrated, and requests outside the coverage envelope by the full cache.

Requests carry a ``metadata.group`` label; the contract certifies per group, so the store records
carry each request's stratum, the export carries it, and the runtime routes on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from scheduler_checks import assert_scheduler_matches, budget_for

N_REQUESTS = 16


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, embedded):
    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract
    from certkv.requests.request_set import generate_requests, write_jsonl

    folder: Path = tmp_path_factory.mktemp("strata-runtime")
    requests = [
        r.model_copy(update={"metadata": {"group": ("north", "south")[i % 2]}})
        for i, r in enumerate(generate_requests("demo", N_REQUESTS, seed=616, context_length="200-320"))
    ]
    write_jsonl(requests, folder / "requests.jsonl")
    contract = {
        "name": "strata-runtime",
        "model": "embedded",
        "requests": {"source": "requests.jsonl"},
        "protocol": {"max_new_tokens": 8, "device": "cpu"},
        "utility": "exact_match",
        "tolerance": 0.0,
        "risk": 0.6,  # lenient: the point is routing and deployment, not power
        "confidence": 0.6,
        "policies": [{"press": "snapkv", "kv_retained": [0.5, 0.3]}, {"press": "knorm", "kv_retained": [0.5]}],
        "strata": {"by": "metadata.group"},
        "store": "store",
    }
    (folder / "contract.yaml").write_text(yaml.safe_dump(contract))
    contract = load_contract(folder / "contract.yaml")
    summary = calibrate(contract, quiet=True)
    assert summary.calibrated == N_REQUESTS
    with CalibrationStore.read(folder / "store") as store:
        records = store.records()
    return contract, records, requests


@pytest.fixture(scope="module")
def stratified(calibrated):
    from certkv.calibration.certification import load_records
    from certkv.contract.spec import certification_spec
    from certkv.core.certify import certify

    contract, _, _ = calibrated
    return certify(load_records(contract).table, certification_spec(contract), contract_sha256=contract.sha256())


def test_store_records_carry_each_requests_stratum(calibrated):
    _, records, requests = calibrated
    group = {r.id: r.metadata["group"] for r in requests}
    assert all(record["stratum"] == group[record["request_id"]] for record in records)


def test_the_operating_point_is_certified_per_group(stratified):
    assert stratified.is_stratified and sorted(stratified.strata.entries) == ["north", "south"]
    assert stratified.coverage.by == "metadata.group" and stratified.coverage.stratum_required
    assert any(not e.fallback for e in stratified.strata.entries.values())


def test_runtime_answers_each_request_with_its_strata_policy(calibrated, stratified, embedded):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    _, records, requests = calibrated
    by_key = {(r["request_id"], r["policy"]): r for r in records}
    runtime = CertifiedRuntime(*embedded, stratified)
    assert sorted(runtime.strata) == ["north", "south"]
    answers = []
    for request in requests:
        group = request.metadata["group"]
        entry = stratified.strata.entries[group]
        out = runtime.generate(request.context, request.question, group)
        answers.append(out)
        d = out.decision
        assert d.stratum == group and d.policy == entry.policy
        if entry.fallback:
            assert d.reason == "fallback" and out.answer == by_key[(request.id, "full")]["answer"]
        else:
            assert d.mode == "evicted" and d.reason is None
            assert out.answer == by_key[(request.id, entry.base_policy)]["answer"]
            assert d.kv_retained == entry.kv_retained
    # certkv serve's scheduler routes each request to its stratum's policy the same way, a fallback
    # stratum's requests (full cache) batched with the evicted ones
    assert_scheduler_matches(runtime, requests, budget=budget_for(runtime, requests), alone=answers,
                             strata=[r.metadata["group"] for r in requests])


def test_requests_outside_the_envelope_get_the_full_cache(calibrated, stratified, embedded):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    _, records, requests = calibrated
    by_key = {(r["request_id"], r["policy"]): r for r in records}
    runtime = CertifiedRuntime(*embedded, stratified)
    request = requests[0]
    full = by_key[(request.id, "full")]["answer"]
    for stratum, needle in ((None, "names no stratum"), ("east", "'east' was not calibrated")):
        out = runtime.generate(request.context, request.question, stratum)
        assert out.decision.mode == "full" and out.decision.reason == "uncovered" and needle in out.decision.detail
        assert out.answer == full and out.decision.stratum == stratum
    group = request.metadata["group"]
    short = runtime.generate(request.context[:200], request.question, group).decision
    assert short.reason == "uncovered" and "outside the calibrated" in short.detail
    longer = runtime.generate(request.context * 3, request.question, group).decision
    assert longer.reason == "uncovered" and "outside the calibrated" in longer.detail


def test_a_margin_widens_the_served_range(calibrated, stratified, embedded):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    _, _, requests = calibrated
    group = requests[0].metadata["group"]
    entry = stratified.strata.entries[group]
    low, high = entry.coverage.context_tokens
    wide = stratified.model_copy(update={"strata": stratified.strata.model_copy(update={"entries": {
        name: e.model_copy(update={"coverage": e.coverage.model_copy(update={"context_margin": 9.0})})
        for name, e in stratified.strata.entries.items()}})})
    out = CertifiedRuntime(*embedded, wide).generate(requests[0].context * 3, requests[0].question, group)
    assert out.decision.reason != "uncovered"


def test_a_press_object_is_refused_for_a_stratified_point(stratified, embedded):
    from certkv.errors import CertkvError
    from certkv.presses.registry import build_press
    from certkv.runtime.certified_runtime import CertifiedRuntime

    with pytest.raises(CertkvError, match="pass no press object"):
        CertifiedRuntime(*embedded, stratified, press=build_press("snapkv", 0.5))
    with pytest.raises(CertkvError, match="stratum must be a string"):
        CertifiedRuntime(*embedded, stratified).generate("a context", "q?", 3)


def test_export_carries_the_stratum_and_certifies_the_same(calibrated, tmp_path):
    from conftest import run_main

    from certkv.core.loss_table import read_loss_table

    contract, records, _ = calibrated
    path = contract.base_dir / "contract.yaml"
    out = tmp_path / "records.csv"
    assert run_main("export", str(path), "-o", str(out)) == 0
    table = read_loss_table(out)
    assert table.strata is not None and set(table.strata) == {"north", "south"}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run_main("certify", str(path), "-o", str(a)) == 0
    assert run_main("certify", str(path), "--records", str(out), "-o", str(b)) == 0
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    assert da["records_sha256"] == db["records_sha256"]
    assert {k: e["policy"] for k, e in da["strata"]["entries"].items()} == {
        k: e["policy"] for k, e in db["strata"]["entries"].items()}
