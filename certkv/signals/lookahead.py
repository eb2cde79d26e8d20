"""The lookahead probe: where the full-cache answer's first queries look, before any eviction.

A press fails a request when the answer needs context entries it evicted. The probe measures
that directly, while the full cache still exists: the question is fed over the full cache and the
first `A` greedy answer tokens are fed back (A + 1 single-row forwards, exactly the full-cache
greedy decode's first calls), and each call's *last* query's attention weights on the context
keys are kept. :func:`evicted_mass` then gives, per layer and KV head, the largest share of that
attention that falls on the entries a candidate evicts.

The weights are captured by wrapping the model's attention implementation (sdpa, eager or any
other registered one) for the probe's calls only: the wrapper forwards every argument unchanged
to the implementation it wraps, so the probe's forwards compute exactly what the plain decode
computes, and recomputes the last query's softmax beside it. The last query of a call sees every
key in the cache (the context, the question and the answer so far), so it needs no mask: its
weights are ``softmax(scaling · q·Kᵀ)`` over all keys, of which the first ``n_ctx`` are kept.
Sliding-window and soft-capped attention are not modelled (the models certkv runs have neither).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from certkv.model.attention import use_attention
from certkv.model.layers import attention_modules
from certkv.model.stopping import ends_on_stop

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel

_ATTR = "_certkv_lookahead_weights"
_PREFIX = "certkv_lookahead+"


@dataclass
class LookaheadProbe:
    """What the probe saw.

    ``weights``: float32 tensor (layers, q_heads, P, n_ctx), the attention weights of the probe's
    P query positions (the question's last token, then each fed answer token; P = A + 1 unless the
    answer stopped earlier) on the context keys, normalised over every key the query saw (so a
    row sums to at most 1). ``token_ids``: the P greedy tokens the calls chose, i.e. the first P
    tokens of the full-cache greedy answer.
    """

    weights: torch.Tensor
    token_ids: list[int]
    outputs: torch.Tensor | None = None
    """With ``outputs=True``: float32 (layers, q_heads, P, d), each query position's attention
    output per query head (before ``o_proj``), over every key it saw; else None."""


def _last_query_weights(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, scaling: float | None,
                        context_length: int) -> torch.Tensor:
    """Softmax weights (q_heads, n_ctx) of the call's last query on the first `context_length` keys.

    `query` (1, q_heads, q_len, d) and `key` (1, kv_heads, k_len, d) are the attention call's own
    (post-RoPE) tensors; query head j reads KV head j // (q_heads / kv_heads), as repeat_kv does.
    """
    q = query[0, :, -1].float()  # (q_heads, d)
    k = key[0].float()  # (kv_heads, k_len, d)
    groups = q.shape[0] // k.shape[0]
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    logits = torch.einsum("hgd,hkd->hgk", q.view(k.shape[0], groups, -1), k) * scaling
    return torch.softmax(logits, dim=-1).reshape(q.shape[0], -1)[:, :context_length]


def _wrap(implementation: str, context_length_of: Callable[[torch.nn.Module], int | None]) -> Callable[..., Any]:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        if implementation == "eager":
            inner = sys.modules[type(module).__module__].eager_attention_forward
        else:
            inner = ALL_ATTENTION_FUNCTIONS[implementation]
        n_ctx = context_length_of(module)
        if n_ctx is not None:
            scaling = kwargs.get("scaling", getattr(module, "scaling", None))
            module.__dict__[_ATTR].append(_last_query_weights(module, query, key, scaling, n_ctx))
        result = inner(module, query, key, value, attention_mask, *args, **kwargs)
        outputs = module.__dict__.get(_ATTR + "_outputs")
        if n_ctx is not None and outputs is not None:
            outputs.append(result[0][0, -1].float())  # (q_heads, d): attention functions return (B, q, H, d)
        return result

    return attention


def _context_length(module: torch.nn.Module) -> int | None:
    """The probe's context length when `module` is inside a probe (its weight list exists)."""
    return module.__dict__.get(_ATTR + "_n_ctx")


@contextmanager
def capturing_last_query(model: PreTrainedModel, context_length: int, outputs: bool = False) -> Iterator[None]:
    """Inside the block, every attention call of `model` appends its last query's weights on the
    first `context_length` keys to ``module._certkv_lookahead_weights`` (one (q_heads, n_ctx)
    tensor per call), and with `outputs` its attention output per head to
    ``module._certkv_lookahead_weights_outputs`` (one (q_heads, d) tensor per call). Batch 1 only."""
    previous = model.config._attn_implementation
    if previous != "eager" and previous not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"the lookahead probe cannot wrap attention implementation {previous!r}")
    name = _PREFIX + previous
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _wrap(previous, _context_length))
        if previous in ALL_MASK_ATTENTION_FUNCTIONS:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    modules = attention_modules(model)
    for module in modules:
        module.__dict__[_ATTR] = []
        module.__dict__[_ATTR + "_n_ctx"] = context_length
        if outputs:
            module.__dict__[_ATTR + "_outputs"] = []
    try:
        with use_attention(model, name):
            yield
    finally:
        for module in modules:
            for suffix in ("", "_n_ctx", "_outputs"):
                module.__dict__.pop(_ATTR + suffix, None)


def captured_last_queries(modules: Sequence[torch.nn.Module]) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Inside :func:`capturing_last_query`: per module, the weights (q_heads, n_ctx) and, when
    captured, the outputs (q_heads, d) of every call so far (empty lists without outputs)."""
    return ([list(m.__dict__[_ATTR]) for m in modules],
            [list(m.__dict__.get(_ATTR + "_outputs", ())) for m in modules])


def lookahead_probe(model: PreTrainedModel, cache: Cache, question_ids: Sequence[int], context_length: int, tokens: int,
                    stop_ids: Iterable[int] | None = None, *, outputs: bool = False,
                    generator: torch.Generator | None = None, temperature: float = 1.0) -> LookaheadProbe:
    """Feed the question over the full `cache`, then the first `tokens` greedy answer tokens.

    `cache` holds the full prefill of the context (``context_length`` entries per layer; batch 1);
    it is cropped back to ``context_length`` afterwards, so the full decode can follow. The calls
    are those of :func:`certkv.model.generation.greedy_decode` (positions continue from the
    context length; the first token is never a stop, a later stop token in `stop_ids` ends the
    probe early, as it ends the answer). Returns the weights of the ``tokens + 1`` query positions
    (see :class:`LookaheadProbe`), with `outputs` their attention outputs too.

    With a `generator`, each token is sampled from ``softmax(logits / temperature)`` (float32,
    ``torch.multinomial`` on that generator) instead of taken greedily: a sampled continuation
    of the full-cache model, as response-aware presses read several of.
    """
    if tokens < 0:
        raise ValueError(f"lookahead tokens must be at least 0, got {tokens}")
    modules = attention_modules(model)
    stops = set(stop_ids or ())
    device = model.device
    fed = torch.as_tensor(list(question_ids), device=device).view(1, -1)
    position = context_length
    chosen: list[int] = []
    try:
        with torch.no_grad(), capturing_last_query(model, context_length, outputs):
            for _ in range(tokens + 1):
                positions = torch.arange(position, position + fed.shape[1], device=device).view(1, -1)
                out = model(input_ids=fed, past_key_values=cache, position_ids=positions, logits_to_keep=1)
                token = _next_token(out.logits[0, -1], generator, temperature)
                chosen.append(int(token))
                position += fed.shape[1]
                if ends_on_stop(chosen, stops):
                    break
                fed = token.view(1, 1)
            calls, call_outputs = captured_last_queries(modules)
            weights = torch.stack([torch.stack(w, dim=1) for w in calls])
            captured = torch.stack([torch.stack(o, dim=1) for o in call_outputs]) if outputs else None
    finally:
        cache.crop(context_length)
    return LookaheadProbe(weights=weights, token_ids=chosen, outputs=captured)


def _next_token(logits: torch.Tensor, generator: torch.Generator | None, temperature: float) -> torch.Tensor:
    """The greedy token of `logits` (vocab,), or one sampled at `temperature` from `generator`."""
    if generator is None:
        return logits.argmax()
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.to(generator.device), 1, generator=generator)[0].to(logits.device)


def _kept_mask(kept: Any, n_kv_heads: int, n_ctx: int, device: torch.device) -> torch.Tensor | None:
    """Boolean (n_kv_heads, n_ctx): which context entries a layer keeps per KV head, or None
    (keeps everything). `kept`: None; a long tensor (1, H_kv, n_kept) of kept indices; a pair
    (indices, valid) with a boolean validity mask of the indices' shape (padding slots are not
    kept); or an object with ``indices`` and ``valid`` (a probabilistic Selection)."""
    if kept is None:
        return None
    if hasattr(kept, "indices") and hasattr(kept, "valid"):
        kept = (kept.indices, kept.valid)
    valid = None
    if isinstance(kept, (tuple, list)):
        kept, valid = kept
    index = kept.reshape(n_kv_heads, -1).to(device=device, dtype=torch.long)
    mask = torch.zeros((n_kv_heads, n_ctx), dtype=torch.bool, device=device)
    if index.shape[1]:
        src = torch.ones(index.shape, dtype=torch.bool, device=device)
        if valid is not None:
            src = valid.reshape(n_kv_heads, -1).to(device=device, dtype=torch.bool)
        mask.scatter_reduce_(1, index, src, reduce="amax")
    return mask


def evicted_mass(weights: torch.Tensor, kept: Sequence[Any], n_kv_heads: int) -> list[float]:
    """Per (layer, KV head), layer-major, the probe's largest attention mass on evicted entries.

    `weights`: (layers, q_heads, P, n_ctx) from :func:`lookahead_probe`. `kept[layer]`: the
    candidate's kept context entries of that layer (see :func:`_kept_mask`; None keeps everything,
    giving 0). For KV head h the value is the max over h's query heads and the P query positions
    of the weight summed over the context entries h does not keep. Returns L * n_kv_heads floats
    (index = layer * n_kv_heads + head), summed in float64 and capped at 1.
    """

    n_layers, q_heads, _, n_ctx = weights.shape
    groups = q_heads // n_kv_heads
    out: list[float] = []
    for layer in range(n_layers):
        mask = _kept_mask(kept[layer], n_kv_heads, n_ctx, weights.device)
        if mask is None:
            out += [0.0] * n_kv_heads
            continue
        w = weights[layer].double().view(n_kv_heads, groups, -1, n_ctx)
        evicted = (w * (~mask).view(n_kv_heads, 1, 1, n_ctx)).sum(dim=-1)  # (H_kv, groups, P)
        # A float32 softmax row sums to 1 only up to rounding: a mass is a share, at most 1.
        out += [min(1.0, float(x)) for x in evicted.flatten(1).amax(dim=1)]
    return out
