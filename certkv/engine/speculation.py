"""Greedy speculative decoding, written once: what a lane is fed after its pending token
(:class:`Proposer`) and what of it the model's greedy choices accept (:func:`accept`).

Both speculative decoders use it: the padded candidate batch
(:func:`certkv.engine.batched_decode.decode_candidates`, which verifies the full answer's draft in
its first forward and proposes by prompt lookup after) and the ragged lanes of calibration and
``certkv serve`` (:class:`certkv.engine.ragged_decode.RaggedBatch`, whose lanes propose the draft
while they follow it and prompt lookup after). A forward feeds a lane its *pending* token t (the
last of its answer, not yet in its cache) followed by a proposal p_0 … p_{P-1}; the logits after
each fed position give the model's greedy choices c_0 … c_P. c_0 is the lane's next token whatever
was proposed; c_{i+1} is its token after that only if p_i = c_i. So the answer takes c_0 … c_k,
k the first i with i = P, c_i ≠ p_i or the answer finished
(:func:`certkv.model.stopping.is_finished`), and the fed tokens t, p_0 … p_{k-1} stay in the
cache. Proposals only save forwards: every accepted token is the model's own greedy choice, so the
answer is the one-token-a-forward decode's (up to the float rounding of a chunked forward, which
the exactness tests compare against kvpress's pipeline and the store).

Torch-free: tokens and log p are plain python lists.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from certkv.engine.prompt_lookup import PromptLookup, ProposalLength
from certkv.model.stopping import is_finished


def accept(
    answer: list[int],
    choices: Sequence[int],
    proposal: Sequence[int],
    max_new_tokens: int,
    stop_ids: Container[int],
    logprobs: list[float] | None = None,
    choice_logprobs: Sequence[float] | None = None,
) -> int:
    """Append to `answer` the greedy `choices` of one forward that its `proposal` lets stand.

    Parameters
    ----------
    answer : list[int]
        The lane's answer so far (its last token the pending one fed first); extended in place.
    choices : Sequence[int], shape (1 + P,) or longer
        The model's argmax after each fed position: the pending token's, then each proposal
        token's. Entries past 1 + P (a padded batch lane's padding) are never read.
    proposal : Sequence[int], shape (P,)
        The tokens fed after the pending one (P = 0: plain greedy, one token).
    max_new_tokens, stop_ids
        The decoders' shared stopping rule (:func:`~certkv.model.stopping.is_finished`): no choice
        is taken once the answer is finished.
    logprobs : list[float], optional
        The log p of the answer's tokens so far; extended in place with `choice_logprobs`'
        entries of the accepted choices (both or neither).
    choice_logprobs : Sequence[float], shape like `choices`, optional
        The log p of each choice (:func:`certkv.model.generation.chosen_logprobs`).

    Returns
    -------
    int
        k + 1 in 1 … 1 + P: the choices appended, which is also how many fed tokens stay in the
        lane's cache (the pending one and the k proposal tokens the choices confirmed); the
        confirmed proposal tokens are k.

    Examples
    --------
    >>> answer = [7]
    >>> accept(answer, [3, 4, 9, 1], [3, 4, 5], max_new_tokens=10, stop_ids=set()), answer
    (3, [7, 3, 4, 9])
    >>> accept(answer, [2, 6], [2], max_new_tokens=10, stop_ids={2}), answer  # ends after a stop token
    (1, [7, 3, 4, 9, 2])
    """
    if (logprobs is None) != (choice_logprobs is None):
        raise ValueError("logprobs and choice_logprobs go together: the accepted choices' log p are moved from one to the other")
    taken = 0
    for i, token in enumerate(choices):
        answer.append(token)
        taken = i + 1
        if is_finished(answer, max_new_tokens, stop_ids) or i >= len(proposal) or token != proposal[i]:
            break
    if logprobs is not None and choice_logprobs is not None:
        logprobs.extend(choice_logprobs[:taken])
    return taken


def following(draft: list[int] | None, answer: list[int]) -> list[int] | None:
    """`draft` while `answer` is its beginning (it proposes what follows), else None.

    >>> following([5, 6, 7], [5, 6]), following([5, 6, 7], [5, 8]), following(None, [])
    ([5, 6, 7], None, None)
    """
    return draft if draft is not None and draft[: len(answer)] == answer else None


@dataclass
class Proposer:
    """One lane's proposals: a draft's next tokens while the answer follows it, else prompt lookup's
    (`lookup`; None: none, plain greedy), as long as the lane's acceptance of earlier lookup
    proposals warrants (`length`, :class:`~certkv.engine.prompt_lookup.ProposalLength`).

    Examples
    --------
    >>> proposer = Proposer(PromptLookup([1, 2, 3, 4, 5]))
    >>> proposer.propose([2], budget=2), proposer.propose([9, 5], budget=3, draft=[9, 5, 8, 8])
    ([3, 4], [8, 8])
    >>> proposer.propose([2], budget=0)
    []
    """

    lookup: PromptLookup | None
    length: ProposalLength = field(default_factory=ProposalLength)
    looked_up: int = 0
    """The length of the last prompt-lookup proposal made (0 when the draft proposed, or none)."""

    def propose(self, answer: list[int], budget: int, draft: list[int] | None = None) -> list[int]:
        """Up to `budget` tokens to feed after `answer`'s pending (last) token: `draft`'s while
        `answer` follows it and it goes further, else prompt lookup's ([] for a plain lane)."""
        self.looked_up = 0
        if budget <= 0:
            return []
        n, followed = len(answer), following(draft, answer)
        if followed is not None and len(followed) > n:
            return followed[n : n + budget]
        proposal = self.lookup.propose(answer, self.length.cap(budget)) if self.lookup is not None else []
        self.looked_up = len(proposal)
        return proposal

    def accepted(self, confirmed: int) -> None:
        """Record that `confirmed` tokens of the last proposal were accepted (:func:`accept`'s count
        less one); only a prompt-lookup proposal sizes the next one."""
        self.length.update(self.looked_up, confirmed)


__all__ = ["Proposer", "accept", "following"]
