"""Does the per-request certificate hold when questions share a context? Resampling contexts of a real loss table.

A loss table whose requests carry a ``group`` column (several questions per context) is taken as
the truth: the population is its empirical distribution over contexts, so a candidate's true risk
is the measure on the whole table (the share of violated questions for the per-request reading
and ``per_question``, the mean per-context share for ``per_context``, the share of contexts with a
violated question for ``any_question``). Each of ``--resamples`` draws takes as many contexts as
the table has, with replacement, and certifies the draw twice over:

* **naive**: every question an independent request (exact binomial p-value, Clopper–Pearson bound),
  which is what certkv did before grouping;
* **grouped**: contexts as the unit (:mod:`certkv.core.grouped`), for each measure, the two mean
  measures under both bounds (Hoeffding–Bentkus and betting).

Both use the same spec: one fixed sequence per press, its candidates from the most KV to the least,
τ, ε and the confidence from the flags, and certkv's own decision step
(:func:`certkv.core.certify.decide`). Reported, per candidate: its coverage (the share of draws
whose test at the candidate's level does not reject its true risk, i.e. whose upper bound is at
least the true risk; a valid test keeps it in at least 1 − level of the draws) and how often it
was certified while its true risk is above ε; for the chosen point,
the share of draws whose choice has a true risk ≤ ε (the full cache always has), and its mean KV.

A second table, the same rows with the questions re-paired across contexts at random (every
context keeps its size, its questions come from anywhere), has nearly independent questions: there
the grouped certificate should cost little, and ``certified`` compares the KV each reading
certifies on the whole table (:func:`certkv.core.certify.certify`).

Everything is vectorised over draws (blocks of them), and three draws are re-certified with
``certkv.certify`` on a real resampled LossTable as a check that the vectorised path is the
certifier's.

    python benchmarks/grouped_coverage.py --records PATH     # a loss table with a group column
    python benchmarks/grouped_coverage.py --synthetic        # a generated clustered table instead
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.stats import binom

from certkv.core.certify import certify, decide
from certkv.core.grouped import MEASURES, Groups, context_order_key, grouped_estimate, grouped_p_values
from certkv.core.loss_table import LossTable, read_loss_table, records_sha256
from certkv.core.procedures import candidate_levels
from certkv.core.spec import CertificationSpec

RESULTS = Path(__file__).parent / "results"
SEED = 4242
RESAMPLES = 2000
BLOCK = 250

#: The grouped readings: (name, measure, bound); "naive" is the per-request certificate.
GROUPED = (
    ("per_question", "per_question", "hoeffding_bentkus"),
    ("per_question+betting", "per_question", "betting"),
    ("per_context", "per_context", "hoeffding_bentkus"),
    ("per_context+betting", "per_context", "betting"),
    ("any_question", "any_question", "hoeffding_bentkus"),
)
READINGS = ("naive", *(name for name, _, _ in GROUPED))


# ----------------------------------------------------------------------------- tables


def synthetic_table(contexts: int = 300, questions: int = 8, seed: int = SEED) -> LossTable:
    """A clustered table: a context's difficulty s_g (log-normal, mean 1) scales every candidate's
    violation rate m(kv), so questions on a hard context fail together; one uniform per question
    makes a question that violates a candidate violate the more aggressive ones too."""
    rng = np.random.default_rng(seed)
    rates = {0.9: 0.004, 0.7: 0.015, 0.5: 0.04, 0.3: 0.08, 0.2: 0.135, 0.1: 0.2}
    difficulty = np.exp(1.5 * rng.standard_normal(contexts) - 1.5**2 / 2)
    rows = []
    for c in range(contexts):
        u = rng.random(questions)
        for q in range(questions):
            for kv, rate in rates.items():
                loss = float(u[q] < min(1.0, rate * difficulty[c]))
                rows.append({"request_id": f"c{c:04d}q{q}", "policy": f"synthetic@{kv:.2f}", "kv_retained": kv,
                             "loss": loss, "group": f"ctx{c:04d}"})
    return LossTable.from_records(rows, source="synthetic clustered table")


def repaired(table: LossTable, seed: int) -> LossTable:
    """The same rows with the questions dealt to contexts at random (each context keeps its size)."""
    assert table.groups is not None
    rng = np.random.default_rng(seed)
    return replace(table, groups=tuple(np.asarray(table.groups, dtype=object)[rng.permutation(table.n_requests)].tolist()))


def spec_for(table: LossTable, risk: float, confidence: float, tolerance: float, **extra) -> CertificationSpec:
    """One fixed sequence per press, most KV first (the pre-registered order of a ladder)."""
    by_press: dict[str, list[tuple[float, str]]] = {}
    for policy, press, kv in zip(table.policies, table.press, table.kv_retained.tolist()):
        by_press.setdefault(press, []).append((-kv, policy))
    sequences = [[p for _, p in sorted(ladder)] for _, ladder in sorted(by_press.items())]
    return CertificationSpec(tolerance=tolerance, risk=risk, confidence=confidence, sequences=sequences, **extra)


# ----------------------------------------------------------------------------- resampling


class Layout:
    """A table's contexts as arrays: violations per context (G, C), sizes (G,), memory sums (G, C)."""

    def __init__(self, table: LossTable, spec: CertificationSpec):
        assert table.groups is not None
        self.groups = Groups.of(table.groups)
        self.rows = [table.index_of(p) for p in spec.candidates]
        violated = table.loss[self.rows] > spec.tolerance + 1e-9
        self.k = self.groups.counts(violated).T  # (G, C)
        self.n = self.groups.sizes  # (G,)
        self.memory = self.groups.sums(table.memory[self.rows]).T  # (G, C)

    def truth(self) -> dict[str, np.ndarray]:
        """Each measure of every candidate on the whole table (C,)."""
        return {m: np.asarray(grouped_estimate(self.k.T, self.n, m)) for m in MEASURES}

    def design_effect(self) -> np.ndarray:
        """Per candidate (C,): the variance of a context's violation count over what independent
        questions at the table's rate would give, Σ n_g p (1 − p) / G; 1 for independent questions,
        above 1 when a context's questions fail together (NaN for a rate of 0 or 1)."""
        p = self.k.sum(axis=0) / self.n.sum()
        independent = self.n.mean() * p * (1 - p)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(independent > 0, self.k.var(axis=0) / independent, np.nan)


def resample_block(layout: Layout, spec: CertificationSpec, idx: np.ndarray, truth: dict) -> dict[str, dict[str, np.ndarray]]:
    """Certify draws `idx` (B, G) of contexts, naively and grouped: per reading, the (B, C)
    p-values at ε, certified flags and coverage (the test at the candidate's level does not
    reject its true risk, `truth`), and the (B,) chosen index and its mean memory."""
    k = layout.k[idx]  # (B, G, C)
    n = layout.n[idx]  # (B, G)
    memory = layout.memory[idx].sum(axis=1) / n.sum(axis=1)[:, None]  # (B, C)
    k_total, n_total = k.sum(axis=1), n.sum(axis=1)[:, None]
    out = {}
    naive_p = binom.cdf(k_total, n_total, spec.risk)
    at_truth = _testable(truth["per_question"])
    covered = _covered(binom.cdf(k_total, n_total, at_truth), naive_p, truth["per_question"], spec)
    out["naive"] = _decided(naive_p, covered, memory, k_total, spec)
    kt, nt = np.swapaxes(k, 1, 2), n[:, None, :]  # (B, C, G), (B, 1, G)
    for name, measure, how in GROUPED:
        p = grouped_p_values(kt, nt, measure, spec.risk, bound=how)
        p_true = grouped_p_values(kt, nt, measure, _testable(truth[measure]), bound=how)
        out[name] = _decided(p, _covered(p_true, p, truth[measure], spec), memory, k_total, spec)
    return out


def _testable(true: np.ndarray) -> np.ndarray:
    """True risks as test points: 0 and 1 (always covered, see :func:`_covered`) replaced by 1/2."""
    return np.where((true > 0) & (true < 1), true, 0.5)


def _covered(p_true: np.ndarray, p: np.ndarray, true: np.ndarray, spec: CertificationSpec) -> np.ndarray:
    """(B, C): the test at each candidate's level (from the p-values at ε, as the procedure sets
    it) keeps the true risk, i.e. the upper bound is at least it; a true risk of 0 or 1 is kept."""
    levels = candidate_levels(p, spec.lengths, spec.delta, spec.procedure)
    return (p_true > levels) | (true <= 0) | (true >= 1)


def _decided(p, covered, memory, k_total, spec) -> dict[str, np.ndarray]:
    flags, chosen = decide(p, memory, k_total, spec)
    used = np.where(chosen < 0, 1.0, np.take_along_axis(memory, np.maximum(chosen, 0)[:, None], axis=1)[:, 0])
    return {"covered": covered, "flags": flags, "chosen": chosen, "kv": used, "p": p}


def coverage(table: LossTable, spec: CertificationSpec, resamples: int, seed: int) -> dict:
    """Every reading's coverage over `resamples` draws of contexts (module docstring)."""
    layout = Layout(table, spec)
    truth = layout.truth()
    levels = candidate_levels(np.zeros(len(layout.rows)), spec.lengths, spec.delta, spec.procedure)
    rng = np.random.default_rng(seed)
    parts: dict[str, list] = {}
    for start in range(0, resamples, BLOCK):
        size = min(BLOCK, resamples - start)
        idx = rng.integers(0, layout.groups.n_groups, size=(size, layout.groups.n_groups))
        for reading, block in resample_block(layout, spec, idx, truth).items():
            parts.setdefault(reading, []).append(block)
    readings = {}
    for reading, blocks in parts.items():
        merged = {key: np.concatenate([b[key] for b in blocks]) for key in blocks[0]}
        true = truth["per_question" if reading == "naive" else reading.split("+")[0]]
        readings[reading] = summarise(merged, true, spec, levels)
    names = spec.candidates
    return {
        "true_risk": {names[c]: {m: float(truth[m][c]) for m in MEASURES} for c in range(len(names))},
        "level": {names[c]: float(levels[c]) for c in range(len(names))},
        "design_effect": {names[c]: None if np.isnan(d) else float(d) for c, d in enumerate(layout.design_effect())},
        "readings": readings,
        "certified": certified_on_whole(table, spec),
    }


def summarise(merged: dict, true: np.ndarray, spec: CertificationSpec, levels: np.ndarray) -> dict:
    """Per candidate: bound coverage, share certified, share certified while its true risk > ε;
    the chosen point: share of draws whose choice holds, mean KV, share of fallbacks."""
    names = spec.candidates
    covered = merged["covered"]
    wrong = merged["flags"] & (true[None, :] > spec.risk)
    chosen = merged["chosen"]
    holds = np.where(chosen < 0, True, true[np.maximum(chosen, 0)] <= spec.risk)
    return {
        "candidates": {
            names[c]: {"coverage": float(covered[:, c].mean()), "certified": float(merged["flags"][:, c].mean()),
                       "certified_above_risk": float(wrong[:, c].mean())}
            for c in range(len(names))
        },
        "chosen": {"holds": float(holds.mean()), "mean_kv_retained": float(merged["kv"].mean()),
                   "fallback": float((chosen < 0).mean())},
        "worst_coverage": float(min(covered[:, c].mean() for c in range(len(names)) if true[c] > 0) if (true > 0).any() else 1.0),
    }


def certified_on_whole(table: LossTable, spec: CertificationSpec) -> dict:
    """The point each reading certifies on the whole table: policy and mean KV."""
    out = {}
    for reading in READINGS:
        extra = _reading_spec(reading)
        op = certify(table, CertificationSpec.parse({**spec.model_dump(), **extra}))
        out[reading] = {"policy": op.policy, "mean_kv_retained": op.mean_kv_retained, "risk_upper_bound": op.risk_upper_bound}
    return out


def _reading_spec(reading: str) -> dict:
    """The spec fields of one reading: independent requests, or its grouping."""
    if reading == "naive":
        return {"independent_requests": True}
    measure, how = next((m, b) for name, m, b in GROUPED if name == reading)
    return {"grouping": {"measure": measure, "bound": how}}


def self_check(table: LossTable, spec: CertificationSpec, seed: int) -> None:
    """Three draws re-certified with certkv.certify on real resampled tables: same choices and p-values."""
    layout = Layout(table, spec)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, layout.groups.n_groups, size=(3, layout.groups.n_groups))
    # certify bets over the contexts in context_order_key order of their names (f"{slot:06d}" in
    # resampled_table), so the vectorised check takes each draw's contexts in that order too
    order = sorted(range(layout.groups.n_groups), key=lambda slot: context_order_key(f"{slot:06d}"))
    block = resample_block(layout, spec, idx[:, order], layout.truth())
    for b in range(3):
        sub = resampled_table(table, layout, idx[b])
        for reading in READINGS:
            op = certify(sub, CertificationSpec.parse({**spec.model_dump(), **_reading_spec(reading)}))
            got = block[reading]["chosen"][b]
            expected = -1 if op.fallback else spec.candidates.index(op.policy)
            assert got == expected, (reading, b, got, expected)
            p_values = [c.p_value for c in op.candidates]
            np.testing.assert_allclose(block[reading]["p"][b], p_values, rtol=1e-9, atol=1e-300)


def resampled_table(table: LossTable, layout: Layout, draw: np.ndarray) -> LossTable:
    """The LossTable of one draw of contexts (a context drawn twice appears twice, renamed by its
    slot in the draw)."""
    rows = []
    for slot, g in enumerate(draw):
        for r in np.flatnonzero(layout.groups.codes == g):
            for row in layout.rows:
                rows.append({
                    "request_id": f"{slot}:{r}", "policy": table.policies[row], "kv_retained": float(table.kv_retained[row]),
                    "loss": float(table.loss[row, r]), "memory": float(table.memory[row, r]), "group": f"{slot:06d}",
                })
    return LossTable.from_records(rows)


# ----------------------------------------------------------------------------- main


def describe(table: LossTable) -> dict:
    assert table.groups is not None
    sizes = Groups.of(table.groups).sizes
    per_context = {"min": int(sizes.min()), "mean": float(sizes.mean()), "max": int(sizes.max())}
    return {"n_requests": table.n_requests, "n_contexts": int(sizes.size), "questions_per_context": per_context,
            "records_sha256": records_sha256(table)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--records", type=Path, help="a CSV/JSONL loss table whose requests carry a group column")
    source.add_argument("--synthetic", action="store_true", help="generate a clustered table instead (a test run)")
    p.add_argument("--contexts", type=int, default=300, help="contexts of the --synthetic table")
    p.add_argument("--risk", type=float, default=0.1)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--tolerance", type=float, default=0.0)
    p.add_argument("--resamples", type=int, default=RESAMPLES)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", type=Path, default=RESULTS / "grouped_coverage.json")
    args = p.parse_args(argv)
    table = synthetic_table(args.contexts, seed=args.seed) if args.synthetic else read_loss_table(args.records)
    if table.groups is None:
        raise SystemExit(f"{table.source}: no group column; the resampling needs each request's context group")
    spec = spec_for(table, args.risk, args.confidence, args.tolerance)
    start = time.perf_counter()
    self_check(table, spec, args.seed)
    results = {
        "source": "synthetic" if args.synthetic else args.records.name,
        "command": "python benchmarks/grouped_coverage.py "
        + ("--synthetic" if args.synthetic else f"--records {args.records.name}")
        + "".join(f" --{name} {getattr(args, name):g}" for name in ("risk", "confidence", "tolerance")
                  if getattr(args, name) != p.get_default(name)),
        **describe(table), "risk": args.risk, "confidence": args.confidence, "tolerance": args.tolerance,
        "resamples": args.resamples, "seed": args.seed, "sequences": spec.sequences,
        "tables": {
            "clustered": coverage(table, spec, args.resamples, args.seed),
            "repaired": coverage(repaired(table, args.seed), spec, args.resamples, args.seed),
        },
    }
    results["seconds"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    for name, t in results["tables"].items():
        print(name, {r: (round(v["worst_coverage"], 3), round(v["chosen"]["holds"], 3)) for r, v in t["readings"].items()},
              {r: round(v["mean_kv_retained"], 3) for r, v in t["certified"].items()})
    print(f"wrote {args.out} in {results['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
