"""Built-in long-context retrieval tasks in the spirit of RULER.

Every task writes a context of about `context_length` embedded-tokenizer tokens (never more) and
questions whose answers appear in that context. As in RULER, each question ends with an answer
prefix that restates the asked record up to its value ("Answer: The magic number for apple is"),
so the answer is what followed the same words in the context. Generation is deterministic: a request depends
only on (task, seed, index, context_length). The texts use only the closed vocabulary of
:mod:`certkv.requests.vocabulary`, so the embedded model can read every word; any other tokenizer reads them
as plain English.

Tasks:
- ``single_needle``: one record hidden in filler sentences.
- ``multi_key``: many records with distinct keys among filler; the question names one key.
- ``multi_value``: like multi_key, but the asked key has two records; answer both values in order.
- ``variable_tracking``: chains of assignments ``VAR b = a.``; ask the value at the end of a chain.
- ``dilution``: the asked code is split in two parts stored in separate records.

One multi-question task, in ``MULTI_QUESTION_TASKS``:
- ``multi_question``: a multi_key haystack asked up to 8 of its keys, one request per question,
  all sharing the context (contracts over it set ``requests.group_by: context``);
  ``ruler_multi_question`` is the same in natural English for real models (8 needles).

One long-output task, in ``LONG_TASKS``:
- ``recite``: a dense list of 4-11 records after some filler; the question asks for every magic
  number, its answer prefix restates the first record up to its value, and the answer is the rest
  of the list verbatim, 42-126 embedded-tokenizer tokens (``RECITE_RECORDS`` sets the count).

:mod:`certkv.requests.natural_tasks` adds the RULER families in natural English for real models
(``ruler_*`` and ``reading_comprehension``, 512-8192 model tokens). ``TASKS`` keeps only the tasks
above, the embedded model's retrieval tasks (its training, its accuracy table and the ``all`` and
``demo`` mixes are about them); ``ALL_TASKS`` holds every task, and ``CONTEXT_RANGES`` says which
lengths each allows (``recite`` 64-256 tokens, so that context and answer stay short).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from certkv.requests import long_tasks, natural_tasks
from certkv.requests.long_tasks import NATURAL_LONG_TASKS
from certkv.requests.natural_tasks import NATURAL_TASKS, NaturalSample
from certkv.requests.vocabulary import KEY_WORDS, count_tokens

FILLER = [
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
]

MIN_CONTEXT = 64
MAX_CONTEXT = 2048


@dataclass
class Sample:
    """One context and every question it can answer (the generator picks one per request)."""

    units: list[str]
    qa: list[tuple[str, str]] = field(default_factory=list)

    @property
    def context(self) -> str:
        return " ".join(self.units)


def _value(rng: random.Random, digits: int = 4) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _record(key: str, value: str) -> str:
    return f"The magic number for {key} is {value}."


def _question(key: str) -> str:
    return f"Question: What is the magic number for {key}? Answer: The magic number for {key} is"


def _fill(rng: random.Random, units: list[str], budget: int) -> list[str]:
    """Scatter `units` (in order) among filler sentences so the total stays within `budget`."""
    used = sum(count_tokens(u) for u in units)
    if used > budget:
        raise ValueError("records do not fit in the context length")
    filler = []
    while True:
        sentence = rng.choice(FILLER)
        cost = count_tokens(sentence)
        if used + cost > budget:
            break
        filler.append(sentence)
        used += cost
    # Interleave: choose insertion slots for the units among the filler, keeping their order.
    slots = sorted(rng.randint(0, len(filler)) for _ in units)
    out: list[str] = []
    j = 0
    for i in range(len(filler) + 1):
        while j < len(units) and slots[j] == i:
            out.append(units[j])
            j += 1
        if i < len(filler):
            out.append(filler[i])
    return out


def _n_records(context_length: int, tokens_per_record: int, share: float, cap: int) -> int:
    return max(1, min(cap, int(context_length * share) // tokens_per_record))


def single_needle(rng: random.Random, context_length: int) -> Sample:
    key, value = rng.choice(KEY_WORDS), _value(rng)
    return Sample(_fill(rng, [_record(key, value)], context_length), [(_question(key), value)])


def multi_key(rng: random.Random, context_length: int, share: float = 0.6, lookalike: bool = False) -> Sample:
    """`share` of the context goes to records, the rest to filler (training uses denser contexts).

    With `lookalike`, the values look alike: all start with one of two 2-digit prefixes, or all are
    anagrams of the same four digits, or all share their first and third digits (training uses
    them: a model that copies each digit from whatever followed the same digit at the same place
    in another value, ignoring the asked key, then fails on most answers instead of a few)."""
    n = _n_records(context_length, 12, share, cap=80)
    keys = rng.sample(KEY_WORDS, n)
    kind = rng.randrange(3) if lookalike else None
    if kind == 0:
        prefixes = [_value(rng, 2) for _ in range(2)]
        values = [rng.choice(prefixes) + f"{rng.randrange(100):02d}" for _ in keys]
    elif kind == 1:
        digits = rng.sample("123456789", 4)
        values = ["".join(rng.sample(digits, 4)) for _ in keys]
    elif kind == 2:
        first, third = rng.choice("123456789"), rng.choice("0123456789")
        values = [f"{first}{rng.randrange(10)}{third}{rng.randrange(10)}" for _ in keys]
    else:
        values = [_value(rng) for _ in keys]
    units = [_record(k, v) for k, v in zip(keys, values)]
    return Sample(_fill(rng, units, context_length), [(_question(k), v) for k, v in zip(keys, values)])


def multi_value(rng: random.Random, context_length: int) -> Sample:
    n = max(2, _n_records(context_length, 12, 0.6, cap=80))
    keys = rng.sample(KEY_WORDS, n - 1)
    asked = keys[0]
    pairs = [(k, _value(rng)) for k in keys] + [(asked, _value(rng))]
    rng.shuffle(pairs)
    answer = " ".join(v for k, v in pairs if k == asked)
    question = f"Question: What are all the magic numbers for {asked}? Answer: The magic numbers for {asked} are"
    return Sample(_fill(rng, [_record(k, v) for k, v in pairs], context_length), [(question, answer)])


def variable_tracking(rng: random.Random, context_length: int, hops: int = 2) -> Sample:
    per_chain = count_tokens("VAR apple = 1234.") + hops * count_tokens("VAR apple = stone.")
    n_chains = _n_records(context_length, per_chain, 0.6, cap=len(KEY_WORDS) // (hops + 1))
    names = rng.sample(KEY_WORDS, n_chains * (hops + 1))
    chains = [names[i * (hops + 1) : (i + 1) * (hops + 1)] for i in range(n_chains)]
    statements: list[list[str]] = []
    qa = []
    for chain in chains:
        value = _value(rng)
        lines = [f"VAR {chain[0]} = {value}."]
        lines += [f"VAR {b} = {a}." for a, b in zip(chain, chain[1:])]
        statements.append(lines)
        qa.append((f"Question: What is the value of {chain[-1]}? Answer: The value of {chain[-1]} is", value))
    # Interleave chains while keeping each chain's statements in order.
    order = [i for i, lines in enumerate(statements) for _ in lines]
    rng.shuffle(order)
    cursors = [0] * len(statements)
    units = []
    for i in order:
        units.append(statements[i][cursors[i]])
        cursors[i] += 1
    return Sample(_fill(rng, units, context_length), qa)


def dilution(rng: random.Random, context_length: int) -> Sample:
    per_key = 2 * count_tokens("The first part of the code for apple is 12.")
    n = _n_records(context_length, per_key, 0.6, cap=60)
    keys = rng.sample(KEY_WORDS, n)
    units, qa = [], []
    for key in keys:
        first, second = _value(rng, 2), _value(rng, 2)
        units.append(f"The first part of the code for {key} is {first}.")
        units.append(f"The second part of the code for {key} is {second}.")
        qa.append((f"Question: What is the code for {key}? Answer: The code for {key} is", first + second))
    rng.shuffle(units)
    return Sample(_fill(rng, units, context_length), qa)


#: Records in a recite context: 4 records make a 42-token answer, 11 a 126-token one.
RECITE_RECORDS = (4, 11)
RECITE_CONTEXT = (64, 256)
#: The recite filler: none starts with "The", so in a recite context "The" always opens a record.
RECITE_FILLER = [sentence for sentence in FILLER if not sentence.startswith("The ")]
RECITE_QUESTION = "Question: What are all the magic numbers?"


def recite(rng: random.Random, context_length: int) -> Sample:
    """Filler, then a dense list of records; the answer recites the list after the first value's key.

    The records stand together at the end of the context, with no filler between them, so the
    answer is one contiguous span of the context, the kind of copy a 2-layer model's induction
    heads make. Like the other tasks, the question's answer prefix restates the first record up
    to its value ("Answer: The magic number for apple is"), so the answer starts at its value and
    goes on with the rest of the list: 6 + 12 (n - 1) tokens for n records."""
    low, high = RECITE_RECORDS
    n = rng.randint(low, max(low, min(high, context_length // count_tokens(_record("apple", "1234")))))
    keys = rng.sample(KEY_WORDS, n)
    records = [_record(k, _value(rng)) for k in keys]
    budget = context_length - sum(count_tokens(r) for r in records)
    filler: list[str] = []
    while True:
        sentence = rng.choice(RECITE_FILLER)
        if count_tokens(sentence) > budget:
            break
        filler.append(sentence)
        budget -= count_tokens(sentence)
    prefix = f"The magic number for {keys[0]} is"
    answer = " ".join(records).removeprefix(prefix + " ")
    return Sample(filler + records, [(f"{RECITE_QUESTION} Answer: {prefix}", answer)])


TASKS: dict[str, Callable[[random.Random, int], Sample]] = {
    "single_needle": single_needle,
    "multi_key": multi_key,
    "multi_value": multi_value,
    "variable_tracking": variable_tracking,
    "dilution": dilution,
}

#: Questions asked of one context by a multi-question task (fewer when it holds fewer records).
QUESTIONS_PER_CONTEXT = 8


def multi_question(rng: random.Random, context_length: int) -> Sample:
    """A multi_key haystack asked up to :data:`QUESTIONS_PER_CONTEXT` of its keys, one request
    each: the traffic of many questions on one document, where questions on one context fail
    together (:mod:`certkv.requests.context_groups`) and a compressed context can be reused.
    Half of the haystacks have look-alike values (:func:`multi_key`), as documents differ in how
    hard they are to compress: a value kept among look-alikes is easier to confuse with another."""
    return multi_key(rng, context_length, lookalike=rng.random() < 0.5)


def ruler_multi_question(rng: random.Random, context_length: int) -> NaturalSample:
    """RULER's NIAH multi-key in natural English (real models, 512-8192 tokens) with
    :data:`QUESTIONS_PER_CONTEXT` needles, each asked by a request of its own."""
    return natural_tasks.ruler_multi_key(rng, context_length, n_keys=QUESTIONS_PER_CONTEXT)


#: Tasks whose one draw gives several requests on the same context (generate_requests).
MULTI_QUESTION_TASKS: dict[str, Callable[[random.Random, int], Sample | NaturalSample]] = {
    "multi_question": multi_question,
    "ruler_multi_question": ruler_multi_question,
}
#: The multi-question tasks in natural English: their questions carry an answer prefix to split off.
NATURAL_MULTI_QUESTION_TASKS = ("ruler_multi_question",)

#: The embedded model's long-output tasks: answers of 32-128 tokens instead of a value.
LONG_TASKS: dict[str, Callable[[random.Random, int], Sample]] = {"recite": recite}

#: Every built-in task, embedded and natural; request generation looks tasks up here.
ALL_TASKS: dict[str, Callable[[random.Random, int], Sample | NaturalSample]] = {
    **TASKS, **MULTI_QUESTION_TASKS, **LONG_TASKS, **NATURAL_TASKS, **NATURAL_LONG_TASKS
}

#: The inclusive context lengths each task allows: the embedded tasks count embedded-tokenizer
#: tokens up to the embedded model's 2048 positions; the natural ones count model tokens
#: (:func:`certkv.requests.natural_tasks.count_model_tokens`) and need room for a few paragraphs.
CONTEXT_RANGES: dict[str, tuple[int, int]] = {
    **{name: (MIN_CONTEXT, MAX_CONTEXT) for name in (*TASKS, "multi_question")},
    **{name: (natural_tasks.MIN_CONTEXT, natural_tasks.MAX_CONTEXT) for name in (*NATURAL_TASKS, *NATURAL_MULTI_QUESTION_TASKS)},
    "recite": RECITE_CONTEXT,
    **{name: (long_tasks.LONG_MIN_CONTEXT, long_tasks.LONG_MAX_CONTEXT) for name in NATURAL_LONG_TASKS},
}

# Named mixtures. `demo` holds only the tasks the embedded model answers with full-KV exact match
# >= 0.90 (see the README's accuracy table), so that degradation comes from eviction, not from the
# model: single-needle and multi-key (multi-value, variable tracking and dilution are not learned).
MIXES: dict[str, dict[str, float]] = {
    "all": {name: 1.0 for name in TASKS},
    "demo": {"single_needle": 1.0, "multi_key": 1.0},
    # The natural-English tasks, for real models (512-8192 tokens): every RULER family and reading comprehension.
    "ruler": {name: 1.0 for name in NATURAL_TASKS},
}
