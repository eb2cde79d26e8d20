"""The SmolLM2 long benchmark's recompute-gate figures per task, on synthetic records: the signal's
AUC counted by hand, the restarted shares, the KV a gate saves against, and the docs table."""

from __future__ import annotations

import benchmarks_doc
import pytest
import smollm2_long


def _records() -> list[dict]:
    """Task "a": 8 requests of base `p@0.50`; the broken ones (loss 0.5 > τ) have low token
    probabilities, except request 3; requests 0-1 are the pilot. Task "b" was too small to test."""
    lows = [0.01, 0.5, 0.02, 0.75, 0.03, 0.7, 0.8, 0.9]
    broken = [True, False, True, True, True, False, False, False]
    rows = []
    for i, (low, bad) in enumerate(zip(lows, broken)):
        rows.append({"request_id": f"a{i}", "task": "a", "policy": "p@0.50", "loss": 0.5 if bad else 0.0,
                     "confidence_min": low, "confidence_min_agreeing": low if i != 4 else 0.9})
    rows.append({"request_id": "b0", "task": "b", "policy": "p@0.50", "loss": 0.0, "confidence_min": 0.5,
                 "confidence_min_agreeing": 0.5})
    return rows


def _entry(certified_ungated: bool) -> dict:
    gated = {"policy": "p@0.50+recq0.1", "certified": True, "mean_kv_retained": 0.62, "gate": {"recompute": 0.05}}
    ungated = [{"policy": "p@0.70", "certified": certified_ungated, "mean_kv_retained": 0.7, "gate": None},
               {"policy": "p@0.90", "certified": True, "mean_kv_retained": 0.9, "gate": {}}]
    return {"pilot": {"request_ids": ["a0", "a1"]}, "candidates": [*ungated, gated], "n": 6}


def test_recompute_gates_per_task_count_what_the_records_say():
    class Contract:
        tolerance = 0.1

    out = smollm2_long.recompute_per_task(Contract(), _records(), {"a": _entry(True), "b": {"candidates": []}})
    assert set(out) == {"a"}  # a stratum with nothing tested has no gates to describe
    assert out["a"]["best_ungated_kv"] == 0.7
    (gate,) = out["a"]["gates"]
    assert gate["policy"] == "p@0.50+recq0.1" and gate["threshold"] == 0.05 and gate["mean_memory"] == 0.62
    cert = gate["certification"]  # requests a2..a7: broken a2, a3, a4; restarted (low < 0.05) a2, a4
    assert (cert["n"], cert["broken"]) == (6, 3)
    # AUC of −low for broken: pairs (broken, intact) where the broken one has the lower probability.
    lows = {2: 0.02, 3: 0.75, 4: 0.03, 5: 0.7, 6: 0.8, 7: 0.9}
    pairs = [(lows[b] < lows[k]) + 0.5 * (lows[b] == lows[k]) for b in (2, 3, 4) for k in (5, 6, 7)]
    assert cert["auc"] == pytest.approx(sum(pairs) / len(pairs)) == pytest.approx(8 / 9)
    assert cert["restarted"] == 2 / 6 and cert["restarted_late"] == 1 / 6  # a4 restarted after it departed
    assert gate["pilot"]["auc"] == 1.0 and gate["pilot"]["restarted"] == 0.5
    assert smollm2_long.recompute_per_task(Contract(), _records(), {"a": _entry(False)})["a"]["best_ungated_kv"] == 0.9
    with pytest.raises(RuntimeError, match="certification split"):
        smollm2_long.recompute_per_task(Contract(), _records(), {"a": {**_entry(True), "n": 7}})


def test_recompute_table_renders_each_task_and_utility():
    class Contract:
        tolerance = 0.1

    per_task = smollm2_long.recompute_per_task(Contract(), _records(), {"a": _entry(True)})
    lines = benchmarks_doc._smollm2_recompute({"task_utility": {"recompute": per_task}, "strict_utility": {}},
                                               "rouge_l", "prefix_agreement")
    assert len(lines) == 2 and "| `rouge_l` | a | `p@0.50+recq0.1` | 0.050 |" in lines[1]
    assert lines[1].rstrip().endswith("| yes | 0.620 | 0.700 |")
    assert benchmarks_doc._smollm2_recompute({"task_utility": {}, "strict_utility": {}}, "rouge_l", "x") == []


def test_a_store_out_of_reach_is_the_binomial_quantile_against_all_planned_requests():
    """A candidate is ruled out early exactly when its breaks so far exceed the largest k whose
    exact binomial p-value on all planned requests is at most δ (scipy's quantile gives the same k)."""
    from scipy.stats import binom

    most = int(binom.ppf(0.05, 1000, 0.05))
    most -= binom.cdf(most, 1000, 0.05) > 0.05  # ppf gives the smallest k with cdf >= δ; the test needs cdf <= δ
    cands = {name: {"tasks": {"a": {"n": 300, "task_broken": k - 5}, "b": {"n": 228, "task_broken": 5}}}
             for name, k in (("over", most + 1), ("at", most))}
    assert smollm2_long.out_of_reach(cands, 1000, 0.05, 0.05) == {
        "over": {"broken": most + 1, "requests": 528, "most_allowed": most}}
    assert most == 38
