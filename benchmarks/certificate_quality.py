"""Does the survey-variance certificate ĉ track the real error of the sampled attention?

For every decode step (each query position of the question feed, then each generated token),
every layer and every KV head of certkv's probabilistic press, this compares

- ĉ, the certificate the Hájek attention computes from the kept entries alone, with
- the true error ‖o_full − ô‖: the same query's attention output over the FULL cache (the
  context's uncompressed keys and values from the same prefill plus the tokens fed since) minus
  the corrected output over the kept entries. Like ĉ, it is the max over the KV head's query heads.

Requests are split in two halves (seeded): z is the (conformal, ⌈(n+1)·0.95⌉-th smallest) 95%
quantile of error/ĉ over the pairs of the first half, and coverage is the share of
(step, layer, head) pairs of the second half with error ≤ z·ĉ (target ≥ 95%). Pairs of one
request are correlated, so one split is noisy: the figures are over 50 random halvings. Spearman's ρ between ĉ and the error says whether ĉ ranks steps by their error.

    python benchmarks/certificate_quality.py --n 100   # writes benchmarks/results/certificate_quality.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SEED = 8080
PROBE = "certkv_hajek_probe"


class Probe:
    """An attention function: the Hájek attention, plus the full-cache output for comparison."""

    def __init__(self):
        self.full: dict[int, tuple] = {}  # layer → the context's full keys and values
        self.pairs: list[tuple] = []  # (certificate, error) tensors of one call

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        import torch

        from certkv.presses.hajek_attention import hajek_attention, layer_certificates
        from certkv.presses.probabilistic import STATE_ATTR

        q_len, k_len = query.shape[2], key.shape[2]
        if q_len == k_len:  # the prefill: remember the full context of this layer
            self.full[module.layer_idx] = (key.detach().clone(), value.detach().clone())
        out = hajek_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
        state = getattr(module, STATE_ATTR, None)
        if q_len == k_len or state is None:
            return out
        full_k, full_v = self.full[module.layer_idx]
        k_all = torch.cat([full_k, key[:, :, state.n_slots :]], dim=2)
        v_all = torch.cat([full_v, value[:, :, state.n_slots :]], dim=2)
        n_all = k_all.shape[2]
        positions = torch.arange(n_all, device=query.device)
        allowed = positions.view(1, -1) <= (n_all - q_len + torch.arange(q_len, device=query.device)).view(-1, 1)
        o_full = torch.nn.functional.scaled_dot_product_attention(
            query, k_all, v_all, attn_mask=allowed, scale=scaling, enable_gqa=True
        )  # (B, H, Q, d)
        o_hat = out[0].transpose(1, 2)
        batch, heads = query.shape[:2]
        kv_heads = key.shape[1]
        error = (o_full - o_hat).float().norm(dim=-1).view(batch, kv_heads, heads // kv_heads, q_len).amax(dim=2)
        certificate = layer_certificates(module)[-1]
        self.pairs.append((certificate.flatten().cpu(), error.flatten().cpu()))
        return out


def collect(model, tok, requests, kv: float, probe: Probe):
    import torch
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from certkv.generation import encode_request, greedy_decode
    from certkv.presses.probabilistic import ProbabilisticPress, clear_states

    AttentionInterface.register(PROBE, probe)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE, sdpa_mask)
    press = ProbabilisticPress(compression_ratio=round(1 - kv, 6))
    per_request = []
    previous = model.config._attn_implementation
    model.config._attn_implementation = PROBE
    try:
        for r in requests:
            enc = encode_request(tok, r.context, r.question)
            probe.pairs = []
            cache = DynamicCache()
            with torch.no_grad():
                with press(model):
                    model.model(input_ids=torch.tensor([enc.context_ids]), past_key_values=cache)
                greedy_decode(model, cache, enc.question_ids, len(enc.context_ids), 8)
            clear_states(model)
            per_request.append((torch.cat([c for c, _ in probe.pairs]), torch.cat([e for _, e in probe.pairs])))
    finally:
        model.config._attn_implementation = previous
    return per_request


def quality(per_request, seed: int, splits: int = 50) -> dict:
    """z on one half of the requests (conformal quantile), coverage on the other; over `splits`
    random halvings, since pairs of one request are correlated and one split is noisy."""
    import math

    import numpy as np
    from scipy.stats import spearmanr

    rng = np.random.default_rng(seed)

    def stack(idx):
        cert = np.concatenate([per_request[i][0].numpy() for i in idx])
        err = np.concatenate([per_request[i][1].numpy() for i in idx])
        return cert, err

    coverages, zs = [], []
    for _ in range(splits):
        order = rng.permutation(len(per_request))
        half = len(order) // 2
        cal_c, cal_e = stack(order[:half])
        test_c, test_e = stack(order[half:])
        ratios = np.sort(np.where(cal_c > 0, cal_e / np.maximum(cal_c, 1e-30), np.inf))
        z = float(ratios[min(len(ratios) - 1, math.ceil((len(ratios) + 1) * 0.95) - 1)])
        zs.append(z)
        coverages.append(float(np.mean(test_e <= z * test_c)))
    all_c, all_e = stack(range(len(per_request)))
    return {
        "pairs": int(all_c.size),
        "splits": splits,
        "z_median": float(np.median(zs)),
        "coverage_mean": float(np.mean(coverages)),
        "coverage_p05": float(np.quantile(coverages, 0.05)),
        "coverage_min": float(np.min(coverages)),
        "spearman": float(spearmanr(all_c, all_e).statistic),
        "mean_certificate": float(all_c.mean()),
        "mean_error": float(all_e.mean()),
    }


def main() -> None:
    import torch

    from certkv.models import load_model
    from certkv.requests import generate_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("embedded", device="cpu")
    requests = generate_requests("demo", args.n, seed=SEED, context_length=(256, 512))
    results = {"seed": SEED, "requests": args.n, "by_kv_retained": {}}
    for kv in (0.7, 0.5, 0.3):
        per_request = collect(model, tok, requests, kv, Probe())
        results["by_kv_retained"][str(kv)] = quality(per_request, SEED)
        print(kv, json.dumps(results["by_kv_retained"][str(kv)]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "certificate_quality.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
