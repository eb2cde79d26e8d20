"""The certificate recompute gate in certification (torch-free): gate.certificate_recompute grows
``+recc<q>`` candidates for probabilistic_decoding entries only, places each bound at the pilot's
(1 − q)-quantile of certificate_max, and counts a restart at or before the first departure from
the full answer as the full answer (loss 0), a later one as violated (loss 1), memory 1 for both —
checked against plain loops over synthetic records.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from certkv.contract.loading import parse_contract
from certkv.contract.spec import certification_spec, sequences
from certkv.core.certify import certify
from certkv.core.gated import derive_gated
from certkv.core.loss_table import LossTable
from certkv.core.pilot import resolve_pilot
from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings
from certkv.errors import CertkvError

BASE = "probabilistic_decoding@0.60"
CONTRACT = {
    "name": "recc", "model": "embedded-recite", "requests": {"source": "builtin:recite", "limit": 400},
    "utility": "prefix_agreement", "tolerance": 0.0, "risk": 0.5, "confidence": 0.9,
    "policies": [{"press": "probabilistic_decoding", "kv_retained": [0.6], "press_kwargs": {"compression_interval": 8}}],
    "gate": {"pilot": 0.25, "certificate_recompute": {"quantiles": [0.1, 0.3]}, "recompute": {"quantiles": [0.2]}},
}


def _rows(n: int = 400, seed: int = 0) -> list[dict]:
    """Records of one probabilistic decoding candidate: broken requests have larger certificates;
    the largest up to the departure is at most the whole answer's, often below it."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        rid = f"r{i:04d}"
        rows.append({"request_id": rid, "policy": "full", "kv_retained": 1.0, "loss": 0.0})
        bad = bool(rng.random() < 0.4)
        whole = float(rng.gamma(3.0 if bad else 2.0, 0.5))
        agreeing = whole if rng.random() < 0.5 else float(whole * rng.random())
        conf = float(rng.beta(2, 5) if bad else rng.beta(5, 2))
        rows.append({"request_id": rid, "policy": BASE, "press": "probabilistic_decoding", "kv_retained": 0.6,
                     "memory": 0.62, "loss": float(bad) * float(rng.choice([0.5, 1.0])),
                     "certificate_max": whole, "certificate_max_agreeing": agreeing,
                     "confidence_min": conf, "confidence_min_agreeing": float(conf + (1 - conf) * rng.random())})
    return rows


def _by_loops(rows: list[dict], ids, r: float | None, b: float | None) -> tuple[list[float], list[float]]:
    """Loss and memory of the gated candidate, request by request, as the docs state the rule."""
    base = {x["request_id"]: x for x in rows if x["policy"] == BASE}
    losses, memory = [], []
    for rid in ids:
        x = base[rid]
        restarted = (r is not None and x["confidence_min"] < r) or (b is not None and x["certificate_max"] > b)
        in_time = (r is not None and x["confidence_min_agreeing"] < r) or (b is not None and x["certificate_max_agreeing"] > b)
        losses.append(x["loss"] if not restarted else (0.0 if in_time else 1.0))
        memory.append(1.0 if restarted else x["memory"])
    return losses, memory


def test_contract_names_recc_candidates_for_probabilistic_decoding_entries_only():
    other = {"press": "compression_ratio_decoding", "kv_retained": [0.6],
             "press_kwargs": {"base_press": "knorm", "compression_interval": 8}}
    prefill = {"press": "probabilistic", "kv_retained": [0.5]}
    contract = parse_contract({**CONTRACT, "policies": [*CONTRACT["policies"], other, prefill]}, "test")
    names = [n for seq in sequences(contract) for n in seq]
    assert [n for n in names if "+recc" in n] == [f"{BASE}+recc0.1", f"{BASE}+recc0.3"]
    assert "compression_ratio_decoding@0.60+recq0.2" in names and "probabilistic@0.50+recq0.2" not in names
    # left out of the canonical JSON while unset: the hash of every contract without it is unchanged
    without = parse_contract({**CONTRACT, "gate": {"pilot": 0.25, "recompute": {"quantiles": [0.2]}}}, "test")
    assert "certificate_recompute" not in json.loads(without.canonical_json())["gate"]
    assert json.loads(contract.canonical_json())["gate"]["certificate_recompute"] == {"quantiles": [0.1, 0.3]}


def test_a_certificate_recompute_without_a_probabilistic_decoding_entry_is_refused_in_one_line():
    other = {"press": "compression_ratio_decoding", "kv_retained": [0.6],
             "press_kwargs": {"base_press": "knorm", "compression_interval": 8}}
    gate = {"pilot": 0.25, "certificate_recompute": {"quantiles": [0.1]}}
    for policies in ([other], [{"press": "probabilistic", "kv_retained": [0.5]}]):
        with pytest.raises(CertkvError) as info:
            parse_contract({**CONTRACT, "policies": policies, "gate": gate}, "test")
        assert "gate.certificate_recompute" in str(info.value) and "probabilistic_decoding" in str(info.value)
        assert "\n" not in str(info.value)
    with pytest.raises(CertkvError, match="gate.certificate_recompute places its thresholds on a pilot split"):
        parse_contract({**CONTRACT, "gate": {"certificate_recompute": {"quantiles": [0.1]}}}, "test")


def test_the_bounds_are_pilot_quantiles_and_the_rows_count_restarts_as_the_rule_says():
    rows = _rows()
    contract = parse_contract(CONTRACT, "test")
    table = LossTable.from_records(rows)
    resolution = resolve_pilot(table, certification_spec(contract))
    pilot = table.take_requests(resolution.split.pilot_columns)
    info = resolution.spec.candidate_info
    for q in (0.1, 0.3):
        gate = info[f"{BASE}+recc{q}"].gate
        assert gate.certificate_recompute == np.quantile(pilot.certificate_max[pilot.index_of(BASE)], 1 - q)
        assert gate.kind == "certificate_recompute" and gate.recompute is None
    derived = derive_gated(resolution.table, resolution.spec)
    ids = list(derived.request_ids)
    for q in (0.1, 0.3):
        name = f"{BASE}+recc{q}"
        losses, memory = _by_loops(rows, ids, None, info[name].gate.certificate_recompute)
        assert derived.loss[derived.index_of(name)].tolist() == losses
        assert derived.memory[derived.index_of(name)].tolist() == memory
        assert derived.gated[name].gated_count == sum(m == 1.0 for m in memory)
    late = sum(x == 1.0 for x in _by_loops(rows, ids, None, info[f"{BASE}+recc0.3"].gate.certificate_recompute)[0])
    assert 0 < late  # the synthetic records have late restarts: the rule's conservative side is exercised
    op = certify(table, certification_spec(contract), contract_sha256=contract.sha256())
    counted = {c.policy: c.violations for c in op.candidates}
    name = f"{BASE}+recc0.3"
    b = info[name].gate.certificate_recompute
    assert counted[name] == sum(loss > 0 for loss in _by_loops(rows, ids, None, b)[0])


def test_both_restarting_parts_restart_at_the_first_that_fires():
    rows = _rows(60, seed=3)
    table = LossTable.from_records(rows)
    gate = GateSettings(recompute=0.3, certificate_recompute=1.2)
    spec = CertificationSpec(tolerance=0.0, risk=0.5, confidence=0.9, sequences=[["g"]],
                             candidate_info={"g": CandidateInfo(base_policy=BASE, gate=gate)})
    derived = derive_gated(table, spec)
    losses, memory = _by_loops(rows, list(derived.request_ids), 0.3, 1.2)
    assert derived.loss[derived.index_of("g")].tolist() == losses
    assert derived.memory[derived.index_of("g")].tolist() == memory
    assert gate.restarts and gate.kind == "recompute+certificate_recompute"


def test_records_without_the_agreeing_certificate_are_refused_with_the_recalibrate_hint():
    rows = [{k: v for k, v in x.items() if k != "certificate_max_agreeing"} for x in _rows(20)]
    spec = CertificationSpec(tolerance=0.0, risk=0.5, confidence=0.9, sequences=[["g"]],
                             candidate_info={"g": CandidateInfo(base_policy=BASE,
                                                                gate=GateSettings(certificate_recompute=0.5))})
    with pytest.raises(CertkvError, match="lacks `certificate_max_agreeing`.*recalibrate"):
        derive_gated(LossTable.from_records(rows), spec)
    with pytest.raises(ValueError, match="certificate_recompute -1.0 is not a finite bound"):
        GateSettings(certificate_recompute=-1.0)
