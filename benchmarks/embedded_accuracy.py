"""Full-KV exact match of the embedded model per task and context length.

Fresh requests from a seed the training never used (training draws its own samples from
``random.Random("train/...")``; request sets use ``certkv/<seed>/<i>``).

    python benchmarks/embedded_accuracy.py                 # 500 per task at 256 and 512 tokens
    python benchmarks/embedded_accuracy.py --n 100 --lengths 128 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from certkv.requests.builtin_tasks import TASKS

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    import torch

    from certkv.calibration.accuracy import full_kv_accuracy
    from certkv.model.loading import load_model, model_fingerprint
    from certkv.requests.request_set import generate_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=500, help="requests per task and length")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512])
    p.add_argument("--seed", type=int, default=90210)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "embedded_accuracy.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("embedded", device="cpu")
    table: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for length in args.lengths:
        for task in TASKS:
            reqs = generate_requests(task, args.n, seed=args.seed, context_length=length)
            (n, acc), = [v for k, v in full_kv_accuracy(model, tokenizer, reqs, progress=False).items() if k == task]
            table.setdefault(task, {})[str(length)] = acc
            print(f"{task:18s} {length:5d} tokens: {acc:.3f} ({n} requests)", flush=True)
    out = {
        "model": model_fingerprint("embedded"),  # tests check that the shipped demo mix follows this table
        "n_per_cell": args.n, "seed": args.seed, "exact_match": table, "seconds": time.perf_counter() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    header = "| task | " + " | ".join(f"{L} tokens" for L in args.lengths) + " |"
    print("\n" + header + "\n|" + "---|" * (len(args.lengths) + 1))
    for task, row in table.items():
        print(f"| {task} | " + " | ".join(f"{row[str(L)]:.3f}" for L in args.lengths) + " |")


if __name__ == "__main__":
    main()
