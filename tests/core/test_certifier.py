"""The certifier, its operating point JSON, and the loss-table readers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from certkv.core.certify import certify, select_candidates
from certkv.core.loss_table import LossTable, read_loss_table, records_sha256
from certkv.core.operating_point import OperatingPoint, load_operating_point
from certkv.core.policy_names import policy_name
from certkv.core.spec import CertificationSpec
from certkv.errors import CertkvError

N = 200


def records(spec: dict, n: int = N, tasks=None, memory=None, full_rows=True) -> list[dict]:
    """Rows for policies given as {name: (kv_retained, number of violating requests)}.

    The first k requests violate (loss 1.0), the rest lose nothing; ``memory`` optionally maps a
    policy to per-request memory values.
    """
    rows = []
    for i in range(n):
        rid = f"q{i:04d}"
        task = tasks[i % len(tasks)] if tasks else None
        if full_rows:
            rows.append({"request_id": rid, "policy": "full", "kv_retained": 1.0, "loss": 0.0,
                         "task": task})
        for name, (kv, k) in spec.items():
            row = {"request_id": rid, "policy": name, "kv_retained": kv,
                   "loss": 1.0 if i < k else 0.0, "task": task}
            if memory and name in memory:
                row["memory"] = memory[name][i]
            rows.append(row)
    return rows


def make_spec(*sequences, procedure="fixed_sequence", risk=0.05, confidence=0.95, tolerance=0.0):
    return CertificationSpec(tolerance=tolerance, risk=risk, confidence=confidence,
                             procedure=procedure, sequences=[list(s) for s in sequences])


# ----------------------------------------------------------------------------- selection


def test_picks_least_kv_among_certified_and_stops_the_sequence():
    # n = 200, ε = δ = 0.05: k ≤ 4 certifies (P(Bin(200, .05) ≤ 4) ≈ 0.026, ≤ 5 ≈ 0.062).
    rows = records({"snapkv@0.90": (0.9, 0), "snapkv@0.70": (0.7, 3), "snapkv@0.50": (0.5, 9),
                    "snapkv@0.30": (0.3, 2)})
    op = certify(LossTable.from_records(rows), make_spec(["snapkv@0.90", "snapkv@0.70", "snapkv@0.50", "snapkv@0.30"]))
    assert (op.policy, op.press, op.kv_retained, op.fallback) == ("snapkv@0.70", "snapkv", 0.7,
                                                                  False)
    assert (op.n, op.violations) == (200, 3)
    assert [c.certified for c in op.candidates] == [True, True, False, False]
    seq = op.sequences[0]
    assert (seq.stopped_at, seq.stopped_policy, seq.tested, seq.certified) == (2, "snapkv@0.50",
                                                                                3, 2)
    assert op.risk_upper_bound <= 0.05 and op.p_value <= 0.05
    assert all(type(c.violations) is int for c in op.candidates)


def test_ties_in_kv_are_broken_by_lower_empirical_risk():
    rows = records({"a@0.50": (0.5, 4), "b@0.50": (0.5, 1), "c@0.90": (0.9, 0)})
    op = certify(LossTable.from_records(rows), make_spec(["c@0.90", "a@0.50"], ["b@0.50"], procedure="bonferroni",
                                 confidence=0.9))
    assert op.policy == "b@0.50"


def test_full_ties_fall_back_to_contract_order():
    assert select_candidates([True, True, True], [0.5, 0.5, 0.5], [2, 2, 2]).item() == 0
    assert select_candidates([False, True, True], [0.5, 0.5, 0.5], [2, 2, 2]).item() == 1
    assert select_candidates([False, False], [0.5, 0.4], [0, 0]).item() == -1


def test_memory_column_drives_selection_for_gated_candidates():
    # The gated candidate nominally keeps 30% but falls back to the full cache (memory 1.0) on
    # half the requests: mean memory 0.65 > 0.5, so the plain 0.5 candidate wins.
    gated = [1.0 if i % 2 else 0.3 for i in range(N)]
    rows = records({"snapkv@0.50": (0.5, 0), "snapkv@0.30+gate": (0.3, 0)},
                   memory={"snapkv@0.30+gate": gated})
    op = certify(LossTable.from_records(rows), make_spec(["snapkv@0.50"], ["snapkv@0.30+gate"]))
    gated_result = op.candidates[1]
    assert gated_result.kv_retained == 0.3
    assert gated_result.mean_kv_retained == pytest.approx(0.65)
    assert op.policy == "snapkv@0.50" and op.mean_kv_retained == 0.5


def test_fallback_names_the_first_failed_candidate():
    rows = records({"snapkv@0.90": (0.9, 30), "knorm@0.90": (0.9, 40)})
    op = certify(LossTable.from_records(rows), make_spec(["snapkv@0.90"], ["knorm@0.90"]))
    assert (op.policy, op.kv_retained, op.fallback) == ("full", 1.0, True)
    assert "snapkv@0.90" in op.reason and "30/200" in op.reason
    assert f"{op.candidates[0].risk_upper_bound:.4g}" in op.reason
    assert "1 other" in op.reason
    assert op.to_dict()["reason"] == op.reason
    assert op.p_value is None and op.violations == 0 and op.risk_upper_bound == 0.0


def test_certified_candidates_have_reason_omitted_in_json():
    op = certify(LossTable.from_records(records({"x@0.5": (0.5, 0)})), make_spec(["x@0.5"]))
    assert "reason" not in op.to_dict()


def test_policy_missing_from_records_is_an_error():
    rows = records({"snapkv@0.90": (0.9, 0)})
    with pytest.raises(CertkvError, match=r"'snapkv@0.50' \(sequence 0, position 1\)"):
        certify(LossTable.from_records(rows), make_spec(["snapkv@0.90", "snapkv@0.50"]))


def test_policies_outside_the_sequences_are_ignored_with_a_note():
    rows = records({"snapkv@0.90": (0.9, 0), "tova@0.10": (0.1, 0)})
    op = certify(LossTable.from_records(rows), make_spec(["snapkv@0.90"]))
    assert op.policy == "snapkv@0.90" and [c.policy for c in op.candidates] == ["snapkv@0.90"]
    assert any("tova@0.10" in note and "ignored" in note for note in op.notes)


def test_per_task_breakdown_flags_tasks_above_risk():
    # 8 violations on the first 8 of 400 requests; tasks alternate, so each gets 4 of its 200.
    rows = records({"p@0.50": (0.5, 8)}, n=400, tasks=["needle", "qa"])
    op = certify(LossTable.from_records(rows), make_spec(["p@0.50"]))
    assert op.per_task["needle"].n == 200 and op.per_task["needle"].violations == 4
    assert op.per_task["needle"].exceeds_risk is False
    skewed = records({"p@0.50": (0.5, 0)}, n=400, tasks=["needle", "qa"])
    for row in skewed:  # 12 of needle's 200 requests violate: 6% > ε for needle, 3% overall
        if row["policy"] == "p@0.50" and row["task"] == "needle" and int(row["request_id"][1:]) < 24:
            row["loss"] = 1.0
    op = certify(LossTable.from_records(skewed), make_spec(["p@0.50"]))
    assert op.fallback is False
    assert op.per_task["needle"].rate == pytest.approx(0.06) and op.per_task["needle"].exceeds_risk
    assert not op.per_task["qa"].exceeds_risk
    assert op.candidates[0].per_task["needle"].exceeds_risk
    assert any("'needle'" in note and "task mix" in note for note in op.notes)


def test_guarantee_sentence_states_its_scope():
    op = certify(LossTable.from_records(records({"p@0.50": (0.5, 0)})), make_spec(["p@0.50"]))
    assert op.guarantee.startswith(
        "With probability ≥ 0.95 over the calibration draw, at most 5% of requests from the "
        "calibration distribution lose more than 0.0 utility."
    )
    assert "not each task" in op.guarantee


def test_tolerance_absorbs_float_noise_in_losses():
    rows = records({"p@0.50": (0.5, 0)})
    for row in rows:
        if row["policy"] == "p@0.50":
            row["loss"] = 0.8 - 0.7  # 0.10000000000000009: a naive comparison counts it
    op = certify(LossTable.from_records(rows), make_spec(["p@0.50"], tolerance=0.1))
    assert op.violations == 0


def test_reference_rows_are_ignored():
    with_full = certify(LossTable.from_records(records({"p@0.50": (0.5, 2)})), make_spec(["p@0.50"]))
    without = certify(LossTable.from_records(records({"p@0.50": (0.5, 2)}, full_rows=False)), make_spec(["p@0.50"]))
    assert with_full.records_sha256 == without.records_sha256
    assert with_full.violations == without.violations == 2


def test_levels_and_bounds_follow_the_procedure():
    rows = records({"a@0.5": (0.5, 1), "b@0.5": (0.5, 2)})
    op = certify(LossTable.from_records(rows), make_spec(["a@0.5"], ["b@0.5"]))
    for c in op.candidates:
        assert c.level == pytest.approx(0.025)
        assert (c.risk_upper_bound <= 0.05) == (c.p_value <= c.level) == c.certified


def test_spec_validation_errors_are_one_line():
    base = dict(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[["a@0.5"]])
    for bad, match in [
        ({"risk": 1.5}, "risk"),
        ({"confidence": 0.0}, "confidence"),
        ({"tolerance": -0.1}, "tolerance"),
        ({"procedure": "bh"}, "procedure"),
        ({"sequences": [["a@0.5"], []]}, "empty"),
        ({"sequences": [["a@0.5"], ["a@0.5"]]}, "twice"),
        ({"sequences": [["full"]]}, "reference"),
        ({"extra": 1}, "unknown key"),
    ]:
        with pytest.raises(CertkvError, match=match) as err:
            certify(LossTable.from_records(records({"a@0.5": (0.5, 0)})), CertificationSpec.parse({**base, **bad}))
        assert "\n" not in str(err.value)


def test_policy_name_convention():
    assert policy_name("snapkv", 0.5) == "snapkv@0.50"


# ----------------------------------------------------------------------------- JSON


DESIGN_KEYS = {"policy", "press", "kv_retained", "fallback", "contract", "n", "violations",
               "risk_upper_bound", "p_value", "candidates", "guarantee", "contract_sha256",
               "records_sha256", "created", "certkv_version"}
CANDIDATE_KEYS = {"policy", "kv_retained", "n", "violations", "empirical_risk",
                  "risk_upper_bound", "p_value", "certified"}


def test_operating_point_json_round_trip(tmp_path):
    rows = records({"snapkv@0.90": (0.9, 0), "snapkv@0.50": (0.5, 3)}, tasks=["a", "b"])
    op = certify(LossTable.from_records(rows), make_spec(["snapkv@0.90", "snapkv@0.50"]), contract_sha256="c" * 64)
    path = op.write_json(tmp_path / "out" / "operating_point.json")
    assert sorted(p.name for p in path.parent.iterdir()) == ["operating_point.json"]  # no temp
    data = json.loads(path.read_text(encoding="utf-8"))
    assert DESIGN_KEYS <= set(data)
    assert set(data["contract"]) == {"tolerance", "risk", "confidence", "procedure", "utility", "kv_cost"}
    assert CANDIDATE_KEYS <= set(data["candidates"][0])
    assert data["contract_sha256"] == "c" * 64 and len(data["records_sha256"]) == 64
    assert data["created"].endswith("Z")
    loaded = load_operating_point(path)
    assert isinstance(loaded, OperatingPoint) and loaded == op


def test_fallback_operating_point_round_trips(tmp_path):
    op = certify(LossTable.from_records(records({"x@0.5": (0.5, 50)})), make_spec(["x@0.5"]))
    loaded = load_operating_point(op.write_json(tmp_path / "op.json"))
    assert loaded.fallback and loaded.reason == op.reason and loaded.p_value is None


def test_load_operating_point_errors(tmp_path):
    with pytest.raises(CertkvError, match="not found"):
        load_operating_point(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(CertkvError, match="not valid JSON"):
        load_operating_point(bad)
    bad.write_text(json.dumps({"format_version": 1, "policy": "x"}), encoding="utf-8")
    with pytest.raises(CertkvError, match="bad.json: .*Field required"):
        load_operating_point(bad)


def test_records_hash_is_canonical(tmp_path):
    rows = records({"a@0.5": (0.5, 2), "b@0.3": (0.3, 1)}, tasks=["t"])
    digest = records_sha256(LossTable.from_records(rows))
    assert records_sha256(LossTable.from_records(list(reversed(rows)))) == digest
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert records_sha256(read_loss_table(path)) == digest
    rows[5]["loss"] = 0.5
    assert records_sha256(LossTable.from_records(rows)) != digest


# ----------------------------------------------------------------------------- readers


def write_csv(path: Path, header: str, *lines: str) -> Path:
    path.write_text("\n".join([header, *lines]) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, *rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


GOOD_CSV = [
    "r1,a@0.50,0.5,0.0,qa",
    "r2,a@0.50,0.5,1.0,qa",
    "r1,b@0.30,0.3,0.0,qa",
    "r2,b@0.30,0.3,0.25,qa",
    "r1,full,,,qa",
]


def test_csv_reader_builds_a_dense_table(tmp_path):
    table = read_loss_table(write_csv(tmp_path / "t.csv", "request_id,policy,kv_retained,loss,task",
                                      *GOOD_CSV))
    assert table.policies == ("a@0.50", "b@0.30") and table.request_ids == ("r1", "r2")
    assert table.loss.tolist() == [[0.0, 1.0], [0.0, 0.25]]
    assert table.memory.tolist() == [[0.5, 0.5], [0.3, 0.3]]  # defaults to kv_retained
    assert table.press == ("a", "b") and table.tasks == ("qa", "qa")


def test_jsonl_reader_matches_csv(tmp_path):
    rows = [dict(zip(["request_id", "policy", "kv_retained", "loss", "task"], line.split(",")))
            for line in GOOD_CSV]
    for r in rows:
        r["kv_retained"] = float(r["kv_retained"]) if r["kv_retained"] else None
        r["loss"] = float(r["loss"]) if r["loss"] else None
    csv_table = read_loss_table(write_csv(tmp_path / "t.csv",
                                          "request_id,policy,kv_retained,loss,task", *GOOD_CSV))
    jsonl_table = read_loss_table(write_jsonl(tmp_path / "t.jsonl", *rows, ""))
    assert records_sha256(csv_table) == records_sha256(jsonl_table)
    assert read_loss_table(tmp_path / "t.jsonl").policies == ("a@0.50", "b@0.30")


def test_optional_columns_are_read(tmp_path):
    table = read_loss_table(write_csv(
        tmp_path / "t.csv", "request_id,policy,kv_retained,loss,press,memory,kv_retained_actual",
        "r1,g@0.30,0.3,0.0,snapkv,1.0,0.31", "r2,g@0.30,0.3,0.0,snapkv,,0.29"))
    assert table.press == ("snapkv",)
    assert table.memory.tolist() == [[1.0, 0.3]]
    assert table.kv_retained_actual.tolist() == [[0.31, 0.29]]
    op = certify(table, make_spec(["g@0.30"], risk=0.9, confidence=0.5))
    assert op.candidates[0].kv_retained_actual == pytest.approx(0.30)


HEADER = "request_id,policy,kv_retained,loss"


@pytest.mark.parametrize(
    "lines,match",
    [
        (["request_id,policy,loss", "r1,a,0.0"],
         r"missing column 'kv_retained' \(columns found: request_id, policy, loss\)"),
        ([HEADER, "r1,a@0.5,0.5,0.0", "r2,a@0.5,0.5,oops"], r"line 3: loss 'oops' is not a number"),
        ([HEADER, "r1,a@0.5,0.5,0.0", "r2,a@0.5,0.5,"], r"line 3: loss '' is not a number"),
        ([HEADER, "r1,a@0.5,0.5,0.0", "r1,a@0.5,0.5,1.0"],
         r"duplicate row for request 'r1' and policy 'a@0.5' \(line 2 and line 3\)"),
        ([HEADER, "r1,a@0.5,0.5,0.0", "r2,a@0.5,0.5,0.0", "r3,a@0.5,0.5,0.0", "r1,b@0.3,0.3,0.0"],
         r"policy 'b@0.3' is missing 2 of 3 requests \(e.g. 'r2'\)"),
        ([HEADER, "r1,a@0.5,1.5,0.0"], r"line 2: kv_retained 1.5 is outside \(0, 1\]"),
        ([HEADER, "r1,a@0.5,0.5,0.0", "r2,a@0.5,0.4,0.0"], "different kv_retained"),
        ([HEADER, "r1,a@0.5,0.5,nan"], "line 2: loss 'nan' is not a finite number"),
        ([HEADER, ",a@0.5,0.5,0.0"], "line 2: request_id is empty"),
        ([HEADER], "no rows"),
    ],
)
def test_malformed_csv_errors_name_the_problem(tmp_path, lines, match):
    path = write_csv(tmp_path / "bad.csv", *lines)
    with pytest.raises(CertkvError, match=match) as err:
        read_loss_table(path)
    assert "\n" not in str(err.value) and "bad.csv" in str(err.value)


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"request_id": "r1", "policy": "a", "kv_retained": 0.5, "loss": 0.0},
          {"request_id": "r2", "policy": "a", "kv_retained": 0.5}], "line 2: missing column 'loss'"),
        (['{"request_id": "r1", "policy": "a", "kv_retained": 0.5, "loss": 0.0}', "{oops"],
         "line 2: not valid JSON"),
        (["[1, 2]"], "line 1: expected a JSON object"),
        ([{"request_id": "r1", "policy": "a", "kv_retained": 0.5, "loss": "high"}],
         "line 1: loss 'high' is not a number"),
        ([{"request_id": "r1", "policy": "a", "kv_retained": 0.5, "loss": None}],
         "line 1: loss None is not a finite number"),
        ([{"request_id": "r1", "policy": "a", "kv_retained": 0.5, "loss": 0, "task": "x"},
          {"request_id": "r1", "policy": "b", "kv_retained": 0.5, "loss": 0, "task": "y"}],
         "line 2: request 'r1' has rows with different task values"),
    ],
)
def test_malformed_jsonl_errors_name_the_line(tmp_path, rows, match):
    with pytest.raises(CertkvError, match=match):
        read_loss_table(write_jsonl(tmp_path / "bad.jsonl", *rows))


def test_reader_file_errors(tmp_path):
    with pytest.raises(CertkvError, match="loss table not found"):
        read_loss_table(tmp_path / "missing.csv")
    (tmp_path / "t.parquet").write_text("x", encoding="utf-8")
    with pytest.raises(CertkvError, match="use a .csv or .jsonl"):
        read_loss_table(tmp_path / "t.parquet")
    with pytest.raises(CertkvError, match="loss table not found"):
        read_loss_table(str(tmp_path / "missing.jsonl"))


def test_record_dict_errors_name_the_record():
    rows = records({"a@0.5": (0.5, 0)}, n=3, full_rows=False)
    del rows[2]["policy"]
    with pytest.raises(CertkvError, match="record 3: missing column 'policy'"):
        LossTable.from_records(rows)
    with pytest.raises(CertkvError, match="only reference rows"):
        LossTable.from_records([{"request_id": "r", "policy": "full", "kv_retained": 1, "loss": 0}])


def test_store_records_with_extra_columns_are_accepted():
    rows = records({"snapkv@0.50": (0.5, 1)}, tasks=["qa"])
    for row in rows:
        row.update(utility=1.0, utility_full=1.0, answer="x", agreement_drop=None, seconds=0.1)
        if row["policy"] == "full":
            row["kv_retained"] = None  # the store leaves the reference's retention empty
    table = LossTable.from_records(rows)
    assert table.policies == ("snapkv@0.50",) and table.n_requests == N


# ----------------------------------------------------------------------------- torch-free


def test_certify_never_imports_torch(tmp_path):
    script = (
        "import sys\n"
        "from certkv.core.certify import certify, CertificationSpec\n"
        "from certkv.core.loss_table import LossTable\n"
        "import certkv.core.validation\n"
        "rows = LossTable.from_records([{'request_id': f'r{i}', 'policy': 'a@0.50', 'kv_retained': 0.5, 'loss': 0.0}\n"
        "                                for i in range(100)])\n"
        "op = certify(rows, CertificationSpec(tolerance=0, risk=0.05, confidence=0.95,\n"
        "                                     sequences=[['a@0.50']]))\n"
        "certkv.core.validation.validate(rows, CertificationSpec(tolerance=0, risk=0.05,\n"
        "                          confidence=0.95, sequences=[['a@0.50']]), n_splits=3)\n"
        "heavy = [m for m in ('torch', 'transformers', 'kvpress') if m in sys.modules]\n"
        "print(op.policy, heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "a@0.50 []"


def test_requests_without_a_task_are_grouped_as_no_task():
    rows = records({"p@0.50": (0.5, 0)}, n=6, tasks=["x"], full_rows=False)
    for row in rows[:2]:
        row["task"] = None
    table = LossTable.from_records(rows)
    assert table.tasks == (None, None, "x", "x", "x", "x")
    op = certify(table, make_spec(["p@0.50"], risk=0.5, confidence=0.5))
    assert {name: t.n for name, t in op.per_task.items()} == {"(no task)": 2, "x": 4}


def test_records_of_the_wrong_type_are_rejected():
    with pytest.raises(CertkvError, match="records must be"):
        certify(5, make_spec(["a"]))
    with pytest.raises(CertkvError, match="spec must be a CertificationSpec"):
        certify(LossTable.from_records(records({"a@0.5": (0.5, 0)})), {"tolerance": 0.0})
