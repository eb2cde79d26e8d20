"""One gate flow for every answering path: pre-decode gate, evicted decode, post-decode gate, restart.

Every answering path (the engine's single prefill, fresh or from a kept context; kvpress's
pipeline hooks; a decoding-time press) answers a request in the same order, and
:func:`gate_flow` is that order, written once:

1. the path starts the request (:meth:`AnsweringPath.start`): it reserves its KV, prefills what it
   prefills and records the signals its pre-decode gates read, and hands back an
   :class:`AnswerSource`;
2. a pre-decode gate that fires (:func:`~certkv.runtime.gating.pre_decode_reason`) is answered by
   the source's full answer (:meth:`AnswerSource.full_answer`), timed as ``decode``;
3. otherwise the press's answer is decoded (:meth:`AnswerSource.decode`, an :class:`EvictedAnswer`);
4. a decode a recompute gate stopped (:attr:`EvictedAnswer.stopped_at`) is finished on a fresh
   full cache from the tokens it kept (:func:`~certkv.runtime.full_path.restart_steps`), timed as
   ``recompute``;
5. otherwise a post-decode gate that fires (:func:`~certkv.runtime.gating.post_decode_reason`)
   escalates: the source's full answer replaces the evicted one, timed as ``escalation``.

What differs between paths is only how the press's answer is decoded and where the full answer
comes from (the full prefill the path still holds, or a prefill of its own): that is all an
:class:`AnswerSource` supplies. The steps (:mod:`certkv.runtime.steps`) are the same whoever runs
them, in-process (:meth:`AnsweringPath.answer`) or in ``certkv serve``'s scheduler.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from certkv.runtime.full_path import full_answer_steps, restart_steps
from certkv.runtime.gating import post_decode_reason, pre_decode_reason
from certkv.runtime.steps import PathAnswer, run_alone

if TYPE_CHECKING:
    from collections.abc import Generator

    from kvpress import BasePress
    from transformers import PreTrainedModel

    from certkv.core.spec import GateSettings
    from certkv.model.generation import EncodedRequest
    from certkv.runtime.steps import Step, Steps


@dataclass
class EvictedAnswer:
    """The press's answer as its path decoded it, with what the post-decode gates read.

    `logprobs` per token (None: not measured); `kept` the realised share of the context its cache
    kept; `certificate` its largest certificate (certkv's probabilistic presses; None otherwise);
    `stopped_at` the token a recompute gate stopped the decode at (None: it ran to its end), `ids`
    then being the tokens kept before it; `kv_peak` / `kv_time` the KV a decoding-time press held
    (:mod:`certkv.core.kv_cost`; None where the path does not measure it), `kv_peak_bytes` /
    `kv_time_bytes` the bytes a KV format held over a 16-bit full cache's (None: 16 bits)."""

    ids: list[int]
    logprobs: list[float] | None
    kept: float
    certificate: float | None = None
    stopped_at: int | None = None
    kv_peak: float | None = None
    kv_time: float | None = None
    kv_peak_bytes: float | None = None
    kv_time_bytes: float | None = None


class AnswerSource(ABC):
    """One started request on an answering path: how its press's answer is decoded and where its full
    answer comes from, the two things :func:`gate_flow` asks of a path.

    `prefix` tags the request's use of a prefix cache (:attr:`~certkv.runtime.steps.PathAnswer.prefix`)."""

    def __init__(self, path: AnsweringPath, enc: EncodedRequest, max_new: int, prefix: str | None = None) -> None:
        self.path, self.enc, self.max_new, self.prefix = path, enc, max_new, prefix

    @property
    def final(self) -> bool:
        """Whether the press's decode is final (:mod:`certkv.runtime.steps`): no post-decode gate
        can replace its tokens, so they may stream as decoded."""
        return not self.path.gate.post_decode

    @abstractmethod
    def decode(self) -> Generator[Step, None, EvictedAnswer]:
        """The press's answer, as steps."""

    def full_answer(self) -> Generator[Step, None, list[int]]:
        """The full cache's answer, as steps; by default with a prefill of its own (a path that holds
        its full prefill by then decodes from it instead)."""
        path = self.path
        return full_answer_steps(path.model, self.enc, self.max_new, path.stop_ids)


class AnsweringPath(ABC):
    """A press's answering path: it starts a request (:meth:`start`); :func:`gate_flow` does the rest.

    Subclasses are dataclasses holding at least `model`, `press`, `gate` and `stop_ids`."""

    model: PreTrainedModel
    press: BasePress
    gate: GateSettings
    stop_ids: set[int]

    def answer(self, enc: EncodedRequest, max_new: int, signals: dict[str, Any]) -> PathAnswer:
        """Answer `enc` in-process, as calibration did; `signals` (every signal name, None when not
        measured) is filled with what the gate read."""
        return run_alone(self.steps(enc, max_new, signals))

    def steps(self, enc: EncodedRequest, max_new: int, signals: dict[str, Any], lean: bool = False) -> Steps:
        """The answer as steps (:mod:`certkv.runtime.steps`): the path's start, then the gate flow.
        `lean` (``certkv serve``'s scheduler) frees each full cache as soon as the path no longer
        needs it and lets the scheduler batch what it can, with the same answers and decisions."""
        seconds: dict[str, float] = {}
        source = yield from self.start(enc, max_new, signals, seconds, lean)
        return (yield from gate_flow(source, signals, seconds))

    @abstractmethod
    def start(
        self, enc: EncodedRequest, max_new: int, signals: dict[str, Any], seconds: dict[str, float], lean: bool
    ) -> Generator[Step, None, AnswerSource]:
        """Start answering `enc`: reserve and prefill what the path prefills before its gate decides,
        put the pre-decode signals it measures into `signals` and the phases' times into `seconds`;
        the request's :class:`AnswerSource`."""


def gate_flow(source: AnswerSource, signals: dict[str, Any], seconds: dict[str, float]) -> Steps:
    """A started request's answer behind its path's gate (module docstring): the full answer when a
    pre-decode gate fires, else the press's answer, restarted on the full cache where a recompute
    gate stopped it, escalated to the full answer where a post-decode gate fires."""
    gate, tag = source.path.gate, source.prefix
    t = time.perf_counter()
    reason = pre_decode_reason(gate, signals)
    if reason is not None:
        ids = yield from source.full_answer()
        seconds["decode"] = time.perf_counter() - t
        return PathAnswer(ids, reason, signals, seconds, prefix=tag)
    evicted = yield from source.decode()
    seconds["decode"] = time.perf_counter() - t
    if evicted.stopped_at is not None:
        signals["confidence_min"], signals["logprob_mean"] = None, None  # the evicted answer was not finished
        t = time.perf_counter()
        path = source.path
        ids = yield from restart_steps(path.model, source.enc, evicted.ids, evicted.stopped_at, source.max_new, path.stop_ids)
        seconds["recompute"] = time.perf_counter() - t
        return PathAnswer(ids, "recompute", signals, seconds, kept=evicted.kept, escalated=True,
                          recomputed_at=evicted.stopped_at, prefix=tag)
    reason = post_decode_reason(gate, signals, evicted.logprobs, evicted.certificate)
    if reason is None:
        return PathAnswer(evicted.ids, None, signals, seconds, kept=evicted.kept, kv_peak=evicted.kv_peak,
                          kv_time=evicted.kv_time, kv_peak_bytes=evicted.kv_peak_bytes, kv_time_bytes=evicted.kv_time_bytes,
                          prefix=tag)
    t = time.perf_counter()
    ids = yield from source.full_answer()
    seconds["escalation"] = time.perf_counter() - t
    return PathAnswer(ids, reason, signals, seconds, escalated=True, prefix=tag)


__all__ = ["AnswerSource", "AnsweringPath", "EvictedAnswer", "gate_flow"]
