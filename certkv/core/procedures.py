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

Layout: the vectorised functions take p-values of shape ``(..., N)`` where the last axis holds the
candidates of all sequences concatenated in contract order, and ``lengths`` gives each sequence's
length. The leading axes are free, so repeated-split validation runs the very same code on
thousands of splits at once; :func:`control_fwer` is the friendly one-shot interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

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
    """

    index: int
    length: int
    level: float | None
    tested: int
    certified: int
    stopped_at: int | None


@dataclass(frozen=True)
class FwerResult:
    """Per-candidate decisions (``certified[s][j]`` for position j of sequence s) and stops."""

    procedure: str
    delta: float
    certified: tuple[tuple[bool, ...], ...]
    levels: tuple[tuple[float, ...], ...]
    sequences: tuple[SequenceStop, ...]


def check_procedure(procedure: str) -> str:
    """Reject unknown procedure names with the list of valid ones."""
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


def check_delta(delta) -> float:
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


def fixed_sequence_mask(p, lengths: Sequence[int], delta: float) -> np.ndarray:
    """Certified flags under fixed-sequence testing with a δ/m split across m sequences.

    Within a sequence, candidate j is certified only if it and every candidate before it have
    p <= δ/m: a running product of the pass flags, which makes the certified set a prefix.
    """
    lengths = check_lengths(lengths)
    p = _check_p_values(p, sum(lengths))
    level = check_delta(delta) / len(lengths)
    passed = p <= level
    out = np.zeros(p.shape, dtype=bool)
    for start, stop in _segments(lengths):
        out[..., start:stop] = np.logical_and.accumulate(passed[..., start:stop], axis=-1)
    return out


def bonferroni_mask(p, lengths: Sequence[int], delta: float) -> np.ndarray:
    """Certified flags when each of the N candidates is tested at δ / N, in any order."""
    lengths = check_lengths(lengths)
    p = _check_p_values(p, sum(lengths))
    return p <= check_delta(delta) / p.shape[-1]


def holm_mask(p, lengths: Sequence[int], delta: float) -> np.ndarray:
    """Certified flags under Holm's step-down procedure over all N candidates.

    Sort the p-values ascending; the i-th smallest (0-based) is compared with δ / (N − i), and
    testing stops at the first comparison that fails. Ties are broken by the stable sort, which
    does not change the set certified (tied p-values pass or fail together in effect).
    """
    lengths = check_lengths(lengths)
    p = _check_p_values(p, sum(lengths))
    n_total = p.shape[-1]
    order = np.argsort(p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=-1)
    thresholds = check_delta(delta) / (n_total - np.arange(n_total))
    passed_ranked = np.logical_and.accumulate(ranked <= thresholds, axis=-1)
    out = np.empty(p.shape, dtype=bool)
    np.put_along_axis(out, order, passed_ranked, axis=-1)
    return out


def pilot_ordered_mask(p, lengths: Sequence[int], delta: float) -> np.ndarray:
    """Certified flags of split fixed-sequence testing: the sequences concatenated (in the order
    the pilot set) and tested as one fixed sequence at the full δ."""
    lengths = check_lengths(lengths)
    return fixed_sequence_mask(p, [sum(lengths)], delta)


_MASKS = {
    "fixed_sequence": fixed_sequence_mask,
    "bonferroni": bonferroni_mask,
    "holm": holm_mask,
    "pilot_ordered": pilot_ordered_mask,
}


def certified_mask(p, lengths: Sequence[int], delta: float, procedure: str) -> np.ndarray:
    """Dispatch to the procedure named in the contract; shape ``(..., N)`` in, booleans out."""
    return _MASKS[check_procedure(procedure)](p, lengths, delta)


def candidate_levels(p, lengths: Sequence[int], delta: float, procedure: str) -> np.ndarray:
    """The significance level each candidate's p-value is compared with.

    fixed_sequence: δ/m; bonferroni: δ/N; holm: δ/(N − rank), rank of the candidate's p-value;
    pilot_ordered: δ.
    Reporting it lets a reader check ``p <= level`` (and the matching Clopper–Pearson bound at
    confidence ``1 − level``) candidate by candidate.
    """
    lengths = check_lengths(lengths)
    p = _check_p_values(p, sum(lengths))
    delta = check_delta(delta)
    procedure = check_procedure(procedure)
    n_total = p.shape[-1]
    if procedure == "fixed_sequence":
        return np.full(p.shape, delta / len(lengths))
    if procedure == "pilot_ordered":
        return np.full(p.shape, delta)
    if procedure == "bonferroni":
        return np.full(p.shape, delta / n_total)
    order = np.argsort(p, axis=-1, kind="stable")
    ranks = np.empty(p.shape, dtype=np.int64)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(n_total), p.shape), axis=-1)
    return delta / (n_total - ranks)


def sequence_stops(certified_flat: np.ndarray, lengths, delta: float, procedure: str):
    """Summarise, per sequence, how far testing went and how much was certified."""
    lengths = check_lengths(lengths)
    delta = check_delta(delta)
    stops = []
    if procedure == "pilot_ordered" and len(lengths) > 1:  # one sequence: stopped at the first failure
        first_fail = np.flatnonzero(~np.asarray(certified_flat, dtype=bool))
        cut = int(first_fail[0]) if first_fail.size else sum(lengths)
    for index, (start, stop) in enumerate(_segments(lengths)):
        flags = np.asarray(certified_flat[start:stop], dtype=bool)
        failures = np.flatnonzero(~flags)
        stopped_at = int(failures[0]) if failures.size else None
        if procedure == "fixed_sequence":
            level = delta / len(lengths)
            tested = len(flags) if stopped_at is None else stopped_at + 1
        elif procedure == "pilot_ordered":
            level = delta
            tested = len(flags) if stopped_at is None else stopped_at + 1
            if len(lengths) > 1:
                tested = min(max(cut + 1 - start, 0), len(flags))
        else:
            level = delta / sum(lengths) if procedure == "bonferroni" else None
            tested = len(flags)
        stops.append(
            SequenceStop(
                index=index,
                length=len(flags),
                level=level,
                tested=tested,
                certified=int(flags.sum()),
                stopped_at=stopped_at,
            )
        )
    return tuple(stops)


def control_fwer(p_values: Sequence[Sequence[float]], delta: float, procedure: str) -> FwerResult:
    """Decide which candidates are certified, controlling the family-wise error rate at δ.

    ``p_values`` holds one list per sequence, each in the contract's test order (conservative
    first). Returns per-candidate flags and levels in the same nested shape, and where each
    sequence stopped.
    """
    procedure = check_procedure(procedure)
    delta = check_delta(delta)
    lengths = check_lengths([len(seq) for seq in p_values])
    flat = np.array([float(x) for seq in p_values for x in seq], dtype=float)
    if not np.all(np.isfinite(flat)):
        raise CertkvError("p-values must be finite numbers in [0, 1]")
    flags = certified_mask(flat, lengths, delta, procedure)
    levels = candidate_levels(flat, lengths, delta, procedure)
    segments = _segments(lengths)
    return FwerResult(
        procedure=procedure,
        delta=delta,
        certified=tuple(tuple(bool(x) for x in flags[a:b]) for a, b in segments),
        levels=tuple(tuple(float(x) for x in levels[a:b]) for a, b in segments),
        sequences=sequence_stops(flags, lengths, delta, procedure),
    )


def is_prefix(flags: Sequence[bool]) -> bool:
    """True when the certified flags form a prefix (all True, then all False)."""
    seen_false = False
    for flag in flags:
        if flag and seen_false:
            return False
        seen_false = seen_false or not flag
    return True


__all__ = [
    "PROCEDURES",
    "Procedure",
    "FwerResult",
    "SequenceStop",
    "bonferroni_mask",
    "candidate_levels",
    "certified_mask",
    "control_fwer",
    "fixed_sequence_mask",
    "holm_mask",
    "is_prefix",
    "pilot_ordered_mask",
    "sequence_stops",
]
