"""certkv serve's scheduler without a server: budget, admission, preemption, every path kind.

The runtime tests (test_runtime_store.py, test_runtime_strata.py) run the scheduler on every
certified gate kind and a stratified point; here: kvpress's own hooks (a head-wise press that
decodes alone, a wrapper behind a post-decode gate, a plain one), the full-cache fallback, and the
scheduler's own rules, with a real model and real caches.
"""

from __future__ import annotations

import threading

import pytest
from scheduler_checks import assert_scheduler_matches, budget_for

N_REQUESTS = 10


@pytest.fixture(scope="module")
def requests():
    from certkv.requests.request_set import generate_requests

    return generate_requests("demo", N_REQUESTS, seed=2929, context_length="200-320")


def _runtime(embedded, press: str, kv: float, gate=None, press_kwargs=None, max_new_tokens: int = 8):
    from certkv.core.operating_point import ContractSummary, OperatingPoint
    from certkv.core.spec import GateSettings
    from certkv.runtime.certified_runtime import CertifiedRuntime

    fallback = kv >= 1.0
    policy = "full" if fallback else f"{press}@{kv}"
    op = OperatingPoint(
        policy=policy, base_policy=policy, press="full" if fallback else press, kv_retained=kv,
        mean_kv_retained=kv, fallback=fallback, gate=GateSettings(**gate) if gate else None, max_new_tokens=max_new_tokens,
        press_kwargs=press_kwargs or {},
        contract=ContractSummary(tolerance=0.0, risk=0.6, confidence=0.6, procedure="fixed_sequence"),
        n=N_REQUESTS, violations=0, empirical_risk=0.0, risk_upper_bound=0.6, p_value=0.1, candidates=[],
        sequences=[], guarantee="test", created="now", certkv_version="test",
    )
    return CertifiedRuntime(*embedded, op)


@pytest.mark.parametrize(
    ("press", "kv", "gate", "press_kwargs", "batching"),
    [
        ("pyramidkv", 0.4, None, {}, True),
        ("chunkkv", 0.5, {"confidence": 0.9}, {"press": "snapkv"}, True),
        ("adakv", 0.4, None, {"press": "knorm"}, False),  # head-wise masks: decodes alone (pipeline.py)
        ("snapkv", 1.0, None, {}, True),  # the full-cache fallback
    ],
    ids=["pipeline", "pipeline_post_decode_gate", "head_wise", "fallback"],
)
def test_scheduler_answers_as_the_runtime(embedded, requests, press, kv, gate, press_kwargs, batching):
    runtime = _runtime(embedded, press, kv, gate, press_kwargs)
    scheduler = assert_scheduler_matches(runtime, requests, budget=budget_for(runtime, requests), batching=batching)
    if gate:  # the gate split the requests, so both kinds of answer went through the scheduler
        modes = {runtime.generate(r.context, r.question).decision.mode for r in requests}
        assert modes == {"evicted", "full"}
    assert scheduler.in_flight() == 0 and scheduler.waiting() == 0


@pytest.mark.parametrize("prompt_lookup", [True, False], ids=["lookup", "no_lookup"])
def test_prompt_lookup_changes_the_forwards_not_the_answers(embedded_recite, prompt_lookup):
    """Recitations copy their context, so prompt lookup confirms many tokens per forward; without
    it (``certkv serve --no-prompt-lookup``) each lane advances one token per forward, so the
    batch runs at least as many forwards as the longest answer has tokens. Same answers both ways."""
    from certkv.requests.request_set import generate_requests

    recitations = generate_requests("recite", 3, seed=31)
    runtime = _runtime(embedded_recite, "snapkv", 1.0, max_new_tokens=140)  # the full cache: the model's own answers
    alone = [runtime.generate(r.context, r.question) for r in recitations]
    longest = max(len(a.token_ids) for a in alone)
    assert longest > 40, "recitations are long answers"
    scheduler = assert_scheduler_matches(runtime, recitations, alone=alone, prompt_lookup=prompt_lookup)
    if prompt_lookup:
        assert scheduler.steps < longest / 2, (scheduler.steps, longest)
    else:
        assert scheduler.steps >= longest, (scheduler.steps, longest)


def test_a_cancelled_request_leaves_the_batch_at_the_next_step(embedded_recite):
    """A caller that gives up (a timeout, a streamed client gone) cancels the future: its lane stops
    decoding at the next step instead of running on to the end of a long answer."""
    from certkv.requests.request_set import generate_requests
    from certkv.serve.scheduler import Scheduler

    (recitation,) = generate_requests("recite", 1, seed=31)
    runtime = _runtime(embedded_recite, "snapkv", 1.0, max_new_tokens=140)
    whole = runtime.generate(recitation.context, recitation.question)
    scheduler = Scheduler(runtime.model, prompt_lookup=False)  # one token a step
    futures = []

    def give_up_after_three(ids, restarted_at):
        if len(ids) == 3:
            futures[0].cancel()

    futures.append(scheduler.submit(runtime.answer_steps(recitation.context, recitation.question, lean=True),
                                    on_tokens=give_up_after_three))
    scheduler.start()
    scheduler.shutdown()  # returns once no live job is left
    assert futures[0].cancelled() and scheduler.in_flight() == 0 and not scheduler.batch.lanes
    assert scheduler.steps == 3 < len(whole.token_ids), scheduler.steps  # a token a step, dropped after the third


def test_a_request_larger_than_the_budget_fails_alone(embedded, requests):
    from certkv.serve.scheduler import BudgetExceeded, Scheduler

    runtime = _runtime(embedded, "snapkv", 0.5)
    small, large = requests[0], requests[1]
    scheduler = Scheduler(runtime.model, budget=120)  # below any request's prefill (200+ tokens)
    scheduler.start()
    try:
        too_big = scheduler.submit(runtime.answer_steps(large.context, large.question, lean=True))
        with pytest.raises(BudgetExceeded, match=r"more than the whole --kv-budget of 120"):
            too_big.result(timeout=120)
        assert scheduler.in_flight() == 0 and scheduler.kv_in_use == 0
    finally:
        scheduler.shutdown()
    # with room for it, the same scheduler code answers it
    roomy = Scheduler(runtime.model, budget=budget_for(runtime, [small]))
    future = roomy.submit(runtime.answer_steps(small.context, small.question, lean=True))
    roomy.start()
    try:
        assert future.result(timeout=120).token_ids == runtime.generate(small.context, small.question).token_ids
    finally:
        roomy.shutdown()


def test_the_live_queue_is_bounded(embedded, requests):
    from certkv.serve.scheduler import QueueFull, Scheduler, Stopping

    runtime = _runtime(embedded, "snapkv", 0.5)
    scheduler = Scheduler(runtime.model, budget=budget_for(runtime, requests))
    r = requests[0]
    first = scheduler.submit(runtime.answer_steps(r.context, r.question, lean=True), max_waiting=1)
    with pytest.raises(QueueFull):  # not started: the first still waits
        scheduler.submit(runtime.answer_steps(r.context, r.question, lean=True), max_waiting=1)
    shadow = scheduler.submit(runtime.answer_steps(r.context, r.question, lean=True), shadow=True,
                              restart=lambda: runtime.answer_steps(r.context, r.question, lean=True), max_waiting=1)
    scheduler.start()
    assert first.result(timeout=120).token_ids == shadow.result(timeout=120).token_ids
    scheduler.shutdown()
    with pytest.raises(Stopping):
        scheduler.submit(runtime.answer_steps(r.context, r.question, lean=True))


def test_a_live_request_preempts_a_decoding_shadow(embedded, requests):
    """A shadow holds most of the budget and decodes; a live request arrives that does not fit: the
    shadow is dropped and restarted after it, and both answers are still the runtime's."""
    from certkv.model.generation import encode_request
    from certkv.serve.scheduler import Scheduler

    runtime = _runtime(embedded, "snapkv", 0.5)
    # the longer request is the live one, and the budget its reservation (and a little): it cannot
    # fit beside the shadow's lane
    shadow_request, live_request = sorted(requests[:4], key=lambda r: len(r.context))[::3]
    live_enc = encode_request(runtime.tokenizer, live_request.context, live_request.question, live_request.answer_prefix)
    budget = runtime.path.reservation(live_enc, runtime.max_new_tokens, pruned=runtime.path.prunes())
    scheduler = Scheduler(runtime.model, budget=budget)
    restarts = []
    live_future = {}
    live_started = threading.Event()

    def shadow_steps(first: bool):
        steps = runtime.answer_steps(shadow_request.context, shadow_request.question, lean=True)
        step = next(steps)
        while True:
            if first and type(step).__name__ == "Decode" and not live_started.is_set():
                # the shadow is about to join the batch: a live request arrives now (from the
                # worker thread itself, so the order is certain)
                live_started.set()
                live_future["f"] = scheduler.submit(
                    runtime.answer_steps(live_request.context, live_request.question, lean=True))
            try:
                step = steps.send((yield step))
            except StopIteration as stop:
                return stop.value

    def restart():
        restarts.append(1)
        return shadow_steps(first=False)

    shadow = scheduler.submit(shadow_steps(first=True), shadow=True, restart=restart)
    scheduler.start()
    try:
        shadow_answer = shadow.result(timeout=120)
        live_answer = live_future["f"].result(timeout=120)
    finally:
        scheduler.shutdown()
    assert restarts == [1], "the shadow was preempted once and restarted"
    assert live_answer.token_ids == runtime.generate(live_request.context, live_request.question).token_ids
    assert shadow_answer.token_ids == runtime.generate(shadow_request.context, shadow_request.question).token_ids
    assert 0 < scheduler.peak_kv <= budget


DECODING_KWARGS = {"base_press": "streaming_llm", "compression_interval": 8}


@pytest.mark.parametrize("prompt_lookup", [True, False], ids=["lookup", "no_lookup"])
def test_a_decoding_time_point_decodes_in_the_batch_and_gives_slots_back(embedded_recite, prompt_lookup):
    """A batchable decoding-time point (StreamingLLM keeping half of what it has seen, every 8
    steps): its requests decode as lanes of one batch, with the in-process runtime's answers and
    held KV; each reserves its decode's peak, and the budget lets the third in only once the lanes
    in flight have given slots back at a compression event (no request has finished by then).
    Without prompt lookup (``--no-prompt-lookup``) a lane feeds one token a forward: the same answers."""
    from certkv.engine.decoding_lanes import lane_slots
    from certkv.model.generation import encode_request
    from certkv.requests.request_set import generate_requests
    from certkv.runtime.full_path import prefill_slots
    from certkv.serve.scheduler import Scheduler

    runtime = _runtime(embedded_recite, "compression_ratio_decoding", 0.5, press_kwargs=DECODING_KWARGS,
                       max_new_tokens=48)
    recitations = generate_requests("recite", 3, seed=31)
    alone = [runtime.generate(r.context, r.question) for r in recitations]
    encs = [encode_request(runtime.tokenizer, r.context, r.question, r.answer_prefix) for r in recitations]
    reserved = [lane_slots(runtime.model, runtime.press, e, 48) for e in encs]
    # by hand: a lane is allocated n + q + 7 (the question and 7 tokens before the first event)
    first = [len(e.context_ids) + len(e.question_ids) + 7 for e in encs]
    # below the full cache's reservation (the whole prefill, question and answer, and one layer)
    assert all(c < r < prefill_slots(runtime.model, e, 48) for c, r, e in zip(first, reserved, encs))
    budget = first[0] + first[1] + reserved[2] - 1  # the third fits only once the others hold less
    assert reserved[1] + first[0] <= budget
    scheduler = Scheduler(runtime.model, budget, prompt_lookup=prompt_lookup)
    futures, admitted = [], []

    def noted_on_admission(steps):
        value = yield next(steps)  # the reservation: resumed once admitted, before its prefill
        admitted.append((scheduler.given_back, sum(f.done() for f in futures)))
        while True:
            try:
                step = steps.send(value)
            except StopIteration as stop:
                return stop.value
            value = yield step

    for i, r in enumerate(recitations):
        steps = runtime.answer_steps(r.context, r.question, lean=True)
        futures.append(scheduler.submit(noted_on_admission(steps) if i == 2 else steps))
    scheduler.start()
    try:
        served = [f.result(timeout=300) for f in futures]
    finally:
        scheduler.shutdown()
    for want, got in zip(alone, served):
        assert got.token_ids == want.token_ids
        a, b = want.decision, got.decision
        assert (b.mode, b.reason, b.kv_retained_actual) == ("evicted", None, a.kv_retained_actual)
        assert b.confidence_min == pytest.approx(a.confidence_min, rel=1e-4)
    longest = max(len(a.token_ids) for a in alone)
    assert scheduler.peak_lanes >= 2 and (scheduler.steps < longest if prompt_lookup else scheduler.steps >= longest)
    given_back, finished = admitted[0]
    assert given_back > 0 and finished == 0, admitted
    assert 0 < scheduler.peak_kv <= budget
