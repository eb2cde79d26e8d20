"""What the lookahead probe adds to a request, measured side by side (issue 16 target: ≤ 5%).

A randomly initialised 8-layer Llama (hidden 512, 8 query / 2 KV heads, sdpa, float32, CPU) and
the embedded tokenizer; demo-mix requests of 2048 context tokens. Each request is answered by two
engines with the same candidate (SnapKV at kv_retained 0.5): ``plain`` (no probe) and ``probe``
(``lookahead_tokens=2``: the question and two answer tokens fed over the full cache, the attention
captured, then the candidate's evicted mass). A request is the engine's whole run: the full
prefill (with SnapKV's scoring hook), the full-cache answer, the candidate's answer. The two run in
alternating order, ``--repeats`` times per request, the fastest of each counting, so that machine
noise hits both alike.

Reported per request and as medians: ``share`` = the probe's own seconds (``seconds["lookahead"]``,
the probe and the evicted-mass sums) over the plain run's total, and ``overhead`` = the probe
run's total over the plain run's, minus 1 (carries the noise of both runs).

    python benchmarks/lookahead_cost.py            # writes benchmarks/results/lookahead_cost.json
    python benchmarks/lookahead_cost.py --quick    # 2 requests, nothing written
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CONTEXT = 2048
LOOKAHEAD_TOKENS = 2


def random_llama(tokenizer):
    """The random 8-layer Llama of the issue's target (hidden 512, 8/2 heads, 4096 positions)."""
    from calibration_speed import larger_llama

    return larger_llama(tokenizer, heads=8, kv_heads=2)


def main() -> None:
    import torch
    from kvpress import SnapKVPress

    from certkv.engine.engine import Engine, PressCandidate
    from certkv.model.loading import load_model
    from certkv.requests.request_set import generate_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, default=8, help="measured requests")
    p.add_argument("--repeats", type=int, default=3, help="runs per request and engine (the fastest counts)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    _, tokenizer = load_model("embedded", device="cpu")
    model = random_llama(tokenizer)
    candidates = [PressCandidate("snapkv@0.50", SnapKVPress(compression_ratio=0.5), "snapkv", 0.5)]
    engines = {
        "plain": Engine(model, tokenizer, candidates, max_new_tokens=8),
        "probe": Engine(model, tokenizer, candidates, max_new_tokens=8, lookahead_tokens=LOOKAHEAD_TOKENS),
    }
    n = 2 if args.quick else args.n
    requests = generate_requests("demo", n + 1, seed=4161, context_length=CONTEXT)
    engines["plain"].run(requests[0].context, requests[0].question, requests[0].answer_prefix)  # warm-up, not measured
    engines["probe"].run(requests[0].context, requests[0].question, requests[0].answer_prefix)
    rows = []
    for i, req in enumerate(requests[1:]):
        best: dict[str, tuple[float, dict]] = {}
        order = ["plain", "probe"] if i % 2 == 0 else ["probe", "plain"]
        for _ in range(args.repeats):
            for name in order:
                t0 = time.perf_counter()
                result = engines[name].run(req.context, req.question, req.answer_prefix)
                total = time.perf_counter() - t0
                if name not in best or total < best[name][0]:
                    best[name] = (total, result.seconds)
        plain, probe = best["plain"][0], best["probe"][0]
        lookahead = best["probe"][1]["lookahead"]
        rows.append({
            "request_id": req.id, "context_tokens": result.context_length, "plain_seconds": plain,
            "probe_run_seconds": probe, "lookahead_seconds": lookahead,
            "share": lookahead / plain, "overhead": probe / plain - 1,
        })
        print(json.dumps(rows[-1]), flush=True)
    out = {
        "model": "random Llama, 8 layers, hidden 512, 8/2 heads",
        "context_tokens": CONTEXT,
        "lookahead_tokens": LOOKAHEAD_TOKENS,
        "candidate": "snapkv@0.50",
        "requests": len(rows),
        "repeats": args.repeats,
        "threads": args.threads,
        "torch": torch.__version__,
        "median_plain_seconds": statistics.median(r["plain_seconds"] for r in rows),
        "median_lookahead_seconds": statistics.median(r["lookahead_seconds"] for r in rows),
        "share_median": statistics.median(r["share"] for r in rows),
        "share_max": max(r["share"] for r in rows),
        "overhead_median": statistics.median(r["overhead"] for r in rows),
        "per_request": rows,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "per_request"}, indent=1))
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "lookahead_cost.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
