"""Behavior-Preserving KV: keep the entries whose loss would move the next-token distribution most."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from certkv.errors import CertkvError
from certkv.model.layers import attention_modules, decoder
from certkv.presses._checks import check_count
from certkv.presses.response_aware import ResponseAwarePress
from certkv.signals.lookahead import captured_last_queries, capturing_last_query

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from certkv.model.generation import EncodedRequest

#: Σ_{k≠j} a_k is clamped to at least this before dividing (an entry holding all of a head's attention).
_MIN_REST = 1e-30
#: Vocabulary rows per float64 block when the output metric is summed (bounds its memory).
_VOCAB_BLOCK = 8192


@dataclass
class BehaviorPreservingPress(ResponseAwarePress):
    """Keep the context entries whose eviction would change the first answer token's distribution most.

    What an eviction must preserve is the model's behaviour, not its attention: the score of
    context entry j of KV head h in layer l is the KL divergence of the next-token distribution at
    the question's last position (fed over the full cache) with that single entry removed, from
    the full-cache one. A masked forward per candidate is far too costly, so the KL is estimated
    from the one full-cache forward; the estimate is a choice made here, first order in the
    eviction, because it needs only statistics that forward already has and one
    hidden × hidden matrix per request:

    1. removing j renormalises head q's softmax without it, changing q's output at the last
       position by δo_q = a_qj (o_q − v_hj) / (1 − a_qj) (a: the attention weight over every key
       the query saw; o_q (d_head,), v_hj (d_head,)). For the one entry a head may weigh above
       ½ (a sink at a ≈ 1 − 1e-7 is common), both 1 − a and o − v cancel to rounding noise in
       float32, so there the same δo is computed as a_qj (ō − v_hj), ō the output renormalised
       over the other keys (Σ_{k≠j} a_k v_k / Σ_{k≠j} a_k, that sum clamped at 1e-30);
    2. the residual stream changes by Δr = Σ_{q in h's group} W_o^q δo_q (hidden,), W_o^q the
       columns of the layer's ``o_proj.weight`` read by query head q; Δr is taken straight to the
       final hidden state (how later layers respond to it is ignored);
    3. there the final RMSNorm's Jacobian J = diag(g)/rms · (I − x xᵀ / (d · rms²)) (x the final
       pre-norm hidden state, rms = sqrt(mean(x²) + eps), d the hidden size) and the LM head W_U
       give Δz = W_U J Δr, and the KL's second-order expansion is ½ Δzᵀ (diag p − p pᵀ) Δz, p the
       full-cache next-token distribution.

    F = Jᵀ W_Uᵀ (diag p − p pᵀ) W_U J (hidden × hidden, float64) is built once per position, so the
    vocabulary is never multiplied per entry; per KV head, K_h = M_hᵀ F M_h (M_h: the o_proj
    columns of h's query group) gives score_hj = ½ e_hjᵀ K_h e_hj with e_hj the concatenated
    δo of the group (float32). Higher score: kept first.

    ``window``: how many of the prompt's last positions' distributions are averaged (1: the last
    only), at most the question's length, refused above 1 under the query-aware protocol, which
    feeds only the question's last token after the prefill (the context's own positions are prefill
    queries that see only part of the context). The default of 1 is measured against ``window: 4``
    (question-agnostic) in docs/benchmarks.md, "Press alternatives". The question is fed over the
    full cache in ``window`` forwards (all but its last ``window − 1`` tokens, then each of those
    alone), so every position read is its call's last query, over every key before it. The norm
    and LM head are checked against the model's own logits at the first position read: a model
    whose logits are not ``W_U · g ⊙ x / rms(x)`` (soft-capping, a scaled head, a (1 + g) norm)
    fails loudly.
    """

    window: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("window", self.window, 1)

    def scores(self, model: PreTrainedModel, cache: DynamicCache, enc: EncodedRequest,
               stop_ids: Iterable[int]) -> list[torch.Tensor]:
        """Per layer (1, H_kv, n_ctx) float32: the estimated KL of evicting each entry, averaged over the window."""
        n_ctx = len(enc.context_ids)
        stats = _probe(model, cache, enc.question_ids, n_ctx, self.window)
        modules = attention_modules(model)
        out = [torch.zeros((1, cache.layers[layer].keys.shape[1], n_ctx), device=model.device)
               for layer in range(len(modules))]
        norm = decoder(model).norm
        head = model.get_output_embeddings().weight
        for t, (x, logits) in enumerate(zip(stats.hidden, stats.logits)):
            metric = output_metric(norm, head, x, logits, check=t == 0)
            for layer, module in enumerate(modules):
                out[layer][0] += entry_scores(metric, module.o_proj.weight, stats.weights[layer][t],
                                              stats.outputs[layer, :, t], cache.layers[layer].values[0],
                                              stats.question_values[layer]) / len(stats.logits)
        return out


@dataclass
class _Forward:
    """The full-cache statistics of the window's P positions.

    ``weights[layer][t]`` (q_heads, k_t): position t's attention on the k_t keys it saw (the
    context first); ``outputs`` (layers, q_heads, P, d_head): its attention output per head
    (before ``o_proj``); ``question_values``: per layer (kv_heads, n_question, d_head), a copy of
    the question's cached values (the context's stay in the cache); ``hidden``: per position the
    final pre-norm hidden state (hidden,); ``logits``: per position (vocab,). Float32 but the
    values (the cache's dtype).
    """

    weights: list[list[torch.Tensor]]
    outputs: torch.Tensor
    question_values: list[torch.Tensor]
    hidden: list[torch.Tensor]
    logits: list[torch.Tensor]


def _probe(model: PreTrainedModel, cache: DynamicCache, question_ids: Sequence[int], n_ctx: int, window: int) -> _Forward:
    """Feed the question over the full `cache` (all but its last ``window − 1`` tokens at once, then
    those one by one) and read each call's last position; the cache is cropped back to `n_ctx`."""
    if not question_ids:
        raise CertkvError("BehaviorPreservingPress reads the distribution after the question, which encodes to no tokens")
    n_q = len(question_ids)
    if window > n_q:
        raise CertkvError(
            f"BehaviorPreservingPress window {window} reads {window} question positions but the question fed "
            f"after the prefill has {n_q} token(s) (the query-aware protocol feeds one); use a window of at most {n_q}"
        )
    w = window
    chunks = [list(question_ids[: n_q - w + 1])] + [[t] for t in question_ids[n_q - w + 1:]]
    modules = attention_modules(model)
    hidden: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []

    def pre_norm(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        hidden.append(args[0][0, -1].float())

    handle = decoder(model).norm.register_forward_pre_hook(pre_norm)
    position = n_ctx
    try:
        # Every key is read (not just the context's): the dominant entry's δo needs the others' weights.
        with torch.no_grad(), capturing_last_query(model, n_ctx + n_q, outputs=True):
            for chunk in chunks:
                ids = torch.as_tensor(chunk, device=model.device).view(1, -1)
                positions = torch.arange(position, position + len(chunk), device=model.device).view(1, -1)
                out = model(input_ids=ids, past_key_values=cache, position_ids=positions, logits_to_keep=1)
                logits.append(out.logits[0, -1].float())
                position += len(chunk)
            weights, call_outputs = captured_last_queries(modules)
            outputs = torch.stack([torch.stack(o, dim=1) for o in call_outputs])
            question_values = [cache.layers[layer].values[0, :, n_ctx:].clone() for layer in range(len(modules))]
    finally:
        handle.remove()
        cache.crop(n_ctx)
    if len(hidden) != len(chunks):
        raise CertkvError(f"the final norm ran {len(hidden)} times for {len(chunks)} forwards; cannot read its input")
    return _Forward(weights=weights, outputs=outputs, question_values=question_values, hidden=hidden, logits=logits)


def _norm_eps(norm: torch.nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(norm, name, None)
        if isinstance(eps, (int, float)):
            return float(eps)
    raise CertkvError(f"the final norm {type(norm).__name__} has no epsilon attribute; it is not an RMSNorm certkv knows")


def output_metric(norm: torch.nn.Module, lm_head: torch.Tensor, x: torch.Tensor, logits: torch.Tensor,
                  check: bool = True) -> torch.Tensor:
    """F = Jᵀ W_Uᵀ (diag p − p pᵀ) W_U J, float64 (hidden, hidden).

    `norm`: the final RMSNorm (gain g, epsilon inside the root); `lm_head`: W_U (vocab, hidden);
    `x` (hidden,): the final pre-norm hidden state; `logits` (vocab,): the model's logits there,
    p = softmax(logits). With `check`, W_U · g ⊙ x / rms(x) must reproduce `logits` (to 2% of
    their range), else the model's head is not the one the expansion assumes.
    """
    x64 = x.double()
    d = x64.numel()
    g = norm.weight.detach().double().to(x64.device)
    rms = torch.sqrt(x64.pow(2).mean() + _norm_eps(norm))
    w = lm_head.detach()
    if check:
        z = (w.float() @ (g * x64 / rms).float()).double()
        ref = logits.double()
        scale = float((ref.max() - ref.min()).clamp(min=1.0))
        if float((z - ref).abs().max()) > 0.02 * scale:
            raise CertkvError("the model's logits are not lm_head(g ⊙ x / rms(x)) at the final hidden state "
                              "(logit soft-capping, a scaled head or another norm): BehaviorPreservingPress cannot expand them")
    jac = (g / rms).unsqueeze(1) * (torch.eye(d, dtype=torch.float64, device=x64.device) - torch.outer(x64, x64) / (d * rms**2))
    p = torch.softmax(logits.double(), dim=-1)
    gram = torch.zeros((d, d), dtype=torch.float64, device=x64.device)
    mean = torch.zeros(d, dtype=torch.float64, device=x64.device)
    for start in range(0, w.shape[0], _VOCAB_BLOCK):
        block = w[start : start + _VOCAB_BLOCK].double()
        pb = p[start : start + _VOCAB_BLOCK]
        scaled = block * pb.sqrt().unsqueeze(1)
        gram += scaled.T @ scaled
        mean += block.T @ pb
    gram -= torch.outer(mean, mean)
    return jac.T @ gram @ jac


def entry_scores(metric: torch.Tensor, o_proj: torch.Tensor, weights: torch.Tensor, outputs: torch.Tensor,
                 values: torch.Tensor, question_values: torch.Tensor) -> torch.Tensor:
    """One layer's (H_kv, n_ctx) float32 scores ½ Δr_hjᵀ F Δr_hj.

    `metric`: F (hidden, hidden); `o_proj`: the layer's ``o_proj.weight`` (hidden, q_heads · d_head),
    head-major columns; `weights` (q_heads, k): the position's attention on the k keys it saw,
    the n_ctx context entries first; `outputs` (q_heads, d_head): its attention output per head;
    `values` (kv_heads, n_ctx, d_head): the context's cached values, `question_values`
    (kv_heads, ≥ k − n_ctx, d_head) the question's after them. Query head q reads KV head
    q // (q_heads / kv_heads), as ``repeat_kv`` does.
    """
    kv_heads, n_ctx, d_head = values.shape
    q_heads, k_len = weights.shape
    groups = q_heads // kv_heads
    weights, values = weights.float(), values.float()
    question_values = question_values[:, : k_len - n_ctx].float()
    a = weights[:, :n_ctx]
    # δo (q_heads, n_ctx, d_head); a ≤ ½ here or overwritten below, so 1 − a ≥ ½.
    context_values = values.repeat_interleave(groups, 0)  # (q_heads, n_ctx, d_head)
    delta = (a / (1 - a).clamp(min=0.5)).unsqueeze(-1) * (outputs.float().unsqueeze(1) - context_values)
    top, where = a.max(dim=-1)
    for q in (top > 0.5).nonzero().flatten().tolist():
        j, v, h = int(where[q]), values[q // groups], q // groups
        rest = weights[q].clone()
        rest[j] = 0
        others = rest[:n_ctx] @ v + rest[n_ctx:] @ question_values[h]  # Σ_{k≠j} a_k v_k
        delta[q, j] = top[q] * (others / rest.sum().clamp(min=_MIN_REST) - v[j])
    w_o = o_proj.detach().to(torch.float64)
    projected = metric.to(w_o.device) @ w_o  # F W_o (hidden, q_heads · d_head)
    out = torch.empty((kv_heads, n_ctx), dtype=torch.float32, device=values.device)
    width = groups * d_head
    for h in range(kv_heads):
        cols = slice(h * width, (h + 1) * width)
        block = (w_o[:, cols].T @ projected[:, cols]).float().to(values.device)  # K_h (G·d_head, G·d_head)
        e = delta[h * groups : (h + 1) * groups].permute(1, 0, 2).reshape(n_ctx, width)  # the group's δo per entry
        out[h] = 0.5 * ((e @ block) * e).sum(dim=-1)
    return out
