"""`certkv serve --replicas`: the shared monitor's statistics, 2 replicas against 1, and a replica killed under load.

Three parts (``--part monitor|throughput|kill``, all by default):

* **monitor** — two replicas serve one deployment's traffic, alternating requests. Three ways to
  watch it, ε = δ = 0.05, s = 0.05 and 0.2, 200 streams per cell:
  *one monitor* sees all traffic, every verdict before the next request
  (:func:`monitor_simulation.simulate_streams`, the reference); *shared* is the shared monitor of
  ``--replicas``: the real :class:`~certkv.core.monitor.RiskMonitor` over all traffic with every
  verdict applied ``LAG`` requests after its request (the shadow runs after the answer and its
  verdict travels in a batch; tests/serve/test_shared_monitor.py shows the shared monitor's state is
  that RiskMonitor's, call for call); *per replica* runs one monitor per replica on its half, each at
  δ, as two independent ``certkv serve`` processes would (a replica switches when its own trips).
  No drift (rate ε/2, and ε, the edge of the null, 5,000 requests): the share of streams in which
  any monitor switched. Drift (2ε from the first request): requests of the deployment until the
  switch (per replica: until the first replica and until both switched), median / p90.
* **throughput** — Ray Serve on a local Ray cluster, 1 replica and then 2 (one torch thread each,
  the default shadow rate 0.05, a point that does not trip), the same requests sent by 4 concurrent
  clients: answered requests per second, measured on this machine with the other processes' load.
* **kill** — 2 replicas, every evicted answer shadowed, 4 concurrent clients; one replica's actor is
  killed (``ray.kill``, as a crash) after a third of the answers: the failed requests by status, the
  shadows whose verdict the monitor applied without their record pair in the store (lost), the
  shadows left pending at the monitor (drawn on the killed replica and never scored: counted at
  their worst value for good).

    python benchmarks/replicas.py                  # writes benchmarks/results/replicas.json
    python benchmarks/replicas.py --part monitor   # one part, printed, results file untouched
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np
from endpoint_servers import free_port  # benchmarks/endpoint_servers.py
from monitor_simulation import bernoulli_violations, simulate_streams  # benchmarks/monitor_simulation.py

RESULTS = Path(__file__).parent / "results"
RISK, DELTA = 0.05, 0.05
SHADOW_RATES = (0.05, 0.2)
N_STREAMS, N_REQUESTS, HORIZON = 200, 5000, 40000
LAG = 16
REPLICAS = 2
SEED = 4343
CLIENTS, N_LOAD = 4, 160


# ----------------------------------------------------------------------------- the monitor's statistics


def quantiles(x: np.ndarray) -> dict:
    """Median and p90 of the requests until the switch (0: never within the horizon)."""
    waits = np.where(x == 0, np.inf, x).astype(float)
    med, p90 = np.median(waits), np.percentile(waits, 90)
    return {"median": None if np.isinf(med) else int(med), "p90": None if np.isinf(p90) else int(p90),
            "never_within_horizon": float(np.mean(x == 0))}


def shared_lagged(violated: np.ndarray, coins: np.ndarray, s: float, lag: int, stop: bool) -> np.ndarray:
    """The shared monitor over each stream of the whole traffic: RiskMonitor itself, each verdict
    applied `lag` requests after its request. Returns each stream's requests until the trip (0: never)."""
    from certkv.core.monitor import RiskMonitor

    out = np.zeros(violated.shape[0], dtype=np.int64)
    for i in range(violated.shape[0]):
        monitor, due = RiskMonitor(RISK, DELTA, s), deque()
        for t in range(violated.shape[1]):
            while due and due[0][0] <= t:
                _, ticket, v = due.popleft()
                monitor.complete(ticket, v)
            ticket = monitor.record("all", evicted=True, shadowed=bool(coins[i, t]))
            if coins[i, t]:
                due.append((t + lag, ticket, bool(violated[i, t])))
            if monitor.tripped("all"):
                out[i] = t + 1
                if stop:
                    break
    return out


def per_replica(violated: np.ndarray, coins: np.ndarray, s: float, stop: bool) -> tuple[np.ndarray, np.ndarray]:
    """One monitor per replica on its half (request t goes to replica t mod 2): in deployment
    requests, when the first replica and when every replica switched (0: never)."""
    trips = []
    for r in range(REPLICAS):
        sim = simulate_streams(violated[:, r::REPLICAS], risk=RISK, delta=DELTA, shadow_rate=s,
                               shadowed=coins[:, r::REPLICAS], stop_when_tripped=stop)
        trips.append(np.where(sim.tripped_after > 0, REPLICAS * (sim.tripped_after - 1) + r + 1, 0))
    t = np.stack(trips)
    never = t == 0
    first = np.where(never.all(axis=0), 0, np.where(never, np.iinfo(np.int64).max, t).min(axis=0))
    every = np.where(never.any(axis=0), 0, t.max(axis=0))
    return first, every


def monitor_cell(rate: float, n: int, s: float, seed: int, drift: bool) -> dict:
    """One (rate, s) cell: one monitor, shared (lagged) and per-replica monitors on the same streams."""
    violated = bernoulli_violations(np.full(n, rate), N_STREAMS, seed=seed)
    coins = np.random.default_rng(seed + 1).random(violated.shape) < s
    one = simulate_streams(violated, risk=RISK, delta=DELTA, shadow_rate=s, shadowed=coins,
                           stop_when_tripped=drift).tripped_after
    shared = shared_lagged(violated, coins, s, LAG, stop=drift)
    first, every = per_replica(violated, coins, s, stop=drift)
    if not drift:
        return {"true_rate": rate, "one_monitor": float(np.mean(one > 0)), "shared": float(np.mean(shared > 0)),
                "per_replica": float(np.mean(first > 0))}
    out = {"true_rate": rate, "one_monitor": quantiles(one), "shared": quantiles(shared),
           "per_replica_first": quantiles(first), "per_replica_every": quantiles(every)}
    ref = out["one_monitor"]["median"]
    out["shared_over_one"] = out["shared"]["median"] / ref
    out["per_replica_every_over_one"] = (out["per_replica_every"]["median"] or HORIZON) / ref
    return out


def monitor_part() -> dict:
    out: dict = {"risk": RISK, "delta": DELTA, "streams": N_STREAMS, "requests": N_REQUESTS, "horizon": HORIZON,
                 "lag": LAG, "replicas": REPLICAS, "seed": SEED}
    for j, s in enumerate(SHADOW_RATES):
        seed = SEED + 100 * j
        out[str(s)] = {"no_drift": monitor_cell(RISK / 2, N_REQUESTS, s, seed, False),
                       "edge_of_null": monitor_cell(RISK, N_REQUESTS, s, seed + 10, False),
                       "drift": monitor_cell(2 * RISK, HORIZON, s, seed + 20, True)}
        print(s, json.dumps(out[str(s)]), flush=True)
    return out


# ----------------------------------------------------------------------------- Ray Serve


def _point(folder: Path, risk: float) -> Path:
    from certkv.core.operating_point import ContractSummary, OperatingPoint

    op = OperatingPoint(
        policy="snapkv@0.50", base_policy="snapkv@0.50", press="snapkv", kv_retained=0.5, mean_kv_retained=0.5,
        fallback=False, contract=ContractSummary(tolerance=0.0, risk=risk, confidence=0.9,
                                                 procedure="fixed_sequence", utility="agreement"),
        n=4, violations=0, empirical_risk=0.0, risk_upper_bound=risk, p_value=0.01, candidates=[], sequences=[],
        guarantee="benchmark", created="now", certkv_version="benchmark", gate=None, max_new_tokens=8)
    return op.write_json(folder / "operating_point.json")


def _deploy(folder: Path, replicas: int, shadow_rate: float) -> str:
    """`replicas` replicas of a point that does not trip (ε = 0.5), behind Serve's proxy; its URL."""
    from ray import serve

    from certkv.serve.replicas import ReplicaOptions, replica_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = ReplicaOptions(operating_point=str(_point(folder, 0.5)), shadow_rate=shadow_rate, device="cpu",
                             shadow_store=str(folder / "shadow"))
    serve.run(replica_app(options, num_replicas=replicas, ray_actor_options={"num_cpus": 1}), name="certkv",
              route_prefix="/")
    return f"http://127.0.0.1:{port}"


def _post(url: str, r) -> int:
    import httpx

    try:
        return httpx.post(url + "/v1/completions", json={"context": r.context, "question": r.question},
                          timeout=120).status_code
    except httpx.HTTPError:
        return 0


def _load(url: str, requests, on_done=None) -> tuple[list[int], float]:
    """Every request of `requests` sent by CLIENTS concurrent clients; statuses and wall seconds."""
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(_post, url, r) for r in requests]
        statuses = []
        for f in concurrent.futures.as_completed(futures):
            statuses.append(f.result())
            if on_done is not None:
                on_done(len(statuses))
    return statuses, time.perf_counter() - t0


def throughput_part(requests) -> dict:
    import ray
    from ray import serve
    from ray_scaling import LoadMeter  # benchmarks/ray_scaling.py: the machine's other load

    out, meter = {}, LoadMeter()
    try:
        for n in (1, REPLICAS):
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, namespace="certkv")
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    url = _deploy(Path(tmp), n, 0.05)
                    _load(url, requests[:CLIENTS * 2])  # warm-up: every replica has answered
                    mark = meter.mark()
                    statuses, wall = _load(url, requests)
                    out[f"replicas_{n}"] = {"requests": len(statuses), "ok": statuses.count(200),
                                            "requests_per_second": round(len(statuses) / wall, 3),
                                            "wall_seconds": round(wall, 2), **meter.since(mark)}
                    print(n, out[f"replicas_{n}"], flush=True)
            finally:
                serve.shutdown()
                ray.shutdown()
    finally:
        meter.close()
    out["speedup"] = round(out[f"replicas_{REPLICAS}"]["requests_per_second"] / out["replicas_1"]["requests_per_second"],
                           3)
    return out


def _settle(url: str, limit: float = 300.0) -> None:
    """Until two replicas in a row report no shadow waiting and no event unsent (the killed one's
    replacement included)."""
    import httpx

    quiet, deadline = set(), time.monotonic() + limit
    while len(quiet) < REPLICAS and time.monotonic() < deadline:
        resp = httpx.get(url + "/health", timeout=30)
        h = resp.json()
        if h["queue"]["shadow_pending"] or h["monitor"]["all"]["monitor_buffered"] or h["kv"]["requests_in_flight"]:
            quiet.clear()
            time.sleep(0.5)
        else:
            quiet.add(resp.headers["x-certkv-replica"])


def kill_part(requests) -> dict:
    import ray
    from ray import serve

    from certkv.core.operating_point import load_operating_point
    from certkv.serve.shadow_store import ShadowStore
    from certkv.serve.shared_monitor import NAMESPACE, monitor_actor_name

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            url = _deploy(folder, REPLICAS, 1.0)
            _load(url, requests[:CLIENTS * 2])
            op = load_operating_point(folder / "operating_point.json")
            monitor = ray.get_actor(monitor_actor_name(op), namespace=NAMESPACE)
            names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
            victim = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
            at = len(requests) // 3

            def on_done(k: int) -> None:
                if k == at:
                    ray.kill(victim, no_restart=True)

            statuses, wall = _load(url, requests, on_done)
            _settle(url)
            state = ray.get(monitor.snapshot.remote())["all"]
            with ShadowStore(folder / "shadow", op) as store:
                stored = store.count()
            applied = state["shadowed"] - state["pending"] - state["abandoned"]
            out = {"requests": len(statuses), "killed_after_answers": at, "concurrent_clients": CLIENTS,
                   "ok": statuses.count(200), "failed_by_status": {str(c): statuses.count(c) for c in set(statuses)
                                                                  if c != 200},
                   "monitor_requests": state["requests"], "shadows_drawn": state["shadowed"],
                   "verdicts_applied": applied, "records_stored": stored, "lost_records": applied - stored,
                   "pending_for_good": state["pending"], "abandoned": state["abandoned"],
                   "wall_seconds": round(wall, 2)}
            print(out, flush=True)
            return out
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--part", choices=("monitor", "throughput", "kill"), help="run one part and print it")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from certkv.requests.request_set import generate_requests

    requests = generate_requests("demo", n=N_LOAD, seed=SEED, context_length=(200, 320))
    parts = {"monitor": monitor_part, "throughput": lambda: throughput_part(requests),
             "kill": lambda: kill_part(requests)}
    if args.part:
        print(json.dumps(parts[args.part](), indent=1))
        return
    import ray
    import torch

    result = {name: run() for name, run in parts.items()}
    result["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "ray": ray.__version__,
                         "python": platform.python_version(), "threads_per_replica": 1, "model": "embedded",
                         "device": "cpu"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replicas.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
