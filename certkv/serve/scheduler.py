"""Continuous batching under a KV budget: many answers in flight, one model, no HTTP.

Every request is an answering path written as steps (:mod:`certkv.runtime.steps`): a generator
that yields ``Reserve(slots)`` before it allocates KV and ``Decode(...)`` when it has a cache to
decode. :class:`Scheduler` runs them all on one worker thread, so the model never runs two forwards
at once, and interleaves them:

* **Admission.** A job that yields ``Reserve(slots)`` waits until ``slots`` fit in what the jobs
  in flight leave of the budget (token slots, :mod:`certkv.engine.ragged_decode`); then it runs on
  (its prefill, its gates) up to its next step. At most one job that prefills is admitted per
  iteration, between two batched decode steps, so a prefill delays the batch by one prefill at
  most (jobs that only copy a kept context, :mod:`certkv.runtime.prefix_cache`, may join it too). Who goes next is
  decided by :mod:`certkv.serve.admission` (a pure policy, tested without a model): a job already
  in flight that asks again (an escalation's second prefill), then live requests first come first
  served, then shadows. A job whose reservation alone exceeds the budget fails with
  :class:`BudgetExceeded` (it could never run).
* **Batched decoding.** A ``Decode`` joins the :class:`~certkv.engine.ragged_decode.RaggedBatch`
  (its cache taken over as a :class:`~certkv.engine.ragged_decode.LaneCache` with room for its
  question and answer) and from then on holds exactly that cache's slots; one forward per
  iteration advances every lane, and a finished lane's job resumes (its post-decode gate). A lane
  under a decoding-time press (``Lane.compression``) gives slots back at each compression event
  (its buffers cut to what it can still need, :meth:`~certkv.engine.ragged_decode.Lane.give_back`),
  and its job then holds that much less: waiting jobs may be admitted at the next plan. A
  ``Decode`` that cannot batch (certkv's probabilistic press; K-norm's decoding press off the CPU
  or on a fused key projection: :func:`~certkv.engine.decoding_lanes.batchable_decoding_press`) is
  decoded alone at once.
* **Tokens as decoded.** A job submitted with ``on_tokens`` (a
  :data:`~certkv.runtime.steps.TokenListener`) hears, on the worker thread, the answer so far of
  each of its ``final`` decodes: after every batched step that added tokens to its lane, and after
  (or, for a solo decode that tells it, during) a solo decode. A decode a post-decode gate may
  still escalate is not final: nothing of it is heard.
* **Cancelled** requests (past ``--timeout``, or a streamed client gone) leave the batch before the
  next decode step, and their KV is free at once; a solo decode runs to its end.
* **Shadows** (``shadow=True``) never hold KV a live request waits for: when the first waiting
  live request does not fit, shadows in flight are preempted (their lanes dropped, their KV freed)
  and restarted from the beginning later, so a live request waits at most the decode step in
  progress for their memory.

* **Kept contexts** (``--prefix-cache-mib``, :mod:`certkv.runtime.prefix_cache`) count against
  the budget: a context is kept only where the budget leaves room beside the jobs in flight, and
  the admission policy evicts kept contexts (least recently used first, those a waiting job will
  copy last) before a job waits for their slots or a shadow is preempted.

KV in use (the reservations of jobs between steps, every lane's allocated cache, and the kept
contexts) is sampled after every admission and every decode step; :attr:`Scheduler.peak_kv` is the largest sample,
never more than the budget.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from certkv.engine.ragged_decode import Lane, LaneCache, RaggedBatch
from certkv.errors import CertkvError
from certkv.runtime.prefix_cache import PrefixReserve
from certkv.runtime.steps import Decode, Reserve
from certkv.serve import admission

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from certkv.runtime.prefix_cache import PrefixCache
    from certkv.runtime.steps import Step, TokenListener

log = logging.getLogger("certkv.serve")

#: A job's steps: yields Reserve / Decode, returns its result.
JobSteps = Generator["Step", None, Any]


class BudgetExceeded(CertkvError):
    """One request alone needs more KV than the whole budget."""


class QueueFull(Exception):
    """The live queue holds --max-queue requests already."""


class Stopping(Exception):
    """The scheduler is shutting down and accepts no new request."""


@dataclass(eq=False)
class _Job:
    steps: JobSteps
    shadow: bool
    future: Future[Any]
    restart: Callable[[], JobSteps] | None = None
    on_abandon: Callable[[], None] | None = None
    on_tokens: TokenListener | None = None
    step: Step | None = None
    held: float = 0.0
    """Token slots the job holds now: its reservation, or its lane's allocated cache."""
    lane: Lane | None = None
    resumed: bool = False
    """Whether the job already ran a step (a second reservation is admitted first)."""
    seq: int = 0

    @property
    def slots(self) -> float:
        """The reservation the job waits with (:mod:`certkv.serve.admission` reads it)."""
        assert isinstance(self.step, Reserve)
        return self.step.slots

    @property
    def cancelled(self) -> bool:
        return self.future.cancelled()


class Scheduler:
    """Run answering steps for many requests under a KV budget (module docstring).

    Parameters
    ----------
    model : PreTrainedModel
        The model every job's steps run (the batch's forwards use it).
    budget : int or None
        KV budget in token slots; None: unlimited (jobs are admitted as they come).
    prompt_lookup : bool
        Whether a lane verifies the prompt-lookup proposals its path seeds (several greedy tokens
        per forward where the answer copies its context; answers are the same either way). Off:
        one token per lane per forward, as a generation that copies nothing decodes.
    prefix_cache : PrefixCache or None
        The runtime's kept compressed contexts, counted against `budget` (module docstring).
    before_step : callable or None
        Called on the worker before each batched decode step (an observer of the decode's pace; it
        may block, and the step waits for it).
    """

    def __init__(self, model: PreTrainedModel, budget: int | None = None, *, prompt_lookup: bool = True,
                 prefix_cache: PrefixCache | None = None, before_step: Callable[[], None] | None = None) -> None:
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise CertkvError(f"the KV budget must be a positive number of token slots, got {budget!r}")
        self.model = model
        self.budget = budget
        self.prompt_lookup = prompt_lookup
        self.batch = RaggedBatch(model)
        self.prefix_cache = prefix_cache
        if prefix_cache is not None and budget is not None:
            prefix_cache.limit = lambda: budget - admission.in_use(self._holding)
            prefix_cache.kv_budget = budget
        self._inbox: collections.deque[_Job] = collections.deque()
        self._waiting: list[_Job] = []
        self._holding: set[_Job] = set()
        self._cv = threading.Condition()
        self._stopping = False
        self._deadline: float | None = None
        self._seq = itertools.count()
        self.peak_kv = 0.0
        """Largest KV in use sampled so far (token slots)."""
        self.kv_in_use = 0.0
        self.steps = 0
        """Batched decode steps run."""
        self.peak_lanes = 0
        """Most requests one decode step advanced together."""
        self.given_back = 0.0
        """Token slots lanes gave back mid-answer, at their decoding-time press's compression events."""
        self.before_step = before_step
        self._thread = threading.Thread(target=self._loop, name="certkv-scheduler", daemon=True)

    # -- the caller's side --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, steps: JobSteps, *, shadow: bool = False, restart: Callable[[], JobSteps] | None = None,
               on_abandon: Callable[[], None] | None = None, max_waiting: int | None = None,
               on_tokens: TokenListener | None = None) -> Future[Any]:
        """Queue a job; its future gets what its steps return (or raise).

        `restart` gives fresh steps for a shadow that was preempted; `on_abandon` is called for a
        shadow still unfinished at the shutdown deadline; `max_waiting` refuses a live job
        (:class:`QueueFull`) when that many live jobs wait for admission already; `on_tokens` hears
        the answer so far of the job's final decodes (module docstring), on the worker thread.
        """
        job = _Job(steps, shadow, Future(), restart, on_abandon, on_tokens, seq=next(self._seq))
        with self._cv:
            if self._stopping and not shadow:  # a live request finishing during the drain may shadow
                raise Stopping()
            if max_waiting is not None and not shadow and self.waiting_live() >= max_waiting:
                raise QueueFull()
            self._inbox.append(job)
            self._cv.notify()
        return job.future

    def waiting_live(self) -> int:
        """Live jobs not yet admitted."""
        return sum(1 for j in list(self._inbox) + self._waiting if not j.shadow)

    def waiting(self) -> int:
        """Jobs waiting for admission (live and shadow)."""
        return len(self._inbox) + len(self._waiting)

    def waiting_shadows(self) -> int:
        return sum(1 for j in list(self._inbox) + self._waiting if j.shadow)

    def in_flight(self) -> int:
        """Jobs admitted and not finished (prefilling or decoding)."""
        return len(self._holding)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def shutdown(self, drain_seconds: float = 30.0) -> None:
        """Stop accepting; finish every live job, then shadows until `drain_seconds` have passed (the
        rest abandoned: their ``on_abandon`` called); returns when the worker has stopped."""
        with self._cv:
            self._stopping = True
            self._deadline = time.monotonic() + drain_seconds
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(drain_seconds + 600)

    # -- the worker ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._waiting and not self.batch.lanes and not self._stopping:
                    self._cv.wait()
                fresh = list(self._inbox)
                self._inbox.clear()
                if self._stopping and self._drained():
                    break
            for job in fresh:
                self._advance(job)
            self._admit()
            self._decode_step()
        self._abandon_shadows()

    def _drained(self) -> bool:
        """Whether the worker may stop: no live job left, and no shadow or the deadline passed."""
        jobs = self._waiting + list(self._holding)
        if any(not j.shadow for j in jobs):
            return False
        return not jobs or (self._deadline is not None and time.monotonic() > self._deadline)

    def _in_use(self) -> float:
        cached = self.prefix_cache.slots if self.prefix_cache is not None else 0.0
        return admission.in_use(self._holding) + cached

    def _sample(self) -> None:
        self.kv_in_use = self._in_use()
        self.peak_kv = max(self.peak_kv, self.kv_in_use)

    def _admit(self) -> None:
        """Admit jobs (:meth:`_admit_one`) until one that prefills is admitted or none is: a job that
        only copies a kept context (:attr:`~certkv.runtime.steps.Reserve.prefills` false) delays the
        batch by no prefill, so any number of them may join it between two decode steps."""
        while self._waiting:
            prefilled = self._admit_one()
            if prefilled is None or prefilled:
                return

    def _admit_one(self) -> bool | None:
        """Carry out the admission policy's plan (:func:`certkv.serve.admission.plan`): drop the jobs
        cancelled while they waited, preempt shadows, admit one job and run it to its next step;
        whether that job was admitted to prefill (None: nobody was admitted)."""
        if not self._waiting:
            return None
        prefix = self.prefix_cache
        wanted = {j.step.key for j in self._waiting if isinstance(j.step, PrefixReserve)} if prefix else set()
        cached = (prefix.slots, prefix.wanted_slots(wanted)) if prefix is not None else (0.0, 0.0)
        plan = admission.plan(self._waiting, self._holding, self.budget, *cached)
        chosen = plan.admit
        granted = chosen.slots if chosen is not None else 0.0  # read once: a kept context's copy, or its prefill
        for job in plan.drop:  # its caller gave up while it waited
            self._waiting.remove(job)
            job.steps.close()
        if plan.evict and prefix is not None:
            prefix.evict_slots(plan.evict, spare=wanted)
        for job in plan.preempt:
            self._preempt(job)
        if chosen is None:
            return None
        reserve = chosen.step
        assert isinstance(reserve, Reserve)  # a waiting job waits with its reservation
        prefills = reserve.prefills  # read before the job runs on (a kept context's copy, or a prefill)
        self._waiting.remove(chosen)
        chosen.held = granted
        self._holding.add(chosen)
        self._sample()
        self._advance(chosen)
        return prefills

    def _preempt(self, job: _Job) -> None:
        """Free a shadow's KV and restart it from the beginning (it waits for admission again)."""
        if job.lane is not None:
            self.batch.remove(job.lane)
        self._holding.discard(job)
        job.steps.close()
        job.lane, job.held, job.resumed = None, 0.0, False
        assert job.restart is not None  # shadows are submitted with their restart
        job.steps, job.step = job.restart(), None
        self._advance(job)

    def _advance(self, job: _Job) -> None:
        """Run `job` to its next step that waits: a reservation, a batched decode, or its end."""
        while True:
            try:
                step = next(job.steps) if job.step is None else job.steps.send(None)
            except StopIteration as stop:
                self._finish(job)
                _resolve(job.future, result=stop.value)
                return
            except Exception as exc:  # noqa: BLE001 - one job's failure is that job's only
                self._finish(job)
                _resolve(job.future, error=exc)
                return
            job.step = step
            if isinstance(step, Reserve):
                if self.budget is not None and step.slots > self.budget:
                    job.steps.close()
                    self._finish(job)
                    _resolve(job.future, error=BudgetExceeded(
                        f"the request needs {step.slots} KV token slots (its context, question and answer), more "
                        f"than the whole --kv-budget of {self.budget}; shorten the context or raise the budget"))
                    return
                self._finish(job)  # the reservation replaces whatever the job held
                self._waiting.append(job)
                return
            if isinstance(step, Decode):
                job.resumed = True
                if step.final and job.on_tokens is not None:
                    step.listener = _guarded(job.on_tokens)
                if not step.batchable or step.cache is None:
                    assert step.solo is not None  # an unbatchable decode carries its own decoder
                    step.ids, step.logprobs = step.solo()
                    step.tell(step.ids)  # a solo decode that told nothing as it went is heard whole
                    continue
                lane = step.lane if step.lane is not None else self._lane(step)
                if not self.prompt_lookup:
                    lane.plain()
                lane.tag = job
                job.lane, job.held = lane, lane.cache.slots
                self._holding.add(job)
                self.batch.add(lane)
                self._sample()
                return
            raise TypeError(f"an answering path yielded {type(step).__name__}, not Reserve or Decode")

    @staticmethod
    def _lane(step: Decode) -> Lane:
        """A batched decode's lane: its cache taken over with room for its question and answer."""
        room = len(step.question_ids) + step.max_new_tokens
        assert step.cache is not None  # a batchable decode carries its cache
        cache = step.cache if isinstance(step.cache, LaneCache) else LaneCache.adopt(step.cache, room)
        return Lane(cache, step.question_ids, step.position, step.max_new_tokens, step.stop_ids,
                    lookup_ids=step.lookup_ids, want_logprobs=step.want_logprobs)

    def _finish(self, job: _Job) -> None:
        self._holding.discard(job)
        job.held, job.lane = 0.0, None

    def _decode_step(self) -> None:
        self._drop_cancelled_lanes()
        if not self.batch.lanes:
            return
        if self.before_step is not None:
            self.before_step()
        self.peak_lanes = max(self.peak_lanes, len(self.batch.lanes))
        lanes = [(lane, len(lane.answer)) for lane in self.batch.lanes]
        try:
            finished = self.batch.step()
        except Exception as exc:  # noqa: BLE001 - a failed forward fails the lanes in it, not the server
            log.exception("certkv serve: a batched decode step failed; its %d request(s) fail", len(self.batch.lanes))
            for lane in list(self.batch.lanes):
                _resolve(self._drop(lane).future, error=exc)
            return
        self.steps += 1
        for lane, _ in lanes:  # a decoding-time press's event gave slots back (Lane.give_back)
            if lane.compression is not None and lane.tag.lane is lane:
                self.given_back += lane.tag.held - lane.cache.slots
                lane.tag.held = lane.cache.slots
        self._sample()
        for lane, before in lanes:  # the new tokens leave before any finished job resumes
            if len(lane.answer) > before:
                lane.tag.step.tell(lane.answer)
        for lane in finished:
            job = lane.tag
            step = job.step
            assert isinstance(step, Decode)
            step.ids, step.logprobs = lane.answer, (lane.logprobs if lane.want_logprobs else None)
            self._finish(job)
            self._advance(job)

    def _drop_cancelled_lanes(self) -> None:
        """Lanes whose caller gave up (a timeout, a streamed client gone) stop decoding and free their KV."""
        for lane in [r for r in self.batch.lanes if r.tag.future.cancelled()]:
            self._drop(lane)

    def _drop(self, lane: Lane) -> _Job:
        """Take `lane` out of the batch for good: its KV freed, its job's steps closed; its job."""
        self.batch.remove(lane)
        job = lane.tag
        self._finish(job)
        job.steps.close()
        return job

    def _abandon_shadows(self) -> None:
        left = [j for j in self._waiting + list(self._holding) if j.shadow]
        for job in left:
            if job.lane is not None:
                self.batch.remove(job.lane)
            job.steps.close()
            if job.on_abandon is not None:
                job.on_abandon()
            job.future.cancel()
        self._waiting.clear()
        self._holding.clear()
        if left:
            log.warning("certkv serve: shutdown deadline reached; %d pending shadow(s) abandoned", len(left))


def _guarded(listener: TokenListener) -> TokenListener:
    """`listener`, its failures logged instead of raised: a client's stream never fails a decode."""

    def tell(ids: list[int], restarted_at: int | None) -> None:
        try:
            listener(ids, restarted_at)
        except Exception:  # noqa: BLE001
            log.exception("certkv serve: a token listener failed; the request decodes on")

    return tell


def _resolve(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Set `future`'s outcome unless its caller cancelled it (a request that timed out)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # cancelled by its caller meanwhile
