"""One request on the engine's single-prefill path: one full prefill, gates, then the kept entries.

For a fast-path press (:func:`certkv.engine.scoring.is_fast_path_press`) or certkv's probabilistic
press, the runtime does what calibration did for this candidate, with the same engine functions:

1. **One full prefill** of the context under the engine's hooks: :func:`~certkv.engine.scoring.scoring_hooks`
   (the press's top-k indices per layer) or :func:`~certkv.engine.probabilistic_decode.selection_hooks`
   (its Poisson selection per layer), the :class:`~certkv.gate.agreement.AgreementRecorder` when the gate
   reads the drop, and :func:`~certkv.model.window_queries.capturing_window_queries`, as calibration
   prefills. Nothing is pruned: the full cache of shape (1, H_kv, n_ctx, d) per layer stays.
2. **Pre-decode signals and gates** while the full cache exists: the agreement drop, the lookahead
   probe (:func:`certkv.model.lookahead.lookahead_probe`, its mass on the entries the press evicts)
   and a learned score without confidence features. When the gate says so, the answer is decoded
   from that same cache: no second prefill.
3. **The evicted answer**: the kept entries are gathered into a one-row cache
   (:func:`~certkv.engine.batched_decode.padded_cache` / the probabilistic decode's own gather) and
   decoded with their log-probabilities (:func:`~certkv.engine.batched_decode.decode_candidates`,
   :func:`~certkv.engine.probabilistic_decode.decode_probabilistic`).
4. **Post-decode gates** (certificate, confidence, learned with confidence features): an escalated
   request's full answer is decoded from the still-existing full cache (cropped back to the
   context first); ``seconds["escalation"]`` is that recomputation.

The full-cache answer is always decoded as calibration decodes it
(:func:`certkv.engine.full_cache.decode_full`: the engine's
``decode_candidates`` over the full cache, one row, every slot visible), so that it equals the
store's ``full`` record.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from certkv.engine.batched_decode import decode_candidates, padded_cache
from certkv.engine.engine import is_probabilistic_press
from certkv.engine.full_cache import decode_full, prefill_full
from certkv.engine.probabilistic_decode import decode_probabilistic
from certkv.gate.agreement import AgreementRecorder
from certkv.model.lookahead import evicted_mass, lookahead_probe
from certkv.presses.poisson_selection import Selection
from certkv.presses.response_aware import is_response_aware_press, prefill_observers
from certkv.runtime.gates import post_decode_reason, pre_decode_reason

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from certkv.model.generation import EncodedRequest
    from certkv.runtime.answering import AnsweringRuntime
    from certkv.runtime.decision import Decision

#: One candidate's kept entries of the full cache, per layer: a fast-path press's kept indices, a
#: (1, H_kv, n_kept) long tensor (None: keeps everything), or the probabilistic press's Selection.
KeptSelection = list[torch.Tensor | None] | list[Selection | None]


def answer(
    runtime: AnsweringRuntime, enc: EncodedRequest, max_new: int, decision: Decision, t0: float
) -> tuple[list[int], dict[str, float]]:
    """Answer one request on the single-prefill path; fills `decision` and returns
    (token ids, seconds). `runtime` is the :class:`~certkv.runtime.certified_runtime.CertifiedRuntime`;
    `t0` the request's start (:func:`time.perf_counter`), from which its prefill is timed."""
    model, gate, press = runtime.model, runtime.gate, runtime.press
    policy = runtime.policy
    probabilistic = is_probabilistic_press(press)
    response_aware = is_response_aware_press(press)
    recorder = AgreementRecorder(**gate.agreement) if gate.needs_agreement and gate.agreement is not None else None
    cache, fast_sel, sampled = prefill_full(
        model,
        enc.context_ids,
        fast=None if probabilistic or response_aware else {policy: press},
        probabilistic={policy: press} if probabilistic else None,
        recorder=recorder,
        observers=prefill_observers([press]) if response_aware else (),
    )
    if response_aware:  # chosen over the full cache right after the prefill, as the engine chooses
        selection = press.select(model, cache, enc, runtime.stop_ids)
    else:
        selection = sampled[policy] if probabilistic else fast_sel[policy]
    seconds = {"prefill": time.perf_counter() - t0}
    if recorder:
        decision.agreement_drop = recorder.drop()
        recorder.reset()
    if gate.needs_lookahead:
        t = time.perf_counter()
        heads = lookahead_heads(model, cache, enc, selection, gate.lookahead_tokens, runtime.stop_ids)
        decision.lookahead_heads, decision.lookahead_mass = heads, max(heads)
        seconds["probe"] = time.perf_counter() - t
    reason = pre_decode_reason(gate, decision)
    t = time.perf_counter()
    if reason is not None:
        ids = decode_full(model, cache, enc, max_new, runtime.stop_ids)
        seconds["decode"] = time.perf_counter() - t
        decision.reason = reason
        return ids, seconds

    ids, logprobs, kept, certificate = evicted_decode(model, cache, enc, selection, probabilistic, max_new, runtime.stop_ids)
    seconds["decode"] = time.perf_counter() - t
    reason = post_decode_reason(gate, decision, logprobs, certificate)
    if reason is not None:
        t = time.perf_counter()
        ids = decode_full(model, cache, enc, max_new, runtime.stop_ids)
        seconds["escalation"] = time.perf_counter() - t
        decision.reason, decision.escalated = reason, True
        return ids, seconds
    decision.mode = "evicted"
    decision.kv_retained = runtime.operating_point.kv_retained
    decision.kv_retained_actual = kept
    return ids, seconds


def evicted_decode(
    model: PreTrainedModel,
    cache: DynamicCache,
    enc: EncodedRequest,
    selection: KeptSelection,
    probabilistic: bool,
    max_new: int,
    stop_ids: set[int],
) -> tuple[list[int], list[float] | None, float, float | None]:
    """The candidate's answer from its kept entries of the full `cache` (left intact).

    `cache` holds the full prefill, (1, H_kv, n_ctx, d) keys and values per layer; `selection` the
    candidate's kept entries per layer (:data:`KeptSelection`).

    Returns (token ids, per-token log p, realised kept fraction, certificate maximum or None).
    Fast path: the kept entries in one row (:func:`~certkv.engine.batched_decode.padded_cache`,
    with the engine's reserve for the question and answer) decoded by ``decode_candidates``;
    probabilistic press: ``decode_probabilistic`` (Hájek attention, certificate per step).
    """
    n_ctx = len(enc.context_ids)
    if probabilistic:
        (result,) = decode_probabilistic(model, cache, [selection], enc.question_ids, n_ctx, max_new, stop_ids)
        return result.token_ids, result.logprobs, result.kept_fraction, result.certificate_max
    logprobs: list = [None]
    reserve = len(enc.question_ids) + 4 * max_new
    batch, mask, lengths = padded_cache(cache, [selection], n_ctx, reserve=reserve)
    (ids,) = decode_candidates(
        model,
        batch,
        mask,
        enc.question_ids,
        [],
        n_ctx,
        max_new,
        stop_ids,
        context_ids=enc.context_ids,
        logprobs=logprobs,
    )
    return ids, logprobs[0], lengths[0] / n_ctx, None


def lookahead_heads(
    model: PreTrainedModel, cache: DynamicCache, enc: EncodedRequest, selection: KeptSelection, tokens: int, stop_ids: set[int]
) -> list[float]:
    """Per (layer, KV head), layer-major, the full-cache attention mass the probe's queries put on
    the context entries the candidate evicts, as the engine records it
    (:func:`~certkv.model.lookahead.lookahead_probe`, then :func:`~certkv.model.lookahead.evicted_mass`
    of the candidate's per-layer selection); the probe leaves the cache cropped to the context.

    `cache` holds the full prefill, (1, H_kv, n_ctx, d) keys and values per layer; `selection` the
    candidate's kept entries per layer (:data:`KeptSelection`)."""
    probe = lookahead_probe(model, cache, enc.question_ids, len(enc.context_ids), tokens, stop_ids)
    return evicted_mass(probe.weights, selection, cache.layers[0].keys.shape[1])
