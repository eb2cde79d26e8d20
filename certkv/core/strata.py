"""Certify each stratum of the calibration requests on its own (contract ``strata:``).

One pooled certificate lets the most fragile task decide for every task: on the demo mix,
multi-key requests break SnapKV far more often than single-needle ones, and a pooled contract falls
back to the full cache for both. Partitioning the calibration requests by a request field (the
task, or a ``metadata`` key) and certifying each part with the contract's τ, ε, sequences and gates
gives each stratum the most aggressive policy its own requests support; the runtime then routes a
request to its stratum's policy (and a request of an unknown stratum to the full cache).

Two readings of δ (:class:`~certkv.core.spec.StrataConfig`):

* per stratum (default): each stratum is certified at δ, so each stratum's guarantee holds with
  probability ≥ 1 − δ on its own; the chance that at least one of S strata is wrong can reach S·δ;
* ``simultaneous``: each stratum is certified at δ/S, so by the union bound all S guarantees hold
  together with probability ≥ 1 − δ (and the pooled violation rate, a mixture of the strata's,
  is ≤ ε as well).

The strata are fixed by the contract before calibration (the field, not its values: the values are
whatever the calibration requests carry), and each stratum's decision uses only its own requests,
so the per-stratum certificates are exactly those of :func:`~certkv.core.certify.certify` on each
stratum's table (with a pilot, each stratum draws its own pilot from its own ids). A stratum with
fewer certification requests than a zero-violation certificate needs falls back with that reason
and its requests are answered from the full cache. This module splits the requests and composes
the entries (:func:`split_strata`, :func:`stratified_point`); the certificates themselves are
:func:`certkv.core.certify.certify_stratified`'s, one pooled certificate per stratum. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from certkv.core.coverage import merge_coverage
from certkv.core.loss_table import LossTable
from certkv.core.operating_point import (
    ContractSummary,
    OperatingPoint,
    StrataResult,
    TaskBreakdown,
    certified_at,
    certkv_version,
)
from certkv.core.pilot import pilot_size
from certkv.core.policy_names import STRATIFIED_POLICY
from certkv.core.sampling_unit import fewest_requests, sampling_unit
from certkv.core.spec import CertificationSpec, delta_of
from certkv.errors import CertkvError


def stratum_labels(table: LossTable, by: str) -> tuple[str, ...]:
    """Each request's stratum: its ``task`` for ``by: task``, else the table's ``stratum`` column
    (which holds the values of the ``metadata`` key the contract names: a store stratified by it
    records them; the runtime routes on the same field, so the task is never read from another
    column); a request without a value (or with an empty one) is an error.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"{t}{i}", "task": t, "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0}
    ...         for t in ("qa", "code") for i in range(2)]
    >>> stratum_labels(LossTable.from_records(rows), "task")  # in the table's sorted request order
    ('code', 'code', 'qa', 'qa')
    """
    labels = table.tasks if by == "task" else table.strata
    if labels is None:
        column = "a task column" if by == "task" else "a stratum column"
        raise CertkvError(
            f"{table.source}: strata.by {by!r} needs {column}, and these records have none; recalibrate "
            "under this contract (the store records each request's stratum) or add the column to the loss table"
        )
    missing = [rid for rid, label in zip(table.request_ids, labels) if label is None or not str(label).strip()]
    if missing:
        raise CertkvError(
            f"{table.source}: request {missing[0]!r} has no {by} value ({len(missing)} of {table.n_requests} "
            f"requests lack one); give every request a non-empty {by}"
        )
    return tuple(str(label) for label in labels)


def stratum_spec(spec: CertificationSpec, n_strata: int) -> CertificationSpec:
    """The spec each stratum is certified under: no strata, and δ/S when `simultaneous`.

    References
    ----------
    .. [1] O. J. Dunn, "Multiple comparisons among means", Journal of the American Statistical
           Association 56(293), 52–64, 1961 (the union bound behind δ/S).

    Examples
    --------
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.9, sequences=[["p@0.50"]],
    ...                          strata={"by": "task", "simultaneous": True})
    >>> per_stratum = stratum_spec(spec, n_strata=2)
    >>> per_stratum.strata, per_stratum.confidence  # δ = 0.1 split over two strata
    (None, 0.95)
    """
    confidence = spec.confidence
    assert spec.strata is not None  # a stratified spec
    if spec.strata.simultaneous and n_strata > 1:
        confidence = round(1.0 - spec.delta / n_strata, 12)
        if n_strata * delta_of(confidence) > spec.delta:  # rounding must never make S · δ_s exceed δ
            confidence = round(confidence + 1e-12, 12)
    return spec.model_copy(update={"strata": None, "confidence": confidence})


def split_strata(table: LossTable, spec: CertificationSpec) -> tuple[CertificationSpec, list[tuple[str, LossTable, str | None]]]:
    """The per-stratum spec (:func:`stratum_spec`) and, per stratum in sorted order, its name,
    its requests (pilot included) and why it is too small to certify anything (None when it is
    not: :func:`too_small_reason`, then its sampling unit's
    :meth:`~certkv.core.sampling_unit.SamplingUnit.shortfall`, too few contexts under grouping).
    :func:`certkv.core.certify.certify_stratified` certifies each.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"{task}{i}", "task": task, "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0}
    ...         for task, n in (("a", 100), ("b", 5)) for i in range(n)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.9, sequences=[["p@0.50"]], strata={"by": "task"})
    >>> per_stratum, strata = split_strata(LossTable.from_records(rows), spec)
    >>> [(name, sub.n_requests, why is None) for name, sub, why in strata]
    [('a', 100, True), ('b', 5, False)]
    """
    assert spec.strata is not None  # a stratified spec
    by = spec.strata.by
    labels = stratum_labels(table, by)
    names = sorted(set(labels))
    per_stratum = stratum_spec(spec, len(names))
    need = fewest_requests(per_stratum)
    unit = sampling_unit(per_stratum)
    codes = _codes(labels, names)
    out = []
    for s, name in enumerate(names):
        columns = np.flatnonzero(codes == s)
        sub = table.take_requests(columns, source=f"{table.source} [{by} {name}]")
        why = too_small_reason(columns.size, per_stratum, need) or unit.shortfall(sub, per_stratum)
        out.append((name, sub, why))
    return per_stratum, out


def with_stratum_coverage(entry: OperatingPoint, by: str, name: str) -> OperatingPoint:
    """`entry` (one stratum's operating point) with its coverage marked as stratum `name`'s: the
    runtime serves it only to requests of that stratum.

    Examples
    --------
    >>> from certkv.core.certify import certify
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(100)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.9, sequences=[["p@0.50"]])
    >>> entry = with_stratum_coverage(certify(LossTable.from_records(rows), spec), "task", "qa")
    >>> entry.coverage.strata, entry.coverage.stratum_required
    (['qa'], True)
    """
    assert entry.coverage is not None  # every certified entry has its coverage
    coverage = entry.coverage.model_copy(update={"by": by, "strata": [name], "stratum_required": True})
    return entry.model_copy(update={"coverage": coverage})


def stratum_guarantee(spec: CertificationSpec, by: str, name: str, fallback: bool) -> str:
    """One stratum's promise in words (`spec`: the per-stratum spec).

    Examples
    --------
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[["p@0.50"]])
    >>> print(stratum_guarantee(spec, "task", "qa", fallback=True))
    Nothing was certified for task 'qa'; its requests are answered from the full cache.
    >>> stratum_guarantee(spec, "task", "qa", fallback=False).split(",")[0]
    'With probability ≥ 0.95 over the calibration draw'
    """
    if fallback:
        return f"Nothing was certified for {by} {name!r}; its requests are answered from the full cache."
    return sampling_unit(spec).stratum_promise(spec, by, name)


def strata_guarantee(spec: CertificationSpec, per_stratum: CertificationSpec, by: str, n_strata: int) -> str:
    """The stratified promise in words, with which reading of δ holds.

    Examples
    --------
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.9, sequences=[["p@0.50"]],
    ...                          strata={"by": "task", "simultaneous": True})
    >>> text = strata_guarantee(spec, stratum_spec(spec, 2), "task", n_strata=2)
    >>> "for every one of the 2 task strata at once" in text, "(each stratum certified at confidence 0.95)" in text
    (True, True)
    """
    eps, tau = f"{spec.risk * 100:g}%", float(spec.tolerance)
    grouped = sampling_unit(spec).strata_clause(spec)
    if spec.strata is not None and spec.strata.simultaneous:
        return (
            f"With probability ≥ {spec.confidence:g} over the calibration draw, for every one of the {n_strata} "
            f"{by} strata at once, at most {eps} of that stratum's requests lose more than {tau} utility under "
            f"its policy (each stratum certified at confidence {per_stratum.confidence:.12g}), so the mix of "
            f"calibrated strata loses more than {tau} on at most {eps} too.{grouped} Requests of another {by} are "
            "answered from the full cache."
        )
    return (
        f"For each of the {n_strata} {by} strata on its own: with probability ≥ {spec.confidence:g} over the "
        f"calibration draw, at most {eps} of its requests lose more than {tau} utility under its policy.{grouped} The "
        f"guarantees are per stratum (the chance that some stratum's fails may exceed {spec.delta:g}; set "
        f"strata.simultaneous for a joint guarantee). Requests of another {by} are answered from the full cache."
    )


def too_small_reason(n_requests: int, spec: CertificationSpec, need: int) -> str | None:
    """Why a stratum of `n_requests` cannot certify anything under the per-stratum `spec`
    (`need`: :func:`fewest_requests`), or None when it can: its pilot draws no request, leaves fewer
    certification requests than a pilot must leave, or fewer than a zero-violation certificate needs.

    Examples
    --------
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[["p@0.50"]])
    >>> print(too_small_reason(30, spec, need=fewest_requests(spec)))
    30 certification requests, fewer than the 59 that certifying anything at ε = 0.05 and confidence 0.95 needs
    with zero violations
    >>> too_small_reason(100, spec, need=fewest_requests(spec)) is None
    True
    """
    why = pilot_shortfall(n_requests, spec)
    if why is not None:
        return why
    n_cert = n_requests - (pilot_size(n_requests, spec.pilot.share) if spec.pilot is not None else 0)
    if n_cert < need:
        return (
            f"{n_cert} certification requests, fewer than the {need} that certifying anything at "
            f"ε = {spec.risk:g} and confidence {spec.confidence:.12g} needs with zero violations"
        )
    return None


def pilot_shortfall(n_requests: int, spec: CertificationSpec) -> str | None:
    """Why `spec`'s pilot cannot be drawn from `n_requests` (it would draw none, or leave fewer
    certification requests than a pilot must leave), or None when it can (or there is no pilot).

    Examples
    --------
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.9, sequences=[["p@0.50"]], pilot={"share": 0.25})
    >>> print(pilot_shortfall(120, spec))
    the pilot leaves 90 certification requests, fewer than the 100 a pilot must leave
    >>> pilot_shortfall(1000, spec) is None
    True
    """
    if spec.pilot is None:
        return None
    n_pilot = pilot_size(n_requests, spec.pilot.share)
    if n_pilot < 1:
        return f"a pilot share of {spec.pilot.share:g} draws no pilot request from its {n_requests}"
    if n_requests - n_pilot < spec.pilot.min_certification:
        return (
            f"the pilot leaves {n_requests - n_pilot} certification requests, fewer than the "
            f"{spec.pilot.min_certification} a pilot must leave"
        )
    return None


def full_cache_counts(sub: LossTable, spec: CertificationSpec) -> tuple[int, dict[str, TaskBreakdown]]:
    """The certification requests of a stratum answered from the full cache: their number and
    per-task counts (0 violations), so that the summary still counts every one of them.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"{t}{i}", "task": t, "policy": "p@0.50", "kv_retained": 0.5, "loss": 1.0}
    ...         for t in ("a", "b") for i in range(3)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.9, sequences=[["p@0.50"]])
    >>> n, per_task = full_cache_counts(LossTable.from_records(rows), spec)
    >>> n, per_task["a"].n, per_task["a"].violations  # the full cache loses nothing
    (6, 3, 0)
    """
    columns = _certification_columns(sub, spec)
    return len(columns), _task_counts(sub, spec, columns)


def stratified_point(entries: dict[str, OperatingPoint], spec: CertificationSpec, per_stratum: CertificationSpec,
                     contract_sha256: str | None, records_sha256: str) -> OperatingPoint:
    """Each stratum's own point in ``strata.entries`` and, on top, their sums and means pooled by certification requests.

    Examples
    --------
    >>> from certkv.core.certify import certify
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(100)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.9, sequences=[["p@0.50"]], strata={"by": "task"})
    >>> per_stratum = stratum_spec(spec, 2)
    >>> entry = certify(LossTable.from_records(rows), per_stratum)  # one stratum's point, used for both here
    >>> op = stratified_point({"qa": entry, "code": entry}, spec, per_stratum, None, records_sha256="example")
    >>> op.policy, op.n, sorted(op.strata.entries)
    ('stratified', 200, ['code', 'qa'])
    """
    assert spec.strata is not None  # a stratified spec
    by = spec.strata.by
    ops = list(entries.values())
    n, violations = sum(op.n for op in ops), sum(op.violations for op in ops)
    weights = np.asarray([op.n for op in ops], dtype=float)
    weights = weights / weights.sum() if weights.sum() > 0 else np.full(len(ops), 1.0 / len(ops))

    def pooled(values) -> float:
        return float(np.dot(weights, values))

    actual = [op.kv_retained_actual for op in ops]
    fallback = all(op.fallback for op in ops)
    certified = [name for name, op in entries.items() if not op.fallback]
    notes = [f"{by} {name!r}: {op.reason}" for name, op in entries.items() if op.fallback and op.reason]
    return OperatingPoint(
        policy=STRATIFIED_POLICY,
        base_policy=STRATIFIED_POLICY,
        press=STRATIFIED_POLICY,
        kv_retained=pooled([op.kv_retained for op in ops]),
        mean_kv_retained=pooled([op.mean_kv_retained for op in ops]),
        kv_retained_actual=None if None in actual else pooled(actual),
        fallback=fallback,
        reason=(f"no {by} stratum certified a candidate; using the full cache for every request" if fallback else None),
        contract=ContractSummary.of(spec),
        n=n,
        violations=violations,
        empirical_risk=violations / n if n else 0.0,
        risk_upper_bound=max(op.risk_upper_bound for op in ops),
        p_value=None,
        n_contexts=None if any(op.n_contexts is None for op in ops) else sum(op.n_contexts or 0 for op in ops),
        candidates=[],
        sequences=[],
        per_task=_pooled_tasks(ops, spec.risk),
        guarantee=strata_guarantee(spec, per_stratum, by, len(ops)),
        notes=[f"certified per {by}: {len(certified)} of {len(ops)} strata chose a compressed policy", *notes],
        max_new_tokens=spec.max_new_tokens,
        query_aware=spec.query_aware,
        coverage=merge_coverage({k: op.coverage for k, op in entries.items() if op.coverage is not None}, by,
                                context_margin=spec.context_margin, max_new_tokens=spec.max_new_tokens),
        strata=StrataResult(by=by, simultaneous=spec.strata.simultaneous, confidence=per_stratum.confidence, entries=entries),
        contract_sha256=contract_sha256,
        records_sha256=records_sha256,
        created=certified_at(),
        certkv_version=certkv_version(),
    )


def _pooled_tasks(ops: list[OperatingPoint], risk: float) -> dict[str, TaskBreakdown]:
    """The strata's per-task counts summed task by task (a task may span strata), sorted by task."""
    per_task: dict[str, TaskBreakdown] = {}
    for op in ops:
        for task, t in op.per_task.items():
            old = per_task.get(task)
            n_t = t.n + (old.n if old else 0)
            k_t = t.violations + (old.violations if old else 0)
            per_task[task] = TaskBreakdown(
                n=n_t, violations=k_t, rate=k_t / n_t if n_t else 0.0, exceeds_risk=n_t > 0 and k_t / n_t > risk
            )
    return dict(sorted(per_task.items()))


def _certification_columns(sub: LossTable, spec: CertificationSpec) -> np.ndarray:
    """The columns of `sub` that certify: all of them, or those a pilot leaves when one can be
    drawn (by whole contexts under grouping, so its size is counted in contexts)."""
    every = np.arange(sub.n_requests)
    if spec.pilot is None:
        return every
    unit = sampling_unit(spec)
    units = unit.count(sub)
    if not 1 <= pilot_size(units, spec.pilot.share) < units:
        return every
    split = unit.draw_pilot(sub, spec.pilot.share, spec.pilot.seed, min_certification=1)
    return np.asarray(split.certification_columns, dtype=np.int64)


def _task_counts(sub: LossTable, spec: CertificationSpec, columns: np.ndarray) -> dict[str, TaskBreakdown]:
    """Per-task request counts of a stratum answered from the full cache (0 violations), over its
    certification `columns`, so that the summary's per-task table still counts every certification request."""
    if sub.tasks is None:
        return {}
    tasks: Sequence[str | None] = [sub.tasks[int(i)] for i in columns]
    names = [t if t is not None else "(no task)" for t in tasks]
    return {t: TaskBreakdown(n=names.count(t), violations=0, rate=0.0, exceeds_risk=False) for t in sorted(set(names))}


def _codes(labels, names) -> np.ndarray:
    index = {name: i for i, name in enumerate(names)}
    return np.fromiter((index[label] for label in labels), dtype=np.int64, count=len(labels))


__all__ = [
    "fewest_requests",
    "full_cache_counts",
    "pilot_shortfall",
    "split_strata",
    "strata_guarantee",
    "stratified_point",
    "stratum_guarantee",
    "stratum_labels",
    "stratum_spec",
    "too_small_reason",
    "with_stratum_coverage",
]
