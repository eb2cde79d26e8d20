"""Prompt-lookup proposals: the indexed search equals a plain scan of the whole history; a lane's proposal
length follows what it accepted."""

from __future__ import annotations

import random

from certkv.engine.prompt_lookup import PromptLookup


def reference(history: list[int], tokens: list[int], budget: int, max_ngram: int = 3) -> list[int]:
    if budget <= 0 or not tokens:
        return []
    for n in range(min(max_ngram, len(tokens)), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + budget]
    return []


def test_indexed_lookup_equals_brute_force_scan():
    rng = random.Random(0)
    for _ in range(400):
        prompt = [rng.randrange(6) for _ in range(rng.randint(0, 40))]
        answer = [rng.randrange(6) for _ in range(rng.randint(1, 8))]
        budget = rng.randint(0, 6)
        lookup = PromptLookup(prompt)
        assert lookup.propose(answer, budget) == reference(prompt + answer[:-1], answer, budget)


def test_proposes_the_value_that_followed_the_key():
    lookup = PromptLookup([1, 7, 4, 2, 9, 5, 1, 8, 3, 3, 6, 5])
    assert lookup.propose([8], 3) == [3, 3, 6]
    assert lookup.propose([5, 1], 2) == [8, 3]
    assert lookup.propose([42], 3) == []
    assert lookup.propose([9, 9], 2) == [5, 1], "falls back to the 1-gram when the 2-gram is unseen"


def test_a_proposal_grows_while_accepted_whole_and_shrinks_once_rejected():
    from certkv.engine.prompt_lookup import ProposalLength

    length = ProposalLength(size=4, least=2)
    sizes = []
    for accepted_whole in (True, True, True, False, False, True):
        proposed = length.cap(1000)
        sizes.append(proposed)
        length.update(proposed, proposed if accepted_whole else 0)
    assert sizes == [4, 8, 16, 32, 2, 2]
    assert length.cap(3) == 3  # never past the tokens the answer may still take
    length.update(proposed=3, accepted=2)  # rejected part-way: one more than it accepted
    assert length.size == 3
    length.update(proposed=0, accepted=0)  # nothing was proposed: nothing learnt
    assert length.size == 3


def test_a_lane_learns_only_from_lookup_proposals_it_was_fed():
    """A lane's proposal length learns from what it was fed: a feed with no proposal (no budget
    left) teaches it nothing, however long the proposal before it was."""
    from certkv.engine.ragged_decode import Lane, LaneCache

    prompt = list(range(100, 160))
    lane = Lane(LaneCache([]), question_ids=[9], position=0, max_new_tokens=40, stop_ids=set(), lookup_ids=prompt)
    lane.answer = [100, 101]
    tokens, _ = lane.feed()
    assert len(tokens) == 1 + 16  # the pending token and a proposal of the default length
    lane.accepted(16)
    assert lane._proposer.length.size == 32
    lane.max_new_tokens = len(lane.answer)  # no budget left: the pending token alone
    assert lane.feed()[0] == [101]
    lane.accepted(0)
    assert lane._proposer.length.size == 32
