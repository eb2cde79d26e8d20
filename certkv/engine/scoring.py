"""Scores of every score-based press from ONE full prefill.

kvpress prunes layer *i* after layer *i*'s attention has run over the whole context, so the hidden
states that reach every layer are those of the uncompressed prefill. A forward hook on each
attention layer can therefore call each press's ``score()`` with exactly the arguments kvpress's
own hook would pass, and keep the top-k indices that kvpress's ``ScorerPress.compress`` would keep
(same ``topk`` call, same order, same tie-breaking), without pruning anything. Every candidate's
compressed cache is then gathered from the full cache afterwards.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any

import torch
from kvpress import KnormPress, ObservedAttentionPress, RandomPress, ScorerPress, SnapKVPress, TOVAPress
from kvpress.presses.base_press import BasePress, is_prefilling
from kvpress.utils import compute_n_kept, extract_keys_and_values

from certkv.engine.snapkv_scores import snapkv_scores
from certkv.model.layers import decoder

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def ratio_free_score_classes() -> tuple[type, ...]:
    """kvpress presses whose score() does not read compression_ratio (checked in their source).

    One score per layer then serves every ratio. Any other press, subclasses included, is scored
    once per candidate (StreamingLLM's score, for one, depends on the ratio).
    """
    return (SnapKVPress, KnormPress, TOVAPress, RandomPress, ObservedAttentionPress)


def is_fast_path_press(press: object) -> bool:
    """True when `press` is a plain ScorerPress whose compress() is kvpress's top-k gather."""
    return isinstance(press, ScorerPress) and type(press).compress is ScorerPress.compress


def score_key(press: BasePress) -> tuple[Hashable, ...]:
    """Candidates with equal keys share one score tensor per layer."""
    name = type(press).__name__
    params: dict[str, str | int] = {}
    if is_dataclass(press):
        params = {f.name: repr(getattr(press, f.name)) for f in fields(press)}
    if type(press) in ratio_free_score_classes():
        params.pop("compression_ratio", None)
    else:
        params["__id__"] = id(press)
    return (type(press).__module__, name, tuple(sorted(params.items())))


@dataclass
class Selections:
    """Per candidate, per layer: the kept indices of shape (batch, kv_heads, n_kept), topk order."""

    by_candidate: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)


def _score(
    press: ScorerPress,
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attentions: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """The press's scores; SnapKV's (exactly SnapKVPress itself, not a subclass) the cheaper way."""
    if type(press) is SnapKVPress and attentions is None:
        return snapkv_scores(module, hidden_states, keys, press.window_size, press.kernel_size, kwargs["position_embeddings"])
    return press.score(module, hidden_states, keys, values, attentions, kwargs)


@contextmanager
def scoring_hooks(model: PreTrainedModel, presses: dict[str, BasePress], selections: Selections) -> Iterator[Selections]:
    """Register hooks that record each press's kept indices during the next full prefill.

    `presses` maps a candidate's policy name to its press object.
    """
    language_model = decoder(model)
    for press in presses.values():
        press.post_init_from_model(model)
    groups: dict[tuple[Hashable, ...], list[str]] = {}
    for policy, press in presses.items():
        groups.setdefault(score_key(press), []).append(policy)
    for policy in presses:
        selections.by_candidate[policy] = []

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        hidden_states = kwargs["hidden_states"]
        q_len = hidden_states.shape[1]
        if not is_prefilling(kwargs["cache_position"], q_len):
            return output
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        k_len = keys.shape[2]
        for policies in groups.values():
            first = presses[policies[0]]
            scores = None
            for policy in policies:
                press = presses[policy]
                if press.compression_ratio == 0:
                    selections.by_candidate[policy].append(None)  # kvpress keeps the cache untouched
                    continue
                if scores is None:
                    scores = _score(first, module, hidden_states, keys, values, output[1], kwargs)
                n_kept = compute_n_kept(k_len, press.compression_ratio)
                selections.by_candidate[policy].append(scores.topk(n_kept, dim=-1).indices)
        return output

    added_rotary = []
    handles = []
    try:
        for layer in language_model.layers:
            attn = layer.self_attn
            if not hasattr(attn, "rotary_emb"):
                attn.rotary_emb = language_model.rotary_emb  # some presses read it, as in kvpress
                added_rotary.append(attn)
            handles.append(attn.register_forward_hook(hook, with_kwargs=True))
        yield selections
    finally:
        for h in handles:
            h.remove()
        for attn in added_rotary:
            del attn.rotary_emb
