"""The certifier's result: the operating point, with every candidate's evidence, as JSON.

An :class:`OperatingPoint` is what ``certkv certify`` writes (``operating_point.json``) and what
the runtime deploys: the chosen candidate (or the full-cache fallback), its press, kwargs, gate
and retention, the counts and bounds behind the decision, every candidate's result
(:class:`CandidateResult`), where each sequence stopped (:class:`SequenceResult`), per-task
breakdowns and the guarantee in words, bound to the contract and records by their hashes.
Torch-free.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from certkv._version import __version__
from certkv.atomic_io import write_text_atomic
from certkv.core.coverage import Coverage
from certkv.core.file_format import check_format_version
from certkv.core.pilot import PilotInfo
from certkv.core.procedures import Procedure
from certkv.core.spec import CertificationSpec, GateSettings, GroupingConfig
from certkv.errors import CertkvError, format_validation_error

#: The layout of ``operating_point.json`` (:mod:`certkv.core.file_format`): a reader takes this
#: version only, and a file of another is refused with the command that writes it again.
FORMAT_VERSION = 1

#: What writes an operating point, named when a file of another version is refused.
REWRITE = "certkv certify CONTRACT"


def certified_at() -> str:
    """Now, as the ``created`` stamp of an operating point (UTC, seconds, ``Z``).

    Examples
    --------
    >>> stamp = certified_at()  # e.g. 2026-01-31T12:00:00Z
    >>> len(stamp), stamp[10], stamp[-1]
    (20, 'T', 'Z')
    """
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def certkv_version() -> str:
    """The installed certkv version, recorded in every operating point.

    Examples
    --------
    >>> import certkv
    >>> certkv_version() == certkv.__version__
    True
    """
    return __version__


class ContractSummary(BaseModel):
    """The contract terms a result was computed under; ``utility`` (null for a bare loss table's
    spec) is the score calibration used, which a live monitor must use too.

    Examples
    --------
    >>> from certkv.core.spec import CertificationSpec
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> ContractSummary.of(spec)
    ContractSummary(tolerance=0.0, risk=0.1, confidence=0.9, procedure='fixed_sequence', utility=None,
                    kv_cost='kv_retained', grouping=None)

    ``grouping`` is the grouped measure the risk bounds and how it was tested
    (:mod:`certkv.core.grouped`), null when requests are the sampling unit.
    """

    model_config = ConfigDict(extra="forbid")
    tolerance: float
    risk: float
    confidence: float
    procedure: Procedure
    utility: str | None = None
    kv_cost: str = "kv_retained"  # what mean_kv_retained averages: the nominal share, or a generation's peak / KV-time
    grouping: GroupingConfig | None = None

    @classmethod
    def of(cls, spec: CertificationSpec) -> ContractSummary:
        """The contract terms a result reports, taken from the spec it was computed under."""
        return cls(
            tolerance=spec.tolerance, risk=spec.risk, confidence=spec.confidence, procedure=spec.procedure,
            utility=spec.utility, kv_cost=spec.kv_cost, grouping=spec.grouping,
        )


class TaskBreakdown(BaseModel):
    """Violations of one policy within one task; ``exceeds_risk`` when the task's own rate > ε.

    A task above ε does not break the certificate (which covers the task mix), but a user who
    cares about that task on its own should know.

    Examples
    --------
    >>> TaskBreakdown(n=50, violations=4, rate=0.08, exceeds_risk=True)  # 8% > ε = 5% on this task alone
    TaskBreakdown(n=50, violations=4, rate=0.08, exceeds_risk=True)
    """

    model_config = ConfigDict(extra="forbid")
    n: int
    violations: int
    rate: float
    exceeds_risk: bool


class CandidateResult(BaseModel):
    """The evidence for one candidate.

    ``level`` is the significance level its p-value was compared with (δ/m for fixed-sequence
    with m sequences, δ/N for Bonferroni, Holm's step-down level δ/(N − rank)), and
    ``risk_upper_bound`` is the Clopper–Pearson bound at confidence ``1 − level``, so that
    ``p_value <= level`` ⇔ ``risk_upper_bound <= ε``. ``mean_kv_retained`` is the mean KV fraction
    actually used (the memory column; gated fallbacks count 1.0).

    Under a grouped spec (:mod:`certkv.core.grouped`) ``n`` and ``violations`` still count
    questions (requests), ``n_contexts`` counts the contexts, ``grouped_risk`` is the contract's
    measure estimated on them, and ``p_value`` and ``risk_upper_bound`` are the grouped ones (a
    Hoeffding–Bentkus bound, or Clopper–Pearson over contexts for ``any_question``); both
    grouped fields are null otherwise.

    Examples
    --------
    >>> from certkv.core.certify import certify
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": float(i < 2)} for i in range(100)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> c = certify(LossTable.from_records(rows), spec).candidates[0]
    >>> c.policy, c.violations, c.level, round(c.risk_upper_bound, 4), c.certified  # Clopper–Pearson at 1 − level
    ('p@0.50', 2, 0.1, 0.0523, True)
    """

    model_config = ConfigDict(extra="forbid")
    policy: str
    press: str
    kv_retained: float
    mean_kv_retained: float
    kv_retained_actual: float | None = None
    peak_kv_bytes: float | None = None
    """The mean over requests of the bytes its KV held at its peak over a 16-bit full cache's
    (gated fallbacks count 1.0; null when the records lack them); ``mean_kv_bytes`` the same over
    the decoding steps (the bytes' KV-time)."""
    mean_kv_bytes: float | None = None
    n: int
    violations: int
    empirical_risk: float
    risk_upper_bound: float
    p_value: float
    level: float
    certified: bool
    sequence: int
    position: int
    per_task: dict[str, TaskBreakdown] = Field(default_factory=dict)
    gate: GateSettings | None = None
    gated_share: float = 0.0
    n_contexts: int | None = None
    grouped_risk: float | None = None


class SequenceResult(BaseModel):
    """Where testing of one sequence ended (``stopped_at``: first non-certified position).

    Examples
    --------
    >>> from certkv.core.certify import certify
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": f"r{i}", "policy": p, "kv_retained": kv, "loss": float(kv < 0.5 and i < 30)}
    ...         for i in range(100) for p, kv in (("p@0.70", 0.7), ("p@0.30", 0.3))]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.70", "p@0.30"]])
    >>> s = certify(LossTable.from_records(rows), spec).sequences[0]
    >>> s.tested, s.certified, s.stopped_at, s.stopped_policy
    (2, 1, 1, 'p@0.30')
    """

    model_config = ConfigDict(extra="forbid")
    index: int
    policies: list[str]
    level: float | None
    tested: int
    certified: int
    stopped_at: int | None
    stopped_policy: str | None


class OperatingPoint(BaseModel):
    """The certified choice and the evidence for it; serialises to ``operating_point.json``
    (docs/design.md, "File formats").

    Top-level ``n``, ``violations``, ``risk_upper_bound`` and ``p_value`` are the chosen
    candidate's. On a fallback they describe the full cache, which loses nothing by definition:
    0 violations, bound 0.0 and no p-value (null); ``reason`` says what failed.
    ``kv_retained`` is nominal, ``mean_kv_retained`` the mean memory actually used and
    ``kv_retained_actual`` the mean realised retention (null when the records lack it).

    Deployment: ``base_policy`` is the ungated candidate, ``press_kwargs`` its press's kwargs
    (from the contract; {} for a bare loss table), ``gate`` the runtime gate (null: none) and
    ``gated_share`` the share of calibration requests that gate sent to the full cache.

    ``format_version`` is the file's layout (:data:`FORMAT_VERSION`, written first); a point of
    another version is refused, by :func:`load_operating_point` with the command that rewrites it.

    Examples
    --------
    >>> from certkv.core.certify import certify
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(100)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> op = certify(LossTable.from_records(rows), spec)
    >>> op.policy, op.fallback, op.n, op.is_stratified, op.to_dict()["policy"]
    ('p@0.50', False, 100, False, 'p@0.50')
    """

    model_config = ConfigDict(extra="forbid")
    format_version: int = FORMAT_VERSION
    policy: str
    base_policy: str
    press: str
    press_kwargs: dict[str, Any] = Field(default_factory=dict)
    kv_retained: float
    gate: GateSettings | None = None
    gated_share: float = 0.0
    max_new_tokens: int | None = None
    """Decode length the candidates were calibrated with; the runtime deploys exactly that."""
    query_aware: bool = False
    """The protocol: true when the question was prefilled with the context, so the press saw it
    before evicting (contract ``protocol.query_aware``); a runtime deploys the same protocol."""
    mean_kv_retained: float
    kv_retained_actual: float | None = None
    peak_kv_bytes: float | None = None
    """The chosen candidate's KV bytes over a 16-bit full cache's, at each request's peak and over its
    decoding steps, the mean over requests (:class:`CandidateResult`); null when not recorded."""
    mean_kv_bytes: float | None = None
    kv_format: dict[str, Any] | None = None
    """The KV format the point stores its keys and values in (certkv.kv_formats.spec; null: 16 bits)."""
    engine_setting: str | None = None
    """Where the format has a counterpart in a serving engine, what to set there (an engine's kernels
    accumulate differently: the certificate speaks for certkv's runtime, not for the engine)."""
    fallback: bool
    reason: str | None = None
    contract: ContractSummary
    n: int
    violations: int
    empirical_risk: float
    risk_upper_bound: float
    p_value: float | None
    n_contexts: int | None = None
    """Contexts of the certification requests under a grouped spec (null otherwise), with
    ``grouped_risk``, the chosen candidate's grouped measure on them (:class:`CandidateResult`)."""
    grouped_risk: float | None = None
    candidates: list[CandidateResult]
    sequences: list[SequenceResult]
    per_task: dict[str, TaskBreakdown] = Field(default_factory=dict)
    guarantee: str
    notes: list[str] = Field(default_factory=list)
    contract_sha256: str | None = None
    records_sha256: str | None = None
    created: str
    certkv_version: str
    pilot: PilotInfo | None = None
    """The pilot split (null without one): its share, seed, size, the certification size and the
    pilot's request ids; n and the counts above are over the certification requests only."""
    coverage: Coverage | None = None
    """What was calibrated (strata, context lengths, decode length); the runtime answers requests
    outside it from the full cache. Null: nothing is checked."""
    strata: StrataResult | None = None
    """A stratified operating point (contract ``strata:``): one operating point per stratum, each
    deployed for its own requests. The top-level fields then summarise them: ``policy`` is
    ``"stratified"``, ``n``/``violations`` are sums over the strata, ``mean_kv_retained`` the pooled
    mean over every certification request, ``risk_upper_bound`` the largest stratum bound (a
    bound on every stratum at once only under ``simultaneous``; else each holds on its own), and
    ``candidates``/``sequences`` are empty (each stratum has its own)."""

    @property
    def is_stratified(self) -> bool:
        return self.strata is not None

    def entry_for(self, stratum: str | None) -> OperatingPoint | None:
        """The operating point that serves `stratum`: a stratum's entry when stratified (None for
        a stratum it does not know, or none given), else this one."""
        if self.strata is None:
            return self
        return None if stratum is None else self.strata.entries.get(stratum)

    @field_validator("format_version")
    @classmethod
    def _this_format(cls, value: int) -> int:
        """Only this certkv's layout validates (a file's own check, with its name, comes first)."""
        if value != FORMAT_VERSION:
            raise ValueError(f"format_version {value}, this certkv reads {FORMAT_VERSION}; re-run `{REWRITE}`")
        return value

    @model_validator(mode="after")
    def _one_protocol(self) -> OperatingPoint:
        """A stratified point deploys one protocol: every stratum's entry was certified under the
        top level's (a runtime follows the top level, so an entry of the other would be served
        under a protocol it was never calibrated with)."""
        if self.strata is not None:
            for name, entry in self.strata.entries.items():
                if entry.query_aware != self.query_aware:
                    raise ValueError(
                        f"stratum {name!r} has query_aware {str(entry.query_aware).lower()} but the operating point "
                        f"has {str(self.query_aware).lower()}; a point is certified under one protocol, re-run certkv certify"
                    )
        return self

    def to_dict(self) -> dict:
        """JSON-ready dict; ``reason`` appears only when there is one (a fallback)."""
        data = self.model_dump(mode="json")
        if data.get("reason") is None:
            data.pop("reason", None)
        for key in ("pilot", "coverage", "strata", *_GROUPED_KEYS):
            if data.get(key) is None:
                data.pop(key, None)
        _drop_null_grouping(data)
        if self.strata is not None:  # one version per file: the stratum entries carry none of their own
            data["strata"]["entries"] = {
                name: {k: v for k, v in op.to_dict().items() if k != "format_version"} for name, op in self.strata.entries.items()
            }
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    def write_json(self, path: Path | str) -> Path:
        """Write atomically (temporary file in the same folder, then rename): a reader never
        sees a half-written operating point, even if the process is killed mid-write."""
        return write_text_atomic(path, self.to_json())


#: Fields only a grouped certificate fills; a point without grouping writes none of them.
_GROUPED_KEYS = ("n_contexts", "grouped_risk")


def _drop_null_grouping(data: dict) -> None:
    """Leave the grouped fields out of a point's dict where they are null (its contract's
    ``grouping`` and each candidate's counts), so that files without grouping keep their layout."""
    if data.get("contract", {}).get("grouping", 0) is None:
        data["contract"].pop("grouping")
    for candidate in data.get("candidates", []):
        for key in _GROUPED_KEYS:
            if candidate.get(key, 0) is None:
                candidate.pop(key)


class StrataResult(BaseModel):
    """The strata of a stratified operating point: ``by`` (the request field), whether the
    guarantees hold ``simultaneously`` (each stratum certified at δ/S) or per stratum (each at δ),
    the ``confidence`` each stratum was certified at, and one operating point per stratum.

    Examples
    --------
    >>> from certkv.core.certify import certify
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": f"{t}{i}", "task": t, "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0}
    ...         for t in ("a", "b") for i in range(100)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]], strata={"by": "task"})
    >>> strata = certify(LossTable.from_records(rows), spec).strata
    >>> strata.by, strata.simultaneous, sorted(strata.entries)
    ('task', False, ['a', 'b'])
    """

    model_config = ConfigDict(extra="forbid")
    by: str
    simultaneous: bool
    confidence: float
    entries: dict[str, OperatingPoint]


OperatingPoint.model_rebuild()


def load_operating_point(path: str | os.PathLike[str]) -> OperatingPoint:
    """Read and validate an operating point written by :meth:`OperatingPoint.write_json`.

    Examples
    --------
    >>> import tempfile
    >>> from pathlib import Path
    >>> from certkv.core.certify import certify
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(100)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = certify(LossTable.from_records(rows), spec).write_json(Path(folder) / "operating_point.json")
    ...     print(load_operating_point(path).policy)
    p@0.50
    """
    path = Path(path)
    if not path.is_file():
        raise CertkvError(f"operating point not found: {path}; run `certkv certify` first")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CertkvError(f"{path}: not valid JSON ({exc}); re-run `certkv certify`") from None
    if isinstance(data, dict):  # anything else is not an operating point: validation says so
        check_format_version(data.get("format_version"), FORMAT_VERSION, path, REWRITE)
    try:
        return OperatingPoint.model_validate(data)
    except ValidationError as exc:
        raise CertkvError(format_validation_error(exc, str(path))) from None
