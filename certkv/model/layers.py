"""Where a transformers causal LM keeps its decoder layers, in one place.

Text-only models hold them at ``model.model.layers``; multimodal wrappers one level deeper, at
``model.model.language_model.layers`` (kvpress looks in the same two places). Every hook, state and
count certkv attaches per layer finds the layers through here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The module holding the decoder layers and the rotary embedding."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The attention layers of a transformers causal LM, in layer order."""
    return [layer.self_attn for layer in decoder(model).layers]
