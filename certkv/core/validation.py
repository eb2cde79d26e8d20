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
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

from certkv.core.binomial import VIOLATION_EPS, binomial_p_value_table, violation_mask
from certkv.core.certify import candidate_rows, decide, prepare, select_candidates
from certkv.core.loss_table import as_loss_table
from certkv.core.operating_point import ContractSummary
from certkv.core.pilot import PilotInfo
from certkv.core.policy_names import REFERENCE_POLICY
from certkv.core.spec import CertificationSpec
from certkv.errors import CertkvError

METHODS = ("certkv", "empirical_thresholding")
_BLOCK = 256  # splits per matrix product: bounds memory at 256 × requests floats per mask


class MethodResult(BaseModel):
    """How one selection method fared over all splits.

    ``exceed_fraction``: share of splits whose chosen policy's test-half violation rate exceeds ε,
    with its two-sided 95% Clopper–Pearson interval. ``mean_kv_retained``: mean over splits of the
    chosen policy's mean memory on the test half (1.0 for a fallback). ``chosen``: how often each
    policy was chosen ("full" for fallbacks). ``test_risks``: per-split test violation rates.
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
    """Repeated-split results for both methods; ``to_dict()`` is JSON-ready."""

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

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


def validate(
    records,
    spec,
    n_splits: int = 1000,
    calibration_fraction: float = 0.5,
    seed: int = 0,
) -> ValidationResult:
    """Does the certificate hold on requests it has not seen? Repeated splits by request.

    Each split certifies on a random calibration share of the requests, with the very rule of
    :func:`~certkv.core.certify.certify`, and measures the chosen candidate's violation rate on
    the rest; empirical thresholding (the cheapest candidate whose calibration rate is ≤ ε) is
    scored on the same splits for comparison. Splits overlap, so the result is descriptive.

    Parameters
    ----------
    records : LossTable, str, Path or list of dict
        As for :func:`~certkv.core.certify.certify`.
    spec : CertificationSpec or dict
        The pre-registered spec (:func:`certkv.certification_spec` of a contract).
    n_splits : int, default 1000
    calibration_fraction : float, default 0.5
        Share of the requests each split calibrates on; both parts must be non-empty.
    seed : int, default 0

    Returns
    -------
    ValidationResult
        Per method: the share of splits whose test risk exceeds ε, its interval, mean KV and
        fallback share, and the policies chosen.
    """
    spec = CertificationSpec.parse(spec)
    n_splits, calibration_fraction = _check_settings(n_splits, calibration_fraction)
    # Gated candidates derived (memory 1.0 where gated); with a pilot, the certification requests
    # only, under the thresholds and order the pilot fixed once (the splits never refit them).
    table, spec, resolution = prepare(as_loss_table(records), spec)
    rows = candidate_rows(table, spec)
    violations = violation_mask(table.loss[rows], spec.tolerance).T.astype(float)  # (R, C)
    memory = np.ascontiguousarray(table.memory[rows].T)  # (R, C)
    n_requests = table.n_requests
    n_cal = int(round(calibration_fraction * n_requests))
    n_test = n_requests - n_cal
    if n_cal < 1 or n_test < 1:
        raise CertkvError(
            f"calibration_fraction {calibration_fraction} leaves {n_cal} calibration and {n_test} "
            f"test requests out of {n_requests}; both halves need at least one request"
        )

    rng = np.random.default_rng(seed)
    p_table = binomial_p_value_table(n_cal, spec.risk)
    chosen = {m: [] for m in METHODS}
    test_k = {m: [] for m in METHODS}
    kv = {m: [] for m in METHODS}
    for size in _blocks(n_splits):
        cal = calibration_masks(rng, size, n_requests, n_cal)
        k_cal, k_test, mem_cal, mem_test = _split_statistics(cal, violations, memory)
        _, pick = decide(p_table[k_cal], mem_cal, k_cal, spec)
        picks = {
            "certkv": pick,
            "empirical_thresholding": select_candidates(
                empirical_eligible(k_cal, n_cal, spec.risk), mem_cal, k_cal
            ),
        }
        for method, index in picks.items():
            k_chosen, used_kv = _score(index, k_test, mem_test)
            chosen[method].append(index)
            test_k[method].append(k_chosen)
            kv[method].append(used_kv)

    names = [table.policies[r] for r in rows]
    methods = {
        m: _summarise(m, np.concatenate(chosen[m]), np.concatenate(test_k[m]),
                      np.concatenate(kv[m]), n_test, spec.risk, names)
        for m in METHODS
    }
    return ValidationResult(
        contract=ContractSummary.of(spec),
        n_requests=n_requests,
        n_calibration=n_cal,
        n_test=n_test,
        n_splits=n_splits,
        calibration_fraction=calibration_fraction,
        seed=seed,
        methods=methods,
        pilot=None if resolution is None else resolution.info,
        note=(
            "exceed_fraction: share of splits whose chosen policy has a test-half violation rate "
            "above ε (full-cache fallback counts as 0). Test halves are finite and splits overlap, "
            "so this is a noisy, descriptive estimate; the interval is Clopper–Pearson over splits."
        ),
    )


def empirical_eligible(k, n: int, risk: float) -> np.ndarray:
    """Empirical thresholding's rule: calibration rate k/n ≤ ε (integer-safe comparison)."""
    return np.asarray(k) <= risk * n + VIOLATION_EPS


def calibration_masks(rng: np.random.Generator, n_splits: int, n_requests: int, n_cal: int):
    """A (splits × requests) 0/1 float matrix; row s marks split s's calibration requests.

    Each row is a uniformly random subset of size ``n_cal`` (the first ``n_cal`` entries of an
    independent permutation), drawn from the seeded generator so results are reproducible.
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
        raise CertkvError(
            f"calibration_fraction must be strictly between 0 and 1, got {calibration_fraction}"
        )
    return int(n_splits), calibration_fraction


def _blocks(n_splits: int):
    full, rest = divmod(n_splits, _BLOCK)
    return [_BLOCK] * full + ([rest] if rest else [])


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


def _summarise(method, index, k_test, used_kv, n_test, risk, names) -> MethodResult:
    # Imported here: statsmodels pulls in pandas, which `import certkv.core.validation` should not pay.
    from statsmodels.stats.proportion import proportion_confint

    exceed = k_test > risk * n_test + VIOLATION_EPS  # integer count vs ε·n: no float ratio
    test_risk = k_test / n_test
    count = int(exceed.sum())
    total = len(index)
    low, high = proportion_confint(count, total, alpha=0.05, method="beta")
    labels, counts = np.unique(index, return_counts=True)
    chosen = {
        (REFERENCE_POLICY if i < 0 else names[int(i)]): int(c) for i, c in zip(labels, counts)
    }
    return MethodResult(
        method=method,
        exceed_count=count,
        exceed_fraction=count / total,
        exceed_ci_low=float(np.nan_to_num(low, nan=0.0)),
        exceed_ci_high=float(np.nan_to_num(high, nan=1.0)),
        mean_kv_retained=float(used_kv.mean()),
        fallback_share=float((index < 0).mean()),
        chosen=chosen,
        test_risks=[float(x) for x in test_risk],
    )


__all__ = [
    "METHODS",
    "MethodResult",
    "ValidationResult",
    "calibration_masks",
    "empirical_eligible",
    "validate",
]
