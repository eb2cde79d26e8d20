"""One request with its KV stored in the certified KV format, alone or beside the certified press.

A format's generation is decoded as calibration decoded it (:func:`certkv.engine.format_run.run_in_format`):
the context prefilled into the format's cache (under the press when it compresses prefills), the
question and the answer fed one token a forward (under the press's hooks when it compresses while
decoding). The cache holds its keys and values at the format's precision (float8, integers and
their scales, transformers' quantised tensors) and its full-precision window only; it is decoded
alone, between the scheduler's batched steps; in ``certkv serve`` one of certkv's per-token formats
alone decodes as a lane of the batch instead (:mod:`certkv.engine.format_lanes`), behind no
recompute threshold, holding its stored tensors.

The gate: a recompute part (threshold r) stops the decode at the first token whose probability is
< r and the gate flow finishes the answer on a fresh full cache; a post-decode part escalates the
finished answer (:func:`~certkv.runtime.gate_flow.gate_flow`). Gates decided before the decode need a
full prefill this path never holds; the runtime refuses them for a format.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from certkv.core.kv_cost import kv_cost
from certkv.engine.decoding_run import DecodingRun
from certkv.engine.format_lanes import lane_format, plain_held_units, stored_lane
from certkv.engine.format_run import head_dim, layer_slot_bytes, run_in_format
from certkv.kv_formats.caches import build_cache
from certkv.kv_formats.spec import SplitFormat
from certkv.runtime.gate_flow import AnsweringPath, AnswerSource, EvictedAnswer
from certkv.runtime.steps import Decode, Reserve, Step

if TYPE_CHECKING:
    from kvpress import BasePress
    from transformers import PreTrainedModel

    from certkv.core.spec import GateSettings
    from certkv.kv_formats.spec import KvFormat
    from certkv.model.generation import EncodedRequest


def format_slots(model: PreTrainedModel, fmt: KvFormat, enc: EncodedRequest, max_new_tokens: int) -> int:
    """Token slots of the model's dtype a request in `fmt` may hold (what the scheduler reserves):
    every token of its prompt and answer at the format's bytes, its full-precision window (the
    format's, plus the question, which is fed in one forward) at the model's, and one layer of the
    prefill at the model's (each layer computes its keys and values before it stores them)."""
    element_bits = 8 * next(model.parameters()).element_size()
    share = fmt.bytes_share(head_dim(model)) * 16 / element_bits
    parts = (fmt.keys, fmt.values) if isinstance(fmt, SplitFormat) else (fmt,)
    window = max(p.residual_length for p in parts) + len(enc.question_ids)
    tokens = len(enc.context_ids) + len(enc.question_ids) + max_new_tokens
    prefill_layer = len(enc.context_ids) / model.config.num_hidden_layers
    return math.ceil(tokens * share + min(window, tokens) * max(0.0, 1 - share) + prefill_layer)


@dataclass
class FormatPath(AnsweringPath):
    """Answer requests with the KV in `kv_format` (and `press`, None: every token kept), behind `gate`."""

    model: PreTrainedModel
    press: BasePress | None  # type: ignore[assignment]
    gate: GateSettings
    stop_ids: set[int]
    kv_format: KvFormat

    def start(
        self, enc: EncodedRequest, max_new: int, signals: dict[str, Any], seconds: dict[str, float], lean: bool
    ) -> Generator[Step, None, AnswerSource]:
        """Nothing before the decode: the format's prefill is part of its generation. `lean`
        (``certkv serve``'s scheduler) decodes a lane format as a lane of the batch (:meth:`lanes`)."""
        yield from ()
        return FormatDecode(self, enc, max_new, lanes=lean and self.lanes())

    def lanes(self) -> bool:
        """Whether a lean run decodes as a lane of ``certkv serve``'s batch: one of certkv's per-token
        formats alone (:func:`~certkv.engine.format_lanes.lane_format`), behind no recompute
        threshold (its restart is decided token by token, alone)."""
        return self.gate.recompute is None and lane_format(self.kv_format, self.press)


class FormatDecode(AnswerSource):
    """A request decoded alone in the path's format, stopped where a recompute part fires; its full
    answer has a prefill of its own."""

    path: FormatPath

    def __init__(self, path: FormatPath, enc: EncodedRequest, max_new: int, lanes: bool) -> None:
        super().__init__(path, enc, max_new)
        self.lanes = lanes

    def decode(self) -> Generator[Step, None, EvictedAnswer]:
        path, enc, max_new = self.path, self.enc, self.max_new
        yield Reserve(format_slots(path.model, path.kv_format, enc, max_new))
        run = yield from (self._lane_steps() if self.lanes else self._solo_steps())
        n_ctx, n_q = len(enc.context_ids), len(enc.question_ids)
        answer = EvictedAnswer(run.token_ids, run.logprobs, run.prefill_kept / n_ctx, stopped_at=run.stopped_at)
        if run.stopped_at is None:
            tokens, stored = kv_cost(run.held, n_ctx, n_q), kv_cost(run.held_units, n_ctx, n_q)
            answer.kv_peak, answer.kv_time = tokens.peak, tokens.time
            answer.kv_peak_bytes, answer.kv_time_bytes = stored.peak, stored.time
        return answer

    def _lane_steps(self) -> Generator[Step, None, DecodingRun]:
        """The context prefilled into the format's cache (stored as each layer computes it), taken
        over by a lane of the scheduler's batch (:func:`~certkv.engine.format_lanes.stored_lane`)."""
        path, enc, max_new = self.path, self.enc, self.max_new
        model = path.model
        cache = build_cache(path.kv_format, model.config)
        with torch.no_grad():
            model.model(input_ids=torch.as_tensor(enc.context_ids, device=model.device).view(1, -1), past_key_values=cache)
        lane = stored_lane(path.kv_format, cache, enc, max_new, path.stop_ids, layer_slot_bytes(model))  # type: ignore[arg-type]
        job = Decode(lane.cache, list(enc.question_ids), lane.position, max_new, path.stop_ids, solo=None,
                     lookup_ids=lane.lookup_ids, want_logprobs=True, final=self.final, lane=lane)
        yield job
        n_ctx, n_q, steps = len(enc.context_ids), len(enc.question_ids), max(1, len(lane.answer))
        return DecodingRun(token_ids=list(lane.answer), logprobs=list(lane.logprobs), prefill_kept=float(n_ctx),
                           held=[float(n_ctx + n_q + t) for t in range(steps)],
                           held_units=plain_held_units(path.kv_format, head_dim(model), n_ctx, n_q, steps))

    def _solo_steps(self) -> Generator[Step, None, DecodingRun]:
        """The decode alone (:func:`run_in_format`), one token a forward."""
        path, enc, max_new = self.path, self.enc, self.max_new
        runs: list[DecodingRun] = []

        def solo() -> tuple[list[int], list[float] | None]:
            run = run_in_format(path.model, path.kv_format, enc, max_new, path.press, stop_below=path.gate.recompute,
                                on_token=job.tell)
            runs.append(run)
            return run.token_ids, run.logprobs

        job = Decode(None, list(enc.question_ids), len(enc.context_ids), max_new, path.stop_ids, solo=solo,
                     want_logprobs=True, batchable=False, final=self.final)
        yield job
        return runs[0]


__all__ = ["FormatDecode", "FormatPath", "format_slots"]
