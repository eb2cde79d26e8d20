"""`certkv serve` deploying decoding-time points on long generations (the embedded-recite model
reciting its context's records, 30-60 words), through the official `openai` client: behind a
recompute gate (decoded alone), and ungated on a batchable press (lanes of one batch, giving slots
back as they compress); every answer and decision is the in-process runtime's."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from test_runtime_decoding import _point
from test_serve import _Server, _wait_for

from certkv.requests.request_set import generate_requests


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers of the module, started together (each start is mostly an interpreter loading
    torch and the model: two in parallel take little longer than one) and stopped at its end."""
    from certkv.core.spec import GateSettings

    # StreamingLLM compressing every 8 steps to 80% of the tokens seen, restarting below p = 0.3
    kwargs = {"base_press": "streaming_llm", "compression_interval": 8}
    gated = _point(GateSettings(recompute=0.3)).model_copy(update={
        "press_kwargs": kwargs, "kv_retained": 0.8, "policy": "compression_ratio_decoding@0.80+recq",
        "base_policy": "compression_ratio_decoding@0.80", "max_new_tokens": 140})
    # StreamingLLM keeping half of the tokens seen, every 8 steps, ungated: batchable
    batchable = _point(None).model_copy(update={
        "press_kwargs": kwargs, "kv_retained": 0.5, "mean_kv_retained": 0.5,
        "policy": "compression_ratio_decoding@0.50", "base_policy": "compression_ratio_decoding@0.50",
        "max_new_tokens": 140})
    started = []
    try:
        started.append(_Server(tmp_path_factory.mktemp("serve_decoding"), gated, "--shadow-rate", "0.5", "--model",
                               "embedded-recite"))
        started.append(_Server(tmp_path_factory.mktemp("serve_decoding_lanes"), batchable, "--shadow-rate", "0",
                               "--model", "embedded-recite", held=True))
        yield {"gated": (started[0].wait(), gated), "held": (started[1].wait(), batchable)}
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["gated"]


def test_decoding_point_served_as_in_process(server, embedded_recite):
    import openai

    from certkv.runtime.certified_runtime import CertifiedRuntime

    s, point = server
    runtime = CertifiedRuntime(*embedded_recite, point)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reasons = set()
    for request in generate_requests("recite", 4, seed=77):
        want = runtime.generate(request.context, request.question)
        assert len(want.answer.split()) >= 25  # a long generation
        out = client.completions.create(model="embedded-recite", prompt="", max_tokens=140,
                                        extra_body={"context": request.context, "question": request.question})
        decision = out.model_extra["certkv"]["decision"]
        assert out.choices[0].text == want.answer, request.id
        assert (decision["reason"], decision["recomputed_at"]) == (want.decision.reason, want.decision.recomputed_at)
        reasons.add(decision["reason"])
        stream = list(client.completions.create(model="embedded-recite", prompt="", stream=True, max_tokens=140,
                                                extra_body={"context": request.context, "question": request.question}))
        assert "".join(c.choices[0].text for c in stream) == want.answer
        # streamed as decoded: a restart is a chunk of its own, and the text sent before it stands
        events = [(i, c.model_extra["certkv"]) for i, c in enumerate(stream) if "event" in c.model_extra.get("certkv", {})]
        at = want.decision.recomputed_at
        assert [e for _, e in events] == ([] if at is None else [{"event": "recompute", "recomputed_at": at}])
        if events:
            before = "".join(c.choices[0].text for c in stream[: events[0][0]])
            assert want.answer.startswith(before) and before, "the press's tokens streamed before the restart"
    assert reasons == {None, "recompute"}, "the requests must cover kept and restarted generations"


@pytest.fixture(scope="module")
def held_server(servers):
    return servers["held"]


def test_a_batchable_decoding_point_answers_concurrent_recitations_together(held_server, embedded_recite):
    """Held, the server queues three recitations; released, they decode as lanes of one batch (the
    /health counters: more than one lane a step, slots given back at compression events) and each
    answer is the in-process runtime's, which decodes alone under kvpress's hooks."""
    import openai

    from certkv.runtime.certified_runtime import CertifiedRuntime

    s, point = held_server
    runtime = CertifiedRuntime(*embedded_recite, point)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    requests = generate_requests("recite", 3, seed=79)  # answers of 43-74 tokens under this press

    def ask(r):
        return client.completions.create(model="embedded-recite", prompt="", max_tokens=140,
                                         extra_body={"context": r.context, "question": r.question})

    def depth():
        return httpx.get(s.url + "/health", timeout=10).json()["queue"]["depth"]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = []
        for k, r in enumerate(requests, 1):
            futures.append(pool.submit(ask, r))
            _wait_for(lambda k=k: depth() == k, f"{k} requests to wait in the held queue")
        s.release()
        outs = [f.result() for f in futures]
    for r, out in zip(requests, outs):
        want = runtime.generate(r.context, r.question)
        assert len(want.token_ids) >= 32  # a long generation: four compression events at least
        assert out.choices[0].text == want.answer, r.id
        assert out.model_extra["certkv"]["decision"]["mode"] == "evicted"
    kv = httpx.get(s.url + "/health", timeout=10).json()["kv"]
    assert kv["max_batch"] >= 2 and kv["given_back"] > 0, kv
