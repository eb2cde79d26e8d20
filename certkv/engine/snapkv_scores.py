"""kvpress's SnapKV scores, bit for bit, with less memory traffic.

``SnapKVPress.compute_window_attention`` builds its causal mask as a full (B, H, W, K) tensor
(``ones_like`` × −inf, ``triu``, then ``+=``): three extra passes over the window's logits, which
at 2048 tokens cost as much as the attention itself. Only the last W keys can be in a window
query's future, so masking that (W × W) corner in place gives the same logits — an unmasked
logit plus 0.0 is itself, a masked one is −inf either way — hence the same softmax, the same
scores and the same top-k, in kvpress's order. Everything else follows kvpress's code step by step
(the same repeat_kv matmul, division, softmax dtype, pooling and padding), because a different
summation order would change the last bits and, through ties, which entries are kept.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half


def snapkv_scores(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    window_size: int,
    kernel_size: int,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """What ``SnapKVPress(window_size, kernel_size).score(...)`` returns when no attention weights
    are given: (B, H_kv, K) scores from the layer's input (B, Q, hidden) and its keys (B, H_kv, K, d).

    `position_embeddings` is the layer's rotary (cos, sin), each (B, Q, head_dim)."""
    bsz, kv_heads, k_len, _ = keys.shape
    if hidden_states.shape[1] <= window_size:
        # kvpress asserts this; the engine skips such requests before scoring (precondition)
        raise ValueError(f"query length {hidden_states.shape[1]} must exceed the window size {window_size}")
    num_heads = module.config.num_attention_heads
    groups = num_heads // module.config.num_key_value_heads

    query = get_prerope_query_states(module, hidden_states[:, -window_size:])
    cos, sin = position_embeddings
    cos, sin = cos[:, -window_size:], sin[:, -window_size:]
    query = (query * cos.unsqueeze(1)) + (rotate_half(query) * sin.unsqueeze(1))
    weights = torch.matmul(query, repeat_kv(keys, groups).transpose(2, 3)) / math.sqrt(module.head_dim)
    future = torch.ones(window_size, window_size, dtype=torch.bool, device=weights.device).triu(diagonal=1)
    weights[..., k_len - window_size :].masked_fill_(future, float("-inf"))
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = weights[..., :-window_size]

    scores = weights.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    scores = scores.view(bsz, kv_heads, groups, k_len - window_size).mean(2)
    return F.pad(scores, (0, window_size), value=scores.max().item() + 1)
