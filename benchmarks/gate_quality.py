"""How well the gate signals predict a violation, and what the gates save on the demo contract.

1. **Signal AUCs per task.** Fresh requests of every built-in task (their own seed, 6061) run
   through the engine with the agreement drop and the lookahead probe on. A candidate *violates*
   when its answer differs from the full-KV answer (the `agreement` utility: labels-free, so it is
   defined on every task, including those the embedded model answers badly). Each signal is
   oriented so that larger means more suspicious (−drop, −confidence, lookahead mass, certificate)
   and its AUC is the probability that a violating request scores above a non-violating one.
2. **Per candidate on the demo mix, with the learned gate.** Demo-mix requests (seed 6062) give
   every signal's AUC and the learned gate's held-out AUC: certkv's own fit (core.pilot) on a
   random half of the requests, scored (core.gate_features) on the other half.
3. **On the demo store** (`certkv demo` from the repository root first: it copies the packaged
   demo into certkv-demo/ and calibrates there): the signals' AUCs for the contract's own
   exact-match violations; the least mean KV certified with and without a gate; the same at other
   risk targets ε (what-ifs on the same records, not certificates); and fixed-sequence against
   pilot_ordered testing (which the demo ships is the one that saves more).

    python benchmarks/gate_quality.py --n 100 --n-demo 400   # writes benchmarks/results/gate_quality.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from certkv.core.policy_names import REFERENCE_POLICY, policy_name

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
#: Where `certkv demo` run from the repository root puts its copy of the demo contract and its store.
DEMO_CONTRACT = REPO / "certkv-demo" / "demo.yaml"
DEMO_STORE = DEMO_CONTRACT.parent / "runs" / "demo"
SEED = 6061
TASKS = ("single_needle", "multi_key", "multi_value", "variable_tracking", "dilution")


def auc(scores, labels) -> float | None:
    """Mann–Whitney AUC of `scores` for positive `labels` (ties count one half); None if one class."""
    import numpy as np
    from scipy.stats import rankdata

    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    ranks = rankdata(scores)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


#: Candidates whose signals are compared (knorm breaks almost every demo request: no AUC there).
SIGNAL_KVS = (0.7, 0.5, 0.3)
SIGNAL_PRESSES = ("snapkv", "streaming_llm", "probabilistic")
#: The probe's answer tokens (the contract default): the question's last query and two fed tokens.
LOOKAHEAD_TOKENS = 2


def run_signals(requests, candidates) -> list[dict]:
    """Every candidate's signals and "violated" label on `requests`, one dict per (request, candidate)."""
    from certkv.engine.engine import Engine
    from certkv.model.loading import load_model

    model, tok = load_model("embedded", device="cpu")
    engine = Engine(model, tok, candidates, agreement={}, lookahead_tokens=LOOKAHEAD_TOKENS)
    rows = []
    for r in requests:
        result = engine.run(r.context, r.question, r.answer_prefix)
        for c in result.candidates:
            rows.append({
                "request_id": r.id, "task": r.task, "policy": c.policy,
                "violated": c.token_ids != result.full.token_ids,
                "agreement_drop": result.agreement_drop, "certificate_max": c.certificate_max,
                "confidence_min": c.confidence_min, "logprob_mean": c.logprob_mean,
                "lookahead_mass": c.lookahead_mass, "lookahead_heads": c.lookahead_heads,
                "context_tokens": result.context_length,
            })
    return rows


def signal_aucs(rows: list[dict]) -> dict:
    """AUC of each signal (oriented so that larger = more suspicious) for `rows` of one candidate."""
    import numpy as np

    violated = [r["violated"] for r in rows]
    out = {
        "agreement_drop": auc([-r["agreement_drop"] for r in rows], violated),
        "confidence_min": auc([-r["confidence_min"] for r in rows], violated),
        "logprob_mean": auc([-r["logprob_mean"] for r in rows], violated),
        "lookahead_mass": auc([r["lookahead_mass"] for r in rows], violated),
    }
    if rows[0]["certificate_max"] is not None:
        out["certificate_max"] = auc([r["certificate_max"] for r in rows], violated)
    heads = np.array([r["lookahead_heads"] for r in rows], dtype=float)
    out["lookahead_heads"] = [auc(heads[:, j], violated) for j in range(heads.shape[1])]
    return out


def learned_auc(rows: list[dict], features: list[str], seed: int) -> dict:
    """Held-out AUC of certkv's learned gate: fit on a random half of the requests (the pilot's
    role), scored on the other half. The fit and the score are certkv's own (core.pilot,
    core.gate_features), the ones certification and the runtime use."""
    import numpy as np

    from certkv.core.gate_features import expand_features, learned_score
    from certkv.core.pilot import fit_learned_gate

    ids = sorted({r["request_id"] for r in rows})
    rng = np.random.default_rng(seed)
    train_ids = set(rng.permutation(ids)[: len(ids) // 2].tolist())
    train = [r for r in rows if r["request_id"] in train_ids]
    test = [r for r in rows if r["request_id"] not in train_ids]
    names = expand_features(features, len(rows[0]["lookahead_heads"]))
    model = fit_learned_gate(train, names, np.array([r["violated"] for r in train]))
    keys = ("lookahead_heads", "confidence_min", "logprob_mean", "agreement_drop", "context_tokens")
    scores = [learned_score(model, {k: r[k] for k in keys}) for r in test]
    return {"auc": auc(scores, [r["violated"] for r in test]), "n_train": len(train), "n_test": len(test),
            "violations_test": int(sum(r["violated"] for r in test))}


def signal_quality(n: int, n_demo: int) -> dict:
    """Signal AUCs per task (agreement violations) and, on the demo mix, per candidate with the
    learned gate's held-out AUC."""
    from certkv.engine.engine import PressCandidate
    from certkv.presses.registry import build_press
    from certkv.requests.request_set import generate_requests

    candidates = [
        PressCandidate(policy_name(press, kv), build_press(press, kv), press, kv) for press in SIGNAL_PRESSES for kv in SIGNAL_KVS
    ]
    out: dict = {"seed": SEED, "requests_per_task": n, "demo_mix_requests": n_demo, "lookahead_tokens": LOOKAHEAD_TOKENS,
                 "by_task": {}, "violations": {}, "demo_mix": {}}
    for task in TASKS:
        rows = run_signals(generate_requests({task: 1.0}, n, seed=SEED, context_length=(256, 512)), candidates)
        out["by_task"][task] = {c.policy: signal_aucs([r for r in rows if r["policy"] == c.policy]) for c in candidates}
        out["violations"][task] = {c.policy: sum(r["violated"] for r in rows if r["policy"] == c.policy) for c in candidates}
        print(task, json.dumps(out["violations"][task]), flush=True)
    rows = run_signals(generate_requests("demo", n_demo, seed=SEED + 1, context_length="256-512"), candidates)
    for c in candidates:
        mine = [r for r in rows if r["policy"] == c.policy]
        entry = {"violations": sum(r["violated"] for r in mine), **signal_aucs(mine)}
        for name, features in LEARNED_FEATURES.items():
            entry[f"learned[{name}]"] = learned_auc(mine, features, seed=SEED)
        out["demo_mix"][c.policy] = entry
        print(c.policy, json.dumps({k: v for k, v in entry.items() if k != "lookahead_heads"}), flush=True)
    return out


#: Feature sets of the learned gate compared (contract names: certkv.contract.schema).
LEARNED_FEATURES = {
    "lookahead+confidence+context_length": ["lookahead", "confidence", "context_length"],
    "lookahead+context_length": ["lookahead", "context_length"],
    "all": ["lookahead", "confidence", "agreement_drop", "context_length"],
}


def best_certified(op) -> tuple:
    """The certified gated and ungated candidates of an operating point with the least mean KV
    (None for a family with nothing certified)."""
    certified = [c for c in op.candidates if c.certified]
    best = {}
    for gated in (True, False):
        family = [c for c in certified if (c.gate is not None) == gated]
        best[gated] = min(family, key=lambda c: c.mean_kv_retained) if family else None
    return best[True], best[False]


def demo_savings() -> dict | None:
    from certkv.core.operating_point import load_operating_point

    path = DEMO_STORE / "operating_point.json"
    if not path.is_file():
        return None
    op = load_operating_point(path)
    g, u = best_certified(op)
    return {
        "chosen": op.policy,
        "chosen_mean_kv": op.mean_kv_retained,
        "best_gated": None if g is None else {"policy": g.policy, "mean_kv": g.mean_kv_retained, "gated_share": g.gated_share},
        "best_ungated": None if u is None else {"policy": u.policy, "mean_kv": u.mean_kv_retained},
        "kv_saved": None if g is None or u is None else u.mean_kv_retained - g.mean_kv_retained,
    }


def demo_savings_by_risk(risks=(0.05, 0.10, 0.15, 0.20)) -> dict | None:
    """What the gate buys at other risk targets: the demo store re-certified with ε replaced (the
    rest of the contract, its 24 sequences and δ included, unchanged). Only ε = the contract's own
    is the demo's certificate; the others are what-ifs on the same records, for sizing the gate,
    not operating points anyone may deploy under the demo contract (ε is fixed before the data).
    ``kv_saved_by_gate`` = least certified mean KV without a gate − least with one, a family with
    nothing certified counting as 1.0 (what would be deployed: the full cache); negative when the
    gate costs KV."""
    from certkv.calibration.certification import load_records
    from certkv.contract.loading import load_contract
    from certkv.contract.spec import certification_spec
    from certkv.core.certify import certify
    from certkv.errors import CertkvError

    contract_path = DEMO_CONTRACT
    try:
        contract = load_contract(contract_path)
        evidence = load_records(contract, None, contract_label=str(contract_path), allow_incomplete=False)
    except CertkvError as error:  # no finished store for this contract yet: run `certkv demo` first
        print(f"demo_by_risk skipped: {error}")
        return None
    spec = certification_spec(contract)
    out = {}
    for risk in risks:
        op = certify(evidence.table, spec.model_copy(update={"risk": risk}))
        best = {
            kind: None if c is None else {"policy": c.policy, "mean_kv": c.mean_kv_retained, "gated_share": c.gated_share}
            for kind, c in zip(("gated", "ungated"), best_certified(op))
        }
        mean_kv = {k: (1.0 if v is None else v["mean_kv"]) for k, v in best.items()}  # nothing certified: full KV
        out[f"{risk:g}"] = {
            "chosen": op.policy, "chosen_mean_kv": op.mean_kv_retained, **{f"best_{k}": v for k, v in best.items()},
            "kv_saved_by_gate": mean_kv["ungated"] - mean_kv["gated"],
        }
    return out


def demo_procedures() -> dict | None:
    """The demo store certified under fixed-sequence testing (δ split over the sequences, the
    demo contract's choice) and under pilot_ordered (one sequence ordered by the pilot's risk, at
    the full δ): which saves more KV. Both are pre-registrable; the demo ships the winner."""
    from certkv.calibration.certification import load_records
    from certkv.contract.loading import load_contract
    from certkv.contract.spec import certification_spec
    from certkv.core.certify import certify
    from certkv.errors import CertkvError

    try:
        contract = load_contract(DEMO_CONTRACT)
        evidence = load_records(contract, None, contract_label=str(DEMO_CONTRACT))
    except CertkvError as error:
        print(f"demo_procedures skipped: {error}")
        return None
    spec = certification_spec(contract)
    out = {}
    for procedure in ("fixed_sequence", "pilot_ordered"):
        op = certify(evidence.table, spec.model_copy(update={"procedure": procedure}))
        out[procedure] = {"chosen": op.policy, "mean_kv": op.mean_kv_retained, "n": op.n, "violations": op.violations,
                          "risk_upper_bound": op.risk_upper_bound, "certified": sum(c.certified for c in op.candidates),
                          "candidates": len(op.candidates)}
    return out


def demo_store_signals() -> dict | None:
    """AUCs of the recorded signals on the demo store itself (exact-match violations): the figures
    the README quotes about the demo contract. The demo contract reads no agreement drop, so its
    store records none; the per-task agreement-drop AUCs above cover it."""
    import numpy as np

    from certkv.calibration.store import CalibrationStore, db_path

    store = DEMO_STORE
    if not db_path(store).is_file():
        return None
    with CalibrationStore.read(store) as s:
        rows = s.records()
    by: dict[str, dict] = {}
    for r in rows:
        by.setdefault(r["policy"], {})[r["request_id"]] = r
    ids = sorted(by[REFERENCE_POLICY])
    out: dict = {}
    for policy in ("snapkv@0.70", "snapkv@0.50", "snapkv@0.30", "streaming_llm@0.50", "probabilistic@0.70",
                   "probabilistic@0.50"):
        recs = [by[policy][i] for i in ids]
        violated = [r["loss"] > 1e-9 for r in recs]
        entry = {
            "violations": int(sum(violated)),
            "confidence_min": auc([-r["confidence_min"] for r in recs], violated),
            "lookahead_mass": auc([r["lookahead_mass"] for r in recs], violated),
            "lookahead_heads": [auc(col, violated) for col in np.array([r["lookahead_heads"] for r in recs]).T.tolist()],
        }
        if recs[0].get("certificate_max") is not None:
            entry["certificate_max"] = auc([r["certificate_max"] for r in recs], violated)
        out[policy] = entry
    return out


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100, help="requests per task")
    p.add_argument("--n-demo", type=int, default=400, help="demo-mix requests for the per-candidate and learned AUCs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--demo-only", action="store_true", help="recompute only the demo-store figures")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = RESULTS / "gate_quality.json"
    if args.demo_only and path.is_file():
        results = json.loads(path.read_text())
    else:
        results = signal_quality(args.n, args.n_demo)
    results["demo"] = demo_savings()
    results["demo_store"] = demo_store_signals()
    results["demo_by_risk"] = demo_savings_by_risk()
    results["demo_procedures"] = demo_procedures()
    print(json.dumps(results["demo_procedures"], indent=1))
    print(json.dumps(results["demo_by_risk"], indent=1))
    print(json.dumps(results["demo_store"], indent=1))
    print(json.dumps(results["demo"], indent=1))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gate_quality.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
