"""`certkv gateway` end to end: a real gateway process in front of two real `certkv serve` upstreams.

The upstreams are the embedded model's full cache and its snapkv@0.50 point, as in
tests/e2e/test_endpoint_calibration.py (the processes of benchmarks/endpoint_servers.py, which
benchmarks/gateway.py starts too); the endpoint contract is calibrated through them and
certified (`certkv certify`), and the point's confidence gate is placed by hand at 0.5 (a pilot
needs 100 certification requests, more than a test can afford; the store's confidence separates
this model's right answers, ~0.99, from its wrong ones, ~0.2). Through the official `openai`
client the gateway gives the in-process CertifiedRuntime's answers and escalations for the same
point, streamed or not; the candidate killed under load and restarted gives no 5xx and shows in
/health; the full endpoint down is a one-line 503 for a request that needs it.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys

import httpx
import pytest
from conftest import REPO, run_main
from endpoint_servers import Gateway, Upstream
from endpoint_servers import endpoint_contract as _endpoint_contract
from endpoint_servers import full_point as _full_point
from test_serve import _operating_point

from certkv.requests.request_set import generate_requests, write_jsonl

N_REQUESTS = 8

NO_TORCH = ("import sys, certkv.cli.gateway, certkv.gateway.app, certkv.gateway.setup; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'kvpress')); "
            "assert not heavy, heavy")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """(folder, requests, full, snap, gateway, gated point): the contract calibrated and certified."""
    from certkv.core.operating_point import load_operating_point
    from certkv.core.spec import GateSettings

    folder = tmp_path_factory.mktemp("gateway")
    requests = generate_requests("demo", n=N_REQUESTS, seed=4243, context_length=(200, 320))
    write_jsonl(requests, folder / "requests.jsonl")
    full, snap = Upstream(folder / "full", _full_point()), Upstream(folder / "snap", _operating_point(0.5, 0.5))
    gateway = None
    try:
        full.wait(), snap.wait()
        contract = _endpoint_contract(folder, "gw", full.url, snap.url)
        assert run_main("calibrate", str(contract), "--quiet") == 0
        assert run_main("certify", str(contract)) == 0
        op = load_operating_point(folder / "runs" / "gw" / "operating_point.json")
        assert (op.policy, op.press, op.fallback) == ("snapkv@0.50", "endpoint", False)
        gated = op.model_copy(update={"policy": "snapkv@0.50+confq0.5", "gate": GateSettings(confidence=0.5, quantile=0.5)})
        point = gated.write_json(folder / "runs" / "gw" / "gated.json")
        gateway = Gateway(folder, point, "--shadow-rate", "1", "--candidate-timeout", "30", "--timeout", "30").wait()
        yield folder, requests, full, snap, gateway, gated
    finally:
        for server in (gateway, full, snap):
            if server is not None:
                server.stop()


def _in_process(gated, requests):
    """(answer, reason) per request from the in-process CertifiedRuntime of the same point (snapkv at 0.5)."""
    from certkv.model.loading import load_model
    from certkv.runtime.certified_runtime import CertifiedRuntime

    local = gated.model_copy(update={"press": "snapkv", "contract_sha256": None})
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
    assert health["status"] == "ok" and health["monitor"]["all"]["requests"] == 2 * N_REQUESTS
    assert subprocess.run([sys.executable, "-c", NO_TORCH], cwd=REPO, capture_output=True).returncode == 0


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
    """Requests in flight while the candidate is SIGKILLed and restarted on its port: every one is
    answered (200), those while it was down by the full endpoint (reason candidate_down)."""
    folder, requests, _, snap, gateway, _ = deployed
    body = [{"context": r.context, "question": r.question, "max_tokens": 4} for r in requests]

    def one(i: int) -> tuple[int, str | None]:
        resp = httpx.post(gateway.url + "/v1/chat/completions", json=body[i % len(body)], timeout=120)
        return resp.status_code, resp.json().get("certkv", {}).get("decision", {}).get("reason")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = list(pool.map(one, range(16)))
        snap.proc.send_signal(signal.SIGKILL)
        snap.proc.wait()
        during = list(pool.map(one, range(16)))
        health = gateway.health()
        restarted = Upstream(folder / "snap2", _operating_point(0.5, 0.5), snap.port).wait()
        snap.proc = restarted.proc
        after = list(pool.map(one, range(16)))
    assert all(status == 200 for status, _ in first + during + after), first + during + after
    assert {reason for _, reason in during} == {"candidate_down"}
    assert health["status"] == "candidate_down" and "unreachable" in health["candidates"]["snapkv@0.50"]["error"]
    assert None in {reason for _, reason in after} and gateway.health()["status"] == "ok"


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
