"""A grouped-query sdpa attention for the batched candidate decode.

transformers' sdpa path repeats every KV head once per query group whenever an explicit mask is
given (it only passes ``enable_gqa`` when there is no mask). The candidate batch always has a mask
(padding, and draft tokens a lane did not take), so on CPU that copy dominated decoding. This
function is transformers' sdpa call with ``enable_gqa=True`` always (and an additive mask); it is
registered under its own name, with the stock sdpa mask builder, only when the engine first needs it.

Candidate lanes are padded to the longest kept cache of their batch. Inside
:func:`attention_lane_groups` the attention runs once per group of lanes that share their first real
slot, over the keys from that slot on (lanes are right-aligned, see
``batched_decode.padded_cache``): a 10%-cache lane batched with a 90%-cache one no longer pays for
attending over the other's length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAME = "certkv_gqa_sdpa"

#: (first lane, end lane, first key slot) of each group of batch lanes attended together.
LaneGroups = Sequence[tuple[int, int, int]]

_LANE_GROUPS: ContextVar[LaneGroups | None] = ContextVar("certkv_lane_groups", default=None)


@contextmanager
def attention_lane_groups(groups: LaneGroups | None) -> Iterator[None]:
    """Within the block, attention splits the batch into `groups` ((first lane, end lane, first
    key slot) triples covering every lane in order); None: the whole batch at once."""
    token = _LANE_GROUPS.set(groups)
    try:
        yield
    finally:
        _LANE_GROUPS.reset(token)


def gqa_sdpa_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    is_causal: bool | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function (query (B, H, Q, d), key and value (B, H_kv, K, d));
    returns the output (B, Q, H, d) and no weights. See the module docstring."""
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_len, k_len = query.shape[2], key.shape[2]
    gqa = key.shape[1] != query.shape[1]
    # CPU sdpa's flash kernel works in blocks of queries: for a decoding step's one or two query
    # positions most of each block is wasted (measured: 9.5 ms against 7.9 per layer for 27 lanes
    # of ~1100 keys, 1.8 against 0.8 for 3 lanes of 1850). Grouped matmuls do those steps.
    # (float32 only: in half precision sdpa keeps the logits in float32, which decides near-ties.)
    on_cpu = query.device.type == "cpu"
    attend = _grouped_matmul_attention if on_cpu and query.dtype == torch.float32 and q_len <= 4 else _sdpa
    is_causal = q_len > 1 and attention_mask is None and is_causal
    if is_causal and (q_len < k_len or attend is _grouped_matmul_attention):
        # An explicit causal mask over the last keys: sdpa's is_causal aligns the queries with the
        # first keys (wrong after a cache), and the grouped matmuls take masks only.
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        attention_mask = allowed.view(1, 1, q_len, k_len)
        is_causal = False
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        # An additive mask takes a faster CPU kernel than a boolean one with grouped heads
        # (measured: 5.7 ms against 8.6 ms for 27 candidates x 25 tokens x 590 keys).
        additive = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        attention_mask = additive.masked_fill_(~attention_mask, float("-inf"))
    # Lane groups are measured on CPU only; on an accelerator one call per group may cost more
    # kernel launches than the padding it skips.
    groups = _LANE_GROUPS.get() if on_cpu else None
    if groups is None or attention_mask is None or groups[-1][1] != query.shape[0]:
        out = attend(query, key, value, attention_mask, dropout, scaling, is_causal, gqa)
        return out.transpose(1, 2).contiguous(), None
    mask_lanes = attention_mask.shape[0] != 1
    parts = [
        attend(
            query[a:b], key[a:b, :, slot:], value[a:b, :, slot:],
            attention_mask[a:b, ..., slot:] if mask_lanes else attention_mask[..., slot:], dropout, scaling, False, gqa,
        )
        for a, b, slot in groups
    ]
    return torch.cat(parts, dim=0).transpose(1, 2).contiguous(), None


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
          dropout: float, scaling: float | None, is_causal: bool, gqa: bool) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=gqa,
    )


def _grouped_matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                              is_causal: bool, gqa: bool) -> torch.Tensor:
    """Attention as two matmuls, the query heads of a KV group stacked on their shared keys (no
    copy of the keys per head); softmax in float32. `attention_mask` additive or None (no mask:
    the caller turns causality into a mask); no dropout (the engine decodes in eval mode)."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if scaling is None:
        scaling = head_dim**-0.5
    q = (query * scaling).reshape(batch, kv_heads, groups * q_len, head_dim)
    logits = torch.matmul(q, key.transpose(-1, -2)).view(batch, kv_heads, groups, q_len, k_len)
    if attention_mask is not None:
        logits = logits + attention_mask.unsqueeze(2)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(weights.view(batch, kv_heads, groups * q_len, k_len), value)
    return out.view(batch, heads, q_len, value.shape[-1])


def register() -> None:
    """Register the attention and its mask builder with transformers (idempotent)."""
    AttentionInterface.register(NAME, gqa_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


@contextmanager
def use_attention(model: PreTrainedModel, name: str) -> Iterator[None]:
    """Run the model with attention implementation `name`, restoring the previous one after."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = previous
