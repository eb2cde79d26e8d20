"""Repeated-split validation: does the certificate hold on requests it has not seen?

The calibration requests are split at random into a calibration half and a test half, many times.
With a pilot split (``gate.pilot``) only the certification requests are split: the pilot placed
the gate thresholds (and, under pilot_ordered, the test order) once, and every split keeps them.
On each split two methods choose a policy from the calibration half only:

* ``certkv``: the certifier's own decision (exact binomial p-values, the contract's FWER
  procedure, least mean KV among the certified; full cache when nothing is certified);
* ``empirical_thresholding``: what practitioners do today — the candidate with the least mean KV
  whose calibration violation rate k/n is ≤ ε, with no confidence margin and no multiplicity
  correction.

Each chosen policy is then scored on the test half. The fraction of splits whose test violation
rate exceeds ε estimates how often each method overpromises. A full-cache fallback counts as safe
(test risk 0). The test half is finite, so its rate is a noisy estimate of the true risk: a policy
whose true risk sits just below ε still "exceeds" on some splits, and splits share requests, so
the fraction is descriptive (its Clopper–Pearson interval treats splits as independent), not a
test of the guarantee.

Speed: the violation matrix (requests × candidates) is computed once; each block of splits is a
0/1 calibration mask, and the calibration counts of all candidates on all splits of the block are a
single matrix product. The decision itself is :func:`certkv.core.certify.decide`, the same code
:func:`certkv.core.certify.certify` runs.

A stratified spec (``strata:``) is validated the way it certifies: every stratum on its own, under
its per-stratum spec (:func:`certkv.core.strata.stratum_spec`), with its own pilot and its own
splits (seed :func:`stratum_seed`), so each entry of ``ValidationResult.strata`` is exactly
:func:`validate` of that stratum's table (its note aside). The top level pools the strata split by
split: split i splits every stratum, and its test risk is the strata's test violations over their
test requests (:class:`ValidationResult`). A stratum too small to split or to draw its pilot gets
the full cache on every split, with that reason in its note, instead of an error; one whose
calibration half is too small to certify anything says so (certkv falls back on every split there).

Splits draw the spec's sampling unit (:mod:`certkv.core.sampling_unit`), through one loop whose
per-split statistics the unit computes (:meth:`~certkv.core.sampling_unit.SamplingUnit.split_evidence`).
A grouped spec (``grouping:``) is split by context: each split's calibration half is a random
share of the contexts, every question of a context on the same side, and certkv decides on it
with the grouped p-values (:mod:`certkv.core.grouped`); empirical thresholding takes the
cheapest candidate whose calibration estimate of the measure is ≤ ε, and a split's test risk is
the measure on its test contexts. ``n_calibration`` and ``n_test`` then count contexts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from certkv.core.binomial import VIOLATION_EPS
from certkv.core.certify import candidate_rows, check_inputs, check_sampling_unit, decide, prepare, select_candidates
from certkv.core.loss_table import LossTable
from certkv.core.operating_point import ContractSummary
from certkv.core.pilot import PilotInfo, pilot_size
from certkv.core.policy_names import REFERENCE_POLICY
from certkv.core.sampling_unit import empirical_eligible, sampling_unit
from certkv.core.spec import CertificationSpec
from certkv.core.strata import fewest_requests, pilot_shortfall, stratum_labels, stratum_spec
from certkv.errors import CertkvError

METHODS = ("certkv", "empirical_thresholding")
_BLOCK = 256  # splits per matrix product: bounds memory at 256 × requests floats per mask


class MethodResult(BaseModel):
    """How one selection method fared over all splits.

    ``exceed_fraction``: share of splits whose chosen policy's test-half violation rate exceeds ε,
    with its two-sided 95% Clopper–Pearson interval. ``mean_kv_retained``: mean over splits of the
    chosen policy's mean memory on the test half (1.0 for a fallback). ``chosen``: how often each
    policy was chosen ("full" for fallbacks). ``test_risks``: per-split test violation rates.

    References
    ----------
    .. [1] C. J. Clopper and E. S. Pearson, "The use of confidence or fiducial limits illustrated in
           the case of the binomial", Biometrika 26(4), 404–413, 1934 (the interval on the exceed fraction).

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": p, "kv_retained": kv, "loss": float(kv < 0.5 and i % 10 == 0)}
    ...         for i in range(400) for p, kv in (("p@0.70", 0.7), ("p@0.30", 0.3))]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.70", "p@0.30"]])
    >>> empirical = validate(LossTable.from_records(rows), spec, n_splits=5, seed=0).methods["empirical_thresholding"]
    >>> empirical.exceed_count, empirical.chosen, empirical.test_risks  # a 10% rate, chosen at ε = 10%, exceeds ε on 2 tests
    (2, {'p@0.70': 2, 'p@0.30': 3}, [0.115, 0.1, 0.0, 0.125, 0.0])
    """

    model_config = ConfigDict(extra="forbid")
    method: str
    exceed_count: int
    exceed_fraction: float
    exceed_ci_low: float
    exceed_ci_high: float
    mean_kv_retained: float
    fallback_share: float
    chosen: dict[str, int]
    test_risks: list[float]


class ValidationResult(BaseModel):
    """Repeated-split results for both methods; ``to_dict()`` is JSON-ready.

    For a stratified spec ``by`` names the strata's field and ``strata`` holds each stratum's own
    result (its ``seed`` is the derived :func:`stratum_seed`, its ``n_*`` count its certification
    requests). The top level then pools them split by split and has no pilot. With n_s the test
    requests of stratum s, N = Σ_s n_s, and k_s[i] the test violations of stratum s's choice on
    split i (0 when it falls back), per method:

    * ``test_risks[i]`` = Σ_s k_s[i] / N; ``exceed_count``: splits with Σ_s k_s[i] > ε·N (integers);
    * ``mean_kv_retained`` = mean over splits of Σ_s n_s · kv_s[i] / N, kv_s[i] the test-half mean
      memory of stratum s's choice (1.0 for the full cache): the memory a test request gets;
    * ``fallback_share`` = mean over splits of Σ_s n_s · [stratum s fell back on split i] / N: the
      share of test requests a fallback answered from the full cache;
    * ``chosen``: "stratum:policy" counted over (split, stratum) pairs (sums to S · n_splits);
    * ``n_requests``, ``n_calibration``, ``n_test``: sums over the strata.

    ``by`` and ``strata`` are None for a pooled spec, which keeps older validation.json files loading.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(400)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> result = validate(LossTable.from_records(rows), spec, n_splits=5, seed=0)
    >>> result.n_calibration, result.n_test, sorted(result.methods), result.to_dict()["n_splits"]
    (200, 200, ['certkv', 'empirical_thresholding'], 5)
    """

    model_config = ConfigDict(extra="forbid")
    contract: ContractSummary
    n_requests: int
    n_calibration: int
    n_test: int
    n_splits: int
    calibration_fraction: float
    seed: int
    methods: dict[str, MethodResult]
    note: str
    pilot: PilotInfo | None = None
    by: str | None = None
    strata: dict[str, ValidationResult] | None = None

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


POOLED_NOTE = (
    "exceed_fraction: share of splits whose chosen policy has a test-half violation rate "
    "above ε (full-cache fallback counts as 0). Test halves are finite and splits overlap, "
    "so this is a noisy, descriptive estimate; the interval is Clopper–Pearson over splits."
)


@dataclass(frozen=True)
class SplitOutcomes:
    """One method's per-split outcome on one table: the chosen candidate (-1: full cache), its
    test-half violation count (an integer) and its test-half mean memory (1.0 for the full cache).

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": p, "kv_retained": kv, "loss": float(kv < 0.5 and i % 10 == 0)}
    ...         for i in range(400) for p, kv in (("p@0.70", 0.7), ("p@0.30", 0.3))]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.70", "p@0.30"]])
    >>> outcome = run_splits(LossTable.from_records(rows), spec, 5, 0.5, seed=0).outcomes["empirical_thresholding"]
    >>> outcome.index.tolist(), outcome.k_test.tolist(), outcome.used_kv.round(2).tolist()
    ([1, 1, 0, 1, 0], [23, 20, 0, 25, 0], [0.3, 0.3, 0.7, 0.3, 0.7])
    """

    index: np.ndarray
    k_test: np.ndarray
    used_kv: np.ndarray
    test_risk: np.ndarray | None = None
    """Grouped splits only: each split's test risk (the measure on its test contexts; 0 for the
    full cache) and its weight when strata are pooled (test contexts, or test questions for
    ``per_question``). Null for splits by request, whose risk is ``k_test / n_test``."""
    test_weight: np.ndarray | None = None


@dataclass(frozen=True)
class SplitRun:
    """The repeated splits of one table: its sizes, candidate names, pilot and each method's outcomes.

    Kept apart from :class:`ValidationResult` because pooling strata needs the integer counts of
    every split, which the result only holds as rates.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(400)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> run = run_splits(LossTable.from_records(rows), spec, n_splits=5, calibration_fraction=0.5, seed=0)
    >>> run.n_cal, run.n_test, run.names, sorted(run.outcomes)
    (200, 200, ['p@0.50'], ['certkv', 'empirical_thresholding'])
    """

    n_requests: int
    n_cal: int
    n_test: int
    names: list[str]
    resolution: Any
    outcomes: dict[str, SplitOutcomes]


def validate(
    table: LossTable,
    spec: CertificationSpec,
    n_splits: int = 1000,
    calibration_fraction: float = 0.5,
    seed: int = 0,
) -> ValidationResult:
    """Does the certificate hold on requests it has not seen? Repeated splits by request.

    Each split certifies on a random calibration share of the requests, with the very rule of
    :func:`~certkv.core.certify.certify`, and measures the chosen candidate's violation rate on
    the rest; empirical thresholding (the cheapest candidate whose calibration rate is ≤ ε) is
    scored on the same splits for comparison. Splits overlap, so the result is descriptive.
    A stratified spec is validated per stratum and pooled (the module docstring).

    Parameters
    ----------
    table : LossTable
        As for :func:`~certkv.core.certify.certify`.
    spec : CertificationSpec
        The pre-registered spec (:func:`certkv.certification_spec` of a contract).
    n_splits : int, default 1000
    calibration_fraction : float, default 0.5
        Share of the requests each split calibrates on; both parts must be non-empty.
    seed : int, default 0

    Returns
    -------
    ValidationResult
        Per method: the share of splits whose test risk exceeds ε, its interval, mean KV and
        fallback share, and the policies chosen; per stratum too when the spec has strata.

    References
    ----------
    .. [1] Clopper and Pearson, "The use of confidence or fiducial limits illustrated in the case
       of the binomial", Biometrika 26(4), 1934 (the interval of the exceed fraction).

    Examples
    --------
    A candidate that violates on 1% of requests, at ε = 10%: certkv certifies it on most splits
    and its test-half rate never comes near ε:

    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": float(i % 100 == 0)}
    ...         for i in range(400)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]])
    >>> result = validate(LossTable.from_records(rows), spec, n_splits=20, seed=1)
    >>> result.n_calibration, result.n_test, result.methods["certkv"].exceed_count
    (200, 200, 0)
    >>> result.methods["certkv"].chosen
    {'p@0.50': 20}
    """
    check_inputs(table, spec)
    check_sampling_unit(table, spec)
    n_splits, calibration_fraction = _check_settings(n_splits, calibration_fraction)
    if spec.strata is not None:
        return _validate_stratified(table, spec, n_splits, calibration_fraction, seed)
    run = run_splits(table, spec, n_splits, calibration_fraction, seed)
    return _result(run, spec, n_splits, calibration_fraction, seed, POOLED_NOTE + sampling_unit(spec).validation_note())


def run_splits(table: LossTable, spec: CertificationSpec, n_splits: int, calibration_fraction: float, seed: int) -> SplitRun:
    """Both methods' choices and test outcomes on `n_splits` random splits of one unstratified table.

    Gated candidates are derived (memory 1.0 where gated); with a pilot, only the certification
    requests are split, under the thresholds and order the pilot fixed once (the splits never
    refit them).

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": p, "kv_retained": kv, "loss": float(kv < 0.5 and i % 10 == 0)}
    ...         for i in range(400) for p, kv in (("p@0.70", 0.7), ("p@0.30", 0.3))]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.70", "p@0.30"]])
    >>> run = run_splits(LossTable.from_records(rows), spec, n_splits=5, calibration_fraction=0.5, seed=0)
    >>> run.outcomes["certkv"].index.tolist()  # certkv never certifies the 10% one at ε = 10%
    [0, 0, 0, 0, 0]
    """
    table, spec, resolution = prepare(table, spec)
    rows = candidate_rows(table, spec)
    unit = sampling_unit(spec)
    n_units = unit.count(table)
    n_cal, n_test = _halves(n_units, calibration_fraction)
    if n_cal < 1 or n_test < 1:
        raise CertkvError(
            f"calibration_fraction {calibration_fraction} leaves {n_cal} calibration and {n_test} "
            f"test {unit.noun}s out of {n_units}; both halves need at least one {unit.noun}"
        )
    block_of = unit.split_evidence(table, rows, spec, n_cal)
    rng = np.random.default_rng(seed)
    parts: dict[str, list] = {m: [] for m in METHODS}
    for size in _blocks(n_splits):
        block = block_of(calibration_masks(rng, size, n_units, n_cal))
        _, pick = decide(block.p, block.mem_cal, block.k_cal, spec)
        picks = {
            "certkv": pick,
            "empirical_thresholding": select_candidates(block.empirical, block.mem_cal, block.k_cal),
        }
        for method, index in picks.items():
            parts[method].append(block.score(index))
    outcomes = {m: SplitOutcomes(*(np.concatenate(column) for column in zip(*parts[m]))) for m in METHODS}
    return SplitRun(n_units, n_cal, n_test, [table.policies[r] for r in rows], resolution, outcomes)


def stratum_seed(seed: int, stratum: str) -> int:
    """The split seed of one stratum: the first 13 hex digits of ``sha256(f"{seed}:{stratum}")``.

    Derived from the name rather than the stratum's position, so adding a stratum does not redraw
    the others' splits; 52 bits, so the seed survives a JSON reader that parses numbers as doubles.

    Examples
    --------
    >>> stratum_seed(0, "qa"), stratum_seed(0, "code")  # by name, so adding a stratum redraws nothing
    (981293738136972, 4200496447830128)
    """
    return int(hashlib.sha256(f"{seed}:{stratum}".encode()).hexdigest()[:13], 16)


def _validate_stratified(
    table: LossTable, spec: CertificationSpec, n_splits: int, calibration_fraction: float, seed: int
) -> ValidationResult:
    """Each stratum validated under its per-stratum spec, then pooled split by split (:func:`_pool`)."""
    assert spec.strata is not None  # a stratified spec
    by = spec.strata.by
    labels = np.asarray(stratum_labels(table, by), dtype=object)
    names = sorted(set(labels))
    per_stratum = stratum_spec(spec, len(names))
    runs, results = {}, {}
    for name in names:
        sub = table.take_requests(np.flatnonzero(labels == name), source=f"{table.source} [{by} {name}]")
        runs[name], note = _stratum_run(sub, per_stratum, n_splits, calibration_fraction, stratum_seed(seed, name))
        results[name] = _result(runs[name], per_stratum, n_splits, calibration_fraction, stratum_seed(seed, name), note)
    return _pool(runs, results, spec, per_stratum, n_splits, calibration_fraction, seed)


def _stratum_run(
    sub: LossTable, spec: CertificationSpec, n_splits: int, calibration_fraction: float, seed: int
) -> tuple[SplitRun, str]:
    """One stratum's splits and note; the full cache on every split when it is too small to run."""
    n_cert = sub.n_requests
    if spec.pilot is not None:
        n_cert -= pilot_size(sub.n_requests, spec.pilot.share)
    n_cal, n_test = _halves(n_cert, calibration_fraction)
    why = _unsplittable(sub.n_requests, n_cert, n_cal, n_test, spec)
    if why:
        note = f"too small to validate: {why}; certkv and empirical thresholding use the full cache on every split"
        return _full_cache_run(n_cert, n_cal, n_test, n_splits), note
    run = run_splits(sub, spec, n_splits, calibration_fraction, seed)
    need = fewest_requests(spec)
    if run.n_cal < need:
        return run, (
            f"{POOLED_NOTE} A calibration half has {run.n_cal} requests, fewer than the {need} that "
            f"certifying anything at ε = {spec.risk:g} and confidence {spec.confidence:.12g} needs with "
            "zero violations, so certkv chooses the full cache on every split here."
        )
    return run, POOLED_NOTE


def _unsplittable(n_requests: int, n_cert: int, n_cal: int, n_test: int, spec: CertificationSpec) -> str:
    """Why a stratum's requests cannot be split (or its pilot drawn), or "" when they can."""
    why = pilot_shortfall(n_requests, spec)
    if why is not None:
        return why
    if n_cal < 1 or n_test < 1:
        return f"its {n_cert} certification requests split into {n_cal} calibration and {n_test} test requests"
    return ""


def _full_cache_run(n_requests: int, n_cal: int, n_test: int, n_splits: int) -> SplitRun:
    """Every split of a too-small stratum: both methods fall back (no violation, memory 1.0)."""
    full = SplitOutcomes(np.full(n_splits, -1), np.zeros(n_splits, dtype=np.int64), np.ones(n_splits))
    return SplitRun(n_requests, n_cal, n_test, [], None, {m: full for m in METHODS})


def _result(
    run: SplitRun, spec: CertificationSpec, n_splits: int, calibration_fraction: float, seed: int, note: str
) -> ValidationResult:
    """The ValidationResult of one table's splits."""
    methods = {
        m: _summarise(m, out.k_test, run.n_test, out.used_kv, out.index < 0, _chosen(out.index, run.names), spec.risk,
                      test_risk=out.test_risk)
        for m, out in run.outcomes.items()
    }
    return ValidationResult(
        contract=ContractSummary.of(spec),
        n_requests=run.n_requests,
        n_calibration=run.n_cal,
        n_test=run.n_test,
        n_splits=n_splits,
        calibration_fraction=calibration_fraction,
        seed=seed,
        methods=methods,
        pilot=None if run.resolution is None else run.resolution.info,
        note=note,
    )


def _pool(
    runs: dict[str, SplitRun],
    results: dict[str, ValidationResult],
    spec: CertificationSpec,
    per_stratum: CertificationSpec,
    n_splits: int,
    calibration_fraction: float,
    seed: int,
) -> ValidationResult:
    """The top level of a stratified validation: the strata pooled split by split (the definitions are in
    :class:`ValidationResult`)."""
    assert spec.strata is not None  # a stratified spec
    n_test = sum(run.n_test for run in runs.values())
    n_cal = sum(run.n_cal for run in runs.values())
    if n_cal < 1 or n_test < 1:
        raise CertkvError(
            f"calibration_fraction {calibration_fraction} leaves {n_cal} calibration and {n_test} test requests "
            f"over the {len(runs)} {spec.strata.by} strata; both halves need at least one request"
        )
    methods = {m: _pool_method(m, runs, n_test, spec.risk) for m in METHODS}
    note = (
        f"pooled over the {len(runs)} {spec.strata.by} strata, each validated on its own splits under its "
        f"per-stratum spec (confidence {per_stratum.confidence:.12g}): test_risks[i] = the strata's test "
        "violations on split i over their test requests; mean KV and fallback share weighted by test "
        "requests; chosen counts stratum:policy. " + POOLED_NOTE
    )
    return ValidationResult(
        contract=ContractSummary.of(spec),
        n_requests=sum(run.n_requests for run in runs.values()),
        n_calibration=n_cal,
        n_test=n_test,
        n_splits=n_splits,
        calibration_fraction=calibration_fraction,
        seed=seed,
        methods=methods,
        note=note,
        by=spec.strata.by,
        strata=results,
    )


def _pool_method(method: str, runs: dict[str, SplitRun], n_test: int, risk: float) -> MethodResult:
    """One method's pooled MethodResult (definitions in :class:`ValidationResult`)."""
    k_test = sum(run.outcomes[method].k_test for run in runs.values())
    test_risk = _pooled_test_risk([run.outcomes[method] for run in runs.values()], [run.n_test for run in runs.values()])
    used_kv = sum(run.n_test * run.outcomes[method].used_kv for run in runs.values()) / n_test
    fallback = sum(run.n_test * (run.outcomes[method].index < 0) for run in runs.values()) / n_test
    chosen: dict[str, int] = {}
    for name, run in runs.items():
        for policy, count in _chosen(run.outcomes[method].index, run.names).items():
            chosen[f"{name}:{policy}"] = count
    return _summarise(method, k_test, n_test, used_kv, fallback, chosen, risk, test_risk=test_risk)


def _pooled_test_risk(outcomes: list[SplitOutcomes], n_tests: list[int]) -> np.ndarray | None:
    """Grouped strata pooled split by split: each stratum's test risk weighted by its test
    contexts (test questions for per_question), a stratum answered from the full cache at 0 with
    its test count; None when no stratum's splits are grouped."""
    if all(out.test_risk is None for out in outcomes):
        return None
    weights = [
        out.test_weight if out.test_weight is not None else np.full(len(out.index), float(n)) for out, n in zip(outcomes, n_tests)
    ]
    risks = [out.test_risk if out.test_risk is not None else np.zeros(len(out.index)) for out in outcomes]
    return sum(w * r for w, r in zip(weights, risks)) / sum(weights)


def calibration_masks(rng: np.random.Generator, n_splits: int, n_requests: int, n_cal: int) -> np.ndarray:
    """A (splits × requests) 0/1 float matrix; row s marks split s's calibration requests.

    Each row is a uniformly random subset of size ``n_cal`` (the first ``n_cal`` entries of an
    independent permutation), drawn from the seeded generator so results are reproducible.

    Examples
    --------
    >>> masks = calibration_masks(np.random.default_rng(0), n_splits=2, n_requests=6, n_cal=4)
    >>> masks.tolist()
    [[0.0, 0.0, 1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]]
    """
    perms = rng.permuted(np.tile(np.arange(n_requests), (n_splits, 1)), axis=1)
    mask = np.zeros((n_splits, n_requests))
    np.put_along_axis(mask, perms[:, :n_cal], 1.0, axis=1)
    return mask


def _check_settings(n_splits, calibration_fraction) -> tuple[int, float]:
    if isinstance(n_splits, bool) or not isinstance(n_splits, (int, np.integer)) or n_splits < 1:
        raise CertkvError(f"n_splits must be a positive integer, got {n_splits!r}")
    calibration_fraction = float(calibration_fraction)
    if not 0.0 < calibration_fraction < 1.0:
        raise CertkvError(f"calibration_fraction must be strictly between 0 and 1, got {calibration_fraction}")
    return int(n_splits), calibration_fraction


def _halves(n_requests: int, calibration_fraction: float) -> tuple[int, int]:
    """Calibration and test sizes of a split: ``round(fraction · n)`` and the rest."""
    n_cal = int(round(calibration_fraction * n_requests))
    return n_cal, n_requests - n_cal


def _blocks(n_splits: int):
    full, rest = divmod(n_splits, _BLOCK)
    return [_BLOCK] * full + ([rest] if rest else [])


def _chosen(index, names) -> dict[str, int]:
    """How often each candidate was chosen ("full" for a fallback)."""
    labels, counts = np.unique(index, return_counts=True)
    return {(REFERENCE_POLICY if i < 0 else names[int(i)]): int(c) for i, c in zip(labels, counts)}


def _summarise(method, k_test, n_test, used_kv, fallback, chosen, risk, test_risk=None) -> MethodResult:
    """A MethodResult from per-split integer test violations out of `n_test`, per-split mean memory and
    fallback share (0/1 for one table, a share of test requests when pooled over strata); grouped
    splits give their per-split `test_risk` instead, compared with ε directly."""
    # Lazy: statsmodels pulls in pandas, which `certkv report` (ValidationResult from validation.json) need not pay.
    from statsmodels.stats.proportion import proportion_confint

    if test_risk is None:
        exceed = k_test > risk * n_test + VIOLATION_EPS  # integer count vs ε·n: no float ratio
        test_risk = k_test / n_test if n_test else np.zeros(len(k_test))
    else:
        exceed = test_risk > risk + VIOLATION_EPS
    count = int(exceed.sum())
    total = len(k_test)
    low, high = proportion_confint(count, total, alpha=0.05, method="beta")
    return MethodResult(
        method=method,
        exceed_count=count,
        exceed_fraction=count / total,
        exceed_ci_low=float(np.nan_to_num(low, nan=0.0)),
        exceed_ci_high=float(np.nan_to_num(high, nan=1.0)),
        mean_kv_retained=float(used_kv.mean()),
        fallback_share=float(np.mean(fallback)),
        chosen=chosen,
        test_risks=[float(x) for x in test_risk],
    )


__all__ = [
    "METHODS",
    "POOLED_NOTE",
    "MethodResult",
    "SplitOutcomes",
    "SplitRun",
    "ValidationResult",
    "calibration_masks",
    "empirical_eligible",
    "run_splits",
    "stratum_seed",
    "validate",
]
