"""Prune a full prefill layer by layer, as kvpress prunes, for a request that will only decode.

The engine's single-prefill path (:mod:`certkv.runtime.single_prefill`) records the press's kept
indices per layer while one plain prefill runs, and gathers them afterwards: until the gather the
whole prefill exists, (1, H_kv, n_ctx, d) keys and values in every layer. A request that needs no
full cache after its prefill (``certkv serve``'s lean run, with no gate that reads the full cache)
can drop each layer's evicted entries as soon as that layer is prefilled: a layer's cache is read
by its own attention only, so the later layers compute the same. :class:`LayerPruner` does that
from a forward hook that runs after the scoring hooks: it gathers the layer's kept entries into a
:class:`~certkv.engine.ragged_decode.LaneLayer` with room for the question and answer (the entries
and order of :func:`~certkv.engine.ragged_decode.gather_lane`, so the answer is the same) and
empties the full layer.

The KV held then peaks while the last layer is gathered: every layer's kept entries and room, plus
that layer's full prefill, :func:`pruned_peak_slots` token slots (the unit of
:mod:`certkv.engine.ragged_decode`), where the full prefill plus a copy of one layer was held before.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvpress.presses.base_press import is_prefilling

from certkv.engine.ragged_decode import LaneCache, LaneLayer, gather_layer
from certkv.model.layers import attention_modules

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def pruned_peak_slots(kept: Sequence[int], context_length: int, room: int) -> int:
    """Token slots a layer-by-layer pruned prefill holds at its peak, its answer's room included.

    `kept[layer]` entries of the `context_length` survive in each layer; each kept layer is
    allocated with `room` more slots (the question and answer). The peak is reached while the last
    layer is gathered: every layer's kept entries and room, plus that layer's full prefill; a slot
    is one token in every layer, so the sum is divided by the number of layers.

    Examples
    --------
    >>> pruned_peak_slots([128, 128], 256, 150)   # two layers keeping half: 278 + 256 / 2
    406
    """
    return math.ceil((sum(k + room for k in kept) + context_length) / len(kept))


class LayerPruner:
    """Gathers each layer's kept entries right after the layer is prefilled (module docstring).

    `context_length` is the prefill's tokens; `room` the free slots each kept layer gets. The
    kept entries are read from the list the scoring hooks fill (:meth:`attach`).
    """

    def __init__(self, context_length: int, room: int) -> None:
        self.context_length, self.room = context_length, room
        self.selection: list[Any] = []
        self.layers: list[LaneLayer] = []

    def hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """A forward hook on an attention module, registered after the scoring hooks."""
        if not is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
            return output
        idx = module.layer_idx
        if idx != len(self.layers) or idx >= len(self.selection):
            raise RuntimeError(f"layer {idx} was prefilled out of order, or before its kept entries were chosen")
        full = kwargs["past_key_values"].layers[idx]
        self.layers.append(gather_layer(full.keys, full.values, self.selection[idx], self.context_length, self.room))
        full.keys, full.values = full.keys[:, :, :0].clone(), full.values[:, :, :0].clone()
        return output

    @contextmanager
    def attach(self, model: PreTrainedModel, selection: list[Any]) -> Iterator[LayerPruner]:
        """Register :meth:`hook` on every attention layer of `model` inside the block; `selection`
        is the list the scoring hooks fill, one (1, H_kv, n_kept) index tensor (None: keep all) per
        layer in layer order, so these hooks must be registered after theirs."""
        self.selection = selection
        handles = [m.register_forward_hook(self.hook, with_kwargs=True) for m in attention_modules(model)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def lane(self) -> LaneCache:
        """The kept entries of every layer, once the prefill has run."""
        return LaneCache(self.layers)


__all__ = ["LayerPruner", "pruned_peak_slots"]
