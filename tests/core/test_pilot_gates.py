"""Pilot gates (issue 16): the contract's gate.pilot, confidence/lookahead/learned quantiles and
procedure pilot_ordered; the signals in loss tables; the pilot draw, the thresholds and the learned
model placed on it; certification on the other requests only; split fixed-sequence testing.

Torch-free: synthetic loss tables and a synthetic store with the new signal columns.
"""

from __future__ import annotations

import csv
import hashlib
import json

import numpy as np
import pytest
import yaml
from conftest import certify_without_torch, run_main
from scipy import stats

from certkv.calibration.store import CalibrationStore
from certkv.contract.loading import load_contract, parse_contract
from certkv.contract.spec import certification_spec, sequences
from certkv.core.binomial import binomial_p_value
from certkv.core.certify import certify
from certkv.core.gate_features import expand_features, feature_vector, learned_score, learned_scores
from certkv.core.gated import derive_gated, gated_mask
from certkv.core.loss_table import LossTable, read_loss_table, records_sha256
from certkv.core.operating_point import OperatingPoint, load_operating_point
from certkv.core.pilot import draw_pilot, fit_learned_gate, resolve_pilot
from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings, LearnedGate
from certkv.core.validation import validate
from certkv.errors import CertkvError


def certify_under(rows, contract):
    """certify() of record dicts under a contract, bound to its hash as the commands bind it."""
    return certify(LossTable.from_records(rows), certification_spec(contract), contract_sha256=contract.sha256())


HEADS = 4

CONTRACT = {
    "name": "pilot",
    "requests": {"source": "builtin:demo", "limit": 400},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.1,
    "confidence": 0.9,
    "policies": [{"press": "snapkv", "kv_retained": [0.7, 0.5]}],
    "gate": {
        "pilot": 0.25,
        "confidence": {"quantiles": [0.1, 0.2]},
        "lookahead": {"quantiles": [0.1]},
        "learned": {"quantiles": [0.1, 0.3]},
    },
    "store": "store",
}
RATES = {"snapkv@0.70": 0.08, "snapkv@0.50": 0.2}


def contract_of(**changes):
    data = json.loads(json.dumps(CONTRACT))
    for key, value in changes.items():
        if key == "gate" and isinstance(value, dict) and value.pop("_merge", False):
            data["gate"].update(value)
        else:
            data[key] = value
    return parse_contract(data, "test")


def signal_rows(n: int = 400, seed: int = 0, rates=None, store: bool = False) -> list[dict]:
    """Synthetic records: violations drawn at `rates`, signals that predict them (a violating
    request has lower confidence and more evicted mass)."""
    rng = np.random.default_rng(seed)
    rates = rates or RATES
    rows = []
    for i in range(n):
        rid, task = f"r{i:04d}", ("a", "b")[i % 2]
        full = dict(request_id=rid, task=task, policy="full", kv_retained=1.0, loss=0.0,
                    context_tokens=int(rng.integers(200, 600)), agreement_drop=float(rng.normal()))
        if store:
            full.update(press=None, utility=1.0, utility_full=1.0, answer="a", confidence_min=0.9, logprob_mean=-0.05)
        rows.append(full)
        for policy, rate in rates.items():
            bad = bool(rng.random() < rate)
            conf = float(np.clip(rng.beta(2, 5) if bad else rng.beta(5, 2), 1e-6, 1.0))
            heads = (rng.random(HEADS) * (0.6 if bad else 0.3)).round(6)
            row = dict(request_id=rid, task=task, policy=policy, press="snapkv", kv_retained=float(policy[-4:]),
                       loss=1.0 if bad else 0.0, confidence_min=conf, logprob_mean=float(np.log(conf) / 2),
                       lookahead_heads=heads.tolist(), lookahead_mass=float(heads.max()),
                       agreement_drop=full["agreement_drop"])
            if store:
                row.update(utility=0.0 if bad else 1.0, utility_full=1.0, answer="b" if bad else "a")
            rows.append(row)
    return rows


@pytest.fixture(scope="module")
def rows():
    return signal_rows()


@pytest.fixture(scope="module")
def table(rows):
    return LossTable.from_records(rows)


# ----------------------------------------------------------------------------- contract


def test_contract_sequences_and_names():
    c = contract_of()
    assert sequences(c) == [
        ["snapkv@0.70", "snapkv@0.50"],
        ["snapkv@0.70+confq0.1", "snapkv@0.50+confq0.1"],
        ["snapkv@0.70+confq0.2", "snapkv@0.50+confq0.2"],
        ["snapkv@0.70+lookq0.1", "snapkv@0.50+lookq0.1"],
        ["snapkv@0.70+learnq0.1", "snapkv@0.50+learnq0.1"],
        ["snapkv@0.70+learnq0.3", "snapkv@0.50+learnq0.3"],
    ]
    assert c.gate.needs_lookahead and not c.gate.needs_agreement and c.gate.lookahead_tokens == 2
    assert c.gate.learned.features == ["lookahead", "confidence", "context_length"]
    spec = certification_spec(c)
    assert spec.pilot.share == 0.25 and spec.pilot.seed == 0
    info = spec.candidate_info["snapkv@0.50+learnq0.3"]
    assert info.pilot_gate.pilot_kind == "learned" and info.gate.quantile == 0.3 and info.gate.learned is None


def test_drop_gates_come_before_pilot_gates():
    c = contract_of(gate={"_merge": True, "agreement_drop": [0.2]})
    seqs = sequences(c)
    assert seqs[1] == ["snapkv@0.70+drop0.2", "snapkv@0.50+drop0.2"] and seqs[2][0] == "snapkv@0.70+confq0.1"
    assert c.gate.needs_agreement


def test_needs_properties_follow_the_learned_features():
    c = contract_of(gate={"pilot": 0.25, "learned": {"quantiles": [0.1], "features": ["confidence", "agreement_drop"]}})
    assert c.gate.needs_agreement and not c.gate.needs_lookahead


def test_hash_of_contracts_without_the_new_keys_is_unchanged():
    data = {**CONTRACT, "gate": {"agreement_drop": [0.1]}}
    c = parse_contract(data, "test")
    gate = json.loads(c.canonical_json())["gate"]
    assert set(gate) == {"agreement_drop", "certificate", "agreement_window", "agreement_top_k", "agreement_split"}
    assert "procedure" in json.loads(c.canonical_json())
    # the hash as computed before pilot keys existed: the same dump without them
    old = c.model_dump(mode="json")
    for key in ("order", "strata", "coverage", "kv_cost"):
        old.pop(key)
    for key in ("group_by", "group_measure", "group_bound"):
        old["requests"].pop(key)
    for policy in old["policies"]:  # policy entries had no KV format, nor endpoints, then
        for key in ("cache", "endpoint", "memory"):
            policy.pop(key)
    for key in ("route", "logprobs"):  # nor endpoint routes and log-probability requests
        old["protocol"].pop(key)
    old["gate"] = {k: old["gate"][k] for k in gate}
    expected = hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                              .encode()).hexdigest()
    assert c.sha256() == expected
    assert contract_of().sha256() != contract_of(gate={"_merge": True, "lookahead_tokens": 3}).sha256()


@pytest.mark.parametrize(
    ("gate", "procedure", "fragment"),
    [
        ({"pilot": 0.25, "confidnce": {"quantiles": [0.1]}}, None, "unknown key 'confidnce'"),
        ({"pilot": 0.25, "confidence": {"quantiles": [0.0]}}, None, "gate.confidence.quantiles: quantile 0.0 is outside (0, 1)"),
        ({"pilot": 0.25, "confidence": {"quantiles": [1.0]}}, None, "outside (0, 1)"),
        ({"pilot": 0.25, "lookahead": {"quantiles": [0.2, 0.1]}}, None, "sorted in increasing order"),
        ({"pilot": 0.25, "learned": {"quantiles": [0.1, 0.1]}}, None, "lists 0.1 twice"),
        ({"pilot": 0.25, "learned": {"quantiles": []}}, None, "gate.learned.quantiles"),
        ({"pilot": 0.25, "learned": {"quantiles": [0.1], "features": ["lookahed"]}}, None, "gate.learned.features.0"),
        ({"pilot": 0.25, "learned": {"quantiles": [0.1], "features": ["confidence", "confidence"]}}, None, "twice"),
        ({"pilot": 0.25, "learned": {"quantiles": [0.1], "feature": ["confidence"]}}, None, "unknown key"),
        ({"pilot": 0.0, "confidence": {"quantiles": [0.1]}}, None, "gate.pilot: the pilot share must be strictly"),
        ({"pilot": 1.0, "confidence": {"quantiles": [0.1]}}, None, "gate.pilot"),
        ({"pilot": 1.5, "confidence": {"quantiles": [0.1]}}, None, "gate.pilot"),
        ({"learned": {"quantiles": [0.1]}}, None, "gate.learned places its thresholds on a pilot split; add gate.pilot"),
        ({"confidence": {"quantiles": [0.1]}}, None, "add gate.pilot"),
        ({"lookahead": {"quantiles": [0.1]}}, None, "add gate.pilot"),
        ({"agreement_drop": [0.1]}, "pilot_ordered", "procedure pilot_ordered orders the candidates"),
        (None, "pilot_ordered", "add gate.pilot"),
        ({"pilot": 0.25}, None, "gate.pilot is used by nothing"),
        ({"pilot": 0.25, "lookahead": {"quantiles": [0.1]}, "lookahead_tokens": 0}, None, "gate.lookahead_tokens"),
    ],
)
def test_bad_pilot_gates_are_one_line_errors(gate, procedure, fragment):
    changes = {"gate": gate}
    if procedure is not None:
        changes["procedure"] = procedure
    with pytest.raises(CertkvError) as info:
        contract_of(**changes)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_pilot_ordered_and_order_exclude_each_other():
    with pytest.raises(CertkvError, match="remove one of them"):
        contract_of(procedure="pilot_ordered", order=["snapkv@0.50", "snapkv@0.70"], gate={"pilot": 0.3})
    assert sequences(contract_of(procedure="pilot_ordered", gate={"pilot": 0.3})) == [["snapkv@0.70", "snapkv@0.50"]]


def test_resolved_gate_settings_reject_out_of_range_thresholds():
    for bad in ({"lookahead": -0.1}, {"confidence": 1.5}, {"learned_threshold": 0.5}, {"quantile": 1.0}):
        with pytest.raises(ValueError):
            GateSettings(**bad)


def test_a_short_pilot_is_refused_at_certify_time():
    rows = signal_rows(n=120)
    with pytest.raises(CertkvError) as info:
        certify_under(rows, contract_of())
    message = str(info.value)
    assert "leaves 90 of 120 requests to certify, fewer than 100" in message and "calibrate at least 133" in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- loss table signals


def test_table_reads_the_signals(rows, table):
    assert table.confidence_min.shape == (2, 400) and table.lookahead_heads.shape == (2, 400, HEADS)
    assert table.context_tokens.shape == (400,)
    first = rows[1]
    r = table.request_ids.index(first["request_id"])
    p = table.index_of(first["policy"])
    assert table.confidence_min[p, r] == first["confidence_min"]
    np.testing.assert_array_equal(table.lookahead_heads[p, r], first["lookahead_heads"])
    assert table.context_tokens[r] == rows[0]["context_tokens"]


def test_csv_and_jsonl_tables_with_signals_hash_like_the_records(rows, table, tmp_path):
    fields = ["request_id", "task", "policy", "press", "kv_retained", "loss", "agreement_drop", "confidence_min",
              "logprob_mean", "lookahead_mass", "lookahead_heads", "context_tokens"]
    path = tmp_path / "t.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            cell = {k: r.get(k, "") for k in fields}
            cell["lookahead_heads"] = json.dumps(r["lookahead_heads"]) if "lookahead_heads" in r else ""
            writer.writerow(cell)
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    digest = records_sha256(table)
    assert records_sha256(read_loss_table(path)) == digest == records_sha256(read_loss_table(jsonl))
    np.testing.assert_array_equal(read_loss_table(path).lookahead_heads, table.lookahead_heads)


def test_records_hash_covers_the_signals_and_is_unchanged_without_them(rows, table):
    changed = [dict(r) for r in rows]
    changed[1]["confidence_min"] = 0.123
    assert records_sha256(LossTable.from_records(changed)) != records_sha256(table)
    heads = [dict(r) for r in rows]
    heads[1]["lookahead_heads"] = [0.0] * HEADS
    assert records_sha256(LossTable.from_records(heads)) != records_sha256(table)
    keys = ("confidence_min", "logprob_mean", "lookahead_mass", "lookahead_heads", "context_tokens")
    bare = [{k: v for k, v in r.items() if k not in keys} for r in rows]
    nulls = [{**r, **{k: None for k in keys}} for r in bare]
    assert records_sha256(LossTable.from_records(bare)) == records_sha256(LossTable.from_records(nulls))


def test_bad_signal_cells_are_one_line_errors(rows):
    bad = [dict(r) for r in rows]
    bad[1]["lookahead_heads"] = [0.1]
    with pytest.raises(CertkvError, match="lookahead_heads has 4 values, other rows 1"):
        LossTable.from_records(bad)
    bad[1]["lookahead_heads"] = "[0.1, oops"
    with pytest.raises(CertkvError, match="not a JSON list"):
        LossTable.from_records(bad)
    bad[1]["lookahead_heads"] = [-0.1, 0, 0, 0]
    with pytest.raises(CertkvError, match=r"attention masses in \[0, 1\]"):
        LossTable.from_records(bad)


# ----------------------------------------------------------------------------- the pilot draw


def test_pilot_draw_is_deterministic_and_reads_ids_only(table):
    split = draw_pilot(table.request_ids, 0.25, seed=7)
    ranked = sorted(table.request_ids, key=lambda r: hashlib.sha256(f"7:{r}".encode()).hexdigest())
    assert set(split.pilot_ids) == set(ranked[:100]) and len(split.certification_ids) == 300
    assert split.pilot_ids == tuple(sorted(split.pilot_ids))
    again = draw_pilot(table.request_ids, 0.25, seed=7)
    assert again.pilot_ids == split.pilot_ids
    np.testing.assert_array_equal(again.certification_columns, split.certification_columns)
    assert draw_pilot(table.request_ids, 0.25, seed=8).pilot_ids != split.pilot_ids
    # other losses, the same ids: the same pilot
    other = LossTable.from_records(signal_rows(seed=5))
    spec = certification_spec(contract_of(requests={"source": "builtin:demo", "seed": 7}))
    assert resolve_pilot(other, spec).split.pilot_ids == resolve_pilot(table, spec).split.pilot_ids == split.pilot_ids


def log_odds(mass):
    """The learned gate's lookahead feature, written out: log(m / (1 − m)), m clipped to [1e-6, 1 − 1e-6]."""
    mass = np.clip(mass, 1e-6, 1 - 1e-6)
    return np.log(mass / (1 - mass))


def test_thresholds_are_numpy_quantiles_of_the_pilot(table):
    spec = certification_spec(contract_of())
    res = resolve_pilot(table, spec)
    pilot = table.take_requests(res.split.pilot_columns)
    info = res.spec.candidate_info
    for base in ("snapkv@0.70", "snapkv@0.50"):
        row = pilot.index_of(base)
        assert info[f"{base}+confq0.1"].gate.confidence == np.quantile(pilot.confidence_min[row], 0.1)
        assert info[f"{base}+confq0.2"].gate.confidence == np.quantile(pilot.confidence_min[row], 0.2)
        assert info[f"{base}+lookq0.1"].gate.lookahead == np.quantile(pilot.lookahead_mass[row], 0.9)
        model = info[f"{base}+learnq0.3"].gate.learned
        assert model == info[f"{base}+learnq0.1"].gate.learned  # one fit per base candidate
        scores = learned_scores(model, np.column_stack([
            log_odds(pilot.lookahead_heads[row]), pilot.confidence_min[row], pilot.logprob_mean[row],
            np.log(pilot.context_tokens)]))
        assert info[f"{base}+learnq0.3"].gate.learned_threshold == pytest.approx(np.quantile(scores, 0.7), rel=1e-12)
        assert model.features == [*(f"lookahead[{i}]" for i in range(HEADS)), "confidence_min", "logprob_mean",
                                  "log_context_tokens"]
    assert res.table.n_requests == 300 and set(res.table.request_ids) == set(res.split.certification_ids)


def test_learned_gate_reproduces_sklearn(table):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    row = table.index_of("snapkv@0.50")
    features = expand_features(["lookahead", "confidence", "context_length"], HEADS)
    signals = table.signals_of(row)
    labels = table.loss[row] > 0
    model = fit_learned_gate(signals, features, labels)
    heads = table.lookahead_heads[row]
    x = np.column_stack([log_odds(heads), table.confidence_min[row], table.logprob_mean[row],
                         np.log(table.context_tokens)])
    reference = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=5000)).fit(x, labels)
    np.testing.assert_allclose(learned_scores(model, x), reference.predict_proba(x)[:, 1], rtol=0, atol=1e-12)
    # the runtime's per-request form gives the same score
    one = {"lookahead_heads": list(heads[3]), "confidence_min": x[3, HEADS], "logprob_mean": x[3, HEADS + 1],
           "context_tokens": float(table.context_tokens[3]), "agreement_drop": None}
    np.testing.assert_allclose(feature_vector(one, features), x[3])
    assert learned_score(model, one) == pytest.approx(reference.predict_proba(x[3:4])[0, 1], abs=1e-12)
    # and a list of per-request dicts fits the same model
    dicts = [{"lookahead_heads": list(heads[i]), "confidence_min": x[i, HEADS], "logprob_mean": x[i, HEADS + 1],
              "context_tokens": float(table.context_tokens[i])} for i in range(len(x))]
    assert fit_learned_gate(dicts, features, labels) == model
    assert LearnedGate.model_validate_json(model.model_dump_json()) == model


def test_a_pilot_of_one_class_gives_a_constant_model_that_gates_nothing():
    rows = signal_rows(rates={"snapkv@0.70": 0.0, "snapkv@0.50": 0.2})
    op = certify_under(rows, contract_of())
    gated = next(c for c in op.candidates if c.policy == "snapkv@0.70+learnq0.3")
    assert gated.gate.learned.coef == [0.0] * (HEADS + 3) and gated.gated_share == 0.0
    one_class = [n for n in op.notes if "gates nothing" in n]
    assert len(one_class) == 1 and "(one class on the pilot): no violation for 'snapkv@0.70'" in one_class[0]


def test_post_and_pre_decode_kinds():
    model = LearnedGate(features=["lookahead[0]", "log_context_tokens"], mean=[0, 0], scale=[1, 1], coef=[1, 1],
                        intercept=0)
    assert GateSettings(confidence=0.2).post_decode and GateSettings(certificate=0.1).post_decode
    assert not GateSettings(lookahead=0.2).post_decode and GateSettings(lookahead=0.2).pre_decode
    assert not GateSettings(learned=model, learned_threshold=0.5).post_decode
    with_conf = model.model_copy(update={"features": ["confidence_min", "log_context_tokens"]})
    assert GateSettings(learned=with_conf, learned_threshold=0.5).post_decode


# ----------------------------------------------------------------------------- gated masks


def test_gated_masks_of_the_new_kinds(table):
    row = table.index_of("snapkv@0.70")
    conf = table.confidence_min[row]
    np.testing.assert_array_equal(gated_mask(table, row, GateSettings(confidence=0.3)), conf < 0.3)
    mass = table.lookahead_mass[row]
    np.testing.assert_array_equal(gated_mask(table, row, GateSettings(lookahead=0.25)), mass > 0.25)
    features = expand_features(["lookahead", "context_length"], HEADS)
    model = fit_learned_gate(table.signals_of(row), features, table.loss[row] > 0)
    scores = learned_scores(model, np.column_stack([log_odds(table.lookahead_heads[row]), np.log(table.context_tokens)]))
    np.testing.assert_array_equal(gated_mask(table, row, GateSettings(learned=model, learned_threshold=0.4)),
                                  scores > 0.4)
    spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["snapkv@0.70+x"]], candidate_info={
        "snapkv@0.70+x": CandidateInfo(base_policy="snapkv@0.70", gate=GateSettings(confidence=0.3))})
    out = derive_gated(table, spec)
    g = out.index_of("snapkv@0.70+x")
    np.testing.assert_array_equal(out.loss[g], np.where(conf < 0.3, 0.0, table.loss[row]))
    np.testing.assert_array_equal(out.memory[g], np.where(conf < 0.3, 1.0, 0.7))
    assert out.gated["snapkv@0.70+x"].gate.confidence == 0.3


def test_a_table_without_the_signals_is_refused_with_the_recalibrate_hint(rows):
    bare = [{k: v for k, v in r.items() if k not in ("confidence_min", "logprob_mean")} for r in rows]
    with pytest.raises(CertkvError) as info:
        certify_under(bare, contract_of())
    message = str(info.value)
    assert "lacks `confidence_min`" in message and "certkv calibrate CONTRACT --new-store" in message
    assert "\n" not in message
    no_heads = [{k: v for k, v in r.items() if k != "lookahead_heads"} for r in rows]
    with pytest.raises(CertkvError, match="lacks `lookahead_heads`.*recalibrate"):
        certify_under(no_heads, contract_of())


# ----------------------------------------------------------------------------- certification


def test_certification_counts_the_certification_requests_only(rows, table):
    op = certify_under(rows, contract_of())
    split = draw_pilot(table.request_ids, 0.25, 0)
    assert op.pilot.n_pilot == 100 and op.pilot.n_certification == 300 and op.pilot.request_ids == list(split.pilot_ids)
    assert op.pilot.share == 0.25 and op.pilot.seed == 0
    cert = table.take_requests(split.certification_columns)
    for c in op.candidates:
        assert c.n == 300
        if "+" not in c.policy:
            k = int((cert.loss[cert.index_of(c.policy)] > 0).sum())
            assert c.violations == k
            assert c.p_value == pytest.approx(stats.binom.cdf(k, 300, 0.1), rel=1e-9)
            assert sum(t.n for t in c.per_task.values()) == 300
    conf = next(c for c in op.candidates if c.policy == "snapkv@0.50+confq0.2")
    base = cert.index_of("snapkv@0.50")
    gated = cert.confidence_min[base] < conf.gate.confidence
    assert conf.violations == int(((cert.loss[base] > 0) & ~gated).sum())
    assert conf.mean_kv_retained == pytest.approx(np.where(gated, 1.0, 0.5).mean())
    assert conf.gated_share == pytest.approx(gated.mean())
    assert op.records_sha256 == records_sha256(table)  # the evidence: pilot included
    assert any(n.startswith("pilot: 100 of 400 requests") for n in op.notes)


def test_operating_point_round_trips_with_pilot_and_learned_gate(rows, tmp_path):
    op = certify_under(rows, contract_of())
    learned = next(c for c in op.candidates if c.gate is not None and c.gate.learned is not None)
    path = op.write_json(tmp_path / "op.json")
    data = json.loads(path.read_text())
    assert data["pilot"]["n_pilot"] == 100 and len(data["pilot"]["request_ids"]) == 100
    back = load_operating_point(path)
    assert back.pilot == op.pilot
    assert next(c for c in back.candidates if c.policy == learned.policy).gate == learned.gate
    plain = certify_under(signal_rows(), contract_of(gate={"pilot": 0.25, "confidence": {"quantiles": [0.1]}},
                                               procedure="fixed_sequence"))
    assert "pilot" in plain.to_dict()
    assert "pilot" not in OperatingPoint.model_validate({**plain.to_dict(), "pilot": None}).to_dict()


def test_pilot_ordered_orders_by_pilot_risk_and_tests_at_full_delta(rows, table):
    contract = contract_of(procedure="pilot_ordered")
    spec = certification_spec(contract)
    res = resolve_pilot(table, spec)
    (order,) = res.spec.sequences
    assert sorted(order) == sorted(spec.candidates)
    keys = [(res.pilot_violations[n], -res.pilot_memory[n], spec.candidates.index(n)) for n in order]
    assert keys == sorted(keys)
    op = certify_under(rows, contract)
    assert [c.policy for c in op.candidates] == order and {c.level for c in op.candidates} == {0.1}
    assert len(op.sequences) == 1 and op.contract.procedure == "pilot_ordered"
    # the certified set equals a plain fixed-sequence run on that order, on the certification requests
    plain = CertificationSpec.parse({**res.spec.model_dump(), "procedure": "fixed_sequence", "pilot": None})
    reference = certify(res.table, plain)
    assert [c.certified for c in op.candidates] == [c.certified for c in reference.candidates]
    assert [c.p_value for c in op.candidates] == [c.p_value for c in reference.candidates]
    certified = [c.certified for c in op.candidates]
    assert certified == sorted(certified, reverse=True)  # a prefix
    assert op.policy == reference.policy


def test_pilot_ordered_controls_the_family_wise_error():
    """Known true rates around ε: the share of runs that certify any candidate whose true rate
    exceeds ε stays ≤ δ (plus Monte-Carlo slack)."""
    rng = np.random.default_rng(11)
    true = np.array([0.03, 0.06, 0.09, 0.11, 0.13, 0.16, 0.2])
    risk, delta, n, share = 0.1, 0.1, 400, 0.25
    names = [f"c{i}@{0.9 - 0.1 * i:.2f}" for i in range(len(true))]
    spec = CertificationSpec.parse({"tolerance": 0.0, "risk": risk, "confidence": 1 - delta,
                                    "procedure": "pilot_ordered", "sequences": [[x] for x in names],
                                    "pilot": {"share": share, "seed": 0}})
    ids = tuple(f"q{i:04d}" for i in range(n))
    reps, false = 300, 0
    for _ in range(reps):
        loss = (rng.random((len(true), n)) < true[:, None]).astype(float)
        memory = np.tile(np.array([0.9 - 0.1 * i for i in range(len(true))])[:, None], (1, n))
        table = LossTable(request_ids=ids, policies=tuple(names), press=("c",) * len(true),
                          kv_retained=memory[:, 0].copy(), loss=loss, memory=memory, kv_retained_actual=None,
                          tasks=None, source="simulation")
        op = certify(table, spec)
        false += any(c.certified and true[names.index(c.policy)] > risk for c in op.candidates)
    assert false / reps <= delta + 3 * np.sqrt(delta * (1 - delta) / reps)


def test_p_values_match_scipy(table):
    spec = certification_spec(contract_of(procedure="pilot_ordered"))
    op = certify(table, spec)
    for c in op.candidates:
        assert c.p_value == pytest.approx(stats.binom.cdf(c.violations, c.n, 0.1), rel=1e-9, abs=1e-300)
        assert c.p_value == pytest.approx(binomial_p_value(c.violations, c.n, 0.1))


def test_validation_splits_the_certification_requests_only(rows):
    contract = contract_of(procedure="pilot_ordered")
    result = validate(LossTable.from_records(rows), certification_spec(contract), n_splits=60, seed=2)
    assert result.n_requests == 300 and result.pilot.n_pilot == 100
    assert result.n_calibration + result.n_test == 300


# ----------------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def pilot_store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pilot")
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump({**CONTRACT, "procedure": "pilot_ordered"}, sort_keys=False))
    contract = load_contract(path)
    rows = signal_rows(store=True)
    with CalibrationStore.open(contract.resolved_store_path(), contract) as store:
        for rid in dict.fromkeys(r["request_id"] for r in rows):
            store.write_request(rid, [{k: v for k, v in r.items() if k != "request_id"}
                                      for r in rows if r["request_id"] == rid])
    return path, rows


def test_certify_and_validate_commands_on_a_pilot_store(pilot_store, tmp_path, capsys):
    path, rows = pilot_store
    out = tmp_path / "op.json"
    assert run_main("certify", str(path), "-o", str(out)) == 0
    printed = capsys.readouterr().out
    assert "pilot_ordered" in printed and "pilot: 100 of 400 requests" in printed
    data = json.loads(out.read_text())
    assert data["n"] == 300 and data["pilot"]["n_certification"] == 300
    assert data == {**data, **certify_under(rows, load_contract(path)).to_dict(), "created": data["created"],
                    "contract_sha256": data["contract_sha256"], "records_sha256": data["records_sha256"]}
    assert run_main("validate", str(path), "--splits", "30", "-o", str(tmp_path / "v.json")) == 0
    assert json.loads((tmp_path / "v.json").read_text())["n_requests"] == 300


def test_certify_on_a_table_with_signals_does_not_import_torch(pilot_store, tmp_path):
    path, rows = pilot_store
    table = tmp_path / "losses.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tf.json"
    certify_without_torch(str(path), "--records", str(table), "-o", str(out))
    assert json.loads(out.read_text())["pilot"]["n_pilot"] == 100


def test_a_short_store_is_exit_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CONTRACT, sort_keys=False))
    table = tmp_path / "t.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in signal_rows(n=110)))
    assert run_main("certify", str(path), "--records", str(table), "-o", str(tmp_path / "o.json")) == 2
    err = capsys.readouterr().err.strip()
    assert "fewer than 100" in err and len(err.splitlines()) == 1


def test_export_then_certify_the_csv_gives_the_same_operating_point(pilot_store, tmp_path, capsys):
    path, _ = pilot_store
    csv_path = tmp_path / "records.csv"
    assert run_main("export", str(path), "-o", str(csv_path)) == 0
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run_main("certify", str(path), "-o", str(a)) == 0
    assert run_main("certify", str(path), "--records", str(csv_path), "-o", str(b)) == 0
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    assert da["records_sha256"] == db["records_sha256"]
    for key in ("policy", "n", "violations", "pilot", "candidates", "gate"):
        assert da[key] == db[key]


def test_report_command_on_a_pilot_store(pilot_store, tmp_path, capsys):
    path, _ = pilot_store
    out = tmp_path / "report"
    assert run_main("report", str(path), "-o", str(out), "--splits", "30") == 0
    page = (out / "report.html").read_text()
    assert "pilot_ordered" in page and "pilot: 100 of 400 requests" in page


@pytest.mark.parametrize(
    ("pilot_gate", "message"),
    [
        ({"pilot_kind": "confidence"}, "needs both pilot_kind"),
        ({"quantile": 0.2}, "needs both pilot_kind"),
        ({"pilot_kind": "confidence", "quantile": 1.5}, "strictly between 0 and 1, got 1.5"),
        ({"pilot_kind": "lookahead", "quantile": 0.0}, "strictly between 0 and 1, got 0.0"),
        ({"pilot_kind": "nope", "quantile": 0.2},
         "pilot_kind: Input should be 'confidence', 'lookahead', 'learned', 'recompute' or 'certificate_recompute'"),
        ({}, "pilot_gate needs pilot_kind"),
    ],
)
def test_a_spec_with_a_malformed_pilot_gate_is_refused_in_one_line(pilot_gate, message):
    """A spec read from JSON names its pilot gates itself: one that the contract's grid could never
    produce (no kind, no quantile, a quantile outside (0, 1)) is refused before the pilot reads it."""
    data = {"tolerance": 0.0, "risk": 0.1, "confidence": 0.9, "sequences": [["x@0.50", "x@0.50+confq0.2"]],
            "candidate_info": {"x@0.50+confq0.2": {"base_policy": "x@0.50", "pilot_gate": pilot_gate}}}
    with pytest.raises(CertkvError) as info:
        CertificationSpec.parse(data)
    assert message in str(info.value) and "\n" not in str(info.value)
