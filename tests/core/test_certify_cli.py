"""`certkv certify` and `certkv validate` end to end on a small synthetic store (no model).

The store is filled with fake rows whose violation rates are chosen so that the ladder is
interesting: a sequence that certifies two candidates then stops, a sequence that fails at once,
and a task whose own rate exceeds ε under the chosen policy.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import certify_without_torch, run_main

from certkv.calibration.certification import load_records
from certkv.calibration.store import CalibrationStore
from certkv.contract.loading import load_contract
from certkv.contract.spec import candidates, certification_spec, sequences
from certkv.core.certify import certify

CONTRACT = {
    "name": "synthetic",
    "requests": {"source": "builtin:demo", "limit": 200},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.1,
    "confidence": 0.9,
    "policies": [
        {"press": "snapkv", "kv_retained": [0.8, 0.5, 0.2, 0.1]},
        {"press": "knorm", "kv_retained": [0.5]},
    ],
    "store": "store",
}
N_REQUESTS = 200
TASKS = ("t0", "t1", "t2")
#: Violation probability of each candidate per task (t2 is hard for snapkv@0.50).
RATES = {
    "snapkv@0.80": (0.0, 0.0, 0.03),
    "snapkv@0.50": (0.0, 0.0, 0.16),
    "snapkv@0.20": (0.3, 0.3, 0.5),
    "snapkv@0.10": (0.6, 0.6, 0.7),
    "knorm@0.50": (0.2, 0.2, 0.2),
}
#: The operating point keys docs/design.md lists ("File formats").
DESIGN_KEYS = {
    "policy", "press", "kv_retained", "fallback", "contract", "n", "violations", "risk_upper_bound", "p_value",
    "candidates", "guarantee", "contract_sha256", "records_sha256", "created", "certkv_version",
}


def write_contract(folder: Path, **changes) -> Path:
    data = json.loads(json.dumps(CONTRACT))
    data.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def fake_records(contract, i: int, rng) -> list[dict]:
    """One request's store records: full plus every candidate; loss = utility_full − utility exactly."""
    task_index = i % len(TASKS)
    task = TASKS[task_index]
    full = 1.0 if rng.random() < 0.9 else 0.0
    records = [dict(policy="full", task=task, press=None, kv_retained=1.0, kv_retained_actual=1.0,
                    utility=full, utility_full=full, loss=0.0, answer="a")]
    for c in candidates(contract):
        violated = full == 1.0 and rng.random() < RATES[c.policy][task_index] / 0.9
        helped = full == 0.0 and rng.random() < 0.1  # eviction sometimes helps: a negative loss
        u = 0.0 if violated else (1.0 if helped else full)
        records.append(dict(policy=c.policy, task=task, press=c.press, kv_retained=c.kv_retained,
                            kv_retained_actual=round(c.kv_retained - 0.004, 6), utility=u, utility_full=full,
                            loss=full - u, answer="a" if u else "b"))
    return records


def build_store(folder: Path, n: int = N_REQUESTS, seed: int = 1, skip: int = 0) -> Path:
    """A contract YAML in `folder` and its filled store; returns the contract path."""
    path = write_contract(folder)
    contract = load_contract(path)
    rng = np.random.default_rng(seed)
    with CalibrationStore.open(contract.resolved_store_path(), contract) as store:
        for i in range(n):
            store.write_request(f"r{i:04d}", fake_records(contract, i, rng))
        for j in range(skip):
            store.write_skipped(f"s{j}", "context longer than the model's window")
    return path


@pytest.fixture(scope="module")
def contract_path(tmp_path_factory) -> Path:
    return build_store(tmp_path_factory.mktemp("certify"), skip=1)


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ----------------------------------------------------------------------------- certify


def test_certify_end_to_end_matches_the_python_api(contract_path, tmp_path, capsys):
    out = tmp_path / "op.json"
    assert run_main("certify", str(contract_path), "-o", str(out)) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    data = json.loads(out.read_text())
    assert DESIGN_KEYS <= set(data)
    assert data["fallback"] is False and "reason" not in data

    contract = load_contract(contract_path)
    evidence = load_records(contract)
    api = certify(evidence.table, certification_spec(contract), contract_sha256=contract.sha256())
    assert data["policy"] == api.policy == "snapkv@0.50"
    assert data["violations"] == api.violations and data["n"] == api.n == N_REQUESTS
    assert data["records_sha256"] == api.records_sha256 and data["contract_sha256"] == contract.sha256()
    assert [c["policy"] for c in data["candidates"]] == [p for s in sequences(contract) for p in s]
    assert data["contract"] == {"tolerance": 0.0, "risk": 0.1, "confidence": 0.9, "procedure": "fixed_sequence",
                                "utility": "exact_match", "kv_cost": "kv_retained"}

    # The console: one row per sequence, the choice, per-task flags and the scoped guarantee.
    for fragment in ("snapkv 2/4 @0.50 ★ @0.20 77/200", "knorm 0/1 — @0.50", "stopped at", "--wide",
                     "Chosen", "realised 0.496", "per-task breakdown", "above ε", "calibration distribution",
                     "the declared task mix", "not each task", "1 request(s) were skipped"):
        assert fragment in printed, fragment
    assert "snapkv@0.80" not in printed  # the candidate table is --wide's (and the JSON's), not the default's
    assert data["per_task"]["t2"]["exceeds_risk"] is True

    # --wide: the ladder of every candidate and where each sequence stopped, with the same summary after it.
    assert run_main("certify", str(contract_path), "-o", str(tmp_path / "op_wide.json"), "--wide") == 0
    printed = " ".join(capsys.readouterr().out.split())
    for fragment in ("snapkv@0.80", "knorm@0.50", "not tested", "stopped at snapkv@0.20", "stopped at knorm@0.50",
                     "Chosen", "realised 0.496", "per-task breakdown", "above ε", "calibration distribution",
                     "the declared task mix", "not each task", "1 request(s) were skipped"):
        assert fragment in printed, fragment
    assert json.loads((tmp_path / "op_wide.json").read_text())["candidates"] == data["candidates"]


def test_certify_default_output_is_in_the_store(contract_path, capsys):
    assert run_main("certify", str(contract_path)) == 0
    target = load_contract(contract_path).resolved_store_path() / "operating_point.json"
    assert json.loads(target.read_text())["policy"] == "snapkv@0.50"
    assert str(target) in capsys.readouterr().out


def test_certify_a_csv_loss_table(contract_path, tmp_path, capsys):
    contract = load_contract(contract_path)
    with CalibrationStore.read(contract.resolved_store_path()) as store:
        rows = store.records()
    table = tmp_path / "losses.csv"
    with table.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["request_id", "task", "policy", "kv_retained", "loss"])
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r[k] for k in writer.fieldnames})
    out = tmp_path / "op_csv.json"
    assert run_main("certify", str(contract_path), "--records", str(table), "-o", str(out)) == 0
    data = json.loads(out.read_text())
    from_store = certify(load_records(contract).table, certification_spec(contract))
    assert data["policy"] == from_store.policy
    assert [c["violations"] for c in data["candidates"]] == [c.violations for c in from_store.candidates]
    assert f"loss table {table}" in capsys.readouterr().out


def test_fallback_when_every_candidate_is_bad(contract_path, tmp_path, capsys):
    contract = load_contract(contract_path)
    table = tmp_path / "bad.csv"
    with table.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["request_id", "policy", "kv_retained", "loss"])
        for i in range(50):
            for c in candidates(contract):
                writer.writerow([f"q{i}", c.policy, c.kv_retained, 1.0 if i % 2 else 0.0])
    out = tmp_path / "fallback.json"
    assert run_main("certify", str(contract_path), "--records", str(table), "-o", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["policy"] == "full" and data["fallback"] is True and data["kv_retained"] == 1.0
    assert "no candidate was certified" in data["reason"] and "snapkv@0.80" in data["reason"]
    printed = " ".join(capsys.readouterr().out.split())
    assert "Fallback" in printed and "calibration distribution (the declared task mix)" in printed


def test_missing_store_is_one_line_with_the_calibrate_hint(tmp_path, capsys):
    path = write_contract(tmp_path / "empty")
    code = run_main("certify", str(path))
    assert_one_line_error(code, capsys.readouterr().err, "no calibration store", f"certkv calibrate {path}")


def test_empty_store_is_one_line(tmp_path, capsys):
    path = write_contract(tmp_path / "fresh")
    contract = load_contract(path)
    CalibrationStore.open(contract.resolved_store_path(), contract).close()
    code = run_main("certify", str(path))
    assert_one_line_error(code, capsys.readouterr().err, "no records yet", "certkv calibrate")


def test_store_of_another_contract_is_refused(contract_path, tmp_path, capsys):
    store = load_contract(contract_path).resolved_store_path()
    other = write_contract(tmp_path / "other", risk=0.2, store=str(store))
    code = run_main("certify", str(other))
    assert_one_line_error(code, capsys.readouterr().err, "another contract")


def test_certify_does_not_import_torch(contract_path, tmp_path):
    """Run in a fresh interpreter: nothing certify imports may pull in the model stack."""
    out = tmp_path / "tf.json"
    certify_without_torch(str(contract_path), "-o", str(out))
    assert json.loads(out.read_text())["policy"] == "snapkv@0.50"


# ----------------------------------------------------------------------------- validate


def test_validate_writes_both_methods(contract_path, tmp_path, capsys):
    out = tmp_path / "val.json"
    code = run_main("validate", str(contract_path), "--splits", "200", "--calibration-fraction", "0.5",
                    "--seed", "3", "-o", str(out))
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data["methods"]) == {"certkv", "empirical_thresholding"}
    assert data["n_splits"] == 200 and data["seed"] == 3 and data["delta"] == pytest.approx(0.1)
    assert data["records_sha256"] == load_records(load_contract(contract_path)).records_sha256
    for m in data["methods"].values():
        assert len(m["test_risks"]) == 200
        assert 0.0 <= m["exceed_ci_low"] <= m["exceed_fraction"] <= m["exceed_ci_high"] <= 1.0
    printed = " ".join(capsys.readouterr().out.split())
    assert "empirical thresholding" in printed and "δ = 0.1" in printed and "95% CI" in printed


def test_validate_bad_fraction_is_one_line(contract_path, tmp_path, capsys):
    code = run_main("validate", str(contract_path), "--calibration-fraction", "1.5", "-o", str(tmp_path / "v.json"))
    assert_one_line_error(code, capsys.readouterr().err, "calibration_fraction")


def test_python_api_certifies_records_against_a_contract(tmp_path):
    """`certkv.certify(table, certkv.certification_spec(contract))` gives the same decision as the CLI's path."""
    import certkv
    from certkv.contract.loading import parse_contract

    contract = parse_contract({
        "name": "api", "requests": {"source": "builtin:demo"}, "utility": "exact_match", "tolerance": 0.0,
        "risk": 0.1, "confidence": 0.9, "policies": [{"press": "snapkv", "kv_retained": [0.8, 0.5, 0.2]}],
    })
    records = []
    for i in range(200):
        records.append({"request_id": f"r{i}", "policy": "full", "kv_retained": 1.0, "loss": 0.0})
        for kv, bad_every in [(0.8, 100), (0.5, 40), (0.2, 3)]:
            loss = 1.0 if i % bad_every == 0 else 0.0
            records.append({"request_id": f"r{i}", "policy": f"snapkv@{kv:.2f}", "kv_retained": kv, "loss": loss})
    op = certkv.certify(certkv.LossTable.from_records(records), certkv.certification_spec(contract),
                        contract_sha256=contract.sha256())
    assert op.policy == "snapkv@0.50" and not op.fallback
    assert op.violations == 5 and op.n == 200
    # The workflow's certify (what `certkv certify --records` runs) reads the same rows from a file,
    # binds the contract's hash itself and decides the same.
    from certkv import workflow

    table = tmp_path / "records.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in records))
    bound = workflow.certify(contract, records=table, output=tmp_path / "op.json").operating_point
    assert bound.contract_sha256 == contract.sha256() == op.contract_sha256
    assert (bound.policy, bound.violations, bound.n, bound.records_sha256) == (op.policy, op.violations, op.n, op.records_sha256)
