"""Full-KV exact match of a model per task and context length: the embedded model on its tasks,
or a real model (``--model smollm2-135m``) on the natural-English RULER tasks.

The embedded model's long-output task, recite, is measured at the lengths of its own span
(``RECITE_LENGTHS``, 128 and 256 tokens) with room for its longest answer (``RECITE_MAX_NEW_TOKENS``).

Fresh requests from a seed the training never used (training draws its own samples from
``random.Random("train/...")``; request sets use ``certkv/<seed>/<i>``).

    python benchmarks/embedded_accuracy.py                 # 500 per task at 256 and 512 tokens
    python benchmarks/embedded_accuracy.py --n 100 --lengths 128 256 512 1024 2048
    python benchmarks/embedded_accuracy.py --model smollm2-135m --n 10 10 3 --lengths 512 2048 8192
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from certkv.requests.builtin_tasks import LONG_TASKS, TASKS
from certkv.requests.natural_tasks import NATURAL_TASKS

RESULTS = Path(__file__).parent / "results"
RECITE_LENGTHS = [128, 256]
RECITE_MAX_NEW_TOKENS = 160  # the longest recite answer is 126 tokens and its stop token


def main() -> None:
    import torch

    from certkv.calibration.accuracy import FAILING_ACCURACY, full_kv_accuracy
    from certkv.core.spec import DEFAULT_MAX_NEW_TOKENS
    from certkv.model.loading import load_model, model_fingerprint
    from certkv.requests.request_set import generate_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded", help="embedded (its tasks) or a real model (the ruler tasks)")
    p.add_argument("--n", type=int, nargs="+", default=[500], help="requests per task at each length (one: at every length)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="default: 256 512 (embedded; recite at 128 256), 512 2048 8192")
    p.add_argument("--seed", type=int, default=90210)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="default: results/embedded_accuracy.json, or <model>_accuracy.json")
    args = p.parse_args()
    embedded = args.model == "embedded"
    lengths = args.lengths or ([256, 512] if embedded else [512, 2048, 8192])
    out_path = Path(args.out) if args.out else RESULTS / ("embedded_accuracy.json" if embedded else
                                                         f"{args.model.replace('-', '_')}_accuracy.json")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device="cpu")
    tasks = TASKS if embedded else NATURAL_TASKS
    if len(args.n) not in (1, len(lengths)):
        p.error(f"--n gives {len(args.n)} counts for {len(lengths)} lengths; give one, or one per length")
    n_at = dict(zip(lengths, args.n * len(lengths) if len(args.n) == 1 else args.n))
    table: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    cells = [(task, length, n_at[length], DEFAULT_MAX_NEW_TOKENS) for length in lengths for task in tasks]
    if embedded and not args.lengths:
        cells += [(task, length, n_at[lengths[0]], RECITE_MAX_NEW_TOKENS) for task in LONG_TASKS for length in RECITE_LENGTHS]
    for task, length, count, max_new_tokens in cells:
        reqs = generate_requests(task, count, seed=args.seed, context_length=length)
        (n, acc), = [v for k, v in full_kv_accuracy(model, tokenizer, reqs, max_new_tokens=max_new_tokens,
                                                     progress=False).items() if k == task]
        table.setdefault(task, {})[str(length)] = acc
        print(f"{task:18s} {length:5d} tokens: {acc:.3f} ({n} requests)", flush=True)
    out = {
        "model": model_fingerprint(args.model),  # tests check that the shipped demo mix follows the embedded table
        "n_per_cell": args.n[0] if len(args.n) == 1 else {str(L): n_at[L] for L in lengths},
        "seed": args.seed, "exact_match": table, "seconds": time.perf_counter() - t0,
        "threads": args.threads, "max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "failing_below": FAILING_ACCURACY,
        **({"max_new_tokens_long": RECITE_MAX_NEW_TOKENS} if set(LONG_TASKS) & set(table) else {}),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    columns = sorted({int(L) for row in table.values() for L in row})
    header = "| task | " + " | ".join(f"{L} tokens" for L in columns) + " |"
    print("\n" + header + "\n|" + "---|" * (len(columns) + 1))
    for task, row in table.items():
        print(f"| {task} | " + " | ".join(f"{row[str(L)]:.3f}" if str(L) in row else "—" for L in columns) + " |")


if __name__ == "__main__":
    main()
