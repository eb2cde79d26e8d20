"""Compress once, answer many: throughput of a question-agnostic point with and without its prefix cache.

Traffic with several questions per context (8 by default): multi_key haystacks of the embedded
model (2,048 tokens by default, its longest: a prefill of a few hundred tokens costs this tiny
model less than the request's HTTP round trip, which reuse cannot save), each asked that many of
its keys, the questions of one context sent one after another, closed loop at concurrency 32
through the official ``openai`` client. The same operating point is served by two real ``certkv
serve`` processes under the same ``--kv-budget``, side by side in one run: one with
``--prefix-cache-mib`` (a later question on a kept context skips its prefill and compression), one
without; a pair per budget (``--budget-shares``: 8 and 4 times the largest request's full prefill
reservation), since the kept contexts count against it. The point is question-agnostic
(``query_aware: false``): SnapKV keeping half the cache by default (an ungated fixed point, as
``benchmarks/capacity.py`` builds them), or any operating point given with ``--point``.

Every server runs with ``--shadow-rate 0``: the live monitor's seeded shadows could switch one
server to the full cache and not the other, and the comparison is of one operating point's answers.
Each pass sends fresh contexts (a context kept by one pass would make the next pass's questions
hits that no new traffic would have); passes alternate between the servers. Reported: the median
pass throughput of each, the ratio with and without reuse at each budget (target ≥ 3× at the first),
whether every answer is the same with and without reuse, and the prefix cache's hits, misses and
evictions from ``/metrics``.
Writes ``benchmarks/results/prefix_cache.json`` and prints a table::

    python benchmarks/prefix_cache.py                   # ~2 minutes on 2 CPU cores
    python benchmarks/prefix_cache.py --contexts 8 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capacity import Server, fixed_point, largest_reservation  # noqa: E402
from serve_load import REPO, percentile  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "prefix_cache.json"
METRICS = ("certkv_prefix_cache_hits_total", "certkv_prefix_cache_misses_total",
           "certkv_prefix_cache_evictions_total")


def traffic(contexts: int, questions: int, context_length: int, seed: int, start: int = 0) -> list:
    """`questions` requests about each of `contexts` multi_key haystacks (context i from (seed, start + i)),
    the questions of one context consecutive."""
    from certkv.requests.builtin_tasks import multi_key
    from certkv.requests.request_set import Request

    out = []
    for i in range(start, start + contexts):
        sample = multi_key(random.Random(f"certkv/prefix/{seed}/{i}"), context_length)
        if len(sample.qa) < questions:
            sys.exit(f"a {context_length}-token multi_key context holds {len(sample.qa)} keys, fewer than "
                     f"--questions {questions}; raise --context-length")
        out += [Request(id=f"ctx{i:04d}-q{j}", task="multi_key", context=sample.context, question=q, answers=[a])
                for j, (q, a) in enumerate(sample.qa[:questions])]
    return out


def prefix_counts(server: Server) -> dict[str, float]:
    """The prefix cache's counters in the server's /metrics (0 when it has none)."""
    import httpx

    text = httpx.get(server.base + "/metrics", timeout=10).text
    counts = {}
    for name in METRICS:
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        counts[name.removeprefix("certkv_prefix_cache_").removesuffix("_total")] = float(match.group(1)) if match else 0.0
    return counts


def summary(server: Server, counts: dict[str, float]) -> dict:
    """Throughput (the median pass's, each listed), latency over every pass, answers by request id."""
    rows = [r for rep in server.repeats for r in rep["rows"]]
    ok = [r for r in rows if r["status"] == 200]
    each = [sum(r["status"] == 200 for r in rep["rows"]) / rep["seconds"] for rep in server.repeats]
    lat = [r["seconds"] for r in ok]
    return {
        "requests": len(rows), "answered": len(ok), "throughput_rps": statistics.median(each),
        "throughput_each_rps": each, "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
        "decisions": {mode: sum(1 for r in ok if (r["decision"]["reason"] or "evicted") == mode)
                      for mode in sorted({r["decision"]["reason"] or "evicted" for r in ok})},
        "shadows_left_per_pass": [rep["shadows_left"] for rep in server.repeats],
        "prefix_cache": counts, "answers": {r["id"]: r["answer"] for r in ok},
    }


def measure(servers: dict[str, Server], passes: list[list], warm: list, concurrency: int) -> dict[str, dict]:
    """Warm each server, run the passes alternately, read each one's prefix cache counters, stop them all."""
    counts: dict[str, dict] = {}
    try:
        for server in servers.values():
            server.warm(warm)
        before = {name: prefix_counts(server) for name, server in servers.items()}
        for requests in passes:
            for server in servers.values():
                server.measure(requests, concurrency)
        for name, server in servers.items():
            after = prefix_counts(server)
            counts[name] = {k: after[k] - before[name][k] for k in after}
    finally:
        health = {name: server.stop() for name, server in servers.items()}
    silent = [name for name, kv in health.items() if kv is None]
    if silent:
        sys.exit(f"no /health answer at the end from: {', '.join(silent)}")
    return {name: {**summary(server, counts[name]), "kv_peak": health[name]["peak"]}
            for name, server in servers.items()}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--point", type=Path, help="a question-agnostic operating_point.json (default: SnapKV keeping "
                        "half the cache, ungated)")
    parser.add_argument("--contexts", type=int, default=16, help="contexts per pass")
    parser.add_argument("--questions", type=int, default=8, help="questions per context")
    parser.add_argument("--context-length", type=int, default=2048, help="tokens per context (the embedded model's "
                        "longest; shorter ones cost the server less than their HTTP round trip)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--budget-shares", type=float, nargs="+", default=[8.0, 4.0], help="--kv-budget of both "
                        "servers, in multiples of the largest request's full prefill reservation; a pair of servers "
                        "per budget, the first is the one the target is read at")
    parser.add_argument("--prefix-cache-mib", type=float, default=256.0)
    parser.add_argument("--repeats", type=int, default=3, help="passes per server (median throughput)")
    parser.add_argument("--seed", type=int, default=4242)
    parser.add_argument("--output", type=Path, default=RESULT)
    return parser.parse_args()


def compare(runs: dict[str, dict], budget: int, share: float, expected: int) -> dict:
    """One budget's pair of runs, their throughput ratio (median against median, and pass by pass) and
    whether every one of the `expected` answers is the same with and without reuse."""
    answers = {name: run.pop("answers") for name, run in runs.items()}
    paired = [r / n for r, n in zip(runs["reuse"]["throughput_each_rps"], runs["no_reuse"]["throughput_each_rps"])]
    return {"slots": budget, "share": share, "runs": runs,
            "ratio": runs["reuse"]["throughput_rps"] / runs["no_reuse"]["throughput_rps"], "ratio_each": paired,
            "answers_equal": answers["reuse"] == answers["no_reuse"] and len(answers["reuse"]) == expected}


def main() -> None:
    args = arguments()
    from certkv.core.operating_point import load_operating_point

    point = load_operating_point(args.point) if args.point else fixed_point(0.5, query_aware=False, max_new_tokens=8)
    if point.query_aware:
        sys.exit(f"{args.point} is query-aware: its compressed context depends on the question; give a "
                 "question-agnostic point")
    work = Path(tempfile.mkdtemp(prefix="prefix_cache_"))
    op_path = point.write_json(work / "point.json")
    passes = [traffic(args.contexts, args.questions, args.context_length, args.seed, start=(1 + k) * args.contexts)
              for k in range(args.repeats)]
    warm = traffic(1, 8, args.context_length, args.seed)
    largest = largest_reservation([r for p in passes for r in p], point.max_new_tokens or 8)
    budgets = {f"{share:g}": round(share * largest) for share in args.budget_shares}
    t0 = time.perf_counter()
    plain = ("--shadow-rate", "0")  # no monitor: its seeded shadows would switch the two servers at different times
    reuse = (*plain, "--prefix-cache-mib", f"{args.prefix_cache_mib:g}")
    servers = {f"{name}@{key}": Server(name, op_path, slots, args.concurrency, work, extra=extra)
               for key, slots in budgets.items() for name, extra in (("no_reuse", plain), ("reuse", reuse))}
    runs = measure(servers, passes, warm, args.concurrency)
    results = {key: compare({name: runs[f"{name}@{key}"] for name in ("no_reuse", "reuse")}, slots,
                            float(key), sum(map(len, passes))) for key, slots in budgets.items()}
    result = {
        "benchmark": "prefix_cache",
        "command": "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "point": {"policy": point.policy, "press": point.press, "kv_retained": point.kv_retained,
                  "gate": point.gate.kind if point.gate else None, "query_aware": point.query_aware,
                  "max_new_tokens": point.max_new_tokens, "fixed": args.point is None},
        "traffic": {"task": "multi_key", "contexts_per_pass": args.contexts, "questions_per_context": args.questions,
                    "context_length": args.context_length, "concurrency": args.concurrency, "seed": args.seed,
                    "passes": args.repeats, "shadow_rate": 0.0},
        "largest_prefill_reservation": largest, "prefix_cache_mib": args.prefix_cache_mib,
        "budgets": results, "target": 3.0, "target_at": next(iter(budgets)),
        "wall_seconds": time.perf_counter() - t0,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{point.policy}, {args.questions} questions on each of {args.contexts} contexts of {args.context_length} "
          f"tokens per pass, concurrency {args.concurrency}; the same --kv-budget with and without reuse")
    print(f"{'server':<10}{'budget':>8}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'hits':>7}{'misses':>8}{'evicted':>9}"
          f"{'peak KV':>9}")
    for key, b in results.items():
        for name, r in b["runs"].items():
            c = r["prefix_cache"]
            print(f"{name:<10}{b['slots']:>8}{r['throughput_rps']:>8.2f}{r['latency_p50_s'] * 1e3:>9.0f}"
                  f"{r['latency_p99_s'] * 1e3:>9.0f}{c['hits']:>7.0f}{c['misses']:>8.0f}{c['evictions']:>9.0f}"
                  f"{r['kv_peak']:>9.0f}")
        print(f"  at {key}x: reuse / no reuse {b['ratio']:.2f}x (pass by pass "
              f"{', '.join(f'{x:.2f}x' for x in b['ratio_each'])}); answers equal: {b['answers_equal']}")
    print(f"target >= 3x at {result['target_at']}x; wrote {args.output} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
