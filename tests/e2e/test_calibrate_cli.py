"""`certkv calibrate` end to end on the embedded model: resumable after SIGKILL, clean errors."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_main
from forked_processes import run_script

#: Room for the three kills below (four requests stored by then) and a resumed rest; every test here
#: calibrates some of them, the SIGKILL test all of them twice.
N_REQUESTS = 8

CONTRACT = {
    "name": "killtest",
    "model": "embedded",
    "requests": {"source": "requests.jsonl", "limit": N_REQUESTS},
    "protocol": {"max_new_tokens": 8, "device": "cpu"},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.2,
    "confidence": 0.9,
    "policies": [
        {"press": "snapkv", "kv_retained": [0.6, 0.2]},
        {"press": "streaming_llm", "kv_retained": [0.3]},
        {"press": "adakv", "press_kwargs": {"press": "knorm"}, "kv_retained": [0.5]},
    ],
    "gate": {"agreement_drop": [0.05]},  # so that the gate signal is stored (and resumed) too
    "store": "store",
}

# Timing and per-run bookkeeping differ between runs; everything a certificate reads must not.
VOLATILE = {"seconds", "extra", "seconds_breakdown"}


def _setup(folder: Path) -> Path:
    from certkv.requests.request_set import generate_requests, write_jsonl

    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(generate_requests("all", N_REQUESTS, seed=77, context_length="100-300"), folder / "requests.jsonl")
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump(CONTRACT))
    return path


def _records(folder: Path) -> list[dict]:
    from certkv.calibration.store import CalibrationStore

    with CalibrationStore.read(folder / "store") as store:
        records = [{k: v for k, v in r.items() if k not in VOLATILE} for r in store.records()]
        skipped = store.skipped()
    return sorted(records, key=lambda r: (r["request_id"], r["policy"])), skipped


def _stored_requests(folder: Path) -> tuple[int, int]:
    """(requests, skipped requests) committed to the store so far; (0, 0) before it exists."""
    from certkv.calibration.store import CalibrationStore, db_path

    if not db_path(folder / "store").is_file():
        return 0, 0
    with CalibrationStore.read(folder / "store") as store:
        return store.request_count(), len(store.skipped())


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


# `certkv calibrate CONTRACT --quiet`, as `python -m certkv.cli.app` runs it, but SIGKILLed (no
# handler runs, no cleanup: a power cut) at a hook of the store's writing code, for the `nth`
# request this run writes: "before" (the request computed, its transaction not begun), "inside"
# (after the transaction's third record, uncommitted) or "after" (its COMMIT returned). The hooks wrap
# the store's own methods, which run unchanged; the kill lands mid-run by construction.
KILLED_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from certkv.calibration.store import CalibrationStore
    from certkv.cli.app import main

    when, nth, contract = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    write_request, insert = CalibrationStore.write_request, CalibrationStore._insert
    count = {"writes": 0, "records": 0}

    def kill(at):
        if count["writes"] == nth and when == at:
            os.kill(os.getpid(), signal.SIGKILL)

    def hooked_write_request(self, request_id, records):
        count["writes"] += 1
        count["records"] = 0
        kill("before")
        write_request(self, request_id, records)
        kill("after")

    def hooked_insert(self, sql, values):
        insert(self, sql, values)
        count["records"] += 1
        if count["records"] == 3:
            kill("inside")

    CalibrationStore.write_request, CalibrationStore._insert = hooked_write_request, hooked_insert
    sys.argv = ["certkv", "calibrate", contract, "--quiet"]
    main()
    """
)
# (hook, nth request of the run): a run resumes from what the runs before it left.
KILLS = [("after", 2), ("inside", 2), ("before", 2)]


def _calibrate_on_one_thread(contract: Path, capsys) -> None:
    """`certkv calibrate CONTRACT --quiet` in this process, on one thread as the killed children
    (_env): a matmul's float rounding depends on the thread count, and the recorded
    log-probabilities are compared to the last bit. Only the killed runs need processes of their own."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = run_main("calibrate", str(contract), "--quiet")
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capsys.readouterr().err


def test_sigkill_at_any_point_then_resume_equals_uninterrupted_run(tmp_path, capsys):
    reference = _setup(tmp_path / "reference")
    _calibrate_on_one_thread(reference, capsys)
    expected, expected_skipped = _records(tmp_path / "reference")
    assert len({r["request_id"] for r in expected}) == N_REQUESTS and len(expected) == N_REQUESTS * 5

    killed = _setup(tmp_path / "killed")
    script = tmp_path / "killed_child.py"
    script.write_text(KILLED_CHILD)
    mid_run_kills = 0
    for when, nth in KILLS:
        before, _ = _stored_requests(tmp_path / "killed")
        proc = run_script(script, [when, str(nth), str(killed)], cwd=REPO, env=_env(), timeout=600)
        assert proc.returncode == -signal.SIGKILL, (when, nth, proc.returncode, proc.stderr[-2000:])
        stored, skipped = _stored_requests(tmp_path / "killed")
        # the request killed before or inside its transaction is not stored; the one killed after is
        assert stored == before + nth - (when != "after"), (when, nth, before, stored)
        if 0 < stored + skipped < N_REQUESTS:
            mid_run_kills += 1
    _calibrate_on_one_thread(killed, capsys)
    got, got_skipped = _records(tmp_path / "killed")
    assert mid_run_kills >= 3, "the kills must land while calibration is writing requests"
    assert all(r["agreement_drop"] is not None for r in got)
    if got != expected:  # name the first difference: a diff of 5×8 records is unreadable
        diff = next((g, e) for g, e in zip(got, expected) if g != e)
        raise AssertionError(f"resumed records differ: {diff}")
    assert got_skipped == expected_skipped


def test_labelled_policies_calibrate_and_certify(tmp_path, capsys):
    path = _setup(tmp_path)
    labelled = dict(CONTRACT, policies=[
        {"press": "snapkv", "label": "snap_wide", "press_kwargs": {"window_size": 32}, "kv_retained": [0.5]},
        {"press": "snapkv", "kv_retained": [0.5]},
    ])
    path.write_text(yaml.safe_dump(labelled))
    assert run_main("calibrate", str(path), "--quiet", "--limit", "3") == 0, capsys.readouterr().err
    records, _ = _records(tmp_path)
    assert {(r["policy"], r["press"]) for r in records} == {
        ("full", "full"), ("snap_wide@0.50", "snapkv"), ("snapkv@0.50", "snapkv")
    }
    # Three of the planned requests: certify refuses, a preview is labelled as such.
    capsys.readouterr()
    assert run_main("certify", str(path)) == 2 and f"3 of {N_REQUESTS} planned requests" in capsys.readouterr().err
    assert run_main("certify", str(path), "--allow-incomplete") == 0, capsys.readouterr().err
    assert "NO GUARANTEE" in (tmp_path / "store" / "operating_point.json").read_text()


def test_other_contract_on_same_store_is_refused_then_new_store_moves_it_aside(tmp_path, capsys):
    path = _setup(tmp_path)
    assert run_main("calibrate", str(path), "--quiet", "--limit", "2") == 0
    changed = dict(CONTRACT, risk=0.3)
    path.write_text(yaml.safe_dump(changed))
    capsys.readouterr()
    assert run_main("calibrate", str(path), "--quiet", "--limit", "2") == 2
    err = capsys.readouterr().err
    assert "--new-store" in err and len(err.strip().splitlines()) == 1
    assert run_main("calibrate", str(path), "--quiet", "--limit", "2", "--new-store") == 0, capsys.readouterr().err
    assert len(list((tmp_path / "store").iterdir())) >= 2, "the old database is kept, not deleted"


def test_unrunnable_requests_are_skipped_with_reasons(tmp_path, capsys):
    path = _setup(tmp_path)
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()[:3]
    lines.append('{"id": "empty", "task": "x", "context": "   ", "question": "q?", "answers": ["1"]}')
    lines.append('{"id": "noanswer", "task": "x", "context": "The sky is blue.", "question": "q?", "answers": []}')
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    code, out = run_main("calibrate", str(path), "--quiet"), capsys.readouterr()
    assert code == 0, out.err
    assert "3 calibrated" in out.out and "2 skipped" in out.out
    _, skipped = _records(tmp_path)
    reasons = {s["request_id"]: s["reason"] for s in skipped}
    assert reasons["empty"] == "empty context"
    assert reasons["noanswer"].startswith("answer missing")


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("not json\n", "requests.jsonl:1: not valid JSON"),
        ('{"id": "a", "context": "x"}\n', "requests.jsonl:1: question: Field required"),
        ('{"id": "a", "context": "c", "question": "q", "answers": ["1"]}\n' * 2, "duplicate request id 'a'"),
    ],
)
def test_malformed_requests_are_one_line_exit_2(tmp_path, content, fragment, capsys):
    """Refused before any model loads, so in this process (a traceback would fail the test too)."""
    path = _setup(tmp_path)
    (tmp_path / "requests.jsonl").write_text(content)
    assert run_main("calibrate", str(path), "--quiet") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and fragment in err


def test_malformed_contract_through_the_cli_is_one_line(tmp_path, capsys):
    path = _setup(tmp_path)
    bad = dict(CONTRACT, risk=1.5, surprise=True)
    path.write_text(yaml.safe_dump(bad))
    assert run_main("calibrate", str(path)) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "risk" in line and "surprise" in line
