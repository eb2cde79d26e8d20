"""Turn a loss table and a certification spec into a certified operating point.

The certifier (:func:`certify`, which takes a :class:`~certkv.core.loss_table.LossTable` and a
:class:`~certkv.core.spec.CertificationSpec`, nothing else) counts, for every candidate of the
spec, the calibration requests whose loss exceeds the tolerance τ; computes the exact binomial
p-value of "violation rate > ε"; applies the spec's family-wise procedure at δ = 1 − confidence;
and, among the certified candidates, chooses the one that keeps the least KV cache (any certified
candidate may be chosen because the guarantee is simultaneous). When nothing is certified it falls
back to the full cache and says which candidate failed first and why. Gated candidates are derived
first, in one step (:func:`prepare`), and a stratified spec is one pooled certificate per stratum
(:func:`certify_stratified`). The p-values, bounds and words of the guarantee are the spec's
sampling unit's (:func:`certkv.core.sampling_unit.sampling_unit`): exact binomial over requests,
or over contexts under grouping (:mod:`certkv.core.grouped`), where the violation counts stay
integers over questions.

This module is torch-free: it imports numpy, scipy and pydantic only, so certificates can be
computed and checked on machines without the model stack.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from certkv.core.binomial import violation_mask
from certkv.core.coverage import Coverage, coverage_of
from certkv.core.gated import derive_gated
from certkv.core.loss_table import LossTable
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
from certkv.core.pilot import PilotInfo, PilotResolution, apply_pilot
from certkv.core.policy_names import REFERENCE_POLICY, is_gated_policy
from certkv.core.procedures import candidate_levels, certified_mask, sequence_stops
from certkv.core.sampling_unit import sampling_unit
from certkv.core.spec import CertificationSpec
from certkv.core.strata import (
    full_cache_counts,
    split_strata,
    stratified_point,
    stratum_guarantee,
    stratum_labels,
    with_stratum_coverage,
)
from certkv.errors import CertkvError

#: Re-exported helper; certify() takes a keyword of the same name, hence the private alias above.
records_sha256 = _records_sha256

NO_TASK = "(no task)"


# ----------------------------------------------------------------------------- decisions


def select_candidates(eligible: npt.ArrayLike, mean_memory: npt.ArrayLike, violations: npt.ArrayLike) -> np.ndarray:
    """Index of the chosen candidate along the last axis, or -1 when none is eligible.

    The rule: least mean KV retained; ties (to 1e-12, so that float noise in a mean does not
    decide) by fewer violations, i.e. lower empirical risk at equal n; remaining ties by contract
    order. Works on any leading batch shape, so validation applies the identical rule per split.

    eligible, mean_memory : (..., n_candidates) bool and float arrays; violations : (..., n_candidates)
    int counts (broadcast to `eligible`'s shape). Returns a (...) int array.

    Examples
    --------
    >>> int(select_candidates([True, True, False], mean_memory=[0.5, 0.3, 0.1], violations=[2, 5, 0]))  # least memory
    1
    >>> int(select_candidates([False, False], [0.5, 0.3], [0, 0]))  # none eligible: the fallback
    -1
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

    Examples
    --------
    >>> from certkv.core.spec import CertificationSpec
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.70", "p@0.50", "p@0.30"]])
    >>> flags, chosen = decide([0.001, 0.01, 0.5], mean_memory=[0.7, 0.5, 0.3], violations=[0, 1, 40], spec=spec)
    >>> flags.tolist(), int(chosen)
    ([True, True, False], 1)
    """
    flags = certified_mask(p_values, spec.lengths, spec.delta, spec.procedure)
    return flags, select_candidates(flags, mean_memory, violations)


def candidate_rows(table: LossTable, spec: CertificationSpec) -> np.ndarray:
    """Rows of the table for the spec's candidates, in contract order; absent ones are errors.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": "r0", "policy": p, "kv_retained": kv, "loss": 0.0} for p, kv in (("p@0.30", 0.3), ("p@0.70", 0.7))]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.70", "p@0.30"]])
    >>> candidate_rows(LossTable.from_records(rows), spec).tolist()  # contract order, not the table's
    [1, 0]
    """
    rows = []
    for s, sequence in enumerate(spec.sequences):
        for j, name in enumerate(sequence):
            if name not in table:
                hint = "calibrate it or remove it from the contract"
                if is_gated_policy(name):
                    hint = (
                        "a gated candidate is derived from its base's records: give its gate in the spec's "
                        "candidate_info, as certkv.certification_spec(contract) does"
                    )
                raise CertkvError(
                    f"policy {name!r} (sequence {s}, position {j}) has no calibration records in {table.source}; {hint}"
                )
            rows.append(table.index_of(name))
    return np.asarray(rows, dtype=np.int64)


def prepare(table: LossTable, spec: CertificationSpec) -> tuple[LossTable, CertificationSpec, PilotResolution | None]:
    """The table and spec a pooled decision is computed on, shared by :func:`certify` and
    validation: with a pilot (``spec.pilot``), the certification requests only and the
    pilot-resolved spec (:func:`certkv.core.pilot.apply_pilot`); then every gated candidate
    derived (:func:`certkv.core.gated.derive_gated`). Returns (table, spec, the pilot resolution
    or None).

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(200)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]], pilot={"share": 0.25})
    >>> table, resolved, resolution = prepare(LossTable.from_records(rows), spec)
    >>> table.n_requests, resolution.info.n_pilot  # the pilot's 50 requests never certify
    (150, 50)
    """
    sampling_unit(spec).check(table)
    table, spec, resolution = apply_pilot(table, spec)
    return derive_gated(table, spec), spec, resolution


# ----------------------------------------------------------------------------- certify


def certify(
    table: LossTable,
    spec: CertificationSpec,
    *,
    contract_sha256: str | None = None,
    records_sha256: str | None = None,
) -> OperatingPoint:
    """Certify the most aggressive candidate whose violation rate is ≤ ε with prob. ≥ 1 − δ.

    Learn then Test [1]_ with exact binomial p-values of "violation rate > ε" (loss > τ) under the
    spec's family-wise procedure (fixed-sequence [3]_, Bonferroni, Holm [2]_, pilot-ordered) at δ;
    the certified candidate keeping the least KV is chosen, else the full cache (module docstring).
    A pilot places gate thresholds and never certifies; strata: :func:`certify_stratified`.

    Parameters
    ----------
    table : LossTable
        One loss per (request, policy): :func:`~certkv.core.loss_table.read_loss_table` of a file,
        or :meth:`~certkv.core.loss_table.LossTable.from_records`. Gated rows are derived here.
    spec : CertificationSpec
        τ, ε, confidence, procedure, sequences and deployments (a contract's:
        :func:`certkv.contract.spec.certification_spec`).
    contract_sha256, records_sha256 : str, optional
        Recorded: the contract's hash and the evidence's (default: the table's recorded rows').

    Returns
    -------
    OperatingPoint
        The choice or the fallback with its reason; per candidate the counts, Clopper–Pearson [4]_
        upper bound and level; where each sequence stopped; the guarantee in words.

    References
    ----------
    .. [1] Angelopoulos et al., "Learn then Test: Calibrating Predictive Algorithms to Achieve Risk Control", arXiv:2110.01052.
    .. [2] Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 6, 1979.
    .. [3] Wiens, "A fixed sequence Bonferroni procedure for testing multiple endpoints", Pharm. Stat. 2, 2003.
    .. [4] Clopper and Pearson, "The use of confidence or fiducial limits ...", Biometrika 26, 1934.

    Examples
    --------
    200 requests; the milder retention never violates, the stronger one on 30 requests:

    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": f"r{i}", "policy": p, "kv_retained": kv, "loss": float(p == "snapkv@0.30" and i < 30)}
    ...         for i in range(200) for p, kv in (("snapkv@0.70", 0.7), ("snapkv@0.30", 0.3))]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[["snapkv@0.70", "snapkv@0.30"]])
    >>> op = certify(LossTable.from_records(rows), spec)
    >>> op.policy, op.violations, op.n, round(op.risk_upper_bound, 4)
    ('snapkv@0.70', 0, 200, 0.0149)
    >>> [(s.tested, s.stopped_policy) for s in op.sequences]  # the sequence stopped at the failing one
    [(2, 'snapkv@0.30')]
    """
    check_inputs(table, spec)
    check_sampling_unit(table, spec)
    if records_sha256 is None:  # the recorded evidence (pilot included): derived gated rows are not part of it
        records_sha256 = _records_sha256(table)
    if spec.strata is not None:
        return certify_stratified(table, spec, contract_sha256=contract_sha256, records_sha256=records_sha256)
    return certify_pooled(table, spec, contract_sha256=contract_sha256, records_sha256=records_sha256)


def check_inputs(table: LossTable, spec: CertificationSpec) -> None:
    """One-line errors for a table or spec of another type (a path, rows, a dict, a contract):
    :func:`certify` and validation take exactly a LossTable and a CertificationSpec.

    Examples
    --------
    >>> from certkv.core.spec import CertificationSpec
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> check_inputs([{"request_id": "r0"}], spec)
    Traceback (most recent call last):
    ...
    certkv.errors.CertkvError: records must be a LossTable, got list; read a file with certkv.read_loss_table(path) ...
    """
    if not isinstance(table, LossTable):
        raise CertkvError(
            f"records must be a LossTable, got {type(table).__name__}; read a file with certkv.read_loss_table(path) "
            "or rows with LossTable.from_records(rows)"
        )
    if not isinstance(spec, CertificationSpec):
        raise CertkvError(
            f"spec must be a CertificationSpec, got {type(spec).__name__}; build one with CertificationSpec.parse(data) "
            "or from a contract with certkv.certification_spec(contract)"
        )


def check_sampling_unit(table: LossTable, spec: CertificationSpec) -> None:
    """One-line errors when the table's context groups and the spec's sampling unit disagree
    (:meth:`certkv.core.sampling_unit.SamplingUnit.check`), or when a grouped, stratified spec meets a
    context whose questions span two strata (:meth:`~certkv.core.sampling_unit.SamplingUnit.check_strata`).

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(4)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]], grouping={})
    >>> check_sampling_unit(LossTable.from_records(rows), spec)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    certkv.errors.CertkvError: records: the spec certifies over context groups but the records have no group column; ...
    """
    unit = sampling_unit(spec)
    unit.check(table)
    if spec.strata is not None:
        unit.check_strata(table, spec.strata.by, stratum_labels)


def certify_pooled(
    table: LossTable, spec: CertificationSpec, *, contract_sha256: str | None, records_sha256: str
) -> OperatingPoint:
    """One certificate over every request of `table` (:func:`certify` without strata; `spec`'s
    strata, if any, are ignored).

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 1.0} for i in range(100)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> op = certify_pooled(LossTable.from_records(rows), spec, contract_sha256=None, records_sha256="example")
    >>> op.fallback, op.policy, op.reason.split(";")[0]
    (True, 'full', 'no candidate was certified')
    """
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


def certify_stratified(
    table: LossTable, spec: CertificationSpec, *, contract_sha256: str | None, records_sha256: str
) -> OperatingPoint:
    """One pooled certificate per stratum of `table` (:func:`certify_pooled` of each stratum's
    requests under the per-stratum spec, or the full cache for a stratum too small to certify
    anything), composed into one operating point (:mod:`certkv.core.strata`).

    Parameters
    ----------
    table : LossTable
        Every calibration request (pilot included), with a stratum or task column.
    spec : CertificationSpec
        With ``strata`` set; each stratum is certified under
        :func:`~certkv.core.strata.stratum_spec` (δ, or δ/S when ``simultaneous``).
    contract_sha256, records_sha256 : str
        Bound into every entry and the summary (the records hash is the whole table's).

    Returns
    -------
    OperatingPoint
        ``strata.entries`` holds each stratum's operating point; the top level is their summary.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CertificationSpec
    >>> rows = [{"request_id": f"{task}{i}", "task": task, "policy": "p@0.50", "kv_retained": 0.5,
    ...          "loss": float(task == "hard")} for task in ("easy", "hard") for i in range(100)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.9, sequences=[["p@0.50"]],
    ...                          strata={"by": "task"})
    >>> op = certify_stratified(LossTable.from_records(rows), spec, contract_sha256=None, records_sha256="example")
    >>> {name: entry.policy for name, entry in op.strata.entries.items()}
    {'easy': 'p@0.50', 'hard': 'full'}
    """
    if spec.strata is None:
        raise CertkvError("certify_stratified needs a spec with strata; certify_pooled certifies one without")
    by = spec.strata.by
    per_stratum, strata = split_strata(table, spec)
    entries = {}
    for name, sub, too_small in strata:
        if too_small is None:
            entry = certify_pooled(sub, per_stratum, contract_sha256=contract_sha256, records_sha256=records_sha256)
            entry.guarantee = stratum_guarantee(per_stratum, by, name, entry.fallback)
        else:
            entry = _too_small(sub, per_stratum, by, name, too_small, contract_sha256, records_sha256)
        entries[name] = with_stratum_coverage(entry, by, name)
    return stratified_point(entries, spec, per_stratum, contract_sha256, records_sha256)


def _too_small(
    sub: LossTable, spec: CertificationSpec, by: str, name: str, why: str, contract_sha256: str | None, records_sha256: str
) -> OperatingPoint:
    """The full cache for stratum `name` (of field `by`), too small to certify anything, with why."""
    n_cert, per_task = full_cache_counts(sub, spec)
    reason = f"{by} {name!r} is too small to certify: {why}; using the full cache"
    coverage = coverage_of(sub.context_tokens, None, None, context_margin=spec.context_margin, max_new_tokens=spec.max_new_tokens)
    return full_cache_point(
        spec, n=n_cert, reason=reason, guarantee=stratum_guarantee(spec, by, name, True), notes=[reason],
        per_task=per_task, coverage=coverage,
        contract_sha256=contract_sha256, records_sha256=records_sha256,
    )


# ----------------------------------------------------------------------------- certify, step by step


@dataclass(frozen=True)
class _Counts:
    """Per candidate (contract order): table row, violation flags per request, violation count k,
    mean KV retained, p-value, procedure level, certified flag and upper bound at 1 − level; the
    chosen index (-1: fallback); the fields the sampling unit adds to each candidate (under grouping
    the contexts' count and the grouped estimate; none for requests)."""

    rows: np.ndarray
    violations: np.ndarray
    k: np.ndarray
    mean_memory: np.ndarray
    p: np.ndarray
    levels: np.ndarray
    flags: np.ndarray
    chosen: np.ndarray
    bounds: np.ndarray
    unit_fields: list[dict]


def _count_and_decide(table: LossTable, spec: CertificationSpec) -> _Counts:
    """Count violations as integers, take each p-value from the spec's sampling unit (exact
    binomial, or over contexts under grouping) and apply the procedure; bound each candidate at its level."""
    rows = candidate_rows(table, spec)
    violations = violation_mask(table.loss[rows], spec.tolerance)
    k = violations.sum(axis=1)
    mean_memory = table.memory[rows].mean(axis=1)
    unit = sampling_unit(spec)
    counts = unit.tally(table, violations)
    p = unit.p_values(counts, spec.risk)
    flags, chosen = decide(p, mean_memory, k, spec)
    levels = candidate_levels(p, spec.lengths, spec.delta, spec.procedure)
    bounds = unit.upper_bounds(counts, p, levels, spec.risk)
    return _Counts(rows, violations, k, mean_memory, p, levels, flags, chosen, bounds, unit.candidate_fields(counts))


def _candidate_results(
    table: LossTable, spec: CertificationSpec, counts: _Counts, task_names, task_codes
) -> list[CandidateResult]:
    """One result per candidate, in contract order: counts, bound at its level, per-task breakdown."""
    c = counts
    return [
        _candidate_result(
            table, spec, c.rows[i], i, c.violations[i], c.p[i], c.levels[i], c.flags[i], c.mean_memory[i], task_names, task_codes
        ).model_copy(update={"risk_upper_bound": float(c.bounds[i]), **c.unit_fields[i]})
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
        peak_kv_bytes=best.peak_kv_bytes,
        mean_kv_bytes=best.mean_kv_bytes,
        kv_format=None if info is None or info.kv_format is None else dict(info.kv_format),
        engine_setting=None if info is None else info.engine_setting,
        fallback=False,
        n=best.n,
        violations=best.violations,
        empirical_risk=best.empirical_risk,
        risk_upper_bound=best.risk_upper_bound,
        p_value=best.p_value,
        n_contexts=best.n_contexts,
        grouped_risk=best.grouped_risk,
        per_task=best.per_task,
        guarantee=guarantee_sentence(spec),
        notes=notes,
        **common,
    )


def guarantee_sentence(spec: CertificationSpec) -> str:
    """The promise in words, with its scope: the calibration distribution, not each task; what its
    share counts is the sampling unit's (:meth:`certkv.core.sampling_unit.SamplingUnit.guarantee`).

    Examples
    --------
    >>> from certkv.core.spec import CertificationSpec, GroupingConfig
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[["p@0.50"]])
    >>> print(guarantee_sentence(spec))
    With probability ≥ 0.95 over the calibration draw, at most 5% of requests from the calibration distribution lose
    more than 0.0 utility. This covers the calibration distribution (the declared task mix), not each task or each request
    on its own.
    >>> print(guarantee_sentence(spec.model_copy(update={"grouping": GroupingConfig()})))
    With probability ≥ 0.95 over the calibration draw, at most 5% of questions lose more than 0.0 utility, each context
    weighted equally, contexts drawn as in calibration. This covers the calibration distribution (the declared task mix),
    not each task, context or question on its own.
    """
    return sampling_unit(spec).guarantee(spec)


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
        f"{first.sequence}, position {first.position}): {first.violations}/{first.n} violations{_grouped_evidence(first)}, "
        f"risk upper bound {first.risk_upper_bound:.4g} at confidence {1.0 - first.level:.4g} "
        f"{verdict}{others}; using the full cache"
    )
    per_task = {}
    if task_names:
        counts = np.bincount(task_codes, minlength=len(task_names))
        per_task = {
            name: TaskBreakdown(n=int(c), violations=0, rate=0.0, exceeds_risk=False) for name, c in zip(task_names, counts)
        }
    point = full_cache_point(
        spec,
        n=table.n_requests,
        reason=reason,
        guarantee=(
            f"Nothing was certified at confidence {spec.confidence:g}; the full cache is used, "
            "which loses no utility by definition."
        ),
        notes=notes,
        per_task=per_task,
        coverage=common["coverage"],
        contract_sha256=common["contract_sha256"],
        records_sha256=common["records_sha256"],
        candidates=common["candidates"],
        sequences=common["sequences"],
        pilot=common["pilot"],
    )
    return point.model_copy(update={"n_contexts": first.n_contexts})  # null unless grouped


def _grouped_evidence(candidate: CandidateResult) -> str:
    """The contexts behind a grouped candidate's bound, for the fallback reason ("" when not grouped)."""
    if candidate.n_contexts is None or candidate.grouped_risk is None:
        return ""
    return f" over {candidate.n_contexts} contexts (grouped estimate {candidate.grouped_risk:.4g})"


def full_cache_point(
    spec: CertificationSpec,
    *,
    n: int,
    reason: str,
    guarantee: str,
    notes: list[str],
    per_task: dict[str, TaskBreakdown],
    coverage: Coverage,
    contract_sha256: str | None,
    records_sha256: str,
    candidates: list[CandidateResult] | None = None,
    sequences: list[SequenceResult] | None = None,
    pilot: PilotInfo | None = None,
) -> OperatingPoint:
    """The full-cache operating point (zero loss, all of the KV: 1.0 of a 16-bit cache's bytes by
    definition), with `reason`: the one constructor of a fallback, whether nothing was certified
    (:func:`certify_pooled`) or a stratum was too small to certify anything (:func:`certify_stratified`).

    n : the certification requests it was decided on; per_task : their per-task counts (0 violations).

    Examples
    --------
    >>> from certkv.core.coverage import Coverage
    >>> from certkv.core.spec import CertificationSpec
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> op = full_cache_point(spec, n=100, reason="no candidate certified", guarantee=guarantee_sentence(spec), notes=[],
    ...                       per_task={}, coverage=Coverage(), contract_sha256=None, records_sha256="example")
    >>> op.fallback, op.policy, op.violations, op.risk_upper_bound, op.p_value
    (True, 'full', 0, 0.0, None)
    """
    bytes_share = 1.0 if spec.kv_cost == "bytes" else None
    return OperatingPoint(
        policy=REFERENCE_POLICY,
        base_policy=REFERENCE_POLICY,
        press=REFERENCE_POLICY,
        kv_retained=1.0, mean_kv_retained=1.0, kv_retained_actual=1.0,
        peak_kv_bytes=bytes_share, mean_kv_bytes=bytes_share,
        fallback=True,
        reason=reason,
        n=n,
        violations=0,
        empirical_risk=0.0,
        risk_upper_bound=0.0,
        p_value=None,
        per_task=per_task,
        guarantee=guarantee,
        notes=notes,
        candidates=candidates or [],
        sequences=sequences or [],
        pilot=pilot,
        coverage=coverage,
        max_new_tokens=spec.max_new_tokens,
        query_aware=spec.query_aware,
        contract=ContractSummary.of(spec),
        contract_sha256=contract_sha256,
        records_sha256=records_sha256,
        created=certified_at(),
        certkv_version=certkv_version(),
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
        peak_kv_bytes=_mean_of(table.byte_costs.get("kv_peak_bytes"), row),
        mean_kv_bytes=_mean_of(table.byte_costs.get("kv_time_bytes"), row),
        n=n,
        violations=k,
        empirical_risk=k / n,
        risk_upper_bound=0.0,  # filled from the counts: Clopper–Pearson, or the grouped bound
        p_value=float(p),
        level=float(level),
        certified=bool(certified),
        sequence=position[0],
        position=position[1],
        per_task=_per_task(violated, task_names, task_codes, spec.risk),
        gate=info.gate if info is not None else None,
        gated_share=derived.gated_share if derived is not None else 0.0,
    )


def _mean_of(matrix: np.ndarray | None, row: int) -> float | None:
    """The mean of `matrix`'s row `row` over the requests that recorded it (None: none did)."""
    if matrix is None or np.isnan(matrix[row]).all():
        return None
    return float(np.nanmean(matrix[row]))


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
    return notes + sampling_unit(spec).notes(table)


def _task_notes(best: CandidateResult) -> list[str]:
    return [
        f"task {name!r} has its own violation rate {t.rate:.4g} > ε under {best.policy}; the "
        "guarantee covers the task mix, not this task on its own"
        for name, t in best.per_task.items()
        if t.exceeds_risk
    ]


__all__ = [
    "candidate_rows",
    "certify",
    "certify_pooled",
    "certify_stratified",
    "check_inputs",
    "check_sampling_unit",
    "decide",
    "full_cache_point",
    "guarantee_sentence",
    "prepare",
    "records_sha256",
    "select_candidates",
]
