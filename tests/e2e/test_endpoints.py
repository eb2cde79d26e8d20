"""Real `certkv serve` upstreams, calibrated through as endpoints and deployed behind `certkv gateway`.

Two servers are the upstreams for the module (started by benchmarks/endpoint_servers.py, which the
gateway benchmark shares): the embedded model's full cache (a fallback point) and its snapkv@0.50
point. One module, so the two start once for both halves.

Endpoint calibration. Calibrating the endpoint contract through them gives the records and the
certificate of the same contract calibrated in-process (the same answers, utilities and losses per
request), without importing torch; a run killed between writes resumes to the same records; a
full upstream started late is waited for; one restarted as another point is caught by the probe.

The gateway. The endpoint contract is calibrated through the upstreams and certified (`certkv
certify`), and the point's confidence gate is placed by hand at 0.5 (a pilot needs 100
certification requests, more than a test can afford; the store's confidence separates this model's
right answers, ~0.99, from its wrong ones, ~0.2). Through the official `openai` client the gateway
gives the in-process CertifiedRuntime's answers and escalations for the same point, streamed or
not; the candidate killed with requests in flight (400 at concurrency 32) and restarted gives no
5xx and shows in /health; the full endpoint down is a one-line 503 for a request that needs it
(last: it stops the full upstream).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import REPO, run_main
from endpoint_servers import TERMS, Gateway, Upstream, free_port
from endpoint_servers import endpoint_contract as _endpoint_contract
from endpoint_servers import full_point as _full_point
from test_serve import _operating_point

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


#: The load of the kill test: requests per phase (before, across the kill, beside the impostor,
#: after the restart: 400 in all) and in flight at once; the gateway's shadows in flight at once.
KILL_PHASE, KILL_CONCURRENCY, SHADOW_CONCURRENCY = 100, 32, 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("endpoints")
    write_jsonl(generate_requests("demo", n=N_REQUESTS, seed=4243, context_length=(200, 320)), root / "requests.jsonl")
    return root


@pytest.fixture(scope="module")
def upstreams(folder):
    # the full endpoint's queue holds the kill test's clients and the gateway's shadows, no more
    # (a gateway that let shadows crowd it would get its 503 for an escalated request)
    full = Upstream(folder / "full", _full_point(), None, "--max-queue", str(KILL_CONCURRENCY + SHADOW_CONCURRENCY))
    snap = Upstream(folder / "snap", _operating_point(0.5, 0.5))
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
    port = free_port()
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


# -- the gateway in front of the same upstreams ---------------------------------------------

#: The gateway's requests: the first eight draws of the same seed (a larger n extends a smaller set).
N_GATEWAY = 8

NO_TORCH = ("import sys, certkv.cli.gateway, certkv.gateway.app, certkv.gateway.setup; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'kvpress')); "
            "assert not heavy, heavy")


@pytest.fixture(scope="module")
def deployed(folder, upstreams):
    """(folder, requests, full, snap, gateway, gated point): the contract calibrated and certified."""
    from certkv.core.operating_point import load_operating_point
    from certkv.core.spec import GateSettings

    folder = folder / "gateway"
    folder.mkdir()
    requests = generate_requests("demo", n=N_GATEWAY, seed=4243, context_length=(200, 320))
    write_jsonl(requests, folder / "requests.jsonl")
    full, snap = upstreams
    contract = _endpoint_contract(folder, "gw", full.url, snap.url)
    assert run_main("calibrate", str(contract), "--quiet") == 0
    assert run_main("certify", str(contract)) == 0
    op = load_operating_point(folder / "runs" / "gw" / "operating_point.json")
    assert (op.policy, op.press, op.fallback) == ("snapkv@0.50", "endpoint", False)
    gated = op.model_copy(update={"policy": "snapkv@0.50+confq0.5", "gate": GateSettings(confidence=0.5, quantile=0.5)})
    point = gated.write_json(folder / "runs" / "gw" / "gated.json")
    gateway = Gateway(folder, point, "--shadow-rate", "1", "--shadow-concurrency", str(SHADOW_CONCURRENCY),
                      "--candidate-timeout", "30", "--timeout", "30")
    try:
        yield folder, requests, full, snap, gateway.wait(), gated
    finally:
        gateway.stop()


def _in_process(gated, requests):
    """(answer, reason) per request from the in-process CertifiedRuntime of the same point (snapkv at 0.5)."""
    from certkv.model.loading import load_model
    from certkv.runtime.certified_runtime import CertifiedRuntime

    # the point's context range counts prompts as the upstream does (context and question); the
    # runtime counts the context alone, so the range is left to the gateway (tested below)
    coverage = gated.coverage.model_copy(update={"context_tokens": None})
    local = gated.model_copy(update={"press": "snapkv", "contract_sha256": None, "coverage": coverage})
    runtime = CertifiedRuntime(*load_model("embedded", device="cpu"), local)
    out = {}
    for r in requests:
        got = runtime.generate(r.context, r.question, r.task)
        out[r.id] = (got.answer, got.decision.reason)
    return out


def test_the_gateway_answers_and_escalates_as_the_in_process_runtime(deployed):
    import openai

    folder, requests, _, _, gateway, gated = deployed
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    got, streamed = {}, {}
    for r in requests:
        answer = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": r.context}],
                                                extra_body={"question": r.question, "stratum": r.task}, max_tokens=8)
        got[r.id] = (answer.choices[0].message.content, answer.model_extra["certkv"]["decision"]["reason"])
        chunks = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": r.context}],
                                                extra_body={"question": r.question}, stream=True)
        streamed[r.id] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == _in_process(gated, requests)
    assert {reason for _, reason in got.values()} == {None, "confidence"}  # both kept and escalated answers
    assert streamed == {rid: text for rid, (text, _) in got.items()}
    health = gateway.health()
    assert health["status"] == "ok" and health["monitor"]["all"]["requests"] == 2 * N_GATEWAY
    assert subprocess.run([sys.executable, "-c", NO_TORCH], cwd=REPO, capture_output=True).returncode == 0


def test_a_prompt_longer_than_any_calibrated_one_is_answered_by_the_full_endpoint(deployed):
    """An endpoint point's context range is the calibrated prompts' lengths as the full endpoint
    counted them (its usage.prompt_tokens); the gateway reads the candidate's count after it answers
    and escalates a prompt outside the range as uncovered: the full endpoint's answer, not the
    candidate's."""
    _, requests, full, _, gateway, gated = deployed
    low, high = gated.coverage.context_tokens
    assert 0 < low <= high
    r = requests[0]
    body = {"context": r.context * 3, "question": r.question, "max_tokens": 8}
    got = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120).json()
    decision = got["certkv"]["decision"]
    assert (decision["reason"], decision["mode"]) == ("uncovered", "full"), decision
    assert decision["detail"].startswith(f"context of {got['usage']['prompt_tokens']} tokens is outside the calibrated "
                                         f"{low}-{high} tokens"), decision["detail"]
    direct = httpx.post(full.url + "/chat/completions", json=body, timeout=120).json()
    assert got["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]


def test_a_server_that_is_not_the_calibrated_one_stops_the_gateway_in_one_line(deployed):
    """The store binds each server's /v1/models answer: a gateway whose candidate now answers
    otherwise (here the bound answer is edited to another owner, as if another deployment held the
    port) refuses to start, in one line naming the server, before it serves anything."""
    import shutil
    import sqlite3

    folder, _, _, snap, _, _ = deployed
    moved = folder / "runs" / "moved"
    shutil.copytree(folder / "runs" / "gw", moved, ignore=shutil.ignore_patterns("gateway-shadow*"))
    with sqlite3.connect(moved / "records.sqlite") as db:
        (value,) = db.execute("SELECT value FROM meta WHERE key = 'endpoints'").fetchone()
        identities = json.loads(value)
        identities["snapkv@0.50"]["models"][0]["owned_by"] = "another-deployment"
        db.execute("UPDATE meta SET value = ? WHERE key = 'endpoints'", (json.dumps(identities, sort_keys=True),))
    res = subprocess.run([sys.executable, "-m", "certkv.cli.app", "gateway", str(moved / "gated.json"), "--port", "1"],
                         capture_output=True, text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stderr[-2000:])
    assert "is not the server the point was certified against" in lines[0] and snap.url in lines[0], lines[0]


def test_a_killed_candidate_gives_no_5xx_and_shows_in_health(deployed):
    """400 requests at concurrency 32: the candidate is SIGKILLed with a phase of them in flight,
    another deployment (snapkv@0.10) takes its port, and the calibrated one comes back: every one
    is answered (200). Those the dead candidate did not answer, and all of them while the other
    deployment holds its port (its /v1/models answer is not the bound one), are answered by the
    full endpoint (reason candidate_down); /health says why; once the calibrated server is back,
    its answers are kept again."""
    folder, requests, _, snap, gateway, _ = deployed
    body = [{"context": r.context, "question": r.question, "max_tokens": 4} for r in requests]

    def one(i: int) -> tuple[int, str | None]:
        resp = httpx.post(gateway.url + "/v1/chat/completions", json=body[i % len(body)], timeout=120)
        if resp.status_code != 200:
            return resp.status_code, resp.text[:300]
        return resp.status_code, resp.json()["certkv"]["decision"]["reason"]

    with concurrent.futures.ThreadPoolExecutor(KILL_CONCURRENCY) as pool:
        first = list(pool.map(one, range(KILL_PHASE)))
        in_flight = [pool.submit(one, i) for i in range(KILL_PHASE)]
        snap.proc.send_signal(signal.SIGKILL)
        snap.proc.wait()
        during = [future.result() for future in in_flight]
        health = gateway.health()
        impostor = Upstream(folder / "impostor", _operating_point(0.1, 0.5), snap.port).wait()
        while_impostor = list(pool.map(one, range(KILL_PHASE)))
        impostor_health = gateway.health()
        impostor.stop()
        restarted = Upstream(folder / "snap2", _operating_point(0.5, 0.5), snap.port).wait()
        snap.proc = restarted.proc
        after = list(pool.map(one, range(KILL_PHASE)))
    phases = {"first": first, "during": during, "while_impostor": while_impostor, "after": after}
    failed = [(phase, i, got) for phase, rows in phases.items() for i, got in enumerate(rows) if got[0] != 200]
    assert not failed, failed[:5]
    assert "candidate_down" in {reason for _, reason in during}  # some answered before the kill landed
    assert {reason for _, reason in while_impostor} == {"candidate_down"}
    assert health["status"] == "candidate_down" and "unreachable" in health["candidates"]["snapkv@0.50"]["error"]
    error = impostor_health["candidates"]["snapkv@0.50"]["error"]
    assert "is not the one calibration bound" in error and "snapkv@0.10" in error, error
    final = gateway.health()
    assert None in {reason for _, reason in after} and final["status"] == "ok"
    assert final["shadows"]["scored"] > 0 and final["shadows"]["abandoned"] == 0, final["shadows"]  # none crowded out


def test_the_full_endpoint_down_is_a_one_line_503(deployed):
    """Last in the module: it stops the full upstream. A request only the full endpoint may answer
    (a stratum the point does not know) gets a 503 naming the URL and why it needed it."""
    _, requests, full, _, gateway, _ = deployed
    Upstream.stop(full)
    r = requests[0]
    resp = httpx.post(gateway.url + "/v1/chat/completions", json={"context": r.context, "question": r.question,
                                                                  "stratum": "unknown"}, timeout=60)
    error = resp.json()["error"]
    assert resp.status_code == 503 and error["code"] == "full_endpoint_unavailable" and "\n" not in error["message"]
    assert error["message"].startswith(f"the full endpoint is unavailable: {full.url}: unreachable")
    assert "this request needs it: uncovered (task 'unknown' was not calibrated" in error["message"]
    ok = httpx.post(gateway.url + "/v1/chat/completions", json={"context": r.context, "question": r.question}, timeout=60)
    assert ok.status_code == 200  # a kept candidate answer needs no full endpoint (its shadow is abandoned)
    assert gateway.health()["status"] == "full_down"
    assert json.loads(httpx.get(gateway.url + "/v1/models", timeout=10).text)["data"][0]["id"] == "embedded"
