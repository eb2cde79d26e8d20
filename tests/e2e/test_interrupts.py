"""Ctrl-C and SIGTERM at any instant of a calibration: exit 130/143, one line, a store that resumes.

The main test interrupts `certkv calibrate` at 20 seeded instants of one run: the instants are
bytecodes of certkv's own code while the command's handlers are installed, 10 drawn over the
whole run and 10 over the store's writing code (the "already present" check, the inserts, the
transaction), plus every bytecode of the transaction itself (begin, commit, rollback), and
at each the real signal is raised in the process (``signal.raise_signal``), so Python's own
handler machinery delivers it at that bytecode, as it would a key press. Every instant is checked
for the exit code, certkv's line, no traceback, and a resumed store whose records equal an
uninterrupted run's. Everything runs in one child interpreter (one torch import for 40 runs).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import textwrap

import pytest
import yaml
from conftest import REPO
from forked_processes import run_script

from certkv import interrupts
from certkv.calibration.database import connect, transaction

# -- the primitives ------------------------------------------------------------------------------


def test_a_signal_inside_a_critical_block_is_held_until_it_ends():
    steps = []
    with pytest.raises(KeyboardInterrupt), interrupts.interruptible():
        with interrupts.critical():
            signal.raise_signal(signal.SIGINT)
            steps.append("after the signal, still inside")
            with interrupts.critical():  # nested: held until the outermost block ends
                steps.append("nested")
            steps.append("end of the outer block")
        steps.append("never reached")
    assert steps == ["after the signal, still inside", "nested", "end of the outer block"]


def test_sigterm_raises_terminated_and_exit_codes_follow_the_signal():
    with pytest.raises(interrupts.Terminated) as info, interrupts.interruptible():
        signal.raise_signal(signal.SIGTERM)
    assert isinstance(info.value, KeyboardInterrupt)
    assert interrupts.exit_code(info.value) == 143 and interrupts.exit_code(KeyboardInterrupt()) == 130


def test_handlers_are_restored_and_nothing_is_installed_outside():
    # Python's own Ctrl-C handler, whatever an earlier test in this process (Ray, a server) left
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = {sig: signal.getsignal(sig) for sig in interrupts.HANDLED}
        with interrupts.interruptible():
            assert all(signal.getsignal(sig) is not before[sig] for sig in interrupts.HANDLED)
        assert {sig: signal.getsignal(sig) for sig in interrupts.HANDLED} == before
        with interrupts.critical():  # outside interruptible: a no-op, Ctrl-C raises at once
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


class _InterruptAfterCommit:
    """A connection whose COMMIT succeeds and is then interrupted, as a Ctrl-C landing right after
    SQLite returned would be without certkv's handlers."""

    def __init__(self, conn):
        self._conn = conn

    @property
    def in_transaction(self):
        return self._conn.in_transaction

    def execute(self, sql, *args):
        out = self._conn.execute(sql, *args)
        if sql == "COMMIT":
            raise KeyboardInterrupt()
        return out


def test_an_interrupt_right_after_commit_stays_an_interrupt_and_the_row_stays(tmp_path):
    conn = connect(tmp_path / "db.sqlite")
    conn.execute("CREATE TABLE t (x INTEGER)")
    with pytest.raises(KeyboardInterrupt), transaction(_InterruptAfterCommit(conn)):
        conn.execute("INSERT INTO t VALUES (1)")
    assert conn.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 1 and not conn.in_transaction
    with pytest.raises(KeyboardInterrupt), transaction(conn):  # before COMMIT: rolled back
        conn.execute("INSERT INTO t VALUES (2)")
        raise KeyboardInterrupt()
    assert conn.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 1
    conn.close()
    assert sqlite3.connect(tmp_path / "db.sqlite").execute("SELECT x FROM t").fetchall() == [(1,)]


# -- 20 instants of a real calibration, and every bytecode of a transaction ------------------------

N_REQUESTS = 5
CONTRACT = {
    "name": "interrupted",
    "model": "embedded",
    "requests": {"source": "builtin:demo", "context_length": "120-200", "limit": N_REQUESTS, "seed": 3},
    "protocol": {"max_new_tokens": 6, "device": "cpu"},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.2,
    "confidence": 0.9,
    "policies": [{"press": "snapkv", "kv_retained": [0.6, 0.3]}, {"press": "streaming_llm", "kv_retained": [0.4]}],
    "gate": {"agreement_drop": [0.05]},
    "store": "store",
}
SEED = 2512
INSTANTS_OVER_THE_RUN = 10
INSTANTS_IN_WRITES = 10

CHILD = textwrap.dedent(
    """
    import contextlib, io, json, random, shutil, signal, sys
    from pathlib import Path

    import certkv
    from certkv import interrupts
    from certkv.calibration.store import CalibrationStore
    from certkv.cli.app import main

    work, seed, n_run, n_store = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    PACKAGE = str(Path(certkv.__file__).parent)
    VOLATILE = {"seconds", "seconds_breakdown", "extra"}
    # The store's writing code: its transactions and the functions that run inside them.
    WRITES = {"transaction", "write_request", "write_skipped", "_insert", "_present", "bind", "initialise"}

    class Tracer:
        # Counts bytecode events of certkv's code while the command's handlers are installed; at event
        # `at` it raises `signum` in this process and notes where.
        def __init__(self, at=None, signum=None):
            self.count, self.at, self.signum, self.where, self.in_writes = 0, at, signum, None, []
            self.by_offset = {}  # bytecode offset in database.transaction -> the events at it

        def __call__(self, frame, event, arg):
            if not frame.f_code.co_filename.startswith(PACKAGE):
                return None
            frame.f_trace_opcodes = True  # an instant may fall between two bytecodes of one line
            return self.local

        def local(self, frame, event, arg):
            if event == "opcode" and interrupts._state.active:
                if frame.f_code.co_name in WRITES and Path(frame.f_code.co_filename).name in ("store.py", "database.py"):
                    self.in_writes.append(self.count)
                if frame.f_code.co_name == "transaction" and frame.f_code.co_filename.endswith("database.py"):
                    self.by_offset.setdefault(frame.f_lasti, []).append(self.count)
                if self.count == self.at:
                    self.where = "%s:%s:%d" % (Path(frame.f_code.co_filename).name, frame.f_code.co_name, frame.f_lineno)
                    signal.raise_signal(self.signum)
                self.count += 1
            return self.local

    def calibrate(folder, tracer=None):
        # A run in its own folder (a copy of the contract, so a store of its own).
        folder.mkdir(exist_ok=True)
        contract = folder / "contract.yaml"
        if not contract.exists():
            shutil.copy(work / "contract.yaml", contract)
        err = io.StringIO()
        sys.argv = ["certkv", "calibrate", str(contract), "--quiet"]
        code = 0
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            sys.settrace(tracer)
            try:
                main()
            except SystemExit as exc:
                code = exc.code
            except BaseException as exc:  # escaped main(): what a user would see as a traceback
                import traceback
                code, err = "escaped", io.StringIO(traceback.format_exc())
            finally:
                sys.settrace(None)
        return code, err.getvalue()

    def records(folder):
        with CalibrationStore.read(folder / "store") as store:
            rows = [{k: v for k, v in r.items() if k not in VOLATILE} for r in store.records()]
            return sorted(rows, key=lambda r: (r["request_id"], r["policy"])), store.skipped()

    def stored(folder):
        try:
            with CalibrationStore.read(folder / "store") as store:
                return store.request_count() + len(store.skipped())
        except Exception:
            return 0

    # The first run in a process fills caches (the model's files, the built-in request set) that
    # later runs read, so it walks more lines: the counted reference is the second run.
    code, err = calibrate(work / "warm-up")
    assert code == 0, err
    reference = Tracer()
    code, err = calibrate(work / "reference", reference)
    assert code == 0, err
    again = Tracer()
    calibrate(work / "again", again)
    assert again.count == reference.count, ("a run's line events are not reproducible", again.count, reference.count)
    expected = records(work / "reference")
    rng = random.Random(seed)
    instants = sorted(rng.sample(range(reference.count), n_run)) + sorted(rng.sample(reference.in_writes, n_store))
    # and every bytecode of the transaction itself (at a seeded occurrence of each): the one right
    # after COMMIT returned is where an unguarded interrupt used to become "no transaction is active"
    instants += sorted(rng.choice(events) for events in reference.by_offset.values())
    for i, at in enumerate(instants):
        folder = work / ("run-%02d" % i)
        signum = signal.SIGTERM if i % 2 else signal.SIGINT
        tracer = Tracer(at, signum)
        code, err = calibrate(folder, tracer)
        partial = stored(folder)
        resumed, resume_err = calibrate(folder)
        print(json.dumps({"at": at, "signal": int(signum), "where": tracer.where, "code": code, "stderr": err,
                          "stored_at_interrupt": partial, "resume_code": resumed, "resume_stderr": resume_err,
                          "resumed_equal": resumed == 0 and records(folder) == expected}), flush=True)
    print(json.dumps({"events": reference.count, "in_writes": len(reference.in_writes),
                      "transaction_offsets": len(reference.by_offset)}), flush=True)
    """
)


def test_interrupted_at_seeded_instants_every_run_stops_cleanly_and_resumes_to_the_same_records(tmp_path):
    (tmp_path / "contract.yaml").write_text(yaml.safe_dump(CONTRACT))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    # One thread: a matmul's rounding depends on the thread count, and records compare to the bit.
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    res = run_script(script, [str(tmp_path), str(SEED), str(INSTANTS_OVER_THE_RUN), str(INSTANTS_IN_WRITES)], cwd=REPO,
                     env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    *runs, totals = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    for run in runs:
        lines = [line for line in run["stderr"].splitlines() if line.strip()]
        assert run["code"] == 128 + run["signal"], run
        assert "Traceback" not in run["stderr"], run
        assert len(lines) == 1 and lines[0] == "certkv: interrupted; everything stored so far is kept (rerun to resume)", run
        assert run["resume_code"] == 0, run
        assert run["resumed_equal"], run
    where = [run["where"] for run in runs]
    assert any(w.startswith("database.py:transaction") for w in where), where  # at BEGIN or COMMIT
    assert any(w.startswith(("store.py:write_request", "store.py:_insert")) for w in where), where  # between
    assert any(0 < run["stored_at_interrupt"] < N_REQUESTS for run in runs), "no instant fell between requests"
    assert {run["signal"] for run in runs} == {signal.SIGINT, signal.SIGTERM}
    assert totals["in_writes"] > 0 and totals["events"] > totals["in_writes"]
    assert len(runs) == INSTANTS_OVER_THE_RUN + INSTANTS_IN_WRITES + totals["transaction_offsets"] >= 40, totals
