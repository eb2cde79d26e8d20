"""Capacity under a KV budget on long generations: ``python benchmarks/capacity_long.py``.

It reuses
:mod:`capacity`'s server and point helpers; :mod:`capacity` does not import it back.

Where decoding holds memory for a hundred steps and more, does a point that keeps less KV serve
more? The same traffic goes, closed loop through the official ``openai`` client at concurrency 32,
to a real ``certkv serve`` of the embedded-recite model (``--model embedded-recite``) under one
``--kv-budget``, once per point (each its own server), passes round robin:

* ``full``: the full cache (every request holds its whole prefill and its answer's room while it decodes);
* ``half``: StreamingLLM keeping half of the prefill, ungated (on the engine's single-prefill
  path: under ``certkv serve`` its prefill is pruned layer by layer, so it reserves the kept
  entries and room of every layer plus one full layer, :mod:`certkv.engine.layer_pruning`);
* ``decoding``: kvpress's CompressionRatioDecodingPress over StreamingLLM, keeping half of the
  tokens seen every 8 decoding steps (the embedded long contract's ``streaming_decoding@0.50``).
  **Uncertified**: the embedded long-generation contract certified nothing at ε = 0.05 under its
  strict prefix agreement (docs/long-generations.md), this candidate included; it is served here
  as a fixed point, for its memory, not its risk.

Traffic: fresh ``builtin:recite`` requests (contexts of 192-256 tokens, answers of 42-126 tokens
reciting the context's records) with ``max_new_tokens`` 140, the contract's. The budget is
``--budget-share`` times the largest full-cache reservation among them. The full cache also runs
with no budget, the machine's own ceiling. The servers run with ``--shadow-rate 0`` (no shadows, no
monitor): both evicted points break many recitations, and a live monitor would rightly send them to
the full cache mid-run, after which the run would measure the full cache under their names.

The decoding-time point decodes as a lane of the server's batch (StreamingLLM's choices survive a
batched forward, :mod:`certkv.engine.decoding_lanes`): it reserves its decode's peak (the context,
the question and the tokens up to the first compression event) and gives slots back at each event,
down to the press's target at the longest answer plus one interval.

Recitations copy their context, so prompt lookup confirms many tokens per forward and an answer
holds its KV for few forwards (a decoding-time lane at most up to its next event, 8 tokens). Every
point therefore runs a second time with ``--no-prompt-lookup`` (one token per request per forward,
as a generation that copies nothing decodes), where memory binds.

Every answer is compared with the in-process runtime's (:meth:`CertifiedRuntime.generate`, one
request at a time), which also gives each request's peak KV under the decoding-time press
(:mod:`certkv.core.kv_cost`) for its target. Targets (issue 41): half ÷ full throughput ≥ 1.6;
decoding ÷ full ≥ 0.8 × (full peak KV ÷ its peak KV); no 5xx; answers equal the in-process ones.
The ``_no_lookup`` ratios compare the points' runs without prompt lookup.
Writes ``benchmarks/results/capacity_long.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capacity import Server, fixed_point, largest_reservation, measure_round_robin  # noqa: E402
from serve_load import REPO  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "capacity_long.json"
MODEL = "embedded-recite"
MAX_NEW = 140
CONTEXT = (192, 256)
DECODING_KWARGS = {"base_press": "streaming_llm", "compression_interval": 8}


#: Every server: no shadows and no monitor (the points are fixed, measured for their memory).
NO_MONITOR = ("--shadow-rate", "0")
#: The second run of the full and half points: one token per request per forward.
NO_LOOKUP = "--no-prompt-lookup"


def points(interval: int = DECODING_KWARGS["compression_interval"]) -> dict:
    """The full cache, a half-KV prefill point and a decoding-time point compressing every `interval` steps."""
    common = {"query_aware": False, "max_new_tokens": MAX_NEW}
    return {
        "full": fixed_point(1.0, **common),
        "half": fixed_point(0.5, press="streaming_llm", **common),
        "decoding": fixed_point(0.5, press="compression_ratio_decoding",
                                press_kwargs={**DECODING_KWARGS, "compression_interval": interval},
                                label="streaming_decoding", **common),
    }


def in_process(ops: dict, requests) -> dict:
    """Per point, the in-process runtime's answers; for the decoding-time point also each request's
    peak KV and the full cache's at its last step (token slots)."""
    import torch

    from certkv.model.generation import encode_request
    from certkv.model.loading import load_model
    from certkv.runtime.certified_runtime import CertifiedRuntime

    torch.set_num_threads(1)
    model, tok = load_model(MODEL, device="cpu")
    out: dict = {}
    for name, op in ops.items():
        runtime = CertifiedRuntime(model, tok, op)
        t0 = time.perf_counter()
        answers = {r.id: runtime.generate(r.context, r.question, r.task).answer for r in requests}
        out[name] = {"answers": answers, "seconds": time.perf_counter() - t0}
        if name == "decoding":
            peaks, fulls = [], []
            for r in requests:
                enc = encode_request(tok, r.context, r.question, r.answer_prefix)
                answered = runtime.path.answer(enc, MAX_NEW, {})
                full = len(enc.context_ids) + len(enc.question_ids) + len(answered.ids) - 1
                fulls.append(full)
                peaks.append(answered.kv_peak * full)
            out[name]["kv_peak_slots"], out[name]["full_peak_slots"] = peaks, fulls
    return out


def run_servers(paths: dict, budget: int, requests, args, work: Path) -> tuple[dict, dict]:
    """Every point under `budget`, with and without prompt lookup, and the full cache unlimited;
    (servers, their final /health KV)."""
    configs = {(name, "budget"): (path, budget, NO_MONITOR) for name, path in paths.items()}
    for name in ("full", "half", "decoding"):
        configs[name, "budget_no_lookup"] = (paths[name], budget, (*NO_MONITOR, NO_LOOKUP))
    configs["full", "unlimited"] = (paths["full"], None, NO_MONITOR)
    starts = {config: (lambda name=config[0], path=path, slots=slots, extra=extra:
                       Server(name, path, slots, args.concurrency, work, model=MODEL, extra=extra))
              for config, (path, slots, extra) in configs.items()}
    return measure_round_robin(starts, requests, args, work)


def summarise(ops, servers, health, alone) -> tuple[dict, dict]:
    runs: dict = {}
    for (name, key), server in servers.items():
        summary = server.summary(health[name, key])
        served = summary.pop("answers")
        expected = alone[name]["answers"]
        summary["answers_equal_in_process"] = served is not None and all(expected[i] == a for i, a in served.items())
        summary["answers_differing"] = None if served is None else sum(expected[i] != a for i, a in served.items())
        summary["server_5xx"] = sum(n for s, n in summary["status"].items() if s.startswith("5"))
        runs.setdefault(name, {"policy": ops[name].policy, "runs": {}})["runs"][key] = summary
    full = runs["full"]["runs"]["budget"]["throughput_rps"]
    dec = alone["decoding"]
    peak_ratio = sum(dec["full_peak_slots"]) / sum(dec["kv_peak_slots"])
    plain = runs["full"]["runs"]["budget_no_lookup"]["throughput_rps"]
    ratios = {
        "half": {"over_full": runs["half"]["runs"]["budget"]["throughput_rps"] / full, "target": 1.6},
        "half_no_lookup": {"over_full": runs["half"]["runs"]["budget_no_lookup"]["throughput_rps"] / plain,
                           "target": 1.6},
        "decoding": {"over_full": runs["decoding"]["runs"]["budget"]["throughput_rps"] / full,
                     "full_peak_over_its_peak": peak_ratio, "target": 0.8 * peak_ratio},
        "decoding_no_lookup": {"over_full": runs["decoding"]["runs"]["budget_no_lookup"]["throughput_rps"] / plain,
                               "full_peak_over_its_peak": peak_ratio, "target": 0.8 * peak_ratio},
    }
    return runs, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description="capacity under a KV budget on long generations")
    parser.add_argument("--requests", type=int, default=160, help="requests per pass")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--budget-share", type=float, default=2.0,
                        help="the budget, in multiples of the largest request's full-cache reservation")
    parser.add_argument("--repeats", type=int, default=3, help="closed-loop passes per server (median throughput)")
    parser.add_argument("--seed", type=int, default=4141, help="seeds the fresh requests (the contract used 4040)")
    parser.add_argument("--output", type=Path, default=RESULT)
    parser.add_argument("--decoding-interval", type=int, default=DECODING_KWARGS["compression_interval"],
                        help="the decoding-time point's compression interval: a chunk of prompt-lookup tokens never "
                             "runs past a compression event")
    args = parser.parse_args()

    from certkv.requests.request_set import generate_requests

    t_start = time.perf_counter()
    requests = generate_requests({"recite": 1.0}, n=args.requests, seed=args.seed, context_length=CONTEXT)
    ops = points(args.decoding_interval)
    work = Path(tempfile.mkdtemp(prefix="capacity_long_"))
    paths = {name: op.write_json(work / f"{name}.json") for name, op in ops.items()}
    largest = largest_reservation(requests, MAX_NEW, MODEL)
    budget = round(args.budget_share * largest)
    alone = in_process(ops, requests)
    servers, health = run_servers(paths, budget, requests, args, work)
    runs, ratios = summarise(ops, servers, health, alone)
    result = {
        "benchmark": "capacity_long",
        "command": "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "traffic": {"model": MODEL, "task": "builtin:recite", "seed": args.seed, "context_length": list(CONTEXT),
                    "max_new_tokens": MAX_NEW, "requests": len(requests), "concurrency": args.concurrency,
                    "repeats": args.repeats},
        "budget": {"largest_full_reservation": largest, "share": args.budget_share, "slots": budget},
        "decoding_press_kwargs": ops["decoding"].press_kwargs, "server_flags": list(NO_MONITOR),
        "in_process_seconds": {name: a["seconds"] for name, a in alone.items()},
        "points": runs, "ratios": ratios, "wall_seconds": time.perf_counter() - t_start,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    for name, point in runs.items():
        for key, r in point["runs"].items():
            print(f"{name:<9}{key:<10}{r['throughput_rps']:>7.2f} req/s  p50 {r['latency_p50_s']:.2f} s  "
                  f"p99 {r['latency_p99_s']:.2f} s  peak {r['kv_peak']:.0f}  batch {r['max_batch']}  "
                  f"given back {r['given_back']:.0f}  5xx {r['server_5xx']}  equal {r['answers_equal_in_process']}")
    for name, ratio in ratios.items():
        print(f"{name} / full: {ratio['over_full']:.2f}x (target >= {ratio['target']:.2f}x)")
    print(f"wrote {args.output} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
