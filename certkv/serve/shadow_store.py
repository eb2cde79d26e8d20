"""The shadow store: live loss records of a deployed operating point, in the calibration format.

``certkv serve`` answers a random share of its evicted requests a second time from the full cache
(a *shadow*, :mod:`certkv.serve.shadow`). Each shadow is written here as one record pair, so that
live traffic can be audited and re-certified with the tools that read calibration records::

    certkv export SHADOW_STORE                      # -> SHADOW_STORE/records.csv
    certkv certify CONTRACT --records SHADOW_STORE/records.csv

Format. A shadow store IS a calibration store (:class:`certkv.calibration.store.CalibrationStore`:
the same ``records`` table, :data:`~certkv.calibration.store.COLUMNS`, record encoding, checks and
export), bound in its ``meta`` table to an operating point instead of a contract: ``kind`` is
``shadow``, ``operating_point_sha256`` the hash of the deployed point's JSON, ``policy`` /
``base_policy`` what it deploys. ``contract_sha256`` (which ``CalibrationStore.read`` requires) is
``shadow:<operating point hash>``, so the store can never be mistaken for the calibration store
of a contract (``certkv certify CONTRACT`` refuses it; ``--records`` of its export is the way in).
Reopening the folder with the same operating point appends; with another one is an error (two
deployments' records would mix).

Durability is the calibration store's: WAL, ``synchronous=FULL``, one transaction per shadow
holding both of its records, so a SIGKILL leaves whole shadows or none.

The record rule (one pair per shadowed request)
-----------------------------------------------
* a ``full`` record: the full-cache answer, ``utility = utility_full``, loss 0, memory 1.0, the
  request's ``context_tokens`` and signals;
* a record for the deployed point's **base policy** (``op.base_policy``: the ungated candidate, e.g.
  ``snapkv@0.50`` for ``snapkv@0.50+drop0.1``), with its press and nominal ``kv_retained`` (the
  candidate's, so the table is consistent), the served answer, ``utility``, ``utility_full``,
  ``loss = utility_full − utility``, ``memory`` = the retention of the cache that answered (1.0
  when the served answer came from the full cache), ``kv_retained_actual`` and every signal of
  the served :class:`~certkv.runtime.certified_runtime.Decision` (``agreement_drop``,
  ``certificate_max``, ``confidence_min``, ``logprob_mean``, ``lookahead_mass``,
  ``lookahead_heads``, ``learned_score``) plus ``reason``, ``mode``, ``gate_kind``, the served
  ``deployed_policy`` and the monitor's ``stream`` in ``extra``.

Gated candidates are never read from a loss table: certkv derives them from their base
candidate's records and signals (:mod:`certkv.core.gated`). Recording under the base policy with the
signals therefore lets a contract that lists the base policy certify it (ungated), and a
contract with the deployed gate derive the gated candidate from the same records. What the records
estimate: the service only shadows *evicted* answers (a full-cache answer cannot violate), each
with an independent coin, so the records are a random sample of the evicted requests, and their
certificate bounds the violation rate among evicted requests, which is at least the deployed
rate over all requests (a conservative reading of the deployment, never an optimistic one). A
shadowed answer that came from the full cache (possible only when a caller shadows it on purpose)
is recorded with loss 0 and memory 1.0, as the derived gated records of calibration would be.

Stratified operating points deploy a different policy per stratum, and a loss table must
evaluate every policy on every request, so one table cannot hold them: the store then keeps one
calibration-format store per stratum, ``<store>/<stratum>/records.sqlite`` (each bound to its
stratum's operating point, certified by a contract listing that stratum's base policy), and
``<store>/strata.json`` names them. Records carry ``task`` = the stratum (and ``stratum`` too when the
strata are not by task), as calibration records do.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from certkv.atomic_io import write_text_atomic
from certkv.calibration.database import connect, table_names
from certkv.calibration.store import CalibrationStore, check_store_format, db_path, initialise, read_meta
from certkv.core.operating_point import OperatingPoint
from certkv.core.policy_names import REFERENCE_POLICY
from certkv.errors import CertkvError

KIND = "shadow"
STRATA_INDEX = "strata.json"
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def operating_point_sha256(op: OperatingPoint) -> str:
    """Hash of the operating point's canonical JSON (what the store is bound to)."""
    text = json.dumps(op.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stratum_folder(name: str) -> str:
    """The sub-folder of a stratum: its name when it is a safe file name, else a hash of it."""
    if _SAFE_NAME.fullmatch(name) and name not in (".", ".."):
        return name
    return "stratum-" + hashlib.sha256(name.encode("utf-8")).hexdigest()[:12]


def _open_bound(folder: Path, op: OperatingPoint, stratum: str | None) -> CalibrationStore:
    """The calibration-format store of `op` at `folder`: created, or resumed when bound to `op`."""
    from certkv import __version__

    if folder.exists() and not folder.is_dir():
        raise CertkvError(f"shadow store path {folder} is a file; a store is a folder, choose another path")
    folder.mkdir(parents=True, exist_ok=True)
    file = db_path(folder)
    sha = operating_point_sha256(op)
    conn = connect(file, check_same_thread=False, what="certkv shadow store")
    if table_names(conn):
        meta = read_meta(conn, file)
        if meta.get("kind") != KIND:
            conn.close()
            raise CertkvError(
                f"{file} is not a certkv shadow store (a calibration store?); choose another --shadow-store path"
            )
        check_store_format(conn, meta, file)
        if meta.get("operating_point_sha256") != sha:
            conn.close()
            raise CertkvError(
                f"shadow store {folder} belongs to another operating point (sha256 "
                f"{str(meta.get('operating_point_sha256'))[:12]}, this one {sha[:12]}); two deployments' "
                "records would mix: choose another --shadow-store path"
            )
        return CalibrationStore(conn, folder, None)
    meta = {
        "kind": KIND,
        "contract_sha256": f"shadow:{sha}",
        "operating_point_sha256": sha,
        "calibration_contract_sha256": op.contract_sha256 or "",
        "records_sha256": op.records_sha256 or "",
        "policy": op.policy,
        "base_policy": op.base_policy,
        "stratum": "" if stratum is None else stratum,
        "operating_point": op.to_json(),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "certkv_version": __version__,
    }
    initialise(conn, meta)
    return CalibrationStore(conn, folder, None)


class ShadowStore:
    """Live record pairs of one deployed operating point (module docstring: format and rule).

    Parameters
    ----------
    path : Path
        The store folder (created). A pooled operating point writes ``<path>/records.sqlite``; a
        stratified one ``<path>/<stratum>/records.sqlite`` per stratum that does not fall back.
    operating_point : OperatingPoint
        The deployed point the records are bound to.

    Thread-safe: one lock serialises writes (the server writes from its worker thread).
    """

    def __init__(self, path: Path, operating_point: OperatingPoint) -> None:
        self.path = Path(path)
        self.operating_point = operating_point
        self._lock = threading.Lock()
        self._stores: dict[str | None, CalibrationStore] = {}
        strata = operating_point.strata  # None: a pooled point
        self._by = strata.by if strata is not None else None
        try:
            if strata is not None:
                index: dict[str, str] = {}
                for name, entry in strata.entries.items():
                    if entry.fallback:
                        continue  # every answer is the full cache's: nothing is ever shadowed
                    sub = stratum_folder(name)
                    if sub in index.values():
                        raise CertkvError(f"strata {name!r} and another share the folder name {sub!r}")
                    index[name] = sub
                    self._stores[name] = _open_bound(self.path / sub, entry, name)
                self.path.mkdir(parents=True, exist_ok=True)
                write_text_atomic(self.path / STRATA_INDEX, json.dumps(
                    {"kind": KIND, "by": self._by, "operating_point_sha256": operating_point_sha256(operating_point),
                     "strata": index}, indent=2, ensure_ascii=False) + "\n")
            else:
                if operating_point.fallback:
                    raise CertkvError("the operating point falls back to the full cache: it has nothing to shadow")
                self._stores[None] = _open_bound(self.path, operating_point, None)
        except BaseException:
            self.close()
            raise

    # -- where records go -------------------------------------------------------------------

    @property
    def strata(self) -> list[str]:
        """The strata with a store of their own (empty for a pooled point)."""
        return [s for s in self._stores if s is not None]

    def folder(self, stratum: str | None = None) -> Path:
        """The calibration-format store folder that `stratum`'s records go to (``certkv export`` it)."""
        return self._store(stratum).path

    def _store(self, stratum: str | None) -> CalibrationStore:
        if not self._stores:
            raise CertkvError(f"shadow store {self.path} is closed")
        if not self.operating_point.is_stratified:
            return self._stores[None]
        if stratum not in self._stores:
            known = ", ".join(self.strata) or "none"
            raise CertkvError(
                f"stratum {stratum!r} has no shadow store (the operating point's non-fallback strata: {known}); "
                "full-cache answers are never shadowed"
            )
        return self._stores[stratum]

    def _stratum_of(self, record: Mapping[str, Any]) -> str | None:
        if self._by is None:
            return None
        key = "task" if self._by == "task" else "stratum"
        return record.get(key, record.get("task"))

    # -- writing / reading ------------------------------------------------------------------

    def write(self, records: list[Mapping[str, Any]]) -> None:
        """Write the records of ONE shadowed request (its ``full`` record and its base-policy record)
        in one transaction: all or nothing. A request id already present is an error."""
        if not records:
            raise CertkvError("a shadow needs its records (full and the deployed policy)")
        ids = {str(r.get("request_id")) for r in records}
        if len(ids) != 1 or None in (r.get("request_id") for r in records):
            raise CertkvError(f"the records of one shadow must share one request_id, got {sorted(ids)}")
        strata = {self._stratum_of(r) for r in records}
        if len(strata) != 1:
            raise CertkvError(f"the records of one shadow must share one stratum, got {sorted(map(str, strata))}")
        if not any(r.get("policy") == REFERENCE_POLICY for r in records):
            raise CertkvError(f"a shadow needs its {REFERENCE_POLICY!r} record")
        with self._lock:
            self._store(strata.pop()).write_request(ids.pop(), records)

    def has(self, request_id: str, stratum: str | None = None) -> bool:
        """Whether `request_id`'s pair is already in `stratum`'s store (a pooled point: the one store)."""
        with self._lock:
            return self._store(stratum)._present(str(request_id))

    def count(self) -> int:
        """Shadowed requests recorded (each one full record plus one deployed-policy record)."""
        with self._lock:
            return sum(s.request_count() for s in self._stores.values())

    def records(self, stratum: str | None = None) -> list[dict[str, Any]]:
        """The records of `stratum`'s store (a pooled point: all records), in write order."""
        with self._lock:
            return self._store(stratum).records()

    def export(self, path: str | Path, stratum: str | None = None, format: str | None = None) -> int:
        """Write `stratum`'s records (a pooled point: all) as CSV or JSONL; returns the record count."""
        with self._lock:
            return self._store(stratum).export(path, format)

    def close(self) -> None:
        """Close every database (idempotent); committed shadows are already on disk."""
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
            for store in stores:
                try:
                    store.close()
                except sqlite3.Error:
                    pass

    def __enter__(self) -> ShadowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KIND", "STRATA_INDEX", "ShadowStore", "operating_point_sha256", "stratum_folder"]
