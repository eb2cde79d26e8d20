"""Decoding-time candidates as lanes of one ragged batch: drafted, chunked between compression events.

kvpress's pipeline decodes a decoding-time press one token per forward, one candidate at a time.
Calibration needs every candidate's own greedy generation, and most of it is the full cache's
answer: a candidate follows it until its first departure. So each candidate becomes a
:class:`~certkv.engine.ragged_decode.Lane` of one batch, its compression kept by
:class:`~certkv.engine.decoding_compression.DecodingCompression`, and every forward feeds a lane its
pending token plus the full answer's next tokens (prompt lookup after a departure, or while the
full answer, itself the batch's first lane in the engine, has not got that far), never past the
lane's next compression event. A chunk the greedy choice confirms is the pipeline's steps up to that
event; the first token it rejects is where the lane's own answer goes on.

Only presses whose choices survive a batched or chunked forward decode as lanes
(:func:`batchable_decoding_press`): StreamingLLM's positions and TOVA's attention scores change
with float rounding only where two scores nearly tie, which the tests find nowhere. K-norm ranks
keys by norm, and a token that recurs in a context and its answer has first-layer keys of exactly
equal norm, told apart by rounding alone: its lanes get the pipeline's first-layer key bits
(:mod:`certkv.engine.first_layer_keys`), so it decodes as a lane on the CPU, on models whose first
key projection certkv can reshape. certkv's probabilistic decoding press, which draws at random at
every step, decodes alone (:func:`certkv.engine.decoding_run.run_decoding`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from kvpress import CompressionRatioDecodingPress, DecodingPress, PrefillDecodingPress, StreamingLLMPress, TOVAPress
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept
from transformers import DynamicCache

from certkv.engine.decoding_compression import DecodingCompression, decoding_press_of
from certkv.engine.decoding_run import DecodingRun, compresses_prefill
from certkv.engine.first_layer_keys import first_layer_key_projection, ranks_by_key_norm
from certkv.engine.ragged_decode import Lane, LaneCache, RaggedBatch, gather_lane, gather_layer
from certkv.model.window_queries import capturing_window_queries

if TYPE_CHECKING:
    from collections.abc import Sequence

    from transformers import PreTrainedModel

    from certkv.model.generation import EncodedRequest

#: Scorers whose decoding-time choices survive a batched or chunked forward (module docstring).
ROUNDING_SAFE_SCORERS = (StreamingLLMPress, TOVAPress)

#: The kvpress decoding presses whose books :class:`DecodingCompression` keeps. Exact types: a
#: subclass (CAM's merging press, say) keeps books of its own in its hook.
BOOKKEPT_DECODING_PRESSES = (DecodingPress, CompressionRatioDecodingPress)


def batchable_decoding_press(press: Any, model: PreTrainedModel) -> bool:
    """Whether `press` is one of kvpress's decoding presses (alone or as the decoding half of a
    ``PrefillDecodingPress``, whose prefill runs kvpress's own hook) with a scorer whose choices
    survive a ragged forward on `model` (:data:`ROUNDING_SAFE_SCORERS`, or a key-norm scorer when
    `model` runs on the CPU and its first key projection can be given the pipeline's bits), so it decodes as a lane of a
    ragged batch. Types are matched
    exactly: a subclass may compress differently. The wrapper's prefilling half, if any, must be a
    scorer keeping the same share of every layer (ScorerPress's own ``compress``), which a lane's
    allocation (:func:`prefill_kept`) assumes; PyramidKV's per-layer budgets or AdaKV's masks
    decode alone."""
    if type(press) not in (*BOOKKEPT_DECODING_PRESSES, PrefillDecodingPress):
        return False
    prefilling = getattr(press, "prefilling_press", None)
    if prefilling is not None and (not isinstance(prefilling, ScorerPress) or type(prefilling).compress
                                   is not ScorerPress.compress):
        return False
    inner = decoding_press_of(press)
    if inner is None or type(inner) not in BOOKKEPT_DECODING_PRESSES:
        return False
    if ranks_by_key_norm(inner):  # CPU only: first_layer_keys.py
        return model.device.type == "cpu" and first_layer_key_projection(model) is not None
    return type(inner.base_press) in ROUNDING_SAFE_SCORERS


def prefilled_lane(model: PreTrainedModel, press: Any, enc: EncodedRequest, max_new_tokens: int, stop_ids: set[int],
                   full: DynamicCache | None = None, draft: list[int] | None = None,
                   lookup: bool = True, selection: list[torch.Tensor] | None = None) -> tuple[Lane, float]:
    """One request under a decoding-time `press` as a ragged lane, its prefill done; returns the lane
    and the entries its prefill left (the context, unless the press compresses prefills too).

    The prefill is kvpress's: under the press's context manager when the press compresses
    prefills (its prefilling half), else the full context. With `full`, a full prefill's cache
    holding at least the context, (1, H_kv, ≥ n_ctx, d) per layer, no prefill is run: the context
    is copied out of it, or, for a press that compresses prefills, the entries its prefilling
    scorer kept, `selection` (per layer (1, H_kv, n_kept) in kvpress's order, recorded in that
    full prefill: a scorer's hook compresses a layer after its attention, so the pressed prefill's
    kept entries are exactly these of the full one). The lane feeds the question at the context's
    length (the pipeline's positions); `draft` is proposed while the answer follows it, prompt
    lookup after (`lookup`).
    """
    n_ctx = len(enc.context_ids)
    inner = decoding_press_of(press)
    books = DecodingCompression(inner) if inner is not None else None
    if full is not None and (selection is not None or not compresses_prefill(press)):
        kept_by_layer = selection if selection is not None else [None] * len(full.layers)
        room = _room(books, max(n_ctx if k is None else k.shape[-1] for k in kept_by_layer), enc, max_new_tokens)
        cache = LaneCache([gather_layer(layer.keys, layer.values, k, n_ctx, room)
                           for layer, k in zip(full.layers, kept_by_layer)])
    else:
        own = DynamicCache()
        context = torch.as_tensor(enc.context_ids, device=model.device).view(1, -1)
        with torch.no_grad(), press(model) if compresses_prefill(press) else nullcontext(), capturing_window_queries(model):
            model.model(input_ids=context, past_key_values=own)
        kept_max = max(layer.keys.shape[2] for layer in own.layers)
        cache = gather_lane(own, [None] * len(own.layers), kept_max, _room(books, kept_max, enc, max_new_tokens))
    lane = Lane(cache, list(enc.question_ids), n_ctx, max_new_tokens, stop_ids,
                lookup_ids=list(enc.context_ids) if lookup else None, want_logprobs=True, draft=draft,
                compression=books)
    kept = sum(layer.length for layer in cache.layers) / len(cache.layers)
    return lane, kept


def _room(books: DecodingCompression | None, kept: int, enc: EncodedRequest, max_new_tokens: int) -> int:
    """Free slots a lane of `kept` prefill entries is allocated: up to its decode's peak
    (:meth:`~certkv.engine.decoding_compression.DecodingCompression.first_peak`), not the whole
    question and answer (one more slot: a forward's rejected proposals sit there until cropped)."""
    room = len(enc.question_ids) + max_new_tokens + 1
    if books is None:
        return room
    return min(room, books.first_peak(kept, len(enc.question_ids), max_new_tokens, len(enc.context_ids)) - kept)


def prefill_kept(press: Any, n_ctx: int) -> int:
    """The entries per layer a prefill of `n_ctx` context tokens leaves under a batchable `press`
    (:func:`batchable_decoding_press`): all of them, unless its prefilling half (a kvpress scorer)
    keeps its share."""
    if isinstance(press, PrefillDecodingPress) and press.prefilling_press is not None:
        return compute_n_kept(n_ctx, press.prefilling_press.compression_ratio)
    return n_ctx


def lane_slots(model: PreTrainedModel, press: Any, enc: EncodedRequest, max_new_tokens: int) -> int:
    """The token slots one request under a batchable `press` holds at its peak, from its prefill
    to its answer's end: what ``certkv serve`` reserves for it before the prefill.

    The lane is allocated its decode's peak, c = :meth:`~certkv.engine.decoding_compression.
    DecodingCompression.first_peak` of the prefill's kept entries k (kvpress's prefill: a
    prefilling press cuts each layer to k as soon as the layer is computed). Before that, the
    prefill holds the kept layers and one full layer of n context entries; then it is copied into
    the lane's buffers one layer at a time, each source layer freed as it is copied. Either way
    at most c + max(n, c) / L slots (L layers): c plus one layer's worth.
    """
    n_ctx = len(enc.context_ids)
    kept = prefill_kept(press, n_ctx)
    inner = decoding_press_of(press)
    peak = kept + _room(DecodingCompression(inner) if inner is not None else None, kept, enc, max_new_tokens)
    return peak + math.ceil(max(n_ctx, peak) / model.config.num_hidden_layers)


def decode_lanes(model: PreTrainedModel, lanes: Sequence[Lane]) -> int:
    """Decode `lanes` together to their ends; returns the batched forwards it took."""
    batch = RaggedBatch(model)
    for lane in lanes:
        batch.add(lane)
    forwards = 0
    while batch.lanes:
        batch.step()
        forwards += 1
    return forwards


def run_of(lane: Lane, prefill_kept: float) -> DecodingRun:
    """A decoded lane as the :class:`~certkv.engine.decoding_run.DecodingRun` the solo decode gives."""
    return DecodingRun(token_ids=list(lane.answer), logprobs=list(lane.logprobs), held=list(lane.held),
                       prefill_kept=prefill_kept)


__all__ = ["BOOKKEPT_DECODING_PRESSES", "ROUNDING_SAFE_SCORERS", "batchable_decoding_press", "decode_lanes", "lane_slots",
           "prefill_kept", "prefilled_lane", "run_of"]
