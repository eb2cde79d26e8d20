"""The room a kept-entries cache is built with for its answer: one rule for the engine and the runtime.

:func:`~certkv.engine.batched_decode.padded_cache` preallocates each layer with `reserve` free slots
after the kept entries, so that :func:`~certkv.engine.batched_decode.decode_candidates` writes every
fed token in place instead of re-concatenating the whole batch each forward. Calibration (the
engine) and the runtime (a question decoded alone over its kept entries, fresh or from a kept
context) must build that cache alike, so both take the room from :func:`decode_reserve`.
"""

from __future__ import annotations

#: Multiples of the answer's token budget a decode's cache leaves room for (:func:`decode_reserve`).
ANSWER_ROOM_FACTOR = 4


def decode_reserve(question_tokens: int, max_new_tokens: int) -> int:
    """Free slots per layer to build a kept-entries cache with: the question, then 4 × `max_new_tokens`.

    Why 4×: the answer's tokens are not all the decode writes. The verifying forward writes the
    question and the full answer's draft (up to `max_new_tokens`); every continuation round then
    writes a pending token and a prompt-lookup proposal, and a proposal's rejected tokens stay in
    the cache, masked out (:mod:`certkv.engine.batched_decode`), as do a batch's shorter proposals'
    padding slots; their count follows the proposal lengths
    (:class:`~certkv.engine.prompt_lookup.ProposalLength`, which shrink after a rejection).
    Four answers' worth covers the draft, the answer and those rejected proposals in the answers
    calibration decodes; a decode that writes more grows the layer by concatenation (correct, only
    slower), so the factor trades memory for speed and never changes an answer.

    Examples
    --------
    >>> decode_reserve(question_tokens=10, max_new_tokens=8)
    42
    """
    return question_tokens + ANSWER_ROOM_FACTOR * max_new_tokens


__all__ = ["ANSWER_ROOM_FACTOR", "decode_reserve"]
