"""Capacity under a KV budget: does an operating point that keeps less KV serve more requests?

The same traffic goes, closed loop at concurrency 32 through the official ``openai`` client, to a
real ``certkv serve`` process under the same tight ``--kv-budget``, once per operating point:

* ``full``: the full-cache fallback (every request holds its whole prefill while it decodes);
* ``half``: SnapKV keeping half the cache, ungated (query-aware, as the demo is calibrated);
* ``demo``: the demo's certified stratified point (``certkv demo`` writes it), gates and all.

Traffic: fresh requests of the demo mix (``generate_requests("demo", seed=...)`` with a seed the
demo's calibration file does not use), contexts of 256-512 tokens. The budgets are ``--budget-shares`` (default 2 and 1)
times the KV the largest of them reserves while it prefills: at 2 the full-cache point fits about
two requests at once and a half-cache point about twice as many while they decode.
Shadows run as deployed (``--shadow-rate 0.05``, the default: the monitor cannot be switched off):
an evicted point re-answers 5% of its answers from the full cache at shadow priority, the full-cache
point has nothing to shadow. Under a saturating load most shadows wait until the live load stops;
between passes the benchmark waits for every server to be idle, outside the timed window (so that no
server's backlog runs beside another's pass), and reports how many jobs each pass left behind.
Every configuration has its own server, up for the whole run; passes go round robin.

Each point also runs with no budget at all (memory unlimited). The
unlimited run is the machine's own ceiling for that point: when the budgeted throughput is close to
it, memory is not what binds, the processor is; the server's CPU seconds per wall second say how
busy it was (2 cores here, one of them the client's).

Targets (issue 29): half ÷ full ≥ 0.8 × (1 / 0.5) = 1.6; demo ÷ full ≥ 0.8 / (its mean KV
retained). Writes ``benchmarks/results/capacity.json`` and prints a table::

    python benchmarks/capacity.py                  # ~5-6 minutes on 2 CPU cores
    python benchmarks/capacity.py --requests 200   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import DEMO_POINT, REPO, free_port, percentile, wait_healthy  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "capacity.json"
SHADOW_RATE = 0.05


def fixed_point(kv: float, *, query_aware: bool, max_new_tokens: int, press: str = "snapkv",
                press_kwargs: dict | None = None, label: str | None = None, risk: float = 0.05):
    """An ungated `press` point at `kv` (kv = 1.0: the full-cache fallback), outside any certificate:
    the benchmark compares memory, not risk (`risk` is the ε the live monitor holds it to)."""
    from certkv.core.operating_point import ContractSummary, OperatingPoint

    full = kv >= 1.0
    policy = "full" if full else f"{label or press}@{kv:.2f}"
    return OperatingPoint(
        policy=policy, base_policy=policy, press="full" if full else press, press_kwargs=press_kwargs or {},
        kv_retained=kv, mean_kv_retained=kv,
        fallback=full, reason="benchmark: the full cache" if full else None, query_aware=query_aware,
        contract=ContractSummary(tolerance=0.0, risk=risk, confidence=0.95, procedure="fixed_sequence",
                                 utility="exact_match"),
        n=0, violations=0, empirical_risk=0.0, risk_upper_bound=0.0, p_value=None, candidates=[], sequences=[],
        guarantee="none: a benchmark's fixed point", created="benchmark", certkv_version="benchmark",
        max_new_tokens=max_new_tokens,
    )


def largest_reservation(requests, max_new_tokens: int, model_name: str = "embedded") -> int:
    """The KV slots the largest of `requests` reserves for its full-cache prefill on `model_name`
    (:func:`certkv.runtime.full_path.prefill_slots`): the unit the budgets are given in."""
    from certkv.model.generation import encode_request
    from certkv.model.loading import load_model
    from certkv.runtime.full_path import prefill_slots

    model, tok = load_model(model_name, device="cpu")
    return max(prefill_slots(model, encode_request(tok, r.context, r.question, r.answer_prefix), max_new_tokens)
               for r in requests)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def closed_loop(base: str, requests, concurrency: int, model: str = "embedded") -> tuple[list[dict], float]:
    """`concurrency` clients, each sending its next request as soon as its last is answered."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    todo = iter(requests)
    rows: list[dict] = []

    async def worker():
        for r in todo:
            t = time.perf_counter()
            try:
                out = await client.completions.create(model=model, prompt="", extra_body={
                    "context": r.context, "question": r.question, "stratum": r.task})
                extra = out.model_extra["certkv"]
                rows.append({"id": r.id, "status": 200, "seconds": time.perf_counter() - t, "decision": extra["decision"],
                             "tokens": out.usage.completion_tokens, "answer": out.choices[0].text})
            except openai.APIStatusError as exc:
                rows.append({"id": r.id, "status": exc.status_code, "seconds": time.perf_counter() - t})

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    await client.close()
    return rows, seconds


def measure_round_robin(starts: dict, requests, args, work: Path) -> tuple[dict, dict]:
    """Start a server per entry of `starts` (key → a function that starts it), warm each, measure
    them round robin ``args.repeats`` times (a slow spell of the machine hits every run alike) and
    stop them all, whatever fails; (servers, their final /health KV). Exits when one went silent."""
    servers: dict = {}
    try:
        for key, start in starts.items():
            servers[key] = start()
        for server in servers.values():
            server.warm(requests)
        for _ in range(args.repeats):
            for server in servers.values():
                server.measure(requests, args.concurrency)
    finally:
        health = {key: server.stop() for key, server in servers.items()}
    silent = [f"{name} at {key}" for (name, key), kv in health.items() if kv is None]
    if silent:
        sys.exit(f"no /health answer at the end from: {', '.join(silent)} (see its server.log under {work})")
    return servers, health


class Server:
    """One `certkv serve` process on `op_path` under `budget` slots (None: unlimited), kept up for every repeat."""

    def __init__(self, name: str, op_path: Path, budget: int | None, concurrency: int, work: Path,
                 model: str = "embedded", extra: tuple[str, ...] = ()) -> None:
        self.port, self.model = free_port(), model
        self.base = f"http://127.0.0.1:{self.port}"
        self.budget = budget
        folder = work / f"{name}-{budget or 'unlimited'}{''.join(extra).replace('-', '_')}"
        folder.mkdir()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-m", "certkv.cli.app", "serve", str(op_path), "--port", str(self.port),
               "--device", "cpu", "--shadow-rate", str(SHADOW_RATE), "--shadow-store", str(folder / "shadows"),
               "--max-queue", str(4 * concurrency), "--timeout", "300", "--seed", "0", "--model", model]
        if budget is not None:
            cmd += ["--kv-budget", str(budget)]
        cmd += list(extra)  # after the defaults: the last value of a flag wins
        self.log = open(folder / "server.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.repeats: list[dict] = []

    def warm(self, requests) -> None:
        wait_healthy(self.base, self.proc)
        asyncio.run(closed_loop(self.base, requests[:8], 4, self.model))  # first forwards allocate: not counted
        self.settle()

    def measure(self, requests, concurrency: int) -> None:
        """One closed-loop pass of `requests`, with the server's and this client's CPU seconds over it."""
        cpu0, client0 = cpu_seconds(self.proc.pid), time.process_time()
        rows, seconds = asyncio.run(closed_loop(self.base, requests, concurrency, self.model))
        server_cpu, client_cpu = cpu_seconds(self.proc.pid) - cpu0, time.process_time() - client0
        self.repeats.append({"rows": rows, "seconds": seconds, "server_cpu": server_cpu, "client_cpu": client_cpu,
                             "shadows_left": self.settle()})

    def settle(self, timeout: float = 600.0) -> int:
        """Wait until the server has nothing in flight or waiting (the shadows a pass left behind run at
        shadow priority once the live load stops), so that no other run's work overlaps the next pass;
        returns how many jobs were left when the pass ended."""
        import httpx

        left, t0 = None, time.monotonic()
        while time.monotonic() - t0 < timeout:
            kv = httpx.get(self.base + "/health", timeout=10).json()["kv"]
            busy = kv["requests_in_flight"] + kv["admissions_waiting"]
            left = busy if left is None else left
            if busy == 0:
                return left
            time.sleep(0.2)
        raise RuntimeError(f"{self.base} still busy after {timeout:g} s")

    def stop(self) -> dict | None:
        """/health's KV block (None when the server no longer answers), then SIGTERM; the exit code is recorded."""
        import httpx

        try:
            kv = httpx.get(self.base + "/health", timeout=10).json()["kv"]
        except httpx.HTTPError:
            kv = None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        return None if kv is None else {**kv, "exit_code": self.proc.returncode}

    def summary(self, kv: dict) -> dict:
        """Throughput: the median repeat's (each listed); latency percentiles over every repeat's answers."""
        rows = [r for rep in self.repeats for r in rep["rows"]]
        ok = [r for r in rows if r["status"] == 200]
        lat = [r["seconds"] for r in ok]
        modes: dict[str, int] = {}
        for r in ok:
            key = r["decision"]["mode"] if r["decision"]["reason"] is None else f"full:{r['decision']['reason']}"
            modes[key] = modes.get(key, 0) + 1
        each = [sum(r["status"] == 200 for r in rep["rows"]) / rep["seconds"] for rep in self.repeats]
        wall = sum(rep["seconds"] for rep in self.repeats)
        answers = [{r["id"]: r["answer"] for r in rep["rows"] if r["status"] == 200} for rep in self.repeats]
        return {
            "budget": self.budget, "requests": len(rows), "answered": len(ok),
            "status": {str(s): sum(1 for r in rows if r["status"] == s) for s in sorted({r["status"] for r in rows})},
            "throughput_rps": statistics.median(each), "throughput_each_rps": each,
            "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
            "mean_kv_retained": statistics.fmean(r["decision"]["kv_retained_actual"] for r in ok) if ok else None,
            "decisions": dict(sorted(modes.items())),
            "kv_peak": kv["peak"], "max_batch": kv["max_batch"], "decode_steps": kv["decode_steps"],
            "given_back": kv.get("given_back", 0.0),
            "tokens_per_decode_step": (sum(r["tokens"] for r in ok) / kv["decode_steps"]) if kv["decode_steps"] else None,
            "server_cpu_per_wall_s": sum(rep["server_cpu"] for rep in self.repeats) / wall,
            "client_cpu_per_wall_s": sum(rep["client_cpu"] for rep in self.repeats) / wall,
            "shadows_left_per_pass": [rep["shadows_left"] for rep in self.repeats],
            "server_exit_code": kv["exit_code"],
            "answers": answers[0] if all(a == answers[0] for a in answers) else None,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo-point", type=Path, default=DEMO_POINT, help="what `certkv demo` wrote")
    parser.add_argument("--requests", type=int, default=480, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--budget-shares", type=float, nargs="+", default=[2.0, 1.0],
                        help="budgets, in multiples of the largest request's full prefill reservation; the first is "
                             "the one the targets are read at")
    parser.add_argument("--repeats", type=int, default=3, help="closed-loop passes per run (median throughput)")
    parser.add_argument("--seed", type=int, default=2929, help="seeds the fresh requests (the demo's file used 1)")
    parser.add_argument("--output", type=Path, default=RESULT)
    args = parser.parse_args()

    from certkv.core.operating_point import load_operating_point
    from certkv.requests.request_set import generate_requests

    if not args.demo_point.is_file():
        sys.exit(f"{args.demo_point} not found: run `certkv demo` first (it writes the demo's operating point)")
    demo = load_operating_point(args.demo_point)
    requests = generate_requests("demo", n=args.requests, seed=args.seed, context_length=(256, 512))
    work = Path(tempfile.mkdtemp(prefix="capacity_"))
    decode = demo.max_new_tokens or 8
    points = {"full": fixed_point(1.0, query_aware=demo.query_aware, max_new_tokens=decode),
              "half": fixed_point(0.5, query_aware=demo.query_aware, max_new_tokens=decode), "demo": demo}
    paths = {name: op.write_json(work / f"{name}.json") for name, op in points.items()}
    largest = largest_reservation(requests, decode)
    budgets: dict[str, int | None] = {f"{share:g}": round(share * largest) for share in args.budget_shares}
    t_start = time.perf_counter()
    budgets["unlimited"] = None
    starts = {(name, key): (lambda name=name, path=path, slots=slots: Server(name, path, slots, args.concurrency, work))
              for name, path in paths.items() for key, slots in budgets.items()}
    servers, health = measure_round_robin(starts, requests, args, work)
    runs: dict[str, dict] = {}
    for name in paths:
        runs[name] = {"policy": points[name].policy, "certified_mean_kv_retained": points[name].mean_kv_retained,
                      "runs": {key: servers[name, key].summary(health[name, key]) for key in budgets}}
        answers = [r.pop("answers") for r in runs[name]["runs"].values()]
        # a budget changes when a request runs, never what it answers
        runs[name]["answers_equal_across_budgets"] = answers[0] is not None and all(a == answers[0] for a in answers)
    ratios: dict[str, dict] = {}
    for name in ("half", "demo"):
        kv = runs[name]["certified_mean_kv_retained"]
        ratios[name] = {"target": 0.8 / kv, "mean_kv_retained": kv, "over_full": {
            key: runs[name]["runs"][key]["throughput_rps"] / runs["full"]["runs"][key]["throughput_rps"]
            for key in runs[name]["runs"]}}
    result = {
        "benchmark": "capacity",
        "command": "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "traffic": {"mix": "demo", "seed": args.seed, "context_length": [256, 512], "requests": len(requests),
                    "concurrency": args.concurrency, "shadow_rate": SHADOW_RATE},
        "budgets": {"largest_prefill_reservation": largest, "slots": budgets, "target_at": f"{args.budget_shares[0]:g}"},
        "points": runs, "ratios": ratios, "wall_seconds": time.perf_counter() - t_start,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"capacity at concurrency {args.concurrency}, {len(requests)} fresh demo-mix requests of 256-512 tokens; "
          f"the largest reserves {largest} KV slots for its prefill")
    print(f"{'point':<7}{'budget':<16}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'KV kept':>9}{'peak':>7}{'batch':>7}"
          f"{'srv cpu':>9}")
    for name, run in runs.items():
        for key, r in run["runs"].items():
            label = key if budgets[key] is None else f"{key}x = {budgets[key]}"
            print(f"{name:<7}{label:<16}{r['throughput_rps']:>8.1f}{r['latency_p50_s'] * 1e3:>9.0f}"
                  f"{r['latency_p99_s'] * 1e3:>9.0f}{r['mean_kv_retained']:>9.2f}{r['kv_peak']:>7.0f}"
                  f"{r['max_batch']:>7}{r['server_cpu_per_wall_s']:>9.2f}")
    for name, ratio in ratios.items():
        shown = ", ".join(f"{key}: {value:.2f}x" for key, value in ratio["over_full"].items())
        print(f"{name} / full throughput ({shown}); target >= {ratio['target']:.2f}x at {args.budget_shares[0]:g}x")
    print(f"wrote {args.output} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
