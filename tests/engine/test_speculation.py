"""The one speculative acceptance and proposer (certkv/engine/speculation.py) that both speculative
decoders call: a toy greedy "model" (a function of the prefix) decoded speculatively, with any
proposals, gives its one-token-a-forward answer and the log p of exactly its tokens."""

from __future__ import annotations

import random

import pytest

from certkv.engine.prompt_lookup import PromptLookup
from certkv.engine.speculation import Proposer, accept, following
from certkv.model.stopping import is_finished

STOP = 0


def model(prefix: list[int]) -> int:
    """A deterministic greedy choice after `prefix`: repetitive enough for prompt lookup to hit."""
    return (prefix[-1] * 3 + len(prefix) // 4) % 7 if prefix else 1


def logp(prefix: list[int]) -> float:
    return -0.01 * (len(prefix) + sum(prefix))


def plain(max_new: int, stops: set[int]) -> list[int]:
    answer: list[int] = []
    while not answer or not is_finished(answer, max_new, stops):
        answer.append(model(answer))
    return answer


def speculative(max_new: int, stops: set[int], propose) -> tuple[list[int], list[float], int]:
    """Decode as the decoders do: feed the pending token and a proposal, take what `accept` lets stand."""
    answer, logprobs, forwards = [model([])], [logp([])], 1
    while not is_finished(answer, max_new, stops):
        proposal = propose(answer, max_new - len(answer))
        fed = [answer[-1], *proposal]
        # the choice after each fed position (the prefix up to it), padded as a batch lane would be
        prefixes = [answer + proposal[:i] for i in range(len(fed))]
        choices = [model(p) for p in prefixes] + [99, 99]
        scored = [logp(p) for p in prefixes] + [9.0, 9.0]
        taken = accept(answer, choices, proposal, max_new, stops, logprobs, scored)
        assert 1 <= taken <= len(fed)
        forwards += 1
    return answer, logprobs, forwards


@pytest.mark.parametrize("stops", [set(), {STOP}])
def test_any_proposals_give_the_plain_greedy_answer_and_its_log_p(stops):
    rng = random.Random(5)
    for max_new in (1, 2, 7, 40):
        want = plain(max_new, stops)
        want_logp = [logp(want[:i]) for i in range(len(want))]
        lookup = Proposer(PromptLookup([1, 3, 2, 6, 4, 5, 1, 3, 2]))
        proposers = {
            "none": lambda a, b: [],
            "random": lambda a, b: [rng.randrange(7) for _ in range(rng.randint(0, max(0, b)))],
            "the answer": lambda a, b, want=want: want[len(a) : len(a) + b],
            "lookup": lookup.propose,
        }
        for propose in proposers.values():
            got, got_logp, _ = speculative(max_new, stops, propose)
            assert got == want and got_logp == want_logp
        # fed the answer itself, the forwards are one for the question and one for the rest
        assert speculative(max_new, stops, proposers["the answer"])[2] <= 2


def test_acceptance_stops_at_the_first_disagreement_a_stop_token_or_the_length():
    answer = [4]
    assert accept(answer, [5, 6, 1, 8], [5, 6, 2], 100, set()) == 3 and answer == [4, 5, 6, 1]
    answer = [4]
    assert accept(answer, [5, 6, 2, 8], [5, 6, 2], 100, set()) == 4 and answer == [4, 5, 6, 2, 8]
    answer = [4]
    assert accept(answer, [5, STOP, 2], [5, STOP], 100, {STOP}) == 2 and answer == [4, 5, STOP]
    answer = [4]
    assert accept(answer, [5, 6, 2], [5, 6], 2, set()) == 1 and answer == [4, 5]
    first: list[int] = []  # a stop token as the first token does not end the answer
    assert accept(first, [STOP, 3, 9], [STOP, 4], 100, {STOP}) == 2 and first == [STOP, 3]
    with pytest.raises(ValueError, match="go together"):
        accept([4], [5], [], 100, set(), logprobs=[])


def test_a_proposer_follows_its_draft_then_looks_up_and_learns_only_from_lookups():
    proposer = Proposer(PromptLookup(list(range(10, 60))))
    draft = [10, 11, 12, 13]
    assert following(draft, [10, 11]) is draft and following(draft, [10, 99]) is None
    assert proposer.propose([10, 11], 5, draft) == [12, 13] and proposer.looked_up == 0
    proposer.accepted(2)
    assert proposer.length.size == 16, "a draft's proposal teaches the lookup nothing"
    assert proposer.propose([10, 11, 12, 13], 40, draft) == list(range(14, 30)) and proposer.looked_up == 16
    proposer.accepted(16)
    assert proposer.length.size == 32
    assert proposer.propose([10, 11], 0, draft) == [] and proposer.looked_up == 0
    assert Proposer(None).propose([10, 11], 5) == []
