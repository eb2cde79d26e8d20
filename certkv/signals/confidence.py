"""Confidence of a greedy answer, from its per-token log-probabilities.

The lowest probability the model gave any token of its own greedy answer predicts that an evicted
cache broke the request far better than cache-side signals do (issue 16's measurement). Every
decode path returns each answer's per-token log p (``logit_tok − logsumexp(logits)`` in float64,
the stop token included); this module turns them into the two recorded signals. Plain python:
calibration, certification and the runtime read the same definition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def answer_confidence(logprobs: Sequence[float]) -> tuple[float, float]:
    """(confidence_min, logprob_mean) of one answer.

    `logprobs`: the log-probability of each generated token (at least one). ``confidence_min`` is
    ``exp(min log p)``, the lowest token probability; ``logprob_mean`` the mean log p.
    """
    values = [float(x) for x in logprobs]
    if not values:
        raise ValueError("an answer's confidence needs at least one token's log-probability")
    return math.exp(min(values)), math.fsum(values) / len(values)
