"""What a generation's KV cache costs under a policy, relative to the full cache's.

A long generation's cache grows by one entry per decoded token, and a decoding-time press shrinks
it at every compression event, so one number cannot say what a policy saves. Two do:

* **peak**: the most entries the cache holds at any decoding step, over what the full cache holds
  at the same generation's last step. A KV budget must reserve the peak.
* **time** (KV-time): the entries held summed over the decoding steps, over the full cache's sum
  over the same steps; what the policy holds on average while the request occupies memory.

Both count token slots (one token's keys and values in every layer and KV head; per layer the mean
over layers), over the decoding steps only: step t is the forward that produces generated token t
(step 0 feeds the question), and after it the full cache holds ``context + question + t`` entries.
The prefill's transient (kvpress prunes layer by layer, so one layer holds the whole context while
it is prefilled) is not part of either. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KvCost:
    """A generation's KV, relative to the full cache's on the same steps.

    Attributes
    ----------
    peak : float
        Most entries held at any step over the full cache's at the last step.
    time : float
        Entries held summed over the steps over the full cache's sum.

    Examples
    --------
    >>> KvCost(peak=0.5, time=0.4).peak
    0.5
    """

    peak: float
    time: float


def full_held(context_length: int, question_length: int, steps: int) -> list[int]:
    """Entries the full cache holds after each of `steps` decoding steps.

    Examples
    --------
    >>> full_held(100, 5, 3)
    [105, 106, 107]
    """
    return [context_length + question_length + t for t in range(steps)]


def kv_cost(held: Sequence[float], context_length: int, question_length: int) -> KvCost:
    """Peak and KV-time of a generation whose cache held `held[t]` entries after step t.

    Parameters
    ----------
    held : sequence of float
        Per decoding step, the entries held after it (the mean over layers); one per generated token.
    context_length, question_length : int
        The prefill's tokens and the question's, fed at step 0.

    Examples
    --------
    >>> kv_cost([105, 106, 107], 100, 5)  # the full cache itself
    KvCost(peak=1.0, time=1.0)
    >>> cost = kv_cost([55, 56, 30], 100, 5)  # half the context kept, then a compression event
    >>> round(cost.peak, 3), round(cost.time, 3)
    (0.523, 0.443)
    """
    if not held:
        raise ValueError("a generation has at least one decoding step")
    full = full_held(context_length, question_length, len(held))
    return KvCost(peak=max(held) / full[-1], time=sum(held) / sum(full))


def prefill_press_held(kept: float, question_length: int, steps: int) -> list[float]:
    """Entries held per step when only the prefill was compressed (to `kept` entries): the cache
    then grows by one entry per step.

    Examples
    --------
    >>> prefill_press_held(50.0, 5, 3)
    [55.0, 56.0, 57.0]
    """
    return [kept + question_length + t for t in range(steps)]


__all__ = ["KvCost", "full_held", "kv_cost", "prefill_press_held"]
