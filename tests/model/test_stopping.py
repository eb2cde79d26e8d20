"""The decoders' one stopping rule (certkv.model.stopping), on plain token ids: its edge cases.

Every decoder ends its answers with this rule, so its cases are pinned here directly; the engine,
runtime and scheduler tests check that the decoders' answers agree with kvpress's and each other.
"""

from __future__ import annotations

import doctest

import pytest

from certkv.model import stopping
from certkv.model.stopping import ends_on_stop, is_finished

STOP = 2


@pytest.mark.parametrize("max_new_tokens", [-1, 0, 1])
def test_at_most_one_token_ends_after_the_first(max_new_tokens):
    # a decoder always generates the first token; with no room for more it stops there
    assert is_finished([9], max_new_tokens, {STOP})
    assert is_finished([STOP], max_new_tokens, {STOP})


def test_a_first_stop_token_does_not_stop():
    assert not is_finished([STOP], 8, {STOP})
    assert not ends_on_stop([STOP], {STOP})


def test_a_later_stop_token_stops_and_stays():
    assert is_finished([5, STOP], 8, {STOP})
    assert is_finished([STOP, 5, STOP], 8, {STOP})
    assert ends_on_stop([5, STOP], {STOP})


def test_a_stop_token_before_the_last_does_not_count_again():
    assert not is_finished([5, STOP, 7], 8, {STOP})


def test_the_length_limit_is_inclusive():
    assert not is_finished([1, 3, 4], 4, {STOP})
    assert is_finished([1, 3, 4, 5], 4, {STOP})
    assert is_finished([1, 3, 4, 5, 6], 4, {STOP})  # never asked in practice: past the limit is finished


def test_no_stop_tokens_leaves_only_the_limit():
    assert not is_finished([STOP, STOP], 3, set())
    assert is_finished([STOP, STOP, STOP], 3, set())


def test_several_stop_tokens_each_stop():
    stops = frozenset({STOP, 0})
    assert is_finished([5, 0], 8, stops) and is_finished([5, STOP], 8, stops)
    assert not is_finished([5, 1], 8, stops)


def test_empty_answer_is_not_finished_with_room_left():
    assert not is_finished([], 1, {STOP})


def test_docstring_examples_run():
    result = doctest.testmod(stopping)
    assert result.failed == 0 and result.attempted == 5
