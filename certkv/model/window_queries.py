"""The model's own post-RoPE window queries, kept from the prefill for the window attention.

The agreement gate and the probabilistic press's default score both need the last W context
queries after RoPE (:func:`certkv.model.window_attention.window_attention`). Recomputing them from the
layer's input (a query projection of W rows, then RoPE) is a third of that window attention's cost
on a CPU, while the attention layer has just computed every query. Inside
:func:`capturing_window_queries` the model's attention implementation is wrapped so that, at each
full prefill call, the layer keeps a copy of its last :data:`WIDTH` queries; the window attention
then slices them instead of recomputing.

The copy is bit for bit what recomputing gives on CPU (checked in the tests); wherever a kernel
could round differently (other devices), calibration (both its paths) and the runtime all prefill
inside this context, so they still see the same queries. A window wider than :data:`WIDTH`
recomputes, and so does everything outside the context (e.g. the press inside kvpress's own
pipeline) and a model under ``eager`` attention, which is not wrapped: calibrating under eager and
serving under sdpa is the same on CPU, but calibrate and serve with one implementation elsewhere.
The wrapper forwards every argument unchanged to the implementation it wraps and registers that
implementation's mask builder under its own name, so the prefill itself computes exactly what it
computed before. Nothing is registered at import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from certkv.model.attention import use_attention
from certkv.model.layers import attention_modules

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: How many of the last context queries a layer keeps (the default windows are 32).
WIDTH = 64

_ATTR = "_certkv_window_queries"
_PREFIX = "certkv_window_queries+"


def captured_queries(module: torch.nn.Module, q_len: int, window: int) -> torch.Tensor | None:
    """The last `window` post-RoPE queries (B, H, window, d) of `module`'s current prefill of `q_len`
    tokens, or None when they were not captured (outside the context, a wider window, or another call
    shape)."""
    captured = module.__dict__.get(_ATTR)
    if captured is None or captured[0] != q_len or window > captured[1].shape[2]:
        return None
    return captured[1][:, :, -window:]


def _wrap(implementation: str) -> Callable[..., Any]:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        if query.shape[2] == key.shape[2]:  # a full prefill: keep this call's window
            module.__dict__[_ATTR] = (query.shape[2], query[:, :, -WIDTH:].clone())
        else:
            module.__dict__.pop(_ATTR, None)
        return ALL_ATTENTION_FUNCTIONS[implementation](module, query, key, value, attention_mask, *args, **kwargs)

    return attention


@contextmanager
def capturing_window_queries(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Prefill `model` inside the block with its attention layers keeping their window queries.

    A no-op for an implementation transformers does not list (e.g. ``eager``, which the layers
    call directly): the window attention then recomputes the queries.
    """
    previous = model.config._attn_implementation
    if previous not in ALL_ATTENTION_FUNCTIONS or previous.startswith(_PREFIX):
        yield model
        return
    name = _PREFIX + previous
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _wrap(previous))
        if previous in ALL_MASK_ATTENTION_FUNCTIONS:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    try:
        with use_attention(model, name):
            yield model
    finally:
        for module in attention_modules(model):
            module.__dict__.pop(_ATTR, None)
