"""Shared check: ``certkv serve``'s scheduler answers every request as the in-process runtime does.

Imported by the runtime tests, which hold calibrated operating points of every kind: each submits
its requests to a real :class:`~certkv.serve.scheduler.Scheduler` all at once, under a KV budget
that lets only a few prefill at a time, and compares ids and decisions with
:meth:`CertifiedRuntime.generate` on the same requests.
"""

from __future__ import annotations

import math

import pytest

#: Signals recomputed by the batched decode agree with the one-lane decode's to this.
TOL = 1e-4


def budget_for(runtime, requests, share: float = 2.5) -> int:
    """A budget of about `share` times the largest request's prefill reservation."""
    from certkv.model.generation import encode_request
    from certkv.runtime.full_path import prefill_slots

    most = max(
        prefill_slots(runtime.model, encode_request(runtime.tokenizer, r.context, r.question, r.answer_prefix),
                      runtime.max_new_tokens, extra=64)
        for r in requests
    )
    return math.ceil(share * most)


def assert_scheduler_matches(runtime, requests, *, budget: int | None = None, strata=None, batching: bool = True, alone=None,
                             prompt_lookup: bool = True):
    """Submit every request at once; ids, mode, reason, escalation, retention and signals must be
    the in-process runtime's, and the KV in use never above the budget; `batching`: some decode
    went through the batch (False for presses that decode alone); `alone`: the runtime's answers to
    `requests` already computed by the caller; `prompt_lookup`: the scheduler's. Returns the scheduler."""
    from certkv.serve.scheduler import Scheduler

    strata = strata or [None] * len(requests)
    alone = alone or [runtime.generate(r.context, r.question, s, answer_prefix=r.answer_prefix) for r, s in zip(requests, strata)]
    scheduler = Scheduler(runtime.model, budget, prompt_lookup=prompt_lookup)
    futures = [scheduler.submit(runtime.answer_steps(r.context, r.question, s, answer_prefix=r.answer_prefix, lean=True))
               for r, s in zip(requests, strata)]
    scheduler.start()
    try:
        batched = [f.result(timeout=600) for f in futures]
    finally:
        scheduler.shutdown()
    for request, a, b in zip(requests, alone, batched):
        da, db = a.decision.to_dict(), b.decision.to_dict()
        assert b.token_ids == a.token_ids, (request.id, da, db)
        for key, value in da.items():
            if isinstance(value, float) or (isinstance(value, list) and value and isinstance(value[0], float)):
                assert db[key] == pytest.approx(value, rel=TOL, abs=TOL), (request.id, key)
            else:
                assert db[key] == value, (request.id, key, da, db)
    if budget is not None:
        assert 0 < scheduler.peak_kv <= budget
    assert (scheduler.steps > 0) == batching, scheduler.steps
    if batching and len(requests) > 2:  # submitted together before the start: decoded together
        assert scheduler.peak_lanes >= 2
    return scheduler
