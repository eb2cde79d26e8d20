"""One request under a decoding-time press, with the recompute fallback mid-generation.

A decoding-time press (kvpress's ``CompressionRatioDecodingPress``, ``PrefillDecodingPress``, ...)
compresses the cache while the answer is decoded, through hooks on every attention layer, so the
answer is decoded alone under the press, as calibration decoded it
(:func:`certkv.engine.decoding_run.run_decoding`): the forwards, and so the tokens, are the
store's. In ``certkv serve`` a press whose choices survive a batched forward (StreamingLLM's,
TOVA's, K-norm's given the pipeline's first-layer key bits:
:func:`~certkv.engine.decoding_lanes.batchable_decoding_press`) decodes as a lane of the
batch instead, behind no recompute threshold: the lane keeps kvpress's books itself, compresses
once tokens are confirmed, and gives slots back at each event (:mod:`certkv.engine.decoding_lanes`,
the same tokens and held KV); it reserves its peak, not the whole prefill and answer
(:func:`~certkv.engine.decoding_lanes.lane_slots`). Any other decode (certkv's probabilistic
press, which draws at random every step; a recompute gate) is not batchable (the press's hooks
would compress every lane of a batch): the scheduler runs it alone between batched steps.

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

The gates, the restart and the escalation are the one gate flow every path shares
(:func:`~certkv.runtime.gate_flow.gate_flow`): this path starts a request with nothing (the press
prefills as it decodes) and supplies the press's answer, stopped where a recompute part fires
(:class:`PressDecode`); its full answer has a prefill of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from certkv.core.kv_cost import kv_cost
from certkv.engine.decoding_lanes import batchable_decoding_press, lane_slots, prefilled_lane, run_of
from certkv.engine.decoding_run import DecodingRun, run_decoding
from certkv.runtime.full_path import prefill_slots
from certkv.runtime.gate_flow import AnsweringPath, AnswerSource, EvictedAnswer
from certkv.runtime.steps import Decode, Reserve, Step

if TYPE_CHECKING:
    from kvpress import BasePress
    from transformers import PreTrainedModel

    from certkv.core.spec import GateSettings
    from certkv.model.generation import EncodedRequest


@dataclass
class DecodingPath(AnsweringPath):
    """Answer requests with a decoding-time `press`, behind `gate` (its recompute part included)."""

    model: PreTrainedModel
    press: BasePress
    gate: GateSettings
    stop_ids: set[int]

    def start(
        self, enc: EncodedRequest, max_new: int, signals: dict[str, Any], seconds: dict[str, float], lean: bool
    ) -> Generator[Step, None, AnswerSource]:
        """Nothing before the decode: the press prefills as it decodes, within the decode's own
        reservation. `lean` (``certkv serve``'s scheduler) decodes a batchable press as a lane of the
        batch (:meth:`lanes`); any other decode is solo."""
        yield from ()
        return PressDecode(self, enc, max_new, lanes=lean and self.lanes())

    def lanes(self) -> bool:
        """Whether a lean run decodes as a lane of ``certkv serve``'s batch: a press whose choices
        survive a batched forward (:func:`~certkv.engine.decoding_lanes.batchable_decoding_press`),
        behind no recompute threshold (its restart is decided token by token, alone)."""
        no_restart = self.gate.recompute is None and self.gate.certificate_recompute is None
        return no_restart and batchable_decoding_press(self.press, self.model)


class PressDecode(AnswerSource):
    """A request decoded under its decoding-time press, alone (:func:`run_decoding`) or, with `lanes`,
    as a lane of the scheduler's batch. Behind no post-decode part the press's tokens are the
    answer's as decoded (``final``: a listener hears each one), and a recompute restart keeps them."""

    path: DecodingPath

    def __init__(self, path: DecodingPath, enc: EncodedRequest, max_new: int, lanes: bool) -> None:
        super().__init__(path, enc, max_new)
        self.lanes = lanes

    def decode(self) -> Generator[Step, None, EvictedAnswer]:
        """The press's answer, with the KV it held; stopped where a recompute part fired."""
        enc = self.enc
        run = yield from (self._lane_steps() if self.lanes else self._solo_steps())
        n_ctx = len(enc.context_ids)
        answer = EvictedAnswer(run.token_ids, run.logprobs, run.prefill_kept / n_ctx, run.certificate_max,
                               stopped_at=run.stopped_at)
        if run.stopped_at is None:
            cost = kv_cost(run.held, n_ctx, len(enc.question_ids))
            answer.kv_peak, answer.kv_time = cost.peak, cost.time
        return answer

    def _solo_steps(self) -> Generator[Step, None, DecodingRun]:
        """The decode alone under kvpress's hooks (:func:`run_decoding`), within a reservation of
        the whole prefill, question and answer."""
        path, enc, max_new = self.path, self.enc, self.max_new
        yield Reserve(prefill_slots(path.model, enc, max_new))
        return (yield from solo_run_steps(
            lambda tell: run_decoding(path.model, path.press, enc, max_new, stop_below=path.gate.recompute, on_token=tell,
                                      stop_above=path.gate.certificate_recompute),
            enc, max_new, path.stop_ids, self.final))

    def _lane_steps(self) -> Generator[Step, None, DecodingRun]:
        """The decode as a lane of the scheduler's batch (:func:`~certkv.engine.decoding_lanes.prefilled_lane`):
        reserved at its peak (:func:`~certkv.engine.decoding_lanes.lane_slots`), compressed by the lane's
        own books as tokens are confirmed, its slots given back at each event; the same tokens and
        held KV as :func:`run_decoding`."""
        path, enc, max_new = self.path, self.enc, self.max_new
        yield Reserve(lane_slots(path.model, path.press, enc, max_new))
        lane, kept = prefilled_lane(path.model, path.press, enc, max_new, path.stop_ids)
        job = Decode(lane.cache, list(enc.question_ids), lane.position, max_new, path.stop_ids, solo=None,
                     lookup_ids=list(enc.context_ids), want_logprobs=True, final=self.final, lane=lane)
        yield job
        return run_of(lane, kept)


def solo_run_steps(run: Callable[[Callable[[list[int]], None]], DecodingRun], enc: EncodedRequest, max_new: int,
                   stop_ids: set[int], final: bool) -> Generator[Step, None, DecodingRun]:
    """A generation decoded alone between the scheduler's batched steps: one unbatchable
    :class:`Decode` whose solo decoder is `run` (given the listener to tell each kept token); its
    :class:`~certkv.engine.decoding_run.DecodingRun`."""
    runs: list[DecodingRun] = []

    def solo() -> tuple[list[int], list[float] | None]:
        runs.append(run(job.tell))
        return runs[0].token_ids, runs[0].logprobs

    job = Decode(None, list(enc.question_ids), len(enc.context_ids), max_new, stop_ids, solo=solo,
                 want_logprobs=True, batchable=False, final=final)
    yield job
    return runs[0]


__all__ = ["DecodingPath", "PressDecode", "solo_run_steps"]
