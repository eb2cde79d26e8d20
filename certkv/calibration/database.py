"""The SQLite setup every certkv store shares: how a database is opened and how it is written.

The calibration store (:mod:`certkv.calibration.store`) and the serving shadow store
(:mod:`certkv.serve.shadow_store`) keep their records in the same format, so they open their
databases the same way: WAL journal, ``synchronous=FULL`` (a committed transaction survives a power
loss), autocommit mode so that every write is an explicit :func:`transaction`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from certkv.errors import CertkvError
from certkv.interrupts import critical


def connect(
    path: Path, *, readonly: bool = False, check_same_thread: bool = True, what: str = "certkv calibration store"
) -> sqlite3.Connection:
    """Open the database at `path` (rows as :class:`sqlite3.Row`).

    `readonly` sets ``query_only`` (a URI ``mode=ro`` cannot open a WAL file whose ``-shm`` is
    gone); ``check_same_thread=False`` for a store its owner guards with a lock (the shadow store,
    written by the server's worker and read by its request threads). A file that is not SQLite is
    a one-line :class:`CertkvError` naming `what` was expected.
    """
    try:
        conn = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=check_same_thread)
        if readonly:
            conn.execute("PRAGMA query_only=1")
        else:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
        conn.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
    except sqlite3.DatabaseError as exc:
        raise CertkvError(f"{path} is not a {what} ({exc})") from None
    conn.row_factory = sqlite3.Row
    return conn


def table_names(conn: sqlite3.Connection) -> set[str]:
    """The tables the database holds (none: a new file, or a first open that was killed)."""
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` … ``COMMIT``, rolled back on any exception, as one critical block.

    Ctrl-C and SIGTERM are held until the transaction has committed or rolled back
    (:func:`certkv.interrupts.critical`), so the caller learns of an interrupt only after the
    database is consistent; and the rollback runs only while a transaction is open, so an
    exception raised after SQLite had already ended it (an interrupt outside certkv's handlers,
    right after ``COMMIT`` returned) propagates as itself, never as "no transaction is active".
    """
    with critical():
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
