"""A question decoded alone over a candidate's kept entries, as calibration decodes it.

The single-prefill path decodes the press's answer in-process from the kept entries of the full
prefill it holds (:func:`evicted_decode`), and a question on a kept compressed context from a copy
of those entries (:func:`one_lane_batch`, :mod:`certkv.runtime.prefix_cache`); both build the one-lane
cache :func:`~certkv.engine.batched_decode.padded_cache` builds for one candidate, with the engine's
room for the answer (:func:`~certkv.engine.decode_reserve.decode_reserve`), and decode it with
:func:`decode_kept`, so that both answer as the store's records do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from certkv.engine.batched_decode import decode_candidates, padded_cache, reserved_layer_class
from certkv.engine.decode_reserve import decode_reserve
from certkv.engine.probabilistic_decode import decode_probabilistic
from certkv.presses.poisson_selection import Selection

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from certkv.model.generation import EncodedRequest

#: One candidate's kept entries of the full cache, per layer: a fast-path press's kept indices, a
#: (1, H_kv, n_kept) long tensor (None: keeps everything), or the probabilistic press's Selection.
KeptSelection = list[torch.Tensor | None] | list[Selection | None]


def evicted_decode(
    model: PreTrainedModel,
    cache: DynamicCache,
    enc: EncodedRequest,
    selection: KeptSelection,
    probabilistic: bool,
    max_new: int,
    stop_ids: set[int],
) -> tuple[list[int], list[float] | None, float, float | None]:
    """The candidate's answer from its kept entries of the full `cache` (left intact).

    `cache` holds the full prefill, (1, H_kv, n_ctx, d) keys and values per layer; `selection` the
    candidate's kept entries per layer (:data:`KeptSelection`).

    Returns (token ids, per-token log p, realised kept fraction, certificate maximum or None).
    Fast path: the kept entries in one lane (:func:`~certkv.engine.batched_decode.padded_cache`,
    with the engine's reserve for the question and answer) decoded by ``decode_candidates``;
    probabilistic press: ``decode_probabilistic`` (Hájek attention, certificate per step).
    """
    n_ctx = len(enc.context_ids)
    if probabilistic:
        (result,) = decode_probabilistic(model, cache, [selection], enc.question_ids, n_ctx, max_new, stop_ids)
        return result.token_ids, result.logprobs, result.kept_fraction, result.certificate_max
    reserve = decode_reserve(len(enc.question_ids), max_new)
    batch, mask, lengths = padded_cache(cache, [selection], n_ctx, reserve=reserve)
    ids, logprobs = decode_kept(model, batch, mask, enc, max_new, stop_ids)
    return ids, logprobs, lengths[0] / n_ctx, None


def decode_kept(
    model: PreTrainedModel, batch: DynamicCache, mask: torch.Tensor, enc: EncodedRequest, max_new: int,
    stop_ids: set[int],
) -> tuple[list[int], list[float] | None]:
    """(ids, per-token log p) of `enc`'s question decoded alone over `batch`, a one-lane cache of kept
    entries with its (1, n_kept) 0/1 `mask` (:func:`padded_cache`, :func:`one_lane_batch`), positions
    continuing from the uncompressed context length."""
    logprobs: list = [None]
    (ids,) = decode_candidates(
        model,
        batch,
        mask,
        enc.question_ids,
        [],
        len(enc.context_ids),
        max_new,
        stop_ids,
        context_ids=enc.context_ids,
        logprobs=logprobs,
    )
    return ids, logprobs[0]


def one_lane_batch(keys: list[torch.Tensor], values: list[torch.Tensor], reserve: int) -> tuple[DynamicCache, torch.Tensor]:
    """Kept entries, (1, H_kv, n_kept, d) per layer, copied into the one-lane batch cache that
    :func:`padded_cache` builds for one candidate (its buffers, `reserve` slots of room, its mask)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for k, v in zip(keys, values):
        n = k.shape[2]
        batch_keys = k.new_empty((1, k.shape[1], n + reserve, k.shape[3]))
        batch_values = v.new_empty((1, v.shape[1], n + reserve, v.shape[3]))
        batch_keys[:, :, :n].copy_(k)
        batch_values[:, :, :n].copy_(v)
        cache.layers.append(reserved_layer_class()(batch_keys, batch_values, n))
    return cache, torch.ones((1, keys[0].shape[2]), dtype=torch.long, device=keys[0].device)


__all__ = ["KeptSelection", "decode_kept", "evicted_decode", "one_lane_batch"]
