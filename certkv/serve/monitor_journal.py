"""The shared monitor's journal: every event it applied, in order, so that a restarted monitor is the same test.

:class:`certkv.core.monitor.RiskMonitor`'s state is a function of the calls it received, in their
order: ``record`` (one per served request, shadowed or not), ``complete`` and ``abandon`` (one per
shadow). The shared monitor of ``certkv serve --replicas`` (:mod:`certkv.serve.shared_monitor`)
writes each batch of those calls here, in one transaction, before it applies them; a restarted
monitor replays the journal through a fresh ``RiskMonitor`` and holds the very state it had (the
same e-values, bound, pending shadows and trip), not an estimate of it. The journal is
``<shadow store>/monitor.sqlite``, beside the records (``records.sqlite``) that ``certkv export``
and ``certkv certify --records`` read; a shadow's records are written to the store before its verdict
is journaled, so a crash between the two leaves a verdict the replica sends again (its sequence
number not acknowledged) and records already present, never a verdict without records.

Each replica numbers its events 1, 2, ...; the journal keeps (replica, seq) unique, and the monitor
acknowledges the highest number it applied, so a batch sent twice (a timeout, then a retry) is
applied once. The journal is bound to the operating point's hash and the monitor's parameters
(ε, each stream's δ, the shadow rate): reopening it with others is refused, as the shadow store
refuses another operating point.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from certkv.calibration.database import connect, table_names, transaction
from certkv.errors import CertkvError

JOURNAL = "monitor.sqlite"

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE events (
    id INTEGER PRIMARY KEY, replica TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL,
    stream TEXT NOT NULL, ticket INTEGER NOT NULL, evicted INTEGER NOT NULL, shadowed INTEGER NOT NULL,
    violated INTEGER NOT NULL, UNIQUE (replica, seq)
)
"""


@dataclass
class Event:
    """One call a replica made on the shared monitor (plain data: it crosses processes).

    ``kind`` ``record``: a served request on ``stream`` (``evicted``, ``shadowed``), whose replica
    ticket is ``ticket``; ``verdict``: the shadow of ``ticket`` completed (``violated``; ``records``,
    its record pair for the shadow store, or None); ``abandon``: it could not be scored.
    """

    kind: Literal["record", "verdict", "abandon"]
    seq: int
    ticket: int
    stream: str = ""
    evicted: bool = False
    shadowed: bool = False
    violated: bool = False
    records: list[dict[str, Any]] | None = field(default=None, repr=False)


class MonitorJournal:
    """The events the shared monitor applied, in one SQLite file (module docstring: why and how).

    Parameters
    ----------
    path : Path
        The journal file (``<shadow store>/monitor.sqlite``); created with `binding` when new.
    binding : mapping of str to JSON-able
        What the journal belongs to (the operating point's hash, ε, the streams' δ, the shadow
        rate); an existing journal bound to anything else is refused.
    """

    def __init__(self, path: Path, binding: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = connect(self.path, what="certkv monitor journal")
        wanted = {k: json.dumps(v, sort_keys=True) for k, v in binding.items()}
        if not table_names(self._conn):
            with transaction(self._conn):
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    self._conn.execute(statement)
                self._conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", wanted.items())
            return
        have = {r["key"]: r["value"] for r in self._conn.execute("SELECT key, value FROM meta")}
        differ = sorted(k for k in wanted.keys() | have.keys() if wanted.get(k) != have.get(k))
        if differ:
            self._conn.close()
            raise CertkvError(f"monitor journal {self.path} belongs to another deployment ({', '.join(differ)} "
                              "differ); choose another --shadow-store path")

    def append(self, replica: str, events: list[Event]) -> None:
        """Journal `events` of `replica` in one transaction (all or none)."""
        values = [(replica, e.seq, e.kind, e.stream, e.ticket, int(e.evicted), int(e.shadowed), int(e.violated))
                  for e in events]
        with transaction(self._conn):
            self._conn.executemany("INSERT INTO events (replica, seq, kind, stream, ticket, evicted, shadowed, "
                                   "violated) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", values)

    def replay(self) -> Iterator[tuple[str, Event]]:
        """Every journaled event with its replica, in the order it was applied."""
        for r in self._conn.execute("SELECT * FROM events ORDER BY id"):
            yield r["replica"], Event(r["kind"], r["seq"], r["ticket"], r["stream"], bool(r["evicted"]),
                                      bool(r["shadowed"]), bool(r["violated"]))

    def close(self) -> None:
        self._conn.close()


__all__ = ["JOURNAL", "Event", "MonitorJournal"]
