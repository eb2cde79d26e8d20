"""A compressor-agnostic loss table: one loss per (request, policy), as dense numpy matrices.

certkv certifies anything that can produce, for each calibration request and each candidate
policy, a loss ``utility(full) − utility(candidate)``. The table is built from the calibration
store's records (dicts with the record columns of docs/design.md, "File formats") or from a plain CSV/JSONL file with at
least ``request_id, policy, kv_retained, loss``. Optional columns:

* ``task``: the request's task, for the per-task breakdown (the guarantee covers the task mix);
* ``press``: the eviction method; derived from a ``press@0.50`` policy name when absent;
* ``kv_retained_actual``: the realised retention, reported next to the nominal one;
* ``memory``: the KV fraction the policy actually used on that request (defaults to
  ``kv_retained``). A gated candidate that falls back to the full cache has memory 1.0 there;
* ``agreement_drop``: the request's agreement drop (a gate signal, docs/design.md "Gate signals"), the
  same on every row of a request (the ``full`` row included); blank/null where not recorded;
* ``certificate_max``: the candidate's largest survey-variance certificate on that request
  (certkv's probabilistic press only); blank/null elsewhere;
* ``confidence_min`` / ``logprob_mean``: the lowest token probability and the mean token
  log-probability of the candidate's own greedy answer (the confidence gate's signal);
* ``lookahead_mass`` and ``lookahead_heads``: the full-cache attention mass the lookahead probe's
  queries put on the context entries the candidate evicts, max over heads, and per (layer, KV
  head), layer-major (a JSON list; in a CSV cell, the list as JSON text);
* ``context_tokens``: the request's context length in tokens (any row of the request, usually the
  ``full`` row; one value per request);
* ``stratum``: the request's value of a ``strata: {by: metadata.<key>}`` contract's field (each
  stratum is certified on its own; one value per request, like ``task``); ``by: task`` reads the
  ``task`` column;
* ``group``: the request's context group (requests that ask about the same context share it; a
  grouped certificate samples contexts, not requests: :mod:`certkv.core.grouped`). One value per
  request, like ``task``; when the column is present every request needs one.

The signal columns are optional, NaN (None for ``lookahead_heads``) where a row lacks them; a gate
that needs a missing one refuses the table (:mod:`certkv.core.gated`).

Gated candidates (``snapkv@0.50+drop0.1``) are not read from the input: :mod:`certkv.core.gated`
derives them from their base candidate's rows and these signals, and records what it derived in
``LossTable.gated``.

Rows with ``policy == "full"`` are the reference: they only contribute request ids and tasks.

The table is validated strictly, because a silently dropped or duplicated row changes n or k and
therefore the certificate: every (request, policy) pair appears once and every policy is evaluated
on the same set of requests.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import NamedTuple, TypeGuard

import numpy as np

from certkv.core.policy_names import REFERENCE_POLICY, parse_policy_name
from certkv.core.signals import BY_NAME, RECORDED, Signal
from certkv.core.spec import GateSettings
from certkv.errors import CertkvError

REQUIRED_COLUMNS = ("request_id", "policy", "kv_retained", "loss")
#: The optional columns: the table's own, then every recorded gate signal (:mod:`certkv.core.signals`).
#: A generation's KV bytes over a 16-bit full cache's: at its peak, and over its decoding steps.
BYTE_COSTS = ("kv_peak_bytes", "kv_time_bytes")
OPTIONAL_COLUMNS = ("task", "press", "kv_retained_actual", "memory", *(s.name for s in RECORDED), "stratum", "group",
                    *BYTE_COSTS)
#: Per-(policy, request) float signals, (P, R) each.
CANDIDATE_SIGNALS = tuple(s.name for s in RECORDED if s.per == "candidate" and s.kind == "scalar")


@dataclass(frozen=True)
class GatedRow:
    """How a gated row of a table was derived (by :func:`certkv.core.gated.derive_gated`): from
    `base_policy` behind `gate` (its settings, :class:`certkv.core.spec.GateSettings`);
    `gated_count` of the table's requests went to the full cache (`gated_share` of them).

    Examples
    --------
    >>> from certkv.core.gated import derive_gated
    >>> from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0, "agreement_drop": 0.05 * i}
    ...         for i in range(4)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.5, confidence=0.9, sequences=[["p@0.50+drop0.1"]],
    ...     candidate_info={"p@0.50+drop0.1": CandidateInfo(base_policy="p@0.50", gate=GateSettings(agreement_drop=0.1))})
    >>> row = derive_gated(LossTable.from_records(rows), spec).gated["p@0.50+drop0.1"]
    >>> row.base_policy, row.gate.agreement_drop, row.gated_count, row.gated_share  # drops 0 and 0.05 are < 0.1
    ('p@0.50', 0.1, 2, 0.5)
    """

    base_policy: str
    gate: GateSettings
    gated_count: int
    gated_share: float


@dataclass(frozen=True, eq=False)
class LossTable:
    """Losses of P candidate policies on the same R requests.

    Matrices are indexed ``[policy, request]``. ``request_ids`` are sorted (canonical order);
    ``policies`` keep the order in which they first appear in the input. ``signals`` holds the
    recorded gate signals (:data:`certkv.core.signals.RECORDED`) that any row has, NaN where a row
    lacks one: a request signal has shape (R,), a candidate signal (P, R), a per-head one
    (P_recorded, R, F), covering the policies read from the input, which come first (derived gated
    rows appended after them have no per-head masses). Each is also an attribute
    (``table.agreement_drop``), None when no row has it. ``gated`` maps each derived gated policy
    to how it was derived; it is empty for a table read from records. ``groups`` holds each
    request's context group (the ``group`` column), None when the input has none.

    Examples
    --------
    >>> rows = [{"request_id": r, "policy": p, "kv_retained": kv, "loss": loss}
    ...         for r, p, kv, loss in [("r1", "p@0.50", 0.5, 1.0), ("r0", "p@0.50", 0.5, 0.0), ("r0", "full", 1.0, 0.0)]]
    >>> rows.append({"request_id": "r1", "policy": "full", "kv_retained": 1.0, "loss": 0.0})
    >>> table = LossTable.from_records(rows)
    >>> table.request_ids, table.policies, table.press  # ids sorted; "full" is the reference, not a candidate
    (('r0', 'r1'), ('p@0.50',), ('p',))
    >>> table.loss[table.index_of("p@0.50")].tolist(), table.n_requests
    ([0.0, 1.0], 2)
    """

    request_ids: tuple[str, ...]
    policies: tuple[str, ...]
    press: tuple[str, ...]
    kv_retained: np.ndarray
    loss: np.ndarray
    memory: np.ndarray
    kv_retained_actual: np.ndarray | None
    tasks: tuple[str | None, ...] | None
    source: str = "records"
    gated: Mapping[str, GatedRow] = field(default_factory=dict)
    strata: tuple[str | None, ...] | None = None
    signals: Mapping[str, np.ndarray] = field(default_factory=dict)
    groups: tuple[str, ...] | None = None
    byte_costs: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __getattr__(self, name: str):
        # A declared signal reads as an attribute (None when the table has none of it).
        if name in BY_NAME:
            return self.__dict__.get("signals", {}).get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def n_requests(self) -> int:
        return len(self.request_ids)

    def index_of(self, policy: str) -> int:
        """Row of ``policy``; a one-line error names the available policies when it is absent."""
        try:
            return self._index[policy]
        except KeyError:
            raise CertkvError(
                f"{self.source}: no records for policy {policy!r}; policies present: {_preview(self.policies)}"
            ) from None

    @property
    def _index(self) -> dict[str, int]:
        cached = self.__dict__.get("_index_cache")
        if cached is None:
            cached = {p: i for i, p in enumerate(self.policies)}
            object.__setattr__(self, "_index_cache", cached)
        return cached

    def __contains__(self, policy: object) -> bool:
        return policy in self._index

    def take_requests(self, columns: Sequence[int] | np.ndarray, source: str | None = None) -> LossTable:
        """The table restricted to the requests at `columns` (indices into ``request_ids``, in
        increasing order, so the canonical sorted order is kept); ``gated`` shares are not
        recounted, so take requests before deriving gated rows.

        columns : (n_kept,) int array (or sequence) of request indices.
        """
        columns = np.asarray(columns, dtype=np.int64)
        if columns.size and (np.diff(columns) <= 0).any():
            raise ValueError("take_requests needs increasing request indices")

        def cut(array, axis=1):
            return None if array is None else np.take(array, columns, axis=axis)

        return replace(
            self,
            request_ids=tuple(self.request_ids[int(i)] for i in columns),
            tasks=None if self.tasks is None else tuple(self.tasks[int(i)] for i in columns),
            strata=None if self.strata is None else tuple(self.strata[int(i)] for i in columns),
            groups=None if self.groups is None else tuple(self.groups[int(i)] for i in columns),
            loss=cut(self.loss),
            memory=cut(self.memory),
            kv_retained_actual=cut(self.kv_retained_actual),
            signals={name: cut(values, 0 if BY_NAME[name].per == "request" else 1) for name, values in self.signals.items()},
            byte_costs={name: cut(values) for name, values in self.byte_costs.items()},
            source=source or self.source,
        )

    def signals_of(self, row: int, columns: Sequence[int] | np.ndarray | None = None) -> dict[str, np.ndarray | None]:
        """The gate signals of policy row `row` (optionally at request `columns`), as arrays keyed
        like :func:`certkv.core.gate_features.feature_matrix` reads them (None where absent).

        columns : (n_kept,) int array (or sequence) of request indices; None: every request. Each
        signal comes back as (n_kept,), or (n_kept, F) for a per-head one.
        """
        sel = slice(None) if columns is None else np.asarray(columns, dtype=np.int64)
        out: dict[str, np.ndarray | None] = {s.name: None for s in RECORDED}
        for name, values in self.signals.items():
            if BY_NAME[name].per == "request":
                out[name] = values[sel]
            elif row < values.shape[0]:  # per-head masses cover the recorded policies only
                out[name] = values[row][sel]
        return out

    @classmethod
    def from_records(cls, records: Iterable[Mapping], *, source: str = "records") -> LossTable:
        """Build from dicts (the calibration store's rows); extra keys are ignored."""
        rows = records if isinstance(records, list) else list(records)
        return _build(_columns_from_mappings(rows, source, _record_where), source, _record_where)


# ----------------------------------------------------------------------------- readers


def read_loss_table(path: str | os.PathLike[str]) -> LossTable:
    """Read a CSV or JSONL loss table, choosing the format from the file suffix.

    Examples
    --------
    >>> import tempfile
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = Path(folder) / "losses.csv"
    ...     _ = path.write_text("request_id,policy,kv_retained,loss\\nr0,p@0.50,0.5,0\\nr1,p@0.50,0.5,1\\n")
    ...     table = read_loss_table(path)  # the suffix picks the CSV reader
    >>> table.policies, table.loss.tolist()
    (('p@0.50',), [[0.0, 1.0]])
    """
    path = Path(path)
    if not path.is_file():
        raise CertkvError(f"loss table not found: {path}; check the path or export the store first")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return read_csv(path)
    if suffix in (".jsonl", ".ndjson"):
        return read_jsonl(path)
    raise CertkvError(f"{path}: unknown loss-table format {suffix!r}; use a .csv or .jsonl file")


def read_csv(path: str | os.PathLike[str]) -> LossTable:
    """Read a CSV loss table with a header row; empty optional cells count as absent.

    Examples
    --------
    >>> import tempfile
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = Path(folder) / "losses.csv"
    ...     _ = path.write_text("request_id,policy,kv_retained,loss,task\\nr0,p@0.50,0.5,0,\\nr1,p@0.50,0.5,1,qa\\n")
    ...     table = read_csv(path)
    >>> table.tasks  # the blank task cell reads as absent
    (None, 'qa')
    """
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise CertkvError(f"loss table not found: {path}; check the path or export the store first")
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        for column in REQUIRED_COLUMNS:
            if column not in header:
                raise CertkvError(
                    f"{source}: missing column {column!r} (columns found: "
                    f"{', '.join(header) or 'none'}); a loss table needs "
                    f"{', '.join(REQUIRED_COLUMNS)}"
                )
        rows, lines = [], []
        for row in reader:
            rows.append(row)
            lines.append(reader.line_num)
    where = _line_where(lines)
    columns = _columns_from_mappings(rows, source, where, blank_is_missing=True)
    return _build(columns, source, where)


def read_jsonl(path: str | os.PathLike[str]) -> LossTable:
    """Read a JSONL loss table: one JSON object per line; blank lines are skipped.

    Examples
    --------
    >>> import tempfile
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = Path(folder) / "losses.jsonl"
    ...     _ = path.write_text('{"request_id": "r0", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0}\\n\\n'
    ...                         '{"request_id": "r1", "policy": "p@0.50", "kv_retained": 0.5, "loss": 1}\\n')
    ...     table = read_jsonl(path)  # the blank line is skipped
    >>> table.request_ids, table.loss.tolist()
    (('r0', 'r1'), [[0.0, 1.0]])
    """
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise CertkvError(f"loss table not found: {path}; check the path or export the store first")
    rows, lines = [], []
    with open(path, encoding="utf-8") as fh:
        for number, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise CertkvError(f"{source}: line {number}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise CertkvError(f"{source}: line {number}: expected a JSON object per line")
            rows.append(row)
            lines.append(number)
    where = _line_where(lines)
    return _build(_columns_from_mappings(rows, source, where), source, where)


# ----------------------------------------------------------------------------- hashing


def records_sha256(table: LossTable) -> str:
    """SHA-256 of a canonical serialisation of the table, sorted by (request_id, policy).

    Independent of the input's row order and file format, so the same calibration evidence always
    hashes the same; any change to a loss, a memory value, a task or the request set changes it.
    The reference rows (policy ``full``) carry no certification evidence and are not part of it.
    Gated rows are derived from the others (and the contract, hashed separately) and are left
    out, so a table hashes the same before and after :func:`certkv.core.gated.derive_gated`; the gate
    signals are part of it when the table has any (see :attr:`certkv.core.signals.Signal.hash_group`).

    Examples
    --------
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": float(i)} for i in range(2)]
    >>> before = records_sha256(LossTable.from_records(rows))
    >>> len(before), before == records_sha256(LossTable.from_records(rows[::-1]))  # the row order does not count
    (64, True)
    >>> rows[0]["loss"] = 0.5
    >>> before == records_sha256(LossTable.from_records(rows))  # a loss does
    False
    """
    order = sorted((i for i, p in enumerate(table.policies) if p not in table.gated), key=lambda i: table.policies[i])
    header = {
        "format": "certkv-loss-table-v1",
        "request_ids": list(table.request_ids),
        "tasks": list(table.tasks) if table.tasks is not None else None,
        "policies": [table.policies[i] for i in order],
        "press": [table.press[i] for i in order],
        "kv_retained": [float(table.kv_retained[i]) for i in order],
    }
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode("utf-8"))
    # (request, policy) order: transpose the policy-sorted matrices. Adding 0.0 maps -0.0 to 0.0.
    for matrix in (table.loss, table.memory, table.kv_retained_actual):
        if matrix is None:
            digest.update(b"none")
            continue
        block = np.ascontiguousarray(matrix[order].T + 0.0, dtype="<f8")
        digest.update(block.tobytes())
    for name in BYTE_COSTS:  # only where recorded, so a table without them hashes as it always did
        if name in table.byte_costs:
            digest.update(name.encode() + np.ascontiguousarray(table.byte_costs[name][order].T + 0.0, dtype="<f8").tobytes())
    # The joint signals, hashed together whenever either has a value.
    joint = [s for s in RECORDED if s.hash_group == "joint"]
    if any(_has_values(table.signals.get(s.name)) for s in joint):
        for s in joint:
            digest.update(s.name.encode("ascii"))
            values = table.signals.get(s.name)
            if _has_values(values):
                digest.update(_hash_block(s, values, order, table.policies, digest))
    if table.strata is not None:  # hashed only when present: a table without strata hashes as if they did not exist
        digest.update(json.dumps(["stratum", list(table.strata)]).encode("utf-8"))
    if table.groups is not None:  # likewise: a table without groups hashes as before the column existed
        digest.update(json.dumps(["group", list(table.groups)]).encode("utf-8"))
    # The own-hash signals, each only when present.
    for s in RECORDED:
        values = table.signals.get(s.name)
        if s.hash_group == "own" and _has_values(values):
            digest.update(s.name.encode("ascii"))
            digest.update(_hash_block(s, values, order, table.policies, digest))
    return digest.hexdigest()


def _hash_block(s: Signal, values: np.ndarray, order: list[int], policies, digest) -> bytes:
    """A signal's values in (request, policy[, head]) order as little-endian float64 bytes
    (-0.0 folded to 0.0); a per-head signal first names the policies it covers into `digest`."""
    if s.per == "request":
        block = np.atleast_2d(values).T if s.hash_group == "joint" else values
    elif s.kind == "heads":
        recorded = [i for i in order if i < values.shape[0]]
        block = np.swapaxes(values[recorded], 0, 1)  # (R, P, F)
        digest.update(json.dumps([policies[i] for i in recorded]).encode("utf-8"))
    else:
        block = values[order].T
    return np.ascontiguousarray(block + 0.0, dtype="<f8").tobytes()


def _has_values(values: np.ndarray | None) -> TypeGuard[np.ndarray]:
    return values is not None and bool((~np.isnan(values)).any())


# ----------------------------------------------------------------------------- building


def _record_where(i: int) -> str:
    return f"record {i + 1}"


def _line_where(lines: Sequence[int]):
    return lambda i: f"line {lines[i]}"


def _preview(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:limit])
    more = len(names) - limit
    return shown + (f" and {more} more" if more > 0 else "") if names else "none"


def _columns_from_mappings(rows, source: str, where, *, blank_is_missing: bool = False):
    """Pull each known column out of the rows as a list; required ones must be in every row."""
    if not rows:
        raise CertkvError(f"{source}: the loss table has no rows")
    columns: dict[str, list | None] = {}
    for column in REQUIRED_COLUMNS:
        try:
            columns[column] = list(map(itemgetter(column), rows))
        except KeyError:
            bad = next(i for i, row in enumerate(rows) if column not in row)
            raise CertkvError(
                f"{source}: {where(bad)}: missing column {column!r}; a loss table needs {', '.join(REQUIRED_COLUMNS)}"
            ) from None
        except TypeError:
            bad = next(i for i, row in enumerate(rows) if not isinstance(row, Mapping))
            raise CertkvError(f"{source}: {where(bad)}: expected a mapping of column to value") from None
    for column in OPTIONAL_COLUMNS:
        values = [row.get(column) for row in rows]
        if blank_is_missing and "" in values:
            values = [None if v == "" else v for v in values]
        columns[column] = None if values.count(None) == len(values) else values
    return columns


def _head_lists(values, source: str, where) -> list | None:
    """``lookahead_heads`` cells as lists of floats (JSON text in a CSV cell); all one length."""
    out: list = []
    length = None
    for i, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise CertkvError(f"{source}: {where(i)}: lookahead_heads {value[:40]!r} is not a JSON list of numbers") from None
        if not isinstance(value, (list, tuple)) or not value:
            raise CertkvError(f"{source}: {where(i)}: lookahead_heads must be a non-empty list of numbers")
        if length is None:
            length = len(value)
        elif len(value) != length:
            raise CertkvError(
                f"{source}: {where(i)}: lookahead_heads has {len(value)} values, other rows {length}; one value "
                "per (layer, KV head) of the model, the same on every row"
            )
        out.append(value)
    return out if length is not None else None


def _strings(values: list, column: str, source: str, where) -> list[str]:
    """Identifiers as strings; a missing or empty identifier is an error naming the row."""
    # Checked on the distinct values first: a fast path for the usual, valid table.
    out = list(map(str, values))
    if None in values or any(not text.strip() for text in set(out)):
        bad = next(i for i, (raw, text) in enumerate(zip(values, out)) if raw is None or not text.strip())
        raise CertkvError(f"{source}: {where(bad)}: {column} is empty; give every row a {column}")
    return out


def _floats(values: list, column: str, source: str, where, *, optional: bool = False):
    """Numbers as a float array; NaN marks a missing optional value, never a required one."""
    try:
        array = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        array = None
    if array is None or array.shape != (len(values),):
        for i, value in enumerate(values):
            if optional and value is None:
                continue
            try:
                float(value)
            except (TypeError, ValueError):
                raise CertkvError(f"{source}: {where(i)}: {column} {value!r} is not a number") from None
        array = np.array([np.nan if v is None else float(v) for v in values], dtype=float)
    if not optional:
        bad = np.flatnonzero(~np.isfinite(array))
        if bad.size:
            i = int(bad[0])
            raise CertkvError(f"{source}: {where(i)}: {column} {values[i]!r} is not a finite number")
    elif np.isinf(array).any():
        i = int(np.flatnonzero(np.isinf(array))[0])
        raise CertkvError(f"{source}: {where(i)}: {column} {values[i]!r} is not a finite number")
    return array


def _check_range(array, rows, column, low, high, source, where, *, low_open: bool) -> None:
    """Values of ``array`` (indexed by original row numbers ``rows``) within [low or (low, high]."""
    below = array <= low if low_open else array < low
    bad = np.flatnonzero((below | (array > high)) & ~np.isnan(array))
    if bad.size:
        i = int(bad[0])
        interval = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise CertkvError(
            f"{source}: {where(int(rows[i]))}: {column} {float(array[i])!r} is outside "
            f"{interval}; it is a fraction of the KV cache"
        )


def _codes(values: Sequence[str], mapping: dict[str, int]) -> np.ndarray:
    """Integer codes of ``values``, filling the empty ``mapping`` in first-seen order."""
    mapping.update((v, i) for i, v in enumerate(dict.fromkeys(values)))
    return np.fromiter(map(mapping.__getitem__, values), dtype=np.int64, count=len(values))


class _Rows(NamedTuple):
    """Where a table's input rows go: request codes (into the sorted ``universe``) of every row,
    and the candidate rows (policy other than ``full``) as indices into the input."""

    universe: list[str]
    request_codes: np.ndarray
    rows: np.ndarray
    pick: Callable[[list], list]
    where: Callable[[int], str]


def _build(columns: dict, source: str, where) -> LossTable:
    """Validate the columns and scatter them into dense (policy × request) matrices."""
    request_ids = _strings(columns["request_id"], "request_id", source, where)
    policy_names = _strings(columns["policy"], "policy", source, where)
    at = _row_layout(request_ids, policy_names, source, where)
    tasks = _request_tasks(columns["task"], at.request_codes, at.universe, source, where)
    strata = _request_tasks(columns["stratum"], at.request_codes, at.universe, source, where, column="stratum")
    groups = _request_groups(columns["group"], at.request_codes, at.universe, source, where)
    loss, kv, memory, actual = _fractions(columns, at, source, where)
    costs = _byte_costs(columns, at, source, where)
    parsed = {s.name: _parse_signal(s, columns[s.name], at, source, where) for s in RECORDED if columns[s.name] is not None}

    policy_map: dict[str, int] = {}
    pol = _codes(at.pick(policy_names), policy_map)
    req = at.request_codes[at.rows]
    policies = tuple(policy_map)
    n_pol, n_req = len(policies), len(at.universe)
    _check_unique_pairs(pol, req, n_req, at.rows, policies, at.universe, source, where)
    _check_complete(pol, req, n_pol, n_req, policies, at.universe, source)

    def dense(values):
        out = np.empty((n_pol, n_req), dtype=float)
        out[pol, req] = values
        return out

    signals: dict[str, np.ndarray] = {}
    for s in RECORDED:
        values = parsed.get(s.name)
        full: np.ndarray | None = values  # a request signal is (R,) as parsed
        if values is not None and s.per == "candidate" and s.kind == "heads":
            full = _dense_heads(values, pol, req, n_pol, n_req, source, at.where)
        elif values is not None and s.per == "candidate":
            full = dense(values)
        if full is not None and _has_values(full):
            signals[s.name] = full
        elif s.always_present:
            signals[s.name] = np.full(n_req if s.per == "request" else (n_pol, n_req), np.nan)

    press_names = _press_names(columns["press"], at.pick, policy_names, source, at.where)
    press_map: dict[str, int] = {}
    press_dense = dense(_codes(press_names, press_map))
    kv_dense = dense(kv)
    _check_constant(kv_dense, "kv_retained", policies, source)
    _check_constant(press_dense, "press", policies, source)
    press_list = list(press_map)
    return LossTable(
        request_ids=tuple(at.universe),
        policies=policies,
        press=tuple(press_list[int(c)] for c in press_dense[:, 0]),
        kv_retained=kv_dense[:, 0].copy(),
        loss=dense(loss),
        memory=dense(memory),
        kv_retained_actual=None if actual is None else dense(actual),
        tasks=tasks,
        source=source,
        strata=strata,
        signals=signals,
        groups=groups,
        byte_costs={name: dense(values) for name, values in costs.items() if not np.isnan(values).all()},
    )


def _row_layout(request_ids: list[str], policy_names: list[str], source: str, where) -> _Rows:
    """The sorted request universe, every row's request code, and the candidate rows."""
    universe = sorted(set(request_ids))
    request_map = {r: i for i, r in enumerate(universe)}
    request_codes = np.fromiter(map(request_map.__getitem__, request_ids), dtype=np.int64, count=len(request_ids))
    keep = np.fromiter(map(REFERENCE_POLICY.__ne__, policy_names), dtype=bool, count=len(policy_names))
    rows = np.flatnonzero(keep)
    if rows.size == 0:
        raise CertkvError(f"{source}: only reference rows (policy 'full'); add candidate rows")
    row_list = rows.tolist()

    def pick(values):
        return [values[i] for i in row_list] if rows.size != len(keep) else values

    return _Rows(universe, request_codes, rows, pick, lambda i: where(int(rows[i])))  # errors name the input row


def _fractions(columns: dict, at: _Rows, source: str, where):
    """(loss, kv_retained, memory, kv_retained_actual or None) of the candidate rows, checked."""
    loss = _floats(at.pick(columns["loss"]), "loss", source, at.where)
    kv = _floats(at.pick(columns["kv_retained"]), "kv_retained", source, at.where)
    _check_range(kv, at.rows, "kv_retained", 0.0, 1.0, source, where, low_open=True)
    memory = kv
    if columns["memory"] is not None:
        memory = _floats(at.pick(columns["memory"]), "memory", source, at.where, optional=True)
        _check_range(memory, at.rows, "memory", 0.0, 1.0, source, where, low_open=False)
        memory = np.where(np.isnan(memory), kv, memory)
    actual = None
    if columns["kv_retained_actual"] is not None:
        actual = _floats(at.pick(columns["kv_retained_actual"]), "kv_retained_actual", source, at.where, optional=True)
        _check_range(actual, at.rows, "kv_retained_actual", 0.0, 1.0, source, where, low_open=False)
    return loss, kv, memory, actual


def _byte_costs(columns: dict, at: _Rows, source: str, where) -> dict[str, np.ndarray]:
    """The candidate rows' byte shares (:data:`BYTE_COSTS`) where the table has them, checked."""
    costs = {}
    for name in BYTE_COSTS:
        if columns[name] is not None:
            costs[name] = _floats(at.pick(columns[name]), name, source, at.where, optional=True)
            _check_range(costs[name], at.rows, name, 0.0, 1.0, source, where, low_open=False)
    return costs


def _parse_signal(s: Signal, values: list, at: _Rows, source: str, where):
    """One signal column checked: a request signal as its (R,) array (rows of one request must
    agree), a candidate signal as the candidate rows' floats, a per-head one as their lists."""
    if s.per == "request":
        return _request_drops(values, at.request_codes, at.universe, source, where, column=s.name)
    if s.kind == "heads":
        return _head_lists(at.pick(values), source, at.where)
    array = _floats(at.pick(values), s.name, source, at.where, optional=True)
    if s.minimum is not None:
        low = np.flatnonzero(array < s.minimum)
        if low.size:
            i = int(low[0])
            what = "negative" if s.minimum == 0 else f"below {s.minimum:g}"
            raise CertkvError(f"{source}: {at.where(i)}: {s.name} {float(array[i])!r} is {what}; {s.minimum_why}")
    return array


def _dense_heads(heads: list | None, pol, req, n_pol: int, n_req: int, source: str, where) -> np.ndarray | None:
    """Per-head lists of the candidate rows as a (P, R, F) array, NaN where a row has none."""
    if heads is None:
        return None
    n_heads = len(next(h for h in heads if h is not None))
    flat = np.full((len(heads), n_heads), np.nan)
    has = np.fromiter((h is not None for h in heads), dtype=bool, count=len(heads))
    if has.any():
        try:
            flat[has] = np.asarray([h for h in heads if h is not None], dtype=float)
        except (TypeError, ValueError):
            bad = next(i for i, h in enumerate(heads) if h is not None and not _all_numbers(h))
            raise CertkvError(f"{source}: {where(bad)}: lookahead_heads holds a value that is not a number") from None
    if np.isinf(flat).any() or (flat < 0).any():
        bad = int(np.flatnonzero(np.isinf(flat).any(axis=1) | (flat < 0).any(axis=1))[0])
        raise CertkvError(f"{source}: {where(bad)}: lookahead_heads must hold attention masses in [0, 1]")
    out = np.full((n_pol, n_req, n_heads), np.nan)
    out[pol, req] = flat
    return out


def _all_numbers(values) -> bool:
    try:
        [float(v) for v in values]
    except (TypeError, ValueError):
        return False
    return True


def _request_drops(values, request_codes, universe, source, where, column: str = "agreement_drop") -> np.ndarray:
    """The agreement drop (or another per-request `column`) of each request (NaN where no row has
    one); rows of one request that disagree are an error, since the value is a property of the
    request, not of a candidate."""
    n_req = len(universe)
    if values is None:
        return np.full(n_req, np.nan)
    drops = _floats(values, column, source, where, optional=True)
    has = ~np.isnan(drops)
    low = np.full(n_req, np.inf)
    high = np.full(n_req, -np.inf)
    np.minimum.at(low, request_codes[has], drops[has])
    np.maximum.at(high, request_codes[has], drops[has])
    conflict = np.flatnonzero(np.isfinite(low) & (low != high))
    if conflict.size:
        r = int(conflict[0])
        rows_of_r = np.flatnonzero((request_codes == r) & has)
        first = int(rows_of_r[0])
        other = int(rows_of_r[np.flatnonzero(drops[rows_of_r] != drops[first])[0]])
        raise CertkvError(
            f"{source}: request {universe[r]!r} has different {column} values "
            f"({drops[first]!r} at {where(first)}, {drops[other]!r} at {where(other)}); it is "
            "one value per request, identical on every row of it"
        )
    return np.where(np.isfinite(low), low, np.nan)


def _press_names(values, pick, policy_names, source, where) -> list[str]:
    """The press of each candidate row: the column when given, else the part before '@'."""
    names = pick(policy_names)
    prefix = {p: parse_policy_name(p).display for p in set(names)}
    derived = list(map(prefix.__getitem__, names))
    if values is None:
        return derived
    given = pick(values)
    return [d if v is None else str(v) for v, d in zip(given, derived)]


def _request_tasks(values, request_codes, universe, source, where, column: str = "task"):
    """One task (or another per-request label `column`) per request, from any of its rows;
    conflicting values are an error."""
    if values is None:
        return None
    present = [v for v in dict.fromkeys(values) if v is not None]
    task_map = {v: i for i, v in enumerate(present)}
    codes = np.fromiter(map(task_map.get, values, repeat(-1)), dtype=np.int64, count=len(values))
    has = codes >= 0
    n_req = len(universe)
    low = np.full(n_req, np.iinfo(np.int64).max)
    high = np.full(n_req, -1)
    np.minimum.at(low, request_codes[has], codes[has])
    np.maximum.at(high, request_codes[has], codes[has])
    conflict = np.flatnonzero((high >= 0) & (low != high))
    if conflict.size:
        r = int(conflict[0])
        rows_of_r = np.flatnonzero((request_codes == r) & has)
        row = int(rows_of_r[np.flatnonzero(codes[rows_of_r] != codes[rows_of_r[0]])[0]])
        raise CertkvError(
            f"{source}: {where(row)}: request {universe[r]!r} has rows with different {column} values; "
            f"give each request a single {column}"
        )
    names = [str(v) for v in task_map]
    return tuple(names[int(c)] if c >= 0 else None for c in high)


def _request_groups(values, request_codes, universe, source, where) -> tuple[str, ...] | None:
    """One context group per request (:func:`_request_tasks` of the ``group`` column); with the
    column present, a request none of whose rows names its group is an error: a missing group
    would silently make it a context of its own."""
    groups = _request_tasks(values, request_codes, universe, source, where, column="group")
    if groups is None:
        return None
    if None in groups:
        missing = universe[groups.index(None)]
        raise CertkvError(
            f"{source}: request {missing!r} has no group while other requests have one; give every request "
            "its context group (or drop the group column)"
        )
    return tuple(g for g in groups if g is not None)


def _check_unique_pairs(pol, req, n_req, rows, policies, universe, source, where) -> None:
    """Each (request_id, policy) pair must appear once; a duplicate would inflate n."""
    flat = pol * n_req + req
    counts = np.bincount(flat, minlength=len(policies) * n_req)
    if counts.max() > 1:
        key = int(np.flatnonzero(counts > 1)[0])
        first, second = np.flatnonzero(flat == key)[:2]
        raise CertkvError(
            f"{source}: duplicate row for request {universe[key % n_req]!r} and policy "
            f"{policies[key // n_req]!r} ({where(int(rows[first]))} and "
            f"{where(int(rows[second]))}); keep one row per (request_id, policy)"
        )


def _check_complete(pol, req, n_pol, n_req, policies, universe, source) -> None:
    """Every policy must be evaluated on every request of the table (the same request set)."""
    per_policy = np.bincount(pol, minlength=n_pol)
    short = np.flatnonzero(per_policy < n_req)
    if short.size:
        p = int(short[0])
        covered = np.zeros(n_req, dtype=bool)
        covered[req[pol == p]] = True
        example = universe[int(np.flatnonzero(~covered)[0])]
        others = f" ({short.size - 1} other policies are incomplete too)" if short.size > 1 else ""
        raise CertkvError(
            f"{source}: policy {policies[p]!r} is missing {n_req - int(per_policy[p])} of "
            f"{n_req} requests (e.g. {example!r}){others}; every policy must be evaluated on the "
            "same requests"
        )


def _check_constant(dense: np.ndarray, column: str, policies, source) -> None:
    """A policy has one nominal kv_retained and one press; differing rows are an input error."""
    varies = np.flatnonzero(dense.max(axis=1) != dense.min(axis=1))
    if varies.size:
        raise CertkvError(
            f"{source}: policy {policies[int(varies[0])]!r} has rows with different {column} "
            "values; give each policy a single " + column
        )


__all__ = [
    "CANDIDATE_SIGNALS",
    "GatedRow",
    "LossTable",
    "OPTIONAL_COLUMNS",
    "REQUIRED_COLUMNS",
    "read_csv",
    "read_jsonl",
    "read_loss_table",
    "records_sha256",
]
