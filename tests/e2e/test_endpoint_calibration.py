"""Endpoint calibration against real `certkv serve` upstreams, as a user runs it.

Two servers are the upstreams for the module (started by benchmarks/endpoint_servers.py, which the
gateway benchmark shares): the embedded model's full cache (a fallback point)
and its snapkv@0.50 point. Calibrating the endpoint contract through them gives the records and the
certificate of the same contract calibrated in-process (the same answers, utilities and losses per
request), without importing torch; a run killed between writes resumes to the same records; a
full upstream started late is waited for; one restarted as another point is caught by the probe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_main
from endpoint_servers import TERMS, Upstream
from endpoint_servers import endpoint_contract as _endpoint_contract
from endpoint_servers import full_point as _full_point
from test_serve import _free_port, _operating_point

from certkv.calibration.store import CalibrationStore
from certkv.requests.request_set import generate_requests, write_jsonl

#: The requests: six demo draws (single-needle and multi-key), the first the probe.
N_REQUESTS = 6

#: `certkv calibrate ARGS` in a fresh interpreter that fails if it imported the model stack.
WITHOUT_TORCH = """
import sys
from certkv.cli.app import main
sys.argv = ["certkv", "calibrate", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "kvpress"))
assert not heavy, heavy
"""

#: `certkv calibrate ARGS` that SIGKILLs itself the moment its second request's write returns (a
#: trace hook on the store write, as tests/e2e/test_ray.py stops its driver).
KILLED = """
import os, signal, sys
import certkv.calibration.driver as driver
from certkv.cli.app import main

code, writes = driver.record_request.__code__, 0

def on_return(frame, event, arg):
    global writes
    if event == "return":
        writes += 1
        if writes == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    return on_return

sys.settrace(lambda frame, event, arg: on_return if frame.f_code is code else None)
sys.argv = ["certkv", "calibrate", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("endpoints")
    write_jsonl(generate_requests("demo", n=N_REQUESTS, seed=4243, context_length=(200, 320)), root / "requests.jsonl")
    return root


@pytest.fixture(scope="module")
def upstreams(folder):
    full, snap = Upstream(folder / "full", _full_point()), Upstream(folder / "snap", _operating_point(0.5, 0.5))
    try:
        yield full.wait(), snap.wait()
    finally:
        full.stop()
        snap.stop()


def _records(folder: Path, name: str) -> dict:
    with CalibrationStore.read(folder / "runs" / name) as store:
        return {(r["request_id"], r["policy"]): r for r in store.records()}


def _calibrate(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def local_records(folder):
    """The same contract in-process: snapkv at 0.5 on the embedded model, its records."""
    path = folder / "local.yaml"
    path.write_text(yaml.safe_dump({"name": "local", **TERMS, "protocol": {"max_new_tokens": 8},
                                    "policies": [{"press": "snapkv", "kv_retained": [0.5]}]}))
    assert run_main("calibrate", str(path), "--quiet") == 0
    return path, _records(folder, "local")


def _same_answers(got: dict, expected: dict) -> None:
    """Per request and policy: the same answer, utilities and loss (the records' columns a certificate reads)."""
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        have = got[key]
        assert (have["answer"], have["utility"], have["utility_full"], have["loss"]) == (
            want["answer"], want["utility"], want["utility_full"], want["loss"]), key


def test_endpoints_give_the_in_process_records_and_certificate_without_torch(folder, upstreams, local_records):
    from certkv.contract.loading import load_contract
    from certkv.workflow import certify

    full, snap = upstreams
    path = _endpoint_contract(folder, "ep", full.url, snap.url)
    res = _calibrate(WITHOUT_TORCH, str(path), "--quiet", "--concurrency", "2", "--probe-every", "2")
    assert res.returncode == 0, res.stderr
    local_path, expected = local_records
    got = _records(folder, "ep")
    _same_answers(got, expected)
    assert any(r["loss"] > 0 for r in got.values())  # the point breaks a request: the comparison tests something
    for (_, policy), record in got.items():
        want = expected[(record["request_id"], policy)]
        assert (record["path"], record["kv_retained"]) == (("endpoint", 0.5) if policy != "full" else (None, 1.0))
        # a server returns no log p for the end-of-answer token: the lowest of the others is never lower
        assert record["confidence_min"] >= want["confidence_min"] - 1e-6
    ours, theirs = (certify(load_contract(p)).operating_point for p in (path, local_path))
    assert (ours.policy, ours.fallback, ours.n, ours.violations, ours.p_value, ours.risk_upper_bound) == (
        theirs.policy, theirs.fallback, theirs.n, theirs.violations, theirs.p_value, theirs.risk_upper_bound)
    assert [(c.policy, c.violations, c.risk_upper_bound, c.certified) for c in ours.candidates] == [
        (c.policy, c.violations, c.risk_upper_bound, c.certified) for c in theirs.candidates]
    with CalibrationStore.read(folder / "runs" / "ep") as store:
        meta = store.meta()
    assert '"policy": "snapkv@0.50"' in meta["endpoints"] and "single_needle-s4243-000000" in meta["endpoint_probe"]


def test_a_killed_run_resumes_with_nothing_lost_or_duplicated(folder, upstreams, local_records):
    full, snap = upstreams
    path = _endpoint_contract(folder, "killed", full.url, snap.url)
    killed = _calibrate(KILLED, str(path), "--quiet", "--concurrency", "1", "--probe-every", "1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len({rid for rid, _ in _records(folder, "killed")}) == 2
    res = _calibrate(WITHOUT_TORCH, str(path), "--quiet")
    assert res.returncode == 0, res.stderr
    assert "4 calibrated, 2 already stored" in res.stdout
    _same_answers(_records(folder, "killed"), local_records[1])


def test_a_late_full_upstream_is_waited_for_and_a_moved_one_stops_the_run(folder, upstreams):
    """The full endpoint down at the start: the run retries until it is up (told on stderr), within
    its retry budget. Restarted as another point (snapkv@0.10) at the same URL, its answer to the
    probe moves, and the resumed run stops with one line, writing nothing more."""
    _, snap = upstreams
    port = _free_port()
    path = _endpoint_contract(folder, "late", f"http://127.0.0.1:{port}/v1", snap.url)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    run = subprocess.Popen([sys.executable, "-m", "certkv.cli.app", "calibrate", str(path), "--quiet", "--limit", "2",
                            "--retries", "20"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    late = moved = None
    try:
        first = run.stderr.readline()  # blocks until the first try failed: the server is started after it
        assert "unreachable" in first and "retrying in" in first, first
        late = Upstream(folder / "late", _full_point(), port).wait()
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        assert "2 calibrated" in out
        late.stop()
        moved = Upstream(folder / "moved", _operating_point(0.1, 0.5), port).wait()
        res = subprocess.run([sys.executable, "-m", "certkv.cli.app", "calibrate", str(path), "--quiet"], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
        for server in (late, moved):
            if server is not None:
                server.stop()
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"certkv: error: the reference moved: full endpoint http://127.0.0.1:{port}/v1 "
                                 "answers probe request 'single_needle-s4243-000000' with '5555', not '6386'")
    assert len({rid for rid, _ in _records(folder, "late")}) == 2


def test_a_model_the_endpoint_does_not_serve_is_one_line(folder, upstreams):
    full, snap = upstreams
    path = _endpoint_contract(folder, "wrong", full.url, snap.url)
    path.write_text(path.read_text().replace("name: embedded", "name: smollm2", 1))
    res = _calibrate(WITHOUT_TORCH.replace("assert not exc.code, exc.code", "assert exc.code == 2, exc.code"), str(path))
    assert res.returncode == 0, res.stderr
    assert f"certkv: error: endpoint {full.url} serves ['embedded'], not 'smollm2'; fix the contract's name" in res.stderr
