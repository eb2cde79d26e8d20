"""The calibration store: contract binding, atomic per-request writes, crash safety, export.

The crash test SIGKILLs a writer repeatedly at hooks inside and between its transactions and
checks that the resumed result equals an uninterrupted run exactly.
Fake records only: no model is loaded.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

from certkv.calibration.store import COLUMNS, CalibrationStore, db_path
from certkv.contract.loading import parse_contract
from certkv.errors import CertkvError

CONTRACT = {
    "name": "s",
    "requests": {"source": "builtin:demo"},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.1,
    "confidence": 0.9,
    "policies": [
        {"press": "snapkv", "kv_retained": [0.8, 0.5, 0.2]},
        {"press": "knorm", "kv_retained": [0.5]},
    ],
}

# Deterministic fake records; the crash-test child builds the same records from this source.
FAKE_RECORDS = '''
from certkv.contract.spec import candidates


def fake_records(contract, i):
    full = (i % 3) / 2
    records = [dict(policy="full", task="t%d" % (i % 2), press=None, kv_retained=1.0, kv_retained_actual=1.0,
                    utility=full, utility_full=full, loss=0.0, answer="a%d" % i, path="fast", seconds=0.5)]
    for j, c in enumerate(candidates(contract)):
        u = ((i + j) % 3) / 2
        records.append(dict(policy=c.policy, task="t%d" % (i % 2), press=c.press, kv_retained=c.kv_retained,
                            kv_retained_actual=c.kv_retained - 0.01, utility=u, utility_full=full, loss=full - u,
                            answer="a%d-%d" % (i, j), agreement_drop=0.1 * j, certificate_max=None,
                            path="fast" if j % 2 else "pipeline", seconds=0.25, n_tokens=100 + i))
    return records
'''
exec(FAKE_RECORDS)


def make_contract(base: Path, **changes):
    data = json.loads(json.dumps(CONTRACT))
    data.update(changes)
    return parse_contract(data, "test", base)


@pytest.fixture
def contract(tmp_path):
    return make_contract(tmp_path)


def test_create_write_read_resume(tmp_path, contract):
    store = CalibrationStore.open(tmp_path / "st", contract)
    assert store.done_request_ids() == set() and store.count() == 0
    store.write_request("r0", fake_records(contract, 0))
    store.write_request("r1", fake_records(contract, 1))
    store.write_skipped("r2", "context too long")
    assert store.done_request_ids() == {"r0", "r1", "r2"}
    assert store.count() == 2 * 5 and store.request_count() == 2
    recs = store.records()
    assert [r["policy"] for r in recs[:5]] == ["full", "snapkv@0.80", "snapkv@0.50", "snapkv@0.20", "knorm@0.50"]
    assert recs[1]["n_tokens"] == 100 and recs[1]["request_id"] == "r0" and recs[1]["path"] == "pipeline"
    assert list(recs[1])[: len(COLUMNS)] == list(COLUMNS)
    meta = store.meta()
    assert meta["contract_sha256"] == contract.sha256()
    assert json.loads(meta["contract"])["name"] == "s"
    store.close()

    # WAL mode and FULL sync are what the durability argument relies on.
    conn = sqlite3.connect(db_path(tmp_path / "st"))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()

    with CalibrationStore.open(tmp_path / "st", make_contract(tmp_path)) as again:
        assert again.done_request_ids() == {"r0", "r1", "r2"}
        assert again.records() == recs
        assert again._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert again.skipped() == [{"request_id": "r2", "reason": "context too long"}]


def test_a_request_is_never_written_twice(tmp_path, contract):
    store = CalibrationStore.open(tmp_path / "st", contract)
    store.write_request("r0", fake_records(contract, 0))
    with pytest.raises(CertkvError, match="already in store"):
        store.write_request("r0", fake_records(contract, 0))
    with pytest.raises(CertkvError, match="already in store"):
        store.write_skipped("r0", "x")
    store.write_skipped("r1", "x")
    with pytest.raises(CertkvError, match="already in store"):
        store.write_request("r1", fake_records(contract, 1))
    assert store.count() == 5


@pytest.mark.parametrize("version", [None, "0", "2"])
def test_a_store_of_another_format_version_is_refused_in_one_line(tmp_path, contract, version):
    store = CalibrationStore.open(tmp_path / "st", contract)
    store.write_request("r0", fake_records(contract, 0))
    assert store.meta()["format_version"] == "1"
    store.close()
    file = db_path(tmp_path / "st")
    conn = sqlite3.connect(file, isolation_level=None)
    if version is None:  # a store an earlier build wrote
        conn.execute("DELETE FROM meta WHERE key = 'format_version'")
    else:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'format_version'", (version,))
    conn.close()
    shown = "none (written by an earlier certkv build)" if version is None else version
    expected = (f"{file}: format_version {shown}, this certkv reads 1; "
                "re-run `certkv calibrate CONTRACT --new-store` to write it again")
    for opening in (lambda: CalibrationStore.open(tmp_path / "st", contract), lambda: CalibrationStore.read(tmp_path / "st")):
        with pytest.raises(CertkvError) as err:
            opening()
        assert str(err.value) == expected
    # --new-store moves it aside, whatever its version, and starts a store of this one
    fresh = CalibrationStore.open(tmp_path / "st", contract, new=True)
    assert fresh.moved_aside is not None and fresh.count() == 0 and fresh.meta()["format_version"] == "1"
    fresh.close()


def test_rows_must_match_the_contract(tmp_path, contract):
    store = CalibrationStore.open(tmp_path / "st", contract)
    records = fake_records(contract, 0)
    with pytest.raises(CertkvError, match="missing: \\['knorm@0.50'\\]"):
        store.write_request("r", records[:-1])
    with pytest.raises(CertkvError, match="unknown: \\['tova@0.50'\\]"):
        store.write_request("r", records + [dict(records[-1], policy="tova@0.50")])
    with pytest.raises(CertkvError, match="lack the full-cache policy"):
        store.write_request("r", records[1:])
    with pytest.raises(CertkvError, match="more than once"):
        store.write_request("r", records + [records[1]])
    with pytest.raises(CertkvError, match="loss .* != utility_full − utility"):
        store.write_request("r", [records[0], dict(records[1], loss=0.5, utility=1.0, utility_full=1.0), *records[2:]])
    with pytest.raises(CertkvError, match="outside \\[0, 1\\]"):
        store.write_request("r", [dict(records[0], utility=2.0, utility_full=2.0, loss=0.0), *records[1:]])
    with pytest.raises(CertkvError, match="lacks answer"):
        store.write_request("r", [dict(records[0], answer=None), *records[1:]])
    with pytest.raises(CertkvError, match="the contract says 'snapkv' at 0.8"):
        store.write_request("r", [records[0], dict(records[1], kv_retained=0.7), *records[2:]])
    with pytest.raises(CertkvError, match="path must be"):
        store.write_request("r", [dict(records[0], path="slow"), *records[1:]])
    with pytest.raises(CertkvError, match="disagree on utility_full"):
        store.write_request("r", [records[0], dict(records[1], utility_full=0.9, loss=0.9 - records[1]["utility"]), *records[2:]])
    assert store.count() == 0 and store.done_request_ids() == set()


def test_failure_inside_the_transaction_leaves_nothing(tmp_path, contract, monkeypatch):
    store = CalibrationStore.open(tmp_path / "st", contract)
    calls = []
    original = CalibrationStore._insert

    def failing(self, sql, values):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        original(self, sql, values)

    monkeypatch.setattr(CalibrationStore, "_insert", failing)
    with pytest.raises(RuntimeError):
        store.write_request("r0", fake_records(contract, 0))
    assert store.count() == 0 and store.done_request_ids() == set()
    monkeypatch.setattr(CalibrationStore, "_insert", original)
    store.write_request("r0", fake_records(contract, 0))  # the connection is usable again
    assert store.count() == 5


def test_another_contract_is_refused_and_new_store_moves_aside(tmp_path, contract):
    with CalibrationStore.open(tmp_path / "st", contract) as store:
        store.write_request("r0", fake_records(contract, 0))
    other = make_contract(tmp_path, risk=0.2)
    with pytest.raises(CertkvError) as info:
        CalibrationStore.open(tmp_path / "st", other)
    message = str(info.value)
    assert "belongs to another contract" in message and "--new-store" in message and "store:" in message
    with CalibrationStore.open(tmp_path / "st", other, new=True) as fresh:
        assert fresh.count() == 0 and fresh.moved_aside is not None
        moved = fresh.moved_aside
    assert moved.exists() and moved.parent == tmp_path / "st" and moved.name.startswith("records.")
    conn = sqlite3.connect(moved)  # the old records survive, complete
    assert conn.execute("SELECT COUNT(*) FROM records").fetchone()[0] == 5
    conn.close()


def test_read_only_open_and_missing_store(tmp_path, contract):
    with pytest.raises(CertkvError, match="no calibration store at"):
        CalibrationStore.read(tmp_path / "nothing")
    with CalibrationStore.open(tmp_path / "st", contract) as store:
        store.write_request("r0", fake_records(contract, 0))
    with CalibrationStore.read(tmp_path / "st") as ro:
        assert ro.count() == 5 and ro.meta()["contract_sha256"] == contract.sha256()
        with pytest.raises(sqlite3.OperationalError):
            ro._conn.execute("DELETE FROM records")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "records.sqlite").write_text("not a database")
    with pytest.raises(CertkvError, match="not a certkv calibration store"):
        CalibrationStore.read(tmp_path / "junk")


def test_export_csv_and_jsonl(tmp_path, contract):
    with CalibrationStore.open(tmp_path / "st", contract) as store:
        for i in range(3):
            store.write_request(f"r{i}", fake_records(contract, i))
        recs = store.records()
        assert store.export(tmp_path / "out.csv") == 15
        assert store.export(tmp_path / "out.jsonl", "jsonl") == 15
        with pytest.raises(CertkvError, match="csv or jsonl"):
            store.export(tmp_path / "out.txt")
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert lines == recs
    with (tmp_path / "out.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert list(table[0])[: len(COLUMNS)] == list(COLUMNS) and "n_tokens" in table[0]
    assert [r["policy"] for r in table] == [r["policy"] for r in recs]
    assert [float(r["loss"]) for r in table] == [r["loss"] for r in recs]
    assert not list(tmp_path.glob(".*.tmp"))


# -- crash safety ----------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from certkv.contract.loading import parse_contract
    from certkv.calibration.store import CalibrationStore
    {fake_records}
    store_dir, n, at, nth = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    contract = parse_contract(json.loads(sys.argv[5]), "test", store_dir.parent)

    class HookedStore(CalibrationStore):
        inserted = 0

        def _insert(self, sql, values):  # SIGKILL at this run's nth record: inside its transaction
            super()._insert(sql, values)
            HookedStore.inserted += 1
            if at == "record" and HookedStore.inserted == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    store = HookedStore.open(store_dir, contract)
    done = store.done_request_ids()
    print("ready", len(done), flush=True)
    writes = 0
    for i in range(n):
        rid = "req-%04d" % i
        if rid in done:
            continue
        if i % 7 == 3:
            store.write_skipped(rid, "skipped %d" % i)
        else:
            store.write_request(rid, fake_records(contract, i))
        writes += 1
        if at == "write" and writes == nth:  # SIGKILL after this run's nth commit: between two
            os.kill(os.getpid(), signal.SIGKILL)
        print("wrote", rid, flush=True)
    print("finished", flush=True)
    """
).replace("{fake_records}", FAKE_RECORDS)


def _run_child(script: Path, store_dir: Path, n: int, at: str = "never", nth: int = 0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, str(script), str(store_dir), str(n), at, str(nth), json.dumps(CONTRACT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _check_complete(store_dir: Path, contract) -> None:
    """No partial request: every recorded request has exactly full + every candidate."""
    expected = sorted(["full", *(c.policy for c in candidates(contract))])
    conn = sqlite3.connect(db_path(store_dir))
    by_request: dict[str, list[str]] = {}
    for rid, policy in conn.execute("SELECT request_id, policy FROM records"):
        by_request.setdefault(rid, []).append(policy)
    conn.close()
    for rid, policies in by_request.items():
        assert sorted(policies) == expected, rid


# (hook, nth) per killed run, each resuming the last: a request is 5 records, so the 3rd record is inside
# the first transaction and the 10th the second's last record before its COMMIT; "write" kills between.
KILLS = [("record", 3), ("write", 2), ("record", 10), ("write", 5), ("record", 1)]


def test_sigkill_at_hooks_then_resume_equals_uninterrupted_run(tmp_path):
    n = 40
    contract = make_contract(tmp_path)
    script = tmp_path / "child.py"
    script.write_text(CHILD)

    reference = _run_child(script, tmp_path / "reference", n)
    out, err = reference.communicate(timeout=120)
    assert reference.returncode == 0, err
    assert "finished" in out

    kills = 0
    for at, nth in KILLS:
        proc = _run_child(script, tmp_path / "killed", n, at, nth)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL and out.startswith("ready"), err
        kills += 1
        _check_complete(tmp_path / "killed", contract)
    proc = _run_child(script, tmp_path / "killed", n)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "finished" in out, "the writer never finished: " + err
    _check_complete(tmp_path / "killed", contract)
    assert kills >= 3, f"only {kills} kills landed; the test did not exercise crashes"

    with CalibrationStore.read(tmp_path / "reference") as ref, CalibrationStore.read(tmp_path / "killed") as got:
        assert got.records() == ref.records()
        assert got.skipped() == ref.skipped()
        assert got.count() == (n - len(ref.skipped())) * 5
        assert got.meta()["contract_sha256"] == ref.meta()["contract_sha256"]


# -- the export command ----------------------------------------------------------------------------


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "certkv.cli.app", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_cli_export_missing_store_is_one_line_exit_2(tmp_path):
    proc = _cli("export", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no calibration store at" in lines[0]


def test_cli_export_bad_contract_is_one_line_exit_2(tmp_path):
    (tmp_path / "c.yaml").write_text("name: [broken\n")
    proc = _cli("export", str(tmp_path / "c.yaml"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid YAML" in lines[0]


def test_cli_export_writes_files(tmp_path):
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(dict(CONTRACT, store="st")))
    from certkv.contract.loading import load_contract

    contract = load_contract(tmp_path / "c.yaml")
    with CalibrationStore.open(contract.resolved_store_path(), contract) as store:
        store.write_request("r0", fake_records(contract, 0))
    proc = _cli("export", str(tmp_path / "c.yaml"), "--format", "jsonl")  # contract -> its store
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "st" / "records.jsonl").read_text().splitlines()) == 5
    proc = _cli("export", str(tmp_path / "st"), "-o", str(tmp_path / "x.csv"))
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "x.csv").read_text().splitlines()) == 6
    proc = _cli("export", str(tmp_path / "st"), "--format", "jsonl", "-o", "-")
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 5
