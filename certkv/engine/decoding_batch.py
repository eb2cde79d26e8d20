"""Many decoding-time candidates of one request, decoded together, each compressing its own cache.

kvpress's decoding presses (``DecodingPress``, ``CompressionRatioDecodingPress``) leave the prefill
untouched, so their candidates start from the same cache: the request's full prefill, which the
engine holds anyway. Their generations then part ways at each compression event, so no draft can
stand in for them; but each forward can still serve them all. Every candidate becomes a row of a
:class:`~certkv.engine.ragged_decode.RaggedBatch` (projections and MLPs batched, attention per row
over the row's own cache), and one hook per attention layer hands each row's slice of the forward
to that candidate's own press: kvpress's ``forward_hook`` itself, which buffers the row's hidden
states, counts its steps and, when an event is due, compresses the row's cache with the wrapped
scorer. What each candidate keeps is decided by kvpress's code, on its own row, at kvpress's steps;
tests compare every answer with kvpress's pipeline token for token.

The prefill-and-decoding wrapper compresses the prefill first, differently per candidate; it
decodes alone (:func:`certkv.engine.decoding_run.run_decoding`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from kvpress import DecodingPress

from certkv.engine.decoding_run import DecodingRun
from certkv.engine.ragged_decode import _FORWARD, RaggedBatch, Row, RowCache, RowLayer
from certkv.model.layers import attention_modules

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from certkv.model.generation import EncodedRequest


def shares_the_prefill(press: Any) -> bool:
    """Whether a decoding-time candidate starts from the full prefill (a plain decoding press)."""
    return isinstance(press, DecodingPress)


class _LayerView:
    """One row layer as kvpress's hook sees a cache layer: ``keys`` / ``values`` (1, H_kv, n, d) to
    read, and to replace with the compressed ones (the row keeps `room` free slots after them)."""

    def __init__(self, layer: RowLayer, room: int) -> None:
        self._layer, self._room = layer, room

    @property
    def keys(self) -> torch.Tensor:
        return self._layer.keys

    @keys.setter
    def keys(self, keys: torch.Tensor) -> None:
        fresh = RowLayer.holding(keys, keys, self._room)
        self._layer._keys, self._layer.length = fresh._keys, keys.shape[2]

    @property
    def values(self) -> torch.Tensor:
        return self._layer.values

    @values.setter
    def values(self, values: torch.Tensor) -> None:
        self._layer._values = RowLayer.holding(values, values, self._room)._values


class _RowAsCache:
    """A row's cache as the ``past_key_values`` kvpress's hook reads (``layers[i].keys``)."""

    def __init__(self, cache: RowCache, room: int) -> None:
        self.layers = [_LayerView(layer, room) for layer in cache.layers]


def _row_kwargs(kwargs: dict, b: int, n: int, row: Row, room: int, layer_idx: int) -> dict:
    """The attention layer's call `kwargs` as row `b` alone would have had them: its first `n`
    fed positions, its own cache, and cache positions after its own entries (so kvpress sees a
    decoding step, not a prefill)."""
    out = dict(kwargs)
    out["hidden_states"] = kwargs["hidden_states"][b : b + 1, :n]
    if kwargs.get("position_embeddings") is not None:
        out["position_embeddings"] = tuple(t[b : b + 1, :n] for t in kwargs["position_embeddings"])
    if kwargs.get("position_ids") is not None:
        out["position_ids"] = kwargs["position_ids"][b : b + 1, :n]
    start = row.cache.layers[layer_idx].length - n  # the row's entries in this layer before this forward
    out["cache_position"] = torch.arange(start, start + n, device=out["hidden_states"].device)
    out["past_key_values"] = _RowAsCache(row.cache, room)
    out["attention_mask"] = None
    return out


@contextmanager
def _each_row_to_its_press(model: PreTrainedModel, room: int) -> Iterator[None]:
    """Within the block, after every attention layer of a ragged forward, each row's own press
    (the row's ``tag``) runs kvpress's forward hook on that row's slice."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        state = _FORWARD.get()
        if state is None:
            return output
        rows, fed = state
        for b, (row, n) in enumerate(zip(rows, fed)):
            row_kwargs = _row_kwargs(kwargs, b, n, row, room, module.layer_idx)
            row.tag.forward_hook(module, args, row_kwargs, (output[0][b : b + 1], None))
        return output

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in attention_modules(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def decode_decoding_candidates(
    model: PreTrainedModel,
    full_cache: DynamicCache,
    presses: Sequence[DecodingPress],
    enc: EncodedRequest,
    max_new_tokens: int,
    stop_ids: set[int],
) -> list[DecodingRun]:
    """Each press's generation from the request's full prefill (`full_cache`, of which the first
    ``len(enc.context_ids)`` entries per layer are the context), decoded together.

    Returns one :class:`~certkv.engine.decoding_run.DecodingRun` per press, in order: its answer,
    its tokens' log p and the entries its cache held after each forward. `full_cache` is read, not
    changed; each row copies the context.
    """
    n_ctx = len(enc.context_ids)
    room = len(enc.question_ids) + max_new_tokens
    batch = RaggedBatch(model)
    rows, runs = [], []
    for press in presses:
        press.reset()  # the buffers and step counts a previous request may have left
        layers = [RowLayer.holding(layer.keys[:, :, :n_ctx], layer.values[:, :, :n_ctx], room) for layer in full_cache.layers]
        row = Row(RowCache(layers), list(enc.question_ids), n_ctx, max_new_tokens, stop_ids, want_logprobs=True, tag=press)
        rows.append(row)
        runs.append(DecodingRun(token_ids=row.answer, logprobs=row.logprobs, prefill_kept=float(n_ctx)))
        batch.add(row)
    with _each_row_to_its_press(model, room):
        while batch.rows:
            active = list(batch.rows)
            batch.step()
            for row in active:
                runs[rows.index(row)].held.append(sum(layer.length for layer in row.cache.layers) / len(row.cache.layers))
    for press in presses:
        press.reset()
    return runs


__all__ = ["decode_decoding_candidates", "shares_the_prefill"]
