"""Exact binomial statistics behind a certificate.

Everything here is small, pure and torch-free. The rules it implements are the promise in
docs/design.md ("Statistical rules"):

* violation counts are integers, counted from the losses themselves, never reconstructed as
  ``n * mean`` (flooring a float count is anti-conservative);
* the p-value of a candidate is exact, ``P(Binomial(n, ε) <= k)``;
* the Clopper–Pearson upper bound at confidence ``1 − δ`` is ``beta.ppf(1 − δ, k + 1, n − k)``
  and 1 when ``k == n``, so that ``U <= ε`` if and only if ``p <= δ``.

References
----------
.. [1] C. J. Clopper and E. S. Pearson, "The use of confidence or fiducial limits illustrated in
   the case of the binomial", Biometrika 26(4), 404–413, 1934.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import numpy.typing as npt
from scipy.stats import beta, binom

from certkv.errors import CertkvError

#: Absolute slack in ``loss > tolerance``. Losses are differences of utilities in [0, 1] computed
#: in floating point, so a loss that is exactly the tolerance on paper can land one ulp above it
#: (``0.8 - 0.7 == 0.10000000000000009 > 0.1``) and flip a request into a violation at random.
#: Rounding errors of such differences are ~1e-16; every meaningful utility difference (a token
#: of an F1 over even thousands of tokens) is far above 1e-9, so the slack only absorbs noise.
VIOLATION_EPS = 1e-9


def as_count(value: object, name: str) -> int:
    """Return ``value`` as a Python int, or raise if it is not an integer count.

    Python and numpy integers are accepted. Floats are rejected, even integral ones such as
    ``47.0``: a float count almost always comes from ``n * mean``, and the design forbids
    reconstructing counts that way. Booleans are rejected because they are not counts.

    Examples
    --------
    >>> import numpy as np
    >>> as_count(np.int64(3), "k")
    3
    >>> as_count(47.0, "k")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    certkv.errors.CertkvError: k must be an integer count, got the float 47.0; count violations with ...
    """
    if isinstance(value, (bool, np.bool_)):
        raise CertkvError(f"{name} must be an integer count, got the boolean {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        raise CertkvError(
            f"{name} must be an integer count, got the float {value!r}; count violations with "
            "certkv.core.binomial.count_violations instead of reconstructing n * mean"
        )
    raise CertkvError(f"{name} must be an integer count, got {type(value).__name__} {value!r}")


def check_counts(k: object, n: object) -> tuple[int, int]:
    """Validate a (violations, requests) pair: ``n >= 1`` and ``0 <= k <= n``, both integers.

    Examples
    --------
    >>> check_counts(3, 10)
    (3, 10)
    >>> check_counts(11, 10)
    Traceback (most recent call last):
    ...
    certkv.errors.CertkvError: k (violations) must be between 0 and n = 10, got 11
    """
    k = as_count(k, "k (violations)")
    n = as_count(n, "n (requests)")
    if n < 1:
        raise CertkvError(f"n (requests) must be at least 1, got {n}")
    if not 0 <= k <= n:
        raise CertkvError(f"k (violations) must be between 0 and n = {n}, got {k}")
    return k, n


def check_probability(value: object, name: str) -> float:
    """Validate a probability strictly inside (0, 1), such as a risk target ε or a confidence.

    Examples
    --------
    >>> check_probability(0.05, "risk")
    0.05
    >>> check_probability(1, "confidence")
    Traceback (most recent call last):
    ...
    certkv.errors.CertkvError: confidence must be strictly between 0 and 1, got 1.0
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise CertkvError(f"{name} must be a number in (0, 1), got {value!r}")
    value = float(value)
    if not 0.0 < value < 1.0:
        raise CertkvError(f"{name} must be strictly between 0 and 1, got {value!r}")
    return value


def binomial_p_value(k: int | np.integer, n: int | np.integer, risk: float) -> float:
    """Exact p-value of "true violation rate > ε" after seeing k violations in n requests.

    ``P(Binomial(n, ε) <= k)``: small when k is much smaller than ``n·ε`` would suggest, so a
    p-value ``<= δ`` is evidence that the true rate is at most ε. Exact (no normal approximation),
    because the approximation is anti-conservative in the small-k tail we care about.

    Under the hypothesis "rate > ε" the count is stochastically at least Binomial(n, ε), so this
    p-value is valid (``P(p <= δ) <= δ``) for every rate in the hypothesis, not only at ε: the
    one-sided exact binomial test that Clopper and Pearson's interval inverts [1]_.

    References
    ----------
    .. [1] C. J. Clopper and E. S. Pearson, "The use of confidence or fiducial limits illustrated
       in the case of the binomial", Biometrika 26(4), 404–413, 1934.

    Examples
    --------
    Three violations in 200 requests are strong evidence for a rate below 5%; twelve are not:

    >>> round(binomial_p_value(3, 200, 0.05), 4)
    0.009
    >>> round(binomial_p_value(12, 200, 0.05), 4)
    0.7965

    With no violation at all, 59 requests are the fewest that certify ε = 0.05 at δ = 0.05:

    >>> binomial_p_value(0, 59, 0.05) <= 0.05 < binomial_p_value(0, 58, 0.05)
    True
    """
    k, n = check_counts(k, n)
    risk = check_probability(risk, "risk (ε)")
    return float(binom.cdf(k, n, risk))


def clopper_pearson_upper(k: int | np.integer, n: int | np.integer, confidence: float) -> float:
    """One-sided Clopper–Pearson upper confidence bound on the violation rate.

    ``beta.ppf(confidence, k + 1, n − k)``, and exactly 1 when ``k == n`` (the Beta quantile is
    undefined there). It is the dual of :func:`binomial_p_value`: the bound is ``<= ε`` exactly
    when the p-value at ε is ``<= 1 − confidence``.

    The bound is the largest rate that the exact one-sided binomial test does not reject at level
    ``1 − confidence``; its coverage is at least `confidence` for every n and true rate (exact,
    conservative), which is why certkv reports it instead of a normal-approximation interval.

    References
    ----------
    .. [1] C. J. Clopper and E. S. Pearson, "The use of confidence or fiducial limits illustrated
       in the case of the binomial", Biometrika 26(4), 404–413, 1934.

    Examples
    --------
    >>> round(clopper_pearson_upper(3, 200, 0.95), 4)
    0.0383
    >>> round(clopper_pearson_upper(12, 200, 0.95), 4)  # above ε = 0.05: not certified
    0.0954
    >>> clopper_pearson_upper(5, 5, 0.95)
    1.0

    The duality with :func:`binomial_p_value`: at the bound itself the p-value is the level.

    >>> round(binomial_p_value(3, 200, clopper_pearson_upper(3, 200, 0.95)), 6)
    0.05
    """
    k, n = check_counts(k, n)
    confidence = check_probability(confidence, "confidence")
    if k == n:
        return 1.0
    return float(beta.ppf(confidence, k + 1, n - k))


def binomial_p_value_table(n: int | np.integer, risk: float) -> np.ndarray:
    """P-values for every possible count 0..n at once, for vectorised lookups ``table[k]``: an
    (n + 1,) float array.

    Repeated-split validation evaluates thousands of counts with the same n; indexing this table
    gives exactly the numbers :func:`binomial_p_value` would, without calling scipy per count.

    Examples
    --------
    >>> binomial_p_value_table(4, 0.5).tolist()
    [0.0625, 0.3125, 0.6875, 0.9375, 1.0]
    >>> bool(binomial_p_value_table(200, 0.05)[3] == binomial_p_value(3, 200, 0.05))
    True
    """
    _, n = check_counts(0, n)
    risk = check_probability(risk, "risk (ε)")
    return binom.cdf(np.arange(n + 1), n, risk)


def violation_mask(losses: npt.ArrayLike, tolerance: float) -> np.ndarray:
    """Boolean array, True where ``loss > tolerance`` beyond floating-point noise.

    NaN losses are rejected rather than silently treated as "no violation", which would be
    anti-conservative.

    losses : float array of any shape, e.g. (n_candidates, n_requests); the mask has its shape.

    Examples
    --------
    ``0.8 - 0.7`` is one ulp above 0.1: noise, not a violation of τ = 0.1.

    >>> violation_mask([0.0, 0.1, 0.8 - 0.7, 0.5], 0.1).tolist()
    [False, False, False, True]
    """
    tolerance = _check_tolerance(tolerance)
    losses = np.asarray(losses, dtype=float)
    if np.isnan(losses).any():
        raise CertkvError("losses contain NaN; every request needs a numeric loss")
    return losses > tolerance + VIOLATION_EPS


def count_violations(losses: npt.ArrayLike, tolerance: float) -> int:
    """Number of requests whose loss exceeds the tolerance, as a Python int (`losses`: an
    (n_requests,) float array, or any shape: every entry counts).

    Examples
    --------
    >>> count_violations([0.0, 1.0, 0.0, 0.25], 0.0)
    2
    """
    return int(np.count_nonzero(violation_mask(losses, tolerance)))


def _check_tolerance(tolerance) -> float:
    if isinstance(tolerance, (bool, np.bool_)) or not isinstance(tolerance, numbers.Real):
        raise CertkvError(f"tolerance must be a number, got {tolerance!r}")
    tolerance = float(tolerance)
    if not math.isfinite(tolerance):
        raise CertkvError(f"tolerance must be finite, got {tolerance!r}")
    return tolerance
