"""One request with its KV stored in the certified KV format, alone or beside the certified press.

A format's generation is decoded as calibration decoded it (:func:`certkv.engine.format_run.run_in_format`):
the context prefilled into the format's cache (under the press when it compresses prefills), the
question and the answer fed one token a forward (under the press's hooks when it compresses while
decoding). The cache holds its keys and values at the format's precision (float8, integers and
their scales, transformers' quantised tensors) and its full-precision window only; it is decoded
alone, between the scheduler's batched steps; in ``certkv serve`` one of certkv's per-token formats
alone or beside a scorer press decodes as a lane of the batch instead (:mod:`certkv.engine.format_lanes`),
holding its stored tensors, and stops itself at a recompute threshold.

The gate: a recompute part (threshold r) stops the decode at the first token whose probability is
< r and the gate flow finishes the answer on a fresh full cache; a post-decode part escalates the
finished answer (:func:`~certkv.runtime.gate_flow.gate_flow`). Gates decided before the decode need a
full prefill this path never holds; the runtime refuses them for a format.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from certkv.core.kv_cost import kv_cost
from certkv.engine.batched_decode import kept_count
from certkv.engine.decoding_lanes import decode_lanes
from certkv.engine.decoding_run import DecodingRun
from certkv.engine.format_lanes import format_lane, lane_format, lane_run, stored_lane
from certkv.engine.format_run import head_dim, layer_slot_bytes, run_in_format
from certkv.engine.full_cache import prefill_full
from certkv.kv_formats.caches import build_cache
from certkv.kv_formats.spec import key_value_formats, stored_share
from certkv.runtime.decoding_path import solo_run_steps
from certkv.runtime.full_path import prefill_slots
from certkv.runtime.gate_flow import AnsweringPath, AnswerSource, EvictedAnswer
from certkv.runtime.steps import Decode, Reserve, Step

if TYPE_CHECKING:
    from kvpress import BasePress
    from transformers import PreTrainedModel

    from certkv.core.spec import GateSettings
    from certkv.engine.ragged_decode import Lane
    from certkv.kv_formats.spec import KvFormat
    from certkv.model.generation import EncodedRequest


def format_slots(model: PreTrainedModel, fmt: KvFormat, enc: EncodedRequest, max_new_tokens: int) -> int:
    """Token slots of the model's dtype a request in `fmt` may hold (what the scheduler reserves):
    every token of its prompt and answer at the bytes the format's tensors take
    (:func:`~certkv.kv_formats.spec.stored_share`: integers of b < 8 bits packed eight to b bytes
    where the head size is a multiple of 8), its full-precision window (the format's, plus the question, which is fed in one
    forward) at the model's, and two copies of one layer at the model's (a step dequantises a layer's
    keys and values and concatenates its new entries to them before its attention reads them)."""
    config = model.config.get_text_config(decoder=True)
    element_bits = 8 * next(model.parameters()).element_size()
    share = stored_share(fmt, head_dim(model)) * 16 / element_bits
    parts = key_value_formats(fmt)
    window = max(p.residual_length for p in parts) + len(enc.question_ids)
    tokens = len(enc.context_ids) + len(enc.question_ids) + max_new_tokens
    transient = 2 * tokens / config.num_hidden_layers
    return math.ceil(tokens * share + min(window, tokens) * max(0.0, 1 - share) + transient)


@dataclass
class FormatPath(AnsweringPath):
    """Answer requests with the KV in `kv_format` (and `press`, None: every token kept), behind `gate`."""

    model: PreTrainedModel
    press: BasePress | None
    gate: GateSettings
    stop_ids: set[int]
    kv_format: KvFormat

    def start(
        self, enc: EncodedRequest, max_new: int, signals: dict[str, Any], seconds: dict[str, float], lean: bool
    ) -> Generator[Step, None, AnswerSource]:
        """A scorer press beside a per-token format: the full prefill under its scoring hooks, its
        kept entries gathered into a lane in the format (the full cache dropped), as calibration
        chose them (:func:`~certkv.engine.format_lanes.format_lane`). Otherwise nothing before the
        decode: the format's prefill is part of its generation. `lean` (``certkv serve``'s scheduler)
        decodes a lane format as a lane of the batch (:meth:`lanes`)."""
        lanes = lean and self.lanes()
        if self.press is None or not lane_format(self.kv_format, self.press):
            yield from ()
            return FormatDecode(self, enc, max_new, lanes=lanes)
        yield Reserve(prefill_slots(self.model, enc, max_new))
        t0 = time.perf_counter()
        cache, kept, _ = prefill_full(self.model, enc.context_ids, {"scored": self.press})
        lane = format_lane(self.kv_format, cache.layers, enc, max_new, self.stop_ids, None, kept["scored"])
        lane.stop_below = self.gate.recompute
        cache.layers.clear()
        seconds["prefill"] = time.perf_counter() - t0
        return FormatDecode(self, enc, max_new, lanes=lanes, lane=lane, kept=kept_count(kept["scored"], len(enc.context_ids)))

    def lanes(self) -> bool:
        """Whether a lean run decodes as a lane of ``certkv serve``'s batch: one of certkv's per-token
        formats, alone or beside a scorer press (:func:`~certkv.engine.format_lanes.lane_format`); a
        recompute threshold stops the lane itself, at the token the token-by-token decode stops at."""
        return lane_format(self.kv_format, self.press)


class FormatDecode(AnswerSource):
    """A request decoded in the path's format: as a lane (`lane`: one built from a scored prefill;
    with `lanes` a lane of the scheduler's batch), or alone; stopped where a recompute part fires.
    Its full answer has a prefill of its own."""

    path: FormatPath

    def __init__(self, path: FormatPath, enc: EncodedRequest, max_new: int, lanes: bool, lane: Lane | None = None,
                 kept: int | None = None) -> None:
        super().__init__(path, enc, max_new)
        self.lanes, self.lane, self.kept = lanes, lane, kept

    def decode(self) -> Generator[Step, None, EvictedAnswer]:
        path, enc, max_new = self.path, self.enc, self.max_new
        if self.lane is None:
            yield Reserve(format_slots(path.model, path.kv_format, enc, max_new))
        if self.lane is not None:
            run = yield from self._built_lane_steps(self.lane)
        else:
            run = yield from (self._lane_steps() if self.lanes else self._solo_steps())
        n_ctx, n_q = len(enc.context_ids), len(enc.question_ids)
        answer = EvictedAnswer(run.token_ids, run.logprobs, run.prefill_kept / n_ctx, stopped_at=run.stopped_at)
        if run.stopped_at is None:
            tokens, stored = kv_cost(run.held, n_ctx, n_q), kv_cost(run.held_units, n_ctx, n_q)
            answer.kv_peak, answer.kv_time = tokens.peak, tokens.time
            answer.kv_peak_bytes, answer.kv_time_bytes = stored.peak, stored.time
        return answer

    def _built_lane_steps(self, lane: Lane) -> Generator[Step, None, DecodingRun]:
        """The lane a scored prefill built: batched by the scheduler (`lanes`), or decoded alone here;
        stopped at its first token under a recompute threshold (the tokens before it are the ones a
        token-by-token decode would have kept)."""
        path, enc, max_new = self.path, self.enc, self.max_new

        def solo() -> tuple[list[int], list[float] | None]:
            decode_lanes(path.model, [lane])
            return lane.answer, lane.logprobs

        job = Decode(lane.cache, list(enc.question_ids), lane.position, max_new, path.stop_ids,
                     solo=None if self.lanes else solo, lookup_ids=list(enc.context_ids), want_logprobs=True,
                     batchable=self.lanes, final=self.final, lane=lane if self.lanes else None)
        yield job
        return lane_run(lane, path.kv_format, head_dim(path.model), self.kept or 0)

    def _lane_steps(self) -> Generator[Step, None, DecodingRun]:
        """The context prefilled into the format's cache (stored as each layer computes it), taken
        over by a lane of the scheduler's batch (:func:`~certkv.engine.format_lanes.stored_lane`)."""
        path, enc, max_new = self.path, self.enc, self.max_new
        model = path.model
        cache = build_cache(path.kv_format, model.config)
        with torch.no_grad():
            model.model(input_ids=torch.as_tensor(enc.context_ids, device=model.device).view(1, -1), past_key_values=cache)
        lane = stored_lane(path.kv_format, cache, enc, max_new, path.stop_ids, layer_slot_bytes(model))
        lane.stop_below = path.gate.recompute
        job = Decode(lane.cache, list(enc.question_ids), lane.position, max_new, path.stop_ids, solo=None,
                     lookup_ids=lane.lookup_ids, want_logprobs=True, final=self.final, lane=lane)
        yield job
        return lane_run(lane, path.kv_format, head_dim(model), len(enc.context_ids))

    def _solo_steps(self) -> Generator[Step, None, DecodingRun]:
        """The decode alone (:func:`run_in_format`), one token a forward."""
        path, enc, max_new = self.path, self.enc, self.max_new
        return (yield from solo_run_steps(
            lambda tell: run_in_format(path.model, path.kv_format, enc, max_new, path.press, stop_below=path.gate.recompute,
                                       on_token=tell),
            enc, max_new, path.stop_ids, self.final))


__all__ = ["FormatDecode", "FormatPath", "format_slots"]
