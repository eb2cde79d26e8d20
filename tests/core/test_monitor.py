"""The live risk monitor (certkv.core.monitor): false trips at most δ under H0, a bound that covers
the rate at all times, power under drift, and the bookkeeping the server relies on
(out-of-order shadows, abandons, per-stream δ, a sticky trip, thread safety, one-line errors)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from monitor_simulation import bernoulli_violations, simulate_streams
from scipy.stats import binom

from certkv.core.monitor import BOUND_GRID, RiskMonitor, bound_from_rejected
from certkv.errors import CertkvError

EPS, DELTA = 0.05, 0.05


def _allowed(n_streams: int, level: float = DELTA) -> int:
    """Most trips (or misses) a level-δ procedure shows in n_streams streams, but for a 1e-3 fluke."""
    return int(binom.ppf(1 - 1e-3, n_streams, level))


@pytest.mark.parametrize("shadow_rate", [0.05, 0.2])
@pytest.mark.parametrize("rate", [EPS / 2, EPS])
def test_false_trips_at_most_delta_under_h0(rate, shadow_rate):
    n_streams = 1000
    v = bernoulli_violations(np.full(3000, rate), n_streams, seed=11)
    sim = simulate_streams(v, risk=EPS, delta=DELTA, shadow_rate=shadow_rate, seed=12)
    assert np.count_nonzero(sim.tripped_after) <= _allowed(n_streams)


@pytest.mark.parametrize("shadow_rate", [0.05, 0.2])
@pytest.mark.parametrize("rate", [EPS / 2, 2 * EPS])
def test_bound_covers_the_rate_at_all_times(rate, shadow_rate):
    # the bound never increases, so covering after the last request is covering at every time
    n_streams = 300
    v = bernoulli_violations(np.full(2000, rate), n_streams, seed=21)
    sim = simulate_streams(v, risk=EPS, delta=DELTA, shadow_rate=shadow_rate, seed=22, bound=True)
    assert np.count_nonzero(sim.upper_bound < rate) <= _allowed(n_streams)
    assert np.median(sim.upper_bound) < 1.0  # and it says something


def test_bound_is_monotone_and_tightens():
    m = RiskMonitor(EPS, DELTA, 0.2, seed=3)
    rng = np.random.default_rng(4)
    bounds = []
    for _ in range(3000):
        shadowed = m.draw_shadow()
        ticket = m.record("all", evicted=True, shadowed=shadowed)
        if shadowed:
            m.complete(ticket, bool(rng.random() < EPS / 2))
        bounds.append(m.snapshot()["all"]["upper_bound"])
    assert np.all(np.diff(bounds) <= 0)
    assert EPS / 2 <= bounds[-1] < 0.06


@pytest.mark.parametrize("shadow_rate,within", [(0.05, 20000), (0.2, 6000)])
def test_trips_under_drift(shadow_rate, within):
    v = bernoulli_violations(np.full(within, 2 * EPS), 100, seed=31)
    sim = simulate_streams(v, risk=EPS, delta=DELTA, shadow_rate=shadow_rate, seed=32, stop_when_tripped=True)
    assert np.mean(sim.tripped_after > 0) >= 0.95


def test_monitor_matches_the_simulator():
    rng = np.random.default_rng(5)
    v, sh = rng.random((1, 2500)) < 0.08, rng.random((1, 2500)) < 0.2
    m = RiskMonitor(EPS, DELTA, 0.2)
    for t in range(v.shape[1]):
        ticket = m.record("all", evicted=True, shadowed=bool(sh[0, t]))
        if sh[0, t]:
            m.complete(ticket, bool(v[0, t]))
    sim = simulate_streams(v, risk=EPS, delta=DELTA, shadow_rate=0.2, shadowed=sh, bound=True)
    snap = m.snapshot()["all"]
    assert snap["e_value"] == pytest.approx(sim.e_value[0], rel=1e-9)
    assert snap["upper_bound"] == sim.upper_bound[0]
    assert (snap["tripped_after"] or 0) == sim.tripped_after[0]


def _batch(order, verdicts):
    """Record a warm-up, then shadowed requests whose verdicts arrive in `order`."""
    m = RiskMonitor(EPS, DELTA, 0.2)
    for i in range(200):  # some completed history, so that the bets are not all the prior's
        t = m.record("all", evicted=True, shadowed=i % 10 == 0)
        if i % 10 == 0:
            m.complete(t, i % 40 == 0)
    tickets = [m.record("all", evicted=True, shadowed=True) for _ in verdicts]
    for j in order:
        m.complete(tickets[j], verdicts[j])
    return m.snapshot()["all"]


def test_out_of_order_completion_gives_the_in_order_e_value():
    verdicts = [True, False, False, True, False, False, False, True]
    in_order = _batch(range(len(verdicts)), verdicts)
    shuffled = _batch([5, 0, 7, 2, 6, 1, 4, 3], verdicts)
    assert shuffled["e_value"] == pytest.approx(in_order["e_value"], rel=1e-12)
    assert shuffled["upper_bound"] == in_order["upper_bound"]
    assert shuffled["violations"] == in_order["violations"] == 3 + 5


def test_pending_shadows_count_at_their_smallest_factor():
    m = RiskMonitor(EPS, DELTA, 0.2)
    before = m.snapshot()["all"]["e_value"]
    t = m.record("all", evicted=True, shadowed=True)
    pending = m.snapshot()["all"]
    assert pending["pending"] == 1 and pending["e_value"] <= before
    m.complete(t, True)
    done = m.snapshot()["all"]
    assert done["pending"] == 0 and done["e_value"] > before  # a violation is evidence against H0


def test_abandon_counts_as_a_violation():
    a, b = RiskMonitor(EPS, DELTA, 0.2), RiskMonitor(EPS, DELTA, 0.2)
    ta, tb = (m.record("all", evicted=True, shadowed=True) for m in (a, b))
    a.abandon(ta)
    b.complete(tb, True)
    sa, sb = a.snapshot()["all"], b.snapshot()["all"]
    assert sa["e_value"] == sb["e_value"] and sa["upper_bound"] == sb["upper_bound"]
    assert (sa["abandoned"], sa["violations"], sa["pending"]) == (1, 0, 0)
    with pytest.raises(CertkvError, match="not a pending shadow"):
        a.abandon(ta)
    with pytest.raises(CertkvError, match="not a pending shadow"):
        a.complete(ta, False)


def test_once_tripped_stays_tripped():
    m = RiskMonitor(EPS, DELTA, 1.0)
    n = 0
    while not m.tripped("all"):
        m.complete(m.record("all", evicted=True, shadowed=True), True)
        n += 1
        assert n < 100
    after = m.snapshot()["all"]["tripped_after"]
    assert after == n
    for _ in range(5000):  # a long clean run afterwards does not un-trip it
        m.record("all", evicted=False, shadowed=False)
    snap = m.snapshot()["all"]
    assert m.tripped("all") and snap["tripped"] and snap["tripped_after"] == after
    assert snap["requests"] == n + 5000 and snap["evicted"] == n


def test_streams_are_separate_and_have_their_own_delta():
    m = RiskMonitor(EPS, 0.5, 1.0, streams={"tight": 1e-6, "loose": 0.2})
    for _ in range(3):
        for name in ("tight", "loose"):
            m.complete(m.record(name, evicted=True, shadowed=True), True)
    snap = m.snapshot()
    assert set(snap) == {"tight", "loose"} and m.streams == ["tight", "loose"]
    assert snap["loose"]["tripped"] and not snap["tight"]["tripped"]
    assert snap["tight"]["delta"] == 1e-6 and snap["loose"]["delta"] == 0.2
    # the tighter δ asks for more evidence, so it keeps a wider bound
    assert snap["tight"]["upper_bound"] >= snap["loose"]["upper_bound"]
    with pytest.raises(CertkvError, match="unknown monitor stream 'other'"):
        m.record("other", evicted=True, shadowed=False)


def test_default_stream_and_snapshot_keys():
    m = RiskMonitor(EPS, DELTA, 0.05)
    m.record("all", evicted=False, shadowed=False)
    snap = m.snapshot()
    assert list(snap) == ["all"]
    assert set(snap["all"]) >= {"requests", "evicted", "shadowed", "pending", "violations", "e_value",
                                "upper_bound", "tripped", "tripped_after", "delta"}
    assert snap["all"]["tripped_after"] is None and snap["all"]["delta"] == DELTA


def test_draw_shadow_is_seeded_with_the_shadow_rate():
    draws = [RiskMonitor(EPS, DELTA, 0.2, seed=7).draw_shadow() for _ in range(3)]
    assert len(set(draws)) == 1
    m = RiskMonitor(EPS, DELTA, 0.2, seed=8)
    share = np.mean([m.draw_shadow() for _ in range(20000)])
    assert abs(share - 0.2) < 0.015


def test_thread_safety_smoke():
    m = RiskMonitor(EPS, DELTA, 0.2, streams={"a": DELTA, "b": DELTA})
    tickets: list[int] = []
    issued: list[int] = []
    lock = threading.Lock()

    def serve(name):
        for _ in range(2000):
            shadowed = m.draw_shadow()
            t = m.record(name, evicted=True, shadowed=shadowed)
            with lock:
                issued.append(t)
                if shadowed:
                    tickets.append(t)

    def score():
        done = 0
        while done < 50:
            with lock:
                t = tickets.pop() if tickets else None
            if t is None:
                continue
            m.complete(t, False)
            done += 1

    threads = [threading.Thread(target=serve, args=(n,)) for n in ("a", "b", "a", "b")]
    threads.append(threading.Thread(target=score))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in tickets:
        m.complete(t, False)
    snap = m.snapshot()
    assert snap["a"]["requests"] == snap["b"]["requests"] == 4000
    assert all(s["pending"] == 0 and s["violations"] == 0 and not s["tripped"] for s in snap.values())
    assert sorted(issued) == list(range(8000))  # every ticket issued once


def test_full_cache_answers_are_never_shadowed():
    m = RiskMonitor(EPS, DELTA, 0.2)
    with pytest.raises(CertkvError, match="never shadowed"):
        m.record("all", evicted=False, shadowed=True)


@pytest.mark.parametrize("kwargs,name", [
    (dict(risk=0.0), "risk"), (dict(risk=1.0), "risk"), (dict(risk=float("nan")), "risk"),
    (dict(delta=0.0), "delta"), (dict(delta=1.5), "delta"), (dict(delta="0.05"), "delta"),
    (dict(shadow_rate=0.0), "shadow_rate"), (dict(shadow_rate=-0.1), "shadow_rate"),
    (dict(shadow_rate=1.01), "shadow_rate"), (dict(shadow_rate=True), "shadow_rate"),
    (dict(streams={"x": 1.0}), "delta of stream 'x'"), (dict(streams={}), "streams"),
])
def test_bad_arguments_raise_one_line_errors(kwargs, name):
    args = dict(risk=EPS, delta=DELTA, shadow_rate=0.05) | kwargs
    streams = args.pop("streams", None)
    with pytest.raises(CertkvError, match=name) as info:
        RiskMonitor(args["risk"], args["delta"], args["shadow_rate"], streams=streams)
    assert "\n" not in str(info.value)


def test_bound_from_rejected_edges():
    g = BOUND_GRID.size
    assert bound_from_rejected(np.zeros(g, bool)) == 1.0
    assert bound_from_rejected(np.ones(g, bool)) == BOUND_GRID[0]
    rejected = np.ones(g, bool)
    rejected[[3, 10]] = False  # not upward-closed: the largest kept point decides
    assert bound_from_rejected(rejected) == BOUND_GRID[11]
