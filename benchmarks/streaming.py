"""Time to first token of a streamed long answer, beside its total latency.

A real ``certkv serve`` process per operating point (the embedded-recite model, loopback, a free
port), driven by the official ``openai`` client with ``stream=True``. The requests are fresh
``builtin:recite`` requests whose recitation is at least ``--min-tokens`` tokens (default 100; the
task's answers run 42-126 tokens), decoded to the long-generation contract's 140 new tokens. Points,
all ungated (fixed, outside any certificate: the benchmark measures when tokens leave, not risk):

* ``full``: the full-cache fallback: batched decoding with prompt-lookup proposals (a step may
  accept several tokens of a recitation at once);
* ``snapkv_half``: SnapKV keeping half the cache, batched the same way;
* ``rerotated``: SnapKV keeping 80% of the cache inside kvpress's ``KeyRerotationPress`` (at half,
  SnapKV breaks most recitations, which then stop early): pruned by kvpress's hooks while it
  prefills (certkv's pipeline path), then batched and decoded plainly greedy, as kvpress's pipeline
  decodes: one token per batched step;
* ``decoding``: kvpress's ``CompressionRatioDecodingPress`` (StreamingLLM scorer, every 8 steps to
  80% of the tokens seen), decoded as a row of the batch (its scorer's choices survive a batched
  forward), with prompt-lookup proposals up to each compression event: at most 8 tokens a forward;
* ``decoding_recompute``: the same press behind the recompute gate (p < 0.3 restarts on the full
  cache, announced in the stream), decoded alone under the press, one token per forward, as
  calibrated: gated, reported beside, not part of the target;
* ``full_no_lookup``, ``snapkv_half_no_lookup``: ``full`` and ``snapkv_half`` served with
  ``--no-prompt-lookup``: one token per batched step, as an answer that copies nothing decodes.

The servers run with ``--shadow-rate 0`` (no shadows, no monitor): a fixed point outside any
certificate would trip its monitor within the run, and the full cache would then answer the rest, a
different point mid-measurement.

Per request: the time to the first chunk (the response starts), to the first chunk with text (what
a reader sees: the time to first token), and to the end of the stream, at concurrency 1 (one request
at a time) and at ``--concurrency`` (default 8, a closed loop). Target (issue 41): the time to first
token at most 0.2× the total latency, p50 over p50, on an ungated point. Each point's streamed
answers are compared with the same server's non-streamed answers on the first ``--check`` requests.

Writes ``benchmarks/results/streaming.json`` and prints a table::

    python benchmarks/streaming.py                 # ~5 minutes on 2 CPU cores
    python benchmarks/streaming.py --requests 8    # a quick look
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
from serve_load import REPO, free_port, percentile, wait_healthy  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "streaming.json"
MODEL = "embedded-recite"
MAX_NEW_TOKENS = 140  # contracts/embedded_long.yaml: the longest recitation (126 tokens) and its stop token
TARGET = 0.2
DECODING_KWARGS = {"base_press": "streaming_llm", "compression_interval": 8}
POINTS = ("full", "snapkv_half", "rerotated", "decoding", "decoding_recompute", "full_no_lookup",
          "snapkv_half_no_lookup")
#: The suffix of a point served with --no-prompt-lookup.
NO_LOOKUP = "_no_lookup"


def point(name: str):
    """The operating point `name` (module docstring), ungated but for ``decoding_recompute``."""
    name = name.removesuffix(NO_LOOKUP)
    from certkv.core.operating_point import ContractSummary, OperatingPoint
    from certkv.core.spec import GateSettings

    press, policy, kv, kwargs, gate = {
        "full": ("full", "full", 1.0, {}, None),
        "snapkv_half": ("snapkv", "snapkv@0.50", 0.5, {}, None),
        "rerotated": ("key_rerotation", "key_rerotation@0.80", 0.8, {"press": "snapkv"}, None),
        "decoding": ("compression_ratio_decoding", "compression_ratio_decoding@0.80", 0.8, DECODING_KWARGS, None),
        "decoding_recompute": ("compression_ratio_decoding", "compression_ratio_decoding@0.80", 0.8, DECODING_KWARGS,
                               GateSettings(recompute=0.3)),
    }[name]
    return OperatingPoint(
        policy=policy + ("+recq" if gate else ""), base_policy=policy, press=press, kv_retained=kv,
        mean_kv_retained=kv, fallback=press == "full", reason="benchmark: the full cache" if press == "full" else None,
        press_kwargs=kwargs, gate=gate, max_new_tokens=MAX_NEW_TOKENS,
        contract=ContractSummary(tolerance=0.0, risk=0.05, confidence=0.95, procedure="fixed_sequence",
                                 utility="prefix_agreement"),
        n=0, violations=0, empirical_risk=0.0, risk_upper_bound=0.0, p_value=None, candidates=[], sequences=[],
        guarantee="none: a benchmark's fixed point", created="benchmark", certkv_version="benchmark",
    )


def long_requests(n: int, min_tokens: int, seed: int):
    """`n` fresh recite requests whose reference recitation has at least `min_tokens` tokens."""
    from certkv.model.loading import load_model
    from certkv.requests.request_set import generate_requests

    _, tok = load_model(MODEL, device="cpu")
    pool = generate_requests("recite", 8 * n, seed=seed)
    chosen = [r for r in pool if len(tok.encode(r.answers[0])) >= min_tokens][:n]
    if len(chosen) < n:
        raise SystemExit(f"only {len(chosen)} of {len(pool)} recite requests have {min_tokens}+ tokens; lower --min-tokens")
    return chosen


async def streamed(client, r) -> dict:
    """One streamed request: seconds to the first chunk, the first text and the end; text, tokens, restarts."""
    t0 = time.perf_counter()
    first = first_text = None
    pieces, restarts, usage = [], [], None
    stream = await client.completions.create(model=MODEL, prompt="", stream=True,
                                             extra_body={"context": r.context, "question": r.question})
    async for chunk in stream:
        now = time.perf_counter() - t0
        first = now if first is None else first
        text = chunk.choices[0].text if chunk.choices else ""
        if text and first_text is None:
            first_text = now
        pieces.append(text)
        extra = (chunk.model_extra or {}).get("certkv") or {}
        if "event" in extra:
            restarts.append(extra["recomputed_at"])
        usage = chunk.usage or usage
    total = time.perf_counter() - t0
    return {"id": r.id, "first_chunk_s": first, "ttft_s": first_text, "total_s": total, "text": "".join(pieces),
            "tokens": usage.completion_tokens if usage else None, "chunks": len(pieces), "restarts": restarts,
            "reason": str(extra["decision"]["reason"])}


async def closed_loop(base: str, requests, concurrency: int) -> tuple[list[dict], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    todo, rows = iter(requests), []

    async def worker():
        for r in todo:
            rows.append(await streamed(client, r))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    await client.close()
    return rows, seconds


def summary(rows: list[dict], seconds: float, min_tokens: int) -> dict:
    """Percentiles of the three times and the target's ratio (p50 time to first token over p50 total),
    also over the answers of at least `min_tokens` tokens alone (an evicted point may stop early)."""
    ttft, total = [r["ttft_s"] for r in rows], [r["total_s"] for r in rows]
    long = [r for r in rows if r["tokens"] >= min_tokens]
    ratios = [r["ttft_s"] / r["total_s"] for r in rows]
    return {
        "requests": len(rows), "seconds": seconds, "tokens_mean": statistics.fmean(r["tokens"] for r in rows),
        "chunks_mean": statistics.fmean(r["chunks"] for r in rows),
        "first_chunk_p50_s": percentile([r["first_chunk_s"] for r in rows], 0.5),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "total_p50_s": percentile(total, 0.5), "total_p99_s": percentile(total, 0.99),
        "ratio_p50": percentile(ttft, 0.5) / percentile(total, 0.5),
        "ratio_per_request_median": statistics.median(ratios), "ratio_per_request_max": max(ratios),
        "restarted": sum(1 for r in rows if r["restarts"]),
        "reasons": {k: sum(1 for r in rows if r["reason"] == k) for k in sorted({r["reason"] for r in rows})},
        "long_answers": len(long),
        "long_ratio_p50": (percentile([r["ttft_s"] for r in long], 0.5) / percentile([r["total_s"] for r in long], 0.5)
                           if long else None),
    }


def run_point(name: str, requests, args, work: Path) -> dict:
    """One server on point `name`: warm-up, the check against non-streamed answers, then both passes."""
    import httpx

    folder = work / name
    folder.mkdir()
    op_path = point(name).write_json(folder / "operating_point.json")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "certkv.cli.app", "serve", str(op_path), "--model", MODEL, "--port", str(port),
           "--device", "cpu", "--shadow-rate", "0", "--shadow-store", str(folder / "shadows"), "--timeout", "600",
           "--max-queue", "256", "--seed", "0", *(["--no-prompt-lookup"] if name.endswith(NO_LOOKUP) else [])]
    with open(folder / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(base, proc)
            asyncio.run(closed_loop(base, requests[:2], 1))  # first forwards allocate: not counted
            plain = [httpx.post(base + "/v1/completions", timeout=600, json={
                "context": r.context, "question": r.question}).json()["choices"][0]["text"] for r in requests[:args.check]]
            one, one_s = asyncio.run(closed_loop(base, requests, 1))
            many, many_s = asyncio.run(closed_loop(base, requests, args.concurrency))
        except Exception:
            print(f"{name}: failed (server exit code {proc.poll()}); its log ends:\n"
                  + (folder / "server.log").read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    texts = {r["id"]: r["text"] for r in one}
    return {
        "policy": point(name).policy, "gated": name == "decoding_recompute",
        "streamed_equals_whole": all(texts[r.id] == p for r, p in zip(requests, plain)),
        "concurrency_1": summary(one, one_s, args.min_tokens),
        f"concurrency_{args.concurrency}": summary(many, many_s, args.min_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--min-tokens", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--check", type=int, default=6, help="requests whose streamed answer is compared")
    parser.add_argument("--points", nargs="+", default=list(POINTS))
    parser.add_argument("--seed", type=int, default=4141)
    args = parser.parse_args()
    requests = long_requests(args.requests, args.min_tokens, args.seed)
    points = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.points:
            points[name] = run_point(name, requests, args, Path(tmp))
            c1 = points[name]["concurrency_1"]
            print(f"{name:20s} ttft p50 {c1['ttft_p50_s']:.3f}s p99 {c1['ttft_p99_s']:.3f}s  total p50 "
                  f"{c1['total_p50_s']:.3f}s p99 {c1['total_p99_s']:.3f}s  ratio {c1['ratio_p50']:.3f}", flush=True)
    ungated = {n: p["concurrency_1"]["ratio_p50"] for n, p in points.items() if not p["gated"]}
    out = {
        "benchmark": "streaming",
        "command": "python benchmarks/streaming.py" + ("" if args.requests == 24 else f" --requests {args.requests}"),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "model": MODEL, "max_new_tokens": MAX_NEW_TOKENS, "min_tokens": args.min_tokens, "seed": args.seed,
        "concurrency": args.concurrency, "target": TARGET, "points": points,
        "target_met_by": sorted(n for n, ratio in ungated.items() if ratio <= TARGET),
    }
    RESULT.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(REPO)}; target {TARGET}× met by: {out['target_met_by'] or 'none'}")


if __name__ == "__main__":
    main()
