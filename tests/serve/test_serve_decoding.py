"""`certkv serve` deploying a decoding-time point behind a recompute gate, through the official
`openai` client: every answer and decision is the in-process runtime's."""

from __future__ import annotations

import pytest
from test_runtime_decoding import KWARGS, _point
from test_serve import _Server

from certkv.requests.request_set import generate_requests


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from certkv.core.spec import GateSettings

    point = _point(GateSettings(recompute=0.97))
    s = _Server(tmp_path_factory.mktemp("serve_decoding"), point, "--shadow-rate", "0.5")
    try:
        yield s.wait(), point
    finally:
        s.stop()


def test_decoding_point_served_as_in_process(server, embedded):
    import openai

    from certkv.runtime.certified_runtime import CertifiedRuntime

    s, point = server
    assert point.press_kwargs == KWARGS
    runtime = CertifiedRuntime(*embedded, point)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reasons = set()
    for request in generate_requests("demo", 8, seed=21, context_length="100-200")[4:]:
        want = runtime.generate(request.context, request.question)
        out = client.completions.create(model="embedded", prompt="", max_tokens=12,
                                        extra_body={"context": request.context, "question": request.question})
        decision = out.model_extra["certkv"]["decision"]
        assert out.choices[0].text == want.answer, request.id
        assert (decision["reason"], decision["recomputed_at"]) == (want.decision.reason, want.decision.recomputed_at)
        reasons.add(decision["reason"])
        stream = client.completions.create(model="embedded", prompt="", stream=True, max_tokens=12,
                                           extra_body={"context": request.context, "question": request.question})
        assert "".join(c.choices[0].text for c in stream) == want.answer
    assert reasons == {None, "recompute"}, "the requests must cover kept and restarted generations"
