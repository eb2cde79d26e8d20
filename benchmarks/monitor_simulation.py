"""The live risk monitor's statistics simulated on many streams at once: the monitor's own arithmetic,
vectorised over streams, for benchmarks/monitor_quality.py and tests/core/test_monitor.py.

:func:`simulate_streams` replays what :class:`certkv.core.monitor.RiskMonitor` computes when every
request's shadow completes before the next request (a test checks the two agree), at numpy speed,
so that a benchmark can run thousands of streams of tens of thousands of requests. It lives beside
the benchmarks, not in the package: a server never simulates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from certkv.core.binomial import check_probability
from certkv.core.monitor import (
    BOUND_GRID,
    bound_bets,
    bound_from_rejected,
    check_shadow_rate,
    plug_in_discount,
    plug_in_priors,
    trip_bets,
)
from certkv.errors import CertkvError


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate_streams` saw, per stream.

    Attributes
    ----------
    tripped_after : numpy.ndarray
        Requests recorded when the test tripped; 0 where it never did.
    e_value : numpy.ndarray
        The test martingale K after the last request.
    upper_bound : numpy.ndarray or None
        The bound after the last request (None unless ``bound=True``). The bound never increases,
        so "above p after the last request" is "above p at every time".
    """

    tripped_after: np.ndarray
    e_value: np.ndarray
    upper_bound: np.ndarray | None


def bernoulli_violations(rates: npt.ArrayLike, n_streams: int, seed: int = 0) -> np.ndarray:
    """A (n_streams, len(rates)) boolean matrix: request t of each stream violates with
    probability ``rates[t]`` (a constant rate, or one with a change point; `rates`: an
    (n_requests,) float array)."""
    rates = np.asarray(rates, dtype=float)
    rng = np.random.default_rng(seed)
    return rng.random((n_streams, rates.size)) < rates[None, :]


def simulate_streams(
    violated: npt.ArrayLike,
    *,
    risk: float,
    delta: float,
    shadow_rate: float,
    seed: int = 0,
    shadowed: np.ndarray | None = None,
    bound: bool = False,
    stop_when_tripped: bool = False,
) -> Simulation:
    """Run the monitor's statistics on many independent streams at once (vectorised over streams).

    Every request is evicted and its shadow, when drawn, completes before the next request: the
    same arithmetic as :class:`RiskMonitor` recording and completing in order (a test checks they
    agree), at numpy speed.

    Parameters
    ----------
    violated : array of bool, shape (streams, requests)
        Whether each served answer violates (V).
    risk, delta, shadow_rate : float
        ε, δ and s.
    seed : int
        Seed of the shadow coins (ignored when ``shadowed`` is given).
    shadowed : array of bool, optional
        The shadow coins, same shape as ``violated``; drawn with P = s when None.
    bound : bool
        Also run the confidence sequence (200 martingales per stream: ~10× slower).
    stop_when_tripped : bool
        Stop once every stream has tripped (for time-to-trip measurements; only without ``bound``).
    """
    violated, risk, delta, s = _simulation_inputs(violated, risk, delta, shadow_rate)
    n_streams, n = violated.shape
    rng = np.random.default_rng(seed)
    a, gamma, level = 1.0 / s, plug_in_discount(risk, s), math.log(1.0 / delta)
    prior_n, prior_p, bound_prior_n = plug_in_priors(risk, s)
    z_sum, weight = np.zeros(n_streams), 0.0  # the test's discounted estimate
    z_total = np.zeros(n_streams)
    log_k = np.zeros(n_streams)
    tripped_after = np.zeros(n_streams, dtype=np.int64)
    grid = BOUND_GRID.size if bound else 0  # the bound's statistics, empty when it is not asked for
    log_km = np.zeros((n_streams, grid))
    rejected = np.zeros((n_streams, grid), dtype=bool)
    for t in range(n):
        coin = shadowed[:, t] if shadowed is not None else rng.random(n_streams) < s
        z = np.where(violated[:, t] & coin, a, 0.0)
        lam = trip_bets((z_sum + prior_n * prior_p) / (weight + prior_n), risk, s)
        if bound:
            lam_m = bound_bets((z_total + bound_prior_n * risk) / (t + bound_prior_n), s)
            log_km += np.log1p(-lam_m * (z[:, None] - BOUND_GRID))
            rejected |= log_km >= level
            z_total += z
        log_k += np.log1p(lam * (z - risk))
        weight = gamma * weight + 1.0
        z_sum = gamma * z_sum + z
        tripped_after[(tripped_after == 0) & (log_k >= level)] = t + 1
        if stop_when_tripped and not bound and (tripped_after > 0).all():
            break
    return Simulation(tripped_after, np.exp(np.minimum(log_k, 700.0)), bound_from_rejected(rejected) if bound else None)


def _simulation_inputs(
    violated: npt.ArrayLike, risk: float, delta: float, shadow_rate: float
) -> tuple[np.ndarray, float, float, float]:
    """:func:`simulate_streams`'s inputs, checked: the (streams, requests) bool matrix, ε, δ and s."""
    risk = check_probability(risk, "risk")
    delta = check_probability(delta, "delta")
    s = check_shadow_rate(shadow_rate)
    matrix = np.asarray(violated, dtype=bool)
    if matrix.ndim != 2:
        raise CertkvError("violated must be a (streams, requests) boolean matrix")
    return matrix, risk, delta, s
