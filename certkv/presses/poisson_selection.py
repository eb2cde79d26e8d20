"""Which cache entries a probabilistic press keeps: a deterministic head and a Poisson-sampled tail.

Pure tensor functions, shared by :class:`~certkv.presses.probabilistic.ProbabilisticPress` (its
own pruning and the engine's one-prefill path) and
:class:`~certkv.presses.deterministic_head.DeterministicHeadPress`. Per layer and KV head, out of
``n_kept`` entries: the first ``n_sink``, the last ``window`` and the top-scored ``head_share`` of
the rest are kept with π = 1 (:func:`head_priority`, :func:`head_count`); every other entry i is
kept independently with probability π_i ∝ score_i, capped at 1 and re-normalised so that Σ π_i is
the rest of the budget (:func:`_capped_proportional`). The draw (:func:`probabilistic_selection`)
returns a :class:`Selection`; :func:`pad_selection` pads it to a common width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _capped_proportional(s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Poisson-sampling inclusion probabilities π ∝ score, capped at 1, summing to the budget `b`
    (...) in [0, n], for float64 scores `s` (..., n) already known to be finite and nonnegative (the
    selection's tail, made so). Entries whose proportional share reaches 1 are capped at 1 and the
    remaining budget re-spread over the others.

    The answer is π_i = min(1, c·s_i) with the one c that makes Σ π = b. It is found in closed form
    rather than by capping round after round (each round a dozen small kernel calls): with the
    scores sorted in decreasing order d_0 ≥ d_1 ≥ … and S_m = Σ_{j ≥ m} d_j, capping the top m
    leaves c_m = (b − m) / S_m, and the right m is the first whose largest free entry stays below
    1, c_m·d_m < 1 (that condition only becomes true as m grows, and the first m meeting it had
    its m-th largest entry rightly capped). The same π as the iterative capping to float rounding
    (tested against it, including budgets that rounding leaves entirely to the capped entries).
    When the positive scores cannot absorb the budget even all capped (S_m = 0 there), the rest is
    spread uniformly over the zero-score entries.
    """
    n = s.shape[-1]
    decreasing = s.sort(dim=-1, descending=True).values
    suffix = decreasing.flip(-1).cumsum(-1).flip(-1)  # S_m, summed from the smallest up
    c = (b.unsqueeze(-1) - torch.arange(n, dtype=s.dtype, device=s.device)).clamp_min_(0)
    c.div_(suffix.clamp_min(1e-300))
    free_below_one = c * decreasing < 1
    first = free_below_one.to(torch.uint8).argmax(-1, keepdim=True)
    # the capped entries are the top `first`; by score, not by c·s ≥ 1, which fails when rounding
    # leaves no budget for the free ones (c = 0 at m = b)
    smallest_capped = decreasing.gather(-1, (first - 1).clamp_min(0)).masked_fill_(first == 0, float("inf"))
    pi = (c.gather(-1, first) * s).clamp_max_(1).masked_fill_(s >= smallest_capped, 1.0)
    found = free_below_one.gather(-1, first) & (suffix.gather(-1, first) > 0)
    if bool(found.all()):
        return pi
    positive = s > 0
    n_positive = positive.sum(-1, keepdim=True)
    uniform = ((b.unsqueeze(-1) - n_positive) / (n - n_positive).clamp_min(1)).clamp(0, 1)
    return torch.where(found, pi, torch.where(positive, 1.0, uniform)).clamp(0, 1)


def head_priority(scores: torch.Tensor, n_sink: int, window: int) -> torch.Tensor:
    """Scores with the sinks (+inf) and the recent window (float max) ranked above everything.

    The deterministic head is ``head_priority(...).topk(n_head)``; :class:`DeterministicHeadPress`
    uses the same tensor with kvpress's own top-k, which is why, with ``head_share=1``, both presses
    keep the very same entries in the very same order.
    """
    if bool(torch.isnan(scores).any()):
        raise ValueError("the base press returned NaN scores")
    s = scores.to(torch.promote_types(scores.dtype, torch.float32)).clone()
    k_len = s.shape[-1]
    if window > 0:
        s[..., max(0, k_len - window) :] = torch.finfo(s.dtype).max
    if n_sink > 0:
        s[..., :n_sink] = float("inf")
    return s


def head_count(k_len: int, n_kept: int, n_sink: int, window: int, head_share: float) -> int:
    """How many entries the deterministic head holds: sinks, window, then head_share of the rest."""
    protected = min(k_len, n_sink + window)
    rest = max(0, n_kept - protected)
    return min(n_kept, protected + int(math.floor(head_share * rest + 0.5)))


@dataclass
class Selection:
    """Kept entries of one layer, padded to the largest count over (batch row, KV head).

    All tensors have shape (B, H_kv, N) except `counts` (B, H_kv). Slots ``[:n_head]`` are the
    deterministic head, ``[n_head:]`` the sampled tail in ascending position, then padding.
    """

    indices: torch.Tensor
    """Positions in the full cache (padding slots point at unsampled tail entries)."""
    log_pi: torch.Tensor
    """log π of every slot (float32): 0 for the head, for tail entries with π = 1 and for padding."""
    valid: torch.Tensor
    """False for padding slots."""
    counts: torch.Tensor
    """Entries actually kept per (batch row, KV head)."""
    n_head: int


def probabilistic_selection(
    scores: torch.Tensor, n_kept: int, *, n_sink: int = 4, window: int = 16, head_share: float = 0.5,
    score_floor: float = 0.01, generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> Selection:
    """Deterministic head plus Poisson-sampled tail from scores of shape (B, H_kv, K).

    Tail scores are made usable as sizes: shifted up when any is negative (so the lowest is 0; e.g.
    kvpress's knorm scores are −‖k‖), then ``score_floor`` × their mean is added so that every tail
    entry has π > 0 (Hájek's estimator needs π > 0 to be consistent). Scores must be finite in the
    tail. `generator` is a CPU ``torch.Generator`` (None: torch's global one), or a sequence of
    G of them for a batch of G equal blocks of consecutive rows: block g's uniforms are exactly
    those a selection of that block alone with generator g would draw, so the blocks can be the
    layers of one prefill, selected together (one set of kernel calls instead of one per layer;
    the blocks only share the padded width).
    """
    if not (math.isfinite(score_floor) and score_floor >= 0):
        raise ValueError(f"score_floor must be a finite number ≥ 0, got {score_floor!r}")
    batch, heads, k_len = scores.shape
    device = scores.device
    n_kept = max(0, min(int(n_kept), k_len))
    n_head = head_count(k_len, n_kept, n_sink, window, head_share)
    head_idx = head_priority(scores, n_sink, window).topk(n_head, dim=-1).indices
    n_tail = k_len - n_head
    budget = n_kept - n_head
    zeros_head = torch.zeros(batch, heads, n_head, dtype=torch.float32, device=device)
    ones_head = torch.ones(batch, heads, n_head, dtype=torch.bool, device=device)
    if n_tail == 0 or budget == 0:
        counts = torch.full((batch, heads), n_head, dtype=torch.long, device=device)
        return Selection(head_idx, zeros_head, ones_head, counts, n_head)

    # The tail in ascending position: every row has exactly n_tail non-members, listed row by row.
    in_tail = torch.ones(batch, heads, k_len, dtype=torch.bool, device=device).scatter_(-1, head_idx, False)
    tail_idx = in_tail.nonzero()[:, 2].view(batch, heads, n_tail)
    tail = _tail_sizes(scores.gather(-1, tail_idx), score_floor)
    b = torch.full(tail.shape[:-1], float(budget), dtype=torch.float64, device=device)
    pi = _capped_proportional(tail, b)
    kept = _uniforms(pi, generator) < pi
    # each tail entry's slot: the kept ones first, then the unsampled ones that fill the padding,
    # each in ascending position (a counting sort by kept / not kept; no comparison sort needed)
    kept_before = kept.cumsum(-1)
    tail_counts = kept_before[..., -1]
    width = int(tail_counts.max())
    rank = torch.arange(n_tail, device=device)
    slot = torch.where(kept, kept_before - 1, tail_counts.unsqueeze(-1) + rank - kept_before)
    order = torch.empty_like(slot).scatter_(-1, slot, rank.expand_as(slot))[..., :width]
    slot_valid = kept.gather(-1, order)
    slot_log_pi = torch.where(slot_valid, pi.gather(-1, order).log(), 0.0)
    return Selection(
        indices=torch.cat([head_idx, tail_idx.gather(-1, order)], dim=-1),
        log_pi=torch.cat([zeros_head, slot_log_pi.float()], dim=-1),
        valid=torch.cat([ones_head, slot_valid], dim=-1),
        counts=n_head + tail_counts,
        n_head=n_head,
    )


def _tail_sizes(tail_scores: torch.Tensor, score_floor: float) -> torch.Tensor:
    """The tail's scores (B, H_kv, n_tail) as sizes for π: shifted so the lowest is 0 when any is
    negative, plus `score_floor` × their mean so every π > 0; float64, same shape."""
    tail = tail_scores.to(torch.float64)
    tail = tail - tail.amin(dim=-1, keepdim=True).clamp(max=0)
    tail = tail + score_floor * tail.mean(dim=-1, keepdim=True)
    # After the shift and the floor: non-finite base scores, or finite ones whose shift overflows,
    # end up here as inf or NaN (the shifted tail is nonnegative otherwise).
    if not bool(torch.isfinite(tail).all()):
        raise ValueError("the base press returned non-finite scores outside the sinks and window (or scores too"
                         " large to shift into sizes)")
    return tail


def _uniforms(pi: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator] | None) -> torch.Tensor:
    """One float64 uniform per entry of `pi` (B, H_kv, n_tail), drawn on the CPU: from one generator,
    or block by block of consecutive rows from a sequence of them (see :func:`probabilistic_selection`)."""
    batch = pi.shape[0]
    if isinstance(generator, (list, tuple)):
        if not generator or batch % len(generator):
            raise ValueError(f"got {len(generator)} generators for {batch} batch rows (one per equal block of rows)")
        block = (batch // len(generator), *pi.shape[1:])
        return torch.cat([torch.rand(block, generator=g, dtype=torch.float64) for g in generator]).to(pi.device)
    return torch.rand(pi.shape, generator=generator, dtype=torch.float64).to(pi.device)


def pad_selection(selection: Selection, width: int) -> Selection:
    """`selection` widened to `width` slots with invalid padding (index: the row's first slot)."""
    extra = width - selection.indices.shape[-1]
    if extra < 0:
        raise ValueError(f"cannot pad a selection of width {selection.indices.shape[-1]} down to {width}")
    if extra == 0:
        return selection

    def widen(t: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, fill.expand(*t.shape[:-1], extra)], dim=-1)

    return Selection(
        indices=widen(selection.indices, selection.indices[..., :1]),
        log_pi=widen(selection.log_pi, torch.zeros((), dtype=selection.log_pi.dtype, device=selection.log_pi.device)),
        valid=widen(selection.valid, torch.zeros((), dtype=torch.bool, device=selection.valid.device)),
        counts=selection.counts,
        n_head=selection.n_head,
    )
