"""One live risk monitor for every replica of an operating point (``certkv serve --replicas N``).

The operating point is one promise, so its monitor is one test: N replicas that each ran their own
:class:`~certkv.core.monitor.RiskMonitor` at δ would switch a healthy deployment up to N times as
often, and each would see a drift only in its 1/N share of the shadows. :class:`SharedMonitor`
holds the one ``RiskMonitor`` (its statistics unchanged), the one
:class:`~certkv.serve.shadow_store.ShadowStore` and the journal of every call it applied
(:mod:`certkv.serve.monitor_journal`). Replicas send it their calls in batches
(:meth:`SharedMonitor.apply`, through :class:`~certkv.serve.monitor_client.SharedMonitorClient`)
and read its state in the reply. On a Ray cluster it runs as one named actor
(:func:`monitor_actor`), restarted by Ray when it dies; a restarted monitor replays its journal
and is the same test, with nothing lost.

Order within :meth:`SharedMonitor.apply`: the shadows' records go to the store first (a pair already
present is not written again), then the batch is journaled in one transaction, then applied to the
monitor. The calls of one replica are applied in the order the replica made them (its ``seq``), so
each shadow's bets are fixed, as in one process, before its verdict is applied; the calls of
different replicas interleave in the order their batches arrive, as the requests of one process
interleave on its threads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from certkv.core.monitor import RiskMonitor
from certkv.core.spec import delta_of
from certkv.errors import CertkvError
from certkv.serve.monitor_journal import JOURNAL, Event, MonitorJournal

if TYPE_CHECKING:
    from certkv.core.operating_point import OperatingPoint
    from certkv.serve.shadow_store import ShadowStore

log = logging.getLogger("certkv.serve.monitor")

def log_first_trip(monitor: Any, stream: str, logged: set[str], logger: logging.Logger, server: str, fallback: str) -> None:
    """Warn once per `stream` (remembered in `logged`) that `monitor` (a
    :class:`~certkv.core.monitor.RiskMonitor` or a replica's
    :class:`~certkv.serve.monitor_client.SharedMonitorClient`) tripped on it: after how many
    requests, its e-value and bound, and that `server` now answers the stream from `fallback` until
    restart (``certkv serve``: the full cache; ``certkv gateway``: the full endpoint)."""
    if stream in logged or not monitor.tripped(stream):
        return
    logged.add(stream)
    s = monitor.snapshot()[stream]
    logger.warning("%s: monitor TRIPPED on stream %r after %s requests (e-value %.3g >= 1/delta, violation-rate bound "
                   "%.3g > risk %.3g); its requests are answered from the %s until restart", server, stream,
                   s["tripped_after"], s["e_value"], s["upper_bound"], monitor.risk, fallback)


#: The shared monitor actor's name (in :data:`NAMESPACE`), one per operating point: the name ends with
#: the first 12 hex digits of the operating point's hash.
ACTOR_PREFIX = "certkv-monitor-"
NAMESPACE = "certkv"


def monitor_streams(op: OperatingPoint) -> dict[str, float] | None:
    """The monitor streams of `op` and their δ: one per stratum of a stratified point (None: the one
    stream ``all`` at the contract's δ), as ``certkv serve`` monitors them in one process."""
    if op.strata is None:
        return None
    return {name: delta_of(op.strata.confidence) for name in op.strata.entries}


def new_risk_monitor(op: OperatingPoint, shadow_rate: float, seed: int = 0) -> RiskMonitor:
    """The :class:`RiskMonitor` ``certkv serve`` runs for `op` at `shadow_rate`."""
    return RiskMonitor(op.contract.risk, delta_of(op.contract.confidence), shadow_rate, seed=seed,
                       streams=monitor_streams(op))


class SharedMonitor:
    """The one monitor, shadow store and journal of an operating point (module docstring).

    Parameters
    ----------
    operating_point : OperatingPoint
        The deployed point (its ε and δ, its strata, the store's binding).
    store_path : Path
        The shadow store folder: ``records.sqlite`` (or one per stratum) and ``monitor.sqlite``.
    shadow_rate : float
        s, in (0, 1], the share of evicted answers every replica shadows.

    A journal already in `store_path` is replayed: the monitor resumes where it stopped.
    """

    def __init__(self, operating_point: OperatingPoint, store_path: Path, shadow_rate: float) -> None:
        from certkv.serve.shadow_store import ShadowStore, operating_point_sha256

        op = operating_point
        self.operating_point = op
        self.monitor = new_risk_monitor(op, shadow_rate)
        self.store: ShadowStore | None = None
        if op.is_stratified or not op.fallback:  # a fallback point answers from the full cache: no shadows
            self.store = ShadowStore(Path(store_path), op)
        binding = {"operating_point_sha256": operating_point_sha256(op), "risk": self.monitor.risk,
                   "shadow_rate": self.monitor.shadow_rate,
                   "streams": {k: v["delta"] for k, v in self.monitor.snapshot().items()}}
        try:
            self.journal = MonitorJournal(Path(store_path) / JOURNAL, binding)
        except BaseException:
            if self.store is not None:
                self.store.close()
            raise
        self._tickets: dict[tuple[str, int], int] = {}
        self._acked: dict[str, int] = {}
        self._logged: set[str] = set()
        self.restored = 0
        for replica, event in self.journal.replay():
            self._apply_one(replica, event)
            self._acked[replica] = event.seq
            self.restored += 1
        self._log_trips()

    def apply(self, replica: str, events: list[Event]) -> dict[str, Any]:
        """Apply `replica`'s `events` not applied yet; returns ``acked`` (the highest ``seq`` of
        `replica` applied so far) and ``monitor`` (:meth:`RiskMonitor.snapshot`).

        Events at or below the acknowledged ``seq`` are skipped (a batch sent again); an event that
        names an unknown stream or ticket is logged, acknowledged and not applied (it would fail
        the same way on every retry and replay).
        """
        last = self._acked.get(replica, 0)
        fresh = [e for e in sorted(events, key=lambda e: e.seq) if e.seq > last]
        valid = self._valid(replica, fresh)
        for event in valid:
            if event.kind == "verdict" and event.records:
                self._write_records(event.records)
        if valid:
            self.journal.append(replica, valid)
        for event in valid:
            self._apply_one(replica, event)
        if fresh:
            self._acked[replica] = fresh[-1].seq
        self._log_trips()
        return {"acked": self._acked.get(replica, 0), "monitor": self.monitor.snapshot()}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The monitor's state per stream (:meth:`RiskMonitor.snapshot`)."""
        return self.monitor.snapshot()

    def settings(self) -> dict[str, Any]:
        """What this monitor was started with: its store folder and shadow rate. A detached monitor
        outlives the deployment that started it, so a new deployment checks that it matches."""
        return {"store_path": str(self.journal.path.parent), "shadow_rate": self.monitor.shadow_rate}

    def close(self) -> None:
        """Close the journal and the store (every applied batch is already committed)."""
        self.journal.close()
        if self.store is not None:
            self.store.close()

    # -- internals ----------------------------------------------------------------------------

    def _valid(self, replica: str, events: list[Event]) -> list[Event]:
        """The events that can be applied, in order (a shadow's verdict after its record)."""
        streams, opened, closed, ok = set(self.monitor.streams), set(), set(), []
        for e in events:
            key = (replica, e.ticket)
            if e.kind == "record" and e.stream in streams and not (e.shadowed and not e.evicted):
                if e.shadowed:
                    opened.add(key)
                ok.append(e)
            elif e.kind in ("verdict", "abandon") and key not in closed and (key in self._tickets or key in opened):
                closed.add(key)
                ok.append(e)
            else:
                log.error("shared monitor: replica %s sent an event it cannot apply (%s, seq %d, ticket %d, "
                          "stream %r); skipped", replica, e.kind, e.seq, e.ticket, e.stream)
        return ok

    def _apply_one(self, replica: str, e: Event) -> None:
        key = (replica, e.ticket)
        if e.kind == "record":
            ticket = self.monitor.record(e.stream, evicted=e.evicted, shadowed=e.shadowed)
            if e.shadowed:
                self._tickets[key] = ticket
        elif e.kind == "verdict":
            self.monitor.complete(self._tickets.pop(key), e.violated)
        else:
            self.monitor.abandon(self._tickets.pop(key))

    def _write_records(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Write one shadow's pair unless it is there already; a failed write is logged and the
        verdict still applied (as in one process: the verdict keeps the deployment safe, the store
        is the audit trail)."""
        assert self.store is not None  # only a point with a store has shadows
        first = records[0]
        stratum = first.get("stratum", first.get("task")) if self.operating_point.is_stratified else None
        try:
            if not self.store.has(str(first.get("request_id")), stratum):
                self.store.write(list(records))
        except CertkvError as exc:
            log.error("shared monitor: shadow %s not written to the store (%s); its verdict stands",
                      first.get("request_id"), exc)

    def _log_trips(self) -> None:
        for stream, s in self.monitor.snapshot().items():
            if s["tripped"] and stream not in self._logged:
                self._logged.add(stream)
                log.warning("certkv serve: shared monitor TRIPPED on stream %r after %s requests (e-value %.3g >= "
                            "1/delta); every replica answers its requests from the full cache", stream,
                            s["tripped_after"], s["e_value"])


def monitor_actor_name(op: OperatingPoint) -> str:
    """The shared monitor actor's name for `op` (:data:`ACTOR_PREFIX` and 12 hex digits of its hash)."""
    from certkv.serve.shadow_store import operating_point_sha256

    return ACTOR_PREFIX + operating_point_sha256(op)[:12]


def monitor_actor(op: OperatingPoint, store_path: Path, shadow_rate: float, *, node_id: str | None = None) -> Any:
    """The shared monitor of `op` as a named, detached Ray actor (created, or the running one).

    Ray restarts it whenever it dies (``max_restarts=-1``) and retries the calls it was running
    (``max_task_retries=-1``; a batch applied twice is applied once); every start replays the
    journal. It holds no CPU, and runs on `node_id` (default: this node), whose local disk holds
    the store: SQLite's write-ahead log needs a local file system. Needs ``ray.init`` first.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node_id or ray.get_runtime_context().get_node_id()
    cls = ray.remote(SharedMonitor)
    return cls.options(
        name=monitor_actor_name(op), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_task_retries=-1, num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(op, Path(store_path).resolve(), shadow_rate)


__all__ = ["ACTOR_PREFIX", "NAMESPACE", "SharedMonitor", "monitor_actor", "monitor_actor_name", "monitor_streams",
           "log_first_trip", "new_risk_monitor"]
