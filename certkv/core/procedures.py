"""Family-wise error control over the candidate sequences of a contract.

A contract tests many candidates (press × retention × gate setting) on the same calibration
requests. Picking "the most aggressive candidate whose p-value is small" without correction would
let chance pick a bad candidate far more often than δ. The procedures here keep the probability of
certifying ANY candidate whose true violation rate exceeds ε at most δ (family-wise error rate):

* ``fixed_sequence``: each sequence is tested in the contract's order (conservative first) and
  testing stops at the first failure, so the certified set of a sequence is a prefix. No level is
  lost within a sequence; m sequences share δ by a Bonferroni split (δ/m each). One pre-registered
  interleaved order is simply m = 1.
* ``bonferroni``: every candidate is tested at δ / N, N being the total number of candidates.
* ``holm``: Holm's step-down over all N candidates; never certifies less than Bonferroni.
* ``pilot_ordered``: split fixed-sequence testing. A pilot split of the requests (which never
  certifies) orders every candidate into ONE sequence by its pilot violation rate
  (:mod:`certkv.core.pilot`); the certification requests then test that sequence at the full δ.
  The order depends on the pilot only, which is independent of the certification requests, so it
  is pre-registered with respect to them. Here the sequences given are concatenated and tested as
  one fixed sequence at δ.

The order of the candidates comes from the contract (or, for ``pilot_ordered``, from the pilot)
and never from the certification data; the functions below take it as given.

Each procedure is one small class (:class:`FixedSequence`, :class:`Bonferroni`, :class:`Holm`,
:class:`PilotOrdered`) whose methods are the steps callers need: the certified mask, the level of
each candidate and where each sequence stopped. :data:`REGISTRY` holds one of each by the names
contracts use; the plain functions (:func:`certified_mask`, :func:`candidate_levels`,
:func:`sequence_stops`) look the name up and call the step, so a new
procedure is one class here and a name in :data:`Procedure`.

Layout: the vectorised steps take p-values of shape ``(..., N)`` where the last axis holds the
candidates of all sequences concatenated in contract order, and ``lengths`` gives each sequence's
length. The leading axes are free, so repeated-split validation runs the very same code on
thousands of splits at once.

The overall scheme, one valid p-value per candidate turned into a certified set by a family-wise
procedure, is the Learn-then-Test framework [1]_; the procedures are the classical ones: a
Bonferroni split [2]_, fixed-sequence testing of pre-ordered hypotheses [3]_ [4]_, and Holm's
step-down [5]_.

References
----------
.. [1] A. N. Angelopoulos, S. Bates, E. J. Candès, M. I. Jordan and L. Lei, "Learn then Test:
   Calibrating predictive algorithms to achieve risk control", arXiv:2110.01052, 2021.
.. [2] O. J. Dunn, "Multiple comparisons among means", Journal of the American Statistical
   Association 56(293), 52–64, 1961.
.. [3] W. Maurer, L. A. Hothorn and W. Lehmacher, "Multiple comparisons in drug clinical trials
   and preclinical assays: a-priori ordered hypotheses", in Biometrie in der
   chemisch-pharmazeutischen Industrie 6, 3–18, 1995.
.. [4] P. H. Westfall and A. Krishen, "Optimally weighted, fixed sequence and gatekeeper multiple
   testing procedures", Journal of Statistical Planning and Inference 99(1), 25–40, 2001.
.. [5] S. Holm, "A simple sequentially rejective multiple test procedure", Scandinavian Journal
   of Statistics 6(2), 65–70, 1979.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Literal, get_args

import numpy as np
import numpy.typing as npt

from certkv.errors import CertkvError

#: The family-wise procedures, by the names contracts and specs use.
Procedure = Literal["fixed_sequence", "bonferroni", "holm", "pilot_ordered"]
PROCEDURES: tuple[str, ...] = get_args(Procedure)


@dataclass(frozen=True)
class SequenceStop:
    """Where testing of one sequence ended.

    ``level`` is the per-test significance level of the sequence (None for Holm, whose level
    depends on each candidate's rank). ``stopped_at`` is the position of the first candidate that
    was not certified (None if all were); for ``fixed_sequence`` nothing after it was tested.

    Examples
    --------
    >>> flags = certified_mask([0.001, 0.01, 0.2], [3], 0.1, "fixed_sequence")
    >>> sequence_stops(flags, [3], 0.1, "fixed_sequence")[0]
    SequenceStop(index=0, length=3, level=0.1, tested=3, certified=2, stopped_at=2)
    """

    index: int
    length: int
    level: float | None
    tested: int
    certified: int
    stopped_at: int | None


def check_procedure(procedure: str) -> str:
    """Reject unknown procedure names with the list of valid ones.

    Examples
    --------
    >>> check_procedure("holm")
    'holm'
    >>> check_procedure("bh")
    Traceback (most recent call last):
    ...
    certkv.errors.CertkvError: procedure must be one of fixed_sequence, bonferroni, holm, pilot_ordered; got 'bh'
    """
    if procedure not in PROCEDURES:
        raise CertkvError(f"procedure must be one of {', '.join(PROCEDURES)}; got {procedure!r}")
    return procedure


def check_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    """At least one sequence, and no empty sequence (an empty sequence would waste level)."""
    lengths = tuple(int(x) for x in lengths)
    if not lengths:
        raise CertkvError("sequences: give at least one sequence of candidates")
    for i, length in enumerate(lengths):
        if length < 1:
            raise CertkvError(f"sequences[{i}] is empty; remove it or list its candidates")
    return lengths


def check_delta(delta: float) -> float:
    """δ = 1 − confidence must lie strictly between 0 and 1."""
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise CertkvError(f"delta (1 - confidence) must be strictly between 0 and 1, got {delta!r}")
    return delta


def _check_p_values(p: np.ndarray, n_total: int) -> np.ndarray:
    p = np.asarray(p, dtype=float)
    if p.ndim < 1 or p.shape[-1] != n_total:
        raise CertkvError(f"expected {n_total} p-values on the last axis, got shape {p.shape}")
    if not np.all((p >= 0.0) & (p <= 1.0)):
        raise CertkvError("p-values must be numbers in [0, 1] (NaN is not allowed)")
    return p


def _segments(lengths: Sequence[int]):
    """(start, stop) column ranges of each sequence in the concatenated layout."""
    stops = np.cumsum(lengths)
    return list(zip((stops - np.asarray(lengths)).tolist(), stops.tolist()))


def _inputs(p, lengths: Sequence[int], delta) -> tuple[tuple[int, ...], np.ndarray, float]:
    """The checks every step runs, in this order: the sequences, the p-values, then δ."""
    lengths = check_lengths(lengths)
    p = _check_p_values(p, sum(lengths))
    return lengths, p, check_delta(delta)


# ----------------------------------------------------------------------------- the procedures


class FwerProcedure(ABC):
    """One family-wise procedure: the steps every caller needs, on validated inputs.

    A procedure says which candidates it certifies (:meth:`mask`), the level each candidate's
    p-value is compared with (:meth:`levels`) and where testing of each sequence ended
    (:meth:`stops`). Subclasses fill in the steps; the public methods validate first, so that the
    three answers always rest on the same checks. Instances hold no state: :data:`REGISTRY` keeps
    one per name, as contracts spell them.

    Examples
    --------
    >>> proc = REGISTRY["fixed_sequence"]
    >>> isinstance(proc, FwerProcedure), proc.stops_at_first_failure
    (True, True)
    >>> proc.mask([0.001, 0.2, 0.001], [3], 0.1).tolist()  # the third is never reached
    [True, False, False]
    """

    #: The name contracts and specs use.
    name: ClassVar[str]
    #: Tests an order and stops at the first failure (later candidates: not tested).
    stops_at_first_failure: ClassVar[bool] = False
    #: Its test order comes from a pilot split, which it therefore requires.
    orders_by_pilot: ClassVar[bool] = False

    def mask(self, p: npt.ArrayLike, lengths: Sequence[int], delta: float) -> np.ndarray:
        """Certified flags, shape ``(..., N)`` in and out (`p`: the p-values, N = sum of `lengths`)."""
        lengths, p, delta = _inputs(p, lengths, delta)
        return self._mask(p, lengths, delta)

    def levels(self, p: npt.ArrayLike, lengths: Sequence[int], delta: float) -> np.ndarray:
        """The level each candidate's p-value is compared with, shape ``(..., N)`` in (`p`) and out."""
        lengths, p, delta = _inputs(p, lengths, delta)
        return self._levels(p, lengths, delta)

    def stops(self, certified_flat: np.ndarray, lengths: Sequence[int], delta: float) -> tuple[SequenceStop, ...]:
        """Per sequence, how far testing went and how much was certified (one decision: `certified_flat`
        is an (N,) bool array, the sequences concatenated)."""
        lengths = check_lengths(lengths)
        delta = check_delta(delta)
        segments = _segments(lengths)
        flags = [np.asarray(certified_flat[start:stop], dtype=bool) for start, stop in segments]
        tested = self._tested(np.concatenate(flags), lengths)
        level = self._level(lengths, delta)
        stops = []
        for index, ((start, stop), seq_flags) in enumerate(zip(segments, flags)):
            failures = np.flatnonzero(~seq_flags)
            stops.append(
                SequenceStop(
                    index=index,
                    length=len(seq_flags),
                    level=level,
                    tested=int(np.count_nonzero(tested[start:stop])),
                    certified=int(seq_flags.sum()),
                    stopped_at=int(failures[0]) if failures.size else None,
                )
            )
        return tuple(stops)

    # The steps, on inputs already validated (lengths a tuple, p a float array in [0, 1], δ a float).

    @abstractmethod
    def _level(self, lengths: tuple[int, ...], delta: float) -> float | None:
        """The one level shared by every candidate, or None when it depends on the candidate."""

    @abstractmethod
    def _mask(self, p: np.ndarray, lengths: tuple[int, ...], delta: float) -> np.ndarray:
        """Certified flags; p already checked against `lengths`."""

    def _levels(self, p: np.ndarray, lengths: tuple[int, ...], delta: float) -> np.ndarray:
        return np.full(p.shape, self._level(lengths, delta))

    def _tested(self, flat: np.ndarray, lengths: tuple[int, ...]) -> np.ndarray:
        """Which positions of the concatenated layout were tested: all, unless an order stops early."""
        return np.ones(flat.shape, dtype=bool)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FixedSequence(FwerProcedure):
    """Each sequence tested in contract order at δ/m, stopping at its first failure.

    No level is lost within a sequence, so the only split is across the m sequences. Within a
    chain of tests, candidate j is certified only if it and every candidate before it pass: a
    running product of the pass flags, which makes the certified set of a chain a prefix.

    Why no level is lost within a chain: a later candidate is reached only through every earlier
    one, so any false certificate in a chain needs its first candidate truly above ε to pass its
    test at δ/m. Each chain therefore errs with probability at most δ/m, and the m chains together
    at most δ (Maurer, Hothorn & Lehmacher 1995; see the module's References).

    Examples
    --------
    >>> p = [0.001, 0.01, 0.2, 0.03, 0.06, 0.001]  # two sequences of three
    >>> FixedSequence().mask(p, [3, 3], 0.1).tolist()  # δ/2 per sequence, each a prefix
    [True, True, False, True, False, False]
    >>> FixedSequence().levels(p, [3, 3], 0.1).tolist()
    [0.05, 0.05, 0.05, 0.05, 0.05, 0.05]
    """

    name = "fixed_sequence"
    stops_at_first_failure = True

    def _chains(self, lengths: tuple[int, ...]) -> list[tuple[int, int]]:
        """(start, stop) column ranges tested as one order each: here, every sequence."""
        return _segments(lengths)

    def _level(self, lengths, delta):
        return delta / len(lengths)

    def _mask(self, p, lengths, delta):
        passed = p <= self._level(lengths, delta)
        out = np.zeros(p.shape, dtype=bool)
        for start, stop in self._chains(lengths):
            out[..., start:stop] = np.logical_and.accumulate(passed[..., start:stop], axis=-1)
        return out

    def _tested(self, flat, lengths):
        tested = np.zeros(flat.shape, dtype=bool)
        for start, stop in self._chains(lengths):  # up to and including the chain's first failure
            failures = np.flatnonzero(~flat[start:stop])
            cut = start + int(failures[0]) if failures.size else stop
            tested[start : min(cut + 1, stop)] = True
        return tested


class PilotOrdered(FixedSequence):
    """Split fixed-sequence testing: the sequences concatenated, tested as ONE order at the full δ.

    The order was set on a pilot split that never certifies (:mod:`certkv.core.pilot`), so it is
    pre-registered with respect to the certification requests and needs no split of δ.

    Examples
    --------
    >>> p = [0.001, 0.01, 0.2, 0.03, 0.06, 0.001]
    >>> PilotOrdered().mask(p, [3, 3], 0.1).tolist()  # one order at the full δ: stops at 0.2
    [True, True, False, False, False, False]
    """

    name = "pilot_ordered"
    orders_by_pilot = True

    def _chains(self, lengths):
        return [(0, sum(lengths))]

    def _level(self, lengths, delta):
        return delta


class Bonferroni(FwerProcedure):
    """Every candidate tested at δ / N, in any order: the simplest split, and never stops.

    Valid by the union bound alone, whatever the dependence between the p-values (Dunn 1961; see
    the module's References).

    Examples
    --------
    >>> p = [0.001, 0.01, 0.2, 0.03, 0.06, 0.001]
    >>> Bonferroni().mask(p, [3, 3], 0.1).tolist()  # each at 0.1 / 6, in any order
    [True, True, False, False, False, True]
    """

    name = "bonferroni"

    def _level(self, lengths, delta):
        return delta / sum(lengths)

    def _mask(self, p, lengths, delta):
        return p <= self._level(lengths, delta)


class Holm(FwerProcedure):
    """Holm's step-down over all N candidates; never certifies less than Bonferroni.

    Sort the p-values ascending; the i-th smallest (0-based) is compared with δ / (N − i), and
    testing stops at the first comparison that fails. Ties are broken by the stable sort, which
    does not change the set certified (tied p-values pass or fail together in effect). The level
    depends on the rank, so a sequence has none of its own.

    Holm (1979; see the module's References) shows it controls the family-wise error rate under
    any dependence, like Bonferroni, while rejecting at least as much.

    Examples
    --------
    >>> p = [0.001, 0.01, 0.2, 0.03, 0.06, 0.001]
    >>> Holm().mask(p, [3, 3], 0.1).tolist()  # 0.03 passes at 0.1 / 3, which Bonferroni misses
    [True, True, False, True, False, True]
    >>> Holm().levels(p, [3, 3], 0.1).round(4).tolist()
    [0.0167, 0.025, 0.1, 0.0333, 0.05, 0.02]
    """

    name = "holm"

    def _level(self, lengths, delta):
        return None

    def _mask(self, p, lengths, delta):
        n_total = p.shape[-1]
        order = np.argsort(p, axis=-1, kind="stable")
        ranked = np.take_along_axis(p, order, axis=-1)
        thresholds = delta / (n_total - np.arange(n_total))
        passed_ranked = np.logical_and.accumulate(ranked <= thresholds, axis=-1)
        out = np.empty(p.shape, dtype=bool)
        np.put_along_axis(out, order, passed_ranked, axis=-1)
        return out

    def _levels(self, p, lengths, delta):
        n_total = p.shape[-1]
        order = np.argsort(p, axis=-1, kind="stable")
        ranks = np.empty(p.shape, dtype=np.int64)
        np.put_along_axis(ranks, order, np.broadcast_to(np.arange(n_total), p.shape), axis=-1)
        return delta / (n_total - ranks)


#: One instance per procedure, by the names contracts use, in the order of :data:`PROCEDURES`.
REGISTRY: Mapping[str, FwerProcedure] = MappingProxyType(
    {proc.name: proc for proc in (FixedSequence(), Bonferroni(), Holm(), PilotOrdered())}
)
if tuple(REGISTRY) != PROCEDURES:  # the Literal (what contracts validate) and the code must agree
    raise ImportError(f"procedure registry {tuple(REGISTRY)} does not match Procedure {PROCEDURES}")

#: Procedures that test one order and stop at the first failure (later candidates: not tested).
FIXED_ORDER: tuple[str, ...] = tuple(name for name, proc in REGISTRY.items() if proc.stops_at_first_failure)


def procedure_of(procedure: str) -> FwerProcedure:
    """The procedure named `procedure`; unknown names get :func:`check_procedure`'s error.

    Examples
    --------
    >>> procedure_of("holm")
    Holm()
    >>> procedure_of("pilot_ordered").orders_by_pilot, procedure_of("fixed_sequence").stops_at_first_failure
    (True, True)
    """
    return REGISTRY[check_procedure(procedure)]


# ----------------------------------------------------------------------------- functions


def certified_mask(p: npt.ArrayLike, lengths: Sequence[int], delta: float, procedure: str) -> np.ndarray:
    """Dispatch to the procedure named in the contract; shape ``(..., N)`` in, booleans out.

    p : (..., N) float array of p-values, the candidates of all sequences concatenated on the last axis.

    Examples
    --------
    Two sequences of three candidates, most KV first, at δ = 0.1. Fixed-sequence testing tests
    each at 0.05 and stops at its first failure, so the second sequence never reaches its last
    candidate:

    >>> p = [0.001, 0.01, 0.2, 0.03, 0.06, 0.001]
    >>> certified_mask(p, [3, 3], 0.1, "fixed_sequence").tolist()
    [True, True, False, True, False, False]

    Bonferroni tests each at 0.1 / 6: the last candidate passes although its sequence stopped
    before it. Holm's step-down meets 0.1/6, 0.1/5, 0.1/4 and 0.1/3, then 0.06 > 0.1/2 stops it:
    it certifies everything Bonferroni does, and here one more.

    >>> certified_mask(p, [3, 3], 0.1, "bonferroni").tolist()
    [True, True, False, False, False, True]
    >>> certified_mask(p, [3, 3], 0.1, "holm").tolist()
    [True, True, False, True, False, True]

    Leading axes are free: one row per validation split.

    >>> certified_mask([p, [0.2] * 6], [3, 3], 0.1, "fixed_sequence").tolist()
    [[True, True, False, True, False, False], [False, False, False, False, False, False]]
    """
    return procedure_of(procedure).mask(p, lengths, delta)


def candidate_levels(p: npt.ArrayLike, lengths: Sequence[int], delta: float, procedure: str) -> np.ndarray:
    """The significance level each candidate's p-value is compared with, an array of `p`'s shape.

    fixed_sequence: δ/m; bonferroni: δ/N; holm: δ/(N − rank), rank of the candidate's p-value;
    pilot_ordered: δ.
    Reporting it lets a reader check ``p <= level`` (and the matching Clopper–Pearson bound at
    confidence ``1 − level``) candidate by candidate.

    p : (..., N) float array of p-values, the candidates of all sequences concatenated on the last axis.

    Examples
    --------
    >>> p = [0.001, 0.01, 0.2, 0.03, 0.06, 0.001]
    >>> candidate_levels(p, [3, 3], 0.1, "fixed_sequence").tolist()
    [0.05, 0.05, 0.05, 0.05, 0.05, 0.05]
    >>> candidate_levels(p, [3, 3], 0.1, "holm").round(4).tolist()  # δ / (N − rank)
    [0.0167, 0.025, 0.1, 0.0333, 0.05, 0.02]
    """
    lengths, p, delta = _inputs(p, lengths, delta)  # the inputs are checked before the name
    return procedure_of(procedure)._levels(p, lengths, delta)


def sequence_stops(certified_flat: np.ndarray, lengths: Sequence[int], delta: float, procedure: str) -> tuple[SequenceStop, ...]:
    """Summarise, per sequence, how far testing went and how much was certified.

    certified_flat : (N,) bool array of one decision's flags, the sequences concatenated.

    Examples
    --------
    >>> flags = certified_mask([0.001, 0.01, 0.2, 0.03, 0.06, 0.001], [3, 3], 0.1, "fixed_sequence")
    >>> [(s.tested, s.certified, s.stopped_at) for s in sequence_stops(flags, [3, 3], 0.1, "fixed_sequence")]
    [(3, 2, 2), (2, 1, 1)]
    """
    lengths = check_lengths(lengths)
    delta = check_delta(delta)
    return procedure_of(procedure).stops(certified_flat, lengths, delta)


__all__ = [
    "FIXED_ORDER",
    "PROCEDURES",
    "REGISTRY",
    "Bonferroni",
    "FixedSequence",
    "FwerProcedure",
    "Holm",
    "PilotOrdered",
    "Procedure",
    "SequenceStop",
    "candidate_levels",
    "certified_mask",
    "procedure_of",
    "sequence_stops",
]
