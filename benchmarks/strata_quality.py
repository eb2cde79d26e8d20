"""Do per-stratum certificates keep their promise? Known true risks, and the demo store.

**Simulation.** S = 2, 3, 4 strata, each with its own true violation rate for every candidate of a
ladder like the demo contract's (two presses, kv_retained 0.9 … 0.1, one fixed sequence each,
procedure fixed_sequence): a "mixed" stratum has a candidate just above ε right after ones below
it, an "edge" stratum has its first candidates just above ε (anything certified there is an
error), a "safe" stratum has every candidate below ε. Each draw samples
every stratum's requests (a request that violates a candidate also violates the more aggressive
ones of its press, as eviction does), certifies with :func:`certkv.core.certify.certify` under
``strata: {by: task}`` and ``{by: task, simultaneous: true}``, and scores each stratum's choice by
its TRUE rate (the full cache: 0). Over the draws it counts, as integers:

* per stratum, the draws whose choice's true rate exceeds ε: the per-stratum promise is that this
  frequency is ≤ δ (each stratum certified at δ, or at δ/S when simultaneous);
* the draws where ANY stratum's choice exceeds ε: ≤ δ only under ``simultaneous`` (the union
  bound); the per-stratum reading may exceed δ here, up to S·δ, and that is what it says it does.

The verdicts compare each frequency with δ plus three Monte-Carlo standard errors.

**Demo store** (``--demo-dir``, skipped when absent): the contract as it is (gated, with its pilot)
and its ungated sequences only (no pilot, so the pilot's requests certify too), certified pooled,
per stratum and simultaneous (mean KV retained and each stratum's choice), and
:func:`certkv.core.validation.validate` per stratum (share of 1000 splits whose test half exceeds ε,
per stratum and pooled).

    python benchmarks/strata_quality.py    # writes benchmarks/results/strata_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
SEED = 1717
DRAWS = 2000
SPLITS = 1000
EPS, DELTA = 0.05, 0.05
KV = (0.9, 0.7, 0.5, 0.3, 0.1)
PRESSES = ("snapkv", "streaming_llm")

#: True violation rate of each candidate (press → rate at each of KV), per stratum profile.
PROFILES = {
    # first candidate of each press just above ε: anything certified is an error
    "edge": {"snapkv": (0.051, 0.08, 0.15, 0.3, 0.5), "streaming_llm": (0.051, 0.1, 0.2, 0.35, 0.6)},
    # below ε, then just above it
    "mixed": {"snapkv": (0.005, 0.02, 0.051, 0.1, 0.3), "streaming_llm": (0.01, 0.035, 0.055, 0.15, 0.4)},
    # every candidate below ε: no choice can be an error
    "safe": {"snapkv": (0.0, 0.005, 0.01, 0.02, 0.04), "streaming_llm": (0.0, 0.01, 0.02, 0.03, 0.045)},
}
#: The strata of each setting: (name, profile, certification requests).
SETTINGS = {
    2: [("s0", "edge", 400), ("s1", "mixed", 500)],
    3: [("s0", "edge", 400), ("s1", "mixed", 500), ("s2", "edge", 300)],
    4: [("s0", "edge", 400), ("s1", "mixed", 500), ("s2", "edge", 300), ("s3", "safe", 250)],
}


# ----------------------------------------------------------------------------- simulation


def candidates() -> list[str]:
    """The ladder's candidate names, press by press, most KV first (the contract's order)."""
    return [f"{press}@{kv:.2f}" for press in PRESSES for kv in KV]


def true_rates(profile: str) -> np.ndarray:
    """The true violation rate of every candidate, in :func:`candidates` order."""
    return np.concatenate([PROFILES[profile][press] for press in PRESSES])


def spec(simultaneous: bool):
    """The simulation's spec: τ = 0, ε, 1 − δ, one fixed sequence per press, strata by task."""
    from certkv.core.spec import CertificationSpec

    names = candidates()
    return CertificationSpec(tolerance=0.0, risk=EPS, confidence=1 - DELTA,
                             sequences=[names[i * len(KV):(i + 1) * len(KV)] for i in range(len(PRESSES))],
                             strata={"by": "task", "simultaneous": simultaneous})


def draw_table(rng: np.random.Generator, strata):
    """One calibration draw: per request one uniform per press, violating candidate j when u < rate_j."""
    from certkv.core.loss_table import LossTable

    names = candidates()
    losses, ids, tasks = [], [], []
    for name, profile, n in strata:
        u = np.repeat(rng.random((len(PRESSES), n)), len(KV), axis=0)  # (candidates, n)
        losses.append((u < true_rates(profile)[:, None]).astype(float))
        ids += [f"{name}-{i:05d}" for i in range(n)]
        tasks += [name] * n
    kv = np.tile(np.asarray(KV), len(PRESSES))
    loss = np.concatenate(losses, axis=1)
    return LossTable(request_ids=tuple(ids), policies=tuple(names), press=tuple(n.split("@")[0] for n in names),
                     kv_retained=kv, loss=loss, memory=np.repeat(kv[:, None], loss.shape[1], axis=1),
                     kv_retained_actual=None, tasks=tuple(tasks), source="simulation")


def errors_of(op, strata) -> dict[str, bool]:
    """Per stratum: does its chosen policy's TRUE rate exceed ε (the full cache never does)?"""
    names = candidates()
    out = {}
    for name, profile, _ in strata:
        entry = op.strata.entries[name]
        out[name] = (not entry.fallback) and bool(true_rates(profile)[names.index(entry.policy)] > EPS)
    return out


def simulate(n_strata: int, draws: int, seed: int) -> dict:
    """Both readings of δ on the same draws of one setting: integer error counts and their verdicts."""
    from certkv.core.certify import certify

    strata = SETTINGS[n_strata]
    rng = np.random.default_rng([seed, n_strata])
    modes = ("per_stratum", "simultaneous")
    counts = {mode: {"per_stratum": {name: 0 for name, _, _ in strata}, "any": 0} for mode in modes}
    kept = {mode: 0.0 for mode in counts}
    start = time.perf_counter()
    for _ in range(draws):
        table = draw_table(rng, strata)
        for mode in counts:
            op = certify(table, spec(mode == "simultaneous"), records_sha256="simulation")
            errors = errors_of(op, strata)
            for name, bad in errors.items():
                counts[mode]["per_stratum"][name] += int(bad)
            counts[mode]["any"] += int(any(errors.values()))
            kept[mode] += op.mean_kv_retained
    elapsed = time.perf_counter() - start
    return {
        "strata": [{"name": name, "profile": profile, "n": n} for name, profile, n in strata],
        "draws": draws,
        "ms_per_certify": 1000 * elapsed / (2 * draws),
        "modes": {mode: verdicts(counts[mode], draws, kept[mode] / draws) for mode in counts},
    }


def verdicts(counts: dict, draws: int, mean_kv: float) -> dict:
    """Frequencies from integer counts, each against the limit δ + 3 Monte-Carlo standard errors."""
    limit = DELTA + 3 * math.sqrt(DELTA * (1 - DELTA) / draws)
    per = {name: {"errors": k, "frequency": k / draws, "within_delta": k <= limit * draws}
           for name, k in counts["per_stratum"].items()}
    return {"per_stratum": per, "any": {"errors": counts["any"], "frequency": counts["any"] / draws,
                                        "within_delta": counts["any"] <= limit * draws},
            "limit": limit, "mean_kv_retained": mean_kv}


# ----------------------------------------------------------------------------- demo store


def ungated(spec_):
    """The contract's ungated sequences only: no pilot (its requests certify too), fixed_sequence."""
    sequences = [s for s in spec_.sequences if "+" not in s[0]]
    kept = {name for s in sequences for name in s}
    info = {name: i for name, i in spec_.candidate_info.items() if name in kept}
    return spec_.model_copy(update={"sequences": sequences, "candidate_info": info, "pilot": None,
                                    "procedure": "fixed_sequence"})


def readings(spec_) -> dict:
    """The spec pooled, per stratum (δ each) and simultaneous (δ/S each)."""
    from certkv.core.spec import StrataConfig

    by = spec_.strata.by if spec_.strata is not None else "task"
    return {
        "pooled": spec_.model_copy(update={"strata": None}),
        "per_stratum": spec_.model_copy(update={"strata": StrataConfig(by=by, simultaneous=False)}),
        "simultaneous": spec_.model_copy(update={"strata": StrataConfig(by=by, simultaneous=True)}),
    }


def demo_certificate(table, spec_) -> dict:
    """One certificate's choice, mean KV and counts; per stratum too when stratified."""
    from certkv.core.certify import certify

    op = certify(table, spec_)
    out = {"policy": op.policy, "mean_kv_retained": op.mean_kv_retained, "n": op.n, "violations": op.violations}
    if op.is_stratified:
        out["strata"] = {name: {"policy": e.policy, "mean_kv_retained": e.mean_kv_retained, "n": e.n,
                                "violations": e.violations, "fallback": e.fallback}
                         for name, e in op.strata.entries.items()}
    return out


def demo_validation(table, spec_) -> dict:
    """validate() of a stratified spec: per method the share of splits over ε, pooled and per stratum."""
    from certkv.core.validation import validate

    result = validate(table, spec_, n_splits=SPLITS, seed=SEED)

    def summary(r) -> dict:
        return {m: {"exceed_count": x.exceed_count, "exceed_fraction": x.exceed_fraction,
                    "mean_kv_retained": x.mean_kv_retained, "fallback_share": x.fallback_share}
                for m, x in r.methods.items()}

    return {"n_test": result.n_test, "pooled": summary(result),
            "strata": {name: {"n_test": r.n_test, **summary(r)} for name, r in result.strata.items()}}


def demo(demo_dir: Path) -> dict | None:
    """The demo store's certificates and validations, gated (the contract) and ungated."""
    from certkv.calibration.certification import load_records
    from certkv.contract.loading import load_contract
    from certkv.contract.spec import certification_spec

    path = demo_dir / "demo.yaml"
    if not path.is_file():
        return None
    contract = load_contract(path)
    evidence = load_records(contract)
    table = evidence.table
    out = {"contract_sha256": contract.sha256(), "records_sha256": evidence.records_sha256, "splits": SPLITS,
           "seed": SEED}
    for label, spec_ in (("gated", certification_spec(contract)), ("ungated", ungated(certification_spec(contract)))):
        specs = readings(spec_)
        out[label] = {
            "certify": {name: demo_certificate(table, s) for name, s in specs.items()},
            "validate": {name: demo_validation(table, specs[name]) for name in ("per_stratum", "simultaneous")},
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=DRAWS)
    p.add_argument("--demo-dir", type=Path, default=Path("certkv-demo"))
    args = p.parse_args()
    results = {"seed": SEED, "risk": EPS, "delta": DELTA, "kv_retained": list(KV), "presses": list(PRESSES),
               "profiles": {k: {p: list(r) for p, r in v.items()} for k, v in PROFILES.items()}, "simulation": {}}
    for n_strata in SETTINGS:
        results["simulation"][str(n_strata)] = simulate(n_strata, args.draws, SEED)
        print(n_strata, json.dumps(results["simulation"][str(n_strata)]["modes"]), flush=True)
    results["demo"] = demo(args.demo_dir)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "strata_quality.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
