"""Long generations: what each policy breaks, what its KV costs, the recompute gate, calibration cost.

Run after calibrating and certifying the contract (default ``contracts/embedded_long.yaml``)::

    certkv calibrate contracts/embedded_long.yaml
    certkv certify contracts/embedded_long.yaml
    python benchmarks/long_generation.py            # writes benchmarks/results/long_generation.json

From the store (every request): per policy, violations under the contract's label-free utility and
under the task's own utility against the references (exact match of the recited list), with the
mean peak and KV-time KV relative to the full cache. From the operating point: the certified
candidate. The recompute gate, per base policy, on the pilot and on the certification split: the
AUC of its signal (the lowest token probability, low = suspect) for the requests the base breaks,
the share each placed threshold restarts, and the share it restarts too late (counted as
violated). Calibration cost: on ``--timing-requests`` requests, certkv's engine for every
candidate against kvpress's own pipeline once per candidate and for the full cache, side by side,
alternating, in one process.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "long_generation.json"


def _rows(contract):
    from certkv.calibration.store import CalibrationStore

    with CalibrationStore.read(contract.resolved_store_path()) as store:
        return store.records()


def policy_table(contract, rows, references) -> list[dict]:
    """Per policy: violations under the contract's utility and the task utility, mean KV costs."""
    from certkv.calibration.utility import score
    from certkv.core.binomial import violation_mask

    full = {r["request_id"]: r["answer"] for r in rows if r["policy"] == "full"}
    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"):
        mine = [r for r in rows if r["policy"] == policy]
        task_loss = [
            score("exact_match", full[r["request_id"]], references[r["request_id"]])
            - score("exact_match", r["answer"], references[r["request_id"]])
            for r in mine
        ]
        out.append({
            "policy": policy,
            "n": len(mine),
            "violations": int(violation_mask([r["loss"] for r in mine], contract.tolerance).sum()),
            "task_violations": int(violation_mask(task_loss, contract.tolerance).sum()),
            "kv_peak": float(np.mean([r["kv_peak"] for r in mine])),
            "kv_time": float(np.mean([r["kv_time"] for r in mine])),
        })
    return out


def recompute_gate(contract, rows, point: dict) -> list[dict]:
    """Per recompute-gated candidate of the operating point: its signal's AUC for the base's broken
    requests and the shares it restarts (in time and too late), on the pilot and certification split."""
    from sklearn.metrics import roc_auc_score

    from certkv.core.binomial import violation_mask

    pilot_ids = set(point["pilot"]["request_ids"]) if point.get("pilot") else set()
    by_policy: dict[str, list[dict]] = {}
    for r in rows:
        by_policy.setdefault(r["policy"], []).append(r)
    out = []
    for cand in point["candidates"]:
        gate = cand.get("gate") or {}
        if gate.get("recompute") is None:
            continue
        threshold = gate["recompute"]
        base = cand["policy"].split("+")[0]
        entry = {"policy": cand["policy"], "threshold": threshold, "certified": cand["certified"],
                 "mean_memory": cand["mean_kv_retained"]}
        for split, keep in (("pilot", True), ("certification", False)):
            mine = [r for r in by_policy[base] if (r["request_id"] in pilot_ids) == keep]
            broken = violation_mask([r["loss"] for r in mine], contract.tolerance)
            low = np.array([r["confidence_min"] for r in mine])
            agreeing = np.array([r["confidence_min_agreeing"] for r in mine])
            restarted = low < threshold
            auc = float(roc_auc_score(broken, -low)) if 0 < broken.sum() < len(mine) else None
            entry[split] = {"n": len(mine), "broken": int(broken.sum()), "auc": auc,
                            "restarted": float(restarted.mean()) if mine else None,
                            "restarted_late": float((restarted & ~(agreeing < threshold)).mean()) if mine else None}
        out.append(entry)
    return out


def timing(contract, n: int) -> dict:
    """certkv's engine (every candidate) against kvpress's pipeline once per candidate and for the
    full cache, on the first `n` requests, in one process; and against its exact floor (the
    prefill, plus :func:`floor_decode_seconds`: the full answer's decode, and beside it every
    candidate's verifying forwards). Also the part of each: the candidates certkv decodes as lanes of one
    drafted batch (the batchable decoding-time ones and the prefill-time ones beside them: the
    engine's ``candidates_decoding`` seconds, the full answer's share apart) against kvpress's
    pipeline for those candidates alone."""
    import kvpress  # noqa: F401  (registers the pipeline)
    import torch
    from transformers import pipeline

    from certkv.calibration.run import load_engine

    torch.set_num_threads(1)
    engine, tok, _ = load_engine(contract, "cpu")
    pipe = pipeline("kv-press-text-generation", model=engine.model, tokenizer=tok, device="cpu")
    requests = contract.load_requests()[:n]
    certkv_s, kvpress_s, lanes_certkv, lanes_kvpress, floor_s = [], [], [], [], []
    for request in requests:
        t0 = time.perf_counter()
        result = engine.run(request.context, request.question, request.answer_prefix)
        certkv_s.append(time.perf_counter() - t0)
        floor_s.append(result.seconds["prefill"] + floor_decode_seconds(engine, request, result))
        t1 = time.perf_counter()
        question = request.question + ("\n" + request.answer_prefix if request.answer_prefix else "")
        pipe(request.context, question=question, max_new_tokens=engine.max_new_tokens)
        in_lanes = 0.0
        for c in engine.candidates:
            t = time.perf_counter()
            pipe(request.context, question=question, press=c.press, max_new_tokens=engine.max_new_tokens)
            in_lanes += time.perf_counter() - t if c in engine.lane_candidates else 0.0
        t2 = time.perf_counter()
        kvpress_s.append(t2 - t1)
        lanes_certkv.append(result.seconds.get("candidates_decoding", 0.0))
        lanes_kvpress.append(in_lanes)
    return {"requests": n, "candidates": len(engine.candidates), "certkv_seconds": float(np.mean(certkv_s)),
            "kvpress_seconds": float(np.mean(kvpress_s)), "speedup": float(np.sum(kvpress_s) / np.sum(certkv_s)),
            # the results file's keys say "rows" for the lanes of the drafted batch (kept: stored results use them)
            "decoding_rows": len(engine.decoding_lanes), "decoding_alone": len(engine.decoding) - len(engine.decoding_lanes),
            "prefill_rows": len(engine.lane_candidates) - len(engine.decoding_lanes),
            "rows_certkv_seconds": float(np.mean(lanes_certkv)), "rows_kvpress_seconds": float(np.mean(lanes_kvpress)),
            "rows_speedup": float(np.sum(lanes_kvpress) / max(np.sum(lanes_certkv), 1e-9)),
            "floor_seconds": float(np.mean(floor_s)), "over_floor": float(np.sum(certkv_s) / np.sum(floor_s)),
            "full_answer_row": bool(engine.decoding_lanes)}


def floor_decode_seconds(engine, request, result) -> float:
    """The exact floor of certkv's scheme for one request, but its prefill (``result.seconds``):
    one batch of the full answer's lane, decoded as the engine decodes it (prompt lookup: it is
    not known yet), and every lane candidate fed the answer it gave as its draft, so that each
    forward confirms all the scheme lets it (its question, then its answer up to each compression
    event) from the request's full prefill. This is what drafting could at best leave: a verifier
    free to feed a question and its answer in one forward would save one forward a batch. Uses the
    engine's own lane builders; meant for contracts whose candidates all decode as lanes (both
    long-generation contracts). Raises when any answer differs from the engine's."""
    from certkv.engine.decoding_lanes import decode_lanes
    from certkv.model.generation import encode_request, for_protocol

    enc = for_protocol(encode_request(engine.tokenizer, request.context, request.question, request.answer_prefix),
                       engine.query_aware)
    prefilled, _ = engine._prefill(enc)
    engine._select(prefilled)
    own = {answer.policy: answer.token_ids for answer in result.candidates}
    t0 = time.perf_counter()
    lead = engine._full_lane(prefilled)
    lanes = [engine._lane(c, prefilled, own[c.policy])[0] for c in engine.lane_candidates]
    decode_lanes(engine.model, [lead, *lanes])
    seconds = time.perf_counter() - t0
    if lead.answer != result.full.token_ids:
        raise RuntimeError(f"{request.id}: the full answer's lane answered otherwise than the engine")
    if any(lane.answer != own[c.policy] for lane, c in zip(lanes, engine.lane_candidates)):
        raise RuntimeError(f"{request.id}: a candidate fed its own answer as its draft answered otherwise")
    return seconds


def _shown(path: Path) -> str:
    """The contract's path relative to the repository when inside it."""
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> None:
    from certkv.contract.loading import load_contract

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contract", default=str(ROOT / "contracts" / "embedded_long.yaml"))
    parser.add_argument("--timing-requests", type=int, default=6)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    contract = load_contract(args.contract)
    rows = _rows(contract)
    references = {r.id: r.answers for r in contract.load_requests()}
    point = json.loads((contract.resolved_store_path() / "operating_point.json").read_text())
    result = {
        "contract": _shown(Path(args.contract)),
        "utility": contract.utility, "tolerance": contract.tolerance, "risk": contract.risk,
        "confidence": contract.confidence, "kv_cost": contract.cost_measure,
        "max_new_tokens": contract.protocol.max_new_tokens,
        "answer_tokens": float(np.mean([len(r["answer"].split()) for r in rows if r["policy"] == "full"])),
        "policies": policy_table(contract, rows, references),
        "chosen": {k: point[k] for k in ("policy", "mean_kv_retained", "fallback", "n", "violations", "risk_upper_bound")},
        "recompute": recompute_gate(contract, rows, point),
        "timing": timing(contract, args.timing_requests),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
