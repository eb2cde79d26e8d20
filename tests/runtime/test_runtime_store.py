"""calibrate → certify → CertifiedRuntime: the deployed decisions are the calibrated ones.

A contract with a gate grid and certkv's probabilistic press is calibrated into a real store and
certified; the runtime built from each certified operating point then answers every calibration
request, and its answer and decision must be what the store's records imply.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from scheduler_checks import assert_scheduler_matches, budget_for

N_REQUESTS = 12


def _with_answer_prefix(request):
    """The request with the end of its question ("The magic number for cactus is") moved into its
    answer prefix, after the line break that ends the question: calibration and the runtime must
    encode it alike."""
    ask, mark, prefix = request.question.rpartition(" Answer: ")
    assert mark, request.question
    return request.model_copy(update={"question": f"{ask} Answer:", "answer_prefix": prefix})


def _contract(folder: Path, drops: list[float] | None = None, bounds: list[float] | None = None,
              query_aware: bool = False) -> Path:
    from certkv.requests.request_set import generate_requests, write_jsonl

    folder.mkdir(parents=True, exist_ok=True)
    requests = generate_requests("demo", N_REQUESTS, seed=515, context_length="200-320")
    write_jsonl([_with_answer_prefix(r) if i % 2 else r for i, r in enumerate(requests)], folder / "requests.jsonl")
    contract = {
        "name": "runtime",
        "model": "embedded",
        "requests": {"source": "requests.jsonl"},
        "protocol": {"max_new_tokens": 8, "device": "cpu", "query_aware": query_aware},
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


@pytest.fixture(scope="module", params=[False, True], ids=["question_agnostic", "query_aware"])
def calibrated(request, tmp_path_factory, embedded):
    """Calibrate a contract whose gate grid is wide (gated candidates cost nothing to calibrate),
    then test the grid values nearest the records' medians, so that the gate splits the requests;
    under each protocol (the runtime follows the operating point's)."""
    import statistics

    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract

    folder = tmp_path_factory.mktemp("runtime")
    contract = load_contract(_contract(folder, DROPS, BOUNDS, query_aware=request.param))
    summary = calibrate(contract, quiet=True)
    assert summary.calibrated == N_REQUESTS and not summary.skipped
    with CalibrationStore.read(folder / "store") as store:
        records = store.records()
    drops = {r["request_id"]: r["agreement_drop"] for r in records}.values()
    certs = [r["certificate_max"] for r in records if r["policy"] == "probabilistic@0.40"]
    threshold = min(DROPS, key=lambda t: abs(t - statistics.median(drops)))
    bound = min(BOUNDS, key=lambda b: abs(b - statistics.median(certs)))
    return contract, records, threshold, bound


def test_store_records_carry_the_gate_signals(calibrated):
    _, records, _, _ = calibrated
    by_request: dict[str, set] = {}
    for r in records:
        by_request.setdefault(r["request_id"], set()).add(r["agreement_drop"])
        if r["policy"] == "probabilistic@0.40":
            assert r["certificate_max"] > 0
        else:
            assert r["certificate_max"] is None
    assert all(len(v) == 1 and None not in v for v in by_request.values()), "one drop per request, on every record"


def test_certified_runtime_reproduces_the_store(calibrated, embedded):
    from certkv.calibration.certification import load_records
    from certkv.contract.spec import certification_spec
    from certkv.core.certify import certify
    from certkv.requests.request_set import read_jsonl
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, records, threshold, bound = calibrated
    model, tok = embedded
    table = load_records(contract).table
    op_all = certify(table, certification_spec(contract), contract_sha256=contract.sha256())
    by_key = {(r["request_id"], r["policy"]): r for r in records}
    requests = read_jsonl(contract.resolved_requests_path())
    tested = 0
    spec = certification_spec(contract)
    assert op_all.max_new_tokens == 8
    assert op_all.query_aware is contract.protocol.query_aware
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
        assert runtime.query_aware is contract.protocol.query_aware
        gated_count = 0
        answers = []
        for request in requests:
            full = by_key[(request.id, "full")]
            base = by_key[(request.id, op.base_policy)]
            out = runtime.generate(request.context, request.question, answer_prefix=request.answer_prefix)
            answers.append(out)
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
        # certkv serve's scheduler, a few requests' KV at a time, answers them all the same; the
        # probabilistic press decodes alone, so only its gated requests' full answers are batched
        assert_scheduler_matches(runtime, requests, budget=budget_for(runtime, requests), alone=answers,
                                 batching=candidate.press != "probabilistic" or gate is not None)
        tested += 1
    assert tested == len(names)
    assert sum(bool(r.answer_prefix) for r in requests) == N_REQUESTS // 2


# -- the gates of issue 16: confidence, lookahead, learned ----------------------------------------
#
# A pilot needs ≥ 100 certification requests, far more than a test calibrates; the gate settings
# are therefore built here, with thresholds placed between two recorded values (never on one),
# and the runtime's answers, decisions and signals are checked against the store's records.

SIGNAL_POLICIES = ("snapkv@0.30", "probabilistic@0.40")
#: Signals recomputed by the runtime agree with the records to this (batched vs one-lane decode).
SIGNAL_TOL = 1e-4


@pytest.fixture(scope="module")
def signals_store(tmp_path_factory, embedded):
    """A store calibrated under a contract whose pilot gates need every new signal."""
    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract

    folder = tmp_path_factory.mktemp("runtime_signals")
    path = _contract(folder, [0.1])
    data = yaml.safe_load(path.read_text())
    data["gate"].update({
        "pilot": 0.25,
        "confidence": {"quantiles": [0.2]},
        "lookahead": {"quantiles": [0.2]},
        "learned": {"quantiles": [0.2], "features": ["lookahead", "confidence", "agreement_drop", "context_length"]},
    })
    path.write_text(yaml.safe_dump(data))
    contract = load_contract(path)
    summary = calibrate(contract, quiet=True)
    assert summary.calibrated == N_REQUESTS and not summary.skipped
    with CalibrationStore.read(folder / "store") as store:
        records = store.records()
    return contract, {(r["request_id"], r["policy"]): r for r in records}


def _between(values: list[float], gap: float = 10 * SIGNAL_TOL) -> float:
    """A threshold that splits `values` near their median, in the widest gap of the middle half
    (so a value recomputed within the tolerance falls on the same side)."""
    ordered = sorted(values)
    n = len(ordered)
    lo, hi = max(1, n // 4), max(2, n - n // 4)
    i = max(range(lo, hi), key=lambda j: ordered[j] - ordered[j - 1])
    assert ordered[i] - ordered[i - 1] > gap, f"no clear gap to place a threshold in: {ordered}"
    return (ordered[i] + ordered[i - 1]) / 2


def _record_signals(record: dict, full: dict) -> dict:
    return {"lookahead_heads": record["lookahead_heads"], "confidence_min": record["confidence_min"],
            "logprob_mean": record["logprob_mean"], "agreement_drop": record["agreement_drop"],
            "context_tokens": full["context_tokens"]}


def _learned_model(features: list[str], n_heads: int, seed: int):
    """A fixed logistic model over `features` (the runtime must score it exactly as the core)."""
    import numpy as np

    from certkv.core.gate_features import expand_features
    from certkv.core.spec import LearnedGate

    names = expand_features(features, n_heads)
    rng = np.random.default_rng(seed)
    return LearnedGate(features=names, mean=[0.1] * len(names), scale=[0.5] * len(names),
                       coef=rng.normal(size=len(names)).tolist(), intercept=0.0)


def _gates(records: dict, requests) -> list[tuple[str, str, dict, str, bool]]:
    """(name, base policy, gate dict, reason when it fires, whether it escalates), thresholds
    from the records; each gate splits the requests."""
    from certkv.core.gate_features import learned_score

    ids = [r.id for r in requests]
    snap = [records[(i, "snapkv@0.30")] for i in ids]
    prob = [records[(i, "probabilistic@0.40")] for i in ids]
    full = [records[(i, "full")] for i in ids]
    n_heads = len(snap[0]["lookahead_heads"])
    pre = _learned_model(["lookahead", "agreement_drop", "context_length"], n_heads, seed=1)
    post = _learned_model(["lookahead", "confidence", "context_length"], n_heads, seed=2)
    score = lambda model, base: [learned_score(model, _record_signals(r, f)) for r, f in zip(base, full)]  # noqa: E731
    return [
        ("ungated", "snapkv@0.30", {}, None, False),
        ("agreement_drop", "snapkv@0.30", {"agreement_drop": _between([r["agreement_drop"] for r in snap])}, "gate", False),
        ("lookahead", "snapkv@0.30", {"lookahead": _between([r["lookahead_mass"] for r in snap])}, "lookahead", False),
        ("lookahead_sampled", "probabilistic@0.40",
         {"lookahead": _between([r["lookahead_mass"] for r in prob])}, "lookahead", False),
        ("confidence", "snapkv@0.30", {"confidence": _between([r["confidence_min"] for r in snap])}, "confidence", True),
        ("certificate", "probabilistic@0.40",
         {"certificate": _between([r["certificate_max"] for r in prob])}, "certificate", True),
        ("learned", "snapkv@0.30", {"learned": pre, "learned_threshold": _between(score(pre, snap))}, "learned", False),
        ("learned_confidence", "snapkv@0.30",
         {"learned": post, "learned_threshold": _between(score(post, snap))}, "learned", True),
    ]


def test_store_records_carry_the_new_signals(signals_store, embedded):
    contract, records = signals_store
    model, _ = embedded
    n_heads = model.config.num_hidden_layers * model.config.num_key_value_heads
    for (_, policy), record in records.items():
        assert 0 < record["confidence_min"] <= 1 and record["logprob_mean"] <= 0, record
        if policy in SIGNAL_POLICIES:
            assert len(record["lookahead_heads"]) == n_heads
            assert record["lookahead_mass"] == max(record["lookahead_heads"])


def test_runtime_equals_the_store_for_every_gate_kind(signals_store, embedded):
    """For an ungated candidate and each gate kind, the runtime's answer, decision and signals on
    every calibration request are the store's: evicted answer and signals of the base candidate,
    the full record's answer wherever the gate fires."""
    from certkv.core.gate_features import learned_score
    from certkv.core.gated import gated_mask
    from certkv.core.loss_table import LossTable
    from certkv.core.operating_point import ContractSummary, OperatingPoint
    from certkv.core.spec import GateSettings
    from certkv.requests.request_set import read_jsonl
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, records = signals_store
    model, tok = embedded
    requests = read_jsonl(contract.resolved_requests_path())
    table = LossTable.from_records(list(records.values()))
    for name, base_policy, gate, reason, escalates in _gates(records, requests):
        press, kv = base_policy.split("@")
        settings = GateSettings(**gate) if gate else None
        op = OperatingPoint(
            policy=f"{base_policy}+{name}", base_policy=base_policy, press=press, kv_retained=float(kv),
            mean_kv_retained=float(kv), fallback=False, gate=settings, max_new_tokens=8,
            press_kwargs={"seed": 5} if press == "probabilistic" else {},
            contract=ContractSummary(tolerance=0.0, risk=0.6, confidence=0.6, procedure="fixed_sequence"),
            n=N_REQUESTS, violations=0, empirical_risk=0.0, risk_upper_bound=0.6, p_value=0.1, candidates=[],
            sequences=[], guarantee="test", created="now", certkv_version="test",
        )
        runtime = CertifiedRuntime(model, tok, op)
        fired, answers = {}, []
        for request in requests:
            full, base = records[(request.id, "full")], records[(request.id, base_policy)]
            out = runtime.generate(request.context, request.question, answer_prefix=request.answer_prefix)
            answers.append(out)
            d = out.decision
            signals = _record_signals(base, full)
            goes_full = (
                ("agreement_drop" in gate and base["agreement_drop"] < gate["agreement_drop"])
                or ("lookahead" in gate and base["lookahead_mass"] > gate["lookahead"])
                or ("confidence" in gate and base["confidence_min"] < gate["confidence"])
                or ("certificate" in gate and base["certificate_max"] > gate["certificate"])
                or ("learned" in gate and learned_score(gate["learned"], signals) > gate["learned_threshold"])
            )
            assert out.answer == (full["answer"] if goes_full else base["answer"]), (name, request.id, d)
            assert (d.mode, d.reason, d.escalated) == (
                ("full", reason, escalates) if goes_full else ("evicted", None, False)
            ), (name, request.id, d)
            assert d.gate_kind == (None if not gate else settings.kind)
            decoded = not goes_full or escalates  # the evicted answer was decoded: its signals exist
            if decoded:
                assert d.confidence_min == pytest.approx(base["confidence_min"], rel=SIGNAL_TOL)
                assert d.logprob_mean == pytest.approx(base["logprob_mean"], rel=SIGNAL_TOL, abs=SIGNAL_TOL)
            if decoded and press == "probabilistic":
                assert d.certificate_max == pytest.approx(base["certificate_max"], rel=SIGNAL_TOL)
            if runtime.gate.needs_lookahead:
                assert d.lookahead_heads == pytest.approx(base["lookahead_heads"], abs=SIGNAL_TOL)
                assert d.lookahead_mass == pytest.approx(base["lookahead_mass"], abs=SIGNAL_TOL)
            if runtime.gate.needs_agreement:
                assert d.agreement_drop == pytest.approx(base["agreement_drop"], abs=1e-6)
            if "learned" in gate and (decoded or not runtime.gate.learned_post_decode):
                assert d.learned_score == pytest.approx(learned_score(gate["learned"], signals), abs=SIGNAL_TOL)
            if d.mode == "evicted":
                assert d.kv_retained_actual == pytest.approx(base["kv_retained_actual"])
            fired[request.id] = goes_full
        if gate:
            assert 0 < sum(fired.values()) < len(requests), f"{name}: the threshold should split the requests"
        # the requests the runtime sent to the full cache are those certification derives as gated
        derived = gated_mask(table, table.policies.index(base_policy), settings or GateSettings())
        assert dict(zip(table.request_ids, derived.tolist())) == fired, name
        assert_scheduler_matches(runtime, requests, budget=budget_for(runtime, requests), alone=answers,
                                 batching=press != "probabilistic" or bool(gate))
