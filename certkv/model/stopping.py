"""When a greedy answer is complete: the one stopping rule of every certkv decoder.

certkv's answers must equal kvpress's pipeline token for token, and the answers a runtime serves
must equal the ones calibration measured, so every decoder (the full-cache and pipeline decode of
:func:`certkv.model.generation.greedy_decode`, the candidate batch of
:mod:`certkv.engine.batched_decode`, the serving batch of :mod:`certkv.engine.ragged_decode`, the
probabilistic press's :mod:`certkv.engine.probabilistic_decode`) asks this module whether an
answer is finished. The rule is kvpress's pipeline's:

* an answer holds at most ``max_new_tokens`` tokens;
* it ends right after a stop token, which stays part of it;
* except on the first generated token: a stop token there is kept and decoding goes on.

The first token is always generated, whatever ``max_new_tokens`` is (a decoder asks only once it
has one). Torch-free: answers are plain lists of token ids.
"""

from __future__ import annotations

from collections.abc import Container, Sequence


def ends_on_stop(answer: Sequence[int], stop_ids: Container[int]) -> bool:
    """Whether `answer` ends on a stop token that counts: one in `stop_ids` after the first.

    Examples
    --------
    >>> ends_on_stop([5, 2], stop_ids={2})
    True
    >>> ends_on_stop([2], stop_ids={2})  # the first token never stops an answer
    False
    """
    return len(answer) > 1 and answer[-1] in stop_ids


def is_finished(answer: Sequence[int], max_new_tokens: int, stop_ids: Container[int]) -> bool:
    """Whether decoding of `answer` (the token ids generated so far, stop token included) is over.

    Parameters
    ----------
    answer : sequence of int
        The generated token ids so far; a decoder asks once it holds at least one.
    max_new_tokens : int
        The most tokens an answer may hold (at most one is generated when it is 1 or less).
    stop_ids : container of int
        The model's stop tokens (:func:`certkv.model.generation.stop_token_ids`).

    Examples
    --------
    >>> is_finished([7, 8], max_new_tokens=2, stop_ids=set())
    True
    >>> is_finished([2], max_new_tokens=8, stop_ids={2})  # a first stop token: decoding goes on
    False
    >>> is_finished([2, 9, 2], max_new_tokens=8, stop_ids={2})
    True
    """
    return len(answer) >= max_new_tokens or ends_on_stop(answer, stop_ids)


__all__ = ["ends_on_stop", "is_finished"]
