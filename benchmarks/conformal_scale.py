"""Conformal scale factors for a certificate whose pairs come in correlated groups.

A certificate ĉ is useful when the true error stays below z·ĉ for a known factor z on most of the
(step, layer, head) pairs of requests it has not seen. The pairs of one request are not
exchangeable with each other (they share a context, an answer and a sample of kept entries), so
the plain split-conformal quantile of error/ĉ over pooled pairs promises nothing: a request-level
outlier moves many pairs at once, and its coverage on new requests falls short of the nominal
level on average (measured: 94.8–95.0% for a 95% quantile in ``benchmarks/certificate_quality.py``).

Requests, not pairs, are exchangeable. :func:`grouped_scale_factor` therefore applies conformal
risk control (Angelopoulos, Bates, Fisch, Lei & Schuster, 2022) with one loss per request: the
share of its pairs that z does not cover, a bounded loss that does not increase with z. With n
calibration requests, the smallest z whose (n/(n+1))·mean loss + 1/(n+1) is at most α gives a
new request an expected uncovered share ≤ α — a finite-sample bound, not an asymptotic one —
whatever the dependence inside a request. Numpy only; it lives beside the benchmarks that measure the
certificate's coverage (``benchmarks/certificate_quality.py``), the one place it is used, and its
tests import it from there (tests/benchmarks/test_conformal.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def grouped_scale_factor(ratios_by_group: Sequence[npt.ArrayLike], alpha: float) -> float:
    """The smallest z with E[share of a new group's pairs with ratio > z] ≤ `alpha`.

    `ratios_by_group` holds one 1-d array per calibration group (request) of error/certificate
    ratios (``inf`` where the certificate is 0 and the error is not); `alpha` is in (0, 1). The
    loss of a group at z is the share of its ratios above z. Returns ``inf`` when no finite z
    controls the risk (too few groups: 1/(n+1) > α, or too many infinite ratios).
    """
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha < 1):
        raise ValueError(f"alpha must be a number in (0, 1), got {alpha!r}")
    groups = [np.asarray(r, dtype=np.float64).ravel() for r in ratios_by_group]
    if not groups or any(g.size == 0 for g in groups):
        raise ValueError("every group needs at least one ratio, and there must be at least one group")
    if any(bool(np.isnan(g).any()) or bool((g < 0).any()) for g in groups):
        raise ValueError("ratios must be nonnegative numbers (inf allowed, NaN not)")
    n = len(groups)
    # Each pair weighs 1 / (n · its group's size): the mean loss at z is the weight of the ratios above z.
    ratios = np.concatenate(groups)
    weights = np.concatenate([np.full(g.size, 1.0 / (n * g.size)) for g in groups])
    order = np.argsort(ratios, kind="stable")
    ratios, weights = ratios[order], weights[order]
    # mean loss at z = ratios[i]: the weight strictly above it (ties: after the last equal ratio),
    # summed from the largest ratio down (a suffix sum, not 1 − a prefix sum, which cancels)
    suffix = np.append(np.cumsum(weights[::-1])[::-1], 0.0)
    above = suffix[np.searchsorted(ratios, ratios, side="right")]
    # n/(n+1)·risk + 1/(n+1) ≤ α, i.e. n·risk ≤ α(n+1) − 1, with a 1e-12 allowance so that float
    # rounding does not move a boundary that exact arithmetic would meet
    ok = np.flatnonzero((n * above <= alpha * (n + 1) - 1 + 1e-12) & np.isfinite(ratios))
    # below the smallest ratio every pair is uncovered (loss 1), which never passes for alpha < 1
    return float(ratios[ok[0]]) if ok.size else math.inf


def pooled_scale_factor(ratios: npt.ArrayLike, level: float) -> float:
    """The plain split-conformal quantile over pooled pairs: the ⌈(m+1)·level⌉-th smallest of m
    ratios (``inf`` past the last). Valid only for exchangeable pairs; kept for comparison.

    ratios : (m,) float array of error/certificate ratios (any shape: it is flattened).
    """
    if not (isinstance(level, (int, float)) and not isinstance(level, bool) and 0 < level < 1):
        raise ValueError(f"level must be a number in (0, 1), got {level!r}")
    r = np.sort(np.asarray(ratios, dtype=np.float64).ravel())
    if r.size == 0:
        raise ValueError("no ratios to take a quantile of")
    rank = math.ceil((r.size + 1) * level)
    return float(r[rank - 1]) if rank <= r.size else math.inf
