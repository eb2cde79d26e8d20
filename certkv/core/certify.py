"""Turn a loss table and a contract into a certified operating point.

The certifier counts, for every candidate of the contract, the calibration requests whose loss
exceeds the tolerance τ; computes the exact binomial p-value of "violation rate > ε"; applies the
contract's family-wise procedure at δ = 1 − confidence; and, among the certified candidates,
chooses the one that keeps the least KV cache (any certified candidate may be chosen because the
guarantee is simultaneous). When nothing is certified it falls back to the full cache and says
which candidate failed first and why.

This module is torch-free: it imports numpy, scipy and pydantic only, so certificates can be
computed and checked on machines without the model stack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from certkv.core.binomial import binomial_p_value, clopper_pearson_upper, violation_mask
from certkv.core.coverage import coverage_of
from certkv.core.gated import expand_gated, spec_derivations
from certkv.core.loss_table import LossRecords, LossTable, as_loss_table
from certkv.core.loss_table import records_sha256 as _records_sha256
from certkv.core.operating_point import (
    CandidateResult,
    ContractSummary,
    OperatingPoint,
    SequenceResult,
    TaskBreakdown,
    certified_at,
    certkv_version,
)
from certkv.core.pilot import PilotResolution, apply_pilot
from certkv.core.policy_names import REFERENCE_POLICY, is_gated_policy
from certkv.core.procedures import candidate_levels, certified_mask, sequence_stops
from certkv.core.spec import CertificationSpec
from certkv.core.strata import certify_stratified
from certkv.errors import CertkvError

#: Re-exported helper; certify() takes a keyword of the same name, hence the private alias above.
records_sha256 = _records_sha256

NO_TASK = "(no task)"


class ContractLike(Protocol):
    """What :func:`certify` reads from a contract (:class:`certkv.contract.schema.Contract`, which the
    core does not import): its certification spec and its hash."""

    def certification_spec(self) -> CertificationSpec: ...

    def sha256(self) -> str: ...


# ----------------------------------------------------------------------------- decisions


def select_candidates(eligible: npt.ArrayLike, mean_memory: npt.ArrayLike, violations: npt.ArrayLike) -> np.ndarray:
    """Index of the chosen candidate along the last axis, or -1 when none is eligible.

    The rule: least mean KV retained; ties (to 1e-12, so that float noise in a mean does not
    decide) by fewer violations, i.e. lower empirical risk at equal n; remaining ties by contract
    order. Works on any leading batch shape, so validation applies the identical rule per split.

    eligible, mean_memory : (..., n_candidates) bool and float arrays; violations : (..., n_candidates)
    int counts (broadcast to `eligible`'s shape). Returns a (...) int array.
    """
    eligible = np.asarray(eligible, dtype=bool)
    memory = np.where(eligible, np.round(np.asarray(mean_memory, dtype=float), 12), np.inf)
    violations = np.broadcast_to(np.asarray(violations), eligible.shape)
    order = np.lexsort((violations, memory), axis=-1)  # stable: last tie-break is contract order
    first = order[..., 0]
    found = np.take_along_axis(eligible, first[..., None], axis=-1)[..., 0]
    return np.where(found, first, -1)


def decide(
    p_values: npt.ArrayLike, mean_memory: npt.ArrayLike, violations: npt.ArrayLike, spec: CertificationSpec
) -> tuple[np.ndarray, np.ndarray]:
    """Certified flags and the chosen index (-1: fallback) from per-candidate statistics.

    The shared decision step of :func:`certify` and repeated-split validation; arrays have the
    candidates on the last axis in contract order: p_values, mean_memory and violations are
    (..., n_candidates) float, float and int arrays. Returns the (..., n_candidates) bool flags
    and the (...) int chosen index.
    """
    flags = certified_mask(p_values, spec.lengths, spec.delta, spec.procedure)
    return flags, select_candidates(flags, mean_memory, violations)


def candidate_rows(table: LossTable, spec: CertificationSpec) -> np.ndarray:
    """Rows of the table for the spec's candidates, in contract order; absent ones are errors."""
    rows = []
    for s, sequence in enumerate(spec.sequences):
        for j, name in enumerate(sequence):
            if name not in table:
                hint = "calibrate it or remove it from the contract"
                if is_gated_policy(name):
                    hint = (
                        "a gated candidate is derived from its base's records: certify against the contract "
                        "(certkv.certify(records, contract)) or a spec from certification_spec(contract)"
                    )
                raise CertkvError(
                    f"policy {name!r} (sequence {s}, position {j}) has no calibration records in {table.source}; {hint}"
                )
            rows.append(table.index_of(name))
    return np.asarray(rows, dtype=np.int64)


def expand_for_spec(table: LossTable, spec: CertificationSpec) -> LossTable:
    """`table` plus the spec's gated candidates derived from their bases (see
    :mod:`certkv.core.gated`); candidates already derived are kept, the input is never modified."""
    wanted = spec_derivations(spec)
    return expand_gated(table, wanted) if wanted else table


def prepare(
    records: LossRecords, spec: CertificationSpec | Mapping[str, Any]
) -> tuple[LossTable, CertificationSpec, PilotResolution | None]:
    """The table and spec a decision is computed on, shared by :func:`certify` and validation:
    with a pilot (``spec.pilot``), the certification requests only and the pilot-resolved spec
    (:func:`certkv.core.pilot.resolve_pilot`); then every gated candidate derived. Returns
    (table, spec, the pilot resolution or None)."""
    table, spec, resolution = apply_pilot(as_loss_table(records), CertificationSpec.parse(spec))
    return expand_for_spec(table, spec), spec, resolution


def violation_matrix(table: LossTable, spec: CertificationSpec) -> np.ndarray:
    """Boolean (candidates × requests) matrix of violations, candidates in contract order."""
    return violation_mask(table.loss[candidate_rows(table, spec)], spec.tolerance)


# ----------------------------------------------------------------------------- certify


def certify(
    records: LossRecords,
    spec: CertificationSpec | Mapping[str, Any] | ContractLike,
    *,
    contract_sha256: str | None = None,
    records_sha256: str | None = None,
) -> OperatingPoint:
    """Certify the most aggressive candidate whose violation rate is ≤ ε with prob. ≥ 1 − δ.

    Counts each candidate's violations (loss > τ) as integers, computes the exact binomial
    p-value of "violation rate > ε", applies the spec's family-wise procedure at δ over the
    pre-registered sequences, and picks, among the certified candidates, the one keeping the least
    KV (any certified one may be picked: the guarantee is simultaneous). Nothing certified means
    the full cache. With a pilot split (``spec.pilot``) the pilot requests place the gate
    thresholds (and, under pilot_ordered, the test order) and never certify: n, the violations,
    the per-task breakdown and the mean KV count the certification requests only.

    Parameters
    ----------
    records : LossTable, str, Path or list of dict
        One loss per (request, policy): a :class:`~certkv.core.loss_table.LossTable`, a CSV/JSONL
        loss-table path, or record dicts (a calibration store's rows).
    spec : CertificationSpec, dict or Contract
        τ, ε, confidence, procedure and sequences; a contract
        (:class:`certkv.contract.schema.Contract`) gives its own spec and its hash is recorded.
    contract_sha256 : str, optional
        Recorded in the operating point (taken from the contract when `spec` is one).
    records_sha256 : str, optional
        The hash of the evidence; computed from the table when not given.

    Returns
    -------
    OperatingPoint
        The choice (or the fallback, with the reason), every candidate's counts, bounds and
        levels, where each sequence stopped, per-task breakdowns and the guarantee in words.
    """
    table, spec, contract_sha256, records_sha256 = _evidence(records, spec, contract_sha256, records_sha256)
    if spec.strata is not None:
        return certify_stratified(table, spec, certify, contract_sha256=contract_sha256, records_sha256=records_sha256)
    table, spec, resolution = prepare(table, spec)
    counts = _count_and_decide(table, spec)
    task_names, task_codes = _task_codes(table)
    candidates = _candidate_results(table, spec, counts, task_names, task_codes)
    sequences = _sequence_results(spec, counts.flags)
    notes = _notes(table, spec, task_names)
    if resolution is not None:
        notes = [*resolution.notes, *notes]
    common = _shared_fields(table, spec, resolution, candidates, sequences, contract_sha256, records_sha256)
    index = int(counts.chosen)
    if index < 0:
        return _fallback(table, spec, candidates, task_names, task_codes, notes, common)
    return _certified(spec, candidates[index], notes, common)


# ----------------------------------------------------------------------------- certify, step by step


def _evidence(
    records, spec, contract_sha256: str | None, records_sha256: str | None
) -> tuple[LossTable, CertificationSpec, str | None, str]:
    """(table, spec, contract hash, records hash): a contract gives its own spec and its hash; the
    records hash covers the recorded evidence (pilot included), so it is taken before any gated
    rows are derived."""
    if callable(getattr(spec, "certification_spec", None)):  # a Contract: its pre-registered choices
        contract_sha256 = contract_sha256 or spec.sha256()
        spec = spec.certification_spec()
    spec = CertificationSpec.parse(spec)
    table = as_loss_table(records)
    if records_sha256 is None:  # the recorded evidence (pilot included): derived gated rows are not part of it
        records_sha256 = _records_sha256(table)
    return table, spec, contract_sha256, records_sha256


@dataclass(frozen=True)
class _Counts:
    """Per candidate (contract order): table row, violation flags per request, violation count k,
    mean KV retained, exact p-value, procedure level and certified flag; and the chosen index (-1:
    fallback)."""

    rows: np.ndarray
    violations: np.ndarray
    k: np.ndarray
    mean_memory: np.ndarray
    p: np.ndarray
    levels: np.ndarray
    flags: np.ndarray
    chosen: np.ndarray


def _count_and_decide(table: LossTable, spec: CertificationSpec) -> _Counts:
    """Count violations as integers, take each exact binomial p-value and apply the procedure."""
    rows = candidate_rows(table, spec)
    violations = violation_mask(table.loss[rows], spec.tolerance)
    n = table.n_requests
    k = violations.sum(axis=1)
    mean_memory = table.memory[rows].mean(axis=1)
    p = np.array([binomial_p_value(int(kj), n, spec.risk) for kj in k])
    flags, chosen = decide(p, mean_memory, k, spec)
    levels = candidate_levels(p, spec.lengths, spec.delta, spec.procedure)
    return _Counts(rows, violations, k, mean_memory, p, levels, flags, chosen)


def _candidate_results(
    table: LossTable, spec: CertificationSpec, counts: _Counts, task_names, task_codes
) -> list[CandidateResult]:
    """One result per candidate, in contract order: counts, bound at its level, per-task breakdown."""
    c = counts
    return [
        _candidate_result(
            table, spec, c.rows[i], i, c.violations[i], c.p[i], c.levels[i], c.flags[i], c.mean_memory[i], task_names, task_codes
        )
        for i in range(len(c.rows))
    ]


def _sequence_results(spec: CertificationSpec, flags: np.ndarray) -> list[SequenceResult]:
    """Where each sequence stopped, with the policy names of the spec."""
    return [
        SequenceResult(
            index=stop.index,
            policies=list(spec.sequences[stop.index]),
            level=stop.level,
            tested=stop.tested,
            certified=stop.certified,
            stopped_at=stop.stopped_at,
            stopped_policy=None if stop.stopped_at is None else spec.sequences[stop.index][stop.stopped_at],
        )
        for stop in sequence_stops(flags, spec.lengths, spec.delta, spec.procedure)
    ]


def _shared_fields(
    table: LossTable, spec: CertificationSpec, resolution, candidates, sequences, contract_sha256: str | None, records_sha256: str
) -> dict:
    """The operating point's fields that do not depend on the choice (certified or fallback)."""
    return dict(
        pilot=None if resolution is None else resolution.info,
        coverage=coverage_of(
            table.context_tokens, table.tasks, "task", context_margin=spec.context_margin, max_new_tokens=spec.max_new_tokens
        ),
        max_new_tokens=spec.max_new_tokens,
        query_aware=spec.query_aware,
        contract=ContractSummary.of(spec),
        candidates=candidates,
        sequences=sequences,
        contract_sha256=contract_sha256,
        records_sha256=records_sha256,
        created=certified_at(),
        certkv_version=certkv_version(),
    )


def _certified(spec: CertificationSpec, best: CandidateResult, notes: list[str], common: dict) -> OperatingPoint:
    """The operating point of the chosen candidate, with its deployment settings from the spec."""
    notes = [*notes, *_task_notes(best)]
    info = spec.candidate_info.get(best.policy)
    return OperatingPoint(
        policy=best.policy,
        base_policy=info.base_policy if info is not None else best.policy,
        press=best.press,
        press_kwargs=dict(info.press_kwargs) if info is not None else {},
        kv_retained=best.kv_retained,
        gate=best.gate,
        gated_share=best.gated_share,
        mean_kv_retained=best.mean_kv_retained,
        kv_retained_actual=best.kv_retained_actual,
        fallback=False,
        n=best.n,
        violations=best.violations,
        empirical_risk=best.empirical_risk,
        risk_upper_bound=best.risk_upper_bound,
        p_value=best.p_value,
        per_task=best.per_task,
        guarantee=guarantee_sentence(spec),
        notes=notes,
        **common,
    )


def guarantee_sentence(spec: CertificationSpec) -> str:
    """The promise in words, with its scope: the calibration distribution, not each task."""
    return (
        f"With probability ≥ {spec.confidence:g} over the calibration draw, at most "
        f"{_percent(spec.risk)} of requests from the calibration distribution lose more than "
        f"{float(spec.tolerance)} utility. This covers the calibration distribution (the declared "
        "task mix), not each task or each request on its own."
    )


def _fallback(table, spec, candidates, task_names, task_codes, notes, common) -> OperatingPoint:
    """Nothing certified: use the full cache (zero loss by definition) and say what failed."""
    first = next(c for c in candidates if not c.certified)
    failed = sum(not c.certified for c in candidates)
    others = ""
    if failed > 1:
        others = f" (and {failed - 1} other candidate{'s' if failed > 2 else ''} failed)"
    # Under Holm a candidate can pass its own level yet fail because the step-down stopped.
    verdict = (
        f"> ε = {spec.risk:g}"
        if first.risk_upper_bound > spec.risk
        else f"≤ ε = {spec.risk:g} but Holm's step-down stopped before it"
    )
    reason = (
        f"no candidate was certified; the first to fail was {first.policy!r} (sequence "
        f"{first.sequence}, position {first.position}): {first.violations}/{first.n} violations, "
        f"risk upper bound {first.risk_upper_bound:.4g} at confidence {1.0 - first.level:.4g} "
        f"{verdict}{others}; using the full cache"
    )
    per_task = {}
    if task_names:
        counts = np.bincount(task_codes, minlength=len(task_names))
        per_task = {
            name: TaskBreakdown(n=int(c), violations=0, rate=0.0, exceeds_risk=False) for name, c in zip(task_names, counts)
        }
    return OperatingPoint(
        policy=REFERENCE_POLICY,
        base_policy=REFERENCE_POLICY,
        press=REFERENCE_POLICY,
        kv_retained=1.0,
        mean_kv_retained=1.0,
        kv_retained_actual=1.0,
        fallback=True,
        reason=reason,
        n=table.n_requests,
        violations=0,
        empirical_risk=0.0,
        risk_upper_bound=0.0,
        p_value=None,
        per_task=per_task,
        guarantee=(
            f"Nothing was certified at confidence {spec.confidence:g}; the full cache is used, "
            "which loses no utility by definition."
        ),
        notes=notes,
        **common,
    )


def _candidate_result(table, spec, row, i, violated, p, level, certified, mean_memory, task_names, task_codes) -> CandidateResult:
    n = table.n_requests
    k = int(np.count_nonzero(violated))
    actual = None
    if table.kv_retained_actual is not None and not np.isnan(table.kv_retained_actual[row]).all():
        actual = float(np.nanmean(table.kv_retained_actual[row]))
    position = _position(spec, i)
    policy = table.policies[row]
    info = spec.candidate_info.get(policy)
    derived = table.gated.get(policy)
    return CandidateResult(
        policy=table.policies[row],
        press=table.press[row],
        kv_retained=float(table.kv_retained[row]),
        mean_kv_retained=float(mean_memory),
        kv_retained_actual=actual,
        n=n,
        violations=k,
        empirical_risk=k / n,
        risk_upper_bound=clopper_pearson_upper(k, n, 1.0 - float(level)),
        p_value=float(p),
        level=float(level),
        certified=bool(certified),
        sequence=position[0],
        position=position[1],
        per_task=_per_task(violated, task_names, task_codes, spec.risk),
        gate=info.gate if info is not None else None,
        gated_share=derived.gated_share if derived is not None else 0.0,
    )


def _position(spec: CertificationSpec, flat_index: int) -> tuple[int, int]:
    for s, length in enumerate(spec.lengths):
        if flat_index < length:
            return s, flat_index
        flat_index -= length
    raise IndexError(flat_index)


def _task_codes(table: LossTable):
    """Task names (sorted) and each request's task code; ([], None) when there are no tasks."""
    if table.tasks is None:
        return [], None
    labels = [NO_TASK if t is None else t for t in table.tasks]
    names = sorted(set(labels))
    index = {name: i for i, name in enumerate(names)}
    return names, np.fromiter((index[t] for t in labels), dtype=np.int64, count=len(labels))


def _per_task(violated, task_names, task_codes, risk) -> dict[str, TaskBreakdown]:
    if not task_names:
        return {}
    n = np.bincount(task_codes, minlength=len(task_names))
    k = np.bincount(task_codes, weights=violated, minlength=len(task_names))
    out = {}
    for name, n_t, k_t in zip(task_names, n.tolist(), k.tolist()):
        k_t = int(round(k_t))  # a sum of 0/1 weights: exact integers stored as floats
        rate = k_t / n_t
        out[name] = TaskBreakdown(n=n_t, violations=k_t, rate=rate, exceeds_risk=rate > risk)
    return out


def _notes(table: LossTable, spec: CertificationSpec, task_names) -> list[str]:
    notes = []
    tested = set(spec.candidates)
    ignored = [p for p in table.policies if p not in tested]
    if ignored:
        shown = ", ".join(ignored[:10]) + (f" and {len(ignored) - 10} more" if len(ignored) > 10 else "")
        notes.append(f"policies in the records but in no sequence were ignored: {shown}")
    if not task_names:
        notes.append("the records have no task column; no per-task breakdown")
    return notes


def _task_notes(best: CandidateResult) -> list[str]:
    return [
        f"task {name!r} has its own violation rate {t.rate:.4g} > ε under {best.policy}; the "
        "guarantee covers the task mix, not this task on its own"
        for name, t in best.per_task.items()
        if t.exceeds_risk
    ]


def _percent(risk: float) -> str:
    return f"{risk * 100:g}%"


__all__ = [
    "candidate_rows",
    "certify",
    "decide",
    "expand_for_spec",
    "prepare",
    "guarantee_sentence",
    "records_sha256",
    "select_candidates",
    "violation_matrix",
]
