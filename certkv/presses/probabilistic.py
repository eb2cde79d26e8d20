"""Probabilistic (Poisson-sampled) eviction with Hájek-corrected attention (DESIGN.md, "Gate signals").

A deterministic eviction press has no handle on its own error: the entries it drops are simply
gone. Sampling the low-score tail instead, with known inclusion probabilities π_i, turns the kept
cache into a survey sample of the full one: weighting each kept tail entry by 1/π_i inside the
softmax (adding −log π_i to its logit) makes the attention output a Hájek (ratio) estimator of the
full-cache output, and the survey variance of that estimator is a per-step certificate ĉ that the
runtime can check (see :mod:`certkv.presses.hajek_attention`).

Per layer and KV head, out of ``n_kept = compute_n_kept(K, compression_ratio)`` entries (kvpress's
count):

* a deterministic **head** with π = 1: the first ``n_sink`` entries, the last ``window`` entries,
  and the top-scored entries, ``head_share`` of what is left of the budget;
* a Poisson-sampled **tail**: every other entry i is kept independently with probability
  π_i ∝ score_i, capped at 1 and re-normalised so that Σ π_i is the rest of the budget
  (:func:`inclusion_probabilities`). The expected kept count is exactly ``n_kept``; the realised
  count varies per request, layer and head.

Storage (the decision the attention function relies on)
-------------------------------------------------------
Poisson sampling keeps a different number of entries per (batch row, KV head) and per layer, but a
cache layer is one rectangular tensor, and transformers builds one attention mask for all layers
from layer 0's length. So every layer of the cache is padded to one common width: the largest
count over all layers, batch rows and KV heads of the prefill (on average a few standard
deviations, ~3·sqrt(tail budget), above the expected count). Within a layer a head with fewer
entries fills its extra slots with entries of its own tail that were *not* sampled (real keys and
values); slots added afterwards to reach the common width hold zeros. Both kinds are marked
invalid and the attention function gives them a −inf logit, so they carry exactly zero weight.
Layout along the sequence axis: ``[head entries (n_head) | sampled tail, ascending position |
padding]``; tokens appended later (question, answer) follow. The widths are equalised by the
press's forward hook after the last layer (:func:`equalise_widths`); code that gathers caches
itself from :meth:`ProbabilisticPress.select` (the engine's one-prefill path) pads with
:func:`pad_selection`. Realised retention counts valid entries only (:func:`kept_fraction`).

The per-entry information lives on the attention module itself, as kvpress does with
``masked_key_indices``: ``module.certkv_hajek`` holds a :class:`HajekState` (log π per kept slot,
validity, counts, derived logit bias) for the cache's first ``N`` slots, and
``module.certkv_certificates`` is the list the attention function appends each step's
certificates to. The press sets both after pruning a layer; the attention function clears them at
the next full prefill (query length == key length), so a stale state never leaks into another
request; :func:`clear_states` does it explicitly. With ``compression_ratio == 0`` the press leaves
the cache untouched and clears the state, so attention is plain.

Reproducibility: the uniforms of layer ``l`` come from a CPU ``torch.Generator`` seeded with
``seed * 1_000_003 + l``, drawn in float64 and then moved to the cache's device, so the same
request with the same seed keeps the same entries on any device: calibration and runtime agree.
The press with a fixed seed is a deterministic policy, which is what certification needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from kvpress.presses.base_press import BasePress
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept

from certkv.model.layers import attention_modules

#: Attribute of an attention module holding its layer's :class:`HajekState` (or None).
STATE_ATTR = "certkv_hajek"
#: Attribute of an attention module holding the list of per-step certificate tensors.
CERT_ATTR = "certkv_certificates"


# --------------------------------------------------------------------------------------------------
# Inclusion probabilities and selection (pure tensor functions)
# --------------------------------------------------------------------------------------------------


def inclusion_probabilities(scores, budget):
    """Poisson-sampling inclusion probabilities π ∝ score, capped at 1, summing to `budget`.

    `scores` is a nonnegative, finite tensor of shape (..., n); `budget` a number or a tensor
    broadcastable to ``scores.shape[:-1]``, clamped to [0, n]. Entries whose proportional share
    reaches 1 are capped at 1 and the remaining budget is re-spread over the others, as if capping
    round after round until no new entry is capped (computed in closed form: see
    :func:`_capped_proportional`). If the positive scores cannot absorb the budget even when all
    capped, the rest is spread uniformly over the zero-score entries, so Σ π = budget whenever
    budget ≤ n. Otherwise an entry with score 0 gets π = 0. π is nondecreasing in the score
    (min(1, c·score) for one c per row, except in the uniform spread). Computed in float64;
    returned in the scores' dtype promoted to at least float32.
    """
    if scores.dim() < 1:
        raise ValueError("scores must have at least one dimension (the entries)")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores must be finite to give inclusion probabilities")
    if bool((scores < 0).any()):
        raise ValueError("scores must be nonnegative to give inclusion probabilities")
    out_dtype = torch.promote_types(scores.dtype, torch.float32)
    s = scores.to(torch.float64)
    n = s.shape[-1]
    if n == 0:
        return s.to(out_dtype)
    b = torch.as_tensor(budget, dtype=torch.float64, device=s.device).expand(s.shape[:-1]).clamp(0, n)
    return _capped_proportional(s, b).to(out_dtype)


def _capped_proportional(s, b):
    """:func:`inclusion_probabilities` without its checks, for float64 `s` (..., n) that is already
    known to be finite and nonnegative and `b` (...) in [0, n] (the selection's tail, made so).

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


def head_priority(scores, n_sink: int, window: int):
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

    indices: object
    """Positions in the full cache (padding slots point at unsampled tail entries)."""
    log_pi: object
    """log π of every slot (float32): 0 for the head, for tail entries with π = 1 and for padding."""
    valid: object
    """False for padding slots."""
    counts: object
    """Entries actually kept per (batch row, KV head)."""
    n_head: int


def probabilistic_selection(
    scores, n_kept: int, *, n_sink: int = 4, window: int = 16, head_share: float = 0.5,
    score_floor: float = 0.01, generator=None,
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
    tail = scores.gather(-1, tail_idx).to(torch.float64)
    tail = tail - tail.amin(dim=-1, keepdim=True).clamp(max=0)
    tail = tail + score_floor * tail.mean(dim=-1, keepdim=True)
    # After the shift and the floor: non-finite base scores, or finite ones whose shift overflows,
    # end up here as inf or NaN (the shifted tail is nonnegative otherwise).
    if not bool(torch.isfinite(tail).all()):
        raise ValueError("the base press returned non-finite scores outside the sinks and window (or scores too"
                         " large to shift into sizes)")
    b = torch.full(tail.shape[:-1], float(budget), dtype=torch.float64, device=device)
    pi = _capped_proportional(tail, b)

    if isinstance(generator, (list, tuple)):
        if not generator or batch % len(generator):
            raise ValueError(f"got {len(generator)} generators for {batch} batch rows (one per equal block of rows)")
        block = (batch // len(generator), *pi.shape[1:])
        u = torch.cat([torch.rand(block, generator=g, dtype=torch.float64) for g in generator]).to(device)
    else:
        u = torch.rand(pi.shape, generator=generator, dtype=torch.float64).to(device)
    kept = u < pi
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


def pad_selection(selection: Selection, width: int) -> Selection:
    """`selection` widened to `width` slots with invalid padding (index: the row's first slot)."""
    extra = width - selection.indices.shape[-1]
    if extra < 0:
        raise ValueError(f"cannot pad a selection of width {selection.indices.shape[-1]} down to {width}")
    if extra == 0:
        return selection

    def widen(t, fill):
        return torch.cat([t, fill.expand(*t.shape[:-1], extra)], dim=-1)

    return Selection(
        indices=widen(selection.indices, selection.indices[..., :1]),
        log_pi=widen(selection.log_pi, torch.zeros((), dtype=selection.log_pi.dtype, device=selection.log_pi.device)),
        valid=widen(selection.valid, torch.zeros((), dtype=torch.bool, device=selection.valid.device)),
        counts=selection.counts,
        n_head=selection.n_head,
    )


# --------------------------------------------------------------------------------------------------
# Per-layer state read by the attention function
# --------------------------------------------------------------------------------------------------


@dataclass
class HajekState:
    """What the Hájek attention needs about one layer's kept entries (the cache's first N slots).

    Built once per layer by the press, so that each decoding step only slices precomputed tensors.
    """

    log_pi: object
    """(B, H_kv, N) float32: log π per slot, 0 for π = 1 and for padding."""
    valid: object
    """(B, H_kv, N) bool: False for padding slots."""
    counts: object
    """(B, H_kv) long: entries kept per batch row and KV head."""
    n_head: int
    """Slots [:n_head] are the deterministic head (π = 1)."""
    context_length: int
    """K, the uncompressed context length of the prefill."""
    bias: object = field(init=False, repr=False)
    """(B, H_kv, N) float32 logit correction: −log π for kept entries, −inf for padding."""
    tail_weight: object = field(init=False, repr=False)
    """(B, H_kv, N − n_head) float32: 1 − π for kept tail entries, 0 for padding."""
    trivial: bool = field(init=False)
    """Every slot is a real entry with π = 1: attention is plain attention over the kept cache."""

    def __post_init__(self):
        neg_inf = torch.full_like(self.log_pi, float("-inf"))
        self.bias = torch.where(self.valid, -self.log_pi, neg_inf)
        tail_log_pi = self.log_pi[..., self.n_head :]
        self.tail_weight = torch.where(
            self.valid[..., self.n_head :], -torch.expm1(tail_log_pi), torch.zeros_like(tail_log_pi)
        )
        self.trivial = bool(self.valid.all()) and bool((self.log_pi == 0).all())

    @property
    def n_slots(self) -> int:
        return self.log_pi.shape[-1]

    @property
    def n_tail(self) -> int:
        return self.n_slots - self.n_head

    @property
    def tail_weight_rows(self):
        """`tail_weight` as (B·H_kv, 1, T), the layout of the attention's per-KV-head batches."""
        rows = self.__dict__.get("_tail_weight_rows")
        if rows is None:
            rows = self.__dict__["_tail_weight_rows"] = self.tail_weight.reshape(-1, 1, self.n_tail)
        return rows

    def logit_bias(self, k_len: int):
        """(B·H_kv, 1, k_len) float32: `bias` for the first N keys, 0 for the tokens decoded after.

        A view of one buffer with room to spare, so a decoding step adds the correction inside its
        logits product instead of building a bias per step.
        """
        buffer = self.__dict__.get("_logit_bias")
        if buffer is None or buffer.shape[-1] < k_len:
            width = max(k_len, self.n_slots) + 64
            buffer = torch.zeros(
                self.bias.shape[0] * self.bias.shape[1], 1, width, dtype=torch.float32, device=self.bias.device
            )
            buffer[:, 0, : self.n_slots] = self.bias.reshape(-1, self.n_slots)
            self.__dict__["_logit_bias"] = buffer
        return buffer[..., :k_len]

    def tail_moments(self, value):
        """(B·H_kv, T, 2) float32 [‖v_i‖², 1] of the kept tail slots, built at the first decoding step
        from the layer's values and kept: the kept entries never change while the answer is decoded."""
        moments = self.__dict__.get("_tail_moments")
        if moments is None:
            tail = value[:, :, self.n_head : self.n_slots].float()
            norms = tail.square().sum(-1).reshape(-1, self.n_tail, 1)
            moments = self.__dict__["_tail_moments"] = torch.cat([norms, torch.ones_like(norms)], dim=-1)
        return moments

    @classmethod
    def from_selection(cls, selection: Selection, context_length: int) -> "HajekState":
        return cls(selection.log_pi, selection.valid, selection.counts, selection.n_head, context_length)

    def widened(self, width: int) -> "HajekState":
        """The same state with invalid slots appended up to `width`."""
        extra = width - self.n_slots
        if extra <= 0:
            return self
        pad = torch.zeros(*self.log_pi.shape[:-1], extra, dtype=self.log_pi.dtype, device=self.log_pi.device)
        return HajekState(
            torch.cat([self.log_pi, pad], dim=-1), torch.cat([self.valid, pad.bool()], dim=-1),
            self.counts, self.n_head, self.context_length,
        )


def set_state(module, state: HajekState | None) -> None:
    """Attach `state` to an attention module and start a fresh certificate list."""
    setattr(module, STATE_ATTR, state)
    setattr(module, CERT_ATTR, [])


def clear_state(module) -> None:
    set_state(module, None)


def clear_states(model) -> None:
    """Forget every layer's state and certificates (before running a request without this press)."""
    for module in attention_modules(model):
        clear_state(module)


def equalise_widths(cache, modules) -> int:
    """Pad every layer of `cache` (and its module's state) to the widest layer; returns the width.

    transformers builds one attention mask from layer 0's length, so all layers must have the same
    number of slots. Layers whose module has no state (not compressed) are left alone; they are
    then all the same length already (a press either compresses every layer or none).
    """
    from transformers import QuantizedCache

    if isinstance(cache, QuantizedCache):
        raise ValueError("ProbabilisticPress does not support quantized caches")
    pairs = [(m, getattr(m, STATE_ATTR, None)) for m in modules]
    pairs = [(m, state) for m, state in pairs if state is not None]
    if not pairs:
        return 0
    width = max(state.n_slots for _, state in pairs)
    for module, state in pairs:
        extra = width - state.n_slots
        if extra == 0:
            continue
        layer = cache.layers[module.layer_idx]
        if layer.keys.shape[2] != state.n_slots:
            raise RuntimeError(f"layer {module.layer_idx}: cache length {layer.keys.shape[2]} ≠ {state.n_slots} slots")
        layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(*layer.keys.shape[:2], extra, layer.keys.shape[3])], dim=2)
        layer.values = torch.cat(
            [layer.values, layer.values.new_zeros(*layer.values.shape[:2], extra, layer.values.shape[3])], dim=2
        )
        setattr(module, STATE_ATTR, state.widened(width))
    return width


def kept_fraction(model) -> float:
    """Realised kv_retained of the last prefill: kept entries / context length, averaged over
    layers, batch rows and KV heads. Layers without a state (press off, ratio 0) count as 1."""
    fractions = []
    for module in attention_modules(model):
        state = getattr(module, STATE_ATTR, None)
        if state is None:
            fractions.append(1.0)
        else:
            fractions.append(float(state.counts.float().mean()) / state.context_length)
    return sum(fractions) / len(fractions)


# --------------------------------------------------------------------------------------------------
# Presses
# --------------------------------------------------------------------------------------------------


def _check_ratio(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"compression_ratio must be a number in [0, 1), got {value!r}")


def _check_count(name: str, value, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")


def _check_base_press(value) -> None:
    if not isinstance(value, ScorerPress):
        raise ValueError(f"base_press must be a kvpress ScorerPress (its score() gives the sizes), got {type(value).__name__}")


@dataclass
class AttentionTimesValueNormPress(ScorerPress):
    """Score = window attention × ‖v‖, the default size measure of :class:`ProbabilisticPress`.

    An entry's contribution to an attention output is its weight times its value; ‖v‖ turns
    SnapKV-style attention into a proxy of that contribution, which is what π should be
    proportional to for the Hájek estimator to have low variance. The attention of the last
    ``window_size`` context queries (causal: the last keys are seen by fewer queries; the press
    that uses this one protects the recent window anyway) is averaged over those queries and over
    the query heads of each KV group.
    """

    compression_ratio: float = 0.0
    window_size: int = 32

    def __post_init__(self):
        _check_ratio(self.compression_ratio)
        _check_count("window_size", self.window_size, 1)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        from certkv.model.window_attention import window_attention_mean

        batch, kv_heads, k_len, _ = keys.shape
        # Always from the window queries, even when the layer returned eager attention weights:
        # calibration may run eager attention and the runtime sdpa, and the sampled entries must
        # not depend on which (rounding differs, and π drives the Poisson draw).
        attention = window_attention_mean(module, hidden_states, keys, kwargs["position_embeddings"], self.window_size)
        attention = attention.view(batch, kv_heads, attention.shape[1] // kv_heads, k_len).mean(dim=2)
        return attention * torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)


@dataclass
class DeterministicHeadPress(ScorerPress):
    """The deterministic counterpart: kvpress top-k of the base scores with sinks and window protected.

    Equals :class:`ProbabilisticPress` with ``head_share=1`` entry for entry (same top-k call on the
    same priorities), so it is the reference for "with every π = 1 the answers equal the
    deterministic press's", and a plain ScorerPress the engine's fast path can score.
    """

    compression_ratio: float = 0.0
    base_press: ScorerPress = field(default_factory=AttentionTimesValueNormPress)
    n_sink: int = 4
    window: int = 16

    def __post_init__(self):
        _check_ratio(self.compression_ratio)
        _check_base_press(self.base_press)
        _check_count("n_sink", self.n_sink)
        _check_count("window", self.window)

    def post_init_from_model(self, model):
        self.base_press.post_init_from_model(model)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = self.base_press.score(module, hidden_states, keys, values, attentions, kwargs)
        return head_priority(scores, self.n_sink, self.window)


@dataclass
class ProbabilisticPress(BasePress):
    """Deterministic head + Poisson-sampled tail; needs the Hájek attention (see module docstring).

    Run the model with :func:`certkv.presses.hajek_attention.use_hajek_attention` (or the
    attention implementation ``certkv.presses.hajek_attention.NAME`` after ``register()``): with
    any other attention the padding slots would not be masked and the −log π correction not applied.
    ``compression_ratio`` is kvpress's (1 − nominal kv_retained); the realised retention, which
    varies around it, is :func:`kept_fraction`.
    """

    compression_ratio: float = 0.0
    """Target fraction evicted; the expected kept count per head is kvpress's compute_n_kept."""
    base_press: ScorerPress = field(default_factory=AttentionTimesValueNormPress)
    """Only its score() is used: it ranks the head and sizes the tail's inclusion probabilities."""
    n_sink: int = 4
    """First entries always kept (attention sinks)."""
    window: int = 16
    """Most recent entries always kept."""
    head_share: float = 0.5
    """Share of the budget left after sinks and window kept deterministically by top score
    (1: a deterministic press; 0: only sinks and window are certain)."""
    seed: int = 0
    """Seeds the per-layer generators: a fixed seed makes the press a reproducible policy."""
    score_floor: float = 0.01
    """Added to tail scores as a multiple of their mean so that every tail entry has π > 0."""

    def __post_init__(self):
        _check_ratio(self.compression_ratio)
        _check_base_press(self.base_press)
        _check_count("n_sink", self.n_sink)
        _check_count("window", self.window)
        if isinstance(self.head_share, bool) or not isinstance(self.head_share, (int, float)) or not 0 <= self.head_share <= 1:
            raise ValueError(f"head_share must be a number in [0, 1], got {self.head_share!r}")
        _check_count("seed", self.seed)
        if (isinstance(self.score_floor, bool) or not isinstance(self.score_floor, (int, float))
                or not (math.isfinite(self.score_floor) and self.score_floor >= 0)):
            raise ValueError(f"score_floor must be a finite number ≥ 0, got {self.score_floor!r}")

    def post_init_from_model(self, model):
        self.base_press.post_init_from_model(model)
        # the layers whose widths the last hook equalises (not a dataclass field: not a setting)
        self._attention_modules = attention_modules(model)

    def forward_hook(self, module, input, kwargs, output):
        """kvpress's hook (prune this layer), then, after the last layer, equalise the widths."""
        from kvpress.presses.base_press import is_prefilling

        output = super().forward_hook(module, input, kwargs, output)
        modules = getattr(self, "_attention_modules", None)
        if (
            self.compression_ratio > 0 and modules and module is modules[-1]
            and is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1])
        ):
            equalise_widths(kwargs["past_key_values"], modules)
            # the window-attention means the scores shared are not needed while decoding
            from certkv.model.window_attention import forget_window_attention

            forget_window_attention(modules)
        return output

    def generator(self, layer_idx: int):
        """The CPU generator of layer `layer_idx` (fresh and identically seeded on every call)."""
        return torch.Generator().manual_seed((self.seed * 1_000_003 + int(layer_idx)) % (2**63))

    def select(self, module, hidden_states, keys, values, attentions, kwargs) -> Selection:
        """The layer's selection, without pruning anything (the engine's one-prefill path can use it)."""
        scores = self.base_press.score(module, hidden_states, keys, values, attentions, kwargs)
        return self._selection(scores, self.generator(module.layer_idx))

    def _selection(self, scores, generator) -> Selection:
        """:func:`probabilistic_selection` of (B, H_kv, K) base scores with this press's settings."""
        return probabilistic_selection(
            scores, compute_n_kept(scores.shape[2], self.compression_ratio), n_sink=self.n_sink,
            window=self.window, head_share=self.head_share, score_floor=self.score_floor, generator=generator,
        )

    def select_layers(self, layer_indices, scores) -> list[Selection]:
        """The selections of several layers of one prefill from their base scores, computed together.

        `scores` is one (B, H_kv, K) tensor per layer of `layer_indices` (the base press's, same
        shape); each returned Selection equals what :meth:`select` gives that layer (each layer
        draws from its own generator) except that all are padded to the widest (invalid slots).
        The engine scores each layer in its hook and selects once after the last one.
        """
        scores = list(scores)
        if len(scores) != len(layer_indices) or len({tuple(s.shape) for s in scores}) > 1:
            raise ValueError("select_layers needs one score tensor per layer, all of one shape")
        batch = scores[0].shape[0]
        joint = self._selection(torch.cat(scores, dim=0), [self.generator(i) for i in layer_indices])
        rows = [slice(i * batch, (i + 1) * batch) for i in range(len(layer_indices))]
        return [
            Selection(joint.indices[r], joint.log_pi[r], joint.valid[r], joint.counts[r], joint.n_head) for r in rows
        ]

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            clear_state(module)
            return keys, values
        k_len = keys.shape[2]
        selection = self.select(module, hidden_states, keys, values, attentions, kwargs)
        index = selection.indices.unsqueeze(-1)
        keys = keys.gather(2, index.expand(-1, -1, -1, keys.shape[-1])).contiguous()
        values = values.gather(2, index.expand(-1, -1, -1, values.shape[-1])).contiguous()
        set_state(module, HajekState.from_selection(selection, context_length=k_len))
        return keys, values
