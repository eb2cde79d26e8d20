"""PAGE-style agreement drop, the pre-decoding gate signal (docs/design.md, "Gate signals").

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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvpress.presses.base_press import is_prefilling
from kvpress.utils import extract_keys_and_values

from certkv.core.spec import AGREEMENT_SPLIT, AGREEMENT_TOP_K, AGREEMENT_WINDOW
from certkv.model.layers import attention_modules
from certkv.model.window_attention import check_positive_int, forget_window_attention, window_attention_mean

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def layer_agreements(weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per batch element, the mean pairwise Jaccard of the query heads' top-k key sets.

    `weights` has shape (B, H, W, K); it is averaged over the W queries. When K < `top_k`, every
    head's set is all K keys' top min(top_k, K). A layer with one head agrees with itself (1.0).
    Returns a float32 tensor of shape (B,) on the weights' device (no host sync).
    """
    check_positive_int("top_k", top_k)
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


def layer_split(n_layers: int, split_divisor: int = AGREEMENT_SPLIT) -> tuple[range, range]:
    """The first and last ⌊L / split_divisor⌋ layers (at least one each), as index ranges.

    With one layer both ranges are that layer (the drop is then 0); with two, the first and the last.
    """
    check_positive_int("n_layers", n_layers)
    check_positive_int("split_divisor", split_divisor)
    n = max(1, n_layers // split_divisor)
    return range(0, n), range(n_layers - n, n_layers)


def agreement_drop(per_layer_agreements: Sequence[float], split_divisor: int = AGREEMENT_SPLIT) -> float:
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
    settings are the pre-registered ones of docs/design.md ("Gate signals"); changing them changes the gate, so a
    calibration run and the runtime must use the same values. Layers are ordered by their
    ``layer_idx``; the split applies to the layers actually observed. Agreements stay on the
    model's device until :meth:`drop` so that observing costs no host synchronisation.
    """

    window: int = AGREEMENT_WINDOW
    """W: how many of the last context queries are averaged."""
    top_k: int = AGREEMENT_TOP_K
    """k: the size of each head's key set."""
    split_divisor: int = AGREEMENT_SPLIT
    """Each end of the network is the first / last ⌊L / split_divisor⌋ layers (at least one)."""
    scores: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    """layer_idx → window-averaged attention per batch element and query head (B, H, K)."""

    def __post_init__(self) -> None:
        check_positive_int("window", self.window)
        check_positive_int("top_k", self.top_k)
        check_positive_int("split_divisor", self.split_divisor)

    def reset(self) -> None:
        self.scores.clear()

    def observe(self, module: torch.nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                kwargs: dict[str, Any]) -> None:
        """Record `module`'s layer window attention from its prefill input and cached keys.

        The Jaccard agreements of all layers are computed together when they are read (one
        batched top-k instead of one per layer: the prefill pays only for the window attention).
        """
        self.scores[module.layer_idx] = window_attention_mean(
            module, hidden_states, keys, kwargs["position_embeddings"], self.window
        )

    @property
    def agreements(self) -> dict[int, torch.Tensor]:
        """layer_idx → agreement per batch element (tensor of shape (B,))."""
        if not self.scores:
            return {}
        layers = sorted(self.scores)
        stacked = torch.stack([self.scores[i] for i in layers])  # (L, B, H, K)
        n_layers, batch, heads, k_len = stacked.shape
        values = layer_agreements(stacked.view(n_layers * batch, heads, 1, k_len), self.top_k).view(n_layers, batch)
        return {layer: values[i] for i, layer in enumerate(layers)}

    def forward_hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """A ``register_forward_hook(..., with_kwargs=True)`` hook: observes the context prefill only."""
        hidden_states = kwargs["hidden_states"]
        if is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            keys, _ = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
            self.observe(module, hidden_states, keys, kwargs)
        return output

    @contextmanager
    def attach(self, model: PreTrainedModel) -> Iterator[AgreementRecorder]:
        """Register :meth:`forward_hook` on every attention layer of `model` inside the block."""
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
