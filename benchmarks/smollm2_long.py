"""What compressing SmolLM2-135M-Instruct's KV cache breaks in its long answers, and what certifies.

Reads the store of ``contracts/smollm2_long.yaml`` (SmolLM2-135M-Instruct reciting a recipe's steps
or a diary from a context of a few hundred tokens, 128 new tokens; KV formats, alone and beside a
press in three tiers) or of its earlier version (``--contract``: eviction by decoding-time,
prefill-and-decoding and prefill-time presses, certified per task) and writes, torch-free:

1. per task: the full cache's own task quality (ROUGE-L against the recited text, on the
   calibrated requests) and its seconds per request (every candidate, one worker);
2. per candidate and task: the requests it breaks under the contract's task utility (loss above
   τ), under the strict label-free ``prefix_agreement`` (any word changed before the full
   output's end, τ = 0), its mean ROUGE-L against the full output, and the KV it held: peak and
   KV-time, each over the full cache's, and under ``kv_cost: bytes`` their bytes over a 16-bit cache's;
3. the certified point per task (a contract with strata by task) or for all tasks (``all``: a
   pooled contract) under the task utility and under the strict utility (the same records, each
   candidate's loss rescored; the strict contract is a comparison, never deployed);
4. per certificate and utility, each recompute-gated candidate: its signal's AUC for the requests
   its base breaks and the shares it restarts, on the pilot and certification split, and its mean
   KV beside the best ungated certified point's.

An unfinished store gives a preview (``--allow-incomplete``): the JSON says how many of the
contract's requests it holds, and the certificates of a preview promise nothing. Calibrate first,
in the background (it resumes where it stops):

    nohup certkv calibrate contracts/smollm2_long.yaml > calibrate.log &
    python benchmarks/smollm2_long.py         # writes benchmarks/results/smollm2_long.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from certkv.calibration.utility import prefix_agreement, rouge_l_full
from certkv.core.policy_names import REFERENCE_POLICY

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
CONTRACT = REPO / "contracts" / "smollm2_long.yaml"
STRICT_UTILITY = "prefix_agreement"
#: The certificate of a contract without strata, in the per-task tables' place.
POOLED = "all"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def full_cache(rows: list[dict]) -> dict:
    """Per task: requests, the full cache's mean task utility, and engine seconds per request."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["policy"] == REFERENCE_POLICY:
            by_task[r["task"]].append(r)
    out = {}
    for task, full in sorted(by_task.items()):
        spent = [sum(r["seconds_breakdown"].values()) for r in full if r.get("seconds_breakdown")]
        out[task] = {"n": len(full), "utility": _mean([r["utility"] for r in full]),
                     "below_half": sum(r["utility"] < 0.5 for r in full), "seconds_per_request": _mean(spent)}
    return out


def out_of_reach(candidates: dict, planned: int, risk: float, delta: float) -> dict:
    """The candidates an unfinished store already rules out: more requests broken (task utility,
    all tasks) than a certificate on all `planned` requests allows even with the whole of δ spent on
    that candidate (the largest k with ``P(Binomial(planned, ε) <= k) <= δ``), so no remaining
    request can change the verdict. Only for a contract without a pilot, where every request certifies."""
    import numpy as np

    from certkv.core.binomial import binomial_p_value_table

    allowed = np.flatnonzero(binomial_p_value_table(planned, risk) <= delta)
    most = int(allowed[-1]) if allowed.size else -1
    out = {}
    for policy, cand in candidates.items():
        broken = sum(t["task_broken"] for t in cand["tasks"].values())
        if broken > most:
            out[policy] = {"broken": broken, "requests": sum(t["n"] for t in cand["tasks"].values()), "most_allowed": most}
    return out


def _out_of_reach(contract, candidates: dict) -> dict:
    """:func:`out_of_reach` where its count is the certificate's: no gate (a gated candidate breaks
    fewer than its base), no strata (each stratum has its own limit), requests as the sampling unit
    and a planned number of them; else nothing is ruled out early."""
    plain = contract.gate is None and contract.strata is None and contract.requests.group_by != "context"
    if not (plain and contract.requests.limit and candidates):
        return {}
    return out_of_reach(candidates, contract.requests.limit, contract.risk, round(1 - contract.confidence, 10))


def per_candidate(rows: list[dict], tolerance: float) -> dict:
    """Per ungated candidate and task: breaks under the task utility and the strict one, ROUGE-L
    against the full output, peak KV and KV-time (means over the requests)."""
    full = {r["request_id"]: r for r in rows if r["policy"] == REFERENCE_POLICY}
    cells: dict[str, dict] = {}
    for r in rows:
        if r["policy"] == REFERENCE_POLICY:
            continue
        c = cells.setdefault(r["policy"], {"press": r["press"], "kv_retained": r["kv_retained"], "tasks": {}})
        t = c["tasks"].setdefault(r["task"], defaultdict(list))
        reference = full[r["request_id"]]["answer"]
        t["task_broken"].append(r["loss"] > tolerance)
        t["strict_broken"].append(prefix_agreement(r["answer"], reference) < 1.0)
        t["rouge_l_full"].append(rouge_l_full(r["answer"], reference))
        t["kv_peak"].append(r.get("kv_peak", r["kv_retained"]))
        t["kv_time"].append(r.get("kv_time", r["kv_retained"]))
        for key in ("kv_peak_bytes", "kv_time_bytes"):
            if r.get(key) is not None:
                t[key].append(r[key])
    for c in cells.values():
        c["tasks"] = {
            task: {"n": len(t["task_broken"]), "task_broken": sum(t["task_broken"]), "strict_broken": sum(t["strict_broken"]),
                   **{k: _mean(t[k]) for k in ("rouge_l_full", "kv_peak", "kv_time", "kv_peak_bytes", "kv_time_bytes")}}
            for task, t in sorted(c["tasks"].items())
        }
    return cells


def strict_rows(rows: list[dict]) -> list[dict]:
    """The store's rows with each loss rescored under the strict utility (1 − prefix agreement;
    the full cache agrees with itself)."""
    full = {r["request_id"]: r["answer"] for r in rows if r["policy"] == REFERENCE_POLICY}
    out = []
    for r in rows:
        loss = 1.0 - prefix_agreement(r["answer"], full[r["request_id"]])
        out.append({**r, "utility": 1.0 - loss, "utility_full": 1.0, "loss": loss})
    return out


def write_records(rows: list[dict], path: Path) -> None:
    """`rows` as a JSON-lines loss table that `certify_contract` reads like a store's."""
    with path.open("w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def certified(contract, records_file: Path | None, allow_incomplete: bool, rows: list[dict]) -> dict:
    """The certified point per task (the contract's strata; :data:`POOLED` for a contract without
    them) and pooled (a comparison), with each certificate's recompute gates
    (:func:`recompute_per_task`); what refused to certify instead (a loss table read from a file is
    never a preview: too few requests for the pilot is an error there)."""
    from smollm2_ruler import entry_summary

    from certkv.calibration.certification import certify_contract_with_comparison
    from certkv.errors import CertkvError

    try:
        evidence, op, pooled = certify_contract_with_comparison(contract, records_file, allow_incomplete=allow_incomplete)
    except CertkvError as exc:
        return {"strata": {}, "pooled": None, "incomplete": allow_incomplete, "error": str(exc), "recompute": {}}
    entries = op.strata.entries if op.strata else {POOLED: op}
    return {
        "strata": {name: entry_summary(e) for name, e in entries.items()},
        "pooled": entry_summary(pooled) if pooled is not None else None,
        "incomplete": bool(evidence.incomplete),
        "recompute": recompute_per_task(contract, rows, {name: e.to_dict() for name, e in entries.items()}),
    }


def recompute_per_task(contract, rows: list[dict], entries: dict[str, dict]) -> dict[str, dict]:
    """Per task whose stratum was certified (``candidates`` non-empty; a stratum too small to test
    has none): each recompute-gated candidate's signal AUC for the requests its base breaks and the
    shares it restarts, on the pilot and the certification split (``long_generation.recompute_gate``),
    and ``best_ungated_kv``, the mean KV of the most aggressive ungated candidate that certified (1.0
    when none did: the full cache), which a gated candidate's ``mean_memory`` saves against."""
    from long_generation import recompute_gate  # benchmarks/ is the script's folder, on sys.path

    out = {}
    for task, entry in sorted(entries.items()):
        if not entry.get("candidates"):
            continue
        ungated = [c["mean_kv_retained"] for c in entry["candidates"] if c["certified"] and not (c.get("gate") or {})]
        mine = rows if task == POOLED else [r for r in rows if r["task"] == task]  # the strata are by task
        gates = recompute_gate(contract, mine, entry)
        if any(g["certification"]["n"] != entry["n"] for g in gates):
            raise RuntimeError(f"task {task}: the records' certification split is not the certificate's {entry['n']} requests")
        out[task] = {"best_ungated_kv": min(ungated, default=1.0), "gates": gates}
    return out


def calibration_timing(contract, n: int, previous: Path) -> dict | None:
    """certkv's engine against kvpress's pipeline once per candidate on the first `n` requests
    (``benchmarks/long_generation.py``'s ``timing``, one thread); with n = 0 the timing of the
    `previous` results file, if any, so that a preview of the store keeps its measured cost."""
    if n > 0:
        from long_generation import timing  # benchmarks/ is the script's folder, on sys.path

        return {**timing(contract, n), "command": f"python benchmarks/smollm2_long.py --timing-requests {n}"}
    return json.loads(previous.read_text()).get("timing") if previous.exists() else None


def _shown_path(path: Path) -> str:
    """The contract's path as the results file shows it: from the repository's root, or its name."""
    resolved = path.resolve()
    return resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else path.name


def main() -> None:
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contract", default=str(CONTRACT))
    p.add_argument("--out", default=str(RESULTS / "smollm2_long.json"))
    p.add_argument("--allow-incomplete", action="store_true", help="a preview of an unfinished store (no guarantee)")
    p.add_argument("--timing-requests", type=int, default=0,
                   help="also time the engine against kvpress's pipeline on this many requests (loads the model; "
                        "0 keeps the timing of the last results file)")
    args = p.parse_args()
    t0 = time.perf_counter()
    contract = load_contract(Path(args.contract))
    with CalibrationStore.read(contract.resolved_store_path()) as store:
        rows = list(store.records())
    candidates = per_candidate(rows, contract.tolerance)
    strict = contract.model_copy(update={"utility": STRICT_UTILITY, "tolerance": 0.0})
    with tempfile.TemporaryDirectory() as tmp:
        strict_file, rescored = Path(tmp) / "strict.jsonl", strict_rows(rows)
        write_records(rescored, strict_file)
        certificates = {"task_utility": certified(contract, None, args.allow_incomplete, rows),
                        "strict_utility": certified(strict, strict_file, args.allow_incomplete, rescored)}
    out = {
        "contract": _shown_path(Path(args.contract)),
        "contract_sha256": contract.sha256(),
        "model": contract.model,
        "requests": len({r["request_id"] for r in rows}),
        "requests_planned": contract.requests.limit,
        "source": contract.requests.source,
        "context_length": contract.requests.context_length,
        "seed": contract.requests.seed,
        "query_aware": contract.protocol.query_aware,
        "max_new_tokens": contract.protocol.max_new_tokens,
        "utility": contract.utility,
        "tolerance": contract.tolerance,
        "strict_utility": STRICT_UTILITY,
        "risk": contract.risk,
        "delta": round(1 - contract.confidence, 10),
        "pilot": contract.gate.pilot if contract.gate else None,
        "kv_cost": contract.cost_measure,
        "full_cache": full_cache(rows),
        "candidates": candidates,
        "certified": certificates,
        "out_of_reach": _out_of_reach(contract, candidates),
        "benchmark_seconds": time.perf_counter() - t0,
        "timing": calibration_timing(contract, args.timing_requests, Path(args.out)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("requests", "full_cache", "certified")}, indent=1)[:4000])


if __name__ == "__main__":
    main()
