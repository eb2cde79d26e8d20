"""First-layer keys with kvpress's pipeline's rounding, for decoding presses that rank keys by norm.

K-norm keeps, per layer and head, the keys of smallest norm. At the first layer a key depends on
its token and its position only (embedding, norm, key projection, RoPE), and RoPE preserves
norms: a token that recurs in a context and its answer, as every token of a recitation does, has
keys of *equal* norm up to rounding, so which copy K-norm evicts is decided by their last bits.
Those bits depend on the shape of the key projection's matrix product: on CPU a (1, d) × (d, d_kv)
product and a (T, d) × (d, d_kv) one round 80–90 % of their entries differently (torch 2.13).
kvpress's pipeline projects the question in one forward of its own and every answer token in a
forward of one token; a ragged batch projects all its lanes' tokens in one product.

So inside a ragged forward, :func:`pipeline_first_layer_keys` recomputes the first layer's key
projection for the lanes under such a press the way the pipeline shapes it: a lane's question as one
(1, q, d) product, every later token (pending token or proposal) as a (1, 1, d) one. The norm
before it reduces each token's own vector and gives the same bits at any batch size on the CPU
(tested). A GPU's reduction kernels may split that sum by the number of tokens, so off the CPU a
key-norm press decodes alone until this is checked there
(:func:`~certkv.engine.decoding_lanes.batchable_decoding_press`). Deeper layers mix each
token with its own context, so their keys carry no such exact ties; their rounding matters no more
than it does for TOVA's attention scores. Measured on the embedded recitation model (K-norm keeping 0.2,
0.4 and 0.5 every 8 steps, 140 tokens): 16 of 24 generations (8 requests) departed from kvpress's
one-token decode without this, 0 of 90 (30 requests) with it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from kvpress import KnormPress

from certkv.model.layers import attention_modules

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Scorers that rank keys by their norm: exact only with the pipeline's first-layer key bits.
KEY_NORM_SCORERS = (KnormPress,)


def ranks_by_key_norm(press: Any) -> bool:
    """Whether decoding press `press` (kvpress ``DecodingPress`` or a subclass) scores with a
    :data:`KEY_NORM_SCORERS` press (exact type)."""
    return type(getattr(press, "base_press", None)) in KEY_NORM_SCORERS


def first_layer_key_projection(model: PreTrainedModel) -> torch.nn.Linear | None:
    """The first attention layer's key projection, when it is a plain ``nn.Linear`` (Llama,
    Mistral, Qwen and the like) whose product certkv can reshape; None otherwise (a fused QKV
    projection, a quantized layer): a key-norm press then decodes alone."""
    projection = getattr(attention_modules(model)[0], "k_proj", None)
    return projection if type(projection) is torch.nn.Linear else None


@contextmanager
def pipeline_first_layer_keys(model: PreTrainedModel, lanes: Sequence[tuple[slice, bool]]) -> Iterator[None]:
    """Within the block (one ragged forward over a packed sequence), the first layer's key
    projection gives the pipeline's bits (module docstring) to `lanes`: for each lane whose decoding
    press ranks keys by norm, where its tokens sit in the packed sequence and whether they are its
    question (its first forward). The other tokens keep the batched product's. No-op for no lanes."""
    if not lanes:
        yield
        return
    projection = first_layer_key_projection(model)
    if projection is None:
        raise RuntimeError(f"{type(model).__name__}'s first key projection is not a plain nn.Linear: "
                           "a key-norm decoding press must decode alone on it")

    def as_the_pipeline(module: torch.nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor:
        hidden, out = args[0], out.clone()  # hidden (1, T, d) → out (1, T, d_kv)
        for span, question in lanes:
            pieces = [span] if question else [slice(j, j + 1) for j in range(span.start, span.stop)]
            for piece in pieces:
                alone = hidden[:, piece].clone()  # its own (1, t, d) tensor, as the pipeline feeds it
                out[:, piece] = torch.nn.functional.linear(alone, module.weight, module.bias)
        return out

    handle = projection.register_forward_hook(as_the_pipeline)
    try:
        yield
    finally:
        handle.remove()


__all__ = ["KEY_NORM_SCORERS", "first_layer_key_projection", "pipeline_first_layer_keys", "ranks_by_key_norm"]
