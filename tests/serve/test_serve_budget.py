"""`certkv serve --kv-budget` end to end: a real server process, the official `openai` client.

The budget holds about two requests' prefill, so concurrent requests queue for KV, decode in one
batch, and share it with their shadows (every evicted answer is shadowed); the answers must be the
in-process runtime's, the KV in use never above the budget, a full queue a 503 with Retry-After,
and a request that could never fit a 413 naming the budget. The server starts held at its test hook
(its scheduler takes no job until released), so the queue fills as the test says, not by a race.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from scheduler_checks import budget_for
from test_serve import _operating_point, _Server, _wait_for

from certkv.requests.request_set import generate_requests


@pytest.fixture(scope="module")
def requests():
    return generate_requests("demo", n=16, seed=5151, context_length=(200, 320))


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory, requests, embedded):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    op = _operating_point(0.5, 0.5)
    runtime = CertifiedRuntime(*embedded, op)
    budget = budget_for(runtime, requests, share=2.2)
    server = _Server(tmp_path_factory.mktemp("budget"), op, "--kv-budget", str(budget), "--max-queue", "3",
                     "--shadow-rate", "1.0", "--timeout", "120", held=True)
    try:
        yield server.wait(), runtime, budget
    finally:
        assert server.stop() == 0, server.output()


def test_concurrent_openai_requests_under_a_budget(budgeted, requests):
    import openai

    server, runtime, budget = budgeted
    expected = {r.id: runtime.generate(r.context, r.question).answer for r in requests}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def ask(r):
        try:
            out = client.completions.create(model="embedded", prompt="", extra_body={"context": r.context,
                                                                                     "question": r.question})
            return r.id, out, None
        except openai.APIStatusError as exc:
            return r.id, None, exc

    answered, refused = {}, []

    def note(results):
        for rid, out, exc in results:
            if exc is None:
                answered[rid] = out
            else:
                refused.append(exc)

    def depth():
        return httpx.get(server.url + "/health", timeout=10).json()["queue"]["depth"]

    # Held, the scheduler admits nothing: three requests fill the queue of 3 one by one (each seen in
    # /health) and a fourth is refused. Released, the three are admitted under the budget and decode
    # together; the rest go in groups of three at once, which a queue of 3 always takes whole.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        queued = []
        for k, r in enumerate(requests[:3], 1):
            queued.append(pool.submit(ask, r))
            _wait_for(lambda k=k: depth() == k, f"{k} requests to wait in the held queue")
        note([ask(requests[3])])
        server.release()
        note(f.result() for f in queued)
        rest = requests[3:]
        for i in range(0, len(rest), 3):
            note(pool.map(ask, rest[i : i + 3]))
    assert len(answered) == len(requests), "every request was answered"
    for rid, out in answered.items():
        assert out.choices[0].text == expected[rid], rid
        assert out.model_extra["certkv"]["decision"]["mode"] == "evicted"
    assert len(refused) == 1, "the request beyond the held queue of 3, alone, is refused"
    assert {e.status_code for e in refused} == {503}
    assert all(e.body["code"] == "queue_full" and int(e.response.headers["Retry-After"]) >= 1 for e in refused)

    health = httpx.get(server.url + "/health", timeout=10).json()
    kv = health["kv"]
    assert kv["budget"] == budget
    assert 0 < kv["peak"] <= budget  # sampled after every admission and every decode step
    assert kv["max_batch"] >= 2 and kv["decode_steps"] > 0
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert f"certkv_kv_budget_slots {float(budget)}" in metrics
    peak = float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("certkv_kv_peak_slots ")))
    assert 0 < peak <= budget


def test_a_request_larger_than_the_budget_is_413(budgeted, requests):
    import openai

    server, _, budget = budgeted
    server.release()  # started held: the scheduler must run (the first test released it already)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    long_context = " ".join([requests[0].context] * 8)  # ~2000 tokens: more than the whole budget
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="embedded", prompt="", extra_body={"context": long_context,
                                                                           "question": requests[0].question})
    assert info.value.status_code == 413
    message = info.value.body["message"]
    assert f"--kv-budget of {budget}" in message and "\n" not in message
    # the server goes on: a request that fits is answered
    out = client.completions.create(model="embedded", prompt="", extra_body={"context": requests[1].context,
                                                                             "question": requests[1].question})
    assert out.choices[0].text
