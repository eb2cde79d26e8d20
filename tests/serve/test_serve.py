"""`certkv serve` end to end: real server processes on loopback ports, talked to over HTTP.

Five servers start together (one module fixture): A deploys snapkv@0.5 (API key, queue of 1,
small body limit, every evicted answer shadowed, a prefix cache of compressed contexts), B
snapkv@0.1 with a tiny ε (its answers drift from the full cache's: the monitor trips), C held at a
test hook (its scheduler takes no job until the test releases it: a queue of one that fills, 503,
and a request past its timeout, 504), D a stratified point, Q a query-aware point with its access
log on.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import sys
import time

import httpx
import pytest
from conftest import REPO, run_main
from endpoint_servers import Process, free_port, snapkv_point

from certkv.requests.request_set import generate_requests

#: Starts `certkv serve` with a test's hooks on its service (a held scheduler, a stepped one).
LAUNCHER = REPO / "tests" / "serve" / "hooked_serve.py"

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _operating_point(kv, risk, confidence=0.9):
    """SnapKV keeping `kv`, ungated, 8 new tokens (:func:`endpoint_servers.snapkv_point`)."""
    return snapkv_point(kv, risk, confidence)


def _stratified(kv, risk):
    from certkv.core.operating_point import StrataResult

    entries = {task: _operating_point(kv, risk) for task in ("multi_key", "single_needle")}
    base = _operating_point(kv, risk)
    return base.model_copy(update={"policy": "stratified", "base_policy": "stratified",
                                   "strata": StrataResult(by="task", simultaneous=False, confidence=0.9,
                                                          entries=entries)})


def launcher(env: dict, hook: str, fd: int) -> list[str]:
    """The command that starts `certkv serve` with `hook` on pipe `fd` (:data:`LAUNCHER`); `env`
    is made to find certkv from the launcher's folder."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return [sys.executable, str(LAUNCHER), hook, str(fd)]


class _Server(Process):
    """`certkv serve` in its own process (:class:`endpoint_servers.Process`, the API key in its
    environment); `held`: its scheduler takes no job until :meth:`release` (started by
    :data:`LAUNCHER` with `hook`, ``--hold-fd`` by default: a pipe the server reads to its end)."""

    def __init__(self, folder, op, *args, held=False, hook="--hold-fd"):
        folder.mkdir(parents=True, exist_ok=True)
        self.op_path = op.write_json(folder / "operating_point.json")
        self.store = folder / "shadow"
        env = {"CERTKV_TEST_KEY": KEY}
        hold, self._hold = (os.pipe() if held else (None, None))
        command = None if hold is None else launcher(env, hook, hold)
        super().__init__(folder, "server.log", ["serve", str(self.op_path), "--shadow-store", str(self.store), *args],
                         free_port(), command=command, env=env, pass_fds=() if hold is None else (hold,))
        self.url = self.base
        if hold is not None:
            os.close(hold)  # the server's copy alone is left: it reads until ours closes

    def release(self):
        """Let a held server's scheduler start (closing our end of its pipe); else nothing."""
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None

    def stop(self):
        self.release()
        super().stop()
        return self.proc.returncode


@pytest.fixture(scope="module")
def requests():
    return generate_requests("demo", n=8, seed=4243, context_length=(200, 320))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    a = _Server(root / "a", _operating_point(0.5, 0.5), "--shadow-rate", "1.0", "--api-key-env", "CERTKV_TEST_KEY",
                "--max-queue", "1", "--max-body-bytes", "20000", "--timeout", "60", "--prefix-cache-mib", "2")
    b = _Server(root / "b", _operating_point(0.1, 0.01, 0.9), "--shadow-rate", "1.0", "--seed", "3")
    c = _Server(root / "c", _operating_point(0.5, 0.5), "--max-queue", "1", "--timeout", "1", held=True)
    d = _Server(root / "d", _stratified(0.5, 0.5), "--shadow-rate", "1.0")
    q = _Server(root / "q", _operating_point(0.2, 0.5).model_copy(update={"query_aware": True}), "--access-log")
    try:
        yield {"a": a.wait(), "b": b.wait(), "c": c.wait(), "d": d.wait(), "q": q.wait()}
    finally:
        for s in (a, b, c, d, q):
            s.stop()


def _body(r):
    return {"context": r.context, "question": r.question}


def test_completion_equals_the_runtime_in_process(servers, requests, embedded):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    a = servers["a"]
    runtime = CertifiedRuntime(*embedded, a.op_path)
    for r in requests[:2]:
        expect = runtime.generate(r.context, r.question)
        out = httpx.post(a.url + "/v1/completions", json=_body(r), headers=AUTH, timeout=60).json()
        assert out["object"] == "text_completion" and out["choices"][0]["text"] == expect.answer
        ck = out["certkv"]
        assert ck["decision"]["mode"] == expect.decision.mode == "evicted" and ck["stream"] == "all"
        assert ck["shadowed"] is True and ck["monitor"]["requests"] >= 1
        # a plain prompt splits at its single 'Question:' into the same request
        plain = httpx.post(a.url + "/v1/completions", json={"prompt": r.context + r.question}, headers=AUTH,
                           timeout=60).json()
        assert plain["choices"][0]["text"] == expect.answer


def _metric(text: str, name: str) -> float:
    import re

    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_repeated_contexts_are_answered_from_the_prefix_cache_as_in_process(servers, embedded):
    """Three questions about each of two multi_key haystacks, through the official client: the first
    prefills its context (a miss), the next two are decoded from the kept compressed context (hits in
    /metrics), and every answer is the uncached in-process runtime's."""
    import random

    import openai

    from certkv.requests.builtin_tasks import multi_key
    from certkv.runtime.certified_runtime import CertifiedRuntime

    a = servers["a"]
    runtime = CertifiedRuntime(*embedded, a.op_path)
    samples = [multi_key(random.Random(seed), 256) for seed in (1, 2)]
    traffic = [(s.context, q) for s in samples for q, _ in s.qa[:3]]
    client = openai.OpenAI(base_url=a.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    before = httpx.get(a.url + "/metrics", headers=AUTH).text
    for context, question in traffic:
        out = client.completions.create(model="embedded", prompt="", extra_body={"context": context,
                                                                                 "question": question})
        assert out.choices[0].text == runtime.generate(context, question).answer, question
    after = httpx.get(a.url + "/metrics", headers=AUTH).text
    counted = {name: _metric(after, name) - _metric(before, name)
               for name in ("certkv_prefix_cache_hits_total", "certkv_prefix_cache_misses_total")}
    assert counted == {"certkv_prefix_cache_hits_total": 4, "certkv_prefix_cache_misses_total": 2}
    assert _metric(after, "certkv_prefix_cache_budget_bytes") == 2 * 2**20
    assert 0 < _metric(after, "certkv_prefix_cache_bytes") <= 2 * 2**20
    assert "prefix cache 2 MiB" in a.output()


def test_an_answer_prefix_opens_the_answer_as_in_process(servers, requests, embedded):
    """``answer_prefix`` (an extension field, as a calibration request's) goes after the question
    on the server as in the runtime; it changes what the model decodes, so the check can fail."""
    from certkv.runtime.certified_runtime import CertifiedRuntime

    a = servers["a"]
    runtime = CertifiedRuntime(*embedded, a.op_path)
    differ = 0
    for r in requests[:3]:
        prefix = r.answers[0].split()[0]
        expect = runtime.generate(r.context, r.question, answer_prefix=prefix)
        out = httpx.post(a.url + "/v1/completions", json={**_body(r), "answer_prefix": prefix}, headers=AUTH,
                         timeout=60).json()
        assert out["choices"][0]["text"] == expect.answer, r.id
        differ += expect.answer != runtime.generate(r.context, r.question).answer
    assert differ > 0, "the prefix changed no answer: the check cannot tell it was applied"


def test_a_query_aware_point_is_served_in_its_protocol(servers, requests, embedded):
    """The server follows the operating point's protocol: its answers are the in-process runtime's
    under query_aware, and /health says which protocol it serves."""
    from certkv.runtime.certified_runtime import CertifiedRuntime

    q = servers["q"]
    runtime = CertifiedRuntime(*embedded, q.op_path)
    agnostic = CertifiedRuntime(*embedded, _operating_point(0.2, 0.5))
    assert runtime.query_aware is True
    assert httpx.get(q.url + "/health", timeout=10).json()["operating_point"]["query_aware"] is True
    differ = 0
    for r in requests[:4]:
        expect = runtime.generate(r.context, r.question)
        out = httpx.post(q.url + "/v1/completions", json=_body(r), timeout=60).json()
        assert out["choices"][0]["text"] == expect.answer and out["certkv"]["decision"]["mode"] == "evicted"
        differ += expect.answer != agnostic.generate(r.context, r.question).answer
    assert differ > 0, "the two protocols answered alike: the check cannot tell them apart"


def test_access_log_only_when_asked(servers, requests):
    """One log line per request with --access-log (server Q), none by default (server D)."""
    for name in ("q", "d"):
        out = httpx.post(servers[name].url + "/v1/completions", json=_body(requests[0]), timeout=60)
        assert out.status_code == 200
    line = '"POST /v1/completions HTTP/1.1" 200'
    _wait_for(lambda: line in servers["q"].output(), "server Q to log its request")
    assert line not in servers["d"].output()


def test_chat_and_streamed_completions(servers, requests):
    from certkv.serve.responses import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, HealthResponse

    a, r = servers["a"], requests[2]
    ref = httpx.post(a.url + "/v1/completions", json=_body(r), headers=AUTH, timeout=60).json()
    text = ref["choices"][0]["text"]
    msgs = [{"role": "system", "content": r.context}, {"role": "user", "content": r.question}]
    chat = httpx.post(a.url + "/v1/chat/completions", json={"model": "embedded", "messages": msgs}, headers=AUTH,
                      timeout=60).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == text
    assert chat["certkv"]["decision"]["policy"] == "snapkv@0.50"
    for route, chat_mode in (("/v1/completions", False), ("/v1/chat/completions", True)):
        body = {"messages": msgs, "stream": True} if chat_mode else {**_body(r), "stream": True}
        with httpx.stream("POST", a.url + route, json=body, headers=AUTH, timeout=60) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in resp.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        if chat_mode:
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            got = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        else:
            got = "".join(c["choices"][0]["text"] for c in chunks)
        assert got == text and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert chunks[-1]["certkv"]["decision"]["mode"] == "evicted"
        # every chunk is the typed shape the server documents; only the last carries usage and certkv
        shape = ChatCompletionChunk if chat_mode else CompletionResponse
        assert all(shape.model_validate(c) for c in chunks)
        assert ["certkv" in c for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert ChatCompletionResponse.model_validate(chat).certkv.decision["mode"] == "evicted"
    assert CompletionResponse.model_validate(ref).usage.completion_tokens >= 1
    assert HealthResponse.model_validate(httpx.get(a.url + "/health", timeout=10).json()).status == "ok"


def test_error_classes(servers, requests):
    a, r = servers["a"], requests[0]
    url = a.url + "/v1/completions"

    def error(resp, status):
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
        return err

    error(httpx.post(url, json=_body(r)), 401)
    error(httpx.post(url, json=_body(r), headers={"Authorization": "Bearer wrong"}), 401)
    error(httpx.post(url, json={"context": "x" * 30000, "question": "q"}, headers=AUTH), 413)
    chunked = (b"x" * 5000 for _ in range(6))  # no content-length: counted as it arrives
    error(httpx.post(url, content=chunked, headers={**AUTH, "content-type": "application/json"}), 413)
    err = error(httpx.post(url, json={**_body(r), "max_tokens": "many"}, headers=AUTH), 422)
    assert err["message"].startswith("max_tokens:") and err["param"] == "max_tokens"
    err = error(httpx.post(url, json={"prompt": "no marker here"}, headers=AUTH), 422)
    assert "exactly once" in err["message"] and err["param"] == "prompt"
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    err = error(httpx.post(a.url + "/v1/chat/completions", json={"messages": msgs}, headers=AUTH), 422)
    assert err["param"] == "messages.1.role"
    error(httpx.post(url, json={**_body(r), "model": "gpt-9"}, headers=AUTH), 404)
    error(httpx.post(url, json={**_body(r), "max_tokens": 99}, headers=AUTH), 422)
    error(httpx.post(url, content=b"{not json", headers={**AUTH, "content-type": "application/json"}), 422)
    # C's scheduler is held (it takes no job until released) and its queue holds one request: the
    # first request waits in the queue (an event /health reports), a second is refused with
    # Retry-After (503), and the first, never run, ends at its --timeout of 1 s (504).
    c = servers["c"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, c.url + "/v1/completions", json=_body(r), timeout=60)
        _wait_for(lambda: httpx.get(c.url + "/health").json()["queue"]["depth"] == 1, "the first request to queue")
        busy = httpx.post(c.url + "/v1/completions", json=_body(r), timeout=60)
        assert error(busy, 503)["code"] == "queue_full" and int(busy.headers["Retry-After"]) >= 1
        assert error(held.result(), 504)["code"] == "timeout"
    c.release()
    _wait_for(lambda: httpx.get(c.url + "/health").json()["queue"]["depth"] == 0, "the released scheduler to run")
    assert httpx.get(c.url + "/health").json()["status"] == "ok"  # still up


def test_models_health_operating_point_and_metrics(servers):
    a = servers["a"]
    assert httpx.get(a.url + "/v1/models").status_code == 401
    models = httpx.get(a.url + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "embedded"
    assert httpx.get(a.url + "/v1/operating-point", headers=AUTH).json()["policy"] == "snapkv@0.50"
    health = httpx.get(a.url + "/health").json()  # no key needed
    assert health["status"] == "ok" and health["queue"]["max"] == 1 and "all" in health["monitor"]
    text = httpx.get(a.url + "/metrics", headers=AUTH).text
    for name in ("certkv_requests_total", "certkv_errors_total", "certkv_kv_retained_bucket",
                 "certkv_request_latency_seconds_bucket", "certkv_shadow_samples_total", "certkv_monitor_e_value",
                 "certkv_monitor_risk_upper_bound", "certkv_monitor_tripped", "certkv_queue_depth"):
        assert name in text, name
    assert 'certkv_requests_total{reason="evicted",route="/v1/completions"}' in text
    assert 'certkv_errors_total{route="/v1/completions",status="401"}' in text


def test_shadows_land_in_the_store(servers):
    import sqlite3

    a = servers["a"]
    _wait_for(lambda: not httpx.get(a.url + "/health").json()["monitor"]["all"]["pending"], "every shadow to be scored")
    health = httpx.get(a.url + "/health").json()
    assert health["shadows"]["scored"] >= 3 and health["monitor"]["all"]["pending"] == 0
    with sqlite3.connect(a.store / "records.sqlite") as db:  # WAL: the live server's records are readable
        stored = db.execute("SELECT COUNT(*) FROM records").fetchone()[0]
    assert stored >= health["shadows"]["scored"]


def test_a_stratified_point_monitors_each_stratum(servers, requests):
    d = servers["d"]
    for r in requests[:4]:
        out = httpx.post(d.url + "/v1/completions", json={**_body(r), "stratum": r.task, "answers": r.answers},
                         timeout=60).json()
        assert out["certkv"]["stream"] == r.task and out["certkv"]["decision"]["stratum"] == r.task
    out = httpx.post(d.url + "/v1/completions", json=_body(requests[0]), timeout=60).json()
    assert out["certkv"]["stream"] is None and out["certkv"]["decision"]["mode"] == "full"  # no stratum: full
    monitor = httpx.get(d.url + "/health").json()["monitor"]
    assert set(monitor) == {"multi_key", "single_needle"}
    assert sum(m["requests"] for m in monitor.values()) == 4


def test_monitor_trips_on_a_drifting_stream_stays_tripped_and_sigterm_is_clean(servers, requests, embedded):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    full = CertifiedRuntime(*embedded, _operating_point(0.5, 0.5).model_copy(update={"fallback": True}))
    b = servers["b"]
    reasons = []
    for i in range(40):
        r = requests[i % len(requests)]
        out = httpx.post(b.url + "/v1/completions", json=_body(r), timeout=60).json()
        reasons.append(out["certkv"]["decision"]["reason"])
        if httpx.get(b.url + "/health").json()["status"] == "tripped":
            break
    health = httpx.get(b.url + "/health").json()
    assert health["status"] == "tripped" and health["tripped"] == ["all"], reasons
    for r in requests[:2]:  # tripped for good: the full cache answers, correctly
        out = httpx.post(b.url + "/v1/completions", json=_body(r), timeout=60).json()
        d = out["certkv"]["decision"]
        assert (d["mode"], d["reason"], d["kv_retained"]) == ("full", "monitor", 1.0)
        assert out["certkv"]["shadowed"] is False
        assert out["choices"][0]["text"] == full.generate(r.context, r.question).answer
    assert "certkv_monitor_tripped{stream=\"all\"} 1.0" in httpx.get(b.url + "/metrics").text
    assert 'reason="monitor"' in httpx.get(b.url + "/metrics").text
    assert b.stop() == 0
    log = b.output()
    assert "TRIPPED" in log and "stopped" in log
    assert (b.store / "records.sqlite").is_file()


def test_a_failing_request_is_500_for_it_alone(embedded, tmp_path, requests):
    import asyncio

    from certkv.core.monitor import RiskMonitor
    from certkv.runtime.certified_runtime import CertifiedRuntime
    from certkv.serve.app import create_app
    from certkv.serve.metrics import Metrics
    from certkv.serve.service import Service

    runtime = CertifiedRuntime(*embedded, _operating_point(0.5, 0.5))
    real = runtime.answer_steps

    def answer_steps(context, question, stratum=None, **kwargs):  # what the service's scheduler runs
        if question == "boom":
            raise RuntimeError("kaboom")
        return (yield from real(context, question, stratum, **kwargs))

    runtime.answer_steps = answer_steps
    service = Service(runtime, RiskMonitor(0.5, 0.1, 0.5), None, None, Metrics(), max_queue=4)
    app = create_app(service, model_id="embedded")
    service.start()

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            bad = await client.post("/v1/completions", json={"context": "some context", "question": "boom"})
            good = await client.post("/v1/completions", json=_body(requests[0]))
            return bad, good

    bad, good = asyncio.run(go())
    service.shutdown(1.0)
    assert bad.status_code == 500 and "kaboom" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["certkv"]["shadowed"] is False


def test_bad_cli_input_is_one_line_and_exit_2(tmp_path, capsys):
    op = _operating_point(0.5, 0.5).write_json(tmp_path / "op.json")
    for args, needle in (([str(tmp_path / "missing.json")], "not found"),
                         ([str(op), "--port", "70000"], "--port"),
                         ([str(op), "--shadow-rate", "1.5"], "--shadow-rate"),
                         ([str(op), "--shadow-rate", "-0.1"], "--shadow-rate"),
                         ([str(op), "--api-key-env", "CERTKV_UNSET_VAR_X"], "CERTKV_UNSET_VAR_X"),
                         ([str(op), "--model", "no-such/model-xyz", "--port", str(free_port())], "")):
        code = run_main("serve", *args)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and needle in lines[0], (args, err)


def test_the_official_openai_client(servers, requests):
    """What a user's code sends: the `openai` package against `certkv serve` (server A, with its key)."""
    import openai

    a, r = servers["a"], requests[4]
    client = openai.OpenAI(base_url=a.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    expect = httpx.post(a.url + "/v1/completions", json=_body(r), headers=AUTH, timeout=60).json()["choices"][0]["text"]
    # completions.create requires prompt: the context as the prompt, the question beside it ...
    out = client.completions.create(model="embedded", prompt=r.context,
                                    extra_body={"question": r.question, "stratum": r.task})
    assert out.choices[0].text == expect and out.model_extra["certkv"]["decision"]["mode"] == "evicted"
    assert out.usage.completion_tokens >= 1
    # ... or an empty prompt with context and question in extra_body: an empty prompt is an absent one
    out = client.completions.create(model="embedded", prompt="", extra_body=_body(r))
    assert out.choices[0].text == expect
    chat = client.chat.completions.create(model="embedded", messages=[{"role": "system", "content": r.context},
                                                                      {"role": "user", "content": r.question}])
    assert chat.choices[0].message.content == expect and chat.choices[0].message.role == "assistant"
    # chat with the context in extra_body: an empty system message is absent, the user message the question
    chat = client.chat.completions.create(model="embedded", messages=[{"role": "system", "content": ""},
                                                                      {"role": "user", "content": r.question}],
                                          extra_body={"context": r.context})
    assert chat.choices[0].message.content == expect
    stream = client.chat.completions.create(model="embedded", stream=True,
                                            messages=[{"role": "system", "content": r.context},
                                                      {"role": "user", "content": r.question}])
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expect
    stream = client.completions.create(model="embedded", prompt=r.context + r.question, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expect
    # errors arrive as the client's exception classes, with certkv's one-line message
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt=r.context + r.question)
    assert "is not served here" in info.value.message
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.completions.create(model="embedded", prompt="no marker here")
    assert "exactly once" in info.value.message
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="embedded", prompt="not empty", extra_body=_body(r))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=a.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == ["embedded"]


def test_a_413_reaches_a_client_that_sends_its_whole_body_first(servers):
    """Python's urllib writes the whole body before it reads: the server must read (and discard)
    it after answering, or the client sees a connection reset instead of the 413 (and the 401)."""
    import urllib.error
    import urllib.request

    a = servers["a"]
    body = b"x" * (30 << 20)
    for headers, status in (({**AUTH, "Content-Type": "application/json"}, 413), ({}, 401)):
        req = urllib.request.Request(a.url + "/v1/completions", data=body, headers=headers, method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=60)
        assert info.value.code == status
        error = json.loads(info.value.read())["error"]
        assert error["code"] == ("request_too_large" if status == 413 else "invalid_api_key")
    assert httpx.get(a.url + "/health").json()["status"] == "ok"


def _wait_for(condition, what: str, seconds: float = 60.0) -> None:
    """Poll `condition` until it holds (an event: a count in /health, a log line), or fail."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_sigterm_finishes_the_in_flight_request_and_exits_0(servers, requests):
    """A request whose body is half sent is in flight (the server counts it in /health); SIGTERM
    then (the server logs that it is shutting down) must not lose it: the rest of the body is sent,
    the answer comes back 200, and the server exits 0. Runs last: it stops server A."""
    a = servers["a"]
    body = json.dumps(_body(requests[3])).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{a.port}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", a.port), timeout=60) as sock:
        sock.sendall(head + body[:10])
        _wait_for(lambda: httpx.get(a.url + "/health").json()["in_flight"] == 1, "the request to be in flight")
        a.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: "Shutting down" in a.output(), "the server to begin its shutdown")
        sock.sendall(body[10:])
        response = b"".join(iter(lambda: sock.recv(1 << 16), b""))  # until the server closes
    status_line, _, rest = response.partition(b"\r\n")
    assert status_line.split()[1] == b"200", response[:500]
    answer = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert answer["object"] == "text_completion" and answer["certkv"]["decision"]["mode"] == "evicted"
    assert a.proc.wait(60) == 0
    log = a.output()
    assert "stopped (" in log and "Traceback" not in log


def test_empty_prompt_and_empty_messages_beside_context_are_absent():
    from certkv.serve.schemas import ChatCompletionRequest, CompletionRequest, SplitError

    assert CompletionRequest(prompt="", context="c", question="q").split() == ("c", "q")
    with pytest.raises(SplitError, match="not both"):
        CompletionRequest(prompt="p", context="c", question="q").split()
    chat = ChatCompletionRequest.model_validate
    assert chat({"context": "c", "messages": [{"role": "system", "content": ""},
                                              {"role": "user", "content": "q"}]}).split() == ("c", "q")
    assert chat({"context": "c", "question": "q", "messages": [{"role": "user", "content": ""}]}).split() == ("c", "q")
    for bad in ({"context": "c", "question": "q", "messages": [{"role": "user", "content": "x"}]},
                {"context": "c", "messages": [{"role": "user", "content": ""}]},
                {"context": "c", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
                {"context": "c", "messages": [{"role": "system", "content": "q"}]}):
        with pytest.raises(SplitError):
            chat(bad).split()


@pytest.mark.parametrize("value", ["abc", "0", "2", "-1", "999999"])
def test_the_hold_hook_refuses_anything_but_an_open_pipe_in_one_line(value):
    """The test hook is checked before the scheduler starts: a value that is not an open file
    descriptor above the standard streams is one line, not a held scheduler that never starts."""
    from hooked_serve import pipe_fd

    from certkv.errors import CertkvError

    with pytest.raises(CertkvError, match=f"^--hold-fd={value!r} is not an open pipe's file descriptor"):
        pipe_fd(value, "--hold-fd")
    read, write = os.pipe()
    try:
        assert pipe_fd(str(read), "--hold-fd") == read
    finally:
        os.close(read), os.close(write)
