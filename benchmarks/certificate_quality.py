"""Does the survey-variance certificate ĉ track the real error of the sampled attention?

For every decode step (each query position of the question feed, then each generated token),
every layer and every KV head of certkv's probabilistic press, this compares

- ĉ, the certificate the Hájek attention computes from the kept entries alone, with
- the true error ‖o_full − ô‖: the same query's attention output over the FULL cache (the
  context's uncompressed keys and values from the same prefill plus the tokens fed since) minus
  the corrected output over the kept entries. Like ĉ, it is the max over the KV head's query heads.

Requests are split in two halves (seeded): z is calibrated on the first half and coverage is the
share of (step, layer, head) pairs of the second half with error ≤ z·ĉ (target ≥ 95%). z is
calibrated two ways:

- ``grouped`` (the figure that counts): conformal risk control with one loss per request, the
  share of its pairs z leaves uncovered (:func:`conformal_scale.grouped_scale_factor`, α = 0.05).
  Requests are exchangeable, their pairs are not, so this is what promises ≥ 95% on new requests;
- ``pooled``: the plain conformal quantile (⌈(m+1)·0.95⌉-th smallest) of error/ĉ over the first
  half's m pairs, which treats correlated pairs as exchangeable (kept for comparison).

One split is noisy, so the figures are over 50 random halvings. Spearman's ρ between ĉ and the
error says whether ĉ ranks steps by their error; ``by_layer_head`` gives, per (layer, KV head),
the median and 95th percentile of error/ĉ (where the certificate under-reads the error) and, on
the head's worst 5% of pairs by error/ĉ and on the rest, the median error and the median
full-cache attention mass on the context entries the press did not keep (what no statistic of
the kept sample can see).

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
        self.layer_heads: list = []  # per call, the (layer, KV head) of each flattened pair
        self.dropped: list = []  # per call, the full-cache attention mass on context entries not kept
        self.kept: dict[int, object] = {}  # layer → (B, H_kv, K) bool, the context entries kept

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        import torch

        from certkv.presses.hajek_attention import hajek_attention, layer_certificates
        from certkv.presses.hajek_state import STATE_ATTR

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
        head = torch.arange(kv_heads).view(1, kv_heads, 1).expand(batch, kv_heads, q_len).flatten()
        self.layer_heads.append(head + kv_heads * module.layer_idx)
        # where the full-cache attention of the same queries goes: its mass on the context
        # entries the sample left out is what no statistic of the kept entries can see
        groups = heads // kv_heads
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        logits = torch.matmul(query, k_all.repeat_interleave(groups, dim=1).transpose(2, 3)) * scale
        weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)[..., : full_k.shape[2]]
        left_out = ~self.kept[module.layer_idx].repeat_interleave(groups, dim=1).unsqueeze(2)
        dropped = (weights * left_out).sum(-1).view(batch, kv_heads, groups, q_len).amax(dim=2)
        self.dropped.append(dropped.flatten().cpu())
        return out


def collect(model, tok, requests, kv: float, probe: Probe):
    import torch
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from certkv.model.generation import encode_request, greedy_decode
    from certkv.presses.hajek_state import clear_states
    from certkv.presses.probabilistic import ProbabilisticPress

    AttentionInterface.register(PROBE, probe)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE, sdpa_mask)
    class Recording(ProbabilisticPress):
        """The press, telling the probe which context entries each layer kept."""

        def select(self, module, hidden_states, keys, values, attentions, kwargs):
            selection = super().select(module, hidden_states, keys, values, attentions, kwargs)
            kept = torch.zeros(keys.shape[:3], dtype=torch.bool, device=keys.device)
            kept.scatter_(-1, torch.where(selection.valid, selection.indices, selection.indices[..., :1]), True)
            probe.kept[module.layer_idx] = kept
            return selection

    press = Recording(compression_ratio=round(1 - kv, 6))
    per_request = []
    previous = model.config._attn_implementation
    model.config._attn_implementation = PROBE
    try:
        for r in requests:
            enc = encode_request(tok, r.context, r.question, r.answer_prefix)
            probe.pairs, probe.layer_heads, probe.dropped = [], [], []
            cache = DynamicCache()
            with torch.no_grad():
                with press(model):
                    model.model(input_ids=torch.tensor([enc.context_ids]), past_key_values=cache)
                greedy_decode(model, cache, enc.question_ids, len(enc.context_ids), 8)
            clear_states(model)
            per_request.append((
                torch.cat([c for c, _ in probe.pairs]), torch.cat([e for _, e in probe.pairs]),
                torch.cat(probe.layer_heads), torch.cat(probe.dropped),
            ))
    finally:
        model.config._attn_implementation = previous
    return per_request


def quality(per_request, seed: int, kv_heads: int, splits: int = 50) -> dict:
    """z on one half of the requests, coverage on the other, for both calibrations of z; over
    `splits` random halvings, since pairs of one request are correlated and one split is noisy."""
    import numpy as np
    from conformal_scale import grouped_scale_factor, pooled_scale_factor  # benchmarks/conformal_scale.py
    from scipy.stats import spearmanr

    rng = np.random.default_rng(seed)
    ratios = [np.where(c.numpy() > 0, e.numpy() / np.maximum(c.numpy(), 1e-30), np.inf) for c, e, _, _ in per_request]
    ratios = [np.where((c.numpy() == 0) & (e.numpy() == 0), 0.0, r) for r, (c, e, _, _) in zip(ratios, per_request)]
    figures = {method: {"z": [], "coverage": [], "request_coverage": []} for method in ("grouped", "pooled")}
    for _ in range(splits):
        order = rng.permutation(len(per_request))
        half = len(order) // 2
        calibration, test = [ratios[i] for i in order[:half]], [ratios[i] for i in order[half:]]
        pooled_test = np.concatenate(test)
        for name, z in (
            ("grouped", grouped_scale_factor(calibration, 0.05)),
            ("pooled", pooled_scale_factor(np.concatenate(calibration), 0.95)),
        ):
            figures[name]["z"].append(z)
            figures[name]["coverage"].append(float(np.mean(pooled_test <= z)))
            figures[name]["request_coverage"].append(float(np.mean([np.mean(r <= z) for r in test])))
    all_c = np.concatenate([c.numpy() for c, _, _, _ in per_request])
    all_e = np.concatenate([e.numpy() for _, e, _, _ in per_request])
    all_r = np.concatenate(ratios)
    where = np.concatenate([lh.numpy() for _, _, lh, _ in per_request])
    dropped = np.concatenate([d.numpy() for _, _, _, d in per_request])
    by_layer_head = {}
    for code in np.unique(where):
        mask = where == code
        p95 = np.quantile(all_r[mask], 0.95)
        worst, rest = mask & (all_r >= p95), mask & (all_r < p95)  # this head's worst 5% by error / ĉ
        by_layer_head[f"layer{code // kv_heads}/head{code % kv_heads}"] = {
            "pairs": int(mask.sum()),
            "ratio_median": float(np.median(all_r[mask])),
            "ratio_p95": float(p95),
            "spearman": float(spearmanr(all_c[mask], all_e[mask]).statistic),
            # the full-cache attention mass on context entries not kept, and the error
            "dropped_mass_median_worst5": float(np.median(dropped[worst])),
            "dropped_mass_median_rest": float(np.median(dropped[rest])),
            "error_median_worst5": float(np.median(all_e[worst])),
            "error_median_rest": float(np.median(all_e[rest])),
        }
    summary = {
        name: {
            "z_median": float(np.median(f["z"])),
            "coverage_mean": float(np.mean(f["coverage"])),
            "coverage_p05": float(np.quantile(f["coverage"], 0.05)),
            "coverage_min": float(np.min(f["coverage"])),
            "request_coverage_mean": float(np.mean(f["request_coverage"])),
        }
        for name, f in figures.items()
    }
    return {
        "pairs": int(all_c.size),
        "splits": splits,
        **summary,
        "spearman": float(spearmanr(all_c, all_e).statistic),
        "mean_certificate": float(all_c.mean()),
        "mean_error": float(all_e.mean()),
        "by_layer_head": by_layer_head,
    }


def main() -> None:
    import torch

    from certkv.model.loading import load_model
    from certkv.requests.request_set import generate_requests

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
        results["by_kv_retained"][str(kv)] = quality(per_request, SEED, model.config.num_key_value_heads)
        print(kv, json.dumps(results["by_kv_retained"][str(kv)]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "certificate_quality.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
