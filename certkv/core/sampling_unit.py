"""The sampling unit of a certificate: what the calibration draw is an i.i.d. sample of.

Every statistic of a certificate rests on one assumption, that the calibration evidence is an
i.i.d. sample of some unit. Without ``requests.group_by: context`` the unit is the request
(:class:`RequestUnit`): k violations in n requests, the exact binomial p-value and its
Clopper–Pearson bound [1]_. When requests share contexts and the contract says so, the unit is
the context (:class:`ContextUnit`): questions of one document fail together, so the contexts,
not the questions, are the draws, and the p-values and bounds are :mod:`certkv.core.grouped`'s.

Everything that depends on that choice is a method of one interface, :class:`SamplingUnit`:
which tables it accepts (:meth:`~SamplingUnit.check`), the per-candidate p-values, bounds and
estimates (:meth:`~SamplingUnit.tally`, :meth:`~SamplingUnit.p_values`,
:meth:`~SamplingUnit.upper_bounds`), how a pilot and a validation split are drawn (whole units,
never part of one: :meth:`~SamplingUnit.draw_pilot`, :meth:`~SamplingUnit.split_evidence`), how
few units a stratum may hold, and what the guarantee says in words. :func:`sampling_unit` is the
only place that reads ``spec.grouping``; certify, strata, pilot and validation call the unit, so
a third unit would be one more class, not one more branch in each of them (the design of
scikit-learn's splitters and MAPIE's risk controllers: one interface, the choice made once).

The pilot draws (:func:`draw_pilot`, :func:`draw_pilot_groups`) live here rather than in
:mod:`certkv.core.pilot` because the unit draws them and the pilot module calls the unit;
:mod:`certkv.core.pilot` re-exports them. Torch-free: numpy and scipy.

References
----------
.. [1] C. J. Clopper and E. S. Pearson, "The use of confidence or fiducial limits illustrated in
   the case of the binomial", Biometrika 26(4), 404–413, 1934.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from certkv.core.binomial import (
    VIOLATION_EPS,
    binomial_p_value,
    binomial_p_value_table,
    clopper_pearson_upper,
    violation_mask,
)
from certkv.core.grouped import (
    Groups,
    betting_p_value,
    check_group_strata,
    group_values,
    grouped_estimate,
    grouped_p_values,
    grouped_promise,
    grouped_upper_bound,
)
from certkv.core.loss_table import LossTable
from certkv.core.procedures import candidate_levels
from certkv.core.spec import CertificationSpec, GroupingConfig
from certkv.errors import CertkvError

#: The fewest certification requests a pilot may leave.
MIN_CERTIFICATION = 100

#: How a grouped mean measure was tested, in the notes.
_TEST_NAMES = {"hoeffding_bentkus": "Hoeffding–Bentkus", "betting": "betting"}


# ----------------------------------------------------------------------------- the pilot draw


@dataclass(frozen=True)
class PilotSplit:
    """The pilot and certification requests of a table: ids and their columns (increasing
    indices into the table's sorted ``request_ids``).

    Examples
    --------
    >>> split = draw_pilot([f"r{i}" for i in range(400)], share=0.25, seed=0)
    >>> len(split.pilot_ids), len(split.certification_ids), split.share, split.seed
    (100, 300, 0.25, 0)
    >>> bool((split.pilot_columns[:-1] < split.pilot_columns[1:]).all())  # increasing table columns
    True
    """

    share: float
    seed: int
    pilot_ids: tuple[str, ...]
    certification_ids: tuple[str, ...]
    pilot_columns: np.ndarray
    certification_columns: np.ndarray


def pilot_size(n_units: int, share: float) -> int:
    """Units (requests, or contexts under grouping) the pilot takes out of `n_units`: ``round(share · n_units)``.

    Examples
    --------
    >>> pilot_size(400, 0.25), pilot_size(10, 0.04)  # round(0.4) takes no request
    (100, 0)
    """
    return int(round(share * n_units))


def _check_share(share: float) -> float:
    share = float(share)
    if not 0.0 < share < 1.0:
        raise CertkvError(f"gate.pilot: the pilot share must be strictly between 0 and 1, got {share!r}")
    return share


def draw_pilot(
    request_ids: Sequence[str], share: float, seed: int = 0, min_certification: int = MIN_CERTIFICATION
) -> PilotSplit:
    """Draw a pilot of requests (:meth:`RequestUnit.draw_pilot`): rank `request_ids` by
    ``sha256(f"{seed}:{request_id}")`` (hex) and take the first ``round(share · R)``; the rest
    certify. Contexts are drawn whole by :func:`draw_pilot_groups` instead.

    Deterministic and independent of any loss or signal. Raises a one-line error when the pilot
    would be empty or leave fewer than `min_certification` certification requests.

    Examples
    --------
    >>> split = draw_pilot([f"r{i}" for i in range(400)], share=0.25, seed=0)
    >>> len(split.pilot_ids), len(split.certification_ids)
    (100, 300)
    >>> reordered = draw_pilot([f"r{i}" for i in reversed(range(400))], 0.25, 0)
    >>> set(split.pilot_ids) == set(reordered.pilot_ids)  # the ids decide, not their order
    True
    """
    share = _check_share(share)
    ids = list(request_ids)
    n = len(ids)
    n_pilot = pilot_size(n, share)
    n_cert = n - n_pilot
    if n_cert < min_certification:
        need = next(
            r for r in range(min_certification, 100 * min_certification + 1) if r - pilot_size(r, share) >= min_certification
        )
        raise CertkvError(
            f"gate.pilot: a pilot share of {share:g} leaves {n_cert} of {n} requests to certify, fewer than "
            f"{min_certification}; lower gate.pilot or calibrate at least {need} requests"
        )
    if n_pilot < 1:
        raise CertkvError(f"gate.pilot: a pilot share of {share:g} of {n} requests draws no pilot request; raise gate.pilot")
    keys = [hashlib.sha256(f"{seed}:{rid}".encode()).hexdigest() for rid in ids]
    ranked = sorted(range(n), key=lambda i: (keys[i], ids[i]))
    pilot = np.sort(np.asarray(ranked[:n_pilot], dtype=np.int64))
    rest = np.sort(np.asarray(ranked[n_pilot:], dtype=np.int64))
    return PilotSplit(share, int(seed), tuple(ids[int(i)] for i in pilot), tuple(ids[int(i)] for i in rest), pilot, rest)


def draw_pilot_groups(
    request_ids: Sequence[str], groups: Sequence[str], share: float, seed: int = 0, min_certification: int = MIN_CERTIFICATION
) -> PilotSplit:
    """Draw a grouped pilot: rank the distinct `groups` by ``sha256(f"{seed}:{group}")`` and take
    the first ``round(share · G)`` contexts, every request of them; the rest certify. A context is
    never split between the pilot and the certification requests, since its questions are not
    independent of each other.

    Deterministic, independent of any loss or signal; one-line errors as :func:`draw_pilot`.

    Examples
    --------
    >>> ids = [f"r{i}" for i in range(400)]
    >>> split = draw_pilot_groups(ids, [f"doc{i // 4}" for i in range(400)], share=0.25, seed=0)
    >>> len(split.pilot_ids), len(split.certification_ids)  # 25 of 100 contexts, 4 questions each
    (100, 300)
    >>> len({int(r[1:]) // 4 for r in split.pilot_ids})  # whole contexts
    25
    """
    ids, labels = list(request_ids), list(groups)
    names = sorted(set(labels))
    n_pilot_groups = pilot_size(len(names), share)
    ranked = sorted(names, key=lambda g: (hashlib.sha256(f"{seed}:{g}".encode()).hexdigest(), g))
    chosen = set(ranked[:n_pilot_groups])
    in_pilot = np.fromiter((g in chosen for g in labels), dtype=bool, count=len(labels))
    pilot, rest = np.flatnonzero(in_pilot), np.flatnonzero(~in_pilot)
    if n_pilot_groups < 1:
        raise CertkvError(f"gate.pilot: a pilot share of {share:g} of {len(names)} contexts draws no context; raise gate.pilot")
    if rest.size < min_certification:
        raise CertkvError(
            f"gate.pilot: a pilot share of {share:g} leaves {rest.size} of {len(ids)} requests (whole contexts) to certify, "
            f"fewer than {min_certification}; lower gate.pilot or calibrate more contexts"
        )
    return PilotSplit(share, int(seed), tuple(ids[int(i)] for i in pilot), tuple(ids[int(i)] for i in rest), pilot, rest)


# ----------------------------------------------------------------------------- the fewest units


def most_generous_level(spec: CertificationSpec) -> float:
    """The largest level `spec`'s procedure gives any candidate (δ/m for fixed_sequence, δ/N for
    bonferroni and Holm's first step, δ for pilot_ordered).

    Examples
    --------
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.9, sequences=[["a@0.50"], ["b@0.50"]])
    >>> round(most_generous_level(spec), 12)  # two sequences share δ = 0.1
    0.05
    """
    return float(candidate_levels(np.zeros(len(spec.candidates)), spec.lengths, spec.delta, spec.procedure).max())


def fewest_requests(spec: CertificationSpec) -> int:
    """Fewest certification requests with which any candidate of `spec` can certify: n such that
    zero violations give a p-value ``(1 − ε)^n`` ≤ the most generous level the procedure gives a
    candidate (:func:`most_generous_level`).

    References
    ----------
    .. [1] C. J. Clopper and E. S. Pearson, "The use of confidence or fiducial limits illustrated in
           the case of the binomial", Biometrika 26(4), 404–413, 1934 (the exact p-value at k = 0).

    Examples
    --------
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.9, sequences=[["p@0.50"]])
    >>> n = fewest_requests(spec)
    >>> n, round(0.95 ** n, 4), round(0.95 ** (n - 1), 4)  # the first n with (1 − ε)^n ≤ δ
    (45, 0.0994, 0.1047)
    """
    level = most_generous_level(spec)
    n = max(1, math.ceil(math.log(level) / math.log1p(-spec.risk)))
    while n > 1 and binomial_p_value(0, n - 1, spec.risk) <= level:  # float rounding at the ceiling
        n -= 1
    while binomial_p_value(0, n, spec.risk) > level:
        n += 1
    return n


def fewest_betting_contexts(spec: CertificationSpec) -> int:
    """Fewest contexts with which the betting test certifies any candidate of `spec`: m such that m
    contexts without a violation give a betting p-value ≤ the most generous level the procedure
    gives a candidate (:func:`fewest_requests`'s level).

    Examples
    --------
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[["p@0.50"]], grouping={})
    >>> fewest_betting_contexts(spec), fewest_requests(spec)  # the binomial needs 59
    (91, 59)
    """
    level = most_generous_level(spec)
    m = fewest_requests(spec)
    while float(betting_p_value(np.zeros(m), spec.risk)) > level:
        m += 1
    return m


# ----------------------------------------------------------------------------- validation splits


def empirical_eligible(k: npt.ArrayLike, n: int, risk: float) -> np.ndarray:
    """Empirical thresholding's rule: calibration rate k/n ≤ ε (integer-safe comparison).

    k : (n_splits, n_candidates) int array of calibration violation counts (any shape); the flags have its shape.

    Examples
    --------
    >>> empirical_eligible([[0, 10, 11]], n=100, risk=0.1).tolist()  # k/n ≤ ε, 10/100 included
    [[True, True, False]]
    """
    return np.asarray(k) <= risk * n + VIOLATION_EPS


@dataclass(frozen=True)
class SplitBlock:
    """One block of validation splits as a unit sees it: per split (rows) and candidate (columns)
    the calibration half's ``p`` values, violated questions ``k_cal`` (integers), mean memory per
    question ``mem_cal``, and which candidates ``empirical`` thresholding would accept there;
    ``score(index)`` scores each split's chosen candidate (-1: the full cache) on its test half,
    as the fields of :class:`certkv.core.validation.SplitOutcomes`.

    Examples
    --------
    >>> table = LossTable.from_records([{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5,
    ...                                  "loss": float(i < 2)} for i in range(8)])
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.5, confidence=0.9, sequences=[["p@0.50"]])
    >>> block = RequestUnit().split_evidence(table, np.array([0]), spec, n_cal=4)(np.array([[1.0] * 4 + [0.0] * 4]))
    >>> block.k_cal.tolist(), block.empirical.tolist(), [part.tolist() for part in block.score(np.array([0]))]
    ([[2]], [[True]], [[0], [0], [0.5]])
    """

    p: np.ndarray
    k_cal: np.ndarray
    mem_cal: np.ndarray
    empirical: np.ndarray
    score: Callable[[np.ndarray], tuple[np.ndarray, ...]]


def _split_statistics(cal, violations, memory):
    """Violation counts and mean memory of every candidate on both halves of every split."""
    n_cal = cal[0].sum()
    n_test = cal.shape[1] - n_cal
    # Sums of 0/1 values below 2**53 are exact in float64; rint guards the conversion anyway.
    k_cal = np.rint(cal @ violations).astype(np.int64)
    k_test = np.rint(violations.sum(axis=0)).astype(np.int64) - k_cal
    mem_sum_cal = cal @ memory
    mem_cal = mem_sum_cal / n_cal
    mem_test = (memory.sum(axis=0) - mem_sum_cal) / n_test
    return k_cal, k_test, mem_cal, mem_test


def _score(index, k_test, mem_test):
    """Test violations and mean KV of the chosen candidate per split; fallback: 0 and 1.0."""
    safe = np.maximum(index, 0)[:, None]
    k = np.take_along_axis(k_test, safe, axis=1)[:, 0]
    used = np.take_along_axis(mem_test, safe, axis=1)[:, 0]
    fallback = index < 0
    return np.where(fallback, 0, k), np.where(fallback, 1.0, used)


# ----------------------------------------------------------------------------- the interface


@dataclass(frozen=True)
class UnitCounts:
    """Each candidate's violations per unit: ``k`` (C, U) violated questions of each unit (0/1 for
    a request) and ``sizes`` (U,) questions per unit (1 for a request): what a unit's p-values,
    bounds and estimates are computed from (:meth:`SamplingUnit.tally`).

    Examples
    --------
    >>> table = LossTable.from_records([{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5,
    ...                                  "loss": float(i == 0), "group": f"doc{i // 2}"} for i in range(4)])
    >>> counts = ContextUnit(GroupingConfig()).tally(table, table.loss > 0)
    >>> counts.k.tolist(), counts.sizes.tolist()  # doc0 (one of two questions violated) is ranked second
    ([[0, 1]], [2, 2])
    """

    k: np.ndarray
    sizes: np.ndarray


class SamplingUnit(ABC):
    """What the calibration draw is an i.i.d. sample of, and every statistic that follows from it.

    ``noun`` names one unit in messages ("request", "context"). Subclasses: :class:`RequestUnit`,
    :class:`ContextUnit`; :func:`sampling_unit` picks one from a spec. A certificate is
    ``p_values(tally(table, violations), ε)`` through the spec's procedure, each candidate then
    bounded by ``upper_bounds`` at its level; one interface, so certify, strata, the pilot and
    validation never ask which unit they hold.

    Examples
    --------
    Four contexts of two questions; one context fails on both:

    >>> table = LossTable.from_records([{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5,
    ...                                  "loss": float(i < 2), "group": f"doc{i // 2}"} for i in range(8)])
    >>> violations = table.loss > 0
    >>> for unit in (RequestUnit(independent=True), ContextUnit(GroupingConfig(measure="any_question"))):
    ...     counts = unit.tally(table, violations)
    ...     print(unit.noun, unit.count(table), round(float(unit.p_values(counts, 0.5)[0]), 4))
    request 8 0.1445
    context 4 0.3125
    """

    noun: ClassVar[str]

    @abstractmethod
    def check(self, table: LossTable) -> None:
        """One-line error when `table`'s groups do not fit this unit."""

    @abstractmethod
    def check_strata(self, table: LossTable, by: str, labels: Callable[[LossTable, str], Sequence[str]]) -> None:
        """One-line error when a unit spans two `by` strata (`labels(table, by)`: each request's
        stratum, read only where a unit could span two)."""

    @abstractmethod
    def count(self, table: LossTable) -> int:
        """How many units `table` holds."""

    @abstractmethod
    def tally(self, table: LossTable, violations: np.ndarray) -> UnitCounts:
        """Per-unit counts of the (C, R) request `violations` of a table's candidates."""

    @abstractmethod
    def p_values(self, counts: UnitCounts, risk: float) -> np.ndarray:
        """(C,) valid p-values of "the candidate's risk > ε"."""

    @abstractmethod
    def upper_bounds(self, counts: UnitCounts, p: np.ndarray, levels: np.ndarray, risk: float) -> np.ndarray:
        """(C,) upper confidence bounds on each candidate's risk at confidence 1 − its level."""

    @abstractmethod
    def candidate_fields(self, counts: UnitCounts) -> list[dict[str, Any]]:
        """Per candidate, the operating point fields this unit adds (the estimate of its measure)."""

    @abstractmethod
    def draw_pilot(self, table: LossTable, share: float, seed: int, min_certification: int = MIN_CERTIFICATION) -> PilotSplit:
        """The pilot of `table`, whole units (:func:`draw_pilot`)."""

    @abstractmethod
    def shortfall(self, table: LossTable, spec: CertificationSpec) -> str | None:
        """Why `table` (one stratum, pilot included) holds too few units to certify anything beyond
        the request counts every stratum is held to, or None."""

    @abstractmethod
    def split_evidence(
        self, table: LossTable, rows: np.ndarray, spec: CertificationSpec, n_cal: int
    ) -> Callable[[np.ndarray], SplitBlock]:
        """For validation: a function from (S, U) 0/1 calibration masks over the units (each row
        ``n_cal`` ones) to the :class:`SplitBlock` of those splits, for the candidates at table `rows`."""

    @abstractmethod
    def guarantee(self, spec: CertificationSpec) -> str:
        """The pooled certificate's promise in words, with its scope."""

    @abstractmethod
    def stratum_promise(self, spec: CertificationSpec, by: str, name: str) -> str:
        """One certified stratum's promise in words."""

    def strata_clause(self, spec: CertificationSpec) -> str:
        """What a stratified guarantee adds about this unit ("" for requests)."""
        return ""

    def notes(self, table: LossTable) -> list[str]:
        """Notes an operating point carries about this unit."""
        return []

    def validation_note(self) -> str:
        """What a validation's sizes and risks count, when not requests ("" for requests)."""
        return ""


def sampling_unit(spec: CertificationSpec) -> SamplingUnit:
    """The sampling unit of `spec`: the context under ``grouping`` (``requests.group_by: context``),
    else the request. The one place that reads ``spec.grouping``.

    Examples
    --------
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> type(sampling_unit(spec)).__name__, type(sampling_unit(spec.model_copy(update={"grouping": GroupingConfig()}))).__name__
    ('RequestUnit', 'ContextUnit')
    """
    if spec.grouping is None:
        return RequestUnit(independent=spec.independent_requests)
    return ContextUnit(spec.grouping)


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RequestUnit(SamplingUnit):
    """Independent requests: k violations in n requests, the exact binomial p-value
    ``P(Binomial(n, ε) ≤ k)``, its Clopper–Pearson bound and the rate k/n; pilots and validation
    splits draw requests. ``independent``: requests that share a context were declared independent
    (``requests.group_by: request``); otherwise a table whose groups repeat is refused.

    Examples
    --------
    >>> table = LossTable.from_records([{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5,
    ...                                  "loss": float(i < 3)} for i in range(100)])
    >>> unit = RequestUnit()
    >>> counts = unit.tally(table, table.loss[[0]] > 0)
    >>> p = unit.p_values(counts, risk=0.1)
    >>> round(float(p[0]), 6), round(float(unit.upper_bounds(counts, p, np.array([0.05]), 0.1)[0]), 4)
    (0.007836, 0.0757)
    """

    independent: bool = False
    noun: ClassVar[str] = "request"

    def check(self, table: LossTable) -> None:
        """Refuse records whose requests share contexts unless they were declared independent.

        Examples
        --------
        >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0, "group": f"doc{i // 2}"}
        ...         for i in range(4)]
        >>> RequestUnit().check(LossTable.from_records(rows))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        certkv.errors.CertkvError: records: requests share contexts (group 'doc0' has 2 requests: 'r0', 'r1'); set ...
        >>> RequestUnit(independent=True).check(LossTable.from_records(rows))
        """
        if table.groups is None or self.independent:
            return
        sizes = Counter(table.groups)
        name = next((g for g in table.groups if sizes[g] > 1), None)
        if name is not None:
            size = sizes[name]
            members = [r for r, g in zip(table.request_ids, table.groups) if g == name]
            shown = ", ".join(repr(r) for r in members[:3]) + (f" and {size - 3} more" if size > 3 else "")
            raise CertkvError(
                f"{table.source}: requests share contexts (group {name!r} has {size} requests: {shown}); set "
                "requests.group_by: context in the contract (or request to treat them as independent)"
            )

    def check_strata(self, table: LossTable, by: str, labels: Callable[[LossTable, str], Sequence[str]]) -> None:
        return None  # a request lies in one stratum by definition; its labels are read when the strata are split

    def count(self, table: LossTable) -> int:
        return table.n_requests

    def tally(self, table: LossTable, violations: np.ndarray) -> UnitCounts:
        return UnitCounts(np.asarray(violations), np.ones(table.n_requests, dtype=np.int64))

    def p_values(self, counts: UnitCounts, risk: float) -> np.ndarray:
        n = counts.sizes.size
        return np.array([binomial_p_value(int(kj), n, risk) for kj in counts.k.sum(axis=1)])

    def upper_bounds(self, counts: UnitCounts, p: np.ndarray, levels: np.ndarray, risk: float) -> np.ndarray:
        n = counts.sizes.size
        return np.array([clopper_pearson_upper(int(kj), n, 1.0 - float(lv)) for kj, lv in zip(counts.k.sum(axis=1), levels)])

    def candidate_fields(self, counts: UnitCounts) -> list[dict[str, Any]]:
        return [{} for _ in range(counts.k.shape[0])]

    def draw_pilot(self, table: LossTable, share: float, seed: int, min_certification: int = MIN_CERTIFICATION) -> PilotSplit:
        return draw_pilot(table.request_ids, share, seed, min_certification)

    def shortfall(self, table: LossTable, spec: CertificationSpec) -> str | None:
        return None  # its units are the requests, whose count every stratum is held to already

    def split_evidence(
        self, table: LossTable, rows: np.ndarray, spec: CertificationSpec, n_cal: int
    ) -> Callable[[np.ndarray], SplitBlock]:
        """Splits of requests: each block's counts are one matrix product, its p-values a lookup in
        the exact binomial table of ``n_cal`` requests."""
        violations = violation_mask(table.loss[rows], spec.tolerance).T.astype(float)  # (R, C)
        memory = np.ascontiguousarray(table.memory[rows].T)  # (R, C)
        p_table = binomial_p_value_table(n_cal, spec.risk)

        def block(cal: np.ndarray) -> SplitBlock:
            k_cal, k_test, mem_cal, mem_test = _split_statistics(cal, violations, memory)
            return SplitBlock(
                p_table[k_cal], k_cal, mem_cal, empirical_eligible(k_cal, n_cal, spec.risk),
                lambda index: (index, *_score(index, k_test, mem_test)),
            )

        return block

    def guarantee(self, spec: CertificationSpec) -> str:
        return (
            f"With probability ≥ {spec.confidence:g} over the calibration draw, at most "
            f"{spec.risk * 100:g}% of requests from the calibration distribution lose more than "
            f"{float(spec.tolerance)} utility. This covers the calibration distribution (the declared "
            "task mix), not each task or each request on its own."
        )

    def stratum_promise(self, spec: CertificationSpec, by: str, name: str) -> str:
        return (
            f"With probability ≥ {spec.confidence:.12g} over the calibration draw, at most {spec.risk * 100:g}% of "
            f"{by} {name!r} requests lose more than {float(spec.tolerance)} utility under this policy."
        )


# ----------------------------------------------------------------------------- contexts


@dataclass(frozen=True)
class ContextUnit(SamplingUnit):
    """Contexts as the i.i.d. unit (:mod:`certkv.core.grouped`): context g has n_g questions, k_g
    of them violated; ``grouping`` says which measure of the pairs (k_g, n_g) the guarantee bounds
    and how it is tested. Violation counts stay integers over questions; p-values, bounds and the
    estimate come from the contexts, and pilots and validation splits take whole contexts.

    Examples
    --------
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": float(i < 4),
    ...          "group": f"doc{i // 4}"} for i in range(400)]  # one context of four fails whole
    >>> table, unit = LossTable.from_records(rows), ContextUnit(GroupingConfig(measure="any_question"))
    >>> counts = unit.tally(table, table.loss[[0]] > 0)
    >>> int(counts.k.sum()), counts.sizes.size, unit.candidate_fields(counts)  # 4 questions, 1 context of 100
    (4, 100, [{'n_contexts': 100, 'grouped_risk': 0.01}])
    """

    grouping: GroupingConfig
    noun: ClassVar[str] = "context"

    def check(self, table: LossTable) -> None:
        """Refuse records without a group column: there are no contexts to draw.

        Examples
        --------
        >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(4)]
        >>> ContextUnit(GroupingConfig()).check(LossTable.from_records(rows))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        certkv.errors.CertkvError: records: the spec certifies over context groups but the records have no group column; ...
        """
        if table.groups is None:
            raise CertkvError(
                f"{table.source}: the spec certifies over context groups but the records have no group column; "
                "recalibrate so that every record carries its request's group, or set requests.group_by: request"
            )

    def check_strata(self, table: LossTable, by: str, labels: Callable[[LossTable, str], Sequence[str]]) -> None:
        if table.groups is not None:
            check_group_strata(table.groups, labels(table, by), by)

    def _groups(self, table: LossTable) -> Sequence[str]:
        self.check(table)
        assert table.groups is not None  # check refused a table without groups
        return table.groups

    def count(self, table: LossTable) -> int:
        return len(set(self._groups(table)))

    def tally(self, table: LossTable, violations: np.ndarray) -> UnitCounts:
        groups = Groups.of(self._groups(table))
        return UnitCounts(groups.counts(violations), groups.sizes)

    def p_values(self, counts: UnitCounts, risk: float) -> np.ndarray:
        g = self.grouping
        return np.asarray(grouped_p_values(counts.k, counts.sizes, g.measure, risk, bound=g.bound), dtype=float)

    def upper_bounds(self, counts: UnitCounts, p: np.ndarray, levels: np.ndarray, risk: float) -> np.ndarray:
        g = self.grouping
        bounds = np.asarray(grouped_upper_bound(counts.k, counts.sizes, g.measure, 1.0 - levels, bound=g.bound), dtype=float)
        # the bound reports the decision: a test that certifies at ε bounds the risk by ε at most, also where
        # the p-value is not monotone in ε′ and the bisection finds a larger ε′ (Hoeffding–Bentkus, per_question)
        return np.where(p <= levels, np.minimum(bounds, risk), bounds)

    def candidate_fields(self, counts: UnitCounts) -> list[dict[str, Any]]:
        estimates = np.asarray(grouped_estimate(counts.k, counts.sizes, self.grouping.measure), dtype=float)
        return [{"n_contexts": int(counts.sizes.size), "grouped_risk": float(e)} for e in estimates]

    def draw_pilot(self, table: LossTable, share: float, seed: int, min_certification: int = MIN_CERTIFICATION) -> PilotSplit:
        return draw_pilot_groups(table.request_ids, self._groups(table), _check_share(share), seed, min_certification)

    def fewest(self, spec: CertificationSpec) -> int:
        """Fewest contexts without a violation that certify anything: with no violation the
        Hoeffding–Bentkus and any-question p-values over m contexts are (1 − ε)^m, the binomial one
        over m requests, so :func:`fewest_requests` carries over; the betting test, which learns its
        bets as it goes, needs more (:func:`fewest_betting_contexts`)."""
        if self.grouping.bound == "betting" and self.grouping.measure != "any_question":
            return fewest_betting_contexts(spec)
        return fewest_requests(spec)

    def shortfall(self, table: LossTable, spec: CertificationSpec) -> str | None:
        """Fewer certification contexts (after a pilot's) than a zero-violation certificate needs (:meth:`fewest`).

        Examples
        --------
        >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0, "group": f"doc{i // 8}"}
        ...         for i in range(400)]
        >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[["p@0.50"]],
        ...                          grouping={"bound": "hoeffding_bentkus"})
        >>> print(ContextUnit(spec.grouping).shortfall(LossTable.from_records(rows), spec))
        50 certification contexts, fewer than the 59 that certifying anything at ε = 0.05 and confidence 0.95 needs with
        zero violations
        >>> print(ContextUnit(GroupingConfig()).shortfall(LossTable.from_records(rows), spec))  # betting needs 91
        50 certification contexts, fewer than the 91 that certifying anything at ε = 0.05 and confidence 0.95 needs with
        zero violations
        """
        if table.groups is None:
            return None
        n_contexts = len(set(table.groups))
        n_cert = n_contexts - (pilot_size(n_contexts, spec.pilot.share) if spec.pilot is not None else 0)
        need = self.fewest(spec)
        if n_cert >= need:
            return None
        return (
            f"{n_cert} certification contexts, fewer than the {need} that certifying anything at "
            f"ε = {spec.risk:g} and confidence {spec.confidence:.12g} needs with zero violations"
        )

    def split_evidence(
        self, table: LossTable, rows: np.ndarray, spec: CertificationSpec, n_cal: int
    ) -> Callable[[np.ndarray], SplitBlock]:
        """Splits of contexts: every question of a context on one side; certkv decides on the grouped
        p-values of the calibration contexts, empirical thresholding on the measure's calibration
        estimate, and a split's test risk is the measure on its test contexts, weighted by test
        contexts (test questions for ``per_question``) when strata are pooled."""
        measure = self.grouping.measure
        groups = Groups.of(self._groups(table))
        k_groups = groups.counts(violation_mask(table.loss[rows], spec.tolerance)).T.astype(float)  # (G, C)
        values = group_values(k_groups.T, groups.sizes, measure, spec.risk).T  # (G, C)
        memory = groups.sums(table.memory[rows]).T  # (G, C) memory summed per context
        sizes = groups.sizes.astype(float)
        g_test = groups.n_groups - n_cal

        def block(cal: np.ndarray) -> SplitBlock:
            halves = [_grouped_half(mask, k_groups, values, memory, sizes, measure) for mask in (cal, 1.0 - cal)]
            (k_cal, est_cal, mem_cal), (k_test, est_test, mem_test) = halves
            p = self._split_p(spec, cal, k_groups, groups.sizes, n_cal)
            weight = (1.0 - cal) @ sizes if measure == "per_question" else np.full(cal.shape[0], float(g_test))

            def score(index: np.ndarray) -> tuple[np.ndarray, ...]:
                k, used = _score(index, k_test, mem_test)
                risk = np.where(index < 0, 0.0, np.take_along_axis(est_test, np.maximum(index, 0)[:, None], axis=1)[:, 0])
                return index, k, used, risk, weight

            return SplitBlock(p, k_cal, mem_cal, est_cal <= spec.risk + VIOLATION_EPS, score)

        return block

    def _split_p(
        self, spec: CertificationSpec, cal: np.ndarray, k_groups: np.ndarray, sizes: np.ndarray, g_cal: int
    ) -> np.ndarray:
        """The grouped p-values (S, C) of every candidate on every split's calibration contexts (`cal`:
        (S, G) masks, `k_groups`: (G, C) violated questions per context, `sizes`: (G,) questions per
        context): :func:`certkv.core.grouped.grouped_p_values` on each split's contexts, taken in the
        Groups order as certify takes them (``per_question``'s N: the whole table's largest context)."""
        columns = np.flatnonzero(cal.ravel() > 0).reshape(cal.shape[0], g_cal) % cal.shape[1]  # (S, g_cal)
        k = np.swapaxes(k_groups[columns], 1, 2)  # (S, C, g_cal)
        return grouped_p_values(k, sizes[columns][:, None, :], self.grouping.measure, spec.risk, n_max=int(sizes.max()),
                                bound=self.grouping.bound)

    def guarantee(self, spec: CertificationSpec) -> str:
        return (
            f"With probability ≥ {spec.confidence:g} over the calibration draw, "
            f"{grouped_promise(self.grouping.measure, spec.risk, spec.tolerance)}. This covers the calibration "
            "distribution (the declared task mix), not each task, context or question on its own."
        )

    def stratum_promise(self, spec: CertificationSpec, by: str, name: str) -> str:
        return (
            f"With probability ≥ {spec.confidence:.12g} over the calibration draw, for {by} {name!r} under this policy: "
            f"{grouped_promise(self.grouping.measure, spec.risk, spec.tolerance)}."
        )

    def strata_clause(self, spec: CertificationSpec) -> str:
        return f" Each stratum's share is over its contexts: {grouped_promise(self.grouping.measure, spec.risk, spec.tolerance)}."

    def notes(self, table: LossTable) -> list[str]:
        if table.groups is None:
            return []
        g = self.grouping
        return [
            f"certified over {len(set(table.groups))} contexts of {table.n_requests} requests ({g.measure}, "
            f"{_TEST_NAMES[g.bound] if g.measure != 'any_question' else 'binomial'}): "
            "violations count questions, p-values and bounds come from the contexts"
        ]

    def validation_note(self) -> str:
        return (
            f" Split by context ({self.grouping.measure}): n_calibration and n_test count contexts, and a split's "
            "test risk is the grouped measure on its test contexts."
        )


def _grouped_half(mask, k_groups, values, memory, sizes, measure):
    """One half of grouped splits, `mask` (S, G) marking its contexts: its question violations
    (S, C) as integers, its estimate of the measure and its mean memory per question."""
    questions = mask @ sizes  # (S,)
    k = np.rint(mask @ k_groups).astype(np.int64)
    estimate = k / questions[:, None] if measure == "per_question" else (mask @ values) / mask.sum(axis=1, keepdims=True)
    return k, estimate, (mask @ memory) / questions[:, None]


__all__ = [
    "MIN_CERTIFICATION",
    "ContextUnit",
    "PilotSplit",
    "RequestUnit",
    "SamplingUnit",
    "SplitBlock",
    "UnitCounts",
    "draw_pilot",
    "draw_pilot_groups",
    "empirical_eligible",
    "fewest_betting_contexts",
    "fewest_requests",
    "most_generous_level",
    "pilot_size",
    "sampling_unit",
]
