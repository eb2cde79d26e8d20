"""Shadow jobs: score a served answer against the full cache's, for the live risk monitor.

``certkv serve`` draws the monitor's coin for every evicted answer (:meth:`RiskMonitor.draw_shadow`);
a shadowed request becomes a :class:`ShadowJob`, which the service's one worker runs when no live
request waits. :meth:`ShadowRunner.run`:

1. answers the request from the full cache, exactly as calibration decodes it
   (:meth:`CertifiedRuntime.answer_from_full_cache`, reason ``shadow``: the runtime's own
   encoding and full-cache decode at the calibrated length); a served answer that already came
   from the full cache is that answer (no second forward);
2. scores ``loss = utility(full) − utility(served)`` with the contract's utility
   (``op.contract.utility``, the stratum's for a stratified point) when the request carries
   reference answers or when it needs none (a label-free utility such as ``prefix_agreement``),
   else with ``agreement`` (the served answer against the full answer: what a label-free
   deployment can check); the loss is the one calibration would record for that request and policy;
3. gives the monitor the verdict ``loss > τ`` under calibration's own rule
   (:func:`certkv.core.binomial.violation_mask`, slack :data:`~certkv.core.binomial.VIOLATION_EPS`);
4. writes the record pair to the :class:`~certkv.serve.shadow_store.ShadowStore` (its docstring
   states the record rule).

The monitor is told before the store is written: the verdict is what keeps the deployment safe,
the store is the audit trail. Any failure before the verdict (a model error, an unscorable
request) abandons the ticket (:meth:`RiskMonitor.abandon`, which counts it conservatively); a
failure writing the store after the verdict leaves the verdict in place. Either way the error is
logged and re-raised as a one-line :class:`~certkv.errors.CertkvError` (the original chained), so the
worker that ran the job records it and goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from certkv.core.binomial import VIOLATION_EPS, violation_mask
from certkv.core.policy_names import REFERENCE_POLICY
from certkv.core.signals import SIGNALS as DECLARED
from certkv.errors import CertkvError

if TYPE_CHECKING:
    from collections.abc import Generator

    from certkv.core.monitor import RiskMonitor
    from certkv.core.operating_point import OperatingPoint
    from certkv.runtime.certified_runtime import CertifiedRuntime, RuntimeAnswer
    from certkv.runtime.decision import Decision
    from certkv.runtime.steps import Step
    from certkv.serve.shadow_store import ShadowStore

log = logging.getLogger("certkv.serve.shadow")

#: The utility of a request without reference answers: the served answer against the full one.
AGREEMENT = "agreement"
#: Decision signals copied onto the deployed policy's record: the candidate signals of
#: :mod:`certkv.core.signals` (the request signals go on both records, or the full record, as calibration).
SIGNALS = tuple(s.name for s in DECLARED if s.per == "candidate")

__all__ = ["AGREEMENT", "SIGNALS", "VIOLATION_EPS", "ServedAnswer", "ShadowJob", "ShadowRunner", "shadow_loss",
           "shadow_records"]


class ServedAnswer(Protocol):
    """What a shadow reads of a served answer: the runtime's :class:`RuntimeAnswer`, or the answer
    ``certkv gateway`` got from an endpoint (:mod:`certkv.gateway`), which has no token ids."""

    answer: str
    decision: Decision
    seconds: dict[str, float]
    context_tokens: int


@dataclass
class ShadowJob:
    """One served request to shadow."""

    request_id: str
    stream: str
    """The monitor stream the ticket belongs to (the stratum, or ``"all"``)."""
    stratum: str | None
    context: str
    question: str
    answers: list[str] | None
    """Reference answers when the request carried them, else None (agreement utility)."""
    served: ServedAnswer
    """What the service answered: the (evicted) answer and its Decision."""
    ticket: int
    """The :class:`~certkv.core.monitor.RiskMonitor` ticket."""
    submitted: float = field(default_factory=time.monotonic)
    """When the job was queued (monotonic seconds), for the record's queueing delay."""
    answer_prefix: str = ""
    """The request's answer prefix (the full answer starts after it too)."""


class ShadowRunner:
    """Run shadow jobs: full answer, loss, the monitor's verdict and the store's record pair."""

    def __init__(self, runtime: CertifiedRuntime, monitor: RiskMonitor, store: ShadowStore | None) -> None:
        self.runtime = runtime
        self.monitor = monitor
        self.store = store

    def run(self, job: ShadowJob, full: RuntimeAnswer | None = None) -> dict[str, Any]:
        """Shadow `job`; returns its outcome (loss, verdict, both answers, the store records written).

        `full` is the request's full-cache answer when the caller computed it already (``certkv
        serve``'s scheduler, from :meth:`full_answer_steps`); by default it is computed here.

        Raises CertkvError (one line, the cause chained) after abandoning the ticket when the
        verdict could not be reached, or after completing it when only the store write failed.
        """
        completed = False
        try:
            outcome = self._score(job, full)
            self.monitor.complete(job.ticket, outcome["violated"])
            completed = True
            if self.store is not None:
                self.store.write(outcome["records"])
            return outcome
        except BaseException as exc:
            if not completed:
                try:
                    self.monitor.abandon(job.ticket)
                except Exception:  # an unknown ticket: nothing left to abandon
                    log.exception("shadow %s: could not abandon ticket %s", job.request_id, job.ticket)
            what = "store write" if completed else "abandoned"
            log.error("shadow %s (%s): %s: %s", job.request_id, what, type(exc).__name__, exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: the ticket is abandoned, the process stops
            if completed:
                raise CertkvError(f"shadow {job.request_id}: verdict recorded, store write failed: {exc}") from exc
            raise CertkvError(f"shadow {job.request_id} abandoned: {exc}") from exc

    # -- scoring ------------------------------------------------------------------------------

    def _entry(self, stratum: str | None) -> tuple[OperatingPoint, CertifiedRuntime]:
        """The operating point and runtime that served `stratum`."""
        op = self.runtime.operating_point
        if not op.is_stratified:
            return op, self.runtime
        entry = op.entry_for(stratum)
        if entry is None or stratum not in self.runtime.strata:
            raise CertkvError(f"stratum {stratum!r} is not one the operating point certified; it was "
                              "answered from the full cache, which is never shadowed")
        return entry, self.runtime.strata[stratum]

    def needs_full_answer(self, job: ShadowJob) -> bool:
        """Whether scoring `job` needs a full-cache answer of its own (a served full answer is its own)."""
        return job.served.decision.mode != "full"

    def full_answer_steps(self, job: ShadowJob) -> Generator[Step, None, RuntimeAnswer]:
        """The full-cache answer a shadow compares with, as steps (:mod:`certkv.runtime.steps`), run
        lean by ``certkv serve``'s scheduler: the runtime's own encoding and decode, reason ``shadow``."""
        _, runtime = self._entry(job.stratum)
        return (yield from runtime.answer_steps(job.context, job.question, job.stratum, answer_prefix=job.answer_prefix,
                                                forced=("shadow", None), lean=True))

    def _score(self, job: ShadowJob, full: RuntimeAnswer | None = None) -> dict[str, Any]:
        top = self.runtime.operating_point
        entry, runtime = self._entry(job.stratum)
        if entry.fallback:
            raise CertkvError(f"{entry.policy} falls back to the full cache: there is nothing to shadow")
        served = job.served
        decision = served.decision
        t0 = time.perf_counter()
        context_tokens = served.context_tokens
        if decision.mode == "full":
            full_answer, seconds = served.answer, {}
        else:
            if full is None:
                full = runtime.answer_from_full_cache(
                    job.context, job.question, job.stratum, reason="shadow", answer_prefix=job.answer_prefix
                )
            full_answer, seconds = full.answer, full.seconds
        utility_name, utility_full, utility, violated = shadow_loss(entry, job.answers, served.answer, full_answer)
        loss, tau = utility_full - utility, entry.contract.tolerance
        records = shadow_records(job, entry, full_answer=full_answer, utility_name=utility_name,
                           utility_full=utility_full, utility=utility, context_tokens=context_tokens,
                           seconds=seconds, strata_by=top.strata.by if top.strata is not None else None)
        return {
            "request_id": job.request_id, "stream": job.stream, "stratum": job.stratum,
            "policy": decision.policy, "base_policy": entry.base_policy, "utility_name": utility_name,
            "utility": utility, "utility_full": utility_full, "loss": loss, "tolerance": tau,
            "violated": violated, "answer": served.answer, "full_answer": full_answer,
            "mode": decision.mode, "reason": decision.reason, "ticket": job.ticket,
            "queued_seconds": max(0.0, time.monotonic() - job.submitted),
            "seconds": time.perf_counter() - t0, "records": records,
        }


def shadow_loss(entry: OperatingPoint, answers: list[str] | None, served: str, full: str) -> tuple[str, float, float, bool]:
    """(utility name, utility of `full`, utility of `served`, violated) of one shadow: the contract's
    utility (``entry.contract.utility``) when the request carried reference `answers` or the utility
    needs none, else ``agreement`` with `full`; violated is ``loss > τ`` under calibration's rule.
    ``certkv serve``'s shadows and ``certkv gateway``'s score with this one definition."""
    from certkv.calibration.utility import LABEL_FREE, score

    refs = [str(a) for a in answers] if answers else None
    utility_name = entry.contract.utility
    if utility_name is None or (refs is None and utility_name not in LABEL_FREE):
        utility_name = AGREEMENT  # a label-free utility (prefix_agreement, ...) needs no references
    utility_full = score(utility_name, full, refs or (), full)
    utility = score(utility_name, served, refs or (), full)
    return utility_name, utility_full, utility, bool(violation_mask([utility_full - utility], entry.contract.tolerance)[0])


def shadow_records(job: ShadowJob, entry: OperatingPoint, *, full_answer: str, utility_name: str, utility_full: float,
                   utility: float, context_tokens: int | None, seconds: dict, strata_by: str | None = None
                   ) -> list[dict[str, Any]]:
    """The record pair of one shadow (rule: :mod:`certkv.serve.shadow_store`): the ``full`` record
    and the base policy's record carrying the served answer, its memory and the Decision's signals.
    `entry` is the operating point that served it (its stratum's); `strata_by` the stratified
    point's ``strata.by`` (a key other than ``task`` adds a ``stratum`` column)."""
    d = job.served.decision
    evicted = d.mode != "full"
    common: dict[str, Any] = {
        "request_id": job.request_id,
        "task": job.stratum,
        "utility_full": utility_full,
        # a request signal with a store column is on every record, as calibration writes it
        **{s.name: getattr(d, s.name) for s in DECLARED if s.per == "request" and s.store == "column"},
        "utility_name": utility_name,
        "stream": job.stream,
    }
    if strata_by not in (None, "task"):
        common["stratum"] = job.stratum
    full_record = {
        **common,
        "policy": REFERENCE_POLICY,
        "press": REFERENCE_POLICY,
        "kv_retained": 1.0,
        "kv_retained_actual": 1.0,
        "memory": 1.0,
        "utility": utility_full,
        "loss": 0.0,
        "answer": full_answer,
        "seconds": seconds.get("prefill", 0.0) + seconds.get("decode", 0.0) if seconds else None,
        "context_tokens": context_tokens,
    }
    served_record = {
        **common,
        "policy": entry.base_policy,
        "press": entry.press,
        "kv_retained": entry.kv_retained,
        "kv_retained_actual": d.kv_retained_actual if evicted else 1.0,
        "memory": d.kv_retained if evicted else 1.0,
        "utility": utility,
        "loss": utility_full - utility,
        "answer": job.served.answer,
        "seconds": job.served.seconds.get("total"),
        "deployed_policy": d.policy,
        "mode": d.mode,
        "reason": d.reason,
        "gate_kind": d.gate_kind,
        "escalated": d.escalated,
    }
    for name in SIGNALS:
        value = getattr(d, name)
        if value is not None:
            served_record[name] = value
    return [full_record, served_record]
