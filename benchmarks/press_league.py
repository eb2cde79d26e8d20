"""The certified leaderboard: per press and task, the most aggressive retention certkv certifies.

kvpress's leaderboard ranks presses by average score. A user deploying one wants to know how much
KV it saves *with a certificate* on their traffic; this benchmark answers that for the embedded
model on fresh demo-mix requests (``generate_requests("demo", N, seed=SEED)``, 256–512 tokens; no
shipped file uses that seed), in both protocols (question-agnostic and query-aware).

Per protocol one contract calibrates every press of :data:`PRESSES` at kv_retained 0.9 … 0.1 with
the demo's gates (pilot 25%: confidence, lookahead and learned quantiles) into one store, resumably
(``--work``). Each press is then certified **on its own**, as if a contract had named it alone,
at ε = δ = 0.05 on exact match:

* ``certified`` — its ungated sequence (no pilot needed, so every request certifies), per task
  (``strata: {by: task}``, each task at δ on its own) and pooled: the most aggressive certified
  retention (1.0: nothing certified) and the pooled operating point's mean KV retained;
* ``gated`` — its ungated and gated sequences together (fixed-sequence, δ split over them; the
  pilot places the gates and never certifies): the chosen policy and its mean KV retained, the
  full-cache share of gated requests included. Choosing among gate settings is family-wise
  controlled, never "the best that passed".

Presses that cannot run on this model are listed with the registry's reason. The **cost per
request** relative to the full cache is measured apart, in the same run: the runtime of each press
at kv_retained 0.5 (ungated) and of the full cache answer ``--cost-requests`` fresh requests
(seed ``COST_SEED``), each ``--reps`` times in rotating order, fastest counts; the ratio of the
summed times is reported.

    python benchmarks/press_league.py                       # writes benchmarks/results/press_league.json
    python benchmarks/press_league.py --n 200 --quick       # a smoke run (not a result)

The calibration is long (every press at nine retentions, twice): it resumes where it stopped when
run again with the same ``--work`` folder; ``--log`` names a progress log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).parent))

RESULTS = Path(__file__).parent / "results"
SEED = 2612
COST_SEED = 2613
CONTEXT = "256-512"
KV = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
EPS, DELTA = 0.05, 0.05
PROTOCOLS = {"question_agnostic": False, "query_aware": True}

#: (label, registry name, press_kwargs): kvpress's presses, certkv's own, the response-aware ones.
PRESSES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("snapkv", "snapkv", {}),
    ("streaming_llm", "streaming_llm", {}),
    ("knorm", "knorm", {}),
    ("tova", "tova", {}),
    ("expected_attention", "expected_attention", {}),
    ("keydiff", "keydiff", {}),
    ("pyramidkv", "pyramidkv", {}),
    ("adakv", "adakv", {"press": "snapkv"}),
    ("criticalkv", "criticalkv", {"press": "snapkv"}),
    ("kvzip", "kvzip", {}),
    ("fastkvzip", "fastkvzip", {}),
    ("kvzap", "kvzap", {}),
    ("restorekv", "restorekv", {}),
    ("duo_attention", "duo_attention", {}),
    ("value_diff", "value_diff", {}),
    ("probabilistic", "probabilistic", {}),
    ("deferkv", "deferkv", {}),
    ("lorekv", "lorekv", {}),
    ("behavior_preserving", "behavior_preserving", {}),
)

GATE = {
    "pilot": 0.25,
    "confidence": {"quantiles": [0.1, 0.2, 0.3]},
    "lookahead": {"quantiles": [0.3, 0.4, 0.5]},
    "learned": {"quantiles": [0.3, 0.4, 0.5]},
}


def refusal(name: str, kwargs: dict[str, Any], query_aware: bool) -> str | None:
    """Why a press cannot be calibrated here under a protocol (the contract check's one line), or None."""
    from certkv.contract.loading import parse_contract
    from certkv.errors import CertkvError

    try:
        parse_contract(contract_data([(name, name, kwargs)], query_aware, "probe.jsonl", gates=False))
    except CertkvError as exc:
        return str(exc)
    return None


def contract_data(presses, query_aware: bool, requests: str, gates: bool = True) -> dict[str, Any]:
    """The league's contract for one protocol: every press at every retention, the demo's gates."""
    data: dict[str, Any] = {
        "name": "press-league-" + ("query-aware" if query_aware else "question-agnostic"),
        "model": "embedded",
        "requests": {"source": requests},
        "protocol": {"query_aware": query_aware, "max_new_tokens": 8, "device": "cpu"},
        "utility": "exact_match",
        "tolerance": 0.0,
        "risk": EPS,
        "confidence": 1 - DELTA,
        "procedure": "fixed_sequence",
        "policies": [
            {"press": name, "kv_retained": list(KV), "label": label, **({"press_kwargs": kwargs} if kwargs else {})}
            for label, name, kwargs in presses
        ],
        "store": "store",
    }
    if gates:
        data["gate"] = GATE
    return data


def calibrate_protocol(work: Path, protocol: str, presses, n: int, log) -> Path:
    """Write the requests and contract of `protocol` under `work` and calibrate (resumes)."""
    from certkv.calibration.run import calibrate
    from certkv.contract.loading import load_contract
    from certkv.requests.request_set import generate_requests, write_jsonl

    folder = work / protocol
    folder.mkdir(parents=True, exist_ok=True)
    requests = folder / "requests.jsonl"
    if not requests.exists():
        write_jsonl(generate_requests("demo", n, seed=SEED, context_length=CONTEXT), requests)
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump(contract_data(presses, PROTOCOLS[protocol], "requests.jsonl"), sort_keys=False))
    start = time.perf_counter()
    log(f"{protocol}: calibrating {len(presses)} presses x {len(KV)} retentions on {n} requests")
    summary = calibrate(load_contract(path), quiet=True)
    log(f"{protocol}: calibrated {summary.calibrated}, skipped {len(summary.skipped)} in {time.perf_counter() - start:.0f} s")
    return path


def press_of(spec, policy: str) -> str:
    """The press label of a candidate (its ungated base policy's name before ``@``)."""
    return spec.candidate_info[policy].base_policy.split("@")[0]


def keeps_full_cache(name: str, kwargs: dict[str, Any]) -> bool:
    """Whether the engine runs the press from its single full prefill (fast, probabilistic or
    response-aware): only then are the lookahead signals recorded, which the lookahead and learned
    gates read; a pipeline-path press is gated by the answer's confidence only."""
    from certkv.engine.engine import is_probabilistic_press
    from certkv.engine.scoring import is_fast_path_press
    from certkv.presses.registry import build_press
    from certkv.presses.response_aware import is_response_aware_press

    press = build_press(name, 0.5, kwargs)
    return is_fast_path_press(press) or is_probabilistic_press(press) or is_response_aware_press(press)


def certify_press(evidence, spec, label: str, full_cache: bool) -> dict[str, Any]:
    """One press certified alone: its ungated ladder (per task and pooled) and with its gates."""
    from certkv.core.certify import certify
    from certkv.core.spec import StrataConfig

    def usable(seq: list[str]) -> bool:
        gate = spec.candidate_info[seq[0]].pilot_gate
        return full_cache or gate is None or gate.pilot_kind == "confidence"

    own = [seq for seq in spec.sequences if press_of(spec, seq[0]) == label and usable(seq)]
    ungated = [seq for seq in own if spec.candidate_info[seq[0]].gate is None and spec.candidate_info[seq[0]].pilot_gate is None]
    plain = spec.model_copy(update={"sequences": ungated, "pilot": None, "strata": None,
                                    "candidate_info": {p: spec.candidate_info[p] for seq in ungated for p in seq}})
    pooled = certify(evidence.table, plain, records_sha256=evidence.records_sha256)
    per_task = certify(evidence.table, plain.model_copy(update={"strata": StrataConfig(by="task", simultaneous=False)}),
                       records_sha256=evidence.records_sha256)
    gated = certify(evidence.table, spec.model_copy(update={"sequences": own, "strata": None}),
                    records_sha256=evidence.records_sha256)
    assert per_task.strata is not None
    return {
        "sequences": len(own),
        "certified": {
            "pooled": {"kv_retained": 1.0 if pooled.fallback else pooled.kv_retained,
                       "mean_kv_retained": pooled.mean_kv_retained, "n": pooled.n, "violations": pooled.violations},
            "per_task": {
                task: {"kv_retained": 1.0 if entry.fallback else entry.kv_retained, "n": entry.n,
                       "violations": entry.violations}
                for task, entry in sorted(per_task.strata.entries.items())
            },
        },
        "gated": {"policy": gated.policy, "mean_kv_retained": gated.mean_kv_retained, "gated_share": gated.gated_share,
                  "n": gated.n, "violations": gated.violations},
        "violation_rate_by_kv": violation_rates(evidence.table, label),
    }


def violation_rates(table, label: str) -> dict[str, float]:
    """The press's raw violation rate at each retention over every request (context, not a certificate)."""
    out = {}
    for kv in KV:
        policy = f"{label}@{kv:.2f}"
        if policy in table:
            out[f"{kv:.1f}"] = float((table.loss[table.index_of(policy)] > 0).mean())
    return out


def runtime_costs(presses, query_aware: bool, n: int, reps: int, log) -> dict[str, float]:
    """Per press, summed runtime seconds at kv 0.5 over the full cache's, on the same requests."""
    from certkv.model.loading import load_model
    from certkv.requests.request_set import generate_requests
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tokenizer = load_model("embedded", device="cpu")
    runtimes = {"full": CertifiedRuntime(model, tokenizer, point("full", "full", 1.0, True, query_aware))}
    for label, name, kwargs in presses:
        op = point(f"{label}@0.50", name, 0.5, False, query_aware, kwargs)
        runtimes[label] = CertifiedRuntime(model, tokenizer, op)
    totals = dict.fromkeys(runtimes, 0.0)
    names = list(runtimes)
    for i, req in enumerate(generate_requests("demo", n, seed=COST_SEED, context_length=CONTEXT)):
        best = dict.fromkeys(names, float("inf"))
        for rep in range(reps):
            for k in range(len(names)):
                name = names[(i + rep + k) % len(names)]
                t = time.perf_counter()
                runtimes[name].generate(req.context, req.question, answer_prefix=req.answer_prefix)
                best[name] = min(best[name], time.perf_counter() - t)
        for name in names:
            totals[name] += best[name]
    log(f"costs ({'query-aware' if query_aware else 'question-agnostic'}): full {totals['full']:.2f} s over {n} requests")
    return {label: totals[label] / totals["full"] for label in names if label != "full"}


def point(policy: str, press: str, kv: float, fallback: bool, query_aware: bool, kwargs=None):
    """A deployable operating point without certification behind it (a cost measurement only)."""
    from runtime_cost import operating_point

    op = operating_point(policy, press, kv, fallback=fallback)
    return op.model_copy(update={"query_aware": query_aware, "press_kwargs": dict(kwargs or {})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1200, help="fresh demo-mix requests per protocol")
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "certkv-press-league")
    parser.add_argument("--cost-requests", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--presses", help="comma-separated labels (default: all)")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--quick", action="store_true", help="a smoke run: writes nothing to benchmarks/results")
    parser.add_argument("--log", type=Path, help="append progress lines here too")
    args = parser.parse_args()

    def log(line: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
        print(stamped, flush=True)
        if args.log:
            with args.log.open("a") as fh:
                fh.write(stamped + "\n")

    from certkv.calibration.certification import load_records
    from certkv.contract.loading import load_contract
    from certkv.contract.spec import certification_spec

    chosen = [p for p in PRESSES if not args.presses or p[0] in args.presses.split(",")]
    out: dict[str, Any] = {
        "config": {"n": args.n, "seed": SEED, "context_length": CONTEXT, "kv_retained": list(KV), "risk": EPS,
                   "delta": DELTA, "utility": "exact_match", "gate": GATE, "cost_requests": args.cost_requests,
                   "cost_seed": COST_SEED, "reps": args.reps, "cpu_threads": _threads()},
        "protocols": {},
    }
    for protocol in args.protocols.split(","):
        refused = {label: reason for label, name, kwargs in chosen if (reason := refusal(name, kwargs, PROTOCOLS[protocol]))}
        runnable = [p for p in chosen if p[0] not in refused]
        for label, reason in refused.items():
            log(f"{protocol}: refused {label}: {reason}")
        path = calibrate_protocol(args.work, protocol, runnable, args.n, log)
        contract = load_contract(path)
        evidence = load_records(contract)
        spec = certification_spec(contract)
        presses = {
            label: certify_press(evidence, spec, label, keeps_full_cache(name, kwargs)) for label, name, kwargs in runnable
        }
        costs = runtime_costs(runnable, PROTOCOLS[protocol], args.cost_requests, args.reps, log)
        for label, cost in costs.items():
            presses[label]["cost_vs_full"] = cost
        out["protocols"][protocol] = {"records_sha256": evidence.records_sha256, "n": evidence.table.n_requests,
                                      "presses": presses, "refused": refused}
        summary = (f"{k} {v['certified']['pooled']['kv_retained']:.1f}/{v['gated']['mean_kv_retained']:.2f}"
                   for k, v in presses.items())
        log(f"{protocol}: certified (ungated kv / gated mean kv) " + ", ".join(summary))
    target = args.work / "press_league.json" if args.quick else RESULTS / "press_league.json"
    target.write_text(json.dumps(out, indent=2) + "\n")
    log(f"wrote {target}")


def _threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
