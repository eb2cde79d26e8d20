"""What a gated runtime request costs, relative to the full cache alone, per gate kind.

On demo-like requests (``generate_requests("demo", n, seed=9091, context_length="256-512")``; no
shipped file uses that seed) the :class:`~certkv.runtime.certified_runtime.CertifiedRuntime` of
each operating point answers every request, and its time is divided by the time of the full
cache alone (the runtime of a fallback operating point: one plain prefill and the full answer).
Everything a gate costs is inside the numerator: the engine's scoring hooks on the prefill, the
agreement recorder, the lookahead probe, the evicted decode and, for a request a post-decode gate
escalates, the full answer decoded again (its recomputation).

Operating points (SnapKV at kv_retained 0.5 on the fast path; certkv's probabilistic press at 0.5
for the certificate):

- ``ungated``: the press alone;
- ``agreement_drop``, ``lookahead``, ``confidence``, ``certificate``: one signal each, its
  threshold placed, as a contract's pilot would, at the quantile ``QUANTILE`` of that signal on
  pilot requests of their own seed (``PILOT_SEED``): about that share of requests goes to the
  full cache;
- ``learned`` (pre-decode: lookahead masses and context length) and ``learned+confidence``
  (post-decode: the same plus the confidence features), fit on the same pilot by certkv's own
  fitting (:mod:`certkv.core.pilot`), threshold at the same quantile of the pilot's scores.

Per request every runtime (the full cache included) runs ``--reps`` times in rotating order, the
fastest counts. Reported per operating point: the mean of the per-request ratios, the ratio of the
summed times (what a stream of these requests costs), the median ratio, the share of requests the
gate sent to the full cache, the share it escalated after decoding and the mean seconds per phase.

The lookahead probe's own share of a request (issue target: ≤ 5% on the random 8-layer Llama at
2048 tokens) is measured apart: SnapKV at 0.5 behind a lookahead gate that never fires (threshold 1,
the largest mass there is), so that every request pays the probe and then the evicted decode; the share is
``seconds["probe"] / seconds["total"]`` per request (median), next to the same runtime's time
over the ungated press's.

    python benchmarks/runtime_cost.py            # writes benchmarks/results/runtime_cost.json
    python benchmarks/runtime_cost.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

RESULTS = Path(__file__).parent / "results"
SEED = 9091
PILOT_SEED = 9092
QUANTILE = 0.2
CONTEXT = "256-512"
KV = 0.5
LOOKAHEAD_TOKENS = 2


def operating_point(policy: str, press: str, kv: float, gate=None, fallback: bool = False):
    """A deployable operating point (certify's result fields, no certification behind it)."""
    from certkv.core.operating_point import ContractSummary, OperatingPoint

    return OperatingPoint(
        policy=policy, base_policy=policy, press=press, kv_retained=kv, mean_kv_retained=kv, fallback=fallback,
        contract=ContractSummary(tolerance=0.0, risk=0.05, confidence=0.95, procedure="fixed_sequence"),
        n=0, violations=0, empirical_risk=0.0, risk_upper_bound=1.0, p_value=1.0, candidates=[],
        sequences=[], guarantee="benchmark", created="now", certkv_version="benchmark", gate=gate,
        max_new_tokens=8,
    )


def pilot_records(model, tokenizer, requests) -> dict[str, list[dict]]:
    """Per candidate policy, one dict of recorded signals per pilot request (the engine's run,
    as calibration records them), with ``violation`` (answer differs from the full-KV answer)."""
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.presses.registry import build_press

    candidates = [
        PressCandidate(f"snapkv@{KV:.2f}", build_press("snapkv", KV), "snapkv", KV),
        PressCandidate(f"probabilistic@{KV:.2f}", build_press("probabilistic", KV), "probabilistic", KV),
    ]
    engine = Engine(model, tokenizer, candidates, max_new_tokens=8, agreement={}, lookahead_tokens=LOOKAHEAD_TOKENS)
    out: dict[str, list[dict]] = {c.policy: [] for c in candidates}
    for r in requests:
        result = engine.run(r.context, r.question, r.answer_prefix)
        for c in result.candidates:
            out[c.policy].append({
                "agreement_drop": result.agreement_drop, "certificate_max": c.certificate_max,
                "confidence_min": c.confidence_min, "logprob_mean": c.logprob_mean,
                "lookahead_heads": c.lookahead_heads, "lookahead_mass": c.lookahead_mass,
                "context_tokens": result.context_length, "violation": c.token_ids != result.full.token_ids,
            })
    return out


def quantile(values, q: float) -> float:
    """The q-quantile a contract's pilot places thresholds at (:func:`certkv.core.pilot.signal_quantile`)."""
    import numpy as np

    from certkv.core.pilot import signal_quantile

    return signal_quantile(np.asarray(values, dtype=float), q)


def learned_gate(rows: list[dict], features: list[str]):
    """certkv's learned gate fit on the pilot rows, threshold at the (1 − QUANTILE)-quantile of
    the pilot's scores (:mod:`certkv.core.pilot`, :mod:`certkv.core.gate_features`)."""
    import numpy as np

    from certkv.core.gate_features import expand_features, learned_score
    from certkv.core.pilot import fit_learned_gate

    n_heads = len(rows[0]["lookahead_heads"])
    names = expand_features(features, n_heads)
    model = fit_learned_gate(rows, names, np.array([r["violation"] for r in rows]))
    scores = [learned_score(model, r) for r in rows]
    return model, quantile(scores, 1 - QUANTILE)


def gates(pilot: dict[str, list[dict]]) -> dict[str, tuple[str, object]]:
    """Name → (base policy, GateSettings) of every gated operating point measured."""
    from certkv.core.spec import GateSettings

    snap, prob = pilot[f"snapkv@{KV:.2f}"], pilot[f"probabilistic@{KV:.2f}"]
    base_snap, base_prob = f"snapkv@{KV:.2f}", f"probabilistic@{KV:.2f}"
    out = {
        "ungated": (base_snap, None),
        "agreement_drop": (base_snap, GateSettings(agreement_drop=quantile([r["agreement_drop"] for r in snap], QUANTILE))),
        "lookahead": (base_snap, GateSettings(lookahead=quantile([r["lookahead_mass"] for r in snap], 1 - QUANTILE),
                                              lookahead_tokens=LOOKAHEAD_TOKENS)),
        "confidence": (base_snap, GateSettings(confidence=quantile([r["confidence_min"] for r in snap], QUANTILE))),
        "certificate": (base_prob, GateSettings(certificate=quantile([r["certificate_max"] for r in prob], 1 - QUANTILE))),
    }
    for name, features in (("learned", ["lookahead", "context_length"]),
                           ("learned+confidence", ["lookahead", "confidence", "context_length"])):
        model, threshold = learned_gate(snap, features)
        out[name] = (base_snap, GateSettings(learned=model, learned_threshold=threshold, quantile=QUANTILE,
                                             lookahead_tokens=LOOKAHEAD_TOKENS))
    return out


def runtimes(model, tokenizer, settings: dict) -> dict:
    from certkv.runtime.certified_runtime import CertifiedRuntime

    out = {"full": CertifiedRuntime(model, tokenizer, operating_point("full", "full", 1.0, fallback=True))}
    for name, (base, gate) in settings.items():
        press = base.split("@")[0]
        policy = base if gate is None else f"{base}+{name}"
        out[name] = CertifiedRuntime(model, tokenizer, operating_point(policy, press, KV, gate))
    return out


def measure(runs: dict, requests, reps: int) -> dict:
    """Per request each runtime `reps` times in rotating order (the fastest counts); the first
    request warms up and is not counted."""
    names = list(runs)
    best: dict[str, list[float]] = {k: [] for k in names}
    decisions: dict[str, list] = {k: [] for k in names}
    phases: dict[str, list[dict]] = {k: [] for k in names}
    for i, r in enumerate(requests):
        times: dict[str, list[float]] = {k: [] for k in names}
        for rep in range(reps):
            shift = (i + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                out = runs[name].generate(r.context, r.question, answer_prefix=r.answer_prefix)
                times[name].append(time.perf_counter() - t0)
                if rep == 0:
                    decisions[name].append(out.decision)
                    phases[name].append(out.seconds)
        if i == 0:
            for k in names:
                decisions[k].pop()
                phases[k].pop()
            continue
        for k in names:
            best[k].append(min(times[k]))

    full = best["full"]
    results = {}
    for k in names:
        d = decisions[k]
        keys = sorted({p for s in phases[k] for p in s})
        results[k] = {
            "ratio_mean": statistics.fmean(x / y for x, y in zip(best[k], full)),
            "ratio_of_sums": sum(best[k]) / sum(full),
            "ratio_median": statistics.median(x / y for x, y in zip(best[k], full)),
            "full_share": sum(x.mode == "full" for x in d) / len(d),
            "escalated_share": sum(x.escalated for x in d) / len(d),
            "mean_seconds": statistics.fmean(best[k]),
            "mean_phase_seconds": {p: statistics.fmean(s.get(p, 0.0) for s in phases[k]) for p in keys},
        }
    return results


def probe_share(model, tokenizer, requests, reps: int) -> dict:
    """The lookahead probe's share of the request time, on a gate that never fires."""
    from certkv.core.spec import GateSettings
    from certkv.runtime.certified_runtime import CertifiedRuntime

    base = f"snapkv@{KV:.2f}"
    gated = CertifiedRuntime(model, tokenizer, operating_point(
        f"{base}+look", "snapkv", KV, GateSettings(lookahead=1.0, lookahead_tokens=LOOKAHEAD_TOKENS)))
    plain = CertifiedRuntime(model, tokenizer, operating_point(base, "snapkv", KV))
    shares, ratios = [], []
    for i, r in enumerate(requests):
        runs = {"gated": [], "plain": []}
        for rep in range(reps):
            for name, runtime in ((("gated", gated), ("plain", plain)) if rep % 2 == 0 else
                                  (("plain", plain), ("gated", gated))):
                out = runtime.generate(r.context, r.question, answer_prefix=r.answer_prefix)
                runs[name].append(out.seconds)
        if i == 0:
            continue  # warm-up
        fastest = min(runs["gated"], key=lambda s: s["total"])
        shares.append(fastest["probe"] / fastest["total"])
        ratios.append(fastest["total"] / min(s["total"] for s in runs["plain"]))
    return {"requests": len(requests) - 1, "probe_share_median": statistics.median(shares),
            "probe_share_max": max(shares), "over_ungated_median": statistics.median(ratios)}


def main() -> None:
    import torch

    from certkv.model.loading import load_model
    from certkv.requests.request_set import generate_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--n", type=int, default=60, help="measured requests")
    p.add_argument("--pilot", type=int, default=100, help="pilot requests placing the thresholds")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n, n_pilot, reps = (6, 30, 1) if args.quick else (args.n + 1, args.pilot, args.reps)
    model, tokenizer = load_model("embedded", device="cpu")
    t0 = time.perf_counter()
    pilot = pilot_records(model, tokenizer, generate_requests("demo", n_pilot, seed=PILOT_SEED, context_length=CONTEXT))
    settings = gates(pilot)
    requests = generate_requests("demo", n, seed=SEED, context_length=CONTEXT)
    results = {
        "model": "embedded", "device": "cpu", "threads": args.threads, "torch": torch.__version__,
        "seed": SEED, "pilot_seed": PILOT_SEED, "pilot_requests": n_pilot, "requests": n - 1,
        "context_length": CONTEXT, "kv_retained": KV, "quantile": QUANTILE, "repetitions": reps,
        "lookahead_tokens": LOOKAHEAD_TOKENS,
        "thresholds": {k: (g.model_dump(exclude_defaults=True) if g is not None else None)
                       for k, (_, g) in settings.items()},
        "operating_points": measure(runtimes(model, tokenizer, settings), requests, reps),
    }
    from calibration_speed import larger_llama

    big = larger_llama(tokenizer)
    results["probe"] = {
        "embedded@512": probe_share(model, tokenizer, generate_requests("demo", 4 if args.quick else 11, seed=SEED + 2,
                                                                        context_length=512), reps),
        "random-llama-8L-512h@2048": probe_share(big, tokenizer, generate_requests(
            "demo", 3 if args.quick else 6, seed=SEED + 3, context_length=2048), reps),
    }
    print(json.dumps(results["probe"], indent=1))
    results["seconds"] = time.perf_counter() - t0
    print(json.dumps(results["operating_points"], indent=1))
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "runtime_cost.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
