"""Prompt-lookup proposals for speculative greedy decoding: plain python, no torch.

:class:`certkv.engine.speculation.Proposer` proposes from here to every speculative decoder's lanes
once they leave their draft (or have none); retrieval answers are mostly copied from the context,
so a proposal is usually accepted whole. :class:`ProposalLength` sizes each lane's proposals by
what it accepted before.
Kept apart from the decoding itself so that it can be tested without the model stack.
"""

from __future__ import annotations

from dataclasses import dataclass


class PromptLookup:
    """Prompt-lookup proposals: what followed the latest earlier occurrence of the last n tokens.

    The history searched is the prompt (context and question) followed by the lane's own answer
    before its last token, so a degenerate repetition ("7 7 7") is proposed too, not only text
    copied from the context. The prompt's n-grams are indexed once per request; only the short
    answer part is scanned per call.
    """

    def __init__(self, prompt: list[int], max_ngram: int = 3) -> None:
        self.prompt = prompt
        self.max_ngram = max_ngram
        self.latest: dict[tuple[int, ...], int] = {}
        for n in range(1, max_ngram + 1):
            for start in range(len(prompt) - n):  # the match must have a continuation in the prompt
                self.latest[tuple(prompt[start : start + n])] = start

    def propose(self, tokens: list[int], budget: int) -> list[int]:
        """Up to `budget` tokens to try after `tokens` (the lane's answer so far); [] for none."""
        if budget <= 0 or not tokens:
            return []
        history = self.prompt + tokens[:-1]
        boundary = max(0, len(self.prompt) - self.max_ngram)
        for n in range(min(self.max_ngram, len(tokens)), 0, -1):
            suffix = tokens[-n:]
            # Occurrences reaching into the answer are the latest ones: scan that short tail first.
            for start in range(len(history) - n - 1, boundary - 1, -1):
                if history[start : start + n] == suffix:
                    return history[start + n : start + n + budget]
            # Else the prompt's latest occurrence (one at or past `boundary` was found by the scan).
            latest = self.latest.get(tuple(suffix))
            if latest is not None:
                return history[latest + n : latest + n + budget]
        return []


@dataclass
class ProposalLength:
    """How many tokens a lane's next prompt-lookup proposal may hold, following its acceptance.

    Every proposed token costs compute in the forward that verifies it, accepted or not (and, in a
    padded batch, a cache slot each later forward attends over). A lane copying its context has its
    proposals accepted whole; a lane writing its own text, or one that has left the draft and finds
    only one-token matches, has them rejected at once. So the length doubles after a proposal
    accepted whole and drops to one more than was accepted (at least `least`) after one rejected
    part-way. The proposal tokens change how many forwards an answer takes, never the answer.

    Examples
    --------
    >>> length = ProposalLength(size=8, least=4)
    >>> length.cap(100), length.cap(5)
    (8, 5)
    >>> length.update(proposed=8, accepted=8); length.size
    16
    >>> length.update(proposed=16, accepted=1); length.size
    4
    """

    size: int = 16
    least: int = 4

    def cap(self, budget: int) -> int:
        """The longest proposal to make now, within `budget` (the tokens the answer may still take)."""
        return max(0, min(budget, self.size))

    def update(self, proposed: int, accepted: int) -> None:
        """Record that `accepted` of a proposal's `proposed` tokens were confirmed (no-op for an empty one)."""
        if proposed <= 0:
            return
        self.size = 2 * self.size if accepted >= proposed else max(self.least, accepted + 1)


__all__ = ["PromptLookup", "ProposalLength"]
