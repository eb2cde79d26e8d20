"""The admission policy with fake jobs (no model): certkv.serve.admission.plan.

The rules are checked one by one on hand-built queues, then as invariants of a simulated server:
jobs arrive, are admitted by the plan, hold their reservation, decode (a job's held slots may
shrink, as a lane compressed while it decodes would: the policy reads them afresh at every plan),
finish; shadows are preempted and come back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from certkv.serve.admission import order, plan


@dataclass(eq=False)
class Job:
    slots: float = 0.0
    shadow: bool = False
    resumed: bool = False
    seq: int = 0
    cancelled: bool = False
    held: float = 0.0


def _seqs(jobs):
    return [j.seq for j in jobs]


def test_nothing_waits_nothing_happens():
    step = plan([], [Job(held=5)], budget=10)
    assert step.admit is None and step.drop == [] and step.preempt == []


def test_live_jobs_go_first_come_first_served_and_a_big_one_is_not_overtaken():
    big, small = Job(slots=80, seq=1), Job(slots=10, seq=2)
    assert plan([small, big], [Job(held=10, seq=0)], budget=100).admit is big
    # The first live job does not fit: the smaller one behind it waits too.
    assert plan([small, big], [Job(held=30, seq=0)], budget=100).admit is None


def test_an_in_flight_job_asking_again_goes_before_every_newcomer():
    newcomer, again = Job(slots=10, seq=1), Job(slots=10, seq=5, resumed=True)
    assert plan([newcomer, again], [], budget=100).admit is again
    shadow_again = Job(slots=10, seq=0, resumed=True, shadow=True)
    assert order(shadow_again) > order(newcomer)  # a shadow's second prefill is still a shadow's


def test_a_shadow_is_never_admitted_while_a_live_job_waits():
    live, shadow = Job(slots=90, seq=2), Job(slots=5, shadow=True, seq=1)
    step = plan([shadow, live], [Job(held=20, seq=0)], budget=100)
    assert step.admit is None and step.preempt == []
    assert plan([shadow], [Job(held=20, seq=0)], budget=100).admit is shadow


def test_shadows_are_preempted_newest_first_until_the_live_job_fits():
    old, mid, new = (Job(held=30, shadow=True, seq=s) for s in (1, 2, 3))
    live = Job(slots=50, seq=4)
    step = plan([live], [Job(held=20, seq=0), old, mid, new], budget=100)
    assert _seqs(step.preempt) == [3, 2] and step.admit is live
    # Not enough even with every shadow gone: all are preempted, the live job waits for the rest.
    huge = Job(slots=95, seq=5)
    step = plan([huge], [Job(held=20, seq=0), old, mid, new], budget=100)
    assert _seqs(step.preempt) == [3, 2, 1] and step.admit is None


def test_cancelled_jobs_are_dropped_and_do_not_block_the_queue():
    gone, next_ = Job(slots=500, seq=1, cancelled=True), Job(slots=10, seq=2)
    step = plan([gone, next_], [], budget=100)
    assert step.drop == [gone] and step.admit is next_ and step.preempt == []


def test_decoding_time_compression_frees_slots_for_a_waiting_job():
    decoding = Job(held=70, seq=0)
    waiting = Job(slots=40, seq=1)
    assert plan([waiting], [decoding], budget=100).admit is None
    decoding.held = 55  # a compression event: the lane's cache now holds fewer slots
    assert plan([waiting], [decoding], budget=100).admit is waiting


def _decode_time_lanes(reserve: float, allocated: float, after_event: float, budget: int, steps: int = 6,
                       n: int = 8) -> int:
    """Jobs as a decoding-time lane lives under the scheduler: admitted with its peak reservation,
    holding its lane's allocation once prefilled, cut at its first compression event (its second
    decode step) to what it can still need, done after `steps` steps; one admission per tick
    before each batched step. Returns the most lanes decoded at once; the budget is never exceeded."""
    waiting = [Job(slots=reserve, seq=i) for i in range(n)]
    holding: dict[Job, int] = {}  # a job in flight: its decode steps so far
    most = 0
    while waiting or holding:
        job = plan(waiting, list(holding), budget).admit
        if job is not None:
            waiting.remove(job)
            job.held = job.slots
            assert sum(j.held for j in holding) + job.held <= budget
            job.held, holding[job] = allocated, 0  # prefilled: its lane's buffers, the prefill's copy gone
        most = max(most, len(holding))
        for job in list(holding):  # one batched step
            holding[job] += 1
            if holding[job] == 2:
                job.held = after_event
            if holding[job] == steps:
                del holding[job]
        assert sum(j.held for j in holding) <= budget
    return most


def test_decoding_time_lanes_giving_slots_back_decode_more_at_once():
    # a lane reserves 50 (its peak and one layer of copying), holds 40 once prefilled, 20 after an event
    assert _decode_time_lanes(50, 40, 40, budget=100) == 2
    assert _decode_time_lanes(50, 40, 20, budget=100) == 3


def test_no_budget_admits_the_first_in_order():
    jobs = [Job(slots=10**9, seq=2), Job(slots=1, shadow=True, seq=1)]
    assert plan(jobs, [Job(held=10**9)], budget=None).admit is jobs[0]


def test_kept_contexts_are_evicted_just_enough_and_before_any_shadow_is_preempted():
    shadow, live = Job(held=30, shadow=True, seq=1), Job(slots=50, seq=2)
    # 20 held + 40 kept + 30 shadow = 90: the live job fits once 40 kept slots go, no shadow preempted
    step = plan([live], [Job(held=20, seq=0), shadow], budget=100, cached=40)
    assert step.admit is live and step.preempt == [] and step.evict == pytest.approx(40.0)
    # only part of the kept slots is needed
    step = plan([Job(slots=20, seq=2)], [Job(held=20, seq=0)], budget=100, cached=70)
    assert step.evict == pytest.approx(10.0) and step.admit is not None
    # nothing to evict when it fits beside them
    assert plan([Job(slots=10, seq=2)], [Job(held=20, seq=0)], budget=100, cached=70).evict == 0.0
    # not enough with every kept context gone: then shadows are preempted, the kept slots still evicted
    step = plan([Job(slots=60, seq=2)], [Job(held=20, seq=0), shadow], budget=100, cached=40)
    assert step.preempt == [shadow] and step.evict == pytest.approx(20.0)
    # a shadow may evict kept contexts too (they are only a cache), but never while a live job waits
    lone = Job(slots=50, shadow=True, seq=3)
    assert plan([lone], [], budget=100, cached=90).evict == pytest.approx(40.0)


def test_a_context_a_waiting_job_will_copy_is_evicted_only_when_nothing_is_in_flight():
    first = Job(slots=50, seq=2)
    # 30 of the 60 kept slots are wanted: evicting the other 30 is not enough while a job decodes
    step = plan([first], [Job(held=25, seq=0)], budget=100, cached=60, wanted=30)
    assert step.admit is None and step.evict == 0.0
    assert plan([first], [Job(held=10, seq=0)], budget=100, cached=60, wanted=30).evict == pytest.approx(20.0)
    # nothing in flight would ever free them: then wanted contexts go too
    step = plan([first], [], budget=100, cached=80, wanted=70)
    assert step.admit is first and step.evict == pytest.approx(30.0)


@dataclass(eq=False)
class SimJob(Job):
    steps_left: int = 0
    compress_to: float | None = None
    finished: bool = False


def _simulate(seed: int, budget: int = 100, n: int = 120):
    """Arrivals, one admission per tick (as the scheduler admits), decoding that shrinks the held
    slots of decoding-time jobs, preemption of shadows; checks the invariants after every plan."""
    rng = random.Random(seed)
    waiting: list[SimJob] = []
    holding: list[SimJob] = []
    done: list[SimJob] = []
    arrivals = []
    for seq in range(n):
        shadow = rng.random() < 0.3
        arrivals.append(SimJob(slots=rng.randint(5, 60), shadow=shadow, seq=seq, steps_left=rng.randint(1, 6),
                               compress_to=rng.choice([None, 0.5])))
    peak, tick, admitted_live = 0.0, 0, []
    while arrivals or waiting or holding:
        tick += 1
        assert tick < 10_000, "the simulation does not end: a job starves"
        for _ in range(rng.randint(0, 2)):
            if arrivals:
                waiting.append(arrivals.pop(0))
        step = plan(waiting, holding, budget)
        first = sorted(waiting, key=order)[0] if waiting else None
        for job in step.preempt:
            assert job.shadow and first is not None and not first.shadow
            holding.remove(job)
            job.held = 0.0
            waiting.append(job)  # restarted: it waits for admission again
        if step.admit is not None:
            job = step.admit
            assert not (job.shadow and any(not j.shadow for j in waiting)), "a shadow took a live job's memory"
            waiting.remove(job)
            job.held = job.slots
            holding.append(job)
            if not job.shadow:
                admitted_live.append(job.seq)
        used = sum(j.held for j in holding)
        assert used <= budget
        peak = max(peak, used)
        if first is not None and not first.shadow and step.admit is not first:
            # The first live job waits: no shadow holds KV, and it does not fit.
            assert not any(j.shadow for j in holding)
            assert used + first.slots > budget
        for job in list(holding):  # one decode step
            job.steps_left -= 1
            if job.compress_to is not None:
                job.held = max(1.0, job.held * job.compress_to)
            if job.steps_left <= 0:
                holding.remove(job)
                done.append(job)
    assert admitted_live == sorted(admitted_live), "live jobs were not admitted first come first served"
    return done, peak


@pytest.mark.parametrize("seed", range(5))
def test_a_simulated_server_never_exceeds_the_budget_and_serves_everyone(seed):
    done, peak = _simulate(seed)
    assert len(done) == 120 and 0 < peak <= 100
    live = [j.seq for j in done if not j.shadow]
    assert len(live) == len(set(live))
