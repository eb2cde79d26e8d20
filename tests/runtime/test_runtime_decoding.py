"""A decoding-time point deployed: the runtime's answers are the store's, and its recompute gate
does what certification counted.

A contract with a decoding-time press (kvpress's CompressionRatioDecodingPress around TOVA,
compressing every 2 steps, which breaks many answers) is calibrated into a real store. The runtime
then answers every calibration request ungated, and behind a recompute gate whose threshold splits
the requests into the three cases certification tells apart: not restarted (the store's evicted
answer), restarted at or before the first departure from the full answer (the store's full
answer), restarted later (counted as violated).
"""

from __future__ import annotations

import pytest
import yaml

N_REQUESTS = 14
POLICY = "compression_ratio_decoding@0.60"
KWARGS = {"base_press": "tova", "compression_interval": 2}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract

    folder = tmp_path_factory.mktemp("decoding")
    contract = {
        "name": "decoding",
        "model": "embedded",
        "requests": {"source": "builtin:demo", "limit": N_REQUESTS, "seed": 21, "context_length": "100-200"},
        "protocol": {"max_new_tokens": 12, "device": "cpu"},
        "utility": "prefix_agreement",
        "tolerance": 0.0,
        "risk": 0.6,
        "confidence": 0.6,
        "policies": [{"press": "compression_ratio_decoding", "kv_retained": [0.6], "press_kwargs": KWARGS}],
        "store": "store",
    }
    (folder / "contract.yaml").write_text(yaml.safe_dump(contract))
    contract = load_contract(folder / "contract.yaml")
    assert contract.cost_measure == "peak"  # a decoding-time policy: candidates compare by peak KV
    assert calibrate(contract, quiet=True).calibrated == N_REQUESTS
    with CalibrationStore.read(folder / "store") as store:
        records = {(r["request_id"], r["policy"]): r for r in store.records()}
    return contract, records


def _point(gate):
    from certkv.core.operating_point import ContractSummary, OperatingPoint

    return OperatingPoint(
        policy=POLICY if gate is None else f"{POLICY}+recq", base_policy=POLICY, press="compression_ratio_decoding",
        kv_retained=0.6, mean_kv_retained=0.6, fallback=False, gate=gate, max_new_tokens=12, press_kwargs=KWARGS,
        contract=ContractSummary(tolerance=0.0, risk=0.6, confidence=0.6, procedure="fixed_sequence"),
        n=N_REQUESTS, violations=0, empirical_risk=0.0, risk_upper_bound=0.6, p_value=0.1, candidates=[],
        sequences=[], guarantee="test", created="now", certkv_version="test",
    )


def _three_way_threshold(records, ids) -> float:
    """A threshold r that leaves some requests alone, restarts some before their first departure
    and some after it (the three cases), midway between recorded values."""
    values = sorted({records[(i, POLICY)][k] for i in ids for k in ("confidence_min", "confidence_min_agreeing")})
    for low, high in zip(values, values[1:]):
        r = (low + high) / 2
        cases = {_case(records[(i, POLICY)], r) for i in ids}
        if cases == {"kept", "early", "late"}:
            return r
    raise AssertionError(f"no threshold separates the three cases: {values}")


def _case(record, r: float) -> str:
    if record["confidence_min_agreeing"] < r:
        return "early"
    return "late" if record["confidence_min"] < r else "kept"


def test_store_records_carry_the_generation_cost(calibrated):
    contract, records = calibrated
    for (_, policy), record in records.items():
        if policy == POLICY:
            assert record["memory"] == record["kv_peak"] and 0 < record["kv_time"] < 1 and record["kv_peak"] <= 1
            assert record["confidence_min_agreeing"] >= record["confidence_min"]


def test_ungated_runtime_answers_are_the_store_s(calibrated, embedded):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, records = calibrated
    model, tok = embedded
    runtime = CertifiedRuntime(model, tok, _point(None))
    for request in contract.load_requests():
        out = runtime.generate(request.context, request.question, answer_prefix=request.answer_prefix)
        assert out.answer == records[(request.id, POLICY)]["answer"], request.id
        assert out.decision.mode == "evicted" and out.decision.recomputed_at is None


def test_recompute_gate_runs_as_certification_counted_it(calibrated, embedded):
    """Per request: not restarted, the evicted answer; restarted early, the full answer (loss 0 in
    the derived table); restarted late, a restart the table counts as a violation (loss 1)."""
    from certkv.core.gated import derive_gated
    from certkv.core.loss_table import LossTable
    from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, records = calibrated
    model, tok = embedded
    requests = contract.load_requests()
    r = _three_way_threshold(records, [q.id for q in requests])
    gate = GateSettings(recompute=r)
    spec = CertificationSpec(tolerance=0.0, risk=0.6, confidence=0.6, sequences=[[f"{POLICY}+recq"]],
                             candidate_info={f"{POLICY}+recq": CandidateInfo(base_policy=POLICY, gate=gate)})
    table = derive_gated(LossTable.from_records(list(records.values())), spec)
    derived = dict(zip(table.request_ids, table.loss[table.index_of(f"{POLICY}+recq")].tolist()))
    runtime = CertifiedRuntime(model, tok, _point(gate))
    for request in requests:
        base, full = records[(request.id, POLICY)], records[(request.id, "full")]
        out = runtime.generate(request.context, request.question, answer_prefix=request.answer_prefix)
        d, case = out.decision, _case(base, r)
        if case == "kept":
            assert (out.answer, d.reason, d.recomputed_at) == (base["answer"], None, None), request.id
            assert derived[request.id] == base["loss"]
        else:
            assert (d.mode, d.reason, d.escalated) == ("full", "recompute", True), request.id
            assert d.recomputed_at is not None
            assert derived[request.id] == (0.0 if case == "early" else 1.0)
        if case == "early":
            assert out.answer == full["answer"], request.id
    assert table.gated[f"{POLICY}+recq"].gate.recompute == r


def test_a_recompute_gate_on_a_prefill_press_is_refused(embedded):
    from certkv.core.spec import GateSettings
    from certkv.errors import CertkvError
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tok = embedded
    point = _point(GateSettings(recompute=0.5)).model_copy(
        update={"press": "snapkv", "base_policy": "snapkv@0.60", "policy": "snapkv@0.60+recq", "press_kwargs": {}})
    with pytest.raises(CertkvError, match="only a decoding-time press"):
        CertifiedRuntime(model, tok, point)
