"""Does eviction matter on the embedded model? Per press and KV fraction, through kvpress's pipeline.

For each request the full-KV answer is compared with kvpress's own pipeline answer under SnapKV and
StreamingLLM at several ratios. A certifier has something to work on only when eviction breaks
some requests the model answers at full KV and leaves others intact: the table counts both.

    python benchmarks/eviction_spread.py --n 300
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    import kvpress  # noqa: F401  (registers the pipeline)
    import torch
    from transformers import pipeline

    from certkv.calibration.utility import exact_match
    from certkv.model.loading import load_model
    from certkv.presses.registry import build_press
    from certkv.requests.request_set import generate_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--seed", type=int, default=4242)
    p.add_argument("--context-length", default="256-512")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("embedded", device="cpu")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    requests = generate_requests("demo", args.n, seed=args.seed, context_length=args.context_length)
    full_ok = []
    for r in requests:
        full_ok.append(exact_match(pipe(r.context, question=r.question, max_new_tokens=8)["answer"], r.answers) == 1.0)
    rows = []
    for press in ["snapkv", "streaming_llm"]:
        for kv in [0.9, 0.7, 0.5, 0.3, 0.2, 0.1]:
            broken = kept = 0
            for r, ok in zip(requests, full_ok):
                if not ok:
                    continue
                answer = pipe(r.context, question=r.question, press=build_press(press, kv), max_new_tokens=8)["answer"]
                if exact_match(answer, r.answers) == 1.0:
                    kept += 1
                else:
                    broken += 1
            rows.append({"press": press, "kv_retained": kv, "full_kv_correct": sum(full_ok),
                         "still_correct": kept, "broken_by_eviction": broken})
            print(f"{press:14s} kv {kv:.1f}: of {sum(full_ok)} answered at full KV, {kept} still right, {broken} broken",
                  flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "eviction_spread.json").write_text(json.dumps({"n": args.n, "seed": args.seed, "rows": rows}, indent=2) + "\n")
    print("\n| press | kv_retained | still right | broken by eviction |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['press']} | {row['kv_retained']:.1f} | {row['still_correct']} | {row['broken_by_eviction']} |")


if __name__ == "__main__":
    main()
