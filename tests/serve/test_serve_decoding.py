"""`certkv serve` deploying a decoding-time point behind a recompute gate on long generations (the
embedded-recite model reciting its context's records, 30-60 words), through the official `openai` client:
every answer and decision is the in-process runtime's."""

from __future__ import annotations

import pytest
from test_runtime_decoding import _point
from test_serve import _Server

from certkv.requests.request_set import generate_requests


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from certkv.core.spec import GateSettings

    # StreamingLLM compressing every 8 steps to 80% of the tokens seen, restarting below p = 0.3
    kwargs = {"base_press": "streaming_llm", "compression_interval": 8}
    point = _point(GateSettings(recompute=0.3)).model_copy(update={
        "press_kwargs": kwargs, "kv_retained": 0.8, "policy": "compression_ratio_decoding@0.80+recq",
        "base_policy": "compression_ratio_decoding@0.80", "max_new_tokens": 140})
    s = _Server(tmp_path_factory.mktemp("serve_decoding"), point, "--shadow-rate", "0.5", "--model", "embedded-recite")
    try:
        yield s.wait(), point
    finally:
        s.stop()


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
