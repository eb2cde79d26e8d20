"""The live risk monitor: is the deployed violation rate still at most ε?

A certificate promises that at most ε of requests lose more than τ utility. Once served, the
traffic may drift away from calibration, so ``certkv serve`` answers a random share ``s`` of its
evicted requests a second time from the full cache (a *shadow*) and scores the served answer
against it. :class:`RiskMonitor` turns those verdicts into two anytime-valid statistics per stream
(a stratum of a stratified operating point, or ``"all"``):

* a sequential **test** of H0: p ≤ ε, where p is the deployed violation rate (the share of
  requests whose served answer violates; a full-cache answer never does). It trips — and the
  server falls back to the full cache — when the evidence against H0 reaches 1/δ; under H0 the
  chance that it *ever* trips is at most δ, however long the server runs and however often it
  is looked at;
* an **upper confidence bound** on p that holds at every time at once with probability ≥ 1 − δ.

Why both statistics hold at every time at once — the inverse-probability weighting of the
shadows, the betting martingale and Ville's inequality, the grid of the confidence sequence,
shadows that complete out of order and abandoned shadows (counted as violations) — is written out
in docs/design.md, "Statistical rules: the live risk monitor". In short: each statistic is a
nonnegative martingale under its null hypothesis (a bettor's wealth in a fair game, the bets fixed
before each verdict), and Ville's inequality [1]_ bounds the chance that such a martingale *ever*
reaches 1/δ by δ; that is the whole anytime guarantee. The shadows' inverse-probability weights
[2]_ make each bet fair under the null; the bets follow the predictable plug-in of [3]_, and the
bound is the set of rates no grid martingale has rejected (a confidence sequence, [3]_ [4]_).

The benchmarks' vectorised simulator of these statistics, many streams at once, is
``benchmarks/monitor_simulation.py``; everything here is numpy only and thread-safe (one lock
per monitor).

References
----------
.. [1] J. Ville, *Étude critique de la notion de collectif*, Gauthier-Villars, Paris, 1939.
.. [2] D. G. Horvitz and D. J. Thompson, "A generalization of sampling without replacement from a
   finite universe", Journal of the American Statistical Association 47(260), 663–685, 1952.
.. [3] I. Waudby-Smith and A. Ramdas, "Estimating means of bounded random variables by betting",
   Journal of the Royal Statistical Society Series B 86(1), 1–27, 2024.
.. [4] S. R. Howard, A. Ramdas, J. McAuliffe and J. Sekhon, "Time-uniform, nonparametric,
   nonasymptotic confidence sequences", The Annals of Statistics 49(2), 1055–1080, 2021.
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from certkv.core.binomial import check_probability
from certkv.errors import CertkvError

#: The grid m of the confidence sequence: 10^-4 … 10^(-0.02), 50 points per decade (ratio ≈ 1.047).
#: Below 10^-4 the bound reads 10^-4; 1 is the bound before any grid point below it is kept.
BOUND_GRID = np.logspace(-4.0, 0.0, 201)[:-1]

#: The largest betting fraction, as a share of its no-ruin limit: each factor is ≥ 1 − MAX_SHARE,
#: so one unlucky observation (or one pending worst case) never costs more than half the wealth.
MAX_SHARE = 0.5

#: The plug-in estimate's prior: PRIOR_MASS / (s·ε) pseudo-requests at rate PRIOR_FACTOR · ε.
PRIOR_FACTOR = 2.0
PRIOR_MASS = 2.0

#: The test's estimate forgets with memory MEMORY / (s·ε) requests (about MEMORY violations seen
#: at rate ε), so that after a change point it re-aims within a few thousand requests.
MEMORY = 5.0

#: Prior mass of the bound's (undiscounted) estimate, in units of 1/(s·ε) requests, at rate ε.
BOUND_PRIOR_MASS = 1.0

DEFAULT_STREAM = "all"


# -- the bets (pure, vectorised: the monitor and benchmarks/monitor_simulation.py share them) ------------------------


def trip_bets(p_hat: npt.ArrayLike, risk: float, shadow_rate: float) -> np.ndarray:
    """Betting fraction λ of the test of H0: p ≤ ε, given a predictable estimate of p.

    Z takes two values (0 and a = 1/s), so the bet that maximises the growth rate
    E log(1 + λ(Z − ε)) when the rate is p has a closed form, Kelly's
    λ*(p) = (p − ε) / (ε (a − ε)). Plugging in a predictable estimate p̂ (the *predictable plug-in*
    of Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting", 2024)
    grows at close to the oracle rate once p̂ settles, and bets nothing while p̂ ≤ ε, so clearly
    safe traffic costs no wealth and a later drift starts from K ≈ 1 instead of a deep hole (a
    fixed-λ mixture loses ~3 nats over 2,000 requests at ε/2 and then needs them back). In a
    design simulation (ε = δ = 0.05, 200 streams, median requests until the trip at p = 2ε, for
    s = 0.05 / 0.2): this rule, with the prior and memory below, 2,860 / 780 from the start and
    6,960 / 3,260 with a change point at request 2,000 (ε/2 before); aGRAPA (a second-order rule,
    which under-bets this skewed Z by ~2×) 5,000 / 1,360 and 9,240 / 4,970; an equal mixture of
    four fixed Kelly bets (for p = 1.5, 2, 3, 5 ε) 2,770 / 740 and 8,240 / 5,030. So it is as fast
    as the mixture on drift from the start and much faster after a change point.
    Clipped to [0, MAX_SHARE / ε] so that every factor stays ≥ 1/2.

    p_hat : float, or an (n_streams,) float array (one estimate per stream); the bets have its shape.

    References
    ----------
    Waudby-Smith and Ramdas (2024), the predictable plug-in: the module's References.

    Examples
    --------
    No bet while the estimate is at most ε; a larger bet the further above ε it is, and a
    smaller one when fewer answers are shadowed (a violation then weighs 1/s):

    >>> trip_bets([0.02, 0.1, 0.5], risk=0.05, shadow_rate=1.0).round(3).tolist()
    [0.0, 1.053, 9.474]
    >>> trip_bets([0.02, 0.1, 0.5], risk=0.05, shadow_rate=0.2).round(3).tolist()
    [0.0, 0.202, 1.818]
    """
    a = 1.0 / shadow_rate
    lam = (np.asarray(p_hat, dtype=float) - risk) / (risk * (a - risk))
    return np.clip(lam, 0.0, MAX_SHARE / risk)


def bound_bets(p_hat: npt.ArrayLike, shadow_rate: float, grid: np.ndarray = BOUND_GRID) -> np.ndarray:
    """Betting fractions λ^m against H0(m): p ≥ m, for every grid point m (last axis).

    Kelly's bet against m when the rate is p is λ*(m) = (m − p) / (m (a − m)) with a = 1/s, zero
    when p ≥ m; it is clipped to MAX_SHARE / (a − m), so a violation (Z = a) never costs more than
    half of K^m. ``p_hat`` may be an array (one estimate per stream): the result has shape
    ``p_hat.shape + grid.shape`` (`grid`: the (G,) float grid of m values).

    Examples
    --------
    >>> bound_bets(0.01, shadow_rate=1.0).shape, bound_bets([0.01, 0.02], shadow_rate=1.0).shape
    ((200,), (2, 200))
    >>> bool((bound_bets(0.01, shadow_rate=1.0)[BOUND_GRID <= 0.01] == 0).all())  # no bet against m <= p̂
    True
    """
    a = 1.0 / shadow_rate
    p = np.asarray(p_hat, dtype=float)[..., None]
    room = a - grid  # > 0: the grid stays below 1 ≤ a
    lam = (grid - p) / (grid * room)
    return np.clip(lam, 0.0, MAX_SHARE / room)


def bound_from_rejected(rejected: np.ndarray, grid: np.ndarray = BOUND_GRID) -> np.ndarray:
    """The upper bound given which grid points are rejected (last axis): the grid point just
    above the largest one still kept; 1 when the top one is kept, the bottom one when none is.

    rejected : (..., G) bool array over the (G,) `grid`; the bounds have shape (...).

    Examples
    --------
    >>> import numpy as np
    >>> float(bound_from_rejected(np.zeros(BOUND_GRID.size, dtype=bool)))  # nothing rejected yet
    1.0
    >>> float(bound_from_rejected(BOUND_GRID >= 0.1))  # every rate from 0.1 up rejected
    0.1
    """
    rejected = np.asarray(rejected, dtype=bool)
    kept = ~rejected
    top = np.append(grid, 1.0)
    # index of the largest kept point (−1 if none), then the next one up
    last = np.where(kept.any(axis=-1), kept.shape[-1] - 1 - np.argmax(kept[..., ::-1], axis=-1), -1)
    return top[last + 1]


def plug_in_priors(risk: float, shadow_rate: float) -> tuple[float, float, float]:
    """(test prior mass, test prior rate, bound prior mass), in requests.

    Examples
    --------
    >>> [round(x, 6) for x in plug_in_priors(risk=0.05, shadow_rate=0.2)]
    [200.0, 0.1, 100.0]
    """
    unit = 1.0 / (shadow_rate * risk)
    return PRIOR_MASS * unit, PRIOR_FACTOR * risk, BOUND_PRIOR_MASS * unit


def plug_in_discount(risk: float, shadow_rate: float) -> float:
    """Per-request discount of the test's estimate (memory MEMORY / (s·ε) requests).

    Examples
    --------
    >>> round(plug_in_discount(risk=0.05, shadow_rate=0.2), 6)
    0.998
    """
    return 1.0 - shadow_rate * risk / MEMORY


# -- the monitor ----------------------------------------------------------------------------------


@dataclass
class _Pending:
    """A shadowed request waiting for its verdict: its stream, record index and fixed bets."""

    stream: str
    index: int
    lam: float
    lam_bound: np.ndarray


@dataclass
class _Stream:
    """One stream's counts, estimates and martingales (log scale)."""

    delta: float
    requests: int = 0
    evicted: int = 0
    shadowed: int = 0
    violations: int = 0
    abandoned: int = 0
    # the test's plug-in estimate: discounted sums of Z and of requests
    z_sum: float = 0.0
    weight: float = 0.0
    # the bound's plug-in estimate: plain sum of completed Z
    z_total: float = 0.0
    log_k: float = 0.0  # completed factors of K
    log_k_pending: float = 0.0  # pending factors at their smallest value
    log_km: np.ndarray = field(default_factory=lambda: np.zeros(BOUND_GRID.size))
    log_km_pending: np.ndarray = field(default_factory=lambda: np.zeros(BOUND_GRID.size))
    rejected: np.ndarray = field(default_factory=lambda: np.zeros(BOUND_GRID.size, dtype=bool))
    tripped_after: int | None = None
    pending: int = 0


class RiskMonitor:
    """Anytime-valid sequential test of H0: deployed violation rate ≤ ε, per stream (stratum), from
    shadowed answers with inverse-probability weights; and an anytime-valid upper confidence bound
    on the rate.

    Parameters
    ----------
    risk : float
        ε, the certified violation rate, in (0, 1).
    delta : float
        δ of the single stream ``"all"`` when ``streams`` is None, in (0, 1).
    shadow_rate : float
        s, the probability that an evicted answer is shadowed, in (0, 1] (1: shadow them all).
    seed : int
        Seed of the shadow coin (:meth:`draw_shadow`).
    streams : dict of str to float, optional
        Stream name → its δ (a stratified operating point: each stratum at 1 − its confidence).

    Notes
    -----
    See the module docstring for the statistics, their validity and the treatment of abandoned
    and out-of-order shadows. A tripped stream stays tripped for the monitor's lifetime.

    References
    ----------
    Ville (1939) for the anytime validity; Horvitz and Thompson (1952) for the weights;
    Waudby-Smith and Ramdas (2024) and Howard et al. (2021) for the bets and the bound: the
    module's References.

    Examples
    --------
    Every answer shadowed (s = 1), one in five violating, against a certified ε = 0.05: the test
    trips within a few dozen requests.

    >>> monitor = RiskMonitor(risk=0.05, delta=0.05, shadow_rate=1.0)
    >>> for i in range(400):
    ...     ticket = monitor.record("all", evicted=True, shadowed=True)
    ...     monitor.complete(ticket, violated=i % 5 == 0)
    >>> state = monitor.snapshot()["all"]
    >>> state["tripped"], state["tripped_after"]
    (True, 26)

    One in a hundred violating: 2,000 requests leave the test quiet and bound the rate below ε.

    >>> monitor = RiskMonitor(risk=0.05, delta=0.05, shadow_rate=1.0)
    >>> for i in range(2000):
    ...     ticket = monitor.record("all", evicted=True, shadowed=True)
    ...     monitor.complete(ticket, violated=i % 100 == 0)
    >>> state = monitor.snapshot()["all"]
    >>> state["tripped"], round(state["upper_bound"], 4)
    (False, 0.0191)
    """

    def __init__(
        self, risk: float, delta: float, shadow_rate: float, *, seed: int = 0, streams: dict[str, float] | None = None
    ) -> None:
        self.risk = check_probability(risk, "risk")
        self.shadow_rate = check_shadow_rate(shadow_rate)
        if streams is None:
            streams = {DEFAULT_STREAM: check_probability(delta, "delta")}
        if not isinstance(streams, dict) or not streams:
            raise CertkvError("streams must be a non-empty mapping of stream name to its delta")
        self._streams = {
            str(name): _Stream(delta=check_probability(d, f"delta of stream {name!r}")) for name, d in streams.items()
        }
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next_ticket = 0
        self._prior_n, self._prior_p, self._bound_prior_n = plug_in_priors(self.risk, self.shadow_rate)
        self._gamma = plug_in_discount(self.risk, self.shadow_rate)
        self._a = 1.0 / self.shadow_rate

    # -- the server's calls -------------------------------------------------------------------

    @property
    def streams(self) -> list[str]:
        """The stream names, in the order they were given."""
        return list(self._streams)

    def draw_shadow(self) -> bool:
        """The seeded coin, P(True) = shadow_rate. Call it once per *evicted* answer, after the
        gate's decision, so that the coin is independent of the answer (what makes Z unbiased)."""
        with self._lock:
            return bool(self._rng.random() < self.shadow_rate)

    def record(self, stream: str, *, evicted: bool, shadowed: bool) -> int:
        """Count one served request and return its ticket.

        A full-cache answer, or an evicted one not shadowed, is complete at once (Z = 0); a
        shadowed one waits for :meth:`complete` or :meth:`abandon`. The request's bets are fixed
        here, from the observations completed so far and before this request's own flags are
        counted, so that they are predictable.
        """
        if shadowed and not evicted:
            raise CertkvError("a full-cache answer is never shadowed: record(evicted=False, shadowed=True)")
        with self._lock:
            st = self._stream(stream)
            lam, lam_bound = self._bets(st)
            st.requests += 1
            st.evicted += bool(evicted)
            st.weight = self._gamma * st.weight + 1.0
            st.z_sum *= self._gamma
            ticket = self._next_ticket
            self._next_ticket += 1
            if shadowed:
                st.shadowed += 1
                st.pending += 1
                self._pending[ticket] = _Pending(stream, st.requests, lam, lam_bound)
                st.log_k_pending += math.log1p(-lam * self.risk)
                st.log_km_pending += np.log1p(-lam_bound * (self._a - BOUND_GRID))
            else:
                st.log_k += math.log1p(-lam * self.risk)
                st.log_km += np.log1p(lam_bound * BOUND_GRID)
            self._update(st)
            return ticket

    def complete(self, ticket: int, violated: bool) -> None:
        """Apply a shadow's verdict (loss > τ) to its request's fixed factors."""
        with self._lock:
            job = self._take(ticket)
            st = self._streams[job.stream]
            st.violations += bool(violated)
            self._settle(st, job, bool(violated))

    def abandon(self, ticket: int) -> None:
        """The shadow could not be scored: counted as a violation (see the module docstring)."""
        with self._lock:
            job = self._take(ticket)
            st = self._streams[job.stream]
            st.abandoned += 1
            self._settle(st, job, True)

    def tripped(self, stream: str) -> bool:
        """Whether the stream's test has rejected H0 (once True, True for this monitor's life)."""
        with self._lock:
            return self._stream(stream).tripped_after is not None

    def snapshot(self) -> dict[str, dict]:
        """Per stream: requests, evicted, shadowed, pending, violations (observed verdicts),
        abandoned, e_value (K, pending factors at their smallest), upper_bound, tripped,
        tripped_after (requests recorded when it tripped, or None), delta."""
        with self._lock:
            return {name: self._state(st) for name, st in self._streams.items()}

    # -- internals ----------------------------------------------------------------------------

    def _stream(self, name: str) -> _Stream:
        try:
            return self._streams[name]
        except KeyError:
            raise CertkvError(f"unknown monitor stream {name!r}; known: {', '.join(self._streams)}") from None

    def _take(self, ticket: int) -> _Pending:
        job = self._pending.pop(ticket, None)
        if job is None:
            raise CertkvError(f"ticket {ticket!r} is not a pending shadow (unknown, unshadowed or already settled)")
        return job

    def _bets(self, st: _Stream) -> tuple[float, np.ndarray]:
        """The next request's bets, from the completed observations only."""
        p_test = (st.z_sum + self._prior_n * self._prior_p) / (st.weight + self._prior_n)
        done = st.requests - st.pending
        p_bound = (st.z_total + self._bound_prior_n * self.risk) / (done + self._bound_prior_n)
        lam = float(trip_bets(p_test, self.risk, self.shadow_rate))
        return lam, bound_bets(p_bound, self.shadow_rate)

    def _settle(self, st: _Stream, job: _Pending, violated: bool) -> None:
        """Replace a pending factor's smallest value by its actual one."""
        st.pending -= 1
        st.log_k_pending -= math.log1p(-job.lam * self.risk)
        st.log_km_pending -= np.log1p(-job.lam_bound * (self._a - BOUND_GRID))
        z = self._a if violated else 0.0
        st.log_k += math.log1p(job.lam * (z - self.risk))
        st.log_km += np.log1p(-job.lam_bound * (z - BOUND_GRID))
        if violated:
            st.z_sum += z * self._gamma ** (st.requests - job.index)
            st.z_total += z
        if not st.pending:  # no pending factor left: drop the rounding residue of the sums
            st.log_k_pending = 0.0
            st.log_km_pending[:] = 0.0
        self._update(st)

    def _update(self, st: _Stream) -> None:
        """Trip and reject grid points on the reported (pending-at-worst) martingales."""
        level = math.log(1.0 / st.delta)
        if st.tripped_after is None and st.log_k + st.log_k_pending >= level:
            st.tripped_after = st.requests
        st.rejected |= (st.log_km + st.log_km_pending) >= level

    def _state(self, st: _Stream) -> dict:
        log_k = st.log_k + st.log_k_pending
        return {
            "requests": st.requests,
            "evicted": st.evicted,
            "shadowed": st.shadowed,
            "pending": st.pending,
            "violations": st.violations,
            "abandoned": st.abandoned,
            "e_value": math.exp(min(log_k, 700.0)),
            "upper_bound": float(bound_from_rejected(st.rejected)),
            "tripped": st.tripped_after is not None,
            "tripped_after": st.tripped_after,
            "delta": st.delta,
        }


def check_shadow_rate(value: object) -> float:
    """Validate a shadow rate s in (0, 1]: the share of evicted answers checked (1: all of them).

    Examples
    --------
    >>> check_shadow_rate(1)
    1.0
    >>> check_shadow_rate(0)
    Traceback (most recent call last):
    ...
    certkv.errors.CertkvError: shadow_rate must be a number in (0, 1], got 0
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not 0.0 < float(value) <= 1.0:
        raise CertkvError(f"shadow_rate must be a number in (0, 1], got {value!r}")
    return float(value)
