"""Human-readable summaries of a calibration store."""

from __future__ import annotations

from collections import Counter, defaultdict


def candidate_summary(records, tolerance: float) -> list[dict]:
    """Per policy: n, mean utility, violation count and rate at `tolerance`, mean realised KV."""
    import numpy as np

    from certkv.core.binomial import violation_mask

    by_policy: dict[str, list[dict]] = defaultdict(list)
    for row in records:
        by_policy[row["policy"]].append(row)
    out = []
    for policy, rows in by_policy.items():
        losses = np.array([r["loss"] for r in rows], dtype=float)
        k = int(violation_mask(losses, tolerance).sum())
        out.append(
            {
                "policy": policy,
                "n": len(rows),
                "mean_utility": float(np.mean([r["utility"] for r in rows])),
                "violations": k,
                "violation_rate": k / len(rows),
                "kv_retained_actual": float(np.mean([r["kv_retained_actual"] or 0.0 for r in rows])),
                "path": Counter(r.get("path") or "full" for r in rows).most_common(1)[0][0],
            }
        )
    return out


def print_calibration_summary(contract, summary, console) -> None:
    from rich.table import Table

    from certkv.calibration.store import CalibrationStore

    with CalibrationStore.read(contract.resolved_store_path()) as store:
        records = store.records()
        skipped = store.skipped()
    order = {"full": -1, **{c.policy: i for i, c in enumerate(contract.candidates())}}
    rows = sorted(candidate_summary(records, contract.tolerance), key=lambda r: order.get(r["policy"], 1 << 30))
    table = Table(
        title=f"{summary.store}: mean utility, violations k (loss > {contract.tolerance:g}), rate, realised KV kept"
    )
    for col, justify in [("policy", "left"), ("n", "right"), ("utility", "right"), ("k", "right"),
                         ("rate", "right"), ("KV kept", "right"), ("path", "left")]:
        table.add_column(col, justify=justify, no_wrap=True)
    for r in rows:
        table.add_row(r["policy"], str(r["n"]), f"{r['mean_utility']:.3f}", str(r["violations"]),
                      f"{r['violation_rate']:.3f}", f"{r['kv_retained_actual']:.3f}", r["path"])
    console.print(table)
    rate = f", {summary.calibrated / summary.seconds:.2f} req/s" if summary.seconds else ""
    console.print(
        f"{summary.calibrated} requests calibrated now{rate}, {summary.already_done} were already stored, "
        f"{len(summary.skipped)} skipped now ({len(skipped)} skipped in the store)."
    )
    for rid, reason in list(summary.skipped.items())[:5]:
        console.print(f"  skipped {rid}: {reason}")
