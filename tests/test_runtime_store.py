"""calibrate → certify → CertifiedRuntime: the deployed decisions are the calibrated ones.

A contract with a gate grid and certkv's probabilistic press is calibrated into a real store and
certified; the runtime built from each certified operating point then answers every calibration
request, and its answer and decision must be what the store's records imply.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

N_REQUESTS = 12


def _contract(folder: Path, drops: list[float] | None = None, bounds: list[float] | None = None) -> Path:
    from certkv.requests.request_set import generate_requests, write_jsonl

    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(generate_requests("demo", N_REQUESTS, seed=515, context_length="200-320"), folder / "requests.jsonl")
    contract = {
        "name": "runtime",
        "model": "embedded",
        "requests": {"source": "requests.jsonl"},
        "protocol": {"max_new_tokens": 8, "device": "cpu"},
        "utility": "exact_match",
        "tolerance": 0.0,
        "risk": 0.6,  # lenient: the point is deployment, not power
        "confidence": 0.6,
        "policies": [
            {"press": "snapkv", "kv_retained": [0.3]},
            {"press": "probabilistic", "kv_retained": [0.4], "press_kwargs": {"seed": 5}},
        ],
        "store": "store",
    }
    if drops or bounds:
        contract["gate"] = {k: v for k, v in (("agreement_drop", drops), ("certificate", bounds)) if v}
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump(contract))
    return path


DROPS = [-1.0, 0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4]
BOUNDS = [0.05, 0.1, 0.2, 0.4, 0.8, 1.6]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, embedded):
    """Calibrate a contract whose gate grid is wide (gated candidates cost nothing to calibrate),
    then test the grid values nearest the records' medians, so that the gate splits the requests."""
    import statistics

    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract

    folder = tmp_path_factory.mktemp("runtime")
    contract = load_contract(_contract(folder, DROPS, BOUNDS))
    summary = calibrate(contract, quiet=True)
    assert summary.calibrated == N_REQUESTS and not summary.skipped
    with CalibrationStore.read(folder / "store") as store:
        rows = store.records()
    drops = {r["request_id"]: r["agreement_drop"] for r in rows}.values()
    certs = [r["certificate_max"] for r in rows if r["policy"] == "probabilistic@0.40"]
    threshold = min(DROPS, key=lambda t: abs(t - statistics.median(drops)))
    bound = min(BOUNDS, key=lambda b: abs(b - statistics.median(certs)))
    return contract, rows, threshold, bound


def test_store_rows_carry_the_gate_signals(calibrated):
    _, rows, _, _ = calibrated
    by_request: dict[str, set] = {}
    for r in rows:
        by_request.setdefault(r["request_id"], set()).add(r["agreement_drop"])
        if r["policy"] == "probabilistic@0.40":
            assert r["certificate_max"] > 0
        else:
            assert r["certificate_max"] is None
    assert all(len(v) == 1 and None not in v for v in by_request.values()), "one drop per request, on every row"


def test_certified_runtime_reproduces_the_store(calibrated, embedded):
    from certkv.calibration.records import load_records
    from certkv.contract.spec import certification_spec
    from certkv.core.certify import certify
    from certkv.requests.request_set import read_jsonl
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, rows, threshold, bound = calibrated
    model, tok = embedded
    records = load_records(contract).table
    op_all = certify(records, contract)
    by_key = {(r["request_id"], r["policy"]): r for r in rows}
    requests = read_jsonl(contract.resolved_requests_path())
    tested = 0
    spec = certification_spec(contract)
    assert op_all.max_new_tokens == 8
    names = ("snapkv@0.30", "snapkv@0.30+drop{t}", "probabilistic@0.40", "probabilistic@0.40+drop{t}+cert{b}",
             "probabilistic@0.40+cert{b}")
    for name in names:
        name = name.format(t=format(threshold, "g"), b=format(bound, "g"))
        candidate = next(c for c in op_all.candidates if c.policy == name)
        info = spec.candidate_info[name]  # what certify records for the chosen candidate
        op = op_all.model_copy(update={
            "policy": candidate.policy, "base_policy": info.base_policy, "press": candidate.press,
            "kv_retained": candidate.kv_retained, "gate": info.gate, "fallback": False,
            "press_kwargs": info.press_kwargs,
        })
        runtime = CertifiedRuntime(model, tok, op)
        gated_count = 0
        for request in requests:
            full = by_key[(request.id, "full")]
            base = by_key[(request.id, op.base_policy)]
            out = runtime.generate(request.context, request.question)
            d = out.decision
            gate = candidate.gate
            gated = gate is not None and gate.agreement_drop is not None and base["agreement_drop"] < gate.agreement_drop
            escalated = (
                not gated and gate is not None and gate.certificate is not None
                and base["certificate_max"] > gate.certificate
            )
            expected = full["answer"] if gated or escalated else base["answer"]
            assert out.answer == expected, (name, request.id, d)
            assert d.reason == ("gate" if gated else "certificate" if escalated else None), (name, request.id, d)
            if gate is not None and gate.agreement_drop is not None:
                assert d.agreement_drop == pytest.approx(base["agreement_drop"], abs=1e-6)
            if d.mode == "evicted" and base["certificate_max"] is not None:
                assert d.certificate_max == pytest.approx(base["certificate_max"], rel=1e-4)
            gated_count += gated or escalated
        assert gated_count / len(requests) == pytest.approx(candidate.gated_share)
        if gate is not None:
            assert 0 < gated_count < len(requests), f"{name}: the grid value should split the requests"
        tested += 1
    assert tested == len(names)
