"""One request under a press that is not on the engine's single-prefill path (kvpress's own hooks).

Wrappers, threshold and decoding-time presses prune while they prefill (calibration runs them the
same way, ``path="pipeline"``), so their kept entries are known only after the cache is pruned:

1. The context is prefilled under the press, with the agreement recorder attached first when the
   gate reads the drop (its hooks run before the press's and see each layer's full keys).
2. A pre-decode gate (agreement drop; a learned score without confidence or lookahead features)
   that says "full" answers from the full cache, which needs a prefill of its own.
3. Otherwise the answer is decoded greedily from the pruned cache with its log-probabilities; a
   post-decode gate (confidence, learned with confidence features) escalates, again with a full
   prefill. Gates that need the lookahead probe cannot run here (the runtime refuses them when
   it is built): the probe reads the full cache, which this path never holds.

Every full-cache answer of this path costs its prefill: ``seconds["escalation"]`` reports it.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from certkv.engine.engine import continues_from_compressed_length, kept_entries
from certkv.engine.full_cache import context_tensor
from certkv.gate.agreement import AgreementRecorder
from certkv.model.generation import greedy_decode
from certkv.model.window_queries import capturing_window_queries
from certkv.runtime.gates import post_decode_reason, pre_decode_reason

if TYPE_CHECKING:
    from certkv.model.generation import EncodedRequest
    from certkv.runtime.answering import AnsweringRuntime
    from certkv.runtime.decision import Decision


def answer(
    runtime: AnsweringRuntime, enc: EncodedRequest, max_new: int, decision: Decision, t0: float
) -> tuple[list[int], dict[str, float]]:
    """Answer one request through the press's own hooks; fills `decision`, returns (ids, seconds).

    `t0` is the request's start (:func:`time.perf_counter`), from which its prefill is timed.
    """
    model, gate, press = runtime.model, runtime.gate, runtime.press
    n_ctx = len(enc.context_ids)
    recorder = AgreementRecorder(**gate.agreement) if gate.needs_agreement and gate.agreement is not None else None
    cache = DynamicCache()
    with torch.no_grad():
        # The recorder's hooks are registered before the press's, so they run first on each layer
        # and see its keys before the press prunes them.
        with (
            recorder.attach(model) if recorder else nullcontext(),
            press(model),
            capturing_window_queries(model),  # as calibration prefills
        ):
            model.model(input_ids=context_tensor(model, enc.context_ids), past_key_values=cache)
    seconds = {"prefill": time.perf_counter() - t0}
    if recorder:
        decision.agreement_drop = recorder.drop()
    reason = pre_decode_reason(gate, decision)
    if reason is None:
        t = time.perf_counter()
        position = cache.get_seq_length() if continues_from_compressed_length(press) else n_ctx
        kept = kept_entries(cache, model) / n_ctx
        logprobs: list[float] = []
        ids = greedy_decode(model, cache, enc.question_ids, position, max_new, logprobs=logprobs)
        assert ids is not None  # greedy_decode returns None only when an after_step callback stops it
        seconds["decode"] = time.perf_counter() - t
        reason = post_decode_reason(gate, decision, logprobs, None)
        if reason is None:
            decision.mode = "evicted"
            decision.kv_retained = runtime.operating_point.kv_retained
            decision.kv_retained_actual = kept
            return ids, seconds
        decision.escalated = True
    del cache
    t = time.perf_counter()
    ids = runtime.full_answer(enc, max_new)
    seconds["escalation"] = time.perf_counter() - t
    decision.reason = reason
    return ids, seconds
