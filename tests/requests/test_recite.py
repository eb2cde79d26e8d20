"""The long-output task `recite`: a dense list of records recited in order, 32-128 tokens."""

from __future__ import annotations

import random

import pytest

from certkv.contract.schema import RequestsSpec
from certkv.errors import CertkvError
from certkv.requests.builtin_tasks import CONTEXT_RANGES, LONG_TASKS, RECITE_RECORDS, TASKS, recite
from certkv.requests.request_set import default_context_length, generate_requests
from certkv.requests.vocabulary import count_tokens


def test_recite_is_drawn_from_its_seed_and_index():
    a = generate_requests("recite", 6, seed=3)
    assert [r.model_dump() for r in a] == [r.model_dump() for r in generate_requests("recite", 9, seed=3)[:6]]
    assert {r.context for r in a}.isdisjoint(r.context for r in generate_requests("recite", 6, seed=4))
    assert all(r.task == "recite" and r.id.startswith("recite-s3-") for r in a)


@pytest.mark.parametrize("length", [64, 128, 256])
def test_the_answer_is_the_record_list_after_the_prefix_verbatim(length):
    """Context = filler then records; the question's prefix restates the first record up to its value
    and the answer is the rest of the list, 42-126 tokens (4-11 records of 12 tokens, the first 6)."""
    rng = random.Random(f"test/recite/{length}")
    for _ in range(20):
        sample = recite(rng, length)
        (question, answer), = sample.qa
        records = [u for u in sample.units if u.startswith("The magic number for ")]
        assert sample.units[-len(records):] == records, "the records stand together at the end"
        assert RECITE_RECORDS[0] <= len(records) <= RECITE_RECORDS[1]
        assert question.endswith(records[0].rsplit(" ", 1)[0]) and "Answer: The magic number for " in question
        assert question.rsplit("Answer: ", 1)[1] + " " + answer == " ".join(records)
        tokens = count_tokens(" " + answer)
        assert tokens == 6 + 12 * (len(records) - 1) and 32 <= tokens <= 128
        assert count_tokens(sample.context) <= length
        assert not any(u.startswith("The ") for u in sample.units[: -len(records)]), "no filler opens like a record"


def test_answers_span_32_to_128_embedded_tokens():
    from transformers import AutoTokenizer

    from certkv.model.loading import EMBEDDED_DIR

    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    counts = [len(tok.encode(" " + r.answers[0], add_special_tokens=False)) for r in generate_requests("recite", 200, seed=1)]
    assert min(counts) == 42 and max(counts) == 126, (min(counts), max(counts))


def test_recite_lengths_default_and_range():
    assert set(LONG_TASKS) == {"recite"} and not set(LONG_TASKS) & set(TASKS)
    assert CONTEXT_RANGES["recite"] == (64, 256)
    assert default_context_length("recite") == "128-256"
    assert all(count_tokens(r.context) <= 256 for r in generate_requests("recite", 30, seed=2))
    with pytest.raises(CertkvError, match=r"within 64-256 tokens for task recite"):
        generate_requests("recite", 1, 0, 512)
    assert RequestsSpec(source="builtin:recite").context_length is None  # its default is accepted
    with pytest.raises(ValueError, match="64-256 tokens for task recite"):
        RequestsSpec(source="builtin:recite", context_length="256-512")
