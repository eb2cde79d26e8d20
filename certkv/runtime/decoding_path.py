"""One request under a decoding-time press, with the recompute fallback mid-generation.

A decoding-time press (kvpress's ``CompressionRatioDecodingPress``, ``PrefillDecodingPress``, ...)
compresses the cache while the answer is decoded, through hooks on every attention layer, so the
answer is decoded alone under the press, as calibration decoded it
(:func:`certkv.engine.decoding_run.run_decoding`): the forwards, and so the tokens, are the
store's. In ``certkv serve`` a press whose choices survive a batched forward (StreamingLLM's,
TOVA's, K-norm's given the pipeline's first-layer key bits:
:func:`~certkv.engine.decoding_rows.batchable_decoding_press`) decodes as a row of the
batch instead, behind no recompute threshold: the row keeps kvpress's books itself, compresses
once tokens are confirmed, and gives slots back at each event (:mod:`certkv.engine.decoding_rows`,
the same tokens and held KV); it reserves its peak, not the whole prefill and answer
(:func:`~certkv.engine.decoding_rows.row_slots`). Any other decode (certkv's probabilistic
press, which draws at random every step; a recompute gate) is not batchable (the press's hooks
would compress every row of a batch): the scheduler runs it alone between batched steps.

The gate:

* ``recompute`` (threshold r): the first generated token whose probability is < r is not kept;
  the context is prefilled again with the full cache, the question and the tokens kept so far are
  fed in one forward, and the answer is finished on the full cache
  (:func:`certkv.engine.decoding_run.finish_on_full_cache`). The decision says where
  (``recomputed_at``); certification counted such a request exactly as this runs it
  (:mod:`certkv.core.gated`).
* ``certificate_recompute`` (bound b, certkv's probabilistic decoding press): the same restart at
  the first token whose decoding step's survey-variance certificate is > b, read after each
  forward as calibration read it.
* a post-decode part (confidence; the certificate bound for certkv's probabilistic decoding
  press, whose run records its largest certificate) escalates the finished answer to the full cache.

Gates decided before the decode (agreement drop, lookahead, a learned model reading them) need the
full prefill this path never holds; the runtime refuses them for a decoding-time press.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from certkv.core.kv_cost import kv_cost
from certkv.engine.decoding_rows import batchable_decoding_press, prefilled_row, row_slots, run_of
from certkv.engine.decoding_run import DecodingRun, finish_on_full_cache, run_decoding
from certkv.runtime.full_path import full_answer_steps, prefill_slots
from certkv.runtime.gating import post_decode_reason
from certkv.runtime.steps import Decode, PathAnswer, Reserve, Step, Steps, run_alone

if TYPE_CHECKING:
    from kvpress import BasePress
    from transformers import PreTrainedModel

    from certkv.core.spec import GateSettings
    from certkv.model.generation import EncodedRequest


@dataclass
class DecodingPath:
    """Answer requests with a decoding-time `press`, behind `gate` (its recompute part included)."""

    model: PreTrainedModel
    press: BasePress
    gate: GateSettings
    stop_ids: set[int]

    def answer(self, enc: EncodedRequest, max_new: int, signals: dict[str, Any]) -> PathAnswer:
        """Answer `enc` in-process, as calibration did; `signals` is filled with what the gate read."""
        return run_alone(self.steps(enc, max_new, signals))

    def steps(self, enc: EncodedRequest, max_new: int, signals: dict[str, Any], lean: bool = False) -> Steps:
        """The answer as steps (module docstring); `lean` (``certkv serve``'s scheduler) decodes a
        batchable press as a row of the batch (:meth:`rows`), any other decode is solo. Behind no
        post-decode part the press's tokens are the answer's as decoded (``final``: a listener
        hears each one), and a recompute restart keeps them."""
        t0 = time.perf_counter()
        run = yield from (self._row_steps(enc, max_new) if lean and self.rows() else self._solo_steps(enc, max_new))
        seconds = {"decode": time.perf_counter() - t0}
        kept = run.prefill_kept / len(enc.context_ids)
        if run.stopped_at is not None:
            return (yield from self._recompute(enc, run, max_new, signals, seconds, kept))
        reason = post_decode_reason(self.gate, signals, run.logprobs, run.certificate_max)
        if reason is None:
            cost = kv_cost(run.held, len(enc.context_ids), len(enc.question_ids))
            return PathAnswer(run.token_ids, None, signals, seconds, kept=kept, kv_peak=cost.peak, kv_time=cost.time)
        t = time.perf_counter()
        ids = yield from full_answer_steps(self.model, enc, max_new, self.stop_ids)
        seconds["escalation"] = time.perf_counter() - t
        return PathAnswer(ids, reason, signals, seconds, escalated=True)

    def rows(self) -> bool:
        """Whether a lean run decodes as a row of ``certkv serve``'s batch: a press whose choices
        survive a batched forward (:func:`~certkv.engine.decoding_rows.batchable_decoding_press`),
        behind no recompute threshold (its restart is decided token by token, alone)."""
        no_restart = self.gate.recompute is None and self.gate.certificate_recompute is None
        return no_restart and batchable_decoding_press(self.press, self.model)

    def _solo_steps(self, enc: EncodedRequest, max_new: int) -> Generator[Step, None, DecodingRun]:
        """The decode alone under kvpress's hooks (:func:`run_decoding`), within a reservation of
        the whole prefill, question and answer."""
        yield Reserve(prefill_slots(self.model, enc, max_new))
        runs: list[DecodingRun] = []

        def solo() -> tuple[list[int], list[float] | None]:
            run = run_decoding(self.model, self.press, enc, max_new, stop_below=self.gate.recompute, on_token=job.tell,
                               stop_above=self.gate.certificate_recompute)
            runs.append(run)
            return run.token_ids, run.logprobs

        job = Decode(None, list(enc.question_ids), len(enc.context_ids), max_new, self.stop_ids, solo=solo,
                     want_logprobs=True, batchable=False, final=not self.gate.post_decode)
        yield job
        return runs[0]

    def _row_steps(self, enc: EncodedRequest, max_new: int) -> Generator[Step, None, DecodingRun]:
        """The decode as a row of the scheduler's batch (:func:`~certkv.engine.decoding_rows.prefilled_row`):
        reserved at its peak (:func:`~certkv.engine.decoding_rows.row_slots`), compressed by the row's
        own books as tokens are confirmed, its slots given back at each event; the same tokens and
        held KV as :func:`run_decoding`."""
        yield Reserve(row_slots(self.model, self.press, enc, max_new))
        row, kept = prefilled_row(self.model, self.press, enc, max_new, self.stop_ids)
        job = Decode(row.cache, list(enc.question_ids), row.position, max_new, self.stop_ids, solo=None,
                     lookup_ids=list(enc.context_ids), want_logprobs=True, final=not self.gate.post_decode, row=row)
        yield job
        return run_of(row, kept)

    def _recompute(self, enc, run: DecodingRun, max_new: int, signals: dict, seconds: dict, kept: float) -> Steps:
        """Finish `run`, stopped by the recompute trigger, on a fresh full cache: one more solo
        :class:`Decode` (within the request's reservation: the press's cache is gone by then),
        final, that tells its listener where the restart kept the answer."""
        t = time.perf_counter()
        signals["confidence_min"], signals["logprob_mean"] = None, None  # the evicted answer was not finished
        prefix = list(run.token_ids)

        def solo() -> tuple[list[int], list[float] | None]:
            job.tell(prefix)  # the restart is heard at once, before the full cache's first token
            return finish_on_full_cache(self.model, enc, prefix, max_new, on_token=job.tell).token_ids, None

        job = Decode(None, [*enc.question_ids, *prefix], len(enc.context_ids), max_new, self.stop_ids, solo=solo,
                     batchable=False, final=True, restarted_at=run.stopped_at)
        yield job
        assert job.ids is not None  # whoever runs the steps fills the answer in before resuming
        seconds["recompute"] = time.perf_counter() - t
        return PathAnswer(job.ids, "recompute", signals, seconds, kept=kept, escalated=True,
                          recomputed_at=run.stopped_at)


__all__ = ["DecodingPath"]
