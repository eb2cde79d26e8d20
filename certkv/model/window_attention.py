"""Window attention: what the last ``W`` context queries attend to, inside the single prefill.

Both the agreement gate (:mod:`certkv.signals.agreement`) and the probabilistic press's default score
read it. It is computed from the post-RoPE window queries and the keys already in the cache, the
way kvpress's ``SnapKVPress.compute_window_attention`` does, so it costs W queries per layer: no
eager re-run of the context. Query heads are kept separate (no averaging over a GQA group).

Nothing here registers anything or touches a model at import time.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from functools import lru_cache

import torch
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

from certkv.model.window_queries import captured_queries


def check_positive_int(name: str, value: object) -> None:
    """Raise ValueError unless `value` is an int ≥ 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def window_attention(module: torch.nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor], window: int) -> torch.Tensor:
    """Attention probabilities of the last `window` queries over every cached key.

    `module` is the attention layer (its ``q_proj`` and ``head_dim``; its ``scaling`` when it has
    one, else ``head_dim ** -0.5``), `hidden_states` the layer's input of shape (B, Q, hidden),
    `keys` the post-RoPE cached keys (B, H_kv, K, d) whose last Q entries belong to
    `hidden_states`, `position_embeddings` the layer's ``(cos, sin)`` from the hook kwargs.
    Each window query sees the keys up to its own position (causal). The logits are computed in
    the keys' dtype and the softmax in float32, as transformers' eager attention does.

    Inside :func:`certkv.model.window_queries.capturing_window_queries` the window queries are the
    ones the layer itself computed (the same bits on CPU), not recomputed from `hidden_states`.

    Returns float32 weights of shape (B, H, W, K) with H the number of query heads and
    W = min(window, Q). The query heads of a KV group share one matmul with their keys (no copy of
    the keys per query head). The gate and the probabilistic press's score read only its mean over
    the window queries: :func:`window_attention_mean`, which they share.
    """
    check_positive_int("window", window)
    q_len = hidden_states.shape[1]
    batch, kv_heads, k_len, head_dim = keys.shape
    w = min(window, q_len)
    if k_len < w:
        raise ValueError(f"the cache holds {k_len} keys, fewer than the {w} window queries")
    query = captured_queries(module, q_len, w)  # the layer's own, inside capturing_window_queries
    if query is None:
        query = get_prerope_query_states(module, hidden_states[:, -w:])
        cos, sin = position_embeddings
        cos, sin = cos[:, -w:].unsqueeze(1), sin[:, -w:].unsqueeze(1)
        query = (query * cos) + (rotate_half(query) * sin)

    heads = query.shape[1]
    groups = heads // kv_heads
    scaling = getattr(module, "scaling", head_dim**-0.5)
    grouped = (query * scaling).reshape(batch, kv_heads, groups * w, head_dim)
    logits = torch.matmul(grouped, keys.transpose(2, 3)).view(batch, heads, w, k_len)
    # Window query j sits at position k_len - w + j and sees keys 0 .. k_len - w + j: only the
    # last w keys are ever in its future.
    logits[..., k_len - w :].masked_fill_(_future_mask(w, logits.device), float("-inf"))
    return torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float32)


def window_attention_mean(module: torch.nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                          position_embeddings: tuple[torch.Tensor, torch.Tensor], window: int) -> torch.Tensor:
    """:func:`window_attention` averaged over its window queries: float32 (B, H, K).

    This is all that the gate (each head's key ranking) and the probabilistic press's default score
    read of the window attention, so the last result per layer is remembered, keyed on the very
    same input tensors (weak references: a new prefill's tensors never match an old one's): every
    reader in one prefill after the first pays nothing. Readers get the same tensor: read-only.
    :func:`forget_window_attention` drops it when the hooks that may read it are removed (and the
    probabilistic press after the last layer).
    """
    memo = module.__dict__.get(_MEMO_ATTR)
    if memo is not None and memo[0]() is hidden_states and memo[1]() is keys and memo[2] == window:
        return memo[3]
    mean = window_attention(module, hidden_states, keys, position_embeddings, window).mean(dim=-2)
    module.__dict__[_MEMO_ATTR] = (weakref.ref(hidden_states), weakref.ref(keys), window, mean)
    return mean


def kv_group_window_attention(module: torch.nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                              position_embeddings: tuple[torch.Tensor, torch.Tensor], window: int) -> torch.Tensor:
    """:func:`window_attention_mean` averaged over the query heads of each KV group: float32
    (B, H_kv, K), one attention per cached key of each KV head, as the presses that score KV heads read it."""
    batch, kv_heads, k_len, _ = keys.shape
    mean = window_attention_mean(module, hidden_states, keys, position_embeddings, window)
    return mean.view(batch, kv_heads, mean.shape[1] // kv_heads, k_len).mean(dim=2)


_MEMO_ATTR = "_certkv_window_attention_mean"


@lru_cache(maxsize=8)
def _future_mask(w: int, device: torch.device) -> torch.Tensor:
    """(w, w) bool, True above the diagonal: the keys in each window query's future. Built once
    per size and device (read-only; every layer of every prefill uses the same one)."""
    return torch.ones(w, w, dtype=torch.bool, device=device).triu(diagonal=1)


def forget_window_attention(modules: Iterable[torch.nn.Module]) -> None:
    """Drop any remembered window attention mean (a (B, H, K) tensor per layer) from `modules`."""
    for module in modules:
        module.__dict__.pop(_MEMO_ATTR, None)
