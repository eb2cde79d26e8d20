"""Time `certkv.certify` on 100k records (issue: under a second), torch-free.

Synthetic records: 3,704 requests × 27 candidates (+ the full-cache row each), as the calibration
store hands them over (a list of dicts), losses drawn so that risk grows with eviction.

    python benchmarks/certify_speed.py
"""

from __future__ import annotations

import random
import sys
import time

from certkv.core.policy_names import REFERENCE_POLICY, policy_name


def records(n_requests: int = 3704, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    kvs = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    rows = []
    for i in range(n_requests):
        rid = f"r{i:06d}"
        rows.append({"request_id": rid, "task": "t", "policy": REFERENCE_POLICY, "kv_retained": 1.0, "loss": 0.0})
        for press, hardness in [("snapkv", 0.3), ("streaming_llm", 0.8), ("knorm", 1.0)]:
            for kv in kvs:
                loss = 1.0 if rng.random() < hardness * (1 - kv) ** 2 else 0.0
                rows.append({"request_id": rid, "task": "t", "policy": policy_name(press, kv), "press": press,
                             "kv_retained": kv, "loss": loss})
    return rows


def main() -> None:
    from certkv.core.certify import certify
    from certkv.core.loss_table import LossTable
    from certkv.core.spec import CertificationSpec

    rows = records()
    spec = CertificationSpec(
        tolerance=0.0, risk=0.05, confidence=0.95, procedure="fixed_sequence",
        sequences=[[policy_name(p, kv) for kv in [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]]
                   for p in ("snapkv", "streaming_llm", "knorm")],
    )
    certify(LossTable.from_records(rows[:2800]), spec)  # warm imports
    times = []
    for _ in range(5):
        t = time.perf_counter()
        op = certify(LossTable.from_records(rows), spec)  # reading the rows included, as before
        times.append(time.perf_counter() - t)
    n_candidate_rows = sum(1 for r in rows if r["policy"] != REFERENCE_POLICY)
    print(f"{len(rows)} records ({n_candidate_rows} candidate rows): certify best {min(times):.3f} s, "
          f"median {sorted(times)[2]:.3f} s; chose {op.policy}; torch imported: {'torch' in sys.modules}")


if __name__ == "__main__":
    main()
