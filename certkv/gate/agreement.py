"""PAGE-style agreement drop, the pre-decoding gate signal (DESIGN.md, "Gate signals").

For each layer and query head, the attention of the last ``W`` context queries is averaged over
every key; each head's top-``k`` keys form a set, and the layer's *agreement* is the mean pairwise
Jaccard similarity of these sets over head pairs. The *drop* is the mean agreement of the first
⌊L/3⌋ layers (at least one) minus that of the last ⌊L/3⌋ (at least one). A small drop means the
heads keep disagreeing about what matters deep into the network, which is when eviction is risky;
the gate keeps the full cache when D < threshold.

The window attention is computed from the post-RoPE window queries and the keys already in the
cache, the way kvpress's ``SnapKVPress.compute_window_attention`` does, so the signal costs W
queries per layer inside the engine's single prefill: no eager re-run of the whole context. Query
heads are kept separate (no averaging over a GQA group): agreement is a property of query heads.

Nothing here registers anything or touches a model at import time.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def window_attention(module, hidden_states, keys, position_embeddings, window: int):
    """Attention probabilities of the last `window` queries over every cached key.

    `module` is the attention layer (its ``q_proj`` and ``head_dim``; its ``scaling`` when it has
    one, else ``head_dim ** -0.5``), `hidden_states` the layer's input of shape (B, Q, hidden),
    `keys` the post-RoPE cached keys (B, H_kv, K, d) whose last Q entries belong to
    `hidden_states`, `position_embeddings` the layer's ``(cos, sin)`` from the hook kwargs.
    Each window query sees the keys up to its own position (causal). The logits are computed in
    the keys' dtype and the softmax in float32, as transformers' eager attention does.

    Inside :func:`certkv.gate.window_queries.capturing_window_queries` the window queries are the
    ones the layer itself computed (the same bits on CPU), not recomputed from `hidden_states`.

    Returns float32 weights of shape (B, H, W, K) with H the number of query heads and
    W = min(window, Q). The query heads of a KV group share one matmul with their keys (no copy of
    the keys per query head). The gate and the probabilistic press's score read only its mean over
    the window queries: :func:`window_attention_mean`, which they share.
    """
    import torch
    from kvpress.utils import get_prerope_query_states
    from transformers.models.llama.modeling_llama import rotate_half

    from certkv.gate.window_queries import captured_queries

    _check_positive_int("window", window)
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


def window_attention_mean(module, hidden_states, keys, position_embeddings, window: int):
    """:func:`window_attention` averaged over its window queries: float32 (B, H, K).

    This is all that the gate (each head's key ranking) and the probabilistic press's default score
    read of the window attention, so the last result per layer is remembered, keyed on the very
    same input tensors (weak references: a new prefill's tensors never match an old one's): every
    reader in one prefill after the first pays nothing. Readers get the same tensor: read-only.
    :func:`forget_window_attention` drops it when the hooks that may read it are removed (and the
    probabilistic press after the last layer).
    """
    import weakref

    memo = module.__dict__.get(_MEMO_ATTR)
    if memo is not None and memo[0]() is hidden_states and memo[1]() is keys and memo[2] == window:
        return memo[3]
    mean = window_attention(module, hidden_states, keys, position_embeddings, window).mean(dim=-2)
    module.__dict__[_MEMO_ATTR] = (weakref.ref(hidden_states), weakref.ref(keys), window, mean)
    return mean


_MEMO_ATTR = "_certkv_window_attention_mean"


@lru_cache(maxsize=8)
def _future_mask(w: int, device):
    """(w, w) bool, True above the diagonal: the keys in each window query's future. Built once
    per size and device (read-only; every layer of every prefill uses the same one)."""
    import torch

    return torch.ones(w, w, dtype=torch.bool, device=device).triu(diagonal=1)


def forget_window_attention(modules) -> None:
    """Drop any remembered window attention mean (a (B, H, K) tensor per layer) from `modules`."""
    for module in modules:
        module.__dict__.pop(_MEMO_ATTR, None)


def layer_agreements(weights, top_k: int):
    """Per batch element, the mean pairwise Jaccard of the query heads' top-k key sets.

    `weights` has shape (B, H, W, K); it is averaged over the W queries. When K < `top_k`, every
    head's set is all K keys' top min(top_k, K). A layer with one head agrees with itself (1.0).
    Returns a float32 tensor of shape (B,) on the weights' device (no host sync).
    """
    import torch

    _check_positive_int("top_k", top_k)
    if weights.dim() != 4:
        raise ValueError(f"weights must have shape (batch, heads, window, keys), got {tuple(weights.shape)}")
    scores = weights.float().mean(dim=-2)
    batch, heads, k_len = scores.shape
    if heads < 2:
        return torch.ones(batch, dtype=torch.float32, device=scores.device)
    k = min(top_k, k_len)
    members = torch.zeros_like(scores).scatter_(-1, scores.topk(k, dim=-1).indices, 1.0)
    intersection = members @ members.transpose(-1, -2)
    jaccard = intersection / (2 * k - intersection)
    rows, cols = torch.triu_indices(heads, heads, offset=1, device=scores.device)
    return jaccard[:, rows, cols].mean(dim=-1)


def layer_agreement(weights, top_k: int) -> float:
    """The layer's agreement as a float, for one request (batch size 1)."""
    if weights.shape[0] != 1:
        raise ValueError(f"layer_agreement takes one request; got batch size {weights.shape[0]} (use layer_agreements)")
    return float(layer_agreements(weights, top_k)[0])


def layer_split(n_layers: int, split_divisor: int = 3) -> tuple[range, range]:
    """The first and last ⌊L / split_divisor⌋ layers (at least one each), as index ranges.

    With one layer both ranges are that layer (the drop is then 0); with two, the first and the last.
    """
    _check_positive_int("n_layers", n_layers)
    _check_positive_int("split_divisor", split_divisor)
    n = max(1, n_layers // split_divisor)
    return range(0, n), range(n_layers - n, n_layers)


def agreement_drop(per_layer_agreements: Sequence[float], split_divisor: int = 3) -> float:
    """D = mean agreement of the first ⌊L/3⌋ layers − mean of the last ⌊L/3⌋ (at least one each)."""
    values = [float(a) for a in per_layer_agreements]
    if not values:
        raise ValueError("agreement_drop needs the agreement of at least one layer")
    first, last = layer_split(len(values), split_divisor)
    return sum(values[i] for i in first) / len(first) - sum(values[i] for i in last) / len(last)


@dataclass
class AgreementRecorder:
    """Collects each layer's agreement during one prefill and gives the request's drop.

    Call :meth:`observe` from a forward hook on every attention layer (or use :meth:`attach`, which
    registers :meth:`forward_hook` for the duration of a ``with`` block), then :meth:`drop`. The
    settings are the pre-registered ones of DESIGN.md; changing them changes the gate, so a
    calibration run and the runtime must use the same values. Layers are ordered by their
    ``layer_idx``; the split applies to the layers actually observed. Agreements stay on the
    model's device until :meth:`drop` so that observing costs no host synchronisation.
    """

    window: int = 32
    """W: how many of the last context queries are averaged."""
    top_k: int = 32
    """k: the size of each head's key set."""
    split_divisor: int = 3
    """Each end of the network is the first / last ⌊L / split_divisor⌋ layers (at least one)."""
    scores: dict = field(default_factory=dict, repr=False)
    """layer_idx → window-averaged attention per batch element and query head (B, H, K)."""

    def __post_init__(self):
        _check_positive_int("window", self.window)
        _check_positive_int("top_k", self.top_k)
        _check_positive_int("split_divisor", self.split_divisor)

    def reset(self) -> None:
        self.scores.clear()

    def observe(self, module, hidden_states, keys, kwargs) -> None:
        """Record `module`'s layer window attention from its prefill input and cached keys.

        The Jaccard agreements of all layers are computed together when they are read (one
        batched top-k instead of one per layer: the prefill pays only for the window attention).
        """
        self.scores[module.layer_idx] = window_attention_mean(
            module, hidden_states, keys, kwargs["position_embeddings"], self.window
        )

    @property
    def agreements(self) -> dict:
        """layer_idx → agreement per batch element (tensor of shape (B,))."""
        if not self.scores:
            return {}
        import torch

        layers = sorted(self.scores)
        stacked = torch.stack([self.scores[i] for i in layers])  # (L, B, H, K)
        n_layers, batch, heads, k_len = stacked.shape
        values = layer_agreements(stacked.view(n_layers * batch, heads, 1, k_len), self.top_k).view(n_layers, batch)
        return {layer: values[i] for i, layer in enumerate(layers)}

    def forward_hook(self, module, args, kwargs, output):
        """A ``register_forward_hook(..., with_kwargs=True)`` hook: observes the context prefill only."""
        from kvpress.presses.base_press import is_prefilling
        from kvpress.utils import extract_keys_and_values

        hidden_states = kwargs["hidden_states"]
        if is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            keys, _ = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
            self.observe(module, hidden_states, keys, kwargs)
        return output

    @contextmanager
    def attach(self, model):
        """Register :meth:`forward_hook` on every attention layer of `model` inside the block."""
        from certkv.model_layers import attention_modules

        modules = attention_modules(model)
        handles = [module.register_forward_hook(self.forward_hook, with_kwargs=True) for module in modules]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            forget_window_attention(modules)

    def per_layer(self) -> list[list[float]]:
        """Agreements as [batch element][layer in layer_idx order]."""
        agreements = self.agreements
        if not agreements:
            raise ValueError("no layer was observed: run a prefill with the recorder's hooks first")
        import torch

        stacked = torch.stack([agreements[i].float().cpu() for i in sorted(agreements)], dim=1)
        return stacked.tolist()

    def drops(self) -> list[float]:
        """The agreement drop of every batch element."""
        return [agreement_drop(row, self.split_divisor) for row in self.per_layer()]

    def drop(self) -> float:
        """The agreement drop of the (single) request of the last prefill."""
        drops = self.drops()
        if len(drops) != 1:
            raise ValueError(f"drop() is for one request; the prefill had {len(drops)} (use drops())")
        return drops[0]
