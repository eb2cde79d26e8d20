"""Usage errors through the installed `certkv` entry point: click's short message, exit code 2.

typer >= 0.26 raises the exceptions of its own copy of click (``typer._click``), older typer those
of the ``click`` package; `certkv.cli.app.main` must catch whichever the running typer raises
(issue 20: a mistyped option printed a 30-line traceback and exited 1). Everything here runs the
console script a user runs (the interrupted calibration runs what it runs, ``sys.exit(main())``,
with a hook that signals it), in a fresh process, against the typer that is installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from certkv.demo import DEMO_CONTRACT

#: The console script of this interpreter's environment (never another environment's from PATH,
#: whose typer may differ); the module entry point when this environment has no script.
_SCRIPT = shutil.which("certkv", path=str(Path(sys.executable).parent))
CERTKV = [_SCRIPT] if _SCRIPT else [sys.executable, "-m", "certkv.cli.app"]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore", COLUMNS="100")


def certkv(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CERTKV, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def _assert_short_usage_error(res: subprocess.CompletedProcess, fragment: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 4, res.stderr  # click: Usage, Try '... --help', Error
    assert fragment in lines[-1], res.stderr


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["no-such-command"], "No such command 'no-such-command'"),
        (["calibrate", "--bogus-option", str(DEMO_CONTRACT)], "--bogus-option"),
        (["certify"], "Missing argument 'CONTRACT'"),
        (["validate", str(DEMO_CONTRACT), "--splits", "notanumber"], "Invalid value for '--splits'"),
        (["generate", "builtin:demo", "--n", "-5", "-o", os.devnull], "certkv: error: --n must be at least 1, got -5"),
    ],
    ids=["unknown-command", "unknown-option", "missing-argument", "wrong-type", "certkv-check"],
)
def test_usage_errors_are_short_with_exit_2(args, fragment, tmp_path):
    _assert_short_usage_error(certkv(*args, cwd=tmp_path), fragment)


def test_certkv_and_pydantic_errors_stay_one_line(tmp_path):
    missing = certkv("certify", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEMO_CONTRACT.read_text().replace("risk: 0.05", "risk: 0.05\nrisky: 1", 1))
    typo = certkv("certify", str(bad), cwd=tmp_path)
    for res, fragment in ((missing, "missing.yaml"), (typo, "risky: unknown key")):
        assert res.returncode == 2, (res.returncode, res.stderr)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("certkv: error:") and fragment in lines[0], res.stderr


def _command_names() -> list[str]:
    from certkv.cli.app import app

    return sorted(info.name for info in app.registered_commands)


def test_every_command_has_help(tmp_path):
    names = _command_names()
    assert {"demo", "generate", "calibrate", "certify", "validate", "report", "export"} <= set(names)
    top = certkv("--help", cwd=tmp_path)
    assert top.returncode == 0 and "Usage" in top.stdout, top.stderr
    for name in names:
        res = certkv(name, "--help", cwd=tmp_path)
        assert res.returncode == 0, (name, res.stderr)
        assert "Usage" in res.stdout and "Traceback" not in res.stderr, (name, res.stdout, res.stderr)
        assert name in top.stdout, name  # listed at the top level too


def _stored_requests(store: Path) -> int:
    db = store / "records.sqlite"
    if not db.is_file():
        return 0
    conn = sqlite3.connect(db, timeout=5)
    try:
        return conn.execute("SELECT COUNT(DISTINCT request_id) FROM records").fetchone()[0]
    except sqlite3.DatabaseError:  # schema not written yet
        return 0
    finally:
        conn.close()


# `certkv calibrate CONTRACT --quiet` as the console script runs it (``sys.exit(main())``), but the
# process signals itself (SIGINT as Ctrl-C sends it, or SIGTERM) at a hook of the store's writing
# code: right after the `nth` request's transaction has committed. The hook wraps the store's own
# method, which runs unchanged; the signal lands mid-run, after exactly `nth` stored requests.
SIGNALLED_CHILD = textwrap.dedent(
    """
    import os, sys
    from certkv.calibration.store import CalibrationStore
    from certkv.cli.app import main

    signum, nth, contract = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    write_request = CalibrationStore.write_request
    writes = 0

    def hooked_write_request(self, request_id, records):
        global writes
        write_request(self, request_id, records)
        writes += 1
        if writes == nth:
            os.kill(os.getpid(), signum)

    CalibrationStore.write_request = hooked_write_request
    sys.argv = ["certkv", "calibrate", contract, "--quiet"]
    sys.exit(main())
    """
)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_during_calibration_exits_130_or_143_and_keeps_the_store(tmp_path, signum, code):
    """SIGINT (SIGTERM) mid-calibration: exit 130 (143), one line saying the store is kept, no
    traceback, and the requests stored before the signal are still there (under typer >= 0.26 a
    KeyboardInterrupt became a silent exit code; certkv's own line must survive every typer).
    tests/e2e/test_interrupts.py interrupts a run at many chosen instants; this is the real process,
    signalled once its second request is stored (SIGNALLED_CHILD)."""
    contract = tmp_path / "c.yaml"
    contract.write_text(
        "name: c\nmodel: embedded\nrequests:\n  source: builtin:demo\n  context_length: 120-200\n  limit: 400\n"
        "utility: exact_match\ntolerance: 0.0\nrisk: 0.1\nconfidence: 0.9\n"
        "policies:\n  - press: snapkv\n    kv_retained: [0.5]\n"
    )
    script = tmp_path / "signalled_child.py"
    script.write_text(SIGNALLED_CHILD)
    store = tmp_path / "runs" / "c"
    res = subprocess.run([sys.executable, str(script), str(int(signum)), "2", str(contract)], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=600)
    err = res.stderr
    assert res.returncode == code, (res.returncode, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and "interrupted; everything stored so far is kept" in lines[-1], err
    stored = _stored_requests(store)
    assert stored == 2, stored  # the two committed before the signal (of 400), none after it
