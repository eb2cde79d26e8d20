"""The calibration store: one SQLite database per contract at ``<store>/records.sqlite``.

Durability. The database runs in WAL mode with ``synchronous=FULL`` and every request is written
in ONE transaction holding all of its candidate records (the full cache included). SQLite commits a
WAL transaction by appending it to the log with a commit marker; FULL additionally fsyncs the log
before the commit returns. So:

- a SIGKILL at any instant (before, during or after the commit) leaves either the whole request or
  none of it: a transaction without its commit marker is ignored on the next open;
- a committed request survives even a power loss (this is what FULL buys over NORMAL; one fsync per
  request is negligible next to running a model on it);
- resuming skips exactly the requests present, and the PRIMARY KEY (request_id, policy) plus the
  "request already present" check make duplicates impossible.

The store's ``meta`` table carries its ``format_version`` (:data:`FORMAT_VERSION`); a store of
another version is refused in one line that says how to start a new one
(:mod:`certkv.core.file_format`). The store remembers the hash of the contract it was calibrated
for. Opening it with another contract is an error, because certifying records against a
contract they were not produced under voids the guarantee; ``new=True`` (``--new-store``) moves
the old database aside, never deletes it.
"""

from __future__ import annotations

import csv
import json
import math
import sqlite3
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from certkv._version import __version__
from certkv.atomic_io import atomic_write
from certkv.calibration.database import connect, table_names, transaction
from certkv.core.file_format import check_format_version
from certkv.core.policy_names import REFERENCE_POLICY
from certkv.core.signals import STORE_COLUMNS
from certkv.errors import CertkvError
from certkv.interrupts import critical

if TYPE_CHECKING:
    from certkv.contract.schema import Contract

DB_NAME = "records.sqlite"

#: The layout of a store (its tables and meta keys), written into ``meta`` by :func:`initialise`.
FORMAT_VERSION = 1

#: What writes a calibration store afresh, named when a store of another version is refused.
REWRITE = "certkv calibrate CONTRACT --new-store"

#: What writes a shadow store (meta ``kind`` ``shadow``, :mod:`certkv.serve.shadow_store`) afresh.
SHADOW_REWRITE = "certkv serve OPERATING_POINT --shadow-store NEW_FOLDER"

#: Record columns in export order; anything else a record carries goes into `extra` (JSON).
COLUMNS = (
    "request_id",
    "task",
    "policy",
    "press",
    "kv_retained",
    "kv_retained_actual",
    "utility",
    "utility_full",
    "loss",
    "answer",
    *STORE_COLUMNS,  # the gate signals with a column of their own (certkv.core.signals); the rest go to `extra`
    "path",
    "seconds",
)
_REQUIRED = ("policy", "utility", "utility_full", "loss", "answer")
_REAL = ("kv_retained", "kv_retained_actual", "utility", "utility_full", "loss", *STORE_COLUMNS, "seconds")
LOSS_TOLERANCE = 1e-9

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    request_id TEXT NOT NULL,
    task TEXT,
    policy TEXT NOT NULL,
    press TEXT,
    kv_retained REAL,
    kv_retained_actual REAL,
    utility REAL NOT NULL,
    utility_full REAL NOT NULL,
    loss REAL NOT NULL,
    answer TEXT NOT NULL,
    {signal_columns}
    path TEXT CHECK (path IS NULL OR path IN ('fast', 'pipeline', 'endpoint')),
    seconds REAL,
    extra TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (request_id, policy)
);
CREATE TABLE IF NOT EXISTS skipped (request_id TEXT PRIMARY KEY, reason TEXT NOT NULL);
""".replace("{signal_columns}", "\n    ".join(f"{name} REAL," for name in STORE_COLUMNS))


def db_path(store: str | Path) -> Path:
    """The database file of a store folder."""
    return Path(store) / DB_NAME


def initialise(conn: sqlite3.Connection, meta: Mapping[str, str]) -> None:
    """Create the record tables and write `meta`, with the store's ``format_version``, in one
    transaction (a crash leaves no half-made store); the shadow store initialises its databases
    with it too."""
    rows = {**meta, "format_version": str(FORMAT_VERSION)}
    try:
        with transaction(conn):
            for statement in filter(str.strip, _SCHEMA.split(";")):
                conn.execute(statement)
            conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", rows.items())
    except BaseException:
        conn.close()
        raise


def read_meta(conn: sqlite3.Connection, path: Path) -> dict[str, str]:
    """The store's ``meta`` table as a dict; a database without one is not a certkv store."""
    try:
        return {row["key"]: row["value"] for row in conn.execute("SELECT key, value FROM meta")}
    except sqlite3.DatabaseError as exc:
        raise CertkvError(f"{path} is not a certkv calibration store ({exc})") from None


def check_store_format(conn: sqlite3.Connection, meta: Mapping[str, str], path: Path) -> None:
    """Refuse a store (its `meta`, read through `conn` from `path`) of another ``format_version``,
    closing `conn` first; the error names the command that starts a new one, a shadow store's or a
    calibration store's by the store's ``kind``."""
    rewrite = SHADOW_REWRITE if meta.get("kind") == "shadow" else REWRITE
    try:
        check_format_version(meta.get("format_version"), FORMAT_VERSION, path, rewrite)
    except CertkvError:
        conn.close()
        raise


def _move_aside(path: Path) -> Path:
    """Rename a database (and any WAL left by a crash) to ``records.<UTC time>.sqlite``."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # fold the WAL into the file first
    finally:
        conn.close()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    target = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    with critical():  # the database and its side files move together, or not at all
        path.rename(target)
        for suffix in ("-wal", "-shm"):
            side = Path(str(path) + suffix)
            if side.exists():
                side.rename(Path(str(target) + suffix))
    return target


class CalibrationStore:
    """Per-request calibration records of one contract. Use :meth:`open` or :meth:`read`."""

    def __init__(self, conn: sqlite3.Connection, path: Path, contract: Contract | None, moved_aside: Path | None = None):
        self._conn = conn
        self.path = path
        self.contract = contract
        #: where a previous database was moved by ``new=True`` (None if nothing was moved)
        self.moved_aside = moved_aside
        self._expected: dict[str, Any] | None = None
        if contract is not None:
            from certkv.contract.spec import candidates

            self._expected = {c.policy: c for c in candidates(contract)}

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, contract: Contract, *, new: bool = False) -> CalibrationStore:
        """Create the store for `contract` at folder `path`, or resume it when the hash matches.

        With `new`, an existing database is moved aside (timestamp suffix) and a fresh one created.
        """
        folder = Path(path)
        if folder.exists() and not folder.is_dir():
            raise CertkvError(f"store path {folder} is a file; a store is a folder, choose another `store:` path")
        folder.mkdir(parents=True, exist_ok=True)
        file = db_path(folder)
        sha = contract.sha256()
        moved = None
        if file.exists():
            conn = connect(file)
            if table_names(conn):  # no tables: a kill interrupted the first open; initialise below
                stored_meta = read_meta(conn, file)
                stored = stored_meta.get("contract_sha256")
                if stored is None:
                    conn.close()
                    raise CertkvError(f"{file} is not a certkv calibration store (no contract hash)")
                if stored == sha and not new:  # resume, in this certkv's format only
                    check_store_format(conn, stored_meta, file)
                    return cls(conn, folder, contract)
                conn.close()
                if not new:
                    raise CertkvError(
                        f"store {folder} belongs to another contract (sha256 {stored[:12]}, this one {sha[:12]}); "
                        "pass --new-store to move the old records aside, or choose another `store:` path"
                    )
                moved = _move_aside(file)
            else:
                conn.close()
        conn = connect(file)
        meta = {
            "contract_sha256": sha,
            "contract": contract.canonical_json(),
            "contract_name": contract.name,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "certkv_version": __version__,
        }
        initialise(conn, meta)
        return cls(conn, folder, contract, moved)

    @classmethod
    def read(cls, path: str | Path) -> CalibrationStore:
        """Open an existing store read-only, without a contract (export, certify)."""
        folder = Path(path)
        file = db_path(folder)
        if not file.is_file():
            raise CertkvError(f"no calibration store at {folder} (expected {file}); run `certkv calibrate` first")
        conn = connect(file, readonly=True)
        meta = read_meta(conn, file) if table_names(conn) else {}
        if "contract_sha256" not in meta:
            conn.close()
            raise CertkvError(f"{file} is not a certkv calibration store (no contract hash)")
        check_store_format(conn, meta, file)
        return cls(conn, folder, None)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> CalibrationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------------

    def meta(self) -> dict[str, str]:
        """contract_sha256, contract (canonical JSON), created, certkv_version, format_version."""
        return read_meta(self._conn, db_path(self.path))

    def bind(self, facts: Mapping[str, Any]) -> None:
        """Record what else determines the answers (model, request set, device), or check it on resume.

        The contract hash does not cover the model's weights or the request file's content; resuming
        with a retrained model or an edited file would silently mix two populations of records.
        """
        stored = self.meta()
        for key, value in facts.items():
            if key in stored and stored[key] != str(value):
                raise CertkvError(
                    f"store {self.path} was calibrated with {key} {stored[key]!r}, this run has {str(value)!r}; "
                    "pass --new-store to move the old records aside, or choose another `store:` path"
                )
        new = {k: str(v) for k, v in facts.items() if k not in stored}
        if new:
            with transaction(self._conn):
                self._conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", new.items())

    def done_request_ids(self) -> set[str]:
        """Requests already recorded or skipped: a resumed run starts after these."""
        rows = self._conn.execute("SELECT request_id FROM records UNION SELECT request_id FROM skipped")
        return {r[0] for r in rows}

    def records(self) -> list[dict[str, Any]]:
        """Every record in write order; `extra` signals are merged into each dict."""
        out = []
        for row in self._conn.execute(f"SELECT {', '.join(COLUMNS)}, extra FROM records ORDER BY rowid"):
            rec = {c: row[c] for c in COLUMNS}
            rec.update(json.loads(row["extra"]))
            out.append(rec)
        return out

    def skipped(self) -> list[dict[str, str]]:
        """Skipped requests and why, in write order."""
        rows = self._conn.execute("SELECT request_id, reason FROM skipped ORDER BY rowid")
        return [{"request_id": r[0], "reason": r[1]} for r in rows]

    def count(self) -> int:
        """Number of records (requests × candidates, full included)."""
        return self._conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]

    def request_count(self) -> int:
        """Number of requests with records (skipped ones excluded)."""
        return self._conn.execute("SELECT COUNT(DISTINCT request_id) FROM records").fetchone()[0]

    def full_cache_utility_by_task(self) -> list[tuple[str, int, float]]:
        """(task, requests, best full-cache utility) per labelled task, by task name."""
        rows = self._conn.execute(
            "SELECT task, COUNT(*), MAX(utility) FROM records WHERE policy = ? AND task IS NOT NULL GROUP BY task ORDER BY task",
            (REFERENCE_POLICY,),
        )
        return [(r[0], r[1], r[2]) for r in rows]

    # -- writing -------------------------------------------------------------------------------

    def write_request(self, request_id: str, records: Sequence[Mapping[str, Any]]) -> None:
        """Write all candidate records of one request in one transaction (all or nothing).

        Each record needs policy, utility, utility_full, loss and answer; column keys fill columns and
        any other key is kept in `extra`. The records must cover ``full`` and every contract candidate
        exactly once. A request already present is an error, never a duplicate.
        """
        request_id = str(request_id)
        values = [self._record_values(request_id, record) for record in records]
        self._check_request(request_id, values)
        placeholders = ", ".join("?" for _ in range(len(COLUMNS) + 1))
        sql = f"INSERT INTO records ({', '.join(COLUMNS)}, extra) VALUES ({placeholders})"
        with transaction(self._conn):
            if self._present(request_id):
                raise CertkvError(f"request {request_id!r} is already in store {self.path}; it is never written twice")
            for v in values:
                self._insert(sql, v)

    def write_skipped(self, request_id: str, reason: str) -> None:
        """Record that a request was skipped (e.g. too long), so resuming does not retry it."""
        request_id = str(request_id)
        with transaction(self._conn):
            if self._present(request_id):
                raise CertkvError(f"request {request_id!r} is already in store {self.path}; it is never written twice")
            self._conn.execute("INSERT INTO skipped (request_id, reason) VALUES (?, ?)", (request_id, str(reason)))

    def _insert(self, sql: str, values: tuple) -> None:
        """Insert one record inside the open transaction (a seam the crash test slows down)."""
        self._conn.execute(sql, values)

    def _present(self, request_id: str) -> bool:
        q = "SELECT 1 FROM records WHERE request_id = ? UNION ALL SELECT 1 FROM skipped WHERE request_id = ? LIMIT 1"
        return self._conn.execute(q, (request_id, request_id)).fetchone() is not None

    def _record_values(self, request_id: str, record: Mapping[str, Any]) -> tuple:
        missing = [k for k in _REQUIRED if record.get(k) is None]
        if missing:
            raise CertkvError(f"request {request_id!r}: a record lacks {', '.join(missing)}")
        if "request_id" in record and str(record["request_id"]) != request_id:
            raise CertkvError(f"request {request_id!r}: a record carries request_id {record['request_id']!r}")
        rec: dict[str, Any] = {c: record.get(c) for c in COLUMNS}
        rec["request_id"] = request_id
        for c in _REAL:
            if rec[c] is not None:
                rec[c] = float(rec[c])
                if not math.isfinite(rec[c]):
                    raise CertkvError(f"request {request_id!r}, policy {rec['policy']!r}: {c} is not finite")
        for c in ("utility", "utility_full"):
            if not 0.0 <= rec[c] <= 1.0:
                raise CertkvError(f"request {request_id!r}, policy {rec['policy']!r}: {c} {rec[c]} is outside [0, 1]")
        if abs(rec["loss"] - (rec["utility_full"] - rec["utility"])) > LOSS_TOLERANCE:
            raise CertkvError(f"request {request_id!r}, policy {rec['policy']!r}: loss {rec['loss']} != utility_full − utility")
        if rec["path"] not in (None, "fast", "pipeline", "endpoint"):
            raise CertkvError(f"request {request_id!r}: path must be 'fast', 'pipeline' or 'endpoint', got {rec['path']!r}")
        extra = {k: v for k, v in record.items() if k not in COLUMNS and k != "extra"}
        extra.update(record.get("extra") or {})
        try:
            extra_json = json.dumps(extra, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CertkvError(f"request {request_id!r}: extra signals must be JSON values ({exc})") from None
        return (*(rec[c] for c in COLUMNS), extra_json)

    def _check_request(self, request_id: str, values: list[tuple]) -> None:
        """The records must be exactly the contract's candidates plus full, consistent with each other."""
        i_policy, i_press, i_kv, i_ufull = (COLUMNS.index(c) for c in ("policy", "press", "kv_retained", "utility_full"))
        policies = [v[i_policy] for v in values]
        dupes = sorted({p for p in policies if policies.count(p) > 1})
        if dupes:
            raise CertkvError(f"request {request_id!r}: policies {dupes} appear more than once")
        if REFERENCE_POLICY not in policies:
            raise CertkvError(f"request {request_id!r}: the records lack the full-cache policy {REFERENCE_POLICY!r}")
        if len({v[i_ufull] for v in values}) != 1:
            raise CertkvError(f"request {request_id!r}: records disagree on utility_full")
        if self._expected is None:
            return
        unknown = sorted(set(policies) - set(self._expected) - {REFERENCE_POLICY})
        absent = [p for p in self._expected if p not in policies]
        if unknown or absent:
            raise CertkvError(
                f"request {request_id!r}: records must cover the contract's candidates exactly "
                f"(unknown: {unknown or 'none'}, missing: {absent or 'none'})"
            )
        for v in values:
            cand = self._expected.get(v[i_policy])
            if cand is not None and (v[i_press] != cand.press or v[i_kv] is None or abs(v[i_kv] - cand.kv_retained) > 1e-12):
                raise CertkvError(
                    f"request {request_id!r}: the record of {v[i_policy]!r} has press {v[i_press]!r} at kv_retained {v[i_kv]}, "
                    f"the contract says {cand.press!r} at {cand.kv_retained}"
                )

    # -- export --------------------------------------------------------------------------------

    def export(self, path: str | Path, format: str | None = None) -> int:
        """Write every record to CSV or JSONL atomically (temp file + rename); return the record count.

        `format` defaults to the file suffix. CSV columns are the record columns then the extra
        signals, sorted; JSONL lines carry the same keys.
        """
        path = Path(path)
        fmt = (format or path.suffix.lstrip(".")).lower()
        if fmt not in ("csv", "jsonl"):
            raise CertkvError(f"export format must be csv or jsonl, got {fmt or 'none'!r}")
        records = self.records()
        with atomic_write(path, newline="") as fh:
            write_records(records, fh, fmt)
        return len(records)


def write_records(records: list[dict[str, Any]], fh: IO[str], fmt: str) -> None:
    """Write record dicts to an open text file as csv or jsonl (one CSV row or JSONL line per record)."""
    if fmt == "jsonl":
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        return
    extra_keys = sorted({k for r in records for k in r} - set(COLUMNS))
    writer = csv.DictWriter(fh, fieldnames=[*COLUMNS, *extra_keys], lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow({k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in r.items()})
