"""Human-readable summaries of a calibration store: what `certkv calibrate` prints when it ends.

Per candidate policy: how many requests it ran on, its mean utility, its violations at the
contract's tolerance and the KV it really kept, so that a user sees at a glance, before
certifying, whether a candidate is hopeless or the store is incomplete.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from certkv.core.policy_names import REFERENCE_POLICY

if TYPE_CHECKING:
    from rich.console import Console

    from certkv.calibration.run import CalibrationSummary
    from certkv.contract.schema import Contract


def candidate_summary(records: Iterable[Mapping[str, Any]], tolerance: float) -> list[dict[str, Any]]:
    """Per policy: n, mean utility, violation count and rate at `tolerance`, mean realised KV."""
    import numpy as np

    from certkv.core.binomial import count_violations

    by_policy: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in records:
        by_policy[row["policy"]].append(row)
    out = []
    for policy, rows in by_policy.items():
        losses = np.array([r["loss"] for r in rows], dtype=float)
        k = count_violations(losses, tolerance)
        out.append(
            {
                "policy": policy,
                "n": len(rows),
                "mean_utility": float(np.mean([r["utility"] for r in rows])),
                "violations": k,
                "violation_rate": k / len(rows),
                "kv_retained_actual": float(np.mean([r["kv_retained_actual"] or 0.0 for r in rows])),
                # a generation's peak KV relative to the full cache's (None in stores written before it)
                "kv_peak": None if any(r.get("kv_peak") is None for r in rows) else float(np.mean([r["kv_peak"] for r in rows])),
                "path": Counter(r.get("path") or "full" for r in rows).most_common(1)[0][0],
            }
        )
    return out


def print_calibration_summary(contract: Contract, summary: CalibrationSummary, console: Console) -> None:
    """The store's candidates after `certkv calibrate`, then what this run did.

    Every column folds instead of being cut (:mod:`certkv.report.tables`): the summary is often
    read in a log of an unattended run, where the console is 80 columns wide and a rate cut to
    ``0.0…`` would hide exactly what the reader looks for.

    Parameters
    ----------
    contract : Contract
        The contract calibrated; its candidates give the row order and its tolerance the k.
    summary : certkv.calibration.run.CalibrationSummary
        What this run did (calibrated, already stored, skipped, seconds).
    console : rich.console.Console
    """
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.spec import candidates
    from certkv.report.tables import add_row, narrow_table, print_table, say, say_path

    with CalibrationStore.read(contract.resolved_store_path()) as store:
        records = store.records()
        skipped = store.skipped()
    order = {REFERENCE_POLICY: -1, **{c.policy: i for i, c in enumerate(candidates(contract))}}
    rows = sorted(candidate_summary(records, contract.tolerance), key=lambda r: order.get(r["policy"], 1 << 30))
    peak = contract.cost_measure != "kv_retained"  # a generation's cost orders the candidates: show it
    columns: list[tuple[str, Literal["left", "right"]]] = [
        ("policy", "left"), ("n", "right"), ("utility", "right"), ("k", "right"), ("rate", "right"), ("KV kept", "right")]
    if peak:
        columns.append(("peak", "right"))
    table = narrow_table([*columns, ("path", "left")])
    for r in rows:
        shown = [] if not peak else ["—" if r["kv_peak"] is None else f"{r['kv_peak']:.3f}"]
        add_row(table, r["policy"], str(r["n"]), f"{r['mean_utility']:.3f}", str(r["violations"]),
                f"{r['violation_rate']:.3f}", f"{r['kv_retained_actual']:.3f}", *shown, r["path"])
    say_path(console, "store", summary.store)
    title = f"per policy: mean utility, violations k (loss > {contract.tolerance:g}), their rate, realised KV kept"
    title += " after the prefill, peak KV of the generation" if peak else ""
    print_table(console, table, title=title)
    rate = f", {summary.calibrated / summary.seconds:.2f} req/s" if summary.seconds else ""
    say(
        console,
        f"{summary.calibrated} requests calibrated now{rate}, {summary.already_done} were already stored, "
        f"{len(summary.skipped)} skipped now ({len(skipped)} skipped in the store).",
    )
    for rid, reason in list(summary.skipped.items())[:5]:
        say(console, f"  skipped {rid}: {reason}")
