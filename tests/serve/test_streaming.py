"""Streaming as decoded: a streamed answer's tokens leave while the rest is still being decoded.

Scheduler level (no HTTP): a job's token listener hears its answer grow, step by step, before the
job resumes; an evicted decode behind a post-decode gate is never heard (the gate may still throw
it away), the full cache's answer it escalates to is; a recompute restart keeps what was heard and
says where. Server level: a real ``certkv serve`` process whose scheduler takes one decode step per
byte the test writes (started by tests/serve/hooked_serve.py with ``--step-fd``), driven by the
official ``openai`` client: the first chunk arrives while the server reports the request still
decoding after one step, so it left before the answer ended (by event: with a replayed answer the
chunk could not arrive before the test lets the decode go on).
"""

from __future__ import annotations

import os

import httpx
import pytest
from test_runtime_decoding import _point as _decoding_point
from test_serve import _operating_point, _Server

from certkv.requests.request_set import generate_requests


@pytest.fixture(scope="module")
def requests():
    return generate_requests("demo", n=4, seed=4243, context_length=(200, 320))


def _heard_while_scheduled(runtime, requests):
    """Run `requests` together on a real scheduler, each with a listener: (answers, what each heard)."""
    from certkv.serve.scheduler import Scheduler

    scheduler = Scheduler(runtime.model)
    heard: list[list[tuple[list[int], int | None]]] = [[] for _ in requests]
    futures = [scheduler.submit(runtime.answer_steps(r.context, r.question, lean=True),
                                on_tokens=lambda ids, at, i=i: heard[i].append((ids, at)))
               for i, r in enumerate(requests)]
    scheduler.start()
    try:
        answers = [f.result(timeout=300) for f in futures]
    finally:
        scheduler.shutdown()
    return answers, heard


def _grows(lists: list[list[int]]) -> bool:
    """Whether each list strictly extends the one before it."""
    return all(len(b) > len(a) and b[: len(a)] == a for a, b in zip(lists, lists[1:]))


def test_a_listener_hears_each_batched_step_before_the_answer_ends(embedded, requests):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    runtime = CertifiedRuntime(*embedded, _operating_point(0.5, 0.5))
    answers, heard = _heard_while_scheduled(runtime, requests)
    alone = runtime.generate(requests[0].context, requests[0].question)
    assert answers[0].token_ids == alone.token_ids  # a listener changes nothing
    for answer, calls in zip(answers, heard):
        lists = [ids for ids, _ in calls]
        assert lists[-1] == answer.token_ids and _grows(lists)
        assert len(lists) >= 2 and len(lists[0]) == 1  # the first step's one token, heard before the rest existed
        assert all(at is None for _, at in calls)


def test_a_post_decode_gate_is_heard_only_once_it_decided(embedded, requests):
    from certkv.core.spec import GateSettings
    from certkv.runtime.certified_runtime import CertifiedRuntime

    point = _operating_point(0.5, 0.5)
    kept = CertifiedRuntime(*embedded, point.model_copy(update={"gate": GateSettings(confidence=1e-6)}))
    answers, heard = _heard_while_scheduled(kept, requests)
    assert [a.decision.reason for a in answers] == [None] * len(requests)
    assert heard == [[] for _ in requests]  # decoded before the gate kept it: flushed whole by the route
    escalating = CertifiedRuntime(*embedded, point.model_copy(update={"gate": GateSettings(confidence=1.0)}))
    answers, heard = _heard_while_scheduled(escalating, requests)
    for answer, calls in zip(answers, heard):
        assert answer.decision.reason == "confidence" and answer.decision.escalated
        lists = [ids for ids, _ in calls]
        assert lists[-1] == answer.token_ids and _grows(lists) and len(lists[0]) == 1  # the full answer, as decoded


def test_a_recompute_restart_keeps_what_was_heard_and_says_where(embedded):
    from certkv.core.spec import GateSettings
    from certkv.runtime.certified_runtime import CertifiedRuntime

    # the lowest token probabilities of these answers lie in 0.996-0.9991: some restart, some do not
    runtime = CertifiedRuntime(*embedded, _decoding_point(GateSettings(recompute=0.9987)))
    requests = generate_requests("demo", n=6, seed=21, context_length=(100, 200))
    answers, heard = _heard_while_scheduled(runtime, requests)
    restarts = 0
    for answer, calls in zip(answers, heard):  # (the answers are the in-process runtime's: test_runtime_decoding)
        lists = [ids for ids, _ in calls]
        assert lists[-1] == answer.token_ids and all(b[: len(a)] == a for a, b in zip(lists, lists[1:]))
        at = answer.decision.recomputed_at
        if at is None:
            assert all(a is None for _, a in calls)
            continue
        restarts += 1
        first = next(i for i, (_, a) in enumerate(calls) if a is not None)
        # before: the press's tokens one by one, up to the kept ones; then the restart, heard at once
        assert [len(ids) for ids, _ in calls[:first]] == list(range(1, at + 1))
        assert calls[first] == (answer.token_ids[:at], at)
        assert all(a == at for _, a in calls[first:])
    assert restarts >= 1 and any(a.decision.recomputed_at is None for a in answers), "cover both cases"


def test_pieces_concatenate_to_exactly_the_answer(embedded):
    from certkv.serve.streaming import PieceStream, token_pieces

    tokenizer = embedded[1]
    ids = tokenizer.encode("The magic number for elm is 3802. The magic number for summit is 4600.")
    text = tokenizer.decode(ids, skip_special_tokens=True)
    stream, pieces = PieceStream(tokenizer), []
    for end in (1, 2, 2, 5, 9, len(ids) - 1):  # steps that settle one token, none, several
        pieces.append(stream.add(ids[:end]))
    pieces.append(text[len(stream.sent):])  # what the last chunk adds
    assert "".join(pieces) == text == "".join(token_pieces(tokenizer, ids, text))
    assert pieces[2] == "" and all(pieces[i] for i in (0, 1, 3, 4))


def test_the_feed_hands_tokens_over_in_order_and_ends_after_them():
    import asyncio
    import threading
    from concurrent.futures import Future

    from certkv.serve.streaming import TokenFeed

    async def go():
        feed, future = TokenFeed(asyncio.get_running_loop()), Future()

        def scheduler():  # what the worker thread does: tell the answer as it grows, then resolve
            for n in range(1, 4):
                feed(list(range(n)), None)
            feed([0, 1, 2], 2)
            future.set_result("done")

        worker = threading.Thread(target=scheduler)
        worker.start()
        worker.join()  # all told and resolved before the loop reads: the end still comes last
        items = [await feed.first(future)]
        while items[-1] is not None:
            items.append(await feed.next())
        return items

    items = asyncio.run(go())
    # the answers of one restart state may merge into the latest; a restart is never merged over; the end is last
    assert items[-1] is None and items[-2] == ([0, 1, 2], 2)
    assert [ids for ids, _ in items[:-2]][-1] == [0, 1, 2] and all(at is None for _, at in items[:-2])


def test_a_failure_after_the_first_chunk_ends_the_stream_with_an_error_event(embedded, requests):
    import asyncio
    import json

    from certkv.core.monitor import RiskMonitor
    from certkv.runtime.certified_runtime import CertifiedRuntime
    from certkv.serve.app import create_app
    from certkv.serve.metrics import Metrics
    from certkv.serve.service import Service

    runtime = CertifiedRuntime(*embedded, _operating_point(0.5, 0.5))
    real = runtime.answer_steps

    def answer_steps(context, question, stratum=None, **kwargs):  # fails once its answer is decoded
        yield from real(context, question, stratum, **kwargs)
        raise RuntimeError("kaboom after the decode")

    runtime.answer_steps = answer_steps
    service = Service(runtime, RiskMonitor(0.5, 0.1, 0.5), None, None, Metrics(), max_queue=4)
    app = create_app(service, model_id="embedded")
    service.start()
    r = requests[1]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/completions", json={"context": r.context, "question": r.question,
                                                              "stream": True})

    resp = asyncio.run(go())
    service.shutdown(1.0)
    events = [json.loads(line.removeprefix("data: ")) for line in resp.text.splitlines() if line.startswith("data: ")]
    assert resp.status_code == 200 and "choices" in events[0]  # the stream had begun
    assert "kaboom after the decode" in events[-1]["error"]["message"] and events[-1]["error"]["code"] == "internal_error"


class _SteppedServer(_Server):
    """test_serve's server, its scheduler stepping once per byte of a pipe (the launcher's ``--step-fd``):
    `step` is the pipe's write end; closing it lets the scheduler step freely."""

    def __init__(self, folder, op):
        super().__init__(folder, op, "--timeout", "60", held=True, hook="--step-fd")
        self.step = self._hold

    def free(self):
        self.release()
        self.step = None


@pytest.fixture(scope="module", autouse=True)
def stepped(tmp_path_factory):
    """The stepped server, started with the module (it loads while the in-process tests run); a
    test that talks to it waits for it first."""
    server = _SteppedServer(tmp_path_factory.mktemp("stream"), _operating_point(0.5, 0.5))
    try:
        yield server
    finally:
        server.stop()


def test_chunks_leave_before_the_answer_ends_through_the_openai_client(stepped, requests):
    import openai

    server, r = stepped.wait(), requests[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    os.write(server.step, b"1")  # exactly one decode step
    stream = client.completions.create(model="embedded", prompt="", stream=True,
                                       extra_body={"context": r.context, "question": r.question})
    chunks = iter(stream)
    first = next(chunks)
    kv = httpx.get(server.url + "/health", timeout=10).json()["kv"]
    # the response began with the first decode step's token, while the row waits for its next step
    assert first.choices[0].finish_reason is None and "certkv" not in first.model_extra
    assert (kv["decode_steps"], kv["requests_in_flight"]) == (1, 1)
    server.free()  # the rest decodes freely
    rest = list(chunks)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    last = rest[-1]
    assert last.choices[0].finish_reason in ("stop", "length") and last.model_extra["certkv"]["decision"]["mode"] == "evicted"
    assert last.usage.completion_tokens >= 2
    whole = client.completions.create(model="embedded", prompt="", extra_body={"context": r.context,
                                                                               "question": r.question})
    assert text == whole.choices[0].text  # the pieces are exactly the answer
    messages = [{"role": "system", "content": r.context}, {"role": "user", "content": r.question}]
    chat = list(client.chat.completions.create(model="embedded", messages=messages, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == whole.choices[0].text
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'certkv_time_to_first_token_seconds_count{route="/v1/completions"} 1.0' in metrics
    assert 'certkv_time_to_first_token_seconds_count{route="/v1/chat/completions"} 1.0' in metrics


class _CleaningTokenizer:
    """Tokens' texts joined, then " 's" cleaned up to "'s", as tokenizers that clean up
    tokenization spaces rewrite text already decoded once the next token arrives."""

    words = ["Hi", " '", "s", " there"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words[i] for i in ids).replace(" 's", "'s")


def test_a_token_after_rewritten_text_still_gets_its_own():
    from certkv.serve.answer_cut import token_texts
    from certkv.serve.streaming import token_pieces

    texts = token_texts(_CleaningTokenizer(), [0, 1, 2, 3])
    assert texts == ["Hi", " '", "", " there"]  # the rewrite costs one token its text, not every later one
    assert token_pieces(_CleaningTokenizer(), [0, 1, 2, 3], "Hi's there") == ["Hi's there"]  # not rebuilt: whole
