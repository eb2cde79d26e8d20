"""LORE-KV: keep the entries whose deletion would move the attention outputs of sampled futures most."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from certkv.model.layers import attention_modules
from certkv.presses._checks import check_count
from certkv.presses.response_aware import ResponseAwarePress
from certkv.signals.lookahead import lookahead_probe

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from certkv.model.generation import EncodedRequest

#: Floor of 1 − a_j: a query may put (almost) all its weight on one entry.
_MIN_REST = 1e-6
#: How the futures' costs are aggregated: their mean (the expected cost) or their max (the worst future's).
AGGREGATES = ("mean", "max")


@dataclass
class LOREKVPress(ResponseAwarePress):
    """Keep the context entries whose removal would change the response's attention outputs most.

    Attention weight says where a query looks, not how far its output would move without an entry
    (an entry whose value equals the output costs nothing to drop). LORE-KV samples ``samples``
    futures of ``tokens`` tokens from the full cache (the question fed, then tokens drawn at
    ``temperature`` from a ``torch.Generator`` seeded with ``seed``, made anew in each
    :meth:`scores` call, so calibration and the runtime draw the same futures), scores each entry
    j by its leave-one-out deletion cost for their queries, and crops the futures away. A query
    with weights a (over every key it saw) and output o = Σ a_i v_i loses j as
    o_{−j} = (o − a_j v_j) / (1 − a_j); projected by the layer's output projection (W_o^h: the
    columns of ``o_proj.weight`` that read query head h, v_j from h's KV head) the cost is

        ‖W_o^h (o − o_{−j})‖ = a_j / (1 − a_j) · ‖W_o^h (v_j − o)‖ = a_j · ‖W_o^h (v_j − o_{−j})‖.

    Choices the method leaves open, made here: a future's response queries are the k that draw
    its k tokens (the question feed's last query, then the first k − 1 drawn tokens'; a drawn stop
    token ends a future early); per KV head the cost is *summed* over its group's query heads
    (evicting an entry removes it for all of them), averaged over a future's queries, then
    aggregated over the futures by ``aggregate``: ``"mean"`` (the default: the expected cost) or
    ``"max"`` (the worst future's). The max is measured against the mean in docs/benchmarks.md,
    "Press alternatives".

    Numerics (float32, vectorised per layer): ``‖W_o^h x‖ = ‖R_h x‖`` with R_h (d, d) from the QR
    of W_o^h (hidden, d). The middle form serves every entry with a_j ≤ 1/2 (1 − a_j floored at
    1e-6 as a guard); for a row's largest entry above 1/2 both of its factors cancel as a_j → 1,
    so the last form is used, o_{−j} renormalised from the other context weights (exact) and the
    keys after the context as residuals (o − a·V, 1 − Σ a; resolved to a few 1e-7): an entry that
    leaves the rest < 1e-6 of a query's weight gets a cost of the right size, not a precise one.
    Memory: the probes of all futures at once, m · layers · q_heads · k · n_ctx floats.
    """

    samples: int = 4
    tokens: int = 4
    temperature: float = 1.0
    seed: int = 0
    aggregate: str = "mean"
    futures: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)
    """The token ids drawn by the last :meth:`scores` call, one list per future (for inspection)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("samples", self.samples, 1)
        check_count("tokens", self.tokens, 1)
        check_count("seed", self.seed, 0)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {t!r}")
        if not isinstance(self.aggregate, str) or self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {', '.join(map(repr, AGGREGATES))}, got {self.aggregate!r}")

    def scores(self, model: PreTrainedModel, cache: DynamicCache, enc: EncodedRequest,
               stop_ids: Iterable[int]) -> list[torch.Tensor]:
        """Per layer (1, H_kv, n_ctx) float32: each context entry's projected deletion cost, averaged
        over a future's queries, then the mean or the max over the futures (``aggregate``)."""
        n_ctx = len(enc.context_ids)
        stops = list(stop_ids)
        generator = torch.Generator().manual_seed(self.seed)
        worst = self.aggregate == "max"
        weights, outputs, share, future_of = [], [], [], []
        self.futures = []
        for f in range(self.samples):
            probe = lookahead_probe(model, cache, enc.question_ids, n_ctx, self.tokens - 1, stops, outputs=True,
                                    generator=generator, temperature=float(self.temperature))
            assert probe.outputs is not None
            positions = probe.weights.shape[2]
            weights.append(probe.weights)  # (L, H, P_f, n_ctx)
            outputs.append(probe.outputs)  # (L, H, P_f, d)
            share.append(torch.full((positions,), 1.0 / (positions * (1 if worst else self.samples))))
            future_of.append(torch.full((positions,), f))
            self.futures.append(probe.token_ids)
        a_all = torch.cat(weights, dim=2)  # (L, H, Q, n_ctx), Q = Σ_f P_f
        o_all = torch.cat(outputs, dim=2)  # (L, H, Q, d)
        # (Q,): 1 / (m · P_f), the mean per future then over futures; for the max 1 / P_f, per future
        per_query = torch.cat(share).to(a_all.device)
        future_index = torch.cat(future_of).to(a_all.device) if worst else None  # (Q,): each query's future
        return [_deletion_cost(a_all[layer], o_all[layer], cache.layers[layer].values[0], module.o_proj.weight, per_query,
                               future_index) for layer, module in enumerate(attention_modules(model))]


def _deletion_cost(a: torch.Tensor, o: torch.Tensor, values: torch.Tensor, o_proj: torch.Tensor,
                   per_query: torch.Tensor, future_of: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's score (1, H_kv, n_ctx).

    `a` (H, Q, n_ctx): the queries' weights on the context keys (normalised over all keys seen);
    `o` (H, Q, d): their attention outputs per head; `values` (H_kv, n_ctx, d): the context's
    cached values; `o_proj` (hidden, H · d): the output projection; `per_query` (Q,): each query's
    share of the mean. Returns Σ_q per_query[q] · Σ_{h ∈ group} ‖R_h (o − o_{−j})‖ per KV head;
    with `future_of` (Q,), each query's future (0 … m − 1), that sum is taken per future and the
    largest returned (`per_query` then holds each query's share of its future's mean).

    Every entry but a row's largest has a_j ≤ 1/2 and takes a_j / (1 − a_j) · ‖R_h (v_j − o)‖, well
    conditioned there. The largest, when above 1/2, takes a_j · ‖R_h (v_j − o_{−j})‖ with
    o_{−j} = u / r: u and r sum the other context entries exactly, plus the keys after the context
    (question, drawn tokens) as the residuals o − a·V and 1 − Σ a (dropped when that mass rounds
    to ≤ 0), so no difference of nearly equal terms is divided by a tiny 1 − a_j.
    """
    q_heads, _, n_ctx = a.shape
    kv_heads, _, d = values.shape
    groups = q_heads // kv_heads
    a, o = a.float(), o.float().to(a.device)
    w = o_proj.detach().float().to(a.device).view(-1, q_heads, d).transpose(0, 1)  # (H, hidden, d)
    rt = torch.linalg.qr(w, mode="r").R.transpose(1, 2)  # (H, d, d): ‖W_h x‖ = ‖x R_hᵀ‖
    v = values.detach().float().to(a.device).repeat_interleave(groups, dim=0)  # (H, n_ctx, d)
    distance = torch.cdist(v @ rt, o @ rt, compute_mode="donot_use_mm_for_euclid_dist")  # (H, n_ctx, Q)
    cost = a / (1 - a).clamp(min=_MIN_REST) * distance.transpose(1, 2)  # (H, Q, n_ctx)

    top = a.argmax(dim=-1, keepdim=True)  # (H, Q, 1): each row's largest weight
    a_top = a.gather(-1, top)
    rest = a.scatter(-1, top, 0.0)  # (H, Q, n_ctx): the other context entries, exactly
    after_mass = (1 - a.sum(dim=-1, keepdim=True)).clamp(min=0)  # (H, Q, 1): the keys after the context,
    after_out = torch.where(after_mass > 0, o - a @ v, 0.0)  # (H, Q, d)   as residuals (none if unresolved)
    mass = rest.sum(dim=-1, keepdim=True) + after_mass
    o_without = torch.where(mass > 0, (rest @ v + after_out) / mass.clamp(min=1e-30), 0.0)  # nothing left: 0
    v_top = v.gather(1, top.view(q_heads, -1, 1).expand(-1, -1, d))  # (H, Q, d)
    stable = a_top * ((v_top - o_without) @ rt).norm(dim=-1, keepdim=True)  # (H, Q, 1)
    cost.scatter_(-1, top, torch.where(a_top > 0.5, stable, cost.gather(-1, top)))

    cost = cost.view(kv_heads, groups, -1, n_ctx).sum(dim=1)  # (H_kv, Q, n_ctx)
    if future_of is None:
        return torch.einsum("hqn,q->hn", cost, per_query.to(cost)).unsqueeze(0)
    weighted = cost * per_query.to(cost).view(1, -1, 1)
    per_future = weighted.new_zeros((kv_heads, int(future_of.max()) + 1, n_ctx)).index_add_(1, future_of, weighted)
    return per_future.amax(dim=1).unsqueeze(0)  # (1, H_kv, n_ctx): the worst future's cost
