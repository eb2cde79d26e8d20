"""One model replica behind a bounded queue, served by ONE worker thread.

The worker runs live requests first and shadow jobs (the live monitor's full-cache re-answers) when
no live request waits, so the model never runs two forwards at once. A live request: its stream's
monitor tripped → answered from the full cache (reason ``monitor``); else the runtime answers and,
for an evicted answer only, the seeded shadow coin (:meth:`RiskMonitor.draw_shadow`) is drawn
after the gate's decision; the request is recorded and, when shadowed, its shadow job queued
behind live traffic. The caller gets its answer before its shadow runs. Shadow jobs are never
dropped while the service runs; :meth:`Service.shutdown` finishes the queued live requests, then
the shadows until a deadline (the rest are abandoned and counted), and closes the shadow store.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from certkv.errors import CertkvError

if TYPE_CHECKING:
    from certkv.core.monitor import RiskMonitor
    from certkv.runtime.certified_runtime import CertifiedRuntime, RuntimeAnswer
    from certkv.serve.metrics import Metrics
    from certkv.serve.shadow import ShadowJob, ShadowRunner
    from certkv.serve.shadow_store import ShadowStore

log = logging.getLogger("certkv.serve")


class QueueFull(Exception):
    """The live queue holds --max-queue requests already."""


class Stopping(Exception):
    """The service is shutting down and accepts no new request."""


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


@dataclass
class _Live:
    request_id: str
    context: str
    question: str
    stratum: str | None
    answers: list[str] | None
    future: Future[Served]
    answer_prefix: str = ""
    submitted: float = field(default_factory=time.perf_counter)


class Service:
    """The queue, the worker and the monitor around a :class:`CertifiedRuntime`.

    Parameters
    ----------
    runtime : CertifiedRuntime
    monitor : RiskMonitor
    shadow_runner : ShadowRunner or None (no shadows: nothing is ever shadowed)
    store : ShadowStore or None (closed at shutdown)
    metrics : Metrics
    max_queue : int
        Live requests that may wait for the worker; one more is refused (:class:`QueueFull`).
    """

    def __init__(self, runtime: CertifiedRuntime, monitor: RiskMonitor, shadow_runner: ShadowRunner | None,
                 store: ShadowStore | None, metrics: Metrics, *, max_queue: int = 64) -> None:
        self.runtime = runtime
        self.monitor = monitor
        self.shadow_runner = shadow_runner
        self.store = store
        self.metrics = metrics
        self.max_queue = max_queue
        op = runtime.operating_point
        self.stratified = op.is_stratified
        self._live: collections.deque[_Live] = collections.deque()
        self._shadows: collections.deque[ShadowJob] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._drain_deadline: float | None = None
        self._ids = itertools.count(1)
        self._tripped_logged: set[str] = set()
        self.abandoned = 0
        self.shadows_done = 0
        self._service_time = 0.0
        self._served = 0
        self._worker = threading.Thread(target=self._loop, name="certkv-worker", daemon=True)

    # -- the caller's side --------------------------------------------------------------------

    def start(self) -> None:
        self._worker.start()

    def stream_of(self, stratum: str | None) -> str | None:
        """The monitor stream of a request: "all" for a pooled point, its stratum for a stratified one
        (None: a stratum the point does not know, answered from the full cache and not monitored)."""
        if not self.stratified:
            return self.monitor.streams[0]
        return stratum if stratum in self.monitor.streams else None

    def submit(
        self, context: str, question: str, stratum: str | None, answers: list[str] | None, answer_prefix: str = ""
    ) -> Future[Served]:
        rid = f"req-{next(self._ids)}"
        job = _Live(rid, context, question, stratum, answers, Future(), answer_prefix=answer_prefix)
        with self._cv:
            if self._stopping:
                raise Stopping()
            if len(self._live) >= self.max_queue:
                raise QueueFull()
            self._live.append(job)
            self._cv.notify()
        return job.future

    @property
    def stopping(self) -> bool:
        """True once :meth:`shutdown` began: no new request is accepted."""
        return self._stopping

    def retry_after(self) -> int:
        mean = self._service_time / self._served if self._served else 1.0
        return max(1, int(mean * (len(self._live) + 1) + 0.999))

    def queue_depth(self) -> int:
        return len(self._live)

    def shadow_depth(self) -> int:
        return len(self._shadows)

    def tripped_streams(self) -> list[str]:
        return [s for s, v in self.monitor.snapshot().items() if v["tripped"]]

    # -- the worker ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._live and not self._shadows and not self._stopping:
                    self._cv.wait()
                item: _Live | ShadowJob
                if self._live:
                    item = self._live.popleft()
                elif self._shadows:
                    if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                        self._abandon_rest()
                        return
                    item = self._shadows.popleft()
                else:
                    return  # stopping, nothing left
            if isinstance(item, _Live):
                self._run_live(item)
            else:
                self._run_shadow(item)

    def _run_live(self, job: _Live) -> None:
        if not job.future.set_running_or_notify_cancel():
            return  # timed out while queued
        started = time.perf_counter()
        try:
            job.future.set_result(self._answer(job, started))
        except BaseException as exc:  # noqa: BLE001 - one request's failure is that request's only
            job.future.set_exception(exc)
        finally:
            self._service_time += time.perf_counter() - started
            self._served += 1

    def _answer(self, job: _Live, started: float) -> Served:
        stream = self.stream_of(job.stratum)
        if stream is not None and self.monitor.tripped(stream):
            s = self.monitor.snapshot()[stream]
            answer = self.runtime.answer_from_full_cache(
                job.context, job.question, job.stratum, reason="monitor",
                detail=f"the live monitor tripped on stream {stream!r} after {s['tripped_after']} requests; "
                       "answering from the full cache until restart", answer_prefix=job.answer_prefix)
        else:
            answer = self.runtime.generate(job.context, job.question, job.stratum, answer_prefix=job.answer_prefix)
        decision: Any = answer.decision  # a Decision: built with make_dataclass, no fields a type checker sees
        evicted = decision.mode == "evicted"
        shadowed = False
        if stream is not None:
            shadowed = evicted and self.shadow_runner is not None and self.monitor.draw_shadow()
            ticket = self.monitor.record(stream, evicted=evicted, shadowed=shadowed)
            if shadowed:
                from certkv.serve.shadow import ShadowJob

                with self._cv:
                    self._shadows.append(ShadowJob(request_id=job.request_id, stream=stream, stratum=job.stratum,
                                                   context=job.context, question=job.question, answers=job.answers,
                                                   served=answer, ticket=ticket, answer_prefix=job.answer_prefix))
        rt = self.runtime  # every stratum's runtime shares its model (stop tokens) and decode length
        ids = answer.token_ids
        finish = "length" if len(ids) >= rt.max_new_tokens and not (ids and ids[-1] in rt.stop_ids) else "stop"
        monitor = None if stream is None else self.monitor.snapshot()[stream]
        now = time.perf_counter()
        return Served(job.request_id, answer, stream, shadowed, monitor, answer.context_tokens + answer.question_tokens,
                      finish, started - job.submitted, now - job.submitted)

    def _run_shadow(self, job: ShadowJob) -> None:
        try:
            assert self.shadow_runner is not None  # only a service with a runner queues shadows
            self.shadow_runner.run(job)
            self.shadows_done += 1
            self.metrics.shadow_samples.labels(job.stream).inc()
        except Exception as exc:  # noqa: BLE001 - a failed shadow never kills the worker
            log.error("certkv serve: shadow of %s could not be scored (%s); counted as abandoned", job.request_id,
                      " ".join(str(exc).split()) or type(exc).__name__)
            self._abandon(job)
        self._check_trip(job.stream)

    def _abandon(self, job: ShadowJob) -> None:
        try:
            self.monitor.abandon(job.ticket)
        except CertkvError:
            pass  # the runner abandoned it already
        self.abandoned += 1
        self.metrics.shadow_abandoned.labels(job.stream).inc()

    def _abandon_rest(self) -> None:
        left = list(self._shadows)
        self._shadows.clear()
        for job in left:
            self._abandon(job)
        if left:
            log.warning("certkv serve: shutdown deadline reached; %d pending shadow(s) abandoned", len(left))

    def _check_trip(self, stream: str) -> None:
        if stream in self._tripped_logged or not self.monitor.tripped(stream):
            return
        self._tripped_logged.add(stream)
        s = self.monitor.snapshot()[stream]
        log.warning("certkv serve: monitor TRIPPED on stream %r after %s requests (e-value %.3g >= 1/delta, "
                    "violation-rate bound %.3g > risk %.3g); its requests are answered from the full cache until "
                    "restart", stream, s["tripped_after"], s["e_value"], s["upper_bound"], self.monitor.risk)

    # -- shutdown -----------------------------------------------------------------------------

    def shutdown(self, drain_seconds: float = 30.0) -> None:
        """Stop accepting, finish queued live requests, then shadows until `drain_seconds` (the rest
        abandoned and counted), then close the shadow store."""
        with self._cv:
            self._stopping = True
            self._drain_deadline = time.monotonic() + drain_seconds
            self._cv.notify_all()
        if self._worker.is_alive():
            self._worker.join(drain_seconds + 600)
        with self._cv:
            if self._shadows:
                self._abandon_rest()
        if self.store is not None:
            self.store.close()
        log.info("certkv serve: stopped (%d shadows scored, %d abandoned)", self.shadows_done, self.abandoned)
