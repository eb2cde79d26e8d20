"""How well the gate signals predict a violation, and what the gate saves on the demo contract.

1. **Agreement-drop AUC per task.** For fresh requests of every built-in task (their own seed), the
   engine records each request's agreement drop and every candidate's answer. A candidate
   *violates* on a request when its answer differs from the full-KV answer (the `agreement`
   utility: labels-free, so it is defined on every task, including those the embedded model
   answers badly). The gate sends low-drop requests to the full cache, so the score is −drop; AUC
   is the probability that a violating request has a lower drop than a non-violating one (0.5:
   no signal). Also reported: the certificate maximum's AUC for the probabilistic candidates.
2. **Certificate vs drop.** Spearman correlation between the two signals (are they redundant?).
3. **On the demo store** (`certkv demo` first): the same AUCs for exact-match violations, the
   drop's correlation with context length, and how many violations each certificate bound
   removes against what escalating the same share at random would remove.
4. **KV saved on the demo contract.** From `certkv certify certkv-demo/demo.yaml`'s operating point
   (`certkv demo` from the repository root first: it copies the packaged demo into certkv-demo/
   and calibrates there): the least mean KV of a certified gated candidate versus the least mean
   KV of a certified ungated one, in the same certification (same family-wise correction); and
   the same comparison with the demo's records re-certified at other risk targets ε (what-ifs
   for sizing the gate: only the contract's own ε is its certificate).

    python benchmarks/gate_quality.py --n 100     # writes benchmarks/results/gate_quality.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from certkv.core.policy_names import REFERENCE_POLICY, gated_policy_name, policy_name

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
#: Where `certkv demo` run from the repository root puts its copy of the demo contract and its store.
DEMO_CONTRACT = REPO / "certkv-demo" / "demo.yaml"
DEMO_STORE = DEMO_CONTRACT.parent / "runs" / "demo"
SEED = 6061
TASKS = ("single_needle", "multi_key", "multi_value", "variable_tracking", "dilution")
KVS = (0.5, 0.3)
PRESSES = ("snapkv", "streaming_llm", "knorm", "probabilistic")


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


def signal_quality(n: int) -> dict:
    import numpy as np
    from scipy.stats import spearmanr

    from certkv.engine.engine import Engine, PressCandidate
    from certkv.model.loading import load_model
    from certkv.presses.registry import build_press
    from certkv.requests.request_set import generate_requests

    model, tok = load_model("embedded", device="cpu")
    candidates = [
        PressCandidate(policy_name(press, kv), build_press(press, kv), press, kv) for press in PRESSES for kv in KVS
    ]
    engine = Engine(model, tok, candidates, agreement={})
    out: dict = {"seed": SEED, "requests_per_task": n, "auc_drop": {}, "auc_certificate": {}, "violations": {},
                 "spearman_drop_vs_certificate": {}}
    for task in TASKS:
        drops, violated, certs = [], {c.policy: [] for c in candidates}, {c.policy: [] for c in candidates}
        for r in generate_requests({task: 1.0}, n, seed=SEED, context_length=(256, 512)):
            result = engine.run(r.context, r.question)
            drops.append(result.agreement_drop)
            for c in result.candidates:
                violated[c.policy].append(c.token_ids != result.full.token_ids)
                certs[c.policy].append(c.certificate_max)
        out["auc_drop"][task] = {p: auc(-np.array(drops), v) for p, v in violated.items()}
        out["violations"][task] = {p: int(sum(v)) for p, v in violated.items()}
        for p, values in certs.items():
            if values[0] is not None:
                out["auc_certificate"].setdefault(task, {})[p] = auc(values, violated[p])
                out["spearman_drop_vs_certificate"].setdefault(task, {})[p] = float(spearmanr(drops, values).statistic)
        print(task, json.dumps({k: out[k][task] for k in ("violations", "auc_drop")}), flush=True)
    return out


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
    from certkv.calibration.records import load_records
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


def demo_store_signals() -> dict | None:
    """AUCs of the recorded signals on the demo store itself (exact-match violations) and what the
    certificate gate removes: the figures the README quotes about the demo contract."""
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
    drop = np.array([by[REFERENCE_POLICY][i]["agreement_drop"] for i in ids], dtype=float)
    context = np.array([by[REFERENCE_POLICY][i].get("context_tokens", np.nan) for i in ids], dtype=float)
    out: dict = {"auc_drop": {}, "auc_certificate": {}, "certificate_gate": {},
                 "corr_drop_context_tokens": float(np.corrcoef(drop, context)[0, 1])}
    for policy in ("snapkv@0.50", "snapkv@0.40", "snapkv@0.30", "streaming_llm@0.90", "probabilistic@0.90",
                   "probabilistic@0.70", "probabilistic@0.50"):
        violated = np.array([by[policy][i]["loss"] > 1e-9 for i in ids])
        out["auc_drop"][policy] = auc(-drop, violated)
        if policy.startswith("probabilistic"):
            cert = np.array([by[policy][i]["certificate_max"] for i in ids], dtype=float)
            out["auc_certificate"][policy] = auc(cert, violated)
            for bound in (0.7, 1.1):
                escalated = cert > bound
                out["certificate_gate"][gated_policy_name(policy, certificate=bound)] = {
                    "escalated_share": float(escalated.mean()),
                    "violations": int(violated.sum()),
                    "violations_removed": int((violated & escalated).sum()),
                    "removed_by_chance": float(violated.sum() * escalated.mean()),
                }
    return out


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100, help="requests per task")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--demo-only", action="store_true", help="recompute only the demo-store figures")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = RESULTS / "gate_quality.json"
    if args.demo_only and path.is_file():
        results = json.loads(path.read_text())
    else:
        results = signal_quality(args.n)
    results["demo"] = demo_savings()
    results["demo_store"] = demo_store_signals()
    results["demo_by_risk"] = demo_savings_by_risk()
    print(json.dumps(results["demo_by_risk"], indent=1))
    print(json.dumps(results["demo_store"], indent=1))
    print(json.dumps(results["demo"], indent=1))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gate_quality.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
