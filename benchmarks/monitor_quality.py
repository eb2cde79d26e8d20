"""Does the live risk monitor (certkv.core.monitor) stay quiet when the certificate holds and switch
to the full cache soon after it stops holding?

The monitor sees every served request and the verdict of a random share s of the evicted ones
(a shadow answered from the full cache), and trips a stream when its betting e-value reaches 1/δ.
Every stream below is simulated with :func:`monitor_simulation.simulate_streams` (the monitor's own
arithmetic, vectorised over streams; a test checks it matches :class:`~certkv.core.monitor.RiskMonitor`),
ε = 0.05, δ = 0.05, for s = 0.05 and s = 0.2:

* **no drift** — true violation rate ε/2, 200 streams of 5,000 requests: the share of streams that
  ever switch (the guarantee: ≤ δ), and the median upper bound on the rate after 5,000 requests;
* **drift** — the rate is 2ε from the first request, or ε/2 for 2,000 requests and then 2ε (a
  change point): the median and 90th percentile of the requests until the switch (streams run
  up to 40,000 requests; those that never switch count as beyond the horizon);
* **demo replay, no drift** — real verdicts: requests resampled (with replacement, seeded) from the
  demo store's certification requests, both tasks mixed as calibrated, each served on its task's
  entry of the demo operating point (its violation is the one certification counted: the loss of
  the entry's policy — gated rows derived by :func:`certkv.core.certify.prepare` — above τ); one
  monitor stream per task at the stratum's δ. The share of 200 streams of 5,000 requests in which
  any task's stream switches;
* **demo replay, drift** — multi-key-only traffic served on the single-needle entry's policy and
  gate (its thresholds as the operating point stores them, applied to the multi-key requests'
  recorded signals): the requests until the single-needle stream switches.

    python benchmarks/monitor_quality.py   # writes benchmarks/results/monitor_quality.json

The demo store is read, never written (--store, --operating-point, --contract to point elsewhere).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from monitor_simulation import bernoulli_violations, simulate_streams  # benchmarks/monitor_simulation.py

RESULTS = Path(__file__).parent / "results"
DEMO = Path("certkv-demo")  # the folder `certkv demo` runs in
RISK, DELTA = 0.05, 0.05
SHADOW_RATES = (0.05, 0.2)
N_STREAMS, N_REQUESTS, HORIZON, CHANGE_AT = 200, 5000, 40000, 2000
SEED = 1818


def quantiles(tripped_after: np.ndarray, offset: int = 0) -> dict:
    """Median and p90 of the requests until the switch (after ``offset``); never = beyond horizon."""
    never = tripped_after == 0
    waits = np.where(never, np.inf, tripped_after - offset).astype(float)
    med, p90 = np.median(waits), np.percentile(waits, 90)
    return {"median": None if np.isinf(med) else int(med), "p90": None if np.isinf(p90) else int(p90),
            "never_within_horizon": float(np.mean(never))}


def no_drift(rate: float, s: float, seed: int) -> dict:
    v = bernoulli_violations(np.full(N_REQUESTS, rate), N_STREAMS, seed=seed)
    sim = simulate_streams(v, risk=RISK, delta=DELTA, shadow_rate=s, seed=seed + 1, bound=True)
    return {"true_rate": rate, "false_switch_share": float(np.mean(sim.tripped_after > 0)),
            "median_upper_bound": float(np.median(sim.upper_bound)),
            "bound_coverage": float(np.mean(sim.upper_bound >= rate))}


def drift(rates: np.ndarray, s: float, seed: int, offset: int = 0) -> dict:
    v = bernoulli_violations(rates, N_STREAMS, seed=seed)
    sim = simulate_streams(v, risk=RISK, delta=DELTA, shadow_rate=s, seed=seed + 1, stop_when_tripped=True)
    out = {"requests_until_switch": quantiles(sim.tripped_after)}
    if offset:
        early = (sim.tripped_after > 0) & (sim.tripped_after <= offset)
        out["switched_before_change"] = float(np.mean(early))
        out["requests_after_change"] = quantiles(np.where(early, 0, sim.tripped_after), offset)
    return out


def synthetic() -> dict:
    out = {}
    for j, s in enumerate(SHADOW_RATES):
        seed = SEED + 100 * j
        out[str(s)] = {
            "no_drift": no_drift(RISK / 2, s, seed),
            "drift_from_start": drift(np.full(HORIZON, 2 * RISK), s, seed + 10),
            "change_point": drift(np.r_[np.full(CHANGE_AT, RISK / 2), np.full(HORIZON - CHANGE_AT, 2 * RISK)],
                                  s, seed + 20, offset=CHANGE_AT),
        }
    return out


# -- the demo store's verdicts ---------------------------------------------------------------------


def demo_verdicts(contract_path: Path, op_path: Path) -> dict:
    """Per task: the certification requests' violations under the task's entry (what certification
    counted), and the multi-key requests' violations under the single-needle entry."""
    from certkv.calibration.certification import load_records
    from certkv.contract import load_contract
    from certkv.contract.spec import certification_spec
    from certkv.core.binomial import violation_mask
    from certkv.core.certify import prepare
    from certkv.core.operating_point import load_operating_point
    from certkv.core.strata import stratum_labels, stratum_spec

    contract = load_contract(contract_path)
    op = load_operating_point(op_path)
    table = load_records(contract).table
    spec = certification_spec(contract)
    labels = np.asarray(stratum_labels(table, op.strata.by))
    per_stratum = stratum_spec(spec, len(op.strata.entries))
    served, subs = {}, {}
    for name, entry in op.strata.entries.items():
        subs[name] = table.take_requests(np.flatnonzero(labels == name))
        prepared, resolved, _ = prepare(subs[name], per_stratum)
        served[name] = violation_mask(prepared.loss[prepared.index_of(entry.policy)], resolved.tolerance)
        assert served[name].size == entry.n and served[name].sum() == entry.violations, name
        # the entry as the runtime applies it (stored thresholds on recorded signals) is what was certified
        assert np.array_equal(_served_by(prepared, entry, resolved.tolerance), served[name]), name
    shifted = _served_by(subs["multi_key"], op.strata.entries["single_needle"], spec.tolerance)
    return {"served": served, "multi_key_on_single_needle": shifted,
            "deltas": {name: 1.0 - op.strata.confidence for name in op.strata.entries},
            "policies": {name: e.policy for name, e in op.strata.entries.items()}}


def _served_by(table, entry, tolerance) -> np.ndarray:
    """Violations of every request of `table` under `entry`'s base policy and gate thresholds:
    the gate sends a request to the full cache (loss 0) where it fires."""
    from certkv.core.binomial import violation_mask
    from certkv.core.gated import gated_mask

    base = table.index_of(entry.base_policy)
    full = gated_mask(table, base, entry.gate, entry.policy)
    loss = np.where(full, 0.0, table.loss[base])
    return violation_mask(loss, tolerance)


def replay_no_drift(verdicts: dict, s: float, seed: int) -> dict:
    """Demo-mix traffic on the demo operating point: each task's requests go to its own stream."""
    served = verdicts["served"]
    names = list(served)
    pool_task = np.concatenate([np.full(served[n].size, k) for k, n in enumerate(names)])
    pool_v = np.concatenate([served[n] for n in names])
    rng = np.random.default_rng(seed)
    draw = rng.integers(0, pool_v.size, size=(N_STREAMS, N_REQUESTS))
    any_switch = np.zeros(N_STREAMS, dtype=bool)
    per_task = {}
    for k, name in enumerate(names):
        mine = pool_task[draw] == k
        counts = mine.sum(axis=1)
        v = np.zeros((N_STREAMS, counts.max()), dtype=bool)  # each stream's subsequence, padded
        for i in range(N_STREAMS):
            v[i, :counts[i]] = pool_v[draw[i][mine[i]]]
        sim = simulate_streams(v, risk=RISK, delta=verdicts["deltas"][name], shadow_rate=s, seed=seed + 1 + k)
        switched = (sim.tripped_after > 0) & (sim.tripped_after <= counts)
        any_switch |= switched
        per_task[name] = {"policy": verdicts["policies"][name], "pool_rate": float(served[name].mean()),
                          "median_requests": int(np.median(counts)), "false_switch_share": float(switched.mean())}
    return {"false_switch_share": float(any_switch.mean()), "per_task": per_task}


def replay_drift(verdicts: dict, s: float, seed: int) -> dict:
    """Multi-key-only traffic on the single-needle entry: requests until its stream switches."""
    pool = verdicts["multi_key_on_single_needle"]
    rng = np.random.default_rng(seed)
    v = pool[rng.integers(0, pool.size, size=(N_STREAMS, HORIZON))]
    sim = simulate_streams(v, risk=RISK, delta=verdicts["deltas"]["single_needle"], shadow_rate=s,
                           seed=seed + 1, stop_when_tripped=True)
    return {"pool_rate": float(pool.mean()), "requests_until_switch": quantiles(sim.tripped_after)}


def replays(contract: Path, op: Path) -> dict:
    verdicts = demo_verdicts(contract, op)
    out = {"policies": verdicts["policies"], "multi_key_on_single_needle_rate":
           float(verdicts["multi_key_on_single_needle"].mean())}
    for j, s in enumerate(SHADOW_RATES):
        out[str(s)] = {"no_drift": replay_no_drift(verdicts, s, SEED + 1000 + 100 * j),
                       "drift": replay_drift(verdicts, s, SEED + 1050 + 100 * j)}
    return out


def _fmt(q: dict) -> str:
    med = "—" if q["median"] is None else f"{q['median']:,}"
    p90 = "—" if q["p90"] is None else f"{q['p90']:,}"
    return f"{med} / {p90}"


def print_table(result: dict) -> None:
    print(f"ε = {RISK}, δ = {DELTA}; {N_STREAMS} streams; switch = the monitor trips (median / p90 requests)")
    print(f"{'s':>5} | {'false switches (ε/2)':>20} | {'bound@5k':>8} | {'drift 2ε':>15} | "
          f"{'after change':>15} | {'demo false sw.':>14} | {'demo drift':>15}")
    for s in map(str, SHADOW_RATES):
        syn, rep = result["synthetic"][s], result.get("replay", {}).get(s)
        demo_false = f"{rep['no_drift']['false_switch_share']:.3f}" if rep else "n/a"
        demo_drift = _fmt(rep["drift"]["requests_until_switch"]) if rep else "n/a"
        print(f"{s:>5} | {syn['no_drift']['false_switch_share']:>20.3f} | {syn['no_drift']['median_upper_bound']:>8.4f} | "
              f"{_fmt(syn['drift_from_start']['requests_until_switch']):>15} | "
              f"{_fmt(syn['change_point']['requests_after_change']):>15} | {demo_false:>14} | {demo_drift:>15}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contract", type=Path, default=DEMO / "demo.yaml")
    parser.add_argument("--operating-point", type=Path, default=DEMO / "runs/demo/operating_point.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "monitor_quality.json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    result = {"risk": RISK, "delta": DELTA, "streams": N_STREAMS, "requests": N_REQUESTS, "horizon": HORIZON,
              "change_at": CHANGE_AT, "seed": SEED, "synthetic": synthetic()}
    if args.contract.is_file() and args.operating_point.is_file():
        result["replay"] = replays(args.contract, args.operating_point)
    else:
        print(f"no demo store at {args.contract.parent}: skipping the replays")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} in {result['seconds']} s")


if __name__ == "__main__":
    main()
