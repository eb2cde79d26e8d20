"""Where each request of ``certkv gateway`` goes, what the gate says, and the monitor and its shadows.

A request is planned before any call (:meth:`Gateway.plan`): the full endpoint answers it when the
point chose the full cache (reason ``fallback``), when it is outside the certificate's coverage
(``uncovered``: a stratum the point does not know, or a token limit above the calibrated decode
length, which the full endpoint then decodes), when its monitor stream tripped (``monitor``) or
when the candidate is down (``candidate_down``). Otherwise the certified candidate is asked for
the whole certified answer (the calibrated ``max_new_tokens``, greedy, log-probabilities unless the
contract's ``protocol.logprobs`` is false), as calibration asked it
(:func:`certkv.calibration.endpoints.upstream_body`). An answer to a prompt whose length (the
candidate's ``usage.prompt_tokens``) is outside the certified context range goes to the full
endpoint (``uncovered``); otherwise the gate decides on its log-probabilities with the runtime's
own rule (:func:`certkv.runtime.gating.post_decode_reason`), and a gate that fires escalates the
request to the full endpoint (``confidence`` or ``learned``, ``escalated``). A candidate that
fails or exceeds its timeout is marked down and the request answered from the full endpoint
(``candidate_down``, with the failure in ``detail``). A kept answer is cut at the request's token
limit and stop strings after the gate decided, as ``certkv serve`` cuts its certified answer
(:func:`certkv.serve.answer_cut.cut_answer`); one that came without its tokens (no
log-probabilities) is kept only when nothing needs cutting, else it is ``uncovered``.

Every answer of a monitored stream is recorded by the :class:`~certkv.core.monitor.RiskMonitor`;
a kept candidate answer is shadowed with the monitor's coin: the full endpoint answers it too
(after the client has its answer), the loss is scored as ``certkv serve`` scores it
(:func:`certkv.serve.shadow.shadow_loss`), the verdict goes to the monitor and the record pair to
the shadow store. Shadows yield to live requests, as ``certkv serve``'s one shadow worker does: at
most ``shadow_concurrency`` are in flight to the full endpoint and at most ``shadow_queue`` wait in
the gateway for a slot, so a burst of kept answers cannot fill the full endpoint's queue ahead of
the requests escalated to it (which would then get its 503). A shadow that finds the wait full, or
whose full answer fails, is abandoned (counted conservatively). The gateway is one process
(asyncio; its work is forwarding), so one monitor sees every request and ``--replicas`` has
nothing to share: scale the upstreams instead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from certkv.calibration.endpoints import upstream_body
from certkv.gateway.upstream import Upstream, UpstreamAnswer, UpstreamDown
from certkv.runtime.decision import Decision
from certkv.runtime.gating import post_decode_reason
from certkv.serve.answer_cut import Cut, cut_answer, first_stop
from certkv.serve.shadow import ShadowJob, shadow_loss, shadow_records
from certkv.serve.shared_monitor import log_first_trip

if TYPE_CHECKING:
    from collections.abc import Mapping

    from certkv.core.monitor import RiskMonitor
    from certkv.core.operating_point import OperatingPoint
    from certkv.serve.metrics import AnswerMetrics
    from certkv.serve.shadow_store import ShadowStore

log = logging.getLogger("certkv.gateway")


class FullDown(Exception):
    """A request that needs the full endpoint could not get its answer; the message is one line."""


@dataclass
class Ask:
    """One live request, split: its texts, stratum, token limit, stop strings, whether it wants
    log-probabilities, and its reference answers (read by a shadow only)."""

    context: str
    question: str
    answer_prefix: str
    stratum: str | None
    limit: int | None
    stops: list[str]
    logprobs: bool
    answers: list[str] | None = None


@dataclass
class Plan:
    """Where a request goes first: its stratum's point (None: not certified), its monitor stream,
    and the reason the full endpoint answers it (None: the candidate is asked)."""

    entry: OperatingPoint | None
    stream: str | None
    reason: str | None
    detail: str | None = None


@dataclass
class Served:
    """An answered request: the decision, the upstream's answer, how it was cut, the token texts
    (None: none returned), and the monitor's view (its stream, whether shadowed, the state)."""

    request_id: str
    decision: Decision
    answer: UpstreamAnswer
    cut: Cut
    texts: list[str] | None
    stream: str | None = None
    shadowed: bool = False
    monitor: dict[str, Any] | None = None
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class _ShadowedAnswer:
    """A kept answer as a shadow reads it (:class:`certkv.serve.shadow.ServedAnswer`)."""

    answer: str
    decision: Decision
    seconds: dict[str, float]
    context_tokens: int = 0


class Gateway:
    """The decisions of ``certkv gateway`` for operating point `op` (module docstring): the full
    endpoint, the candidates by base policy, the contract's `route`, the monitor (None: off), the
    shadow store (None: nothing shadowed) and whether upstreams are asked for log-probabilities
    (the contract's ``protocol.logprobs``); shadows in flight at once and waiting (module docstring)."""

    def __init__(self, op: OperatingPoint, full: Upstream, candidates: dict[str, Upstream], route: str,
                 monitor: RiskMonitor | None, store: ShadowStore | None, metrics: AnswerMetrics,
                 logprobs: bool = True, *, shadow_concurrency: int = 2, shadow_queue: int = 1024) -> None:
        self.op, self.full, self.candidates, self.route, self.logprobs = op, full, candidates, route, logprobs
        self.monitor, self.store, self.metrics = monitor, store, metrics
        self.path = "/chat/completions" if route == "chat" else "/completions"
        self.certified_tokens = int(op.max_new_tokens or (op.coverage.max_new_tokens if op.coverage else 0) or 0)
        self._ids = itertools.count(1)
        self._shadows: set[asyncio.Task[None]] = set()
        self._shadow_slots = asyncio.Semaphore(shadow_concurrency)
        # in flight and waiting; a shadow past its full answer, writing its records, still counts
        self.shadow_limit = shadow_concurrency + shadow_queue
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="certkv-shadow-store")
        self._tripped_logged: set[str] = set()
        self.shadows_done = self.abandoned = 0

    # -- planning ---------------------------------------------------------------------------

    def stream_of(self, stratum: str | None) -> str | None:
        """The monitor stream of a request, as ``certkv serve`` names it (None: not monitored)."""
        if self.monitor is None:
            return None
        if not self.op.is_stratified:
            return self.monitor.streams[0]
        return stratum if stratum in self.monitor.streams else None

    def plan(self, stratum: str | None, limit: int | None) -> Plan:
        """Where a request with `stratum` and token `limit` goes first (module docstring)."""
        entry, stream = self.op.entry_for(stratum), self.stream_of(stratum)
        coverage = self.op.coverage
        # context lengths cannot be counted before the candidate answers (the gateway has no tokenizer):
        # its usage.prompt_tokens is checked after (outside_context); here, the strata only
        why = None if coverage is None else coverage.uncovered_stratum(stratum)
        if entry is None or why is not None:
            return Plan(entry, stream, "uncovered", why or f"stratum {stratum!r} is not one the operating point certified")
        if limit is not None and limit > self.certified_tokens:
            return Plan(entry, stream, "uncovered", f"max_tokens {limit} is above the {self.certified_tokens} tokens the "
                        "point was certified for: the full endpoint decodes it")
        if entry.fallback:
            return Plan(entry, stream, "fallback", entry.reason)
        if stream is not None and self.monitor is not None and self.monitor.tripped(stream):
            return Plan(entry, stream, "monitor", f"the live monitor tripped on stream {stream!r}; answering from the "
                        "full endpoint until restart")
        candidate = self.candidates[entry.base_policy]
        if not candidate.usable():
            return Plan(entry, stream, "candidate_down", f"candidate {candidate.url}: {candidate.error}")
        return Plan(entry, stream, None)

    def decision(self, plan: Plan, stratum: str | None) -> Decision:
        """The record of a request planned as `plan` (full until the candidate's answer is kept)."""
        entry = plan.entry or self.op
        gate = entry.gate
        return Decision(mode="full", reason=plan.reason, policy=entry.policy, stratum=stratum,
                        gate_kind=None if gate is None else gate.kind,
                        gate_threshold=None if gate is None else (
                            gate.confidence if gate.confidence is not None else gate.learned_threshold),
                        detail=plan.detail)

    def body(self, upstream: Upstream, ask: Ask, max_tokens: int, logprobs: bool = True) -> dict:
        """What `upstream` is sent for `ask` (calibration's body, :func:`upstream_body`); log-probabilities
        asked for when `logprobs` and the contract's ``protocol.logprobs`` both allow them."""
        return upstream_body(ask.context, ask.question, ask.answer_prefix, self.route, upstream.name, max_tokens,
                             bool(upstream.certkv), self.logprobs and logprobs)

    def full_body(self, ask: Ask) -> dict:
        """The full endpoint's body: the request's own limit (else the certified length) and stop
        strings, log-probabilities only when asked (it is not gated, so nothing else needs them)."""
        body = self.body(self.full, ask, ask.limit or self.certified_tokens, logprobs=ask.logprobs)
        if ask.stops:
            body["stop"] = ask.stops
        return body

    # -- answering --------------------------------------------------------------------------

    async def from_candidate(self, plan: Plan, ask: Ask, decision: Decision) -> UpstreamAnswer | None:
        """The candidate's whole certified answer when the gate keeps it (`decision` then says
        ``evicted``), else None with `decision`'s reason set (the gate fired, or the candidate failed)."""
        assert plan.entry is not None  # only a certified stratum's request reaches its candidate
        candidate, entry = self.candidates[plan.entry.base_policy], plan.entry
        try:
            await candidate.identify()
            got = await candidate.complete(self.path, self.body(candidate, ask, self.certified_tokens))
        except UpstreamDown as exc:
            decision.reason, decision.detail = "candidate_down", f"candidate {exc}"
            return None
        signals: dict[str, Any] = {}
        reason = None
        if (outside := self.outside_context(entry, got.prompt_tokens)) is not None:
            reason, decision.detail = "uncovered", outside  # before the gate: outside the certificate, it has no say
        elif entry.gate is not None:
            reason = post_decode_reason(entry.gate, signals, got.logprobs)
        decision.confidence_min, decision.logprob_mean = signals.get("confidence_min"), signals.get("logprob_mean")
        decision.learned_score = signals.get("learned_score")
        if reason is None and got.token_texts is None and not self.whole_without_tokens(got, ask):
            reason, decision.detail = "uncovered", ("the candidate returned no tokens to cut its answer at max_tokens "
                                                    "or a stop string")
        if reason is not None:
            decision.reason, decision.escalated = reason, reason != "uncovered"
            return None
        decision.mode, decision.reason = "evicted", None
        decision.kv_retained = decision.kv_retained_actual = entry.kv_retained
        return got

    @staticmethod
    def whole_without_tokens(got: UpstreamAnswer, ask: Ask) -> bool:
        """Whether an answer that came without its tokens (no log-probabilities asked for, or none
        given) is returned whole: it is no longer than the request's ``max_tokens`` (as the
        candidate's usage counts it) and holds none of its stop strings, so nothing needs cutting."""
        short = ask.limit is None or 0 < got.completion_tokens <= ask.limit
        return short and first_stop(got.text, ask.stops) is None

    def cut(self, got: UpstreamAnswer, ask: Ask) -> Cut:
        """The kept candidate answer `got` cut at `ask`'s token limit and stop strings (whole when it
        came without its tokens: :meth:`whole_without_tokens` kept it)."""
        if got.token_texts is None:
            return Cut(got.text, got.completion_tokens, got.finish_reason)
        return cut_answer(got.text, got.token_texts, got.finish_reason, limit=ask.limit, stops=ask.stops)

    def outside_context(self, entry: OperatingPoint, prompt_tokens: int) -> str | None:
        """Why a prompt of `prompt_tokens` (the candidate's count, 0: it gave none) is outside the
        context range `entry` (the point, or its stratum's entry) was certified on, or None. An
        endpoint point's range is the prompts' lengths as the full endpoint counted them in
        calibration, and the gateway can count none before asking: the candidate's ``usage`` tells
        it after, and an answer to a longer or shorter prompt than any calibrated one is escalated
        as uncovered. Both servers must count alike (the same model and tokenizer)."""
        coverage = entry.coverage or self.op.coverage  # the stratum itself was checked before asking (plan)
        return None if coverage is None or prompt_tokens <= 0 else coverage.uncovered_context(prompt_tokens)

    async def from_full(self, ask: Ask, decision: Decision) -> UpstreamAnswer:
        """The full endpoint's answer; :class:`FullDown` (one line, with the reason it was needed) when it fails."""
        try:
            await self.full.identify()
            return await self.full.complete(self.path, self.full_body(ask))
        except UpstreamDown as exc:
            raise FullDown(self.full_down(exc, decision)) from None

    @staticmethod
    def full_down(exc: Exception, decision: Decision) -> str:
        """The one-line 503 message of a request that needed the full endpoint and could not get it."""
        why = decision.reason + (f" ({decision.detail})" if decision.detail else "") if decision.reason else "it"
        return f"the full endpoint is unavailable: {exc}; this request needs it: {why}"

    async def answer(self, ask: Ask) -> Served:
        """Answer `ask` whole (module docstring); raises :class:`FullDown` or
        :class:`~certkv.gateway.upstream.UpstreamRefused`."""
        t0 = time.perf_counter()
        plan = self.plan(ask.stratum, ask.limit)
        decision = self.decision(plan, ask.stratum)
        got = await self.from_candidate(plan, ask, decision) if plan.reason is None else None
        if got is not None:
            cut = self.cut(got, ask)
        else:
            got = await self.from_full(ask, decision)
            cut = Cut(got.text, got.completion_tokens, got.finish_reason)
        return self.settle(ask, plan, decision, got, cut, time.perf_counter() - t0)

    def settle(self, ask: Ask, plan: Plan, decision: Decision, got: UpstreamAnswer, cut: Cut, seconds: float) -> Served:
        """Record an answered request with the monitor (and draw its shadow coin), count it, and
        return it: what every answer, whole or streamed, goes through once it is known."""
        served = Served(f"gw-{next(self._ids)}", decision, got, cut, got.token_texts, plan.stream,
                        seconds={"total": seconds})
        monitor, stream = self.monitor, plan.stream
        if stream is not None and monitor is not None:
            evicted = decision.mode == "evicted"
            served.shadowed = evicted and self.store is not None and monitor.draw_shadow()
            ticket = monitor.record(stream, evicted=evicted, shadowed=served.shadowed)
            if served.shadowed:
                assert plan.entry is not None  # a kept answer has its stratum's point
                self._spawn(ShadowJob(request_id=served.request_id, stream=stream, stratum=ask.stratum,
                                      context=ask.context, question=ask.question, answers=ask.answers,
                                      served=_ShadowedAnswer(got.text, decision, {"total": got.seconds}),
                                      ticket=ticket, answer_prefix=ask.answer_prefix), plan.entry, ask)
            served.monitor = monitor.snapshot()[stream]
        return served

    # -- shadows ----------------------------------------------------------------------------

    def _spawn(self, job: ShadowJob, entry: OperatingPoint, ask: Ask) -> None:
        if len(self._shadows) >= self.shadow_limit:
            self._abandon(job, f"{len(self._shadows)} shadows are in flight or waiting already")
            return
        task = asyncio.get_running_loop().create_task(self._shadow(job, entry, ask))
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _shadow(self, job: ShadowJob, entry: OperatingPoint, ask: Ask) -> None:
        """Score `job` against the full endpoint's certified-length answer; the verdict to the
        monitor, then the record pair to the store (module docstring)."""
        assert self.monitor is not None and self.store is not None  # only a monitored point with a store shadows
        try:
            async with self._shadow_slots:
                await self.full.identify()
                full = await self.full.complete(self.path, self.body(self.full, ask, self.certified_tokens))
            name, utility_full, utility, violated = shadow_loss(entry, job.answers, job.served.answer, full.text)
        except asyncio.CancelledError:  # shutdown's drain ran out: abandoned and counted, then cancelled
            self._abandon(job, "cancelled at shutdown")
            raise
        except Exception as exc:  # noqa: BLE001 - a failed shadow is abandoned, counted, and never stops the others
            self._abandon(job, str(exc))
            return
        self.monitor.complete(job.ticket, violated)
        self.shadows_done += 1
        self.metrics.shadow_samples.labels(job.stream).inc()
        self._check_trip(job.stream)
        records = shadow_records(job, entry, full_answer=full.text, utility_name=name, utility_full=utility_full,
                                 utility=utility, context_tokens=None, seconds={"decode": full.seconds},
                                 strata_by=self.op.strata.by if self.op.strata is not None else None)
        try:
            await asyncio.get_running_loop().run_in_executor(self._writer, self.store.write, list[Mapping[str, Any]](records))
        except Exception as exc:  # noqa: BLE001 - the verdict stands; the store is the audit trail
            log.error("certkv gateway: shadow %s not written to the store (%s); its verdict stands", job.request_id, exc)

    def _abandon(self, job: ShadowJob, why: str) -> None:
        """Count `job` as abandoned: the monitor takes it as a violation (conservative)."""
        assert self.monitor is not None  # only shadows, which need a monitor, are abandoned
        self.monitor.abandon(job.ticket)
        self.abandoned += 1
        self.metrics.shadow_abandoned.labels(job.stream).inc()
        log.error("certkv gateway: shadow of %s abandoned (%s)", job.request_id, " ".join(why.split()))
        self._check_trip(job.stream)

    def _check_trip(self, stream: str) -> None:
        assert self.monitor is not None  # only shadows, which need a monitor, check it
        log_first_trip(self.monitor, stream, self._tripped_logged, log, "certkv gateway", "full endpoint")

    async def close(self, drain_seconds: float) -> None:
        """Wait up to `drain_seconds` for the shadows in flight (the rest are cancelled and
        abandoned), then close the upstreams' connections and the shadow store."""
        pending = set(self._shadows)
        if pending:
            _, late = await asyncio.wait(pending, timeout=drain_seconds)
            for task in late:
                task.cancel()
            if late:
                log.warning("certkv gateway: %d shadows abandoned at shutdown", len(late))
        for upstream in {self.full, *self.candidates.values()}:
            await upstream.close()
        self._writer.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
