"""Which waiting request runs next under a KV budget: the scheduler's admission, as a pure policy.

:class:`~certkv.serve.scheduler.Scheduler` executes; this module decides (vLLM splits its
``schedule()`` from the model's execution the same way), so the rules can be tested with plain
objects and no model. The policy reads:

* the jobs **waiting** for admission, each with the token slots its next step reserves
  (``slots``: what its answering path holds at its peak until its next step, see
  :mod:`certkv.runtime.steps`), whether it is a shadow, whether it already ran a step
  (``resumed``: an escalation's second prefill), its arrival number ``seq``, and whether its
  caller gave up (``cancelled``);
* the jobs **in flight**, each with the slots it ``held`` now (its reservation, or once it decodes
  in the batch its lane's allocated cache), read afresh at every plan: a job whose holding shrinks
  lets waiting jobs in at once (the scheduler gives slots back when a lane finishes, and when a
  decoding-time press compresses a lane mid-answer);
* the **budget** in token slots (None: unlimited);
* the slots the prefix cache's kept compressed contexts hold (``cached``; no request holds a
  reference to one, :mod:`certkv.runtime.prefix_cache`), of which ``wanted`` are contexts a waiting
  job will copy.

and returns a :class:`Plan`: the cancelled jobs to drop, the kept contexts to evict (in slots), the
shadows in flight to preempt, and the one job to admit (or none). Its rules:

1. Waiting jobs are served in :func:`order`: a live job already in flight that asks again, then
   live jobs first come first served, then shadows.
2. A job is admitted only when its reservation fits beside what the jobs in flight hold, so the
   KV in use never exceeds the budget.
3. Live jobs are admitted in order: when the first live job does not fit, no later job overtakes it.
4. Shadows never hold KV a live job waits for: when the first live job does not fit, shadows in
   flight are preempted, newest first, until it fits (or none is left: the live job then waits
   for live jobs alone); and no shadow is admitted while a live job waits.
5. Kept contexts count against the budget, and the plan evicts (least recently used first, by the
   scheduler) just the slots a job needs, before any shadow is preempted. A context a waiting job
   will copy is evicted only when nothing is in flight (nothing else would ever free its slots):
   otherwise the job waits for the jobs in flight, which decode a few tokens and end, rather than
   turn the waiting job's cheap copy into a prefill.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class WaitingJob(Protocol):
    """What the policy reads of a job waiting for admission."""

    @property
    def slots(self) -> float: ...  # the reservation of its next step

    @property
    def shadow(self) -> bool: ...

    @property
    def resumed(self) -> bool: ...

    @property
    def seq(self) -> int: ...

    @property
    def cancelled(self) -> bool: ...


class HeldJob(Protocol):
    """What the policy reads of a job in flight."""

    @property
    def held(self) -> float: ...

    @property
    def shadow(self) -> bool: ...

    @property
    def seq(self) -> int: ...


W = TypeVar("W", bound=WaitingJob)
H = TypeVar("H", bound=HeldJob)


@dataclass
class Plan(Generic[W, H]):
    """What the scheduler does next: drop `drop` (cancelled while waiting), evict `evict` token slots
    of kept contexts, preempt `preempt` (shadows in flight, their KV freed), then admit `admit`
    (None: nobody fits or may go)."""

    drop: list[W] = field(default_factory=list)
    preempt: list[H] = field(default_factory=list)
    admit: W | None = None
    evict: float = 0.0


def order(job: WaitingJob) -> tuple[int, int]:
    """Admission order: a live job re-asking (0), live jobs (1), shadows (2); then arrival.

    Examples
    --------
    >>> from types import SimpleNamespace as Job
    >>> jobs = [Job(shadow=True, resumed=False, seq=0), Job(shadow=False, resumed=False, seq=2),
    ...         Job(shadow=False, resumed=True, seq=3), Job(shadow=False, resumed=False, seq=1)]
    >>> [j.seq for j in sorted(jobs, key=order)]
    [3, 1, 2, 0]
    """
    return (0 if job.resumed and not job.shadow else 1 if not job.shadow else 2, job.seq)


def in_use(holding: Collection[HeldJob]) -> float:
    """Token slots the jobs in flight hold now."""
    return sum(job.held for job in holding)


def plan(waiting: Sequence[W], holding: Collection[H], budget: int | None, cached: float = 0.0,
         wanted: float = 0.0) -> Plan[W, H]:
    """The next admission under `budget`, beside `cached` slots of kept contexts of which waiting
    jobs will copy `wanted` (module docstring for the rules).

    Examples
    --------
    >>> from types import SimpleNamespace as Job
    >>> live = Job(slots=60, shadow=False, resumed=False, seq=2, cancelled=False)
    >>> shadow = Job(held=50, shadow=True, seq=1)
    >>> step = plan([live], [Job(held=30, shadow=False, seq=0), shadow], budget=100)
    >>> step.preempt == [shadow], step.admit is live
    (True, True)
    >>> step = plan([live], [Job(held=30, shadow=False, seq=0)], budget=100, cached=40)
    >>> step.admit is live, step.evict
    (True, 30.0)
    """
    result: Plan[W, H] = Plan()
    queue: list[W] = []
    for job in sorted(waiting, key=order):
        (result.drop if job.cancelled else queue).append(job)
    if not queue:
        return result
    used = in_use(holding) + cached
    evictable = cached - wanted if holding else cached

    def fits(slots: float) -> bool:  # once every evictable kept context is evicted
        return budget is None or used - evictable + slots <= budget

    first = queue[0]
    if not first.shadow and not fits(first.slots):
        for shadow in sorted((j for j in holding if j.shadow), key=lambda j: -j.seq):
            if fits(first.slots):
                break
            result.preempt.append(shadow)
            used -= shadow.held
    for job in queue:  # in order: live jobs first, so a shadow is reached only when none waits
        if fits(job.slots):
            result.admit = job
            result.evict = 0.0 if budget is None else max(0.0, float(used + job.slots - budget))
            return result
        if not job.shadow:
            return result  # live jobs are admitted in order
    return result


__all__ = ["HeldJob", "Plan", "WaitingJob", "in_use", "order", "plan"]
