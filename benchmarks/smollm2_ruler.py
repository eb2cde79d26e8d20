"""What certkv certifies on a real model: SmolLM2-135M-Instruct on the natural-English RULER tasks.

Reads the store of ``contracts/smollm2_ruler.yaml`` (600 fresh requests, 35 ungated candidates of 10
presses, query-aware)
and writes what a user choosing a press on this model asks for, torch-free:

1. per task: full-KV exact match on the calibration requests, and per press and retention the
   share of the requests the full cache answers that eviction breaks (context, not a certificate);
2. the certified operating point per task (the contract's strata) and pooled (the same records
   certified with the strata removed, a comparison): policy, gate, violations k of n, the bound,
   the mean KV retained with fallbacks;
3. validation: repeated splits of the certification requests, the share of splits whose choice
   breaks more than ε of the test requests, certkv against empirical thresholding;
4. the gate signals' AUCs for a violation per candidate, over every request the full cache answers
   (pilot ones included: the AUC describes the signal, it certifies nothing) and per task (pooled,
   an AUC partly measures which task a request is): the agreement drop of PAGE (read from 30
   layers here, where the embedded model has 2), the answer's least token probability, and the
   lookahead mass the question and first answer tokens put on evicted entries.

Calibrate first, in the background (it resumes where it stops; 2 Ray workers of one thread each
are 1.27x one process of two threads on 2 cores):

    nohup certkv calibrate contracts/smollm2_ruler.yaml --executor ray --workers 2 --threads-per-worker 1 > calibrate.log &
    python benchmarks/smollm2_ruler.py        # writes benchmarks/results/smollm2_ruler.json

Validation splits the certification requests 90/10 by default: with 150 of them per task, a half
could certify nothing (131 requests without a violation are the least that certifies anything at
ε = δ = 0.05 over 40 sequences), and every split would trivially keep its promise.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from gate_quality import auc

from certkv.core.policy_names import REFERENCE_POLICY

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
CONTRACT = REPO / "contracts" / "smollm2_ruler.yaml"


def entry_summary(op) -> dict:
    """What a certified operating point (or one stratum's entry) chose."""
    return {
        "policy": op.policy,
        "press": op.press,
        "kv_retained": op.kv_retained,
        "gate": op.gate.model_dump() if op.gate is not None else None,
        "gated_share": op.gated_share,
        "mean_kv_retained": op.mean_kv_retained,
        "n": op.n,
        "violations": op.violations,
        "risk_upper_bound": op.risk_upper_bound,
        "fallback": op.fallback,
    }


def certified(contract, evidence, op, pooled) -> dict:
    """Per stratum and pooled, plus the request-weighted mean KV of the stratified point."""
    strata = {name: entry_summary(e) for name, e in (op.strata.entries.items() if op.strata else [])}
    weight = sum(s["n"] for s in strata.values())
    return {
        "strata": strata,
        "stratified_mean_kv_retained": sum(s["n"] * s["mean_kv_retained"] for s in strata.values()) / weight,
        "pooled": entry_summary(pooled) if pooled is not None else None,
        "records_sha256": evidence.records_sha256,
        "contract_sha256": contract.sha256(),
        "notes": op.notes,
        "incomplete": bool(evidence.incomplete),
    }


def validation(contract, evidence, splits: int, fraction: float) -> dict:
    from certkv.calibration.validation_file import run_validation

    result = run_validation(contract, evidence, splits, fraction, seed=0).to_dict()

    def methods(block: dict) -> dict:
        return {
            name: {**{k: m[k] for k in ("exceed_fraction", "exceed_ci_high", "mean_kv_retained", "fallback_share", "chosen")},
                   "mean_test_risk": sum(m["test_risks"]) / len(m["test_risks"]) if m.get("test_risks") else None}
            for name, m in block["methods"].items()
        }

    return {
        "splits": splits,
        "calibration_fraction": fraction,
        "pooled": methods(result),
        "strata": {name: {"n_calibration": s["n_calibration"], "n_test": s["n_test"], **methods(s)}
                   for name, s in (result.get("strata") or {}).items()},
    }


#: Each gate signal, oriented so that larger is more suspicious, read from a candidate's record.
SIGNALS = {
    "agreement_drop": lambda row: None if row.get("agreement_drop") is None else -row["agreement_drop"],
    "confidence": lambda row: None if row.get("confidence_min") is None else -row["confidence_min"],
    "lookahead_mass": lambda row: row.get("lookahead_mass"),
}


def _aucs(signals: dict[str, list], labels: list[bool]) -> dict[str, float | None]:
    out = {}
    for name, values in signals.items():
        pairs = [(v, lab) for v, lab in zip(values, labels) if v is not None]
        out[name] = auc([v for v, _ in pairs], [lab for _, lab in pairs]) if pairs else None
    return out


def per_candidate(rows: list[dict], tolerance: float) -> tuple[dict, dict]:
    """(full-KV exact match per task, per base candidate: breaks per task and signal AUCs).

    A candidate *breaks* a request the full cache answers exactly when its own answer is not exact
    (the contract's loss); AUCs are over those requests of every task (a request the full cache
    fails cannot be broken and is left out)."""
    full = {r["request_id"]: r for r in rows if r["policy"] == REFERENCE_POLICY}
    accuracy: dict[str, list[float]] = defaultdict(list)
    for r in full.values():
        accuracy[r["task"]].append(r["utility"])
    candidates: dict[str, dict] = {}
    for r in rows:
        if r["policy"] == REFERENCE_POLICY or full[r["request_id"]]["utility"] <= 0:
            continue
        c = candidates.setdefault(r["policy"], {"press": r["press"], "kv_retained": r["kv_retained"],
                                                "answered": defaultdict(int), "broken": defaultdict(int),
                                                "labels": [], "signals": defaultdict(list), "task": []})
        broken = r["loss"] > tolerance  # the contract's violation
        c["answered"][r["task"]] += 1
        c["broken"][r["task"]] += broken
        c["labels"].append(broken)
        c["task"].append(r["task"])
        for name, read in SIGNALS.items():
            c["signals"][name].append(read(r))
    out = {}
    for policy, c in candidates.items():
        by_task = {}
        for task in sorted(c["answered"]):
            keep = [i for i, t in enumerate(c["task"]) if t == task]
            by_task[task] = _aucs({k: [v[i] for i in keep] for k, v in c["signals"].items()}, [c["labels"][i] for i in keep])
        out[policy] = {
            "press": c["press"], "kv_retained": c["kv_retained"],
            "broken": {t: f"{c['broken'][t]}/{c['answered'][t]}" for t in sorted(c["answered"])},
            "broken_share": sum(c["labels"]) / len(c["labels"]),
            "auc": _aucs(c["signals"], c["labels"]),
            "auc_per_task": by_task,
        }
    return {t: {"n": len(v), "exact_match": sum(v) / len(v)} for t, v in sorted(accuracy.items())}, out


def engine_seconds(rows: list[dict]) -> float:
    """Mean engine seconds per request: the phases the full row of each request records."""
    spent = [sum(r["seconds_breakdown"].values()) for r in rows if r["policy"] == REFERENCE_POLICY and r.get("seconds_breakdown")]
    return sum(spent) / len(spent)


def main() -> None:
    from certkv.calibration.certification import certify_contract_with_comparison
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contract", default=str(CONTRACT))
    p.add_argument("--splits", type=int, default=1000)
    p.add_argument("--calibration-fraction", type=float, default=0.9)
    p.add_argument("--out", default=str(RESULTS / "smollm2_ruler.json"))
    p.add_argument("--allow-incomplete", action="store_true", help="a preview of an unfinished store (no guarantee)")
    args = p.parse_args()
    t0 = time.perf_counter()
    contract = load_contract(Path(args.contract))
    evidence, op, pooled = certify_contract_with_comparison(
        contract, None, contract_label=args.contract, allow_incomplete=args.allow_incomplete
    )
    with CalibrationStore.read(contract.resolved_store_path()) as store:
        rows = list(store.records())
    accuracy, candidates = per_candidate(rows, contract.tolerance)
    out = {
        "contract": "contracts/smollm2_ruler.yaml",
        "model": contract.model,
        "requests": len({r["request_id"] for r in rows}),
        "source": contract.requests.source,
        "context_length": contract.requests.context_length,
        "seed": contract.requests.seed,
        "query_aware": contract.protocol.query_aware,
        "max_new_tokens": contract.protocol.max_new_tokens,
        "risk": contract.risk,
        "delta": round(1 - contract.confidence, 10),
        "tolerance": contract.tolerance,
        "pilot": contract.gate.pilot if contract.gate else None,
        "presses": sorted({p.press for p in contract.policies}),
        "ungated_candidates": sum(len(p.kv_retained) for p in contract.policies),
        "full_kv_accuracy": accuracy,
        "certified": certified(contract, evidence, op, pooled),
        "validation": validation(contract, evidence, args.splits, args.calibration_fraction),
        "candidates": candidates,
        # one worker's engine time per request (prefill, scoring, every decode), from the full rows
        "engine_seconds_per_request": engine_seconds(rows),
        "benchmark_seconds": time.perf_counter() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("full_kv_accuracy", "certified")}, indent=1)[:4000])


if __name__ == "__main__":
    main()
