"""certkv's probabilistic press while decoding, calibrated and deployed: the runtime's answers are
the store's, ungated and behind a certificate bound, and the bound escalates exactly the requests
certification counted as gated.

A tiny contract on the embedded-recite model (builtin:recite, long recitations) names the press
`probabilistic_decoding` at kv_retained 0.6, sampled again every 8 forwards, with one certificate
bound placed between recorded certificates.
"""

from __future__ import annotations

import pytest
import yaml

N_REQUESTS = 4
POLICY = "probabilistic_decoding@0.60"
KWARGS = {"compression_interval": 8, "seed": 3}
MAX_NEW = 48


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract

    folder = tmp_path_factory.mktemp("probabilistic_decoding")
    contract = {
        "name": "probabilistic_decoding",
        "model": "embedded-recite",
        "requests": {"source": "builtin:recite", "limit": N_REQUESTS, "seed": 77},
        "protocol": {"max_new_tokens": MAX_NEW, "device": "cpu"},
        "utility": "prefix_agreement",
        "tolerance": 0.0,
        "risk": 0.6,
        "confidence": 0.6,
        "policies": [{"press": "probabilistic_decoding", "kv_retained": [0.6], "press_kwargs": KWARGS}],
        "store": "store",
    }
    (folder / "contract.yaml").write_text(yaml.safe_dump(contract))
    contract = load_contract(folder / "contract.yaml")
    assert contract.cost_measure == "peak"  # it compresses while decoding
    assert calibrate(contract, quiet=True).calibrated == N_REQUESTS
    with CalibrationStore.read(folder / "store") as store:
        rows = {(r["request_id"], r["policy"]): r for r in store.records()}
    return contract, rows


def _point(gate=None):
    from certkv.core.operating_point import ContractSummary, OperatingPoint

    return OperatingPoint(
        policy=POLICY if gate is None else f"{POLICY}+cert", base_policy=POLICY, press="probabilistic_decoding",
        kv_retained=0.6, mean_kv_retained=0.6, fallback=False, gate=gate, max_new_tokens=MAX_NEW, press_kwargs=KWARGS,
        contract=ContractSummary(tolerance=0.0, risk=0.6, confidence=0.6, procedure="fixed_sequence"),
        n=N_REQUESTS, violations=0, empirical_risk=0.0, risk_upper_bound=0.6, p_value=0.1, candidates=[],
        sequences=[], guarantee="test", created="now", certkv_version="test",
    )


def test_rows_carry_the_certificate_and_a_bounded_peak(calibrated):
    _, rows = calibrated
    for (_, policy), row in rows.items():
        if policy == POLICY:
            assert row["certificate_max"] > 0  # every answer decoded over sampled entries
            # sampled at the prefill: the peak stays well below the full cache's, which holds every token
            assert row["memory"] == row["kv_peak"] and 0 < row["kv_peak"] < 0.9 and 0 < row["kv_time"] < 0.9


def test_runtime_answers_are_the_store_s(calibrated, embedded_recite):
    from certkv.model.generation import encode_request
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, rows = calibrated
    model, tok = embedded_recite
    runtime = CertifiedRuntime(model, tok, _point())
    for request in contract.load_requests():
        out = runtime.generate(request.context, request.question, answer_prefix=request.answer_prefix)
        row = rows[(request.id, POLICY)]
        assert out.answer == row["answer"], request.id
        assert out.decision.mode == "evicted"
        assert out.decision.certificate_max == pytest.approx(row["certificate_max"], rel=1e-5)
    # the path's own KV measurement is calibration's (the runtime answers through it)
    enc = encode_request(tok, request.context, request.question, request.answer_prefix)
    answer = runtime.path.answer(enc, MAX_NEW, {})
    assert (answer.kv_peak, answer.kv_time, answer.kept) == pytest.approx(
        (row["kv_peak"], row["kv_time"], row["kv_retained_actual"]))


def test_certificate_bound_escalates_as_certification_counted(calibrated, embedded_recite):
    from certkv.core.gated import derive_gated
    from certkv.core.loss_table import LossTable
    from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, rows = calibrated
    model, tok = embedded_recite
    requests = contract.load_requests()
    certificates = sorted(rows[(q.id, POLICY)]["certificate_max"] for q in requests)
    bound = (certificates[1] + certificates[2]) / 2  # two requests above it, two below
    gate = GateSettings(certificate=bound)
    spec = CertificationSpec(tolerance=0.0, risk=0.6, confidence=0.6, sequences=[[f"{POLICY}+cert"]],
                             candidate_info={f"{POLICY}+cert": CandidateInfo(base_policy=POLICY, gate=gate)})
    table = derive_gated(LossTable.from_records(list(rows.values())), spec)
    assert table.gated[f"{POLICY}+cert"].gated_count == 2
    runtime = CertifiedRuntime(model, tok, _point(gate))
    for request in requests:
        base, full = rows[(request.id, POLICY)], rows[(request.id, "full")]
        out = runtime.generate(request.context, request.question, answer_prefix=request.answer_prefix)
        escalated = base["certificate_max"] > bound
        assert out.decision.escalated is escalated, request.id
        assert out.answer == (full["answer"] if escalated else base["answer"]), request.id
        assert out.decision.reason == ("certificate" if escalated else None)
