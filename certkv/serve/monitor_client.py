"""A replica's side of the shared monitor: :class:`RiskMonitor`'s interface, answered by the one monitor.

:class:`~certkv.serve.service.Service` calls its monitor's ``draw_shadow``, ``record``,
``complete``, ``abandon``, ``tripped`` and ``snapshot``. :class:`SharedMonitorClient` answers
those calls for a replica of ``certkv serve --replicas``: the coin is drawn here (a seeded coin of
the replica's own, at the common rate s: what makes Z = V/s unbiased is that it is drawn after the
gate's decision, not which replica draws it); ``record``, ``complete`` and ``abandon`` become
numbered events in a local buffer and never block a request; a sender thread sends the buffer to
the shared monitor (:meth:`certkv.serve.shared_monitor.SharedMonitor.apply`) as soon as events
wait, and at least every ``poll_seconds`` when none do, and keeps the monitor's state from each
reply. ``tripped`` and ``snapshot`` read that state: a replica switches to the full cache at most
one reply after the shared monitor tripped (replicas poll; nothing is pushed to them).

A replica that cannot reach the monitor (the actor restarting, a network partition) keeps serving
with the state it last saw, keeps every event buffered and sends them, in order, once it reaches
the monitor again; the monitor acknowledges the events it applied, so an event sent twice is
applied once. Each stream's snapshot carries the replica's ``monitor_reachable`` and
``monitor_buffered`` (events not yet acknowledged) beside the shared monitor's figures.

:class:`ReplicaShadowRunner` is the shadow runner of such a replica: it scores a shadow as in one
process and sends the verdict together with the shadow's record pair, which the shared monitor
writes to the one shadow store, under request ids made unique across replicas.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from certkv.core.monitor import check_shadow_rate
from certkv.errors import CertkvError
from certkv.serve.monitor_journal import Event
from certkv.serve.shadow import ShadowRunner

if TYPE_CHECKING:
    from certkv.runtime.certified_runtime import RuntimeAnswer
    from certkv.serve.shadow import ShadowJob

log = logging.getLogger("certkv.serve.monitor")

#: How a client reaches the shared monitor: ``send(replica, events)`` returns
#: :meth:`~certkv.serve.shared_monitor.SharedMonitor.apply`'s reply or raises.
Send = Callable[[str, list[Event]], dict[str, Any]]

#: The largest batch one call sends (a long outage's backlog goes in several calls).
MAX_BATCH = 5000


def _empty_state(delta: float) -> dict[str, Any]:
    """A stream's state before the first reply: nothing recorded, not tripped."""
    return {"requests": 0, "evicted": 0, "shadowed": 0, "pending": 0, "violations": 0, "abandoned": 0,
            "e_value": 1.0, "upper_bound": 1.0, "tripped": False, "tripped_after": None, "delta": delta}


class SharedMonitorClient:
    """:class:`~certkv.core.monitor.RiskMonitor`'s interface for one replica (module docstring).

    Parameters
    ----------
    send : Send
        Reaches the shared monitor (a Ray actor call, or a :class:`SharedMonitor` in-process).
    risk : float
        ε of the operating point.
    shadow_rate : float
        s, the same on every replica and the shared monitor.
    streams : dict of str to float
        The monitor streams and their δ (:func:`certkv.serve.shared_monitor.monitor_streams`).
    replica : str
        This replica's name, unique in the deployment (its events' key at the monitor).
    seed : int
        Seed of the shadow coin (mixed with `replica`, so replicas draw independent coins).
    poll_seconds : float
        How often the state is read when no event waits.
    start : bool
        Start the sender thread (False: only :meth:`flush` sends; for a caller that drives it).
    """

    def __init__(self, send: Send, *, risk: float, shadow_rate: float, streams: dict[str, float], replica: str,
                 seed: int = 0, poll_seconds: float = 0.1, start: bool = True) -> None:
        self.risk = float(risk)
        self.shadow_rate = check_shadow_rate(shadow_rate)
        self.replica = replica
        self.poll_seconds = poll_seconds
        self._send = send
        mix = int.from_bytes(hashlib.sha256(replica.encode()).digest()[:8], "big")
        self._rng = np.random.default_rng([seed, mix])
        self._state = {name: _empty_state(d) for name, d in streams.items()}
        self._tripped: set[str] = set()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._buffer: list[Event] = []
        self._pending: set[int] = set()
        self._seq = 0
        self._ticket = 0
        self.reachable = False
        self.last_error: str | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="certkv-monitor-client", daemon=True)
            self._thread.start()

    # -- RiskMonitor's interface ----------------------------------------------------------------

    @property
    def streams(self) -> list[str]:
        return list(self._state)

    def draw_shadow(self) -> bool:
        """The replica's seeded coin, P(True) = s (drawn after the gate's decision)."""
        with self._lock:
            return bool(self._rng.random() < self.shadow_rate)

    def record(self, stream: str, *, evicted: bool, shadowed: bool) -> int:
        """Buffer one served request; returns this replica's ticket for it."""
        if stream not in self._state:
            raise CertkvError(f"unknown monitor stream {stream!r}; known: {', '.join(self._state)}")
        if shadowed and not evicted:
            raise CertkvError("a full-cache answer is never shadowed: record(evicted=False, shadowed=True)")
        with self._lock:
            self._ticket += 1
            if shadowed:
                self._pending.add(self._ticket)
            self._push(Event("record", 0, self._ticket, stream, bool(evicted), bool(shadowed)))
            return self._ticket

    def complete(self, ticket: int, violated: bool, records: list[dict[str, Any]] | None = None) -> None:
        """Buffer a shadow's verdict, with its record pair for the shared shadow store."""
        with self._lock:
            self._settle(ticket)
            self._push(Event("verdict", 0, ticket, violated=bool(violated), records=records))

    def abandon(self, ticket: int) -> None:
        """Buffer that a shadow could not be scored (the monitor counts it as a violation)."""
        with self._lock:
            self._settle(ticket)
            self._push(Event("abandon", 0, ticket))

    def tripped(self, stream: str) -> bool:
        """Whether the shared monitor had tripped `stream` when this replica last heard from it."""
        with self._lock:
            return stream in self._tripped

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The shared monitor's state per stream as last heard, with this replica's
        ``monitor_reachable`` and ``monitor_buffered``."""
        with self._lock:
            extra = {"monitor_reachable": self.reachable, "monitor_buffered": len(self._buffer)}
            return {name: {**s, "tripped": s["tripped"] or name in self._tripped, **extra}
                    for name, s in self._state.items()}

    # -- sending ----------------------------------------------------------------------------------

    def buffered(self) -> int:
        """Events not yet acknowledged by the shared monitor."""
        with self._lock:
            return len(self._buffer)

    def flush(self) -> bool:
        """Send the buffered events once (all of them, :data:`MAX_BATCH` at a time) and read the
        state; False when the monitor could not be reached (the events stay buffered)."""
        with self._send_lock:
            while True:
                with self._lock:
                    batch = self._buffer[:MAX_BATCH]
                try:
                    reply = self._send(self.replica, batch)
                except Exception as exc:  # noqa: BLE001 - any failure to reach it: keep serving, keep the events
                    with self._lock:
                        if self.reachable or self.last_error is None:
                            log.warning("replica %s cannot reach the shared monitor (%s); serving on with its last "
                                        "state, %d events buffered", self.replica, type(exc).__name__,
                                        len(self._buffer))
                        self.reachable, self.last_error = False, f"{type(exc).__name__}: {exc}"
                    return False
                with self._lock:
                    self._acknowledge(reply)
                    more = len(batch) == MAX_BATCH and bool(self._buffer)
                if not more:
                    return True

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the sender and send what is left, trying until `timeout`; True when nothing is left."""
        with self._lock:
            self._stopped = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        while not (self.flush() and not self.buffered()) and time.monotonic() < deadline:
            time.sleep(min(0.5, self.poll_seconds * 5))
        left = self.buffered()
        if left:
            log.error("replica %s stops with %d monitor events the shared monitor never acknowledged", self.replica,
                      left)
        return not left

    # -- internals ----------------------------------------------------------------------------

    def _push(self, event: Event) -> None:
        """Number `event` and buffer it (the lock held), waking the sender."""
        self._seq += 1
        self._buffer.append(dataclasses.replace(event, seq=self._seq))
        self._wake.notify()

    def _settle(self, ticket: int) -> None:
        if ticket not in self._pending:
            raise CertkvError(f"ticket {ticket!r} is not a pending shadow (unknown, unshadowed or already settled)")
        self._pending.discard(ticket)

    def _acknowledge(self, reply: dict[str, Any]) -> None:
        """Drop the acknowledged events and keep the state (the lock held)."""
        acked = int(reply["acked"])
        self._buffer = [e for e in self._buffer if e.seq > acked]
        for name, s in reply["monitor"].items():
            if name in self._state:
                self._state[name] = s
                if s["tripped"] and name not in self._tripped:
                    self._tripped.add(name)
                    log.warning("replica %s: the shared monitor tripped stream %r; its requests are answered from "
                                "the full cache", self.replica, name)
        if not self.reachable and self.last_error is not None:
            log.info("replica %s reached the shared monitor again", self.replica)
        self.reachable, self.last_error = True, None

    def _due(self) -> bool:
        return self._stopped or bool(self._buffer)

    def _stopping(self) -> bool:  # backing off: wait out the delay even when events arrive
        return self._stopped

    def _run(self) -> None:
        """The sender: send whenever events wait, read the state every ``poll_seconds``, back off
        (up to 5 s) while the monitor cannot be reached."""
        backoff = 0.0
        while True:
            with self._lock:
                self._wake.wait_for(self._due if not backoff else self._stopping, timeout=backoff or self.poll_seconds)
                if self._stopped:
                    return
            backoff = 0.0 if self.flush() else min(5.0, max(2 * backoff, self.poll_seconds))


class ReplicaShadowRunner(ShadowRunner):
    """A replica's shadow runner: scores as in one process; the verdict and the record pair go to
    the shared monitor together (it writes the pair to the one store), under a request id prefixed
    with the replica's name (unique in the one store)."""

    def __init__(self, runtime, monitor: SharedMonitorClient) -> None:
        super().__init__(runtime, monitor, None)  # type: ignore[arg-type]
        self.client = monitor

    def run(self, job: ShadowJob, full: RuntimeAnswer | None = None) -> dict[str, Any]:
        job = dataclasses.replace(job, request_id=f"{self.client.replica}-{job.request_id}")
        try:
            outcome = self._score(job, full)
        except Exception as exc:
            self.client.abandon(job.ticket)
            log.error("shadow %s (abandoned): %s: %s", job.request_id, type(exc).__name__, exc)
            raise CertkvError(f"shadow {job.request_id} abandoned: {exc}") from exc
        self.client.complete(job.ticket, outcome["violated"], records=outcome["records"])
        return outcome


__all__ = ["MAX_BATCH", "ReplicaShadowRunner", "Send", "SharedMonitorClient"]
