"""Gated candidates (issue 5, part 2): contract grid, naming, sequences, gate signals in the loss
table, derivation from the base candidate's rows, certification, validation and the report.

Torch-free: everything here runs on hand-made tables and a synthetic store.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import run_main
from pydantic import ValidationError
from scipy import stats

from certkv.calibration.certification import load_records
from certkv.calibration.store import CalibrationStore
from certkv.contract.loading import load_contract, parse_contract
from certkv.contract.spec import candidates, certification_spec, gated_candidates, sequences
from certkv.core.certify import certify
from certkv.core.gated import derive_gated
from certkv.core.loss_table import LossTable, read_loss_table, records_sha256
from certkv.core.operating_point import OperatingPoint, load_operating_point
from certkv.core.policy_names import gated_policy_name
from certkv.core.procedures import certified_mask
from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings
from certkv.core.validation import validate
from certkv.errors import CertkvError
from certkv.presses import registry as press_registry

BASE = {
    "name": "gated",
    "requests": {"source": "builtin:demo", "limit": 200},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.1,
    "confidence": 0.9,
    "policies": [
        {"press": "snapkv", "kv_retained": [0.8, 0.5]},
        {"press": "probabilistic", "kv_retained": [0.5, 0.3], "press_kwargs": {"seed": 3}},
    ],
    "gate": {"agreement_drop": [0.2, -0.05], "certificate": [0.02]},
    "store": "store",
}


def contract_of(**changes):
    data = json.loads(json.dumps(BASE))
    data.update(changes)
    return parse_contract(data, "test")


def certify_under(rows, contract):
    """certify() of record dicts under a contract, bound to its hash as the commands bind it."""
    return certify(LossTable.from_records(rows), certification_spec(contract), contract_sha256=contract.sha256())


def derive(table, *gates):
    """derive_gated() of the gated candidates `gates`: (name, base, gate settings) each."""
    info = {name: CandidateInfo(base_policy=base, gate=GateSettings(**settings)) for name, base, settings in gates}
    spec = CertificationSpec(tolerance=0.0, risk=0.5, confidence=0.9, sequences=[[name for name, _, _ in gates]],
                             candidate_info=info)
    return derive_gated(table, spec)


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")


# ----------------------------------------------------------------------------- contract


def test_names_use_format_g():
    assert gated_policy_name("snapkv@0.50", 0.1) == "snapkv@0.50+drop0.1"
    assert gated_policy_name("probabilistic@0.30", -0.05, 0.02) == "probabilistic@0.30+drop-0.05+cert0.02"
    assert gated_policy_name("p@0.30", None, 1e-05) == "p@0.30+cert1e-05"
    assert gated_policy_name("p@0.30", 0.0) == gated_policy_name("p@0.30", -0.0) == "p@0.30+drop0"
    assert gated_policy_name("snapkv@0.50") == "snapkv@0.50"


def test_sequences_per_entry_ungated_then_thresholds_then_bounds_then_pairs():
    c = contract_of()
    assert sequences(c) == [
        ["snapkv@0.80", "snapkv@0.50"],
        ["snapkv@0.80+drop0.2", "snapkv@0.50+drop0.2"],
        ["snapkv@0.80+drop-0.05", "snapkv@0.50+drop-0.05"],
        # snapkv produces no certificates: no +cert sequences for it
        ["probabilistic@0.50", "probabilistic@0.30"],
        ["probabilistic@0.50+drop0.2", "probabilistic@0.30+drop0.2"],
        ["probabilistic@0.50+drop-0.05", "probabilistic@0.30+drop-0.05"],
        ["probabilistic@0.50+cert0.02", "probabilistic@0.30+cert0.02"],
        ["probabilistic@0.50+drop0.2+cert0.02", "probabilistic@0.30+drop0.2+cert0.02"],
        ["probabilistic@0.50+drop-0.05+cert0.02", "probabilistic@0.30+drop-0.05+cert0.02"],
    ]
    # candidates() stays the base candidates the engine calibrates
    assert [x.policy for x in candidates(c)] == ["snapkv@0.80", "snapkv@0.50", "probabilistic@0.50", "probabilistic@0.30"]
    gated = gated_candidates(c)
    assert len(gated) == 2 * 2 + 2 * 5
    g = next(x for x in gated if x.policy == "probabilistic@0.30+drop0.2+cert0.02")
    assert (g.base_policy, g.press, g.kv_retained, g.gate.agreement_drop, g.gate.certificate) == (
        "probabilistic@0.30", "probabilistic", 0.3, 0.2, 0.02)
    assert g.press_kwargs == {"seed": 3} and (g.sequence, g.position) == (7, 1)
    # every name in sequences is a base or a gated candidate, once
    names = [n for s in sequences(c) for n in s]
    assert sorted(names) == sorted([x.policy for x in candidates(c)] + [x.policy for x in gated])
    assert c.gate.agreement_window == 32 and c.gate.agreement_top_k == 32 and c.gate.agreement_split == 3


def test_gate_changes_the_hash_but_no_gate_keeps_it():
    plain = contract_of(gate=None)
    assert "gate" in plain.canonical_json() and '"order"' not in plain.canonical_json()
    assert contract_of().sha256() != plain.sha256()
    assert contract_of(gate={**BASE["gate"], "agreement_window": 16}).sha256() != contract_of().sha256()


def test_interleaved_order_must_list_gated_candidates():
    c = contract_of(gate={"agreement_drop": [0.1]}, policies=[{"press": "snapkv", "kv_retained": [0.8, 0.5]}])
    every = [n for s in sequences(c) for n in s]
    ordered = contract_of(gate={"agreement_drop": [0.1]}, policies=[{"press": "snapkv", "kv_retained": [0.8, 0.5]}],
                          order=["snapkv@0.80", "snapkv@0.80+drop0.1", "snapkv@0.50+drop0.1", "snapkv@0.50"])
    assert sequences(ordered) == [["snapkv@0.80", "snapkv@0.80+drop0.1", "snapkv@0.50+drop0.1", "snapkv@0.50"]]
    with pytest.raises(CertkvError, match=r"order leaves out 'snapkv@0.80\+drop0.1'"):
        contract_of(gate={"agreement_drop": [0.1]}, policies=[{"press": "snapkv", "kv_retained": [0.8, 0.5]}],
                    order=["snapkv@0.80", "snapkv@0.50"])
    assert len(every) == 4


def test_produces_certificates_is_static():
    assert press_registry.produces_certificates("probabilistic")
    assert press_registry.produces_certificates("certkv.presses.probabilistic:ProbabilisticPress")
    assert not press_registry.produces_certificates("deterministic_head")
    assert not press_registry.produces_certificates("snapkv")
    assert not press_registry.produces_certificates("nope")
    assert press_registry.press_info("deterministic_head").target == "certkv.presses.deterministic_head:DeterministicHeadPress"
    assert press_registry.press_info("probabilistic").knob == "compression_ratio"


@pytest.mark.parametrize(
    "gate, policies, fragment",
    [
        ({}, None, "remove `gate:`"),
        ({"agreement_drop": [], "certificate": []}, None, "remove `gate:`"),
        ({"agreement_drop": [0.1, 0.1]}, None, "gate.agreement_drop: gate values must be distinct"),
        ({"agreement_drop": [0.1234567, 0.1234568]}, None, "give the name '0.123457' twice"),
        ({"certificate": [0.0]}, None, "gate.certificate.0: Input should be greater than 0"),
        ({"certificate": [float("inf")]}, None, "gate.certificate.0: Input should be a finite number"),
        ({"agreement_drop": [float("nan")]}, None, "gate.agreement_drop.0: Input should be a finite number"),
        ({"agreement_drop": [0.1], "agreement_window": 0}, None, "gate.agreement_window"),
        ({"agreement_drop": [0.1], "agreemnt_split": 2}, None, "unknown key"),
        ({"certificate": [0.5]}, [{"press": "snapkv", "kv_retained": [0.5]}],
         "gate: certificate bounds need a policy entry whose press produces certificates"),
    ],
)
def test_bad_gates_are_one_line_errors(gate, policies, fragment):
    changes = {"gate": gate}
    if policies is not None:
        changes["policies"] = policies
    with pytest.raises(CertkvError) as info:
        contract_of(**changes)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_negative_thresholds_are_allowed():
    c = contract_of(gate={"agreement_drop": [-0.3, 0.0]})
    assert c.gate.agreement_drop == [-0.3, 0.0]


def test_bad_gate_via_the_cli_exits_2_with_one_line(tmp_path, capsys):
    data = json.loads(json.dumps(BASE))
    data["gate"] = {"agreement_drop": []}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert run_main("certify", str(path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "remove `gate:`" in err[0] and "Traceback" not in err[0]


# ----------------------------------------------------------------------------- loss table signals


def rows_with_signals(drops, certs=None, losses=None, policy="p@0.50", kv=0.5, full_drop=True):
    """One candidate `policy` on len(drops) requests; the full row carries the drop too."""
    out = []
    for i, d in enumerate(drops):
        rid = f"r{i}"
        out.append({"request_id": rid, "policy": "full", "kv_retained": 1.0, "loss": 0.0,
                    "agreement_drop": d if full_drop else None})
        out.append({"request_id": rid, "policy": policy, "kv_retained": kv,
                    "loss": 1.0 if losses is None else losses[i], "agreement_drop": d,
                    "certificate_max": None if certs is None else certs[i]})
    return out


def test_signals_are_read_per_request_and_per_row():
    t = LossTable.from_records(rows_with_signals([0.3, None, -0.1], certs=[0.5, None, 0.0]))
    assert t.agreement_drop.shape == (3,) and t.certificate_max.shape == (1, 3)
    np.testing.assert_array_equal(t.agreement_drop, [0.3, np.nan, -0.1])
    np.testing.assert_array_equal(t.certificate_max[0], [0.5, np.nan, 0.0])
    # an older store: no signal columns at all
    old = LossTable.from_records([{"request_id": "a", "policy": "x@0.5", "kv_retained": 0.5, "loss": 0.0}])
    assert np.isnan(old.agreement_drop).all() and np.isnan(old.certificate_max).all()
    # the drop may sit on the full row only
    only_full = rows_with_signals([0.3, 0.4])
    for r in only_full:
        if r["policy"] != "full":
            r["agreement_drop"] = None
    np.testing.assert_array_equal(LossTable.from_records(only_full).agreement_drop, [0.3, 0.4])


def test_a_drop_that_differs_within_a_request_is_an_error():
    rows = rows_with_signals([0.3, 0.4])
    rows[3]["agreement_drop"] = 0.41
    with pytest.raises(CertkvError) as info:
        LossTable.from_records(rows, source="store s")
    message = str(info.value)
    assert "request 'r1' has different agreement_drop values" in message and "record 3" in message
    assert "record 4" in message and "\n" not in message


def test_bad_certificates_are_errors():
    with pytest.raises(CertkvError, match="certificate_max -0.5 is negative"):
        LossTable.from_records(rows_with_signals([0.1], certs=[-0.5]))
    with pytest.raises(CertkvError, match="certificate_max 'x' is not a number"):
        LossTable.from_records(rows_with_signals([0.1], certs=["x"]))


def write_rows_csv(path: Path, rows: list[dict]) -> Path:
    fields = ["request_id", "policy", "kv_retained", "loss", "agreement_drop", "certificate_max"]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r.get(k) is None else r[k] for k in fields})
    return path


def test_csv_and_jsonl_signals_match_records(tmp_path):
    rows = rows_with_signals([0.3, None, -0.1], certs=[0.5, None, 0.25])
    from_csv = read_loss_table(write_rows_csv(tmp_path / "t.csv", rows))
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_jsonl = read_loss_table(jsonl)
    direct = LossTable.from_records(rows)
    for t in (from_csv, from_jsonl):
        np.testing.assert_array_equal(t.agreement_drop, direct.agreement_drop)
        np.testing.assert_array_equal(t.certificate_max, direct.certificate_max)
        assert records_sha256(t) == records_sha256(direct)


def test_signals_enter_the_records_hash_only_when_present():
    rows = rows_with_signals([0.3, 0.4])
    plain = [{k: v for k, v in r.items() if k not in ("agreement_drop", "certificate_max")} for r in rows]
    blank = [{**r, "agreement_drop": None, "certificate_max": None} for r in rows]
    assert records_sha256(LossTable.from_records(plain)) == records_sha256(LossTable.from_records(blank))
    assert records_sha256(LossTable.from_records(rows)) != records_sha256(LossTable.from_records(plain))
    changed = [dict(r) for r in rows]
    for r in changed:
        if r["request_id"] == "r0":
            r["agreement_drop"] = 0.31
    assert records_sha256(LossTable.from_records(changed)) != records_sha256(LossTable.from_records(rows))


# ----------------------------------------------------------------------------- expansion


def hand_table():
    """4 requests; base p@0.50 violates on r0, r1, r2; drops and certificates chosen by hand."""
    drops = [0.05, 0.5, 0.15, 0.9]
    certs = [0.0, 0.7, 0.1, 0.3]
    losses = [1.0, 1.0, 1.0, 0.0]
    rows = rows_with_signals(drops, certs, losses)
    for r in rows:
        if r["policy"] != "full":
            r["memory"] = 0.5
            r["kv_retained_actual"] = 0.49
    return LossTable.from_records(rows, source="hand")


def test_expansion_on_a_hand_made_table():
    table = hand_table()
    before = (table.policies, table.loss.copy(), table.memory.copy())
    out = derive(
        table,
        ("p@0.50+drop0.2", "p@0.50", {"agreement_drop": 0.2}),
        ("p@0.50+cert0.5", "p@0.50", {"certificate": 0.5}),
        ("p@0.50+drop0.1+cert0.2", "p@0.50", {"agreement_drop": 0.1, "certificate": 0.2}),
    )
    # the input is untouched
    assert table.policies == before[0] and "p@0.50+drop0.2" not in table
    np.testing.assert_array_equal(table.loss, before[1])
    np.testing.assert_array_equal(table.memory, before[2])
    assert table.gated == {}

    drop = out.index_of("p@0.50+drop0.2")  # gated where drop < 0.2: r0, r2
    np.testing.assert_array_equal(out.loss[drop], [0.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(out.memory[drop], [1.0, 0.5, 1.0, 0.5])
    np.testing.assert_array_equal(out.kv_retained_actual[drop], [1.0, 0.49, 1.0, 0.49])
    cert = out.index_of("p@0.50+cert0.5")  # gated where certificate > 0.5: r1
    np.testing.assert_array_equal(out.loss[cert], [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(out.memory[cert], [0.5, 1.0, 0.5, 0.5])
    both = out.index_of("p@0.50+drop0.1+cert0.2")  # drop < 0.1: r0; certificate > 0.2: r1, r3
    np.testing.assert_array_equal(out.loss[both], [0.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(out.memory[both], [1.0, 1.0, 0.5, 1.0])
    for name in ("p@0.50+drop0.2", "p@0.50+cert0.5", "p@0.50+drop0.1+cert0.2"):
        i = out.index_of(name)
        assert out.kv_retained[i] == 0.5 and out.press[i] == "p"
    shares = {k: (v.gated_count, v.gated_share) for k, v in out.gated.items()}
    assert shares == {"p@0.50+drop0.2": (2, 0.5), "p@0.50+cert0.5": (1, 0.25), "p@0.50+drop0.1+cert0.2": (3, 0.75)}
    assert all(type(v.gated_count) is int for v in out.gated.values())
    # derived rows are not evidence: the hash is the base table's
    assert records_sha256(out) == records_sha256(table)
    # expanding again with the same settings is a no-op; other settings under the same name are refused
    again = derive(out, ("p@0.50+drop0.2", "p@0.50", {"agreement_drop": 0.2}))
    assert again is out
    with pytest.raises(CertkvError, match="derived with other gate settings"):
        derive(out, ("p@0.50+drop0.2", "p@0.50", {"agreement_drop": 0.3}))


def test_violation_counts_of_gated_candidates_are_integers():
    out = derive(hand_table(), ("p@0.50+drop0.2", "p@0.50", {"agreement_drop": 0.2}))
    op = certify(out, CertificationSpec.parse({"tolerance": 0.0, "risk": 0.5, "confidence": 0.9,
                                               "sequences": [["p@0.50"], ["p@0.50+drop0.2"]]}))
    assert [(c.violations, type(c.violations)) for c in op.candidates] == [(3, int), (1, int)]


def test_rows_for_a_gated_name_in_the_input_are_refused():
    rows = rows_with_signals([0.1, 0.3]) + rows_with_signals([0.1, 0.3], policy="p@0.50+drop0.2")
    rows = [r for r in rows if not (r["policy"] == "full" and rows.index(r) >= 4)]
    table = LossTable.from_records(rows)
    with pytest.raises(CertkvError, match=r"has rows for 'p@0.50\+drop0.2', a gated candidate that certkv derives"):
        derive(table, ("p@0.50+drop0.2", "p@0.50", {"agreement_drop": 0.2}))


@pytest.mark.parametrize("gate, column", [
    (("p@0.50+drop0.2", "p@0.50", {"agreement_drop": 0.2}), "agreement_drop"),
    (("p@0.50+cert0.5", "p@0.50", {"certificate": 0.5}), "certificate_max"),
])
def test_a_missing_signal_is_a_one_line_error(gate, column):
    rows = rows_with_signals([0.1, None, 0.3], certs=[0.1, 0.2, None])
    with pytest.raises(CertkvError) as info:
        derive(LossTable.from_records(rows, source="store runs/x"), gate)
    message = str(info.value)
    assert f"store runs/x lacks `{column}` for policy 'p@0.50'" in message
    assert "1 of 3 requests" in message and "recalibrate with a current certkv" in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- certification


def simple_contract(drops=(0.2,)):
    return contract_of(policies=[{"press": "snapkv", "kv_retained": [0.8, 0.5]}], gate={"agreement_drop": list(drops)})


def contract_rows(n, bad_base, drop_of, loss_of):
    """Rows for snapkv@0.80 / snapkv@0.50 with the given per-request drop and losses."""
    rows = []
    for i in range(n):
        rid = f"q{i:04d}"
        rows.append({"request_id": rid, "policy": "full", "kv_retained": 1.0, "loss": 0.0, "agreement_drop": drop_of(i)})
        for name, kv in (("snapkv@0.80", 0.8), ("snapkv@0.50", 0.5)):
            rows.append({"request_id": rid, "policy": name, "kv_retained": kv, "loss": loss_of(name, i),
                         "agreement_drop": drop_of(i)})
    return rows


def test_certify_picks_a_gated_candidate_that_saves_more_memory():
    # 200 requests, ε = δ = 0.1, δ/m with m = 2 sequences (ungated, +drop0.2) → level 0.05.
    # snapkv@0.50 breaks 40 requests, all with drop < 0.2 (10% of requests: 20 of them), ...
    n = 200
    drop_of = lambda i: 0.1 if i < 20 else 0.9  # noqa: E731
    loss_of = lambda name, i: 1.0 if (name == "snapkv@0.50" and i < 20) else 0.0  # noqa: E731
    op = certify_under(contract_rows(n, None, drop_of, loss_of), simple_contract())
    assert op.policy == "snapkv@0.50+drop0.2" and op.base_policy == "snapkv@0.50" and op.press == "snapkv"
    assert op.gate.agreement_drop == 0.2 and op.gate.certificate is None and op.gate.agreement_window == 32
    assert op.gated_share == pytest.approx(0.1) and op.violations == 0
    assert op.mean_kv_retained == pytest.approx(0.1 * 1.0 + 0.9 * 0.5)  # gated requests count 1.0
    base = next(c for c in op.candidates if c.policy == "snapkv@0.50")
    assert not base.certified and base.violations == 20 and base.gated_share == 0.0 and base.gate is None
    assert all(s.level == pytest.approx(0.05) for s in op.sequences)


def test_certify_prefers_the_ungated_candidate_when_gating_costs_memory():
    # Both snapkv@0.50 and its gated version certify; the gate sends 60% of requests to the full
    # cache (mean memory 0.8 > 0.5), so the ungated one is chosen.
    drop_of = lambda i: 0.1 if i % 5 < 3 else 0.9  # noqa: E731
    loss_of = lambda name, i: 0.0  # noqa: E731
    op = certify_under(contract_rows(200, None, drop_of, loss_of), simple_contract())
    gated = next(c for c in op.candidates if c.policy == "snapkv@0.50+drop0.2")
    assert gated.certified and gated.mean_kv_retained == pytest.approx(0.8) and gated.gated_share == pytest.approx(0.6)
    assert op.policy == "snapkv@0.50" and op.gate is None and op.gated_share == 0.0
    assert op.base_policy == "snapkv@0.50" and op.press_kwargs == {}


def test_gated_p_values_and_bounds_match_scipy():
    drop_of = lambda i: (i % 10) / 10  # noqa: E731
    loss_of = lambda name, i: 1.0 if (name == "snapkv@0.50" and i % 7 == 0) else 0.0  # noqa: E731
    op = certify_under(contract_rows(300, None, drop_of, loss_of), simple_contract(drops=(0.2, 0.5)))
    m = 3
    for c in op.candidates:
        assert c.level == pytest.approx(0.1 / m)
        assert c.p_value == pytest.approx(stats.binomtest(c.violations, c.n, 0.1, alternative="less").pvalue, rel=1e-9)
        expected = 1.0 if c.violations == c.n else stats.beta.ppf(1 - 0.1 / m, c.violations + 1, c.n - c.violations)
        assert c.risk_upper_bound == pytest.approx(expected, rel=1e-9)
    # gated counts by hand: violations on i % 7 == 0 whose drop (i % 10)/10 is not below t
    k = {t: sum(1 for i in range(300) if i % 7 == 0 and (i % 10) / 10 >= t) for t in (0.2, 0.5)}
    got = {c.policy: c.violations for c in op.candidates}
    assert got["snapkv@0.50+drop0.2"] == k[0.2] and got["snapkv@0.50+drop0.5"] == k[0.5]


def test_number_of_sequences_and_levels_follow_the_documented_rule():
    # per entry: (1 + T) sequences, or (1 + T)(1 + B) for a certificate press
    c = contract_of()  # T = 2, B = 1: snapkv 3, probabilistic 6
    assert len(sequences(c)) == 3 + 6
    spec = certification_spec(c)
    rows = []
    for i in range(50):
        rows.append({"request_id": f"r{i}", "policy": "full", "kv_retained": 1.0, "loss": 0.0, "agreement_drop": 0.5})
        for x in candidates(c):
            rows.append({"request_id": f"r{i}", "policy": x.policy, "kv_retained": x.kv_retained, "loss": 0.0,
                         "agreement_drop": 0.5, "certificate_max": 0.01 if x.press == "probabilistic" else None})
    op = certify_under(rows, c)
    assert len(op.sequences) == 9 and all(s.level == pytest.approx(0.1 / 9) for s in op.sequences)
    assert len(op.candidates) == len(spec.candidates) == 4 + 14
    # one interleaved order: one sequence at the full δ
    names = [n for s in sequences(c) for n in s]
    interleaved = contract_of(order=names[::-1])
    op1 = certify_under(rows, interleaved)
    assert len(op1.sequences) == 1 and op1.sequences[0].level == pytest.approx(0.1)
    # bonferroni: every candidate at δ / N, N counting the gated ones
    op2 = certify_under(rows, contract_of(procedure="bonferroni"))
    assert all(c.level == pytest.approx(0.1 / 18) for c in op2.candidates)


def test_family_wise_error_with_gated_candidates_simulated():
    """Every candidate's true risk is ≥ ε (one sits exactly at ε): any certification is a false
    one, and its frequency must stay ≤ δ with the Bonferroni split over the gated sequences."""
    rng = np.random.default_rng(7)
    sims, n, eps, delta = 4000, 400, 0.05, 0.1
    thresholds = (0.1, 0.2)
    q = eps / (1 - 0.2)  # base risk 0.0625; gated risk q(1 - t) = 0.05625 and exactly 0.05
    drop = rng.random((sims, n))
    violated = rng.random((sims, n)) < q
    k = np.stack([violated.sum(1)] + [(violated & (drop >= t)).sum(1) for t in thresholds], axis=1)
    p = stats.binom.cdf(k, n, eps)
    lengths = [1, 1, 1]  # contract: one kv_retained, two thresholds → 3 sequences
    assert len(sequences(contract_of(policies=[{"press": "snapkv", "kv_retained": [0.5]}],
                           gate={"agreement_drop": list(thresholds)}))) == len(lengths)
    false = certified_mask(p, lengths, delta, "fixed_sequence").any(axis=1).mean()
    assert false <= delta + 3 * np.sqrt(delta * (1 - delta) / sims)
    # the split matters: the same tests each at the full δ certify falsely more often
    unsplit = (p <= delta).any(axis=1).mean()
    assert unsplit > false


# ----------------------------------------------------------------------------- commands


def signal_rows(contract, n=200, seed=1):
    """Store-like rows for every base candidate with both signals."""
    rng = np.random.default_rng(seed)
    # snapkv@0.50 breaks only low-drop requests (which its +drop0.2 gate catches); the probabilistic
    # press breaks 30% of requests whatever the signals say, so none of its candidates certifies.
    def violates(policy, d):
        if policy == "snapkv@0.80":
            return rng.random() < 0.01
        if policy == "snapkv@0.50":
            return d < 0.15 and rng.random() < 0.7
        return rng.random() < 0.3

    out = []
    for i in range(n):
        d = float(rng.random())
        out.append(dict(request_id=f"r{i:04d}", task="t", policy="full", press=None, kv_retained=1.0,
                        kv_retained_actual=1.0, utility=1.0, utility_full=1.0, loss=0.0, answer="a",
                        agreement_drop=d, certificate_max=None))
        for c in candidates(contract):
            bad = violates(c.policy, d)
            cert = round(float(rng.random()) * 0.04, 6) if c.press == "probabilistic" else None
            out.append(dict(request_id=f"r{i:04d}", task="t", policy=c.policy, press=c.press, kv_retained=c.kv_retained,
                            kv_retained_actual=c.kv_retained, utility=0.0 if bad else 1.0, utility_full=1.0,
                            loss=1.0 if bad else 0.0, answer="b" if bad else "a", agreement_drop=d,
                            certificate_max=cert))
    return out


@pytest.fixture(scope="module")
def gated_store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gated")
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump(BASE, sort_keys=False))
    contract = load_contract(path)
    rows = signal_rows(contract)
    with CalibrationStore.open(contract.resolved_store_path(), contract) as store:
        for rid in dict.fromkeys(r["request_id"] for r in rows):
            store.write_request(rid, [{k: v for k, v in r.items() if k != "request_id"} for r in rows if r["request_id"] == rid])
    return path, rows


def test_certify_cli_on_a_csv_with_signals(gated_store, tmp_path, capsys):
    path, rows = gated_store
    table = tmp_path / "losses.csv"
    fields = ["request_id", "task", "policy", "kv_retained", "loss", "agreement_drop", "certificate_max"]
    with table.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r[k] is None else r[k] for k in fields})
    out = tmp_path / "op.json"
    assert run_main("certify", str(path), "--records", str(table), "-o", str(out)) == 0
    printed = " ".join(capsys.readouterr().out.split())
    data = json.loads(out.read_text())
    contract = load_contract(path)
    api = certify_under(rows, contract)
    assert data["policy"] == api.policy == "snapkv@0.50+drop0.2"
    assert [c["policy"] for c in data["candidates"]] == [n for s in sequences(contract) for n in s]
    assert [c["violations"] for c in data["candidates"]] == [c.violations for c in api.candidates]
    assert data["records_sha256"] == records_sha256(read_loss_table(table))  # the recorded rows, not the derived
    assert {"base_policy", "press_kwargs", "gate", "gated_share"} <= set(data)
    assert data["base_policy"] == data["policy"].split("+", 1)[0]
    assert set(data["gate"]) == {"agreement_drop", "certificate", "agreement_window", "agreement_top_k", "agreement_split",
                                 "confidence", "lookahead", "learned", "learned_threshold", "recompute", "certificate_recompute",
                                 "quantile", "lookahead_tokens"}
    assert 0 < data["gated_share"] < 1 and data["mean_kv_retained"] > data["kv_retained"]
    assert all("gated_share" in c for c in data["candidates"])
    assert "gated" in printed and "δ split over 9 sequences" in printed
    # the store gives the same decision and the same records hash
    from_store = tmp_path / "op_store.json"
    assert run_main("certify", str(path), "-o", str(from_store)) == 0
    stored = json.loads(from_store.read_text())
    assert stored["policy"] == data["policy"] and stored["violations"] == data["violations"]
    assert stored["gated_share"] == data["gated_share"] and stored["gate"] == data["gate"]
    info = certification_spec(contract).candidate_info["probabilistic@0.30+drop0.2+cert0.02"]
    assert info.base_policy == "probabilistic@0.30" and info.press_kwargs == {"seed": 3}
    assert (info.gate.agreement_drop, info.gate.certificate) == (0.2, 0.02)
    by_name = {c["policy"]: c for c in data["candidates"]}
    assert by_name["probabilistic@0.50+cert0.02"]["gate"]["certificate"] == 0.02
    assert by_name["snapkv@0.50"]["gate"] is None and by_name["snapkv@0.50"]["gated_share"] == 0.0


def test_gated_candidates_are_derived_once_and_validation_sees_them(gated_store):
    path, _ = gated_store
    contract = load_contract(path)
    evidence = load_records(contract)
    spec = certification_spec(contract)
    assert evidence.table.gated == {}  # the recorded rows: certify and validate derive the gated ones
    derived = derive_gated(evidence.table, spec)
    assert "snapkv@0.50+drop0.2" in derived and len(derived.gated) == 14
    assert derive_gated(derived, spec) is derived
    result = validate(evidence.table, spec, n_splits=50, seed=3)
    assert validate(derived, spec, n_splits=50, seed=3) == result
    # same result from the raw store rows: validate derives the gated rows itself
    with CalibrationStore.read(contract.resolved_store_path()) as store:
        raw = validate(LossTable.from_records(store.records()), spec, n_splits=50, seed=3)
    assert result.methods["certkv"].chosen == raw.methods["certkv"].chosen
    assert any("+" in name for m in result.methods.values() for name in m.chosen)


def test_validate_and_report_commands_with_gates(gated_store, tmp_path, capsys):
    path, _ = gated_store
    assert run_main("validate", str(path), "--splits", "40", "-o", str(tmp_path / "v.json")) == 0
    out = tmp_path / "report"
    assert run_main("report", str(path), "-o", str(out), "--splits", "40") == 0
    page = (out / "report.html").read_text()
    assert "gated" in page and "snapkv@0.50+drop0.2" in page and "not drawn" not in page
    assert "other gated candidates are in the table below" in page
    for name in ("risk_vs_kv.png", "per_task.png", "validation.png"):
        assert (out / name).stat().st_size > 1000


def test_figures_draw_ungated_sequences_and_the_chosen_family():
    from certkv.report.text import shown_candidates

    drop_of = lambda i: 0.1 if i < 20 else 0.9  # noqa: E731
    loss_of = lambda name, i: 1.0 if (name == "snapkv@0.50" and i < 20) else 0.0  # noqa: E731
    op = certify_under(contract_rows(200, None, drop_of, loss_of), simple_contract(drops=(0.2, 0.05)))
    assert op.policy == "snapkv@0.50+drop0.2"
    shown = [[c.policy for c in s] for s in shown_candidates(op)]
    assert shown == [["snapkv@0.80", "snapkv@0.50"], ["snapkv@0.80+drop0.2", "snapkv@0.50+drop0.2"]]
    op_plain = certify_under(contract_rows(200, None, drop_of, lambda name, i: 0.0), simple_contract(drops=(0.2, 0.05)))
    assert op_plain.gate is None
    assert [[c.policy for c in s] for s in shown_candidates(op_plain)] == [["snapkv@0.80", "snapkv@0.50"]]


# ----------------------------------------------------------------------------- operating point files


def test_operating_points_of_an_earlier_build_are_refused_in_one_line(tmp_path):
    rows = [{"request_id": f"r{i}", "policy": "x@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(100)]
    op = certify(LossTable.from_records(rows),
                 CertificationSpec.parse({"tolerance": 0.0, "risk": 0.1, "confidence": 0.9, "sequences": [["x@0.50"]]}))
    data = op.to_dict()
    assert next(iter(data)) == "format_version" and data["format_version"] == 1
    # as a build from before gates (and before format versions) wrote it
    for key in ("format_version", "base_policy", "press_kwargs", "gate", "gated_share"):
        data.pop(key)
    for c in data["candidates"]:
        c.pop("gate"), c.pop("gated_share")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CertkvError) as err:
        load_operating_point(path)
    assert str(err.value) == (f"{path}: format_version none (written by an earlier certkv build), this certkv reads 1; "
                              "re-run `certkv certify CONTRACT` to write it again")
    path.write_text(json.dumps({**op.to_dict(), "format_version": 2}))
    with pytest.raises(CertkvError, match="format_version 2, this certkv reads 1"):
        load_operating_point(path)
    with pytest.raises(ValidationError, match="format_version 2, this certkv reads 1"):
        OperatingPoint.model_validate({**op.to_dict(), "format_version": 2})
    # and a new file round-trips with its gate
    drop_of = lambda i: 0.1 if i < 20 else 0.9  # noqa: E731
    loss_of = lambda name, i: 1.0 if (name == "snapkv@0.50" and i < 20) else 0.0  # noqa: E731
    gated = certify_under(contract_rows(200, None, drop_of, loss_of), simple_contract())
    new = gated.write_json(tmp_path / "new.json")
    back = load_operating_point(new)
    assert back.gate == gated.gate and back.gated_share == gated.gated_share and back.base_policy == "snapkv@0.50"


def test_fallback_has_no_gate():
    rows = [{"request_id": f"r{i}", "policy": "x@0.50", "kv_retained": 0.5, "loss": 1.0} for i in range(100)]
    op = certify(LossTable.from_records(rows),
                 CertificationSpec.parse({"tolerance": 0.0, "risk": 0.1, "confidence": 0.9, "sequences": [["x@0.50"]]}))
    assert op.fallback and op.gate is None and op.base_policy == "full" and op.gated_share == 0.0


@pytest.mark.parametrize("missing", [None, float("nan")])
def test_the_runtime_gate_sends_a_request_whose_signal_is_missing_to_the_full_cache(missing):
    """Certification refuses records without a gate's signal, so the runtime must not let a request
    whose signal it could not read through as if the gate had not fired."""
    from certkv.runtime.gating import after_decode, before_decode, deployable

    pre = deployable(GateSettings(agreement_drop=0.1))
    assert before_decode(pre, {"agreement_drop": 0.5}) is None
    assert before_decode(pre, {"agreement_drop": missing}) == "gate"
    post = deployable(GateSettings(confidence=0.2))
    assert after_decode(post, {"confidence_min": 0.9, "certificate_max": None}) is None
    assert after_decode(post, {"confidence_min": missing, "certificate_max": None}) == "confidence"
