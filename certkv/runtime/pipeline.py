"""One request under a press that is not on the engine's single-prefill path (kvpress's own hooks).

Wrappers, threshold and decoding-time presses prune while they prefill (calibration runs them the
same way, ``path="pipeline"``), so their kept entries are known only after the cache is pruned.
:class:`PipelinePath`:

1. prefills the context under the press, with the agreement recorder attached first when the
   gate reads the drop (its hooks run before the press's and see each layer's full keys);
2. answers from the full cache when a pre-decode gate (agreement drop; a learned score without
   confidence or lookahead features) says "full", which needs a prefill of its own;
3. otherwise decodes greedily from the pruned cache with its log-probabilities; a post-decode gate
   (confidence, learned with confidence features) escalates, again with a full prefill. Gates that
   need the lookahead probe cannot run here (the runtime refuses them when it is built): the probe
   reads the full cache, which this path never holds.

Steps 2 and 3 are the one gate flow every path shares (:func:`~certkv.runtime.gate_flow.gate_flow`):
this path starts a request with its pruning prefill (:meth:`PipelinePath.start`) and supplies the
press's answer and the full answer (:class:`PrunedCache`).

Every full-cache answer of this path costs its prefill, timed with it (``seconds["decode"]`` before
the evicted decode, ``seconds["escalation"]`` after it). The pruned cache is all a decoding request
holds, in-process or in ``certkv serve``'s batch (*lean*: the scheduler takes the cache over and
decodes it plainly greedy, as :func:`greedy_decode` does), except under a head-wise press (AdaKV,
CriticalAdaKV, DuoAttention, KVzip, ...): those leave the evicted positions in the cache and have
kvpress's attention wrapper mask them per head at every decoding step (``masked_key_indices`` on
each attention module), which the batched attention does not read, so such a request decodes
alone, right after its own prefill, as in-process.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from certkv.engine.engine import kept_entries
from certkv.engine.full_cache import context_tensor
from certkv.engine.positions import continues_from_compressed_length
from certkv.model.generation import greedy_decode
from certkv.model.window_queries import capturing_window_queries
from certkv.runtime.full_path import prefill_slots
from certkv.runtime.gate_flow import AnsweringPath, AnswerSource, EvictedAnswer
from certkv.runtime.gating import agreement_settings
from certkv.runtime.steps import Decode, Reserve
from certkv.signals.agreement import AgreementRecorder

if TYPE_CHECKING:
    from collections.abc import Generator

    from kvpress import BasePress
    from transformers import PreTrainedModel

    from certkv.core.spec import GateSettings
    from certkv.model.generation import EncodedRequest
    from certkv.runtime.steps import Step


@dataclass
class PipelinePath(AnsweringPath):
    """Answer requests with `press` through kvpress's hooks, behind `gate`."""

    model: PreTrainedModel
    press: BasePress
    gate: GateSettings
    stop_ids: set[int]

    def start(
        self, enc: EncodedRequest, max_new: int, signals: dict[str, Any], seconds: dict[str, float], lean: bool
    ) -> Generator[Step, None, AnswerSource]:
        """Reserve the request's KV and prefill its context under the press (module docstring), the
        agreement drop recorded when the gate reads it; `lean` lets the scheduler take the pruned
        cache over."""
        model, gate = self.model, self.gate
        yield Reserve(prefill_slots(model, enc, max_new))
        t0 = time.perf_counter()
        recorder = AgreementRecorder(**agreement_settings(gate)) if gate.needs_agreement else None
        cache = DynamicCache()
        with torch.no_grad():
            # The recorder's hooks are registered before the press's, so they run first on each layer
            # and see its keys before the press prunes them.
            with (
                recorder.attach(model) if recorder else nullcontext(),
                self.press(model),
                capturing_window_queries(model),  # as calibration prefills
            ):
                model.model(input_ids=context_tensor(model, enc.context_ids), past_key_values=cache)
        seconds["prefill"] = time.perf_counter() - t0
        if recorder:
            signals["agreement_drop"] = recorder.drop()
        return PrunedCache(self, enc, max_new, cache, lean)


class PrunedCache(AnswerSource):
    """A request whose context :class:`PipelinePath` prefilled under the press: the press's answer
    decoded greedily from the pruned `cache` (alone unless `lean` and batchable, module docstring),
    the full answer from a prefill of its own (the pruned cache is dropped first)."""

    def __init__(self, path: PipelinePath, enc: EncodedRequest, max_new: int, cache: DynamicCache, lean: bool) -> None:
        super().__init__(path, enc, max_new)
        self.cache, self.lean = cache, lean

    def decode(self) -> Generator[Step, None, EvictedAnswer]:
        model, cache, enc, max_new = self.path.model, self.cache, self.enc, self.max_new
        n_ctx = len(enc.context_ids)
        position = cache.get_seq_length() if continues_from_compressed_length(self.path.press) else n_ctx
        kept = kept_entries(cache, model) / n_ctx

        def solo() -> tuple[list[int], list[float] | None]:
            logprobs: list[float] = []
            ids = greedy_decode(model, cache, enc.question_ids, position, max_new, logprobs=logprobs)
            return ids, logprobs

        alone = not self.lean or _masks_heads(model)
        job = Decode(cache, list(enc.question_ids), position, max_new, self.path.stop_ids, solo=solo if alone else None,
                     want_logprobs=True, batchable=not alone, final=self.final)
        yield job
        assert job.ids is not None  # whoever runs the steps fills the answer in before resuming
        return EvictedAnswer(job.ids, job.logprobs, kept)

    def full_answer(self) -> Generator[Step, None, list[int]]:
        self.cache.layers.clear()  # the pruned cache is done with; the full answer prefills its own
        return super().full_answer()


def _masks_heads(model: PreTrainedModel) -> bool:
    """Whether the last prefill left kvpress head-wise masks on the attention modules (module docstring)."""
    return any(getattr(m, "masked_key_indices", None) is not None for m in model.modules())
