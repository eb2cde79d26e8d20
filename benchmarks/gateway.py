"""What ``certkv gateway`` costs and how it rides out a dead candidate (issue 54, items 4 and 6).

Starts two real ``certkv serve`` upstreams of the embedded model (the full cache and snapkv@0.50,
as tests/e2e/test_endpoints.py does, from :mod:`endpoint_servers`), calibrates the endpoint contract
through them (``certkv calibrate``, ``certkv certify``: the gateway deploys what a user's run
certifies), places the point's confidence gate by hand (``--gate``, default 0.5: a pilot needs more
requests than a benchmark's setup should; at 0.5 the gate keeps most answers and escalates some),
and starts ``certkv gateway`` on that point (shadow rate ``--shadow-rate``, default the gateway's
own 0.05). Then, on fresh demo requests:

a. **added latency** (non-streamed, plain HTTP over keep-alive connections, one request at a time):
   each request goes straight to the candidate upstream, with the very body the gateway sends it
   (the certified 8 tokens, log-probabilities), and through the gateway, the two arms alternating
   which goes first, request by request, so the machine's drift falls on both. Reported: p50/p99 of
   each arm and of the per-request difference (through − direct) over the answers the gate kept
   (the gateway's own cost: its parsing, its call, the gate, the response; target p50 ≤ 5 ms) and,
   apart, over the escalated ones (which add the full endpoint's whole answer).
b. **time to first token, streamed**: the same requests streamed straight from the candidate and
   through the gateway, alternating. The gateway holds a candidate answer until its post-answer
   gate decides, so a kept answer's first token leaves after the candidate's whole answer; an
   escalated one is the full endpoint's stream after that. Reported: TTFT and total per arm, the
   paired TTFT cost of the hold on kept answers, and the direct arm's whole-answer time beside it.
c. **load with a fault**: ``--load`` requests (default 400) at ``--concurrency`` (default 32)
   through the gateway; when half of them have been sent the candidate upstream is SIGKILLed and a
   new one started on its port. Counted: statuses (target: no 5xx), the decisions (how many the full
   endpoint answered because the candidate was down), /health sampled every 0.25 s from the kill
   until the restarted candidate answers again; then ``--after`` requests more once the gateway's
   /health is ``ok`` again, which the candidate must answer (kept by the gate) again.

The machine may be shared: ``os.getloadavg()`` is recorded before and after, with every figure.
Writes ``benchmarks/results/gateway.json``::

    python benchmarks/gateway.py                                        # a few minutes on 2 CPU cores
    python benchmarks/gateway.py --requests 20 --load 64 --concurrency 8 --no-write   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from endpoint_servers import REPO, Gateway, Upstream, endpoint_contract, full_point, snapkv_point

RESULT = REPO / "benchmarks" / "results" / "gateway.json"
LATENCY_TARGET_S = 0.005  # the gateway's added latency, p50 over kept answers (issue 54)
CALIBRATION_REQUESTS = 8
#: The gateway's candidate timeout, above its default (10 s): at concurrency 32 on 2 shared cores an
#: upstream answer can take seconds, and a live candidate timed out would be counted as a dead one.
CANDIDATE_TIMEOUT, FULL_TIMEOUT = 30, 60


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def spread(values: list[float]) -> dict:
    return {"n": len(values), "p50_s": percentile(values, 0.5), "p99_s": percentile(values, 0.99)}


def cli(*args: str, cwd: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, "-m", "certkv.cli.app", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"certkv {' '.join(args)} exited {res.returncode}:\n{res.stdout}{res.stderr}")


def deploy(work: Path, args, servers: list) -> tuple[Upstream, Upstream, Gateway, dict]:
    """The two upstreams, the contract calibrated and certified through them, the gated point's gateway
    (each process appended to `servers` as it starts, for the caller to stop)."""
    from certkv.core.operating_point import load_operating_point
    from certkv.core.spec import GateSettings
    from certkv.requests.request_set import generate_requests, write_jsonl

    write_jsonl(generate_requests("demo", n=CALIBRATION_REQUESTS, seed=4243, context_length=(200, 320)),
                work / "requests.jsonl")
    full, snap = Upstream(work / "full", full_point()), Upstream(work / "snap", snapkv_point(0.5, 0.5))
    servers += [full, snap]
    full.wait(), snap.wait()
    contract = endpoint_contract(work, "gw", full.url, snap.url)
    cli("calibrate", str(contract), "--quiet", cwd=work)
    cli("certify", str(contract), cwd=work)
    op = load_operating_point(work / "runs" / "gw" / "operating_point.json")
    gated = op.model_copy(update={"policy": f"{op.policy}+confq{args.gate:g}",
                                  "gate": GateSettings(confidence=args.gate, quantile=0.5)})
    point = gated.write_json(work / "runs" / "gw" / "gated.json")
    gateway = Gateway(work, point, "--shadow-rate", str(args.shadow_rate), "--candidate-timeout", str(CANDIDATE_TIMEOUT),
                      "--timeout", str(FULL_TIMEOUT), "--candidate-retry", str(args.candidate_retry))
    servers.append(gateway)
    gateway.wait()
    return full, snap, gateway, {"certified": op.policy, "deployed": gated.policy, "gate_confidence": args.gate}


def direct_body(r, stream: bool = False) -> dict:
    """What the gateway sends the candidate for `r` (calibration's body), so the arms differ by the gateway
    alone; streamed, what a client streaming from the candidate sends (certkv serve streams no log-probabilities)."""
    from certkv.calibration.endpoints import upstream_body

    body = upstream_body(r.context, r.question, "", "chat", "embedded", 8, True)
    if stream:
        body.pop("logprobs")
        body["stream"] = True
    return body


def gateway_body(r, stream: bool = False) -> dict:
    return {"model": "embedded", "context": r.context, "question": r.question, **({"stream": True} if stream else {})}


# ----------------------------------------------------------------------------- a. added latency


def latency(snap: Upstream, gateway: Gateway, requests) -> dict:
    """Each request straight to the candidate and through the gateway, alternating which goes first."""
    import httpx

    rows = []
    with httpx.Client(base_url=snap.url, timeout=120) as direct, httpx.Client(base_url=gateway.url, timeout=120) as gw:
        def arm(name: str, r) -> tuple[float, dict]:
            client, path, body = ((direct, "/chat/completions", direct_body(r)) if name == "direct" else
                                  (gw, "/v1/chat/completions", gateway_body(r)))
            t0 = time.perf_counter()
            resp = client.post(path, json=body)
            seconds = time.perf_counter() - t0
            resp.raise_for_status()
            return seconds, resp.json()

        for r in requests[:4]:  # warm-up: connections, first forwards
            arm("direct", r), arm("through", r)
        for i, r in enumerate(requests):
            order = ("direct", "through") if i % 2 == 0 else ("through", "direct")
            got = {name: arm(name, r) for name in order}
            reason = got["through"][1]["certkv"]["decision"]["reason"]
            rows.append({"direct": got["direct"][0], "through": got["through"][0], "reason": reason})
    kept = [r for r in rows if r["reason"] is None]
    escalated = [r for r in rows if r["reason"] is not None]
    added = [r["through"] - r["direct"] for r in kept]
    return {"requests": len(rows), "kept": len(kept), "escalated": len(escalated),
            "reasons": {k: sum(1 for r in rows if str(r["reason"]) == k) for k in sorted({str(r["reason"]) for r in rows})},
            "direct": spread([r["direct"] for r in rows]), "through_kept": spread([r["through"] for r in kept]),
            "through_escalated": spread([r["through"] for r in escalated]),
            "added_kept": spread(added), "added_escalated": spread([r["through"] - r["direct"] for r in escalated]),
            "target_p50_s": LATENCY_TARGET_S, "met": added != [] and percentile(added, 0.5) <= LATENCY_TARGET_S}


# ----------------------------------------------------------------------------- b. time to first token


def stream_once(client, path: str, body: dict) -> dict:
    """(TTFT, total, the certkv object of the last chunk) of one streamed request."""
    t0 = time.perf_counter()
    ttft, info = None, None
    with client.stream("POST", path, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            choices = event.get("choices") or []
            if ttft is None and choices and (choices[0].get("delta") or {}).get("content"):
                ttft = time.perf_counter() - t0
            info = event.get("certkv") or info
    total = time.perf_counter() - t0
    return {"ttft": total if ttft is None else ttft, "total": total, "certkv": info}


def first_token(snap: Upstream, gateway: Gateway, requests) -> dict:
    """Each request streamed straight from the candidate and through the gateway, alternating."""
    import httpx

    rows = []
    with httpx.Client(base_url=snap.url, timeout=120) as direct, httpx.Client(base_url=gateway.url, timeout=120) as gw:
        arms = {"direct": lambda r: stream_once(direct, "/chat/completions", direct_body(r, stream=True)),
                "through": lambda r: stream_once(gw, "/v1/chat/completions", gateway_body(r, stream=True))}
        for r in requests[:2]:
            arms["direct"](r), arms["through"](r)
        for i, r in enumerate(requests):
            order = ("direct", "through") if i % 2 == 0 else ("through", "direct")
            got = {name: arms[name](r) for name in order}
            reason = ((got["through"]["certkv"] or {}).get("decision") or {}).get("reason", "unknown")
            rows.append({"direct": got["direct"], "through": got["through"], "reason": reason})
    kept = [r for r in rows if r["reason"] is None]
    escalated = [r for r in rows if r["reason"] is not None]
    return {"requests": len(rows), "kept": len(kept), "escalated": len(escalated),
            "direct_ttft": spread([r["direct"]["ttft"] for r in rows]),
            "direct_total": spread([r["direct"]["total"] for r in rows]),
            "through_ttft_kept": spread([r["through"]["ttft"] for r in kept]),
            "through_ttft_escalated": spread([r["through"]["ttft"] for r in escalated]),
            "through_total_kept": spread([r["through"]["total"] for r in kept]),
            "ttft_cost_kept": spread([r["through"]["ttft"] - r["direct"]["ttft"] for r in kept]),
            "through_ttft_minus_direct_total_kept": spread([r["through"]["ttft"] - r["direct"]["total"] for r in kept])}


# ----------------------------------------------------------------------------- c. load with a fault


class HealthLog:
    """/health of the gateway sampled every 0.25 s on a thread of its own until :meth:`stop`."""

    def __init__(self, gateway: Gateway, t0: float) -> None:
        self.gateway, self.t0, self.samples = gateway, t0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import httpx

        while not self._stop.is_set():
            try:
                h = httpx.get(self.gateway.url + "/health", timeout=5).json()
                cand = next(iter(h["candidates"].values()))
                self.samples.append({"t": time.monotonic() - self.t0, "status": h["status"], "candidate": cand["state"],
                                     "error": cand["error"]})
            except Exception as exc:  # noqa: BLE001 - an unanswered /health is a finding, not a crash
                self.samples.append({"t": time.monotonic() - self.t0, "status": f"error:{type(exc).__name__}",
                                     "candidate": None, "error": None})
            self._stop.wait(0.25)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.samples


async def fire(gateway: Gateway, requests, concurrency: int, on_sent=None) -> list[dict]:
    """Every request through the gateway, `concurrency` at a time; `on_sent(k)` after the k-th is sent."""
    import httpx

    sem, out, sent = asyncio.Semaphore(concurrency), [], 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=300, limits=limits) as client:
        async def one(r):
            nonlocal sent
            async with sem:
                sent += 1
                if on_sent is not None:
                    on_sent(sent)
                t = time.monotonic()
                try:
                    resp = await client.post("/v1/chat/completions", json=gateway_body(r))
                    status = resp.status_code
                    decision = resp.json().get("certkv", {}).get("decision", {}) if status == 200 else {}
                    reason, detail = decision.get("reason"), decision.get("detail") or ""
                    error = None if status == 200 else resp.text[:300]
                except httpx.HTTPError as exc:
                    status, reason, detail, error = f"error:{type(exc).__name__}", None, "", str(exc)[:300]
                out.append({"status": status, "reason": reason, "detail": detail, "error": error, "start": t,
                            "seconds": time.monotonic() - t})

        await asyncio.gather(*(one(r) for r in requests))
    return out


def tally(rows: list[dict]) -> dict:
    statuses: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for r in rows:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        if r["status"] == 200:
            reasons[str(r["reason"])] = reasons.get(str(r["reason"]), 0) + 1
    bad = [r for r in rows if r["status"] != 200 and (not isinstance(r["status"], int) or r["status"] >= 500)]
    why: dict[str, int] = {}  # what the gateway's decision said of a down candidate: timed out, unreachable, ...
    for r in rows:
        if r["reason"] == "candidate_down":
            kind = "timed out" if "no answer within" in r["detail"] else "unreachable" if "unreachable" in r["detail"] \
                else "down (retry pending)" if not r["detail"] else "other"
            why[kind] = why.get(kind, 0) + 1
    return {"requests": len(rows), "statuses": dict(sorted(statuses.items())), "reasons": dict(sorted(reasons.items())),
            "down_why": dict(sorted(why.items())),
            "five_xx": len(bad), "failures": [r["error"] for r in bad][:5],
            "latency": spread([r["seconds"] for r in rows])}


def health_summary(samples: list[dict], kill_t: float, healthy_t: float | None) -> dict:
    outage = [s for s in samples if s["t"] >= kill_t and (healthy_t is None or s["t"] <= healthy_t)]
    statuses: dict[str, int] = {}
    for s in outage:
        statuses[s["status"]] = statuses.get(s["status"], 0) + 1
    down = [s for s in outage if s["status"] == "candidate_down"]
    ok_again = [s for s in samples if healthy_t is not None and s["t"] > healthy_t and s["status"] == "ok"]
    return {"samples": len(outage), "statuses": statuses,
            "first_candidate_down_after_kill_s": down[0]["t"] - kill_t if down else None,
            "error": down[0]["error"] if down else None,
            "ok_after_restart_s": ok_again[0]["t"] - healthy_t if ok_again and healthy_t is not None else None}


def fault(work: Path, snap: Upstream, gateway: Gateway, requests, after, args) -> tuple[dict, Upstream]:
    """The load with the candidate SIGKILLed when half the requests are sent, and restarted on its port."""
    t0 = time.monotonic()
    events: dict[str, float] = {}
    restarted: list[Upstream] = []

    def on_sent(k: int) -> None:
        if k == len(requests) // 2 + 1 and not restarted:
            snap.kill()  # the process is gone before the rest are sent
            events["kill_t"], events["kill_at_request"] = time.monotonic() - t0, k
            restarted.append(Upstream(work / "snap-restarted", snapkv_point(0.5, 0.5), snap.port))

    health = HealthLog(gateway, t0)
    try:
        rows = asyncio.run(fire(gateway, requests, args.concurrency, on_sent))
        load_end = time.monotonic() - t0
        restarted[0].wait()
        healthy_t = time.monotonic() - t0
        deadline = time.monotonic() + 60
        while gateway.health()["status"] != "ok" and time.monotonic() < deadline:
            asyncio.run(fire(gateway, after[:1], 1))  # a request tries the candidate once --candidate-retry passed
            time.sleep(0.2)
        back = asyncio.run(fire(gateway, after, args.concurrency))
    finally:
        samples = health.stop()
    kill_t = events["kill_t"]
    during = [r for r in rows if r["start"] - t0 >= kill_t]
    return {"requests": len(rows), "concurrency": args.concurrency, "kill_at_request": events["kill_at_request"],
            "kill_s": kill_t, "load_end_s": load_end, "restarted_healthy_s": healthy_t,
            "outage_s": healthy_t - kill_t, "all": tally(rows), "before_kill": tally([r for r in rows if r not in during]),
            "after_kill": tally(during), "candidate_down_answers": sum(1 for r in rows if r["reason"] == "candidate_down"),
            "health": health_summary(samples, kill_t, healthy_t), "after_restart": tally(back),
            "five_xx_target": 0, "met": tally(rows)["five_xx"] == 0 and tally(back)["five_xx"] == 0}, restarted[0]


# ----------------------------------------------------------------------------- the run


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200, help="requests of the latency and TTFT passes (each)")
    p.add_argument("--load", type=int, default=400, help="requests of the load with a fault")
    p.add_argument("--concurrency", type=int, default=32, help="concurrency of the load with a fault")
    p.add_argument("--after", type=int, default=32, help="requests sent once the restarted candidate is back")
    p.add_argument("--gate", type=float, default=0.5, help="the point's confidence gate (its least likely token's p)")
    p.add_argument("--shadow-rate", type=float, default=0.05, help="the gateway's --shadow-rate")
    p.add_argument("--candidate-retry", type=float, default=1.0, help="the gateway's --candidate-retry")
    p.add_argument("--upstream-threads", type=int, default=None, help="OMP_NUM_THREADS of the upstreams (default: "
                   "torch's own, one per core; on a machine shared with other work, 1 spares each one waiting on threads "
                   "the others hold)")
    p.add_argument("--seed", type=int, default=7, help="seed of the demo requests (not the calibration's)")
    p.add_argument("--no-write", action="store_true", help=f"print the results; do not write {RESULT.relative_to(REPO)}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from certkv.requests.request_set import generate_requests

    args = parse(argv)
    # a SIGTERM unwinds like an error, so the servers this run started are stopped by the `finally` below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.upstream_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.upstream_threads)  # the servers this run starts inherit it
    load_before = os.getloadavg()
    n = max(args.requests, args.load, args.after)
    requests = generate_requests("demo", n=n, seed=args.seed, context_length=(200, 320))
    servers: list = []
    with tempfile.TemporaryDirectory(prefix="certkv-gateway-bench-") as tmp:
        work = Path(tmp)
        try:
            _, snap, gateway, point = deploy(work, args, servers)
            lat = latency(snap, gateway, requests[:args.requests])
            ttft = first_token(snap, gateway, requests[:args.requests])
            load, restarted = fault(work, snap, gateway, requests[:args.load], requests[-args.after:], args)
            servers.append(restarted)
        finally:
            for server in servers:
                server.stop()
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    out = {"command": "python benchmarks/gateway.py" + (f" {argv_text}" if argv_text else ""),
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())},
           "model": "embedded", "point": point, "shadow_rate": args.shadow_rate, "candidate_retry_s": args.candidate_retry,
           "candidate_timeout_s": CANDIDATE_TIMEOUT, "timeout_s": FULL_TIMEOUT, "upstream_threads": args.upstream_threads,
           "latency": lat, "first_token": ttft, "fault": load}
    print(json.dumps(out, indent=2))
    if not args.no_write:
        RESULT.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {RESULT.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
