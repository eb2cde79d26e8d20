"""The steps of one answer: what an answering path asks of whoever runs it.

An answer (an :class:`~certkv.runtime.gate_flow.AnsweringPath`'s behind its gate,
:func:`~certkv.runtime.gate_flow.gate_flow`; the full cache's
:func:`~certkv.runtime.full_path.full_answer_steps`) is written once, as a generator, and run two ways:

* in-process, one request at a time (:func:`run_alone`, what :class:`CertifiedRuntime.generate`
  does): every :class:`Reserve` is granted at once and every :class:`Decode` is decoded alone by
  its ``solo`` function, exactly as calibration decoded it;
* by ``certkv serve``'s scheduler (:mod:`certkv.serve.scheduler`): a :class:`Reserve` waits until
  its KV fits in the budget, and a :class:`Decode` joins the batch that decodes every in-flight
  request together (:mod:`certkv.engine.ragged_decode`).

The decisions (which cache answers, the gate's signals and verdicts) are made by the same code in
both; only who decodes, and when, differs. A path yields:

* ``Reserve(slots)`` before it allocates KV (a prefill): the token slots it will hold until its
  next step (see :mod:`certkv.engine.ragged_decode` for the unit);
* ``Decode(...)`` with a cache that holds only what this answer needs (with room for its question
  and answer), and resumes once ``ids`` (and ``logprobs``) are filled in;

and returns a :class:`PathAnswer`.

A ``Decode`` marked ``final`` decodes tokens that are the answer's as they come: no later gate can
replace them (a full-cache answer, an evicted answer behind no post-decode gate, the full cache
finishing an answer a recompute gate restarted). Whoever runs it may set its ``listener`` (a
:data:`TokenListener`), which is then called with the answer's tokens so far each time the decode
adds some: what ``certkv serve`` streams. A non-final decode (an evicted answer that a post-decode
gate may still escalate) is never streamed: its tokens may be thrown away.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from transformers import DynamicCache

    from certkv.engine.ragged_decode import Lane, LaneCache

#: Told, on the runner's thread, (the answer's tokens so far, the count of them a recompute gate kept
#: when it restarted the answer on the full cache, None before any restart) each time a final
#: :class:`Decode` adds tokens. Under greedy decoding the kept tokens stand: the restart prefills
#: them with the context and continues after them, so the list only ever grows.
TokenListener = Callable[[list[int], int | None], None]


@dataclass
class Reserve:
    """The path is about to allocate KV: it will hold at most `slots` token slots until its next step.

    `prefills`: whether that step runs a prefill (False: it only copies a kept compressed context,
    :mod:`certkv.runtime.prefix_cache`, which a scheduler may admit beside a prefill)."""

    slots: int
    prefills: bool = True


@dataclass
class Decode:
    """One greedy answer to decode over `cache`, which holds only this answer's entries.

    `cache` is a one-lane transformers cache or a :class:`~certkv.engine.ragged_decode.LaneCache`;
    `question_ids` are fed first at positions from `position`; `lookup_ids` seed prompt-lookup
    proposals (None: plain greedy, as kvpress's pipeline decodes). `solo` decodes it alone,
    as calibration did, returning (ids, per-token log p or None); a lean path (run by the
    scheduler only) gives none. ``batchable=False`` (certkv's probabilistic press: its Hájek
    attention correction is its own decode; an in-process decode over the full cache) makes the
    scheduler call `solo`, unbatched, between batched steps; `cache` is then None or left to the path.
    `final` (module docstring): its tokens are the answer's as decoded; `restarted_at` is set on the
    decode that finishes an answer a recompute gate restarted after its first `restarted_at`
    tokens (its `ids` include them); `listener` is the runner's (None: nobody listens), and a
    `solo` function that decodes token by token tells it through :meth:`tell`. `lane`: the
    :class:`~certkv.engine.ragged_decode.Lane` over `cache` when the path built it (a decoding-time
    press's, with the books that compress it as it decodes and give its slots back at each event):
    the scheduler batches it as it is (prompt lookup dropped where the server runs without), and
    the path reads what it held from it.
    """

    cache: DynamicCache | LaneCache | None
    question_ids: list[int]
    position: int
    max_new_tokens: int
    stop_ids: set[int]
    solo: Callable[[], tuple[list[int], list[float] | None]] | None
    lookup_ids: list[int] | None = None
    want_logprobs: bool = False
    batchable: bool = True
    final: bool = False
    restarted_at: int | None = None
    listener: TokenListener | None = None
    lane: Lane | None = None
    ids: list[int] | None = None
    logprobs: list[float] | None = None

    _told: int = field(default=-1, init=False, repr=False)
    """How many tokens the listener was last told."""

    def tell(self, ids: list[int]) -> None:
        """Tell the listener, if any, that the answer so far is `ids` (copied: the caller may grow
        it); an answer no longer than the last one told is not told again."""
        if self.listener is not None and len(ids) > self._told:
            self._told = len(ids)
            self.listener(list(ids), self.restarted_at)


Step = Reserve | Decode


@dataclass
class PathAnswer:
    """What an answering path returns: the answer's ids, which cache gave them and why.

    `reason` is None when the press's cache answered (``mode`` "evicted"); `kept` the realised
    kept share of that cache; `signals` the gate signals measured on the way (keys of
    :data:`certkv.core.signals.SIGNALS`); `seconds` per phase (``prefill``, ``probe``, ``decode``,
    ``escalation``, ``recompute``); `recomputed_at` the decoding step a recompute gate restarted
    the answer on the full cache at; `kv_peak` / `kv_time` a decoding-time press's measured KV
    (:mod:`certkv.core.kv_cost`; None where the path did not measure it), `kv_peak_bytes` /
    `kv_time_bytes` a KV format's, in bytes over a 16-bit full cache's; `prefix` "hit" when the
    answer was decoded from a kept compressed context, "miss" when the path kept its own for later
    questions (:mod:`certkv.runtime.prefix_cache`), None when no prefix cache was asked."""

    ids: list[int]
    reason: str | None
    signals: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    kept: float | None = None
    escalated: bool = False
    recomputed_at: int | None = None
    kv_peak: float | None = None
    kv_time: float | None = None
    kv_peak_bytes: float | None = None
    kv_time_bytes: float | None = None
    prefix: str | None = None

    @property
    def mode(self) -> str:
        return "evicted" if self.reason is None else "full"


T = TypeVar("T")

#: An answering path's generator: yields steps, returns its answer.
Steps = Generator[Step, None, PathAnswer]


def run_alone(steps: Generator[Step, None, T]) -> T:
    """Run an answering path in-process: reservations granted at once, each decode alone."""
    try:
        step = next(steps)
        while True:
            if isinstance(step, Decode):
                if step.solo is None:
                    raise ValueError("a lean path's decode is batched by certkv serve's scheduler; run it there")
                step.ids, step.logprobs = step.solo()
            step = steps.send(None)
    except StopIteration as stop:
        return stop.value
