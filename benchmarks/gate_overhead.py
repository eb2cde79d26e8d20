"""What the runtime gate and the certificate cost, measured side by side.

Prefill (issue target: ≤ 5% at 512–2048 tokens), per request, in rotating order so that machine
noise hits every variant alike (each variant 3 times per request, the fastest counts):

- ``plain``: the full prefill alone;
- ``gate``: the same prefill with the agreement recorder's hooks (W = 32 window queries per layer);
- ``gate+scoring``: the recorder plus the probabilistic press's selection (its score, inclusion
  probabilities and Poisson draw) at kv_retained 0.5, i.e. everything certkv adds to a prefill.

The side-by-side ratios (``prefill_overhead_*``) carry the run-to-run noise of the model's own
memory-bound kernels (a few % at these sizes, either way); ``prefill_inside_*`` is the time spent
inside certkv's hooks and the drop's reduction over the plain prefill, timed where they run.

Decode step (issue target: ≤ 10%): the same compressed cache (the probabilistic press's selection
at kv_retained 0.5) decoded for 16 steps (5 rounds per repetition, the fastest counts) with

- ``sdpa``: transformers' sdpa attention over the kept entries (no correction, no certificate);
- ``hajek``: the Hájek attention with its −log π correction but no certificate (benchmark only);
- ``certified``: the Hájek attention with its −log π correction and the certificate of every step,
  read back once at the end of the decode, as the runtime does.

``decode_step_overhead_certificate_over_hajek`` is certified over hajek (what the certificate adds to the
probabilistic press's decode step, the issue's figure); ``decode_step_overhead_hajek_and_certificate``
is certified over sdpa (everything, the correction included, against stock attention).

Models: the embedded model and a randomly initialised 8-layer Llama (hidden 512, 16/4 heads), each
at 512 and 2048 tokens. Times are medians over requests of the per-request time.

    python benchmarks/gate_overhead.py           # writes benchmarks/results/gate_overhead.json
    python benchmarks/gate_overhead.py --quick
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
STEPS = 16
DECODE_ROUNDS = 5


def prefill_variants(model, context_ids, spent: list):
    """Callables running one prefill each way; each returns the cache (and the selection).

    ``spent[0]`` receives the seconds the last run spent inside certkv's own work: the recorder's
    hooks, the press's selection and the drop's reduction (timed where they are called).
    """
    import torch
    from transformers import DynamicCache

    from certkv.engine.probabilistic_decode import selection_hooks
    from certkv.model.window_queries import capturing_window_queries
    from certkv.presses.probabilistic import ProbabilisticPress
    from certkv.signals.agreement import AgreementRecorder

    def timed(function):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    press = ProbabilisticPress(compression_ratio=0.5)
    # what the engine's selection hooks call: the base score in each layer's hook, then the
    # selection of every layer at once after the last one
    press.base_press.score = timed(press.base_press.score)
    press.select_layers = timed(press.select_layers)
    recorder = AgreementRecorder()
    recorder.forward_hook = timed(recorder.forward_hook)  # what attach() registers
    drop = timed(recorder.drop)

    def plain():
        spent[0] = 0.0
        cache = DynamicCache()
        with torch.no_grad():
            model.model(input_ids=context_ids, past_key_values=cache)
        return cache

    def gate():
        spent[0] = 0.0
        cache = DynamicCache()
        recorder.reset()
        with torch.no_grad(), recorder.attach(model), capturing_window_queries(model):
            model.model(input_ids=context_ids, past_key_values=cache)
        drop()
        return cache

    def gate_and_scoring():
        spent[0] = 0.0
        cache = DynamicCache()
        recorder.reset()
        selections: dict = {}
        with (
            torch.no_grad(), recorder.attach(model), selection_hooks(model, {"p": press}, selections),
            capturing_window_queries(model),
        ):
            model.model(input_ids=context_ids, past_key_values=cache)
        drop()
        return cache, selections["p"]

    return {"plain": plain, "gate": gate, "gate+scoring": gate_and_scoring}


HAJEK_ONLY = "certkv_bench_hajek_only"


def hajek_without_certificate(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The Hájek attention minus its certificate: what the −log π correction alone costs, so that
    the certificate's own share of a decode step can be told apart (benchmark only)."""
    from certkv.presses.hajek_attention import corrected_attention, hajek_attention
    from certkv.presses.hajek_state import STATE_ATTR

    state = getattr(module, STATE_ATTR, None)
    if state is None or state.trivial or query.shape[2] == key.shape[2]:
        return hajek_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    output, _ = corrected_attention(query, key, value, attention_mask, scaling, state)
    batch, heads, q_len, head_dim = query.shape
    return output.view(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


def decode_steps(model, cache, states, context_length: int, variant: str) -> float:
    """Seconds for STEPS single-token decode steps over `cache` (consumed).

    `variant`: ``sdpa`` (stock attention over the kept entries), ``hajek`` (the −log π correction,
    no certificate) or ``certified`` (correction and certificate, checked as the runtime does).
    """
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from certkv.presses.hajek_attention import certificate_steps, use_hajek_attention
    from certkv.presses.hajek_state import clear_states, set_state
    from certkv.presses.probabilistic import attention_modules

    modules = attention_modules(model)
    token = torch.tensor([[5]])
    if variant != "sdpa":
        for module, state in zip(modules, states):
            set_state(module, state)
    AttentionInterface.register(HAJEK_ONLY, hajek_without_certificate)
    ALL_MASK_ATTENTION_FUNCTIONS.register(HAJEK_ONLY, sdpa_mask)
    certified = variant == "certified"
    with torch.no_grad(), (_nothing() if variant == "sdpa" else use_hajek_attention(model)):
        if variant == "hajek":
            model.config._attn_implementation = HAJEK_ONLY  # restored by use_hajek_attention
        t0 = time.perf_counter()
        for i in range(STEPS):
            out = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[context_length + i]]))
            token = out.logits[:, -1:].argmax(-1)
            float(out.logits[0, -1, 0])  # one host sync per step, as greedy decoding has
        if certified:
            certificate_steps(model)  # the runtime reads every step's certificate once, at the end
        seconds = time.perf_counter() - t0
    clear_states(model)
    return seconds


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def measure(model, tokenizer, requests, reps: int = 3) -> dict:
    """Per request, each variant `reps` times in rotating order; its time is the minimum (the run
    least disturbed by the machine), and the overheads are medians over requests of the
    per-request ratios."""
    import torch

    from certkv.engine.probabilistic_decode import gathered_cache
    from certkv.model.generation import encode_request

    names = ["plain", "gate", "gate+scoring", "sdpa", "hajek", "certified"]
    best: dict[str, list[float]] = {k: [] for k in names}
    inside: dict[str, list[float]] = {"gate": [], "gate+scoring": []}
    for i, r in enumerate(requests):
        ids = torch.tensor([encode_request(tokenizer, r.context, r.question, r.answer_prefix).context_ids])
        n = ids.shape[1]
        spent = [0.0]
        variants = prefill_variants(model, ids, spent)
        times: dict[str, list[float]] = {k: [] for k in names + ["gate_inside", "gate+scoring_inside"]}
        for rep in range(reps):
            order = list(variants)
            order = order[(i + rep) % 3 :] + order[: (i + rep) % 3]
            for name in order:
                t0 = time.perf_counter()
                result = variants[name]()
                times[name].append(time.perf_counter() - t0)
                if name != "plain":
                    times[name + "_inside"].append(spent[0])
                if name == "gate+scoring":
                    full_cache, selection = result
            decoders = ["sdpa", "hajek", "certified"]
            # decode steps are short (11-15 ms on the 8-layer model) and their ratios noisier than
            # the prefill's: each decoder runs DECODE_ROUNDS times per repetition, rotating
            for _ in range(DECODE_ROUNDS):
                for name in decoders[(i + rep) % 3 :] + decoders[: (i + rep) % 3]:
                    cache, states = gathered_cache(full_cache, [selection], n)
                    times[name].append(decode_steps(model, cache, states, n, name) / STEPS)
        if i == 0:
            continue  # warm-up
        for name in names:
            best[name].append(min(times[name]))
        for name in ("gate", "gate+scoring"):
            inside[name].append(min(times[name + "_inside"]) / min(times["plain"]))

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(best[a], best[b])) - 1

    return {
        "requests": len(requests) - 1,
        "repetitions": reps,
        "context_tokens": int(ids.shape[1]),
        "median_seconds": {k: statistics.median(v) for k, v in best.items()},
        "prefill_overhead_gate": ratio("gate", "plain"),
        "prefill_overhead_gate_and_scoring": ratio("gate+scoring", "plain"),
        # the same, as the time spent inside certkv's hooks over the plain prefill: no run-to-run
        # noise of the model's own (memory-bound) kernels, but none of its indirect costs either
        "prefill_inside_gate": statistics.median(inside["gate"]),
        "prefill_inside_gate_and_scoring": statistics.median(inside["gate+scoring"]),
        "decode_step_overhead_certificate_over_hajek": ratio("certified", "hajek"),
        "decode_step_overhead_hajek": ratio("hajek", "sdpa"),
        "decode_step_overhead_hajek_and_certificate": ratio("certified", "sdpa"),
    }


def main() -> None:
    import torch
    from calibration_speed import larger_llama

    from certkv.model.loading import load_model
    from certkv.requests.request_set import generate_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, default=20, help="measured requests per setting")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "torch": torch.__version__, "settings": {}}
    model, tokenizer = load_model("embedded", device="cpu")
    n = 4 if args.quick else args.n + 1
    for length in (512, 2048):
        reqs = generate_requests("demo", n if length == 512 else max(3, n // 2), seed=77, context_length=length)
        results["settings"][f"embedded@{length}"] = measure(model, tokenizer, reqs)
        print(f"embedded@{length}", json.dumps(results["settings"][f"embedded@{length}"], indent=1), flush=True)
    big = larger_llama(tokenizer)
    for length in (512, 2048):
        reqs = generate_requests("demo", max(3, n // 2), seed=78, context_length=length)
        key = f"random-llama-8L-512h@{length}"
        results["settings"][key] = measure(big, tokenizer, reqs)
        print(key, json.dumps(results["settings"][key], indent=1), flush=True)
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "gate_overhead.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
