"""Calibration on Ray: 1 and 2 workers against the local executor, the driver's write cost, kills.

One run, side by side on the same requests (the first N of the demo request file, the demo
contract's candidates, the embedded model on CPU, every worker and the local run on one torch
thread, so that all records are bit-for-bit comparable):

- ``local``: ``certkv calibrate`` with the local executor (the reference records);
- ``ray_1``, ``ray_2``: ``--executor ray --workers 1|2`` on a local Ray instance (``ray.init(num_cpus=2)``);
- ``faults``: ``--workers 2`` with a worker's process SIGKILLed at three instants (after a quarter,
  half and three quarters of the requests are written); Ray restarts it and runs its requests again.

Rates are requests written per second between the 10% and the 90% write (the steady state: worker
start-up and the last requests' tail left out); wall times include starting the workers. The
scaling efficiency is rate(ray_2) / (2 · rate(ray_1)). The driver's write cost is the time it
spends in the store's transactions (``store.write_request``, fsync included) per request; its CPU
per request (everything the driver does, Ray's bookkeeping included) bounds the rate one driver
can sustain (measured between the same 10% and 90% writes). The machine's other load is measured
per phase: CPU used on the machine outside this process tree (``/proc``), and ``os.getloadavg()``.

    python benchmarks/ray_scaling.py             # 300 requests; writes benchmarks/results/ray_scaling.json
    python benchmarks/ray_scaling.py --quick     # 40 requests, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DEMO = Path(__file__).resolve().parents[1] / "certkv" / "demo" / "demo.yaml"
VOLATILE = {"seconds", "seconds_breakdown"}
TICK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- machine load


def _busy_seconds() -> float:
    """CPU-seconds the whole machine has been busy (``/proc/stat``: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


def _tree_cpu() -> dict[int, float]:
    """CPU-seconds of this process and all its descendants (the Ray instance and its workers), by pid."""
    parent, cpu = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / TICK
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and child not in mine:
                mine.add(child)
                frontier.append(child)
    return {p: cpu[p] for p in mine if p in cpu}


class LoadMeter:
    """Samples this process tree's CPU every half second (so killed workers still count) and the
    machine's busy time: their difference over a phase is the other processes' load."""

    def __init__(self):
        self._last: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.5):
            self.sample()

    def sample(self):
        now = _tree_cpu()
        with self._lock:
            self._last.update(now)

    def mark(self) -> tuple[float, float, dict[int, float]]:
        self.sample()
        with self._lock:
            return time.perf_counter(), _busy_seconds(), dict(self._last)

    def since(self, mark) -> dict:
        t0, busy0, tree0 = mark
        t1, busy1, tree1 = self.mark()
        wall = t1 - t0
        ours = sum(v - tree0.get(p, 0.0) for p, v in tree1.items())
        return {"others_cores": round(max(0.0, busy1 - busy0 - ours) / wall, 3), "ours_cores": round(ours / wall, 3),
                "loadavg_1min": round(os.getloadavg()[0], 2)}

    def close(self):
        self._stop.set()


# ----------------------------------------------------------------------------- phases


def _records(store: Path) -> list[dict]:
    from certkv.calibration.store import CalibrationStore

    with CalibrationStore.read(store) as s:
        rows = [{k: v for k, v in r.items() if k not in VOLATILE} for r in s.records()]
    return sorted(rows, key=lambda r: (r["request_id"], r["policy"]))


def _steady(stamps: list[float]) -> tuple[int, int]:
    """The indices of the 10% and the 90% write (the steady state)."""
    n = len(stamps)
    return int(0.1 * n), max(int(0.9 * n) - 1, int(0.1 * n) + 1)


def _steady_rate(stamps: list[float]) -> float:
    """Requests per second between the 10% and the 90% write."""
    lo, hi = _steady(stamps)
    return (hi - lo) / (stamps[hi] - stamps[lo])


def phase(name: str, contract, n: int, workdir: Path, meter: LoadMeter, executor: str = "local", workers: int = 0,
          kill_after: tuple[int, ...] = ()) -> dict:
    from certkv.calibration.ray_executor import WORKER_NAME, RayExecutor, RayOptions
    from certkv.calibration.run import calibrate

    store = workdir / name
    contract = contract.model_copy(update={"store": str(store)})
    stamps: list[float] = []
    cpu_stamps: list[float] = []
    kills: list[dict] = []

    def written(summary, request_id):  # the run's on_written hook: after each request's write
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.process_time())
        if len(stamps) in kill_after:  # SIGKILL a worker's process: a crash, not a polite stop
            import ray

            names = sorted(x for x in ray.util.list_named_actors() if x.startswith(WORKER_NAME))
            actor = ray.get_actor(names[len(kills) % len(names)])
            pid = ray.get(actor.ping.remote())
            os.kill(pid, signal.SIGKILL)
            kills.append({"after_writes": len(stamps), "pid": pid})

    mark = meter.mark()
    t0 = time.perf_counter()
    runner = RayExecutor(RayOptions(workers=workers)) if executor == "ray" else None
    summary = calibrate(contract, executor=runner, limit=n, quiet=True, on_written=written)
    wall = time.perf_counter() - t0
    load = meter.since(mark)
    assert summary.calibrated + len(summary.skipped) == n, summary
    out = {
        "executor": executor, "workers": workers, "requests": n,
        "requests_per_second": round(_steady_rate(stamps), 3),
        "requests_per_second_all": round((n - 1) / (stamps[-1] - stamps[0]), 3),
        "wall_seconds": round(wall, 2),
        "write_ms_per_request": round(1000 * summary.write_seconds / n, 3),
        "worker_restarts": summary.worker_restarts,
        **load,
    }
    if executor == "ray":  # the driver's CPU per request in the steady state (start-up costs left out)
        lo, hi = _steady(cpu_stamps)
        out["driver_cpu_ms_per_request"] = round(1000 * (cpu_stamps[hi] - cpu_stamps[lo]) / (hi - lo), 3)
    if kill_after:
        out["kills"] = kills
    if executor == "local":  # one request's time, one thread (write included): the length skew
        import statistics

        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
        out["request_seconds"] = {"mean": round(statistics.fmean(gaps), 4), "median": round(statistics.median(gaps), 4),
                                  "p90": round(gaps[int(0.9 * len(gaps))], 4), "max": round(gaps[-1], 4)}
    return out, _records(store)


def compare(records: list[dict], reference: list[dict], n: int) -> dict:
    keys = [(r["request_id"], r["policy"]) for r in records]
    ref = {(r["request_id"], r["policy"]): r for r in reference}
    requests = {r["request_id"] for r in records}
    return {
        "lost": n - len(requests),
        "duplicated": len(keys) - len(set(keys)),
        "rows_differing": sum(1 for r in records if ref.get((r["request_id"], r["policy"])) != r),
        "equal_to_local": records == reference,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="40 requests, nothing written")
    args = p.parse_args()
    n = 40 if args.quick else args.requests
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    import torch

    from certkv.contract.loading import load_contract
    from certkv.contract.spec import candidates

    torch.set_num_threads(1)  # the local run on one thread, as each worker
    contract = load_contract(DEMO)
    meter = LoadMeter()
    loadavg_start = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="certkv-ray-"))
    try:
        phases = {}
        phases["local"], reference = phase("local", contract, n, workdir, meter)
        t = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        ray_start = time.perf_counter() - t
        checks = {}
        for workers in (1, 2):
            name = f"ray_{workers}"
            phases[name], records = phase(name, contract, n, workdir, meter, "ray", workers)
            checks[name] = compare(records, reference, n)
        kill_after = (n // 4, n // 2, 3 * n // 4)
        faults, records = phase("faults", contract, n, workdir, meter, "ray", 2, kill_after)
        faults.update(compare(records, reference, n))
        ray.shutdown()
    finally:
        meter.close()
        shutil.rmtree(workdir, ignore_errors=True)
    r1, r2, rl = (phases[k]["requests_per_second"] for k in ("ray_1", "ray_2", "local"))
    driver_cpu = phases["ray_2"]["driver_cpu_ms_per_request"]
    others = max(ph["others_cores"] for ph in [*phases.values(), faults])
    results = {
        "requests": n,
        "contract": f"demo (certkv/demo/demo.yaml): its {len(candidates(contract))} candidates, the first requests of "
        "demo.jsonl",
        "candidates": len(candidates(contract)),
        "model": contract.model,
        "device": "cpu",
        "threads_per_worker": 1,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "python": platform.python_version(),
        "ray_start_seconds": round(ray_start, 2),
        "phases": phases,
        "records_equal_to_local": {k: v["equal_to_local"] for k, v in checks.items()},
        "ray_1_over_local": round(r1 / rl, 3),
        "scaling_efficiency": round(r2 / (2 * r1), 3),
        "driver": {
            "write_ms_per_request": phases["ray_2"]["write_ms_per_request"],
            "cpu_ms_per_request": driver_cpu,
            "max_requests_per_second": round(1000 / driver_cpu, 1),
        },
        "faults": faults,
        "machine": {
            "loadavg_at_start": [round(x, 2) for x in loadavg_start],
            "others_cores_max": others,
            # other processes' CPU measured per phase; the load average also counts this script's own
            # previous phases and runs, so it is recorded but does not decide
            "shared": others > 0.2,
        },
    }
    print(f"{'phase':8} {'req/s':>8} {'req/s all':>10} {'wall s':>8} {'write ms':>9} {'driver cpu ms':>14} {'others':>7}")
    for name, ph in [*phases.items(), ("faults", faults)]:
        print(f"{name:8} {ph['requests_per_second']:8.2f} {ph['requests_per_second_all']:10.2f} {ph['wall_seconds']:8.1f} "
              f"{ph['write_ms_per_request']:9.2f} {ph.get('driver_cpu_ms_per_request', float('nan')):14.2f} "
              f"{ph['others_cores']:7.2f}")
    print(f"scaling efficiency rate(2)/(2·rate(1)) = {results['scaling_efficiency']:.3f}; ray_1/local = "
          f"{results['ray_1_over_local']:.3f}; records equal to local: {results['records_equal_to_local']}")
    print(f"faults: kills {[k['after_writes'] for k in faults['kills']]}, lost {faults['lost']}, duplicated "
          f"{faults['duplicated']}, equal to local {faults['equal_to_local']}, restarts {faults['worker_restarts']}")
    print(f"machine shared: {results['machine']['shared']} (others' cores up to {others}, loadavg {loadavg_start})")
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "ray_scaling.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {RESULTS / 'ray_scaling.json'}")


if __name__ == "__main__":
    main()
