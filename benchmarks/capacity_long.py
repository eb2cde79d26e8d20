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

Two points store every token at a lower precision (KV formats, docs/kv-formats.md), each decoding
as a lane of the batch that holds its stored tensors (packed integers and float16 scales,
:mod:`certkv.engine.format_lanes`) and reserving those bytes in the budget's token slots of the
model's dtype (:func:`certkv.runtime.format_path.format_slots`):

* ``int8``: integers per token and head, ``{backend: int, nbits: 8}`` alone (``int8@1.00``);
* ``certified``: the point ``certkv certify contracts/embedded_long.yaml`` chose
  (``--certified``, default ``runs/embedded_long/operating_point.json``), served as certified, gate
  included; where that file is missing or its point is the full cache, keys at 8 and values at 4
  bits alone (``kint8-vint4@1.00``) stand in, and the result says so (``certified_source``).

Every answer is compared with the in-process runtime's (:meth:`CertifiedRuntime.generate`, one
request at a time), which also gives each request's peak KV under the decoding-time press
(:mod:`certkv.core.kv_cost`) and, for a format point, its peak bytes over a 16-bit full cache's
(``kv_peak_bytes``; a format alone holds a constant share, its ``bytes_share``) for their targets.
Targets (issue 41): half ÷ full throughput ≥ 1.6; decoding ÷ full ≥ 0.8 × (full peak KV ÷ its peak
KV); (issue 53) a format point ÷ full ≥ 0.8 ÷ its peak KV bytes, int8 also ≥ 1.5; no 5xx; answers
equal the in-process ones. The ``_no_lookup`` ratios compare the points' runs without prompt lookup.
Each server's /metrics at the end gives its peak KV in bytes (``certkv_kv_peak_slots`` ×
``certkv_kv_slot_bytes``).

The machine may be shared: each pass records the cores the rest of the machine used meanwhile
(``/proc/stat`` less the server's and the client's), starts once that is under 0.3 of a core (at most
15 minutes' wait), and a pass during which it was over half a core runs once more, the first one
kept in the result as discarded (its throughput and status codes; its 5xx counted apart).
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
#: The KV format points: int8 alone, and what stands in for the certified point when there is none.
INT8 = {"backend": "int", "nbits": 8}
SPLIT_K8V4 = {"backend": "split", "keys": {"backend": "int", "nbits": 8}, "values": {"backend": "int", "nbits": 4}}
CERTIFIED = REPO / "runs" / "embedded_long" / "operating_point.json"
#: Issue 53's floor for int8 alone, beside 0.8 ÷ its peak KV bytes.
INT8_FLOOR = 1.5
#: The embedded-recite model's head size (a format's bytes share depends on it).
HEAD_DIM = 32


#: Every server: no shadows and no monitor (the points are fixed, measured for their memory).
NO_MONITOR = ("--shadow-rate", "0")
#: The second run of the full and half points: one token per request per forward.
NO_LOOKUP = "--no-prompt-lookup"


def format_point(kv_format: dict, *, query_aware: bool = False, max_new_tokens: int = MAX_NEW):
    """A KV format alone, every token kept (press ``none``, ``kv_retained`` 1.0), ungated, outside any
    certificate, as :func:`capacity.fixed_point` builds the others; its bytes are the format's share."""
    from certkv.core.operating_point import OperatingPoint
    from certkv.core.policy_names import NO_PRESS
    from certkv.kv_formats.spec import parse_format

    fmt = parse_format(kv_format)
    base = fixed_point(1.0, query_aware=query_aware, max_new_tokens=max_new_tokens)
    policy, share = f"{fmt.name}@1.00", fmt.bytes_share(HEAD_DIM)
    return OperatingPoint(**{**base.model_dump(), "policy": policy, "base_policy": policy, "press": NO_PRESS,
                             "fallback": False, "reason": None, "kv_format": fmt.model_dump(),
                             "peak_kv_bytes": share, "mean_kv_bytes": share})


def certified_point(path: Path) -> tuple:
    """(the point certified on contracts/embedded_long.yaml, where it came from): the file at `path`,
    or keys at 8 and values at 4 bits alone where it is missing or certifies the full cache."""
    from certkv.core.operating_point import load_operating_point

    if not path.is_file():
        return format_point(SPLIT_K8V4), f"stand-in: {path.name} not found, keys at 8 and values at 4 bits alone"
    op = load_operating_point(path)
    if op.fallback:
        return format_point(SPLIT_K8V4), (f"stand-in: {path.name} certifies the full cache ({op.reason}), "
                                           "keys at 8 and values at 4 bits alone")
    return op, f"certified: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}"


def points(interval: int = DECODING_KWARGS["compression_interval"], certified=None) -> dict:
    """The full cache, a half-KV prefill point, a decoding-time point compressing every `interval` steps,
    int8 alone and `certified` (the certified point, or its stand-in; None: left out)."""
    common = {"query_aware": False, "max_new_tokens": MAX_NEW}
    ops = {
        "full": fixed_point(1.0, **common),
        "half": fixed_point(0.5, press="streaming_llm", **common),
        "decoding": fixed_point(0.5, press="compression_ratio_decoding",
                                press_kwargs={**DECODING_KWARGS, "compression_interval": interval},
                                label="streaming_decoding", **common),
        "int8": format_point(INT8, **common),
    }
    if certified is not None:
        ops["certified"] = certified
    return ops


def in_process(ops: dict, requests) -> dict:
    """Per point, the in-process runtime's answers; for the decoding-time point also each request's
    peak KV and the full cache's at its last step (token slots); for a KV format point each request's
    peak bytes over a 16-bit full cache's (the runtime's ``kv_peak_bytes``; a full-cache answer, or
    none measured, counts 1.0, as certify counts a gate's) and the slots the server reserves for it
    beside the full cache's (:func:`~certkv.runtime.format_path.format_slots`, ``prefill_slots``)."""
    import torch

    from certkv.kv_formats.spec import stored_share
    from certkv.model.generation import encode_request
    from certkv.model.loading import load_model
    from certkv.runtime.certified_runtime import CertifiedRuntime
    from certkv.runtime.format_path import format_slots
    from certkv.runtime.full_path import prefill_slots

    torch.set_num_threads(1)
    model, tok = load_model(MODEL, device="cpu")
    out: dict = {}
    for name, op in ops.items():
        runtime = CertifiedRuntime(model, tok, op)
        t0 = time.perf_counter()
        answers = {r.id: runtime.generate(r.context, r.question, r.task).answer for r in requests}
        out[name] = {"answers": answers, "seconds": time.perf_counter() - t0}
        if runtime.kv_format is not None:
            peaks, reserved, full_reserved = [], [], []
            for r in requests:
                enc = encode_request(tok, r.context, r.question, r.answer_prefix)
                answered = runtime.path.answer(enc, MAX_NEW, {})
                peaks.append(1.0 if answered.reason is not None or answered.kv_peak_bytes is None
                             else answered.kv_peak_bytes)
                reserved.append(format_slots(model, runtime.kv_format, enc, MAX_NEW))
                full_reserved.append(prefill_slots(model, enc, MAX_NEW))
            out[name].update(kv_peak_bytes=peaks, reserved_slots=reserved, full_reserved_slots=full_reserved,
                             bytes_share=runtime.kv_format.bytes_share(HEAD_DIM),
                             stored_share=stored_share(runtime.kv_format, HEAD_DIM),
                             model_layers=model.config.num_hidden_layers,
                             model_bits=8 * next(model.parameters()).element_size())
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


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used so far (Linux /proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


#: A pass starts once the rest of the machine uses fewer cores than this (over 5 s, for at most
#: QUIET_WAIT seconds); a pass during which it used more than BUSY cores is run once more, the first
#: kept in the result as discarded.
QUIET, BUSY, QUIET_WAIT = 0.3, 0.5, 900.0


def others_cores(seconds: float = 5.0) -> float:
    """Cores the machine used over `seconds`, this process's aside (the servers are idle between passes)."""
    busy0, own0 = machine_busy_seconds(), time.process_time()
    time.sleep(seconds)
    return max(0.0, machine_busy_seconds() - busy0 - (time.process_time() - own0)) / seconds


def wait_quiet() -> float:
    """Seconds waited for the rest of the machine to use fewer than QUIET cores (at most QUIET_WAIT)."""
    t0 = time.monotonic()
    while others_cores() >= QUIET and time.monotonic() - t0 < QUIET_WAIT:
        pass
    return time.monotonic() - t0


class MetricServer(Server):
    """A :class:`capacity.Server` that also reads its /metrics' KV gauges before it stops, and records
    per pass the CPU the rest of the machine used meanwhile (neither this server nor the client): the
    machine is shared, so a pass waits for it to be quiet and one it was busy during runs again."""

    GAUGES = ("certkv_kv_slot_bytes", "certkv_kv_peak_slots", "certkv_kv_budget_bytes", "certkv_kv_budget_slots")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.discarded: list[dict] = []

    def decode_steps(self) -> int:
        import httpx

        return httpx.get(self.base + "/health", timeout=10).json()["kv"]["decode_steps"]

    def measure(self, requests, concurrency: int) -> None:
        for attempt in range(2):
            waited = wait_quiet()
            busy0, steps0 = machine_busy_seconds(), self.decode_steps()
            super().measure(requests, concurrency)
            rep = self.repeats[-1]
            others = machine_busy_seconds() - busy0 - rep["server_cpu"] - rep["client_cpu"]
            rep["others_cpu_per_wall_s"], rep["waited_for_quiet_s"] = max(0.0, others) / rep["seconds"], waited
            rep["decode_steps"] = self.decode_steps() - steps0
            if rep["others_cpu_per_wall_s"] <= BUSY or attempt == 1:
                return
            self.discarded.append(self.repeats.pop())

    def stop(self) -> dict | None:
        import httpx

        try:
            text = httpx.get(self.base + "/metrics", timeout=10).text
            gauges = {name: float(value) for name, value in
                      (line.split()[:2] for line in text.splitlines() if line and not line.startswith("#"))
                      if name in self.GAUGES}
        except httpx.HTTPError:
            gauges = {}
        kv = super().stop()
        return None if kv is None else {**kv, "metrics": gauges}


def run_servers(paths: dict, budget: int, requests, args, work: Path) -> tuple[dict, dict]:
    """Every point under `budget`, with and without prompt lookup, and the full cache unlimited;
    (servers, their final /health KV and /metrics KV gauges)."""
    configs = {(name, "budget"): (path, budget, NO_MONITOR) for name, path in paths.items()}
    for name in paths:
        configs[name, "budget_no_lookup"] = (paths[name], budget, (*NO_MONITOR, NO_LOOKUP))
    configs["full", "unlimited"] = (paths["full"], None, NO_MONITOR)
    starts = {config: (lambda name=config[0], path=path, slots=slots, extra=extra:
                       MetricServer(name, path, slots, args.concurrency, work, model=MODEL, extra=extra))
              for config, (path, slots, extra) in configs.items()}
    return measure_round_robin(starts, requests, args, work)


def format_ratios(runs: dict, alone: dict, name: str) -> dict:
    """A KV format point's throughput over the full cache's, with and without prompt lookup, beside its
    target: 0.8 ÷ its mean peak KV bytes over a 16-bit full cache's (int8 alone: also ≥ 1.5)."""
    point = alone[name]
    peak = sum(point["kv_peak_bytes"]) / len(point["kv_peak_bytes"])
    floor = INT8_FLOOR if name == "int8" else None
    target = max(0.8 / peak, floor or 0.0)
    reserved = sum(point["full_reserved_slots"]) / sum(point["reserved_slots"])
    out = {}
    for suffix, key in (("", "budget"), ("_no_lookup", "budget_no_lookup")):
        full = runs["full"]["runs"][key]["throughput_rps"]
        out[name + suffix] = {"over_full": runs[name]["runs"][key]["throughput_rps"] / full, "peak_kv_bytes": peak,
                              "bytes_share": point["bytes_share"], "target_bytes": 0.8 / peak, "floor": floor,
                              "target": target, "full_reserved_over_its_reserved": reserved}
    return out


def summarise(ops, servers, health, alone) -> tuple[dict, dict]:
    runs: dict = {}
    for (name, key), server in servers.items():
        summary = server.summary(health[name, key])
        served = summary.pop("answers")
        expected = alone[name]["answers"]
        summary["answers_equal_in_process"] = served is not None and all(expected[i] == a for i, a in served.items())
        summary["answers_differing"] = None if served is None else sum(expected[i] != a for i, a in served.items())
        summary["server_5xx"] = sum(n for s, n in summary["status"].items() if s.startswith("5"))
        gauges = health[name, key].get("metrics", {})
        summary["kv_slot_bytes"] = gauges.get("certkv_kv_slot_bytes")
        summary["kv_peak_bytes"] = (gauges["certkv_kv_peak_slots"] * gauges["certkv_kv_slot_bytes"]
                                    if "certkv_kv_peak_slots" in gauges and "certkv_kv_slot_bytes" in gauges else None)
        summary["kv_budget_bytes"] = gauges.get("certkv_kv_budget_bytes")
        summary["others_cpu_per_wall_s_each"] = [rep["others_cpu_per_wall_s"] for rep in server.repeats]
        summary["waited_for_quiet_s_each"] = [rep["waited_for_quiet_s"] for rep in server.repeats]
        summary["decode_steps_each"] = [rep["decode_steps"] for rep in server.repeats]
        summary["step_seconds_each"] = [rep["seconds"] / rep["decode_steps"] if rep["decode_steps"] else None
                                        for rep in server.repeats]
        summary["tokens_per_step_each"] = [
            sum(r["tokens"] for r in rep["rows"] if r["status"] == 200) / rep["decode_steps"] if rep["decode_steps"]
            else None for rep in server.repeats]
        summary["discarded_passes"] = [
            {"throughput_rps": sum(r["status"] == 200 for r in rep["rows"]) / rep["seconds"],
             "others_cpu_per_wall_s": rep["others_cpu_per_wall_s"],
             "status": {str(s): sum(r["status"] == s for r in rep["rows"]) for s in sorted({r["status"] for r in rep["rows"]})}}
            for rep in server.discarded]
        summary["server_5xx_discarded"] = sum(n for rep in summary["discarded_passes"]
                                              for s, n in rep["status"].items() if s.startswith("5"))
        entry = runs.setdefault(name, {"policy": ops[name].policy, "kv_format": ops[name].kv_format,
                                       "gate": None if ops[name].gate is None else ops[name].gate.kind, "runs": {}})
        entry["runs"][key] = summary
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
    for name in runs:
        if "kv_peak_bytes" in alone[name]:
            ratios.update(format_ratios(runs, alone, name))
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
    parser.add_argument("--certified", type=Path, default=CERTIFIED,
                        help="the operating point certified on contracts/embedded_long.yaml (missing, or the full "
                             "cache: keys at 8 and values at 4 bits alone stand in)")
    args = parser.parse_args()

    from certkv.requests.request_set import generate_requests

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    requests = generate_requests({"recite": 1.0}, n=args.requests, seed=args.seed, context_length=CONTEXT)
    certified, certified_source = certified_point(args.certified)
    ops = points(args.decoding_interval, certified)
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
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "load_average_1m_before": round(load_before, 2),
                    "load_average_1m_after": round(os.getloadavg()[0], 2)},
        "traffic": {"model": MODEL, "task": "builtin:recite", "seed": args.seed, "context_length": list(CONTEXT),
                    "max_new_tokens": MAX_NEW, "requests": len(requests), "concurrency": args.concurrency,
                    "repeats": args.repeats},
        "budget": {"largest_full_reservation": largest, "share": args.budget_share, "slots": budget},
        "decoding_press_kwargs": ops["decoding"].press_kwargs, "server_flags": list(NO_MONITOR),
        "certified_source": certified_source,
        "certified_point": {"policy": certified.policy, "kv_format": certified.kv_format, "press": certified.press,
                            "kv_retained": certified.kv_retained, "peak_kv_bytes": certified.peak_kv_bytes,
                            "gate": None if certified.gate is None else certified.gate.model_dump(),
                            "engine_setting": certified.engine_setting},
        "in_process_seconds": {name: a["seconds"] for name, a in alone.items()},
        "format_kv": {name: {"bytes_share": a["bytes_share"], "stored_share": a["stored_share"],
                             "model_layers": a["model_layers"], "model_bits": a["model_bits"],
                             "mean_kv_peak_bytes": sum(a["kv_peak_bytes"])
                             / len(a["kv_peak_bytes"]), "mean_reserved_slots": sum(a["reserved_slots"]) / len(requests),
                             "mean_full_reserved_slots": sum(a["full_reserved_slots"]) / len(requests)}
                      for name, a in alone.items() if "kv_peak_bytes" in a},
        "points": runs, "ratios": ratios, "wall_seconds": time.perf_counter() - t_start,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    for name, point in runs.items():
        for key, r in point["runs"].items():
            print(f"{name:<10}{key:<17}{r['throughput_rps']:>7.2f} req/s  p50 {r['latency_p50_s']:.2f} s  "
                  f"p99 {r['latency_p99_s']:.2f} s  peak {r['kv_peak']:.0f} ({r['kv_peak_bytes'] or 0:,.0f} B)  "
                  f"batch {r['max_batch']}  "
                  f"given back {r['given_back']:.0f}  5xx {r['server_5xx']}  equal {r['answers_equal_in_process']}")
    for name, ratio in ratios.items():
        print(f"{name} / full: {ratio['over_full']:.2f}x (target >= {ratio['target']:.2f}x)")
    print(f"wrote {args.output} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
