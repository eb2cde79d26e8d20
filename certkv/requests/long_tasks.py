"""Built-in long-output tasks in natural English, for real chat models.

The RULER tasks (:mod:`certkv.requests.natural_tasks`) ask for a value of a few tokens. Decoding-time
eviction only matters when the answer is long, so these tasks ask for 100-250 tokens from a context
of a few hundred:

- ``recite_steps``: a recipe of 10 to 12 numbered steps sits at a random depth of the essay of
  :mod:`certkv.requests.natural_tasks`; the model writes out every step, in order. The reference is
  the numbered list as the context gives it (a task utility such as ``rouge_l`` scores it).
- ``recite_diary``: a diary of 4 to 6 days, one line a day (an event and a sentence of colour), sits
  at a random depth of the essay; the model writes out every entry, in order, as written: a copy
  of prose where ``recite_steps`` copies a numbered list. The reference is the entries.
- ``summarise_story``: a short story of a person's week, one event a day with a sentence of colour
  after each; the model summarises it. The reference is the events' own sentences, in order
  (``rouge_l`` against it rewards the events kept and their order, not the wording).

Measured with the full cache (SmolLM2-135M-Instruct, ``certkv.model.generation.full_kv_answer``, one
thread, seed 777, context length 640-960; the recitations' real prompts hold 323-588 tokens):

- ``recite_steps`` (12 requests): ROUGE-L against the recipe 0.80 on average (median 0.87) over 192
  new tokens, 0.77 (median 0.86) over the first 128; 11 of 12 at 0.5 or more. The misses: one
  output that counted "1. 2. 3. ..." instead of reciting, and outputs that go on past the last step
  into the essay (a long budget's cost, which 128 tokens mostly cuts off).
- ``recite_diary`` (12 requests): ROUGE-L 0.75 on average (0.55-0.92) over 128 new tokens, whose end
  cuts off the longer diaries (115-186 tokens); 12 of 12 at 0.5 or more.
- ``summarise_story`` (3 requests, prompts of about 240 tokens): ROUGE-L 0.23 and 0.24 over 192 new
  tokens (one summary looped on a sentence, the other invented events and stopped at 66 tokens) and
  0.68 on a third over 128. A 135M model does not summarise reliably; the task stays for larger
  models and label-free utilities.

So ``contracts/smollm2_long.yaml`` uses the two recitations (about 15-20 s a 128-192 token answer on
one thread of a busy 2-core machine). Requests depend only on (seed, index, task, length), as every
built-in task's do. The context length counts
:func:`certkv.requests.natural_tasks.count_model_tokens` (an overestimate; these pools' ingredients
and names are priced by their letters, so SmolLM2's real count runs 13-26% below) and keeps
:data:`LONG_RESERVED_TOKENS` free for the chat template and a long answer.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from certkv.requests.natural_tasks import (
    FIRST_NAMES,
    SURNAME_PARTS,
    TOWN_PARTS,
    NaturalSample,
    _essay,
    _invented,
    _join,
    count_model_tokens,
)

#: The shortest and longest context lengths these tasks allow (counted tokens, answer included).
LONG_MIN_CONTEXT = 640
LONG_MAX_CONTEXT = 4096

#: Counted tokens kept free of the prompt: a chat template (about 30 tokens) and a decoded answer of
#: up to 200 tokens.
LONG_RESERVED_TOKENS = 230

# --------------------------------------------------------------------------------------------------
# recite_steps: a recipe's steps, in the order a kitchen would take them (stages), each stage's
# steps drawn and filled per request, so neither the order nor the wording can be guessed.

DISHES = """
vegetable soup; potato pie; apple cake; bean stew; onion tart; pumpkin bread; fish pie;
mushroom risotto; carrot cake; lentil curry; cheese scones; plum crumble; leek soup; rice pudding
""".replace("\n", " ").split(";")
VEGETABLES = "onion carrot leek potato parsnip celery pepper courgette mushroom cabbage turnip tomato".split()
SPICES = "nutmeg cinnamon paprika thyme rosemary cumin ginger oregano".split()
LIQUIDS = ["milk", "water", "stock", "cream", "apple juice"]
UTENSILS = ["heavy pan", "deep tray", "round tin", "clay dish", "wide pot", "glass bowl"]

#: Stages of a recipe; each stage's templates are steps that may come in any order within it.
#: Slots: {V} a vegetable (a fresh one each time), {S} a spice, {L} a liquid, {U} a utensil,
#: {M} minutes, {D} degrees.
STAGES: tuple[tuple[str, ...], ...] = (
    (
        "Wash the {V} and cut it into small pieces.",
        "Peel the {V} and slice it thinly.",
        "Chop the {V} and put it in a {U}.",
        "Soak a cup of dried beans in cold water for {M} minutes.",
        "Heat the oven to {D} degrees.",
    ),
    (
        "Melt a spoonful of butter in a {U} over a low heat.",
        "Fry the {V} gently for {M} minutes, stirring often.",
        "Add the {V} and a pinch of {S}.",
        "Pour in a cup of {L} and bring it to a gentle boil.",
        "Stir in two spoonfuls of flour until the sauce thickens.",
        "Whisk two eggs with a little {L} in a large bowl.",
    ),
    (
        "Cover the {U} and let it simmer for {M} minutes.",
        "Season with salt, black pepper and a little {S}.",
        "Fold the {V} into the mixture with a wooden spoon.",
        "Spread the mixture evenly in a {U}.",
        "Bake for {M} minutes, until the top is golden.",
    ),
    (
        "Let it rest on the table for {M} minutes.",
        "Sprinkle grated cheese and a pinch of {S} over the top.",
        "Taste it and add more salt if needed.",
        "Serve it warm with fresh bread and a green salad.",
        "Keep what is left in a cool place for up to two days.",
    ),
)
#: How many steps each stage gives, at least and at most (10 to 12 in all).
STAGE_STEPS = ((2, 3), (3, 3), (3, 3), (2, 3))
RECIPE_HEADER = "Read the following text carefully. Somewhere in it is a recipe."


def _fill_step(rng: random.Random, template: str, vegetables: list[str]) -> str:
    """One step with its slots filled; each {V} takes the next vegetable of the recipe's own list."""
    text = template
    while "{V}" in text:
        text = text.replace("{V}", vegetables.pop(), 1)
    return text.format(
        S=rng.choice(SPICES), L=rng.choice(LIQUIDS), U=rng.choice(UTENSILS), M=rng.choice([5, 10, 15, 20, 25, 30, 40]),
        D=rng.choice([160, 180, 190, 200, 220]),
    )


def recipe_steps(rng: random.Random) -> list[str]:
    """10 to 12 steps, stage after stage, each stage's steps sampled and shuffled within it."""
    vegetables = rng.sample(VEGETABLES, len(VEGETABLES))
    steps: list[str] = []
    for templates, (low, high) in zip(STAGES, STAGE_STEPS):
        for template in rng.sample(templates, rng.randint(low, high)):
            steps.append(_fill_step(rng, template, vegetables))
    return steps


def _numbered(steps: list[str]) -> str:
    return "\n".join(f"{i}. {step}" for i, step in enumerate(steps, 1))


def recite_steps(rng: random.Random, context_length: int) -> NaturalSample:
    """A recipe (a titled numbered list) as one paragraph at a random depth of an essay; the question
    asks for every step, in order; the answer is the numbered list itself."""
    dish = rng.choice(DISHES).strip()
    steps = _numbered(recipe_steps(rng))
    recipe = f"How to make {dish}:\n{steps}"
    question = f"\n\nQuestion: Write out every step of the recipe for {dish}, in order, as a numbered list."
    budget = context_length - LONG_RESERVED_TOKENS - count_model_tokens(question)
    used = count_model_tokens(RECIPE_HEADER) + 2 + count_model_tokens(recipe) + 2
    if used > budget:
        raise ValueError(f"context length {context_length} leaves no room for the recipe")
    paragraphs = _essay(rng, budget - used)
    paragraphs.insert(rng.randint(0, len(paragraphs)), [recipe])
    return NaturalSample(_join(RECIPE_HEADER, paragraphs), [(question, steps)])


# --------------------------------------------------------------------------------------------------
# summarise_story: one event a day, each followed by a sentence of colour that a summary drops.

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
#: Slots: {N} the hero's first name, {F} a friend's first name, {T} a town, {O} an object.
EVENTS = (
    "{N} took the early train to {T} to visit an old friend called {F}.",
    "{N} repaired the roof of the barn after a storm had torn it open.",
    "{N} found an old {O} in the attic and carried it down to the kitchen.",
    "{N} and {F} walked along the river all the way to the mill at {T}.",
    "{N} sold three baskets of apples at the market in {T}.",
    "{N} lost the key to the garden gate and searched for it until dark.",
    "{N} painted the front door a bright shade of blue.",
    "{N} wrote a long letter to {F} about the {O}.",
    "{N} helped {F} move a heavy {O} across the square in {T}.",
    "{N} baked bread for the whole street and gave the last loaf to {F}.",
    "{N} caught a cold in the rain and stayed in bed with a book.",
    "{N} won second prize at the flower show in {T}.",
    "{N} mended the fence that the neighbour's goat had broken.",
    "{N} took the {O} to a shop in {T}, where the owner offered a good price for it.",
)
OBJECTS = ["clock", "sewing machine", "violin", "map", "lamp", "chest", "mirror", "telescope", "typewriter", "kettle"]
#: Sentences of colour: what a summary leaves out.
COLOUR = (
    "The sky was grey and a cold wind came down from the hills.",
    "It was the kind of day when nothing seems to hurry.",
    "On the way, {N} stopped to watch the swallows over the fields.",
    "Everyone in the village heard about it by the evening.",
    "{N} was tired afterwards but pleased with the work.",
    "The smell of wet grass hung in the air all afternoon.",
    "Later, {N} sat by the fire and thought about it for a long time.",
    "A dog followed {N} for most of the way and then disappeared.",
    "The church bell rang six as the sun went down.",
    "Nobody could remember a warmer day so early in the year.",
)
STORY_HEADER = "Read the following story."


def story_events(rng: random.Random, n_days: int) -> tuple[str, list[str], list[str]]:
    """(the hero's name, one event per day, one sentence of colour per day), all filled in."""
    hero, friend = rng.sample(FIRST_NAMES, 2)
    taken: set[str] = set()
    town = _invented(rng, TOWN_PARTS, taken)
    obj = rng.choice(OBJECTS)
    slots = {"N": hero, "F": friend, "T": town, "O": obj}
    events = [e.format(**slots) for e in rng.sample(EVENTS, n_days)]
    colour = [c.format(**slots) for c in rng.sample(COLOUR, n_days)]
    surname = _invented(rng, SURNAME_PARTS, taken)
    return f"{hero} {surname}", events, colour


def summarise_story(rng: random.Random, context_length: int) -> NaturalSample:
    """A week in a person's life (4 to 7 days, an event and a sentence of colour each) and one
    question: summarise it. The story has its own length (about 200-400 counted tokens): 5 to 7
    days are drawn and the last ones dropped while it overruns `context_length`. The reference
    summary is the events' own sentences, one per day, in order."""
    question = "\n\nQuestion: Summarise the story above in a few sentences, keeping the events in order."
    name, events, colour = story_events(rng, rng.randint(5, 7))
    for n_days in range(len(events), 3, -1):
        days = " ".join(f"On {DAYS[i]}, {events[i]} {colour[i]}" for i in range(n_days))
        story = f"This is the story of one week in the life of {name}. {days}"
        if count_model_tokens(STORY_HEADER + "\n\n" + story + question) <= context_length - LONG_RESERVED_TOKENS:
            break
    else:
        raise ValueError(f"context length {context_length} leaves no room for the story")
    reference = " ".join(f"On {DAYS[i]}, {events[i]}" for i in range(n_days))
    return NaturalSample(_join(STORY_HEADER, [[story]]), [(question, reference)])


DIARY_HEADER = "Read the following text carefully. Somewhere in it is a page of a diary."


def recite_diary(rng: random.Random, context_length: int) -> NaturalSample:
    """A diary of 4 to 6 days (the story's events and colour, one line a day) as one paragraph at a
    random depth of the essay; the question asks for every entry, in order, as written; the answer
    is the entries themselves (a copy of prose, where ``recite_steps`` copies a numbered list).
    4 to 6 days are drawn and the last ones dropped while the diary overruns `context_length` (6
    long entries do not fit the shortest contexts), so every length the tasks allow gets a diary."""
    name, events, colour = story_events(rng, rng.randint(4, 6))
    question = f"\n\nQuestion: Write out every entry of the diary of {name}, in order, exactly as written."
    budget = context_length - LONG_RESERVED_TOKENS - count_model_tokens(question)
    for n_days in range(len(events), 3, -1):
        answer = "\n".join(f"{DAYS[i]}: {events[i]} {colour[i]}" for i in range(n_days))
        diary = f"The diary of {name}:\n{answer}"
        used = count_model_tokens(DIARY_HEADER) + 2 + count_model_tokens(diary) + 2
        if used <= budget:
            break
    else:
        raise ValueError(f"context length {context_length} leaves no room for the diary")
    paragraphs = _essay(rng, budget - used)
    paragraphs.insert(rng.randint(0, len(paragraphs)), [diary])
    return NaturalSample(_join(DIARY_HEADER, paragraphs), [(question, answer)])


#: The long-output tasks by name (``builtin:<task>``).
NATURAL_LONG_TASKS: dict[str, Callable[[random.Random, int], NaturalSample]] = {
    "recite_steps": recite_steps,
    "recite_diary": recite_diary,
    "summarise_story": summarise_story,
}
