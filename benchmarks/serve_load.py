"""Load test of `certkv serve`: robustness under concurrency, latency, and the cost of HTTP.

Starts ``certkv serve`` (a real server process, loopback, a free port) with an operating point for
the embedded model (default: the demo's stratified point, read only), then:

1. **load**: N requests (default 2,000) at concurrency 32 with an httpx AsyncClient, drawn from the
   demo requests (``certkv/demo/demo.jsonl``) with their task as stratum, 5% of them malformed, one
   fifth of those of each kind: bad JSON, a missing field (no question), a wrong type (question a
   number), an oversized body (over ``--max-body-bytes``) and no context. Reported: the status
   counts of valid and of malformed requests (valid must see no 5xx, malformed only 4xx), p50/p99
   latency of the valid ones and the throughput;
2. **concurrency 1**: the same M requests one at a time over HTTP (one keep-alive connection of
   a sequential ``httpx.Client``: what a one-at-a-time caller uses) and with
   ``CertifiedRuntime.generate`` on the same model and point (in a process of its own, as the
   server is: see :class:`InProcess`), in alternating passes
   (``--passes``, the server idle before each: its pending shadows are waited for), so that the
   machine's drift falls on both alike; the ratio is the median HTTP throughput over the median
   in-process throughput (target ≥ 0.9). Each pass also goes over HTTP to a second server on the
   same point run with ``--shadow-rate 0``: the HTTP path's own cost, told apart from the shadows
   the first server runs between requests (in-process runs none). One more pass through the official ``openai`` client
   (sequential, synchronous) is reported beside them: its own parsing costs the same cores.

With ``--kv-budget SLOTS`` the server runs under that KV budget (``certkv serve --kv-budget``) and
the result reports the peak KV in use it sampled, which must stay within it.

Writes ``benchmarks/results/serve_load.json`` and prints a table::

    python benchmarks/serve_load.py --kv-budget 1608     # ~1 minute on 2 CPU cores
    python benchmarks/serve_load.py --requests 200 --sequential 30   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from endpoint_servers import free_port  # benchmarks/endpoint_servers.py; capacity and streaming import it from here

REPO = Path(__file__).resolve().parents[1]
DEMO_REQUESTS = REPO / "certkv" / "demo" / "demo.jsonl"
DEMO_POINT = Path("certkv-demo/runs/demo/operating_point.json")  # what `certkv demo` writes
RESULT = REPO / "benchmarks" / "results" / "serve_load.json"
MALFORMED_KINDS = ("bad_json", "missing_field", "wrong_type", "oversized", "no_context")
MAX_BODY = 64 * 1024


def load_requests(n: int, seed: int) -> list[dict]:
    rows = [json.loads(line) for line in DEMO_REQUESTS.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    return [rng.choice(rows) for _ in range(n)]


def valid_body(req: dict) -> bytes:
    return json.dumps({"model": "embedded", "context": req["context"], "question": req["question"],
                       "stratum": req["task"], "answers": req["answers"]}).encode()


def malformed_body(kind: str, req: dict) -> bytes:
    if kind == "bad_json":
        return b'{"context": "' + req["context"][:200].encode() + b'", "question": '
    if kind == "missing_field":
        return json.dumps({"context": req["context"], "stratum": req["task"]}).encode()
    if kind == "wrong_type":
        return json.dumps({"context": req["context"], "question": 42, "stratum": req["task"]}).encode()
    if kind == "oversized":
        return json.dumps({"context": req["context"] * (MAX_BODY // max(1, len(req["context"])) + 2),
                           "question": req["question"], "stratum": req["task"]}).encode()
    if kind == "no_context":
        return json.dumps({"question": req["question"], "stratum": req["task"]}).encode()
    raise ValueError(kind)


def plan(n: int, malformed_share: float, seed: int) -> list[tuple[str, bytes, dict]]:
    """(kind, body, request) per request: 'valid' or a malformed kind, shuffled."""
    reqs = load_requests(n, seed)
    n_bad = round(n * malformed_share)
    kinds = [MALFORMED_KINDS[i % len(MALFORMED_KINDS)] for i in range(n_bad)] + ["valid"] * (n - n_bad)
    random.Random(seed + 1).shuffle(kinds)
    return [(k, valid_body(r) if k == "valid" else malformed_body(k, r), r) for k, r in zip(kinds, reqs)]


def start_server(op: Path, port: int, store: Path, args, shadow_rate: float | None = None) -> subprocess.Popen:
    """`certkv serve` on `op` (`shadow_rate`: None, the command line's ``--shadow-rate``)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    rate = args.shadow_rate if shadow_rate is None else shadow_rate
    cmd = [sys.executable, "-m", "certkv.cli.app", "serve", str(op), "--port", str(port), "--device", "cpu",
           "--shadow-rate", str(rate), "--shadow-store", str(store), "--max-queue", "64",
           "--max-body-bytes", str(MAX_BODY), "--timeout", "120", "--seed", "0"]
    if args.kv_budget is not None:
        cmd += ["--kv-budget", str(args.kv_budget)]
    log = open(store.parent / f"server-{rate:g}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 180.0) -> dict:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            r = httpx.get(f"{base}/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not become healthy in time")


def wait_shadows(base: str, timeout: float = 300.0) -> dict:
    """Wait until the server has no pending shadow (so it is idle), return /health."""
    import httpx

    t0 = time.monotonic()
    while True:
        h = httpx.get(f"{base}/health", timeout=5).json()
        if h["queue"]["shadow_pending"] == 0 and h["queue"]["depth"] == 0 or time.monotonic() - t0 > timeout:
            return h
        time.sleep(0.2)


async def fire(base: str, items, concurrency: int) -> tuple[list[dict], float]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    out: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:

        async def one(kind, body):
            async with sem:
                t = time.perf_counter()
                try:
                    r = await client.post("/v1/completions", content=body,
                                          headers={"content-type": "application/json"})
                    status, payload = r.status_code, None
                    if status == 200:
                        payload = r.json().get("certkv", {})
                except httpx.HTTPError as exc:
                    status, payload = f"error:{type(exc).__name__}", None
                out.append({"kind": kind, "status": status, "seconds": time.perf_counter() - t,
                            "certkv": payload})

        t0 = time.perf_counter()
        await asyncio.gather(*(one(kind, body) for kind, body, _ in items))
        return out, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def status_counts(rows, kind=None) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        if kind is None or r["kind"] == kind:
            counts[str(r["status"])] = counts.get(str(r["status"]), 0) + 1
    return dict(sorted(counts.items()))


class InProcess:
    """``CertifiedRuntime.generate`` on the embedded model and `op`, in a child process of its own.

    Each side runs in a process of its own, the runtime here as the server's runtime in its
    process, so the client process that times the HTTP passes never runs torch forwards (whose
    thread pool would share its cores). Measured here, moving the runtime out of the client's
    process did not change the ratio beyond the run-to-run noise (0.808 against 0.807)."""

    def __init__(self, op: Path, warm: dict) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_in_process_worker, args=(child, str(op), warm), daemon=True)
        self._proc.start()
        child.close()  # the child's end lives in the child alone: its death is an EOF here, not a hang
        self._conn.recv()  # loaded and warmed up

    def run(self, requests: list[dict]) -> tuple[list[float], float, list[str]]:
        """Latencies, total seconds and answers of `requests` answered one at a time."""
        self._conn.send(requests)
        return self._conn.recv()

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass  # the child is gone already
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.terminate()


def _in_process_worker(conn, op: str, warm: dict) -> None:
    from certkv.model.loading import load_model
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tok = load_model("embedded", device="cpu")
    runtime = CertifiedRuntime(model, tok, op)
    runtime.generate(warm["context"], warm["question"], warm["task"])
    conn.send("ready")
    while (requests := conn.recv()) is not None:
        lat, answers = [], []
        t0 = time.perf_counter()
        for r in requests:
            t = time.perf_counter()
            answers.append(runtime.generate(r["context"], r["question"], r["task"]).answer)
            lat.append(time.perf_counter() - t)
        conn.send((lat, time.perf_counter() - t0, answers))


def sequential_http(base: str, items) -> tuple[list[float], float, list[dict], list[str]]:
    """`items` one at a time over one keep-alive connection: latencies, total seconds, a row per
    request (its kind and status, for :func:`status_counts`), answers."""
    import httpx

    lat, answers, rows = [], [], []
    with httpx.Client(base_url=base, timeout=120) as client:
        t0 = time.perf_counter()
        for kind, body, _ in items:
            t = time.perf_counter()
            r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            lat.append(time.perf_counter() - t)
            rows.append({"kind": kind, "status": r.status_code})
            answers.append(r.json()["choices"][0]["text"] if r.status_code == 200 else "")
        return lat, time.perf_counter() - t0, rows, answers


def sequential_openai(base: str, requests: list[dict]) -> float:
    """`requests` one at a time through the official openai client; total seconds."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    t0 = time.perf_counter()
    for r in requests:
        client.completions.create(model="embedded", prompt="", extra_body={
            "context": r["context"], "question": r["question"], "stratum": r["task"], "answers": r["answers"]})
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--operating-point", type=Path, default=DEMO_POINT)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kv-budget", type=int, default=None, help="the server's --kv-budget (token slots)")
    parser.add_argument("--malformed", type=float, default=0.05)
    parser.add_argument("--sequential", type=int, default=150, help="requests of the concurrency-1 comparison")
    parser.add_argument("--passes", type=int, default=3, help="alternating HTTP / in-process passes at concurrency 1")
    parser.add_argument("--shadow-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--output", type=Path, default=RESULT)
    args = parser.parse_args()
    if args.passes < 1 or args.sequential < 1:
        parser.error("--passes and --sequential must be at least 1")

    import httpx

    work = Path(tempfile.mkdtemp(prefix="serve_load_"))
    op = work / "operating_point.json"
    op.write_text(args.operating_point.read_text())  # a copy: the source stays read-only
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t_start = time.perf_counter()
    proc = start_server(op, port, work / "shadows", args)
    # the same point without shadows (--shadow-rate 0): the concurrency-1 passes run on it too, so
    # that the HTTP path's own cost is told apart from the shadows' (in-process runs none)
    port0 = free_port()
    base0 = f"http://127.0.0.1:{port0}"
    proc0 = start_server(op, port0, work / "no_shadows", args, shadow_rate=0.0)
    try:
        health = wait_healthy(base, proc)
        wait_healthy(base0, proc0)
        items = plan(args.requests, args.malformed, args.seed)
        # warm the server (first forwards allocate), not counted
        asyncio.run(fire(base, [i for i in items if i[0] == "valid"][:4], 1))
        rows, load_seconds = asyncio.run(fire(base, items, args.concurrency))
        after_load = wait_shadows(base)
        seq_reqs = [r for k, _, r in plan(args.sequential, 0.0, args.seed + 7)]
        seq_items = [("valid", valid_body(r), r) for r in seq_reqs]
        sequential_http(base, seq_items[:4])  # warm the server's sequential path, not counted
        sequential_http(base0, seq_items[:4])
        http_passes, plain_passes, inproc_passes, seq_rows = [], [], [], []
        http_lat, lat_in, answers_equal = [], [], True
        local = InProcess(op, seq_reqs[0])
        try:
            for _ in range(args.passes):  # each pass starts with the server idle: no shadow left to run
                wait_shadows(base)
                lat, seconds, rows_http, answers_http = sequential_http(base, seq_items)
                http_passes.append(seconds)
                http_lat += lat
                seq_rows += rows_http
                wait_shadows(base)
                _, seconds, _, answers_plain = sequential_http(base0, seq_items)
                plain_passes.append(seconds)
                answers_equal = answers_equal and answers_plain == answers_http
                lat, seconds, answers_in = local.run(seq_reqs)
                inproc_passes.append(seconds)
                lat_in += lat
                answers_equal = answers_equal and answers_http == answers_in
        finally:
            local.close()
        wait_shadows(base)
        openai_seconds = sequential_openai(base, seq_reqs)
        after_seq = wait_shadows(base)
        idle = []  # a route that runs no model: the HTTP stack's own round trip at concurrency 1
        with httpx.Client(base_url=base, timeout=10) as client:
            for _ in range(21):
                t = time.perf_counter()
                client.get("/v1/models")
                idle.append(time.perf_counter() - t)
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
    finally:
        for server in (proc, proc0):
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    server_rc = proc.returncode

    valid = [r for r in rows if r["kind"] == "valid"]
    bad = [r for r in rows if r["kind"] != "valid"]
    ok_lat = [r["seconds"] for r in valid if r["status"] == 200]
    five = sum(1 for r in valid if not isinstance(r["status"], int) or r["status"] >= 500)
    bad_not_4xx = sum(1 for r in bad if not (isinstance(r["status"], int) and 400 <= r["status"] < 500))
    reasons: dict[str, int] = {}
    for r in valid:
        if r["certkv"]:
            d = r["certkv"].get("decision", r["certkv"])
            key = f"{d.get('mode')}:{d.get('reason')}"
            reasons[key] = reasons.get(key, 0) + 1
    http_tp = len(seq_reqs) / statistics.median(http_passes)
    inproc_tp = len(seq_reqs) / statistics.median(inproc_passes)
    plain_tp = len(seq_reqs) / statistics.median(plain_passes)
    shadows = after_seq.get("shadows", {})
    result = {
        "benchmark": "serve_load",
        "command": "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "operating_point": {"source": str(args.operating_point), "policy": health["operating_point"]["policy"],
                            "stratified": health["operating_point"]["stratified"]},
        "shadow_rate": args.shadow_rate,
        "load": {
            "requests": len(rows), "concurrency": args.concurrency, "valid": len(valid), "malformed": len(bad),
            "seconds": load_seconds, "throughput_rps": len(rows) / load_seconds,
            "valid_throughput_rps": len(valid) / load_seconds,
            "valid_status": status_counts(valid), "valid_5xx": five,
            "malformed_status": {k: status_counts(bad, k) for k in MALFORMED_KINDS},
            "malformed_not_4xx": bad_not_4xx,
            "latency_p50_s": percentile(ok_lat, 0.5), "latency_p99_s": percentile(ok_lat, 0.99),
            "latency_mean_s": statistics.fmean(ok_lat) if ok_lat else None,
            "decisions": dict(sorted(reasons.items())),
            "shadows_after_load": after_load.get("shadows"),
        },
        "sequential": {
            "requests": len(seq_reqs),
            "passes": args.passes,
            "client": "httpx.Client, one keep-alive connection, sequential",
            "http": {"pass_seconds": http_passes, "throughput_rps": http_tp,
                     "latency_p50_s": percentile(http_lat, 0.5), "status": status_counts(seq_rows)},
            "in_process": {"pass_seconds": inproc_passes, "throughput_rps": inproc_tp,
                           "latency_p50_s": percentile(lat_in, 0.5)},
            "ratio_http_over_in_process": http_tp / inproc_tp,
            "http_no_shadows": {"pass_seconds": plain_passes, "throughput_rps": plain_tp},
            "ratio_http_no_shadows_over_in_process": plain_tp / inproc_tp,
            "answers_equal": answers_equal,
            "openai_client": {"seconds": openai_seconds, "throughput_rps": len(seq_reqs) / openai_seconds,
                              "ratio_over_in_process": len(seq_reqs) / openai_seconds / inproc_tp},
            "get_models_p50_s": percentile(idle[1:], 0.5),
            "target": 0.9,
            "note": "the server also runs its shadows (shadow_rate of evicted answers) on the same worker; "
                    "in-process has none",
        },
        "shadows": shadows,
        "kv": {**after_seq["kv"], "within_budget": after_seq["kv"]["budget"] is None
               or after_seq["kv"]["peak"] <= after_seq["kv"]["budget"]},
        "monitor": after_seq.get("monitor"),
        "server_exit_code": server_rc,
        "metrics_lines": sum(1 for line in metrics.splitlines() if line.startswith("certkv_")),
        "wall_seconds": time.perf_counter() - t_start,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    load = result["load"]
    seq = result["sequential"]
    print(f"certkv serve load test ({result['operating_point']['policy']}, shadow rate {args.shadow_rate})")
    print(f"{'requests':<34}{load['requests']} ({load['valid']} valid, {load['malformed']} malformed), "
          f"concurrency {args.concurrency}")
    print(f"{'valid: status':<34}{load['valid_status']}  5xx: {five}")
    for kind in MALFORMED_KINDS:
        print(f"{'malformed ' + kind:<34}{load['malformed_status'][kind]}")
    print(f"{'malformed not 4xx':<34}{bad_not_4xx}")
    print(f"{'latency p50 / p99 (valid, 200)':<34}{load['latency_p50_s'] * 1e3:.1f} ms / "
          f"{load['latency_p99_s'] * 1e3:.1f} ms")
    print(f"{'throughput (all / valid)':<34}{load['throughput_rps']:.1f} / {load['valid_throughput_rps']:.1f} req/s")
    print(f"{'decisions':<34}{load['decisions']}")
    print(f"{'shadows (scored, abandoned)':<34}{shadows}")
    print(f"concurrency 1, {seq['requests']} requests x {args.passes} passes:   HTTP {http_tp:.2f} req/s   in-process "
          f"{inproc_tp:.2f} req/s   ratio {seq['ratio_http_over_in_process']:.3f} (target ≥ 0.9); answers equal: "
          f"{seq['answers_equal']}")
    print(f"{'concurrency 1, HTTP, no shadows':<34}{plain_tp:.2f} req/s, ratio "
          f"{seq['ratio_http_no_shadows_over_in_process']:.3f}")
    print(f"{'concurrency 1, openai client':<34}{seq['openai_client']['throughput_rps']:.2f} req/s, ratio "
          f"{seq['openai_client']['ratio_over_in_process']:.3f}")
    print(f"{'KV budget / peak / max batch':<34}{result['kv']['budget']} / {result['kv']['peak']:.0f} / "
          f"{result['kv']['max_batch']}")
    print(f"{'GET /v1/models p50 (no model)':<34}{seq['get_models_p50_s'] * 1e3:.1f} ms: the HTTP round trip alone")
    print(f"wrote {args.output} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
