"""certkv's probabilistic press while decoding, calibrated and deployed: the runtime's answers are
the store's, ungated and behind a certificate bound, and the bound escalates exactly the requests
certification counted as gated.

A tiny contract on the embedded-recite model (builtin:recite, long recitations) names the press
`probabilistic_decoding` at kv_retained 0.6, sampled again every 8 forwards, with one certificate
bound placed between recorded certificates. A second entry at 0.8 holds the whole prompt until its
first compression (compress_prefill false), so its largest step certificate can come after the
answer departs from the full cache's: the certificate recompute gate (restart on the full cache at
the first step whose certificate exceeds a bound) is deployed on it with a bound that splits the
requests into the three cases certification tells apart, and runs as certification counted it.
"""

from __future__ import annotations

import pytest
import yaml

N_REQUESTS = 4
POLICY = "probabilistic_decoding@0.60"
KWARGS = {"compression_interval": 8, "seed": 3}
MAX_NEW = 48
DECODE_ONLY = "decode_only@0.80"
DECODE_ONLY_KWARGS = {"compression_interval": 8, "seed": 3, "compress_prefill": False}


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
        "policies": [{"press": "probabilistic_decoding", "kv_retained": [0.6], "press_kwargs": KWARGS},
                     {"press": "probabilistic_decoding", "label": "decode_only", "kv_retained": [0.8],
                      "press_kwargs": DECODE_ONLY_KWARGS}],
        "store": "store",
    }
    (folder / "contract.yaml").write_text(yaml.safe_dump(contract))
    contract = load_contract(folder / "contract.yaml")
    assert contract.cost_measure == "peak"  # it compresses while decoding
    assert calibrate(contract, quiet=True).calibrated == N_REQUESTS
    with CalibrationStore.read(folder / "store") as store:
        records = {(r["request_id"], r["policy"]): r for r in store.records()}
    return contract, records


def _point(gate=None, policy: str = POLICY, kwargs=None):
    from certkv.core.operating_point import ContractSummary, OperatingPoint

    kv = float(policy.split("@")[1])
    return OperatingPoint(
        policy=policy if gate is None else f"{policy}+{gate.kind}", base_policy=policy, press="probabilistic_decoding",
        kv_retained=kv, mean_kv_retained=kv, fallback=False, gate=gate, max_new_tokens=MAX_NEW,
        press_kwargs=KWARGS if kwargs is None else kwargs,
        contract=ContractSummary(tolerance=0.0, risk=0.6, confidence=0.6, procedure="fixed_sequence"),
        n=N_REQUESTS, violations=0, empirical_risk=0.0, risk_upper_bound=0.6, p_value=0.1, candidates=[],
        sequences=[], guarantee="test", created="now", certkv_version="test",
    )


def test_records_carry_the_certificate_and_a_bounded_peak(calibrated):
    _, records = calibrated
    for (_, policy), record in records.items():
        if policy == POLICY:
            assert record["certificate_max"] > 0  # every answer decoded over sampled entries
            # sampled at the prefill: the peak stays well below the full cache's, which holds every token
            assert record["memory"] == record["kv_peak"] and 0 < record["kv_peak"] < 0.9 and 0 < record["kv_time"] < 0.9


def test_runtime_answers_are_the_store_s(calibrated, embedded_recite):
    from certkv.model.generation import encode_request
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, records = calibrated
    model, tok = embedded_recite
    runtime = CertifiedRuntime(model, tok, _point())
    for request in contract.load_requests():
        out = runtime.generate(request.context, request.question, answer_prefix=request.answer_prefix)
        record = records[(request.id, POLICY)]
        assert out.answer == record["answer"], request.id
        assert out.decision.mode == "evicted"
        assert out.decision.certificate_max == pytest.approx(record["certificate_max"], rel=1e-5)
    # the path's own KV measurement is calibration's (the runtime answers through it)
    enc = encode_request(tok, request.context, request.question, request.answer_prefix)
    answer = runtime.path.answer(enc, MAX_NEW, {})
    assert (answer.kv_peak, answer.kv_time, answer.kept) == pytest.approx(
        (record["kv_peak"], record["kv_time"], record["kv_retained_actual"]))


def test_certificate_bound_escalates_as_certification_counted(calibrated, embedded_recite):
    from certkv.core.gated import derive_gated
    from certkv.core.loss_table import LossTable
    from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, records = calibrated
    model, tok = embedded_recite
    requests = contract.load_requests()
    certificates = sorted(records[(q.id, POLICY)]["certificate_max"] for q in requests)
    bound = (certificates[1] + certificates[2]) / 2  # two requests above it, two below
    gate = GateSettings(certificate=bound)
    spec = CertificationSpec(tolerance=0.0, risk=0.6, confidence=0.6, sequences=[[f"{POLICY}+cert"]],
                             candidate_info={f"{POLICY}+cert": CandidateInfo(base_policy=POLICY, gate=gate)})
    table = derive_gated(LossTable.from_records(list(records.values())), spec)
    assert table.gated[f"{POLICY}+cert"].gated_count == 2
    runtime = CertifiedRuntime(model, tok, _point(gate))
    for request in requests:
        base, full = records[(request.id, POLICY)], records[(request.id, "full")]
        out = runtime.generate(request.context, request.question, answer_prefix=request.answer_prefix)
        escalated = base["certificate_max"] > bound
        assert out.decision.escalated is escalated, request.id
        assert out.answer == (full["answer"] if escalated else base["answer"]), request.id
        assert out.decision.reason == ("certificate" if escalated else None)


def _case(record, bound: float) -> str:
    """How certification counts a request under a certificate recompute at `bound`."""
    if record["certificate_max_agreeing"] > bound:
        return "early"
    return "late" if record["certificate_max"] > bound else "kept"


def _three_way_bound(records, ids) -> float:
    """A bound midway between recorded certificates that leaves some request alone, restarts some
    before their first departure and some after it (the three cases)."""
    values = sorted({records[(i, DECODE_ONLY)][k] for i in ids for k in ("certificate_max", "certificate_max_agreeing")})
    for low, high in zip(values, values[1:]):
        bound = (low + high) / 2
        if {_case(records[(i, DECODE_ONLY)], bound) for i in ids} == {"kept", "early", "late"}:
            return bound
    raise AssertionError(f"no bound separates the three cases: {values}")


def test_certificate_max_agreeing_is_the_largest_step_certificate_up_to_the_departure(calibrated, embedded_recite):
    """Recomputed independently: each step's certificate from a decode under the press, the first
    departure from the full cache's own greedy answer."""
    from certkv.engine.decoding_run import run_decoding
    from certkv.model.generation import encode_request, full_kv_ids
    from certkv.presses.registry import build_press

    contract, records = calibrated
    model, tok = embedded_recite
    press = build_press("probabilistic_decoding", 0.8, DECODE_ONLY_KWARGS)
    later = 0
    for request in contract.load_requests():
        enc = encode_request(tok, request.context, request.question, request.answer_prefix)
        run, full = run_decoding(model, press, enc, MAX_NEW), full_kv_ids(model, enc, MAX_NEW)
        departs = next((t for t, (a, b) in enumerate(zip(run.token_ids, full)) if a != b), min(len(run.token_ids), len(full)))
        record = records[(request.id, DECODE_ONLY)]
        assert record["certificate_max_agreeing"] == pytest.approx(max(run.certificates[: departs + 1]), rel=1e-5)
        assert record["certificate_max"] == pytest.approx(max(run.certificates), rel=1e-5)
        later += record["certificate_max_agreeing"] < record["certificate_max"]
    assert later > 0  # some answer's largest certificate comes after its departure


def test_certificate_recompute_runs_as_certification_counted_it(calibrated, embedded_recite):
    """Per request: not restarted, the evicted answer; restarted at or before the first departure,
    the full answer (loss 0 in the derived table); restarted later, counted as violated (loss 1)."""
    from certkv.core.gated import derive_gated
    from certkv.core.loss_table import LossTable
    from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, records = calibrated
    model, tok = embedded_recite
    requests = contract.load_requests()
    bound = _three_way_bound(records, [q.id for q in requests])
    gate = GateSettings(certificate_recompute=bound)
    name = f"{DECODE_ONLY}+recc"
    spec = CertificationSpec(tolerance=0.0, risk=0.6, confidence=0.6, sequences=[[name]],
                             candidate_info={name: CandidateInfo(base_policy=DECODE_ONLY, gate=gate)})
    table = derive_gated(LossTable.from_records(list(records.values())), spec)
    derived = dict(zip(table.request_ids, table.loss[table.index_of(name)].tolist()))
    memory = dict(zip(table.request_ids, table.memory[table.index_of(name)].tolist()))
    runtime = CertifiedRuntime(model, tok, _point(gate, DECODE_ONLY, DECODE_ONLY_KWARGS))
    for request in requests:
        base, full = records[(request.id, DECODE_ONLY)], records[(request.id, "full")]
        out = runtime.generate(request.context, request.question, answer_prefix=request.answer_prefix)
        d, case = out.decision, _case(base, bound)
        if case == "kept":
            assert (out.answer, d.reason, d.recomputed_at) == (base["answer"], None, None), request.id
            assert (derived[request.id], memory[request.id]) == (base["loss"], base["memory"])
            continue
        assert (d.mode, d.reason, d.escalated, memory[request.id]) == ("full", "recompute", True, 1.0), request.id
        assert derived[request.id] == (0.0 if case == "early" else 1.0)
        if case == "early":
            assert out.answer == full["answer"], request.id
        else:  # the restart kept tokens the full cache would not have produced
            assert out.answer != full["answer"], request.id
    assert table.gated[name].gate.certificate_recompute == bound
    assert table.gated[name].gated_count == sum(_case(records[(q.id, DECODE_ONLY)], bound) != "kept" for q in requests)


def test_a_certificate_recompute_needs_the_probabilistic_decoding_press(embedded_recite):
    from certkv.core.spec import GateSettings
    from certkv.errors import CertkvError
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tok = embedded_recite
    point = _point(GateSettings(certificate_recompute=0.5)).model_copy(update={
        "press": "compression_ratio_decoding", "press_kwargs": {"base_press": "knorm", "compression_interval": 8}})
    with pytest.raises(CertkvError, match="only certkv's probabilistic_decoding press records"):
        CertifiedRuntime(model, tok, point)
