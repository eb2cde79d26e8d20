"""One model replica under a KV budget: the monitor and the shadows around the scheduler.

Requests run on :class:`~certkv.serve.scheduler.Scheduler` (one worker thread, continuous batched
decoding, admission under ``--kv-budget``), as the runtime's answering steps. A live request: its
stream's monitor tripped when it starts → answered from the full cache (reason ``monitor``); else
the runtime answers and, for an evicted answer only, the seeded shadow coin
(:meth:`RiskMonitor.draw_shadow`) is drawn after the gate's decision; the request is recorded and,
when shadowed, its shadow job submitted at shadow priority (it uses the budget like any request,
and gives it back to a live request that needs it). The caller gets its answer before its shadow
runs. Shadow jobs are never dropped while the service runs; :meth:`Service.shutdown` finishes the
live requests, then the shadows until a deadline (the rest are abandoned and counted), and closes
the shadow store.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from certkv.errors import CertkvError
from certkv.runtime.steps import Decode
from certkv.serve.answer_cut import finish_reason
from certkv.serve.kv_budget import bytes_per_slot
from certkv.serve.scheduler import BudgetExceeded, QueueFull, Scheduler, Stopping
from certkv.serve.shared_monitor import log_first_trip

__all__ = ["BudgetExceeded", "QueueFull", "Served", "Service", "Stopping"]

if TYPE_CHECKING:
    from collections.abc import Callable, Generator
    from concurrent.futures import Future

    from certkv.core.monitor import RiskMonitor
    from certkv.runtime.certified_runtime import CertifiedRuntime, RuntimeAnswer
    from certkv.runtime.steps import Step, TokenListener
    from certkv.serve.metrics import Metrics
    from certkv.serve.shadow import ShadowJob, ShadowRunner
    from certkv.serve.shadow_store import ShadowStore

log = logging.getLogger("certkv.serve")

@dataclass
class Served:
    """What a live request returns: the runtime's answer and the monitor's view of it."""

    request_id: str
    answer: RuntimeAnswer
    stream: str | None
    shadowed: bool
    monitor: dict[str, Any] | None
    prompt_tokens: int
    finish_reason: str
    waited: float
    seconds: float
    logprobs: list[float] | None = None
    """Per token of ``answer.token_ids``, the log p its decode computed, when the request asked for
    them and the decode that gave the answer recorded them (a recompute gate's spliced answer: None)."""


class Service:
    """The scheduler, the monitor and the shadows around a :class:`CertifiedRuntime`.

    Parameters
    ----------
    runtime : CertifiedRuntime
    monitor : RiskMonitor or None (no monitor, ``--shadow-rate 0``: no stream, nothing recorded)
    shadow_runner : ShadowRunner or None (no shadows: nothing is ever shadowed)
    store : ShadowStore or None (closed at shutdown)
    metrics : Metrics
    max_queue : int
        Live requests that may wait for admission; one more is refused (:class:`QueueFull`).
    kv_budget : int or None
        KV budget in token slots (``--kv-budget``); None: unlimited.
    prompt_lookup : bool
        ``--prompt-lookup``: whether the batched decode verifies prompt-lookup proposals
        (:class:`~certkv.serve.scheduler.Scheduler`).
    before_step : callable or None
        The scheduler's observer of its batched decode steps (:class:`~certkv.serve.scheduler.Scheduler`).
    """

    def __init__(self, runtime: CertifiedRuntime, monitor: RiskMonitor | None, shadow_runner: ShadowRunner | None,
                 store: ShadowStore | None, metrics: Metrics, *, max_queue: int = 64,
                 kv_budget: int | None = None, prompt_lookup: bool = True,
                 before_step: Callable[[], None] | None = None) -> None:
        self.runtime = runtime
        self.monitor = monitor
        self.shadow_runner = shadow_runner
        self.store = store
        self.metrics = metrics
        self.max_queue = max_queue
        self.scheduler = Scheduler(runtime.model, kv_budget, prompt_lookup=prompt_lookup,
                                   prefix_cache=runtime.prefix_cache, before_step=before_step)
        self.stratified = runtime.operating_point.is_stratified
        self._ids = itertools.count(1)
        self._tripped_logged: set[str] = set()
        self.abandoned = 0
        self.shadows_done = 0
        self._answered = 0
        self._first_answer: float | None = None

    # -- the caller's side --------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler's worker."""
        self.scheduler.start()

    @property
    def kv_budget(self) -> int | None:
        return self.scheduler.budget

    @property
    def kv_slot_bytes(self) -> int:
        """Bytes one token slot of the budget takes (the model's dtype; :mod:`certkv.serve.kv_budget`)."""
        return bytes_per_slot(self.scheduler.model)

    def stream_of(self, stratum: str | None) -> str | None:
        """The monitor stream of a request: "all" for a pooled point, its stratum for a stratified one
        (None: a stratum the point does not know, answered from the full cache and not monitored; or
        no monitor at all)."""
        if self.monitor is None:
            return None
        if not self.stratified:
            return self.monitor.streams[0]
        return stratum if stratum in self.monitor.streams else None

    def submit(
        self, context: str, question: str, stratum: str | None, answers: list[str] | None, answer_prefix: str = "",
        *, logprobs: bool = False, on_tokens: TokenListener | None = None,
    ) -> Future[Served]:
        """Queue a live request; raises QueueFull (``max_queue`` wait already) or Stopping. The
        future fails with BudgetExceeded when the request alone needs more than the budget.
        `logprobs`: the answer's token log-probabilities are recorded (:attr:`Served.logprobs`).
        `on_tokens` hears the answer's tokens as they are decoded, on the scheduler's thread
        (:mod:`certkv.serve.scheduler`; a streamed request's hand-off to the event loop)."""
        rid = f"req-{next(self._ids)}"
        steps = self._live_steps(rid, context, question, stratum, answers, answer_prefix, time.perf_counter(),
                                 logprobs)
        return self.scheduler.submit(steps, max_waiting=self.max_queue, on_tokens=on_tokens)

    @property
    def stopping(self) -> bool:
        """True once :meth:`shutdown` began: no new request is accepted."""
        return self.scheduler.stopping

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved by one request, from the throughput so far."""
        if not self._answered or self._first_answer is None:
            return 1
        rate = self._answered / max(time.perf_counter() - self._first_answer, 1e-3)
        return max(1, math.ceil((self.scheduler.waiting_live() + 1) / rate))

    def queue_depth(self) -> int:
        return self.scheduler.waiting_live()

    def shadow_depth(self) -> int:
        return self.scheduler.waiting_shadows()

    def monitor_snapshot(self) -> dict[str, dict[str, Any]]:
        """Per monitor stream, its state (:meth:`RiskMonitor.snapshot`); empty without a monitor."""
        return {} if self.monitor is None else self.monitor.snapshot()

    # -- a live request, as steps -------------------------------------------------------------

    def _live_steps(self, rid: str, context: str, question: str, stratum: str | None, answers: list[str] | None,
                    answer_prefix: str, submitted: float, logprobs: bool = False) -> Generator[Step, None, Served]:
        stream, monitor = self.stream_of(stratum), self.monitor
        forced = None
        if stream is not None and monitor is not None and monitor.tripped(stream):
            s = monitor.snapshot()[stream]
            forced = ("monitor", f"the live monitor tripped on stream {stream!r} after {s['tripped_after']} requests; "
                                 "answering from the full cache until restart")
        steps = self.runtime.answer_steps(context, question, stratum, answer_prefix=answer_prefix, forced=forced,
                                          lean=True)
        admitted: list[float] = []
        decodes: list[Decode] = []
        answer = yield from _noting(steps, admitted, decodes, logprobs)
        decision = answer.decision
        evicted = decision.mode == "evicted"
        shadowed = False
        if stream is not None and monitor is not None:
            shadowed = evicted and self.shadow_runner is not None and monitor.draw_shadow()
            ticket = monitor.record(stream, evicted=evicted, shadowed=shadowed)
            if shadowed:
                from certkv.serve.shadow import ShadowJob

                self._submit_shadow(ShadowJob(request_id=rid, stream=stream, stratum=stratum, context=context,
                                              question=question, answers=answers, served=answer, ticket=ticket,
                                              answer_prefix=answer_prefix))
        rt = self.runtime  # every stratum's runtime shares its model (stop tokens) and decode length
        ids = answer.token_ids
        finish = finish_reason(ids, rt.max_new_tokens, rt.stop_ids)
        state = None if stream is None or monitor is None else monitor.snapshot()[stream]
        now = time.perf_counter()
        self._answered += 1
        if self._first_answer is None:
            self._first_answer = submitted
        started = admitted[0] if admitted else submitted
        return Served(rid, answer, stream, shadowed, state, answer.context_tokens + answer.question_tokens,
                      finish, started - submitted, now - submitted, _answer_logprobs(decodes, ids) if logprobs else None)

    # -- shadows ------------------------------------------------------------------------------

    def _submit_shadow(self, job: ShadowJob) -> None:
        self.scheduler.submit(self._shadow_steps(job), shadow=True, restart=lambda: self._shadow_steps(job),
                              on_abandon=lambda: self._abandon(job))

    def _shadow_steps(self, job: ShadowJob) -> Generator[Step, None, None]:
        runner = self.shadow_runner
        assert runner is not None  # only a service with a runner shadows
        try:
            full = (yield from runner.full_answer_steps(job)) if runner.needs_full_answer(job) else None
            runner.run(job, full)
            self.shadows_done += 1
            self.metrics.shadow_samples.labels(job.stream).inc()
        except Exception as exc:  # noqa: BLE001 - a failed shadow never stops the others
            log.error("certkv serve: shadow of %s could not be scored (%s); counted as abandoned", job.request_id,
                      " ".join(str(exc).split()) or type(exc).__name__)
            self._abandon(job)
        self._check_trip(job.stream)

    def _abandon(self, job: ShadowJob) -> None:
        assert self.monitor is not None  # a shadow job exists only under a monitor
        try:
            self.monitor.abandon(job.ticket)
        except CertkvError:
            pass  # the runner abandoned it already
        self.abandoned += 1
        self.metrics.shadow_abandoned.labels(job.stream).inc()

    def _check_trip(self, stream: str) -> None:
        assert self.monitor is not None  # only shadows, which need a monitor, check it
        log_first_trip(self.monitor, stream, self._tripped_logged, log, "certkv serve", "full cache")

    # -- shutdown -----------------------------------------------------------------------------

    def shutdown(self, drain_seconds: float = 30.0) -> None:
        """Stop accepting, finish the live requests, then shadows until `drain_seconds` (the rest
        abandoned and counted), then close the shadow store."""
        self.scheduler.shutdown(drain_seconds)
        if self.store is not None:
            self.store.close()
        log.info("certkv serve: stopped (%d shadows scored, %d abandoned)", self.shadows_done, self.abandoned)


def _noting(steps: Generator[Step, None, RuntimeAnswer], admitted: list[float], decodes: list[Decode],
            logprobs: bool) -> Generator[Step, None, RuntimeAnswer]:
    """Run `steps` unchanged but for what they note: the time its first step (the reservation of its
    prefill) was granted goes to `admitted` (the end of the request's queueing), each
    :class:`Decode` it yields to `decodes`; with `logprobs`, each decode asks its decoder for the
    chosen tokens' log-probabilities (the greedy choices are the same)."""
    step = next(steps)
    while True:
        if isinstance(step, Decode):
            step.want_logprobs = step.want_logprobs or logprobs
            decodes.append(step)
        reply = yield step
        if not admitted:
            admitted.append(time.perf_counter())
        try:
            step = steps.send(reply)
        except StopIteration as stop:
            return stop.value


def _answer_logprobs(decodes: list[Decode], ids: list[int]) -> list[float] | None:
    """The log-probabilities of the decode that gave the answer `ids` (the last whose tokens are
    the answer's), or None when none recorded them (a recompute gate splices its answer)."""
    for step in reversed(decodes):
        if step.ids == ids and step.logprobs is not None and len(step.logprobs) == len(ids):
            return list(step.logprobs)
    return None
