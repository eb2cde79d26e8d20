"""Pre-register the demo contract's gate grid on pilot requests that calibration never sees.

A gate threshold or certificate bound chosen on the calibration requests would be tuned on the
data that then tests it. docs/design.md ("Gate signals") allows a grid learned on a separate split; this script is that
split: it draws pilot requests from the demo mix with their own seed (the shipped calibration set
uses seed 0), runs the engine once per request and prints quantiles of

- the agreement drop (thresholds: the gate sends the lowest-drop requests to the full cache),
- each probabilistic candidate's certificate maximum (bounds: escalate the highest ones).

The printed grid is what `certkv/demo/demo.yaml` pre-registers, rounded to two significant digits.

    python benchmarks/gate_grid_pilot.py --n 200
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from certkv.core.policy_names import policy_name

RESULTS = Path(__file__).parent / "results"
PILOT_SEED = 31337
THRESHOLD_QUANTILES = (0.05, 0.10, 0.20)
BOUND_QUANTILES = (0.80, 0.90)


def main() -> None:
    import numpy as np
    import torch

    from certkv.engine.engine import Engine, PressCandidate
    from certkv.model.loading import load_model
    from certkv.presses.probabilistic import ProbabilisticPress
    from certkv.requests.request_set import generate_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("embedded", device="cpu")
    kvs = (0.5, 0.3)
    candidates = [
        PressCandidate(policy_name("probabilistic", kv), ProbabilisticPress(compression_ratio=round(1 - kv, 6)),
                       "probabilistic", kv)
        for kv in kvs
    ]
    engine = Engine(model, tok, candidates, agreement={})
    drops, certs = [], {c.policy: [] for c in candidates}
    for r in generate_requests("demo", args.n, seed=PILOT_SEED, context_length=(256, 512)):
        result = engine.run(r.context, r.question, r.answer_prefix)
        drops.append(result.agreement_drop)
        for c in result.candidates:
            certs[c.policy].append(c.certificate_max)
    drops = np.array(drops)
    out = {
        "pilot_seed": PILOT_SEED,
        "n": args.n,
        "agreement_drop_quantiles": {str(q): float(np.quantile(drops, q)) for q in THRESHOLD_QUANTILES},
        "certificate_max_quantiles": {
            policy: {str(q): float(np.quantile(values, q)) for q in BOUND_QUANTILES} for policy, values in certs.items()
        },
    }
    print(json.dumps(out, indent=1))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gate_grid_pilot.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
