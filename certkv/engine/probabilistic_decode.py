"""certkv's probabilistic press on the engine's one-prefill path, with per-answer certificates.

A :class:`~certkv.presses.probabilistic.ProbabilisticPress` prunes layer *i* after layer *i*'s
attention over the full context, like every kvpress press, so its selection of every layer can be
computed from the engine's single full prefill (:func:`selection_hooks`) and each candidate's cache
gathered afterwards. The candidates of one request are then decoded together, one batch lane each,
under the Hájek attention: each lane's state carries its own log π and validity per slot, so lanes
with different kept counts share one padded width (padding slots get a −inf logit and weigh
exactly 0, as the press's own padding does).

The head/tail split of the batch state is the smallest head over its lanes: the extra head slots
of the other lanes have π = 1, hence 1 − π = 0, and contribute nothing to the certificate sum, so
each lane's certificate is the one of its own split (up to float summation order).

Decoding follows :func:`certkv.model.generation.greedy_decode` step for step (question feed, then one
call per generated token but the last, each lane ending by the decoders' shared rule,
:func:`certkv.model.stopping.is_finished`), and each lane's certificate maximum is taken over
exactly the calls its own answer needed. That is what the
runtime, which decodes one request at a time and escalates when any step's certificate exceeds
the bound (checked every few steps and at the end), computes too: "escalated" ⇔
``certificate_max > bound``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from kvpress.presses.base_press import is_prefilling
from kvpress.utils import extract_keys_and_values
from transformers import DynamicCache

from certkv.model.generation import chosen_logprobs
from certkv.model.stopping import is_finished
from certkv.model.window_attention import forget_window_attention
from certkv.presses.hajek_attention import certificate_steps, use_hajek_attention
from certkv.presses.hajek_state import HajekState, clear_states, set_state
from certkv.presses.poisson_selection import Selection, pad_selection
from certkv.presses.probabilistic import ProbabilisticPress, attention_modules

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class ProbabilisticAnswer:
    """One candidate's answer; ``logprobs`` is each answer token's log p (float64 python floats)."""

    token_ids: list[int]
    certificate_max: float
    kept_fraction: float
    logprobs: list[float] | None = None


@contextmanager
def selection_hooks(
    model: PreTrainedModel, presses: dict[str, ProbabilisticPress], selections: dict[str, list[Selection | None]]
) -> Iterator[dict[str, list[Selection | None]]]:
    """During the next full prefill, record every probabilistic press's selection per layer.

    `presses` maps policy → ProbabilisticPress; ``selections[policy]`` receives one
    :class:`~certkv.presses.poisson_selection.Selection` per layer (None when the press keeps all).
    Nothing is pruned. Each layer's hook only takes the base press's scores; after the last layer
    every press selects for all layers at once (:meth:`ProbabilisticPress.select_layers`: the same
    selections as layer by layer, a fraction of the kernel calls).
    """
    for press in presses.values():
        press.post_init_from_model(model)
    for policy in presses:
        selections[policy] = []
    modules = attention_modules(model)
    scores: dict[str, list[torch.Tensor]] = {policy: [] for policy in presses}

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output
        if module is modules[0]:  # a new prefill: nothing of an interrupted one may carry over
            for kept in scores.values():
                kept.clear()
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for policy, press in presses.items():
            if press.compression_ratio > 0:
                scores[policy].append(press.base_press.score(module, hidden_states, keys, values, output[1], kwargs))
        if module is modules[-1]:
            layers = [m.layer_idx for m in modules]
            for policy, press in presses.items():
                if press.compression_ratio == 0:
                    selections[policy] = [None] * len(layers)
                else:
                    selections[policy] = list(press.select_layers(layers, scores[policy]))
                scores[policy].clear()
        return output

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        yield selections
    finally:
        for handle in handles:
            handle.remove()
        forget_window_attention(modules)


def _full_selection(n_heads: int, context_length: int, device: torch.device) -> Selection:
    """A selection that keeps every entry with π = 1 (a press at compression ratio 0)."""
    return Selection(
        indices=torch.arange(context_length, device=device).expand(1, n_heads, context_length),
        log_pi=torch.zeros(1, n_heads, context_length, device=device),
        valid=torch.ones(1, n_heads, context_length, dtype=torch.bool, device=device),
        counts=torch.full((1, n_heads), context_length, dtype=torch.long, device=device),
        n_head=context_length,
    )


def gathered_cache(
    full_cache: DynamicCache, selections: Sequence[Sequence[Selection | None]], context_length: int
) -> tuple[DynamicCache, list[HajekState]]:
    """One batch cache (a lane per candidate) and the Hájek state of every layer.

    `selections[c][layer]` is candidate c's Selection (batch 1) or None (keep everything). All lanes
    and layers are padded to one width, because transformers builds one mask for every layer.
    """
    first = full_cache.layers[0].keys
    n_heads, device = first.shape[1], first.device
    filled = [
        [_full_selection(n_heads, context_length, device) if s is None else s for s in per_layer] for per_layer in selections
    ]
    width = max(s.indices.shape[-1] for per_layer in filled for s in per_layer)
    cache = DynamicCache()
    states = []
    for layer_idx in range(len(filled[0])):
        lanes = [pad_selection(per_layer[layer_idx], width) for per_layer in filled]
        index = torch.cat([r.indices for r in lanes], dim=0)
        keys = full_cache.layers[layer_idx].keys[:, :, :context_length]
        values = full_cache.layers[layer_idx].values[:, :, :context_length]
        n = index.shape[0]
        k = keys.expand(n, -1, -1, -1).gather(2, index.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
        v = values.expand(n, -1, -1, -1).gather(2, index.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]))
        cache.update(k.contiguous(), v.contiguous(), layer_idx)
        states.append(
            HajekState(
                torch.cat([r.log_pi for r in lanes], dim=0),
                torch.cat([r.valid for r in lanes], dim=0),
                torch.cat([r.counts for r in lanes], dim=0),
                min(r.n_head for r in lanes),
                context_length,
            )
        )
    return cache, states


def decode_probabilistic(
    model: PreTrainedModel,
    full_cache: DynamicCache,
    selections: Sequence[Sequence[Selection | None]],
    question_ids: Sequence[int],
    context_length: int,
    max_new_tokens: int,
    stop_ids: set[int],
    logprobs: list[list[float]] | None = None,
) -> list[ProbabilisticAnswer]:
    """Greedy answers, certificate maxima and realised retention of every probabilistic candidate.

    Every answer carries its tokens' log p (``ProbabilisticAnswer.logprobs``: ``logit_tok −
    logsumexp(logits)`` in float64 from the logits each token was chosen from); `logprobs`, when
    given (one slot per candidate), receives them too, as ``decode_candidates`` fills it.

    One token a forward, not :mod:`certkv.engine.speculation`'s proposals: the Hájek attention records a
    certificate per forward, and a lane's maximum must be over the one-token forwards its answer takes.
    """
    if not selections:
        return []
    cache, states = gathered_cache(full_cache, selections, context_length)
    modules = attention_modules(model)
    n = len(selections)
    kept = torch.stack([s.counts.float().mean(dim=1) for s in states]).mean(dim=0) / context_length
    device = model.device
    q = torch.as_tensor(question_ids, device=device).view(1, -1).expand(n, -1)
    positions = torch.arange(context_length, context_length + q.shape[1], device=device).expand(n, -1)
    answers: list[list[int]] = [[] for _ in range(n)]
    lane_logprobs: list[list[float]] = [[] for _ in range(n)]
    done = [False] * n
    try:
        for module, state in zip(modules, states):
            set_state(module, state)
        with torch.no_grad(), use_hajek_attention(model):
            # The question first, then every lane's last token until all lanes are finished; the
            # batch moves together, so a finished lane's later tokens are computed but not kept.
            fed, fed_positions = q, positions
            while not all(done):
                out = model(input_ids=fed, past_key_values=cache, position_ids=fed_positions, logits_to_keep=1)
                tokens = out.logits[:, -1].argmax(dim=-1)
                step_logprobs = chosen_logprobs(out.logits[:, -1], tokens).tolist()
                for lane, token in enumerate(tokens.tolist()):
                    if not done[lane]:
                        answers[lane].append(token)
                        lane_logprobs[lane].append(step_logprobs[lane])
                        done[lane] = is_finished(answers[lane], max_new_tokens, stop_ids)
                fed, fed_positions = tokens.view(n, 1), fed_positions[:, -1:] + 1
        steps = certificate_steps(model)
    finally:
        clear_states(model)
    if logprobs is not None:
        logprobs[:] = lane_logprobs
    # A lane's answer of T tokens took T calls: the question feed and every token but the last.
    return [
        ProbabilisticAnswer(ids, max(steps[lane][: len(ids)], default=0.0), float(kept[lane]), lane_logprobs[lane])
        for lane, ids in enumerate(answers)
    ]
