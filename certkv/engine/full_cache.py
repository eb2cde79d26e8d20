"""The full-cache half of a request, shared by calibration's engine and the runtime.

Calibration (:class:`certkv.engine.engine.Engine`) and the runtime
(:mod:`certkv.runtime.single_prefill`) prefill a request the same way, once, with the full cache
and every press's scoring hooks, and decode its full-cache answer the same way, so that the
runtime's full answer and the press's kept entries equal the store's records. Both call these.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from certkv.engine.batched_decode import decode_candidates
from certkv.engine.probabilistic_decode import selection_hooks
from certkv.engine.scoring import Selections, scoring_hooks
from certkv.model.window_queries import capturing_window_queries

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvpress.presses.base_press import BasePress
    from transformers import PreTrainedModel

    from certkv.engine.layer_pruning import LayerPruner
    from certkv.model.generation import EncodedRequest
    from certkv.presses.poisson_selection import Selection
    from certkv.presses.probabilistic import ProbabilisticPress
    from certkv.presses.response_aware import ResponseAwarePress
    from certkv.signals.agreement import AgreementRecorder


def context_tensor(model: PreTrainedModel, ids: Sequence[int]) -> torch.Tensor:
    """Token ids as a (1, n) long tensor on the model's device."""
    return torch.as_tensor(ids, device=model.device).view(1, -1)


def prefill_full(
    model: PreTrainedModel,
    context_ids: Sequence[int],
    fast: dict[str, BasePress] | None = None,
    probabilistic: dict[str, ProbabilisticPress] | None = None,
    recorder: AgreementRecorder | None = None,
    observers: Sequence[ResponseAwarePress] = (),
    pruner: LayerPruner | None = None,
) -> tuple[DynamicCache, dict[str, list[torch.Tensor | None]], dict[str, list[Selection | None]]]:
    """The one full prefill of a request: returns (cache, fast selections, probabilistic selections).

    `fast` / `probabilistic` map a name (a policy's, or the engine's key for a decoding lane's
    prefilling scorer) to its press (the engine's scoring / selection hooks record their kept
    entries per layer); `recorder` is an AgreementRecorder or None;
    `observers` are response-aware presses whose ``observe()`` records prompt-side statistics
    from this same forward (their ``select()`` follows, over the returned full cache).
    `pruner` (one `fast` press) keeps only that press's entries of each layer as soon as the layer
    is prefilled (:mod:`certkv.engine.layer_pruning`): the returned cache is then empty.
    """
    selections = Selections()
    sampled: dict[str, list[Selection | None]] = {}
    cache = DynamicCache()
    with (
        torch.no_grad(),
        scoring_hooks(model, fast, selections) if fast else nullcontext(),
        selection_hooks(model, probabilistic, sampled) if probabilistic else nullcontext(),
        recorder.attach(model) if recorder else nullcontext(),
        capturing_window_queries(model),
        ExitStack() as stack,
    ):
        for press in observers:
            stack.enter_context(press.observe(model))
        if pruner is not None:  # after every other hook: they read the layer's full keys first
            if not fast or len(fast) != 1:
                raise ValueError("a layer-by-layer pruned prefill needs exactly one fast-path press")
            stack.enter_context(pruner.attach(model, selections.by_candidate[next(iter(fast))]))
        model.model(input_ids=context_tensor(model, context_ids), past_key_values=cache)
    if pruner is not None:
        cache.layers.clear()
    return cache, selections.by_candidate, sampled


def decode_full(
    model: PreTrainedModel,
    cache: DynamicCache,
    enc: EncodedRequest,
    max_new_tokens: int,
    stop_ids: set[int],
    logprobs: list[list[float]] | None = None,
) -> list[int]:
    """The full-cache answer from a full prefill's `cache`.

    :func:`~certkv.engine.batched_decode.decode_candidates` over the full cache (one lane, every
    one of the n_ctx slots visible, no draft: speculative greedy decoding with prompt lookup); the
    cache is cropped back to the context first and afterwards, so it can serve again (the engine
    gathers every candidate's cache from it). `logprobs`, when given, is a one-element list that
    receives the answer's per-token log p.
    """
    n_ctx = len(enc.context_ids)
    cache.crop(n_ctx)
    full_mask = torch.ones((1, n_ctx), dtype=torch.long, device=model.device)
    (ids,) = decode_candidates(
        model,
        cache,
        full_mask,
        enc.question_ids,
        [],
        n_ctx,
        max_new_tokens,
        stop_ids,
        context_ids=enc.context_ids,
        logprobs=logprobs,
    )
    cache.crop(n_ctx)
    return ids
