"""Prometheus metrics of `certkv serve`, on a registry of their own, every name prefixed ``certkv_``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from certkv.core.monitor import RiskMonitor
    from certkv.runtime.decision import Decision

GATE_REASONS = ("gate", "lookahead", "learned", "confidence", "certificate")


class Scraped(Protocol):
    """What a scrape reads of the service (:class:`certkv.serve.service.Service`)."""

    monitor: RiskMonitor | None

    def monitor_snapshot(self) -> dict[str, dict[str, Any]]: ...

    def queue_depth(self) -> int: ...

    def shadow_depth(self) -> int: ...

    @property
    def kv_budget(self) -> int | None: ...

    @property
    def kv_slot_bytes(self) -> int: ...

    @property
    def scheduler(self) -> Any: ...


class AnswerMetrics:
    """The metrics of any server that answers for an operating point, ``certkv serve`` or ``certkv
    gateway``: answers by decision reason, errors, latency, time to first token, shadows and the live
    monitor's gauges (refreshed at each scrape by :meth:`refresh_monitor`)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("certkv_requests", "Answered requests by route and decision reason "
                                "(evicted: the press answered)", ["route", "reason"], registry=r)
        self.errors = Counter("certkv_errors", "Requests refused or failed, by route and HTTP status",
                              ["route", "status"], registry=r)
        self.gate_fallbacks = Counter("certkv_gate_fallbacks", "Requests a gate sent to the full cache, by kind",
                                      ["kind"], registry=r)
        self.kv_retained = Histogram("certkv_kv_retained", "Realised KV retention of the cache that answered",
                                     buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0),
                                     registry=r)
        self.latency = Histogram("certkv_request_latency_seconds", "Request latency (queue wait + answer)",
                                 ["route"], registry=r)
        self.first_token = Histogram("certkv_time_to_first_token_seconds", "Streamed requests: time from arrival "
                                     "to the first chunk with text", ["route"], registry=r)
        self.queue_wait = Histogram("certkv_queue_wait_seconds", "Time a live request waited for the worker",
                                    registry=r)
        self.shadow_samples = Counter("certkv_shadow_samples", "Shadows run to completion", ["stream"], registry=r)
        self.shadow_abandoned = Counter("certkv_shadow_abandoned", "Shadows that could not be scored (failed "
                                        "or abandoned at shutdown)", ["stream"], registry=r)
        self.m_enabled = Gauge("certkv_monitor_enabled", "1 when a live monitor watches the deployed risk; 0 "
                               "under --shadow-rate 0 (no shadows: nothing watches it)", registry=r)
        labels = ["stream"]
        self.m_requests = Gauge("certkv_monitor_requests", "Requests recorded by the monitor", labels, registry=r)
        self.m_violations = Gauge("certkv_monitor_violations", "Observed shadow violations (loss > tau)", labels,
                                  registry=r)
        self.m_bound = Gauge("certkv_monitor_risk_upper_bound", "Anytime-valid upper bound of the deployed "
                             "violation rate", labels, registry=r)
        self.m_evalue = Gauge("certkv_monitor_e_value", "The monitor's test martingale", labels, registry=r)
        self.m_tripped = Gauge("certkv_monitor_tripped", "1 once the stream's monitor tripped (full cache "
                               "until restart)", labels, registry=r)

    def observe_answer(self, route: str, decision: Decision, seconds: float, waited: float) -> None:
        """Count one answered request; `decision` is its runtime Decision (reason, gate kind, retention)."""
        reason = decision.reason or "evicted"
        self.requests.labels(route, reason).inc()
        if reason in GATE_REASONS:
            self.gate_fallbacks.labels(decision.gate_kind or reason).inc()
        self.kv_retained.observe(decision.kv_retained_actual)
        self.latency.labels(route).observe(seconds)
        self.queue_wait.observe(waited)

    def refresh_monitor(self, monitor: RiskMonitor | None, snapshot: dict[str, dict[str, Any]]) -> None:
        """The monitor gauges from `snapshot` (:meth:`RiskMonitor.snapshot`; `monitor` None: off)."""
        self.m_enabled.set(0.0 if monitor is None else 1.0)
        for stream, s in snapshot.items():
            self.m_requests.labels(stream).set(s["requests"])
            self.m_violations.labels(stream).set(s["violations"])
            self.m_bound.labels(stream).set(s["upper_bound"])
            self.m_evalue.labels(stream).set(s["e_value"])
            self.m_tripped.labels(stream).set(1.0 if s["tripped"] else 0.0)


class Metrics(AnswerMetrics):
    """The service's counters, gauges and histograms: :class:`AnswerMetrics` and the scheduler's
    queue, KV budget and prefix cache; monitor gauges are refreshed at each scrape."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        super().__init__()
        r = self.registry
        self.queue_depth = Gauge("certkv_queue_depth", "Live requests waiting for the worker", registry=r)
        self.shadow_pending = Gauge("certkv_shadow_pending", "Shadow jobs waiting for the worker", registry=r)
        self.kv_budget = Gauge("certkv_kv_budget_slots", "KV budget in token slots (--kv-budget; 0: unlimited)",
                               registry=r)
        self.kv_in_use = Gauge("certkv_kv_in_use_slots", "KV token slots held by requests in flight", registry=r)
        self.kv_peak = Gauge("certkv_kv_peak_slots", "Largest KV in use sampled so far (after every admission and "
                             "decode step)", registry=r)
        self.kv_slot_bytes = Gauge("certkv_kv_slot_bytes", "Bytes one token slot takes (keys and values of every layer "
                                   "in the model's dtype); a KV format's request reserves the bytes it stores, in slots",
                                   registry=r)
        self.kv_budget_bytes = Gauge("certkv_kv_budget_bytes", "KV budget in bytes (0: unlimited)", registry=r)
        self.kv_in_use_bytes = Gauge("certkv_kv_in_use_bytes", "KV bytes held by requests in flight (slots × slot bytes)",
                                     registry=r)
        self.in_flight = Gauge("certkv_requests_in_flight", "Requests admitted and not finished (live and shadow)",
                               registry=r)
        self.admissions_waiting = Gauge("certkv_admissions_waiting", "Requests waiting for KV to be admitted "
                                        "(live and shadow)", registry=r)
        self.decode_steps = Counter("certkv_decode_steps", "Batched decode steps run", registry=r)
        self._steps_seen = 0
        self._prefix_metrics(r)

    def _prefix_metrics(self, r: Any) -> None:
        """The prefix cache's (``--prefix-cache-mib``): counters synced from its own at each scrape."""
        from prometheus_client import Counter, Gauge

        self.prefix_hits = Counter("certkv_prefix_cache_hits", "Questions answered from a kept compressed "
                                   "context (no prefill)", registry=r)
        self.prefix_misses = Counter("certkv_prefix_cache_misses", "Questions that prefilled their context and "
                                     "kept its compressed cache", registry=r)
        self.prefix_evictions = Counter("certkv_prefix_cache_evictions", "Kept contexts evicted (least recently "
                                        "used first, for the cache's MiB or the KV budget)", registry=r)
        self.prefix_bytes = Gauge("certkv_prefix_cache_bytes", "Bytes of kept compressed contexts", registry=r)
        self.prefix_entries = Gauge("certkv_prefix_cache_entries", "Kept compressed contexts", registry=r)
        self.prefix_slots = Gauge("certkv_prefix_cache_slots", "KV token slots the kept contexts hold (counted in "
                                  "certkv_kv_in_use_slots)", registry=r)
        self.prefix_budget = Gauge("certkv_prefix_cache_budget_bytes", "The prefix cache's budget "
                                   "(--prefix-cache-mib; 0: off)", registry=r)
        self._prefix_seen = (0, 0, 0)

    def _refresh_prefix(self, cache: Any) -> None:
        if cache is None:
            return
        counts = (cache.hits, cache.misses, cache.evictions)
        for counter, now, seen in zip((self.prefix_hits, self.prefix_misses, self.prefix_evictions), counts,
                                      self._prefix_seen):
            counter.inc(now - seen)
        self._prefix_seen = counts
        self.prefix_bytes.set(cache.bytes)
        self.prefix_entries.set(len(cache))
        self.prefix_slots.set(cache.slots)
        self.prefix_budget.set(cache.capacity_bytes)

    def render(self, service: Scraped) -> tuple[bytes, str]:
        """The Prometheus exposition of every metric, the queue and monitor gauges refreshed first."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self.queue_depth.set(service.queue_depth())
        self.shadow_pending.set(service.shadow_depth())
        scheduler = service.scheduler
        self.kv_budget.set(service.kv_budget or 0)
        self.kv_in_use.set(scheduler.kv_in_use)
        self.kv_slot_bytes.set(service.kv_slot_bytes)
        self.kv_budget_bytes.set((service.kv_budget or 0) * service.kv_slot_bytes)
        self.kv_in_use_bytes.set(scheduler.kv_in_use * service.kv_slot_bytes)
        self.kv_peak.set(scheduler.peak_kv)
        self.in_flight.set(scheduler.in_flight())
        self.admissions_waiting.set(scheduler.waiting())
        steps = scheduler.steps
        self.decode_steps.inc(steps - self._steps_seen)
        self._steps_seen = steps
        self._refresh_prefix(getattr(scheduler, "prefix_cache", None))
        self.refresh_monitor(service.monitor, service.monitor_snapshot())
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
