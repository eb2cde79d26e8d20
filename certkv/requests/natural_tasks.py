"""Built-in RULER tasks in natural English, for real chat models.

The embedded tasks (:mod:`certkv.requests.builtin_tasks`) write a closed 150-word vocabulary so that
a tiny word-level model can read them. A real model (e.g. SmolLM2-135M-Instruct, 8192 positions)
deserves the real thing: the RULER families (needle in a haystack with one, several keys, several
values or several queries; variable tracking; common and frequent words extraction) and a reading
comprehension question, written in plain English at 512 to 8192 model tokens.

Three choices shape everything below:

- **No tokenizer at generation time.** A request set must be reproducible from its command on a
  machine without the model, so lengths are measured by :func:`count_model_tokens`, a tokenizer-free
  count that overestimates typical BPE counts: every digit, punctuation mark and line break is a
  token, a space before a digit or a mark is a token too, a word of this module's own pools costs
  one token (two when long or capitalised), an invented name one per four letters plus one, an
  invented lowercase word one per two letters plus one, a word in capitals one per letter. The
  prompt (context and question) is filled to ``context_length - RESERVED_TOKENS`` of that count;
  the reserve holds a chat template and the decoded answer, so the prompt the model sees fits the
  requested length. The pools hold only words that SmolLM2's tokenizer keeps within that price
  (tests check it), so the count is at or above its real count, piece by piece.
- **Natural filler.** The haystack is an essay-like text of short paragraphs about everyday
  subjects (gardens, trains, bakeries, ...), each sentence a template filled from topic word pools;
  every draw comes from the `rng` passed in, so a request depends only on (seed, index, task,
  length) and the text varies from request to request instead of repeating one sentence.
- **Short, unambiguous answers for exact match.** As in RULER, every question comes with an answer
  prefix that restates what is asked (``The special magic number for the silver lantern mentioned
  in the provided text is``), so the answer is only the value: a number, a name or a few
  words. Answers with several parts (multi-value, multi-query, words extraction) join them with
  single spaces in the order the prefix names (order of appearance, order asked, most frequent
  first); certkv's exact match drops punctuation, so ``pumpkin, whale`` and a bulleted
  ``- pumpkin\n- whale`` both match ``pumpkin whale``. Every value is one token or a six-digit number,
  so the answers fit in the default 8 decoded tokens of a BPE tokenizer that splits digits. The
  question starts a paragraph of its own (``\n\nQuestion: ...``): certkv encodes context and
  question separately and joins them.

  A chat model reads the answer prefix best at the start of its own turn, where RULER puts it (in
  the question, SmolLM2-135M restates it and exact match falls to 0 on every task): a sample's
  questions carry it after an ``Answer:`` mark, and ``builtin:`` request sets split it off with
  :func:`split_answer_prefix` into the request's ``answer_prefix``, which encoding places after the
  chat template's assistant header.

Tasks (the name each has in ``builtin:<mix>``):

- ``ruler_single_needle``: one special magic number hidden at a random depth of the essay.
- ``ruler_multi_key``: four needles with different keys; the question names one.
- ``ruler_multi_value``: one key with two special magic words; answer both, in order of appearance.
- ``ruler_multi_query``: four needles with word values; the question asks two keys at once.
- ``ruler_variable_tracking``: chains of assignments (``VAR QPDKE = 41873``, ``VAR XKFJD = VAR QPDKE``)
  scattered in the essay, one of them a distractor; ask the value the last variable of a chain holds.
- ``ruler_common_words``: a numbered list of common English words, three of them repeated more
  often than the rest; answer those three, most frequent first.
- ``ruler_frequent_words``: a coded text of invented words with Zipf-like frequencies; answer the
  three most frequent, most frequent first.
- ``reading_comprehension``: a short generated passage about an invented person, towns, a trade, a
  boat and a society, set at a random depth of the essay; one factual question whose answer is a
  short span of it.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_CONTEXT = 512
MAX_CONTEXT = 8192

#: Counted tokens kept free of the prompt: a chat template (SmolLM2's adds 30 tokens) and the
#: decoded answer (8 tokens by default), so that the whole sequence the model reads stays within
#: the requested length (SmolLM2 has 8192 positions).
RESERVED_TOKENS = 40

#: What separates the context from the question: the two are encoded separately and joined, so
#: the question starts a new paragraph of its own.
QUESTION_BREAK = "\n\n"


@dataclass
class NaturalSample:
    """One context and the questions it can answer; the request generator picks one.

    Unlike the embedded tasks' ``Sample`` the context is kept whole: paragraphs and list items are
    laid out here, and ``count_model_tokens(context + question)`` is what the length bounds."""

    context: str
    qa: list[tuple[str, str]]


# --------------------------------------------------------------------------------------------------
# Word pools. Key phrases, value words, names and filler words are disjoint sets (tests check it), so
# a needle is the only place its key and value occur and no filler sentence answers a question.

#: Adjectives and nouns of the needles' keys ("the silver lantern"): 24 x 24 keys.
KEY_ADJECTIVES = """
silver golden purple frozen hidden ancient velvet copper scarlet hollow jade marble ivory
yellow cobalt amber violet crystal bronze black white pearl lucky royal
""".split()
KEY_NOUNS = """
lantern compass violin kettle anchor mirror crown chimney saddle drum pendulum telescope
hourglass lighthouse statue banner fountain throne gramophone typewriter medal
cannon trophy mask
""".split()

#: Values of the word needles (multi-value, multi-query): one or two tokens each.
VALUE_WORDS = """
pumpkin giraffe trumpet kitten cabbage dolphin penguin pillow rocket cherry umbrella volcano
whale zebra banana camera dragon feather guitar hammer jacket spider magnet pizza octopus
parrot rabbit balloon turtle wagon cactus candy pirate planet mango monkey squirrel tractor
robot yogurt cookie donkey falcon gorilla helmet lemon jellyfish kangaroo lobster
""".split()

#: Words of the common-words list: plain, frequent English words, one token each.
LIST_WORDS = """
apple river stone cloud table chair window garden forest mountain ocean island village city
market bridge road train station letter pencil paper book school teacher student doctor
nurse farmer baker butcher sailor soldier king queen castle tower church bell clock watch
ring coin bread cheese butter milk honey sugar salt pepper onion carrot potato bean rice
wheat corn grass flower tree leaf branch root seed bird fish horse cow sheep goat pig dog cat
mouse lion bear wolf fox deer owl duck goose hen egg nest shell sand wave rain snow wind storm
fire smoke ash coal iron gold silk wool cotton leather glass wood paint brush ink card box bag
cup plate bowl spoon fork knife pot pan oven lamp door wall roof floor stair hall room bed
""".split()

#: Syllables of the coded words of the frequent-words task (invented, so no word is frequent a priori).
CODE_ONSETS = list("bdfgklmnprstvz")
CODE_VOWELS = list("aeiou")

#: People, towns and things of the reading-comprehension passages (invented compounds).
FIRST_NAMES = """
Elena Tomas Marta Jonas Clara Felix Ingrid Oscar Helena Victor Nadia Samuel Lucia Henrik Rosa
Anton Greta Mateo Irene Pablo Agnes Luca Vera Emil Alma Hugo Ada Leon Iris Otto
""".split()
SURNAME_PARTS = (
    "Ash Bram Cold Dun Elder Fern Glen Hart Ivy Kings Lark Marsh North Oak Pine Quill Rook Stone Thorn Wren".split(),
    "field ford wood well brook more by ley worth hall croft wick".split(),
)
TOWN_PARTS = (
    "Mill Harrow Bell Cinder Dover Fair Gold Heron Crane Lynn Moss Red Salt Tall Willow Amber Brack Clay".split(),
    "haven bridge mouth dale stead moor gate port ton bury".split(),
)
TRADES = """
clockmaker goldsmith locksmith cartographer shipwright beekeeper printer tailor painter
surgeon carpenter blacksmith
""".split()
SHOPS = ["bakery", "book shop", "tea room", "toy shop", "print works", "boat yard", "flower shop", "hat shop"]
BOAT_NAMES = """
Marigold Seabird Kittiwake Bluebell Starling Moonbeam Primrose Nightjar Curlew Snowdrop
Whimbrel Foxglove Dunlin Larkspur Bramble Thistledown
""".split()
EVENTS = [
    "lantern festival",
    "river race",
    "harvest fair",
    "chess tournament",
    "winter market",
    "kite contest",
    "choir competition",
    "cheese show",
]
SOCIETY_OBJECTS = ["Stamp Collectors", "Map Collectors", "Bell Ringers", "Kite Flyers", "Night Walkers", "Letter Writers"]

# --------------------------------------------------------------------------------------------------
# The essay: topics, each with pools for the template slots. {P} people (plural), {L} a place (with
# its article), {T} a thing (singular, no article), {A} an activity (gerund phrase), {S} a smell.


@dataclass(frozen=True)
class _Topic:
    people: tuple[str, ...]
    places: tuple[str, ...]
    things: tuple[str, ...]
    activities: tuple[str, ...]
    smells: tuple[str, ...]


def _topic(people: str, places: str, things: str, activities: str, smells: str) -> _Topic:
    def split(text: str) -> tuple[str, ...]:
        return tuple(part.strip() for part in text.split(";"))

    return _Topic(split(people), split(places), split(things), split(activities), split(smells))


TOPICS: tuple[_Topic, ...] = (
    _topic(
        "gardeners; allotment holders; retired neighbours",
        "the walled garden; the vegetable plot; the greenhouse by the wall",
        "watering can; flower pot; rake; garden bench",
        "planting beans; pruning the roses; turning the compost; pulling weeds",
        "wet soil; cut grass; tomato leaves",
    ),
    _topic(
        "passengers; station guards; commuters",
        "the branch line; the old station; the signal box",
        "timetable; ticket; platform bench; luggage cart",
        "waiting for the late train; reading the timetable; watching the carriages pass",
        "coal smoke; hot metal; fresh coffee",
    ),
    _topic(
        "cooks; apprentices; early customers",
        "the bakery on the corner; the warm kitchen; the flour store",
        "rolling pin; mixing bowl; bread oven; wooden board",
        "mixing dough; shaping the bread; waiting for the bread to rise",
        "fresh bread; warm butter; burnt sugar",
    ),
    _topic(
        "fishermen; boat owners; children on holiday",
        "the river bank; the old mill pond; the stone bridge",
        "fishing rod; rowing boat; wooden pier",
        "rowing against the current; casting a line; throwing stones",
        "river mud; damp reeds; morning mist",
    ),
    _topic(
        "readers; librarians; students",
        "the reading room; the town library; the archive downstairs",
        "card catalogue; reading lamp; leather chair",
        "sorting old letters; reading in silence; returning borrowed books",
        "old paper; floor polish; dust",
    ),
    _topic(
        "traders; shoppers; stall holders",
        "the market square; the covered market; the fish stalls",
        "canvas roof; weighing scale; box of apples",
        "arguing over prices; setting up the stalls; packing away at dusk",
        "ripe fruit; roasted nuts; fresh fish",
    ),
    _topic(
        "tourists; shepherds; climbers",
        "the high pass; the mountain hut; the narrow ridge",
        "walking stick; map case; wool blanket",
        "climbing the steep path; crossing the ridge; resting by the stone hut",
        "pine resin; wood smoke; cold rain",
    ),
    _topic(
        "music teachers; young pupils; choir members",
        "the church hall; the practice room; the village bandstand",
        "old piano; music stand; brass horn",
        "practising scales; tuning the strings; rehearsing for the concert",
        "candle wax; polish; old wood",
    ),
    _topic(
        "owners; builders; visitors",
        "the old farmhouse; the attic; the long corridor",
        "oak beam; iron lock; stone fireplace",
        "repairing the roof; painting the windows; clearing the attic",
        "lime plaster; damp stone; fresh paint",
    ),
    _topic(
        "cyclists; mechanics; delivery riders",
        "the repair shop; the canal path; the long hill",
        "bicycle bell; bicycle pump; leather seat",
        "fixing a puncture; cleaning the chain; riding to work",
        "engine oil; rubber; rain on the road",
    ),
    _topic(
        "postal workers; letter writers; clerks",
        "the post office; the sorting room; the village shop",
        "postage stamp; brown parcel; ink pen",
        "writing long letters; sorting the morning post; waiting for a reply",
        "sealing wax; ink; cardboard",
    ),
    _topic(
        "keepers; fishermen; sailors",
        "the harbour wall; the rocky shore; the fish market",
        "coil of rope; rain coat; brass bell",
        "fixing the nets; watching the tide; painting the boats",
        "salt spray; seaweed; tar",
    ),
    _topic(
        "teachers; pupils; parents",
        "the schoolyard; the classroom; the school library",
        "blackboard; chalk box; school bell",
        "learning to read; marking homework; practising handwriting",
        "chalk dust; floor wax; wet coats",
    ),
    _topic(
        "foresters; tourists; mushroom hunters",
        "the pine wood; the forest track; the clearing",
        "axe; wooden cart; fallen log",
        "gathering firewood; planting young trees; following the deer tracks",
        "moss; pine needles; wet leaves",
    ),
)

ADJECTIVES = "worn heavy faded sturdy narrow old crooked tidy dusty polished broken simple".split()
TIMES = [
    "In the early morning",
    "By late afternoon",
    "Most evenings",
    "On a cold morning in winter",
    "Long before sunrise",
    "Just after lunch",
    "At the end of the week",
    "On the first warm day of the year",
    "Late at night",
    "In the middle of the morning",
]
SEASONS = ["spring", "summer", "autumn", "winter"]
COLOURS = ["gold", "grey", "pale pink", "orange", "deep blue"]

TEMPLATES = [
    "{W}, the {P} spent most of the day {A}.",
    "Many {P} say that {A} teaches more patience than any book.",
    "The {J} {T} in {L} had not been moved for years.",
    "It is easy to forget how much {A} depends on the weather.",
    "The {P} often arrive early, before {L} fills with visitors.",
    "Nobody remembers exactly when {L} was first built, but everyone has a story about it.",
    "In the quiet months, {A} becomes a habit rather than a chore.",
    "A good {T} is worth more than a shelf of clever tools.",
    "The smell of {S} drifted across {L}.",
    "When {N} came, the {P} went back to {A}.",
    "There is a particular pleasure in {A} while the rest of the town is still asleep.",
    "Some of the {P} kept notes about {A}, though few of them ever read those notes again.",
    "{W}, the light in {L} turns {C} and then slowly goes dark.",
    "Visitors rarely notice the {T}, yet the {P} would be lost without it.",
    "According to the {P}, the secret of {A} is to do a little every day.",
    "The {P} argued for a whole afternoon about the best way of {A}.",
    "By the end of {N}, {L} looked cleaner than it had in a long time.",
    "Even a {J} {T} can last for decades if someone takes care of it.",
    "Most people who spend time in {L} come back, sooner or later.",
    "The older {P} still talk about the year when {L} flooded.",
    "Nothing about {A} is difficult, but all of it takes time.",
    "On rainy days, {L} is almost empty and wonderfully calm.",
    "Children love {A}, although they rarely admit it.",
    "A {J} {T} stood by the door, exactly where it had always been.",
    "It would be hard to imagine {L} without the {P}.",
    "People sometimes ask why anyone cares about {A}, and the {P} simply smile.",
    "The first lesson of {A} is that mistakes are part of the work.",
    "Every {N}, a few new {P} join, and a few old ones retire.",
    "The {P} agreed that {L} was at its best in {N}.",
    "Writing about {A} is much easier than doing it well.",
]

#: Reflective sentences without slots, for the essay's rhythm.
REMARKS = [
    "Small habits, repeated over many years, shape a place more than grand plans do.",
    "Memory is generous with good weather and forgetful about the rain.",
    "Most of what we call skill is simply attention, given again and again.",
    "A town changes slowly, and then all at once, and then slowly again.",
    "It is often the plain things that people miss most when they move away.",
    "Nobody learns a craft from instructions alone; the hands have to learn it too.",
    "The best conversations seem to happen while people are busy with something else.",
    "Every season has its own chores, and every chore has its own small reward.",
    "Old tools carry the marks of the people who used them.",
    "Patience is not the same as waiting, although the two are often confused.",
    "A quiet morning can be more useful than a busy week.",
    "What looks like luck from outside is usually years of practice.",
]


def _fill_template(rng: random.Random, template: str, topic: _Topic) -> str:
    """One essay sentence: `template` with every slot drawn from `topic` (or the shared pools)."""
    slots = {
        "P": rng.choice(topic.people),
        "L": rng.choice(topic.places),
        "T": rng.choice(topic.things),
        "A": rng.choice(topic.activities),
        "S": rng.choice(topic.smells),
        "J": rng.choice(ADJECTIVES),
        "W": rng.choice(TIMES),
        "N": rng.choice(SEASONS),
        "C": rng.choice(COLOURS),
    }
    text = template.format(**slots)
    return text[0].upper() + text[1:]


def essay_paragraph(rng: random.Random) -> list[str]:
    """A paragraph of 3 to 6 sentences about one topic, no template used twice (why: variety
    within a paragraph, so that no two neighbouring sentences read alike)."""
    topic = rng.choice(TOPICS)
    n = rng.randint(3, 6)
    sentences = [_fill_template(rng, t, topic) for t in rng.sample(TEMPLATES, n)]
    if rng.random() < 0.4:
        sentences.insert(rng.randint(0, len(sentences)), rng.choice(REMARKS))
    return sentences


# --------------------------------------------------------------------------------------------------
# Counting.

_PIECE = re.compile(r"[A-Za-z]+|\d|\n|[^\sA-Za-z\d]")


def _vocabulary_words() -> frozenset[str]:
    """Every word of the texts this module writes by itself (templates, pools, headers): the words
    :func:`count_model_tokens` prices as known (first names too: they are common ones). Surnames,
    towns, boats and coded words are left out on purpose: they are invented or rare, so a tokenizer
    splits them, and they are priced by their letters."""
    texts: list[str] = [*TEMPLATES, *REMARKS, *TIMES, *SEASONS, *COLOURS, *ADJECTIVES]
    for topic in TOPICS:
        texts += [*topic.people, *topic.places, *topic.things, *topic.activities, *topic.smells]
    texts += [*KEY_ADJECTIVES, *KEY_NOUNS, *VALUE_WORDS, *LIST_WORDS, *TRADES, *SHOPS, *EVENTS, *SOCIETY_OBJECTS, *FIRST_NAMES]
    texts.append(_FIXED_TEXTS)
    return frozenset(w.lower() for text in texts for w in re.findall(r"[A-Za-z]+", text))


#: The fixed sentences of headers and questions, written once here so the counter knows their words.
_FIXED_TEXTS = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards. Some special magic words are hidden. One of the "
    "special magic numbers for the is: What is the special magic number for the mentioned in the "
    "provided text? Answer: The special magic number for the mentioned in the provided text is. "
    "What are all the special magic words for the, in order of appearance? The special magic words "
    "for the and the, respectively, are. Memorize and track the chain of variable assignments hidden "
    "in the following text. Find the value assigned to, following every step of its chain. "
    "The value of is Below is a numbered list of words. In these words, some appear more often than "
    "others. Memorize the ones that appear most often. What are the three words that appear most "
    "often in the list above, from most to least frequent? The three words that appear most often, "
    "from most to least frequent, are: Read the following coded text and track the frequency of each "
    "coded word. Find the three most frequently appearing coded words. Do not count the words of this "
    "sentence. According to the coded text above, the three most frequently appearing coded words, "
    "from most to least frequent, are: Answer the question based on the following text. Only give "
    "me the answer and do not output any other words. Answer the question based on the text above. "
    "Question: In which town was born? was born in the town of What did name boat? named boat "
    "Who founded the Society of? Society of was founded by Where did open? opened in the town of "
    "In what year did the first take place? first took place in the year Which trade did learn? "
    "learned the trade of a an as apprentice Before that worked years Later became known for "
    "who their member met every month above In also ran small which held"
)


_KNOWN_WORDS = _vocabulary_words()


def _word_cost(word: str) -> int:
    """Counted tokens of one alphabetic word (with the space before it, which BPE merges in)."""
    if word.lower() in _KNOWN_WORDS:
        if word.islower():
            return 1 if len(word) <= 8 else 2
        return 1 if len(word) <= 3 else 2  # capitalised forms are rarer merges
    if word.isupper() and len(word) > 1:
        return len(word)  # random capitals: up to one token per letter
    if word[0].isupper():
        return math.ceil(len(word) / 4) + 1  # invented names: compounds of two name parts
    return math.ceil(len(word) / 2) + 1  # invented lowercase words: up to one token per two letters


def count_model_tokens(text: str) -> int:
    """A tokenizer-free count that overestimates a BPE tokenizer's count of `text`.

    Each digit, punctuation mark and line break is one token; a space before a digit or a mark is
    one more (BPE tokenizers that split digits keep that space apart); each word costs
    :func:`_word_cost`. Against SmolLM2's tokenizer the count of these tasks' prompts runs 0-16%
    above the real one (common words: exact; frequent words, all invented words: 25-60% above),
    never below (a test checks it on many requests when the tokenizer is installed). It is tuned to
    the texts this module writes: arbitrary text (rare words, other scripts) may count low.
    """
    n = 0
    previous_end = 0
    for match in _PIECE.finditer(text):
        piece = match.group()
        if piece[0].isalpha():
            n += _word_cost(piece)
        else:
            n += 1
            gap = text[previous_end : match.start()]
            if gap and piece != "\n" and not gap.strip(" "):
                n += 1  # the bare space before a digit or mark
        previous_end = match.end()
    return n


# --------------------------------------------------------------------------------------------------
# Layout: a header, the essay with records at random depths, and the question.


def _prompt_budget(context_length: int, question: str) -> int:
    """Counted tokens left for the context once the question and the reserve are taken out."""
    budget = context_length - RESERVED_TOKENS - count_model_tokens(QUESTION_BREAK + question)
    if budget < 64:
        raise ValueError(f"context length {context_length} leaves no room for a context")
    return budget


def _essay(rng: random.Random, budget: int) -> list[list[str]]:
    """Essay paragraphs (lists of sentences) whose count, paragraph breaks included, fills `budget`.

    Why the whole budget goes to the essay: the records are inserted into it afterwards, at depths
    drawn over its sentences, and the callers have already taken the records' cost out of `budget`."""
    paragraphs: list[list[str]] = []
    used = 0
    while True:
        paragraph: list[str] = []
        cost = 2 if paragraphs else 0  # the line break before a paragraph
        for sentence in essay_paragraph(rng):
            c = count_model_tokens(sentence)
            if used + cost + c > budget:
                if paragraph:
                    paragraphs.append(paragraph)
                return paragraphs
            paragraph.append(sentence)
            cost += c
        paragraphs.append(paragraph)
        used += cost


def _insert_sentences(rng: random.Random, paragraphs: list[list[str]], records: Sequence[str]) -> None:
    """Insert `records` (kept in order) at uniformly random sentence boundaries of the essay.

    Why sentence-level depths: RULER's needles sit between sentences of a real essay, so finding
    them takes reading, not spotting a paragraph that looks different."""
    if not paragraphs:
        paragraphs.append([])
    boundaries = [(p, i) for p, par in enumerate(paragraphs) for i in range(len(par) + 1)]
    points = sorted(rng.randrange(len(boundaries)) for _ in records)
    for record, point in reversed(list(zip(records, points))):
        p, i = boundaries[point]
        paragraphs[p].insert(i, record)


def _join(header: str, paragraphs: list[list[str]]) -> str:
    return "\n\n".join([header, *(" ".join(par) for par in paragraphs if par)])


def _essay_with_records(rng: random.Random, header: str, records: Sequence[str], budget: int) -> str:
    """`header`, then an essay of `budget` counted tokens (all told) holding `records` at random depths."""
    used = count_model_tokens(header) + 2 + sum(count_model_tokens(r) for r in records)
    if used > budget:
        raise ValueError("the records do not fit in the context length")
    paragraphs = _essay(rng, budget - used)
    _insert_sentences(rng, paragraphs, records)
    return _join(header, paragraphs)


def _value(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _keys(rng: random.Random, n: int) -> list[str]:
    """`n` distinct keys ("silver lantern"), no two sharing an adjective or a noun (why: a shared
    word would make one needle a near-copy of another, a harder task than RULER's)."""
    return [f"{a} {b}" for a, b in zip(rng.sample(KEY_ADJECTIVES, n), rng.sample(KEY_NOUNS, n))]


ANSWER_MARK = " Answer: "


def _qa_text(ask: str, prefix: str) -> str:
    """A sample's question: the ask, then RULER's answer prefix after an ``Answer:`` mark, which
    :func:`split_answer_prefix` splits off into a request's ``answer_prefix``."""
    return f"{QUESTION_BREAK}Question: {ask}{ANSWER_MARK}{prefix}"


def split_answer_prefix(question: str) -> tuple[str, str]:
    """(the question without its answer prefix, the answer prefix) of a question of these tasks.

    Why: RULER puts the answer prefix at the start of the model's own turn, after the chat
    template's assistant header; inside the user turn a chat model tends to restate the prefix
    instead of continuing it. A request's ``answer_prefix`` takes the second part, which
    ``encode_request(..., answer_prefix=)`` places where RULER does."""
    ask, mark, prefix = question.rpartition(ANSWER_MARK)
    if not mark:
        return question, ""
    return ask, prefix


NUMBER_HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)
WORD_HEADER = (
    "Some special magic words are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the words afterwards."
)


def _number_needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for the {key} is: {value}."


def _word_needle(key: str, value: str) -> str:
    return f"One of the special magic words for the {key} is: {value}."


def _number_question(key: str) -> str:
    return _qa_text(
        f"What is the special magic number for the {key} mentioned in the provided text?",
        f"The special magic number for the {key} mentioned in the provided text is",
    )


def _longest_question(questions: Sequence[str]) -> str:
    return max(questions, key=count_model_tokens)


def _needles(
    rng: random.Random, context_length: int, header: str, records: list[str], qa: list[tuple[str, str]]
) -> NaturalSample:
    """Lay out `records` in the essay; the budget leaves room for the longest of the questions."""
    budget = _prompt_budget(context_length, _longest_question([q for q, _ in qa]))
    return NaturalSample(_essay_with_records(rng, header, records, budget), qa)


# --------------------------------------------------------------------------------------------------
# The tasks.

VALUE_DIGITS = 6  # a space and six digits: 7 tokens, within the default 8 decoded tokens


def ruler_single_needle(rng: random.Random, context_length: int) -> NaturalSample:
    """RULER's NIAH single: one special magic number at a random depth of the essay."""
    (key,) = _keys(rng, 1)
    value = _value(rng, VALUE_DIGITS)
    return _needles(rng, context_length, NUMBER_HEADER, [_number_needle(key, value)], [(_number_question(key), value)])


def ruler_multi_key(rng: random.Random, context_length: int, n_keys: int = 4) -> NaturalSample:
    """RULER's NIAH multi-key: `n_keys` needles with different keys; any one may be asked."""
    keys = _keys(rng, n_keys)
    values = [_value(rng, VALUE_DIGITS) for _ in keys]
    records = [_number_needle(k, v) for k, v in zip(keys, values)]
    rng.shuffle(records)
    return _needles(rng, context_length, NUMBER_HEADER, records, [(_number_question(k), v) for k, v in zip(keys, values)])


def ruler_multi_value(rng: random.Random, context_length: int, n_values: int = 2) -> NaturalSample:
    """RULER's NIAH multi-value: one key holds `n_values` special magic words; answer all of them,
    in the order they appear (the records keep their order in the essay)."""
    (key,) = _keys(rng, 1)
    values = rng.sample(VALUE_WORDS, n_values)
    question = _qa_text(
        f"What are all the special magic words for the {key} mentioned in the provided text, in order of appearance?",
        f"The special magic words for the {key} mentioned in the provided text, in order of appearance, are:",
    )
    return _needles(rng, context_length, WORD_HEADER, [_word_needle(key, v) for v in values], [(question, " ".join(values))])


def ruler_multi_query(rng: random.Random, context_length: int, n_keys: int = 4, n_asked: int = 2) -> NaturalSample:
    """RULER's NIAH multi-query: `n_keys` word needles; one question asks `n_asked` keys at once
    and the answer gives their values in the order asked."""
    keys = _keys(rng, n_keys)
    values = rng.sample(VALUE_WORDS, n_keys)
    records = [_word_needle(k, v) for k, v in zip(keys, values)]
    rng.shuffle(records)
    qa = []
    for _ in range(3):
        asked = rng.sample(range(n_keys), n_asked)
        names = " and the ".join(keys[i] for i in asked)
        question = _qa_text(
            f"What are the special magic words for the {names} mentioned in the provided text?",
            f"The special magic words for the {names} mentioned in the provided text, respectively, are:",
        )
        qa.append((question, " ".join(values[i] for i in asked)))
    return _needles(rng, context_length, WORD_HEADER, records, qa)


def _variable_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def ruler_variable_tracking(rng: random.Random, context_length: int, hops: int = 2, chains: int = 2) -> NaturalSample:
    """RULER's variable tracking: `chains` chains ``VAR A = 41873. VAR B = VAR A. ...`` of `hops`
    copies each, their statements in order but interleaved and scattered through the essay; ask the
    value the last variable of one chain holds (a five-digit number)."""
    names: list[str] = []
    while len(names) < chains * (hops + 1):
        name = _variable_name(rng)
        if name not in names and name != "VAR":
            names.append(name)
    statements: list[list[str]] = []
    qa = []
    for c in range(chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        value = _value(rng, 5)
        statements.append([f"VAR {chain[0]} = {value}.", *(f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:]))])
        question = _qa_text(
            f"Find the value assigned to VAR {chain[-1]} in the text above, following every step of its chain.",
            f"The value of VAR {chain[-1]} is",
        )
        qa.append((question, value))
    order = [c for c, lines in enumerate(statements) for _ in lines]
    rng.shuffle(order)
    cursors = [0] * chains
    records = []
    for c in order:
        records.append(statements[c][cursors[c]])
        cursors[c] += 1
    header = "Memorize and track the chain of variable assignments hidden in the following text."
    return _needles(rng, context_length, header, records, qa)


COMMON_WORDS_HEADER = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
COMMON_WORDS_QUESTION = _qa_text(
    "What are the three words that appear most often in the list above, from most to least frequent?",
    "The three words that appear most often, from most to least frequent, are:",
)


def _list_counts(n_items: int, n_words: int) -> list[int]:
    """Counts (summing to `n_items`) for RULER's common words extraction: three common words with
    distinct counts ``b + 4 > b + 2 > b``, every other word at most ``(b - 2) / 2`` times (why:
    the answer and its order are then certain, and the three stand out as RULER's do)."""
    base = max(4, n_items // 30)
    while True:
        rest = n_items - (3 * base + 6)
        most = math.ceil(rest / (n_words - 3))
        if 2 * most + 2 <= base:
            break
        base += 1
    share, extra = divmod(rest, n_words - 3)
    return [base + 4, base + 2, base] + [share + (1 if i < extra else 0) for i in range(n_words - 3)]


def ruler_common_words(rng: random.Random, context_length: int) -> NaturalSample:
    """RULER's common words extraction (CWE): a numbered list where three words repeat more often
    than the rest; the answer names them, most frequent first."""
    budget = _prompt_budget(context_length, COMMON_WORDS_QUESTION) - count_model_tokens(COMMON_WORDS_HEADER + "\n")
    # Item i costs what " i. word" counts (every list word is one known word): fill the budget.
    n_items, used = 0, 0
    while used + count_model_tokens(f" {n_items + 1}. apple") <= budget:
        n_items += 1
        used += count_model_tokens(f" {n_items}. apple")
    n_words = min(len(LIST_WORDS), max(8, n_items // 2))
    words = rng.sample(LIST_WORDS, n_words)
    sequence = [w for w, c in zip(words, _list_counts(n_items, n_words)) for _ in range(c)]
    rng.shuffle(sequence)
    context = COMMON_WORDS_HEADER + "\n" + " ".join(f"{i}. {w}" for i, w in enumerate(sequence, 1))
    return NaturalSample(context, [(COMMON_WORDS_QUESTION, " ".join(words[:3]))])


FREQUENT_WORDS_HEADER = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appearing coded words. Do not count the words of this sentence."
)
FREQUENT_WORDS_QUESTION = _qa_text(
    "What are the three most frequently appearing coded words in the coded text above, from most to least frequent?",
    "According to the coded text above, the three most frequently appearing coded words, from most to least frequent, are:",
)


def _coded_words(rng: random.Random, n: int, out: list[str] | None = None) -> list[str]:
    """`out` extended to `n` distinct invented words (consonant, vowel, consonant, vowel)."""
    out = [] if out is None else out
    while len(out) < n:
        word = "".join(rng.choice(CODE_ONSETS) + rng.choice(CODE_VOWELS) for _ in range(2))
        if word not in out and word not in _KNOWN_WORDS:
            out.append(word)
    return out


def ruler_frequent_words(rng: random.Random, context_length: int, alpha: float = 1.2) -> NaturalSample:
    """RULER's frequent words extraction (FWE): a coded text of invented two-syllable words drawn
    with Zipf-like frequencies (count ∝ rank^-alpha); the answer names the three most frequent,
    most frequent first. Counts are rounded so that the top four are strictly decreasing."""
    budget = _prompt_budget(context_length, FREQUENT_WORDS_QUESTION) - count_model_tokens(FREQUENT_WORDS_HEADER + "\n")
    n_total = budget // count_model_tokens("kelo")  # every coded word has four letters: one price
    vocab = _coded_words(rng, max(20, n_total // 8))
    weights = [(r + 1) ** -alpha for r in range(len(vocab))]
    counts = [max(1, int(w * n_total / sum(weights))) for w in weights]
    for r in range(3, 0, -1):  # strict order at the top, whatever the rounding did
        counts[r - 1] = max(counts[r - 1], counts[r] + 1)
    while sum(counts) > n_total:  # rounding up overshot: drop the rarest words
        counts.pop()
    vocab = _coded_words(rng, len(counts) + n_total - sum(counts), vocab[: len(counts)])
    counts += [1] * (len(vocab) - len(counts))  # rounding down left room: words seen once
    sequence = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(sequence)
    context = FREQUENT_WORDS_HEADER + "\n" + " ".join(sequence)
    return NaturalSample(context, [(FREQUENT_WORDS_QUESTION, " ".join(vocab[:3]))])


# --------------------------------------------------------------------------------------------------
# Reading comprehension.


@dataclass
class _Person:
    first: str
    last: str
    birthplace: str
    trade: str
    shop: str
    shop_town: str
    boat: str
    society: str

    @property
    def name(self) -> str:
        return f"{self.first} {self.last}"


def _invented(rng: random.Random, parts: tuple[list[str], list[str]], taken: set[str]) -> str:
    while True:
        word = rng.choice(parts[0]) + rng.choice(parts[1])
        if word not in taken:
            taken.add(word)
            return word


def _people(rng: random.Random, n: int) -> list[_Person]:
    """`n` invented people whose every attribute differs from the others' (why: each question has
    exactly one answer in the passage, and the other people's facts are its distractors)."""
    firsts = rng.sample(FIRST_NAMES, n)
    taken: set[str] = set()
    trades, shops = rng.sample(TRADES, n), rng.sample(SHOPS, n)
    boats, societies = rng.sample(BOAT_NAMES, n), rng.sample(SOCIETY_OBJECTS, n)
    return [
        _Person(
            firsts[i],
            _invented(rng, SURNAME_PARTS, taken),
            _invented(rng, TOWN_PARTS, taken),
            trades[i],
            shops[i],
            _invented(rng, TOWN_PARTS, taken),
            boats[i],
            societies[i],
        )
        for i in range(n)
    ]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _biography(rng: random.Random, p: _Person) -> list[str]:
    """Four facts about `p`, the first and last in a fixed place, the middle two in either order."""
    middle = [
        f"{p.first} learned the trade of {_article(p.trade)} {p.trade} as an apprentice and later opened "
        f"a small {p.shop} in the town of {p.shop_town}.",
        f"{p.first} also owned a little boat and named the boat {p.boat}.",
    ]
    rng.shuffle(middle)
    return [
        f"{p.name} was born in the town of {p.birthplace}.",
        *middle,
        f"{p.name} founded the Society of {p.society}, and its members met every month above the {p.shop}.",
    ]


def _rc_questions(p: _Person) -> list[tuple[str, str, str]]:
    """(ask, answer prefix, answer) about `p`; every answer is a span of the passage."""
    return [
        (f"In which town was {p.name} born?", f"{p.name} was born in the town of", p.birthplace),
        (f"In which town did {p.name} open a {p.shop}?", f"{p.name} opened a {p.shop} in the town of", p.shop_town),
        (f"What did {p.name} name the boat?", f"{p.name} named the boat", p.boat),
        (f"Which society did {p.name} found?", f"{p.name} founded the Society of", p.society),
        (f"Which trade did {p.name} learn?", f"{p.name} learned the trade of {_article(p.trade)}", p.trade),
    ]


RC_HEADER = "Answer the question based on the following text. Only give me the answer and do not output any other words."


def reading_comprehension(rng: random.Random, context_length: int, n_people: int = 1) -> NaturalSample:
    """A passage of four facts about each of `n_people` invented people (where they were born,
    which trade they learned and where they opened a shop, what they named their boat, which society
    they founded), one paragraph at a random depth of the essay, as a document among distractor
    documents; the question asks one fact; the answer (a town, a trade, a boat's name or a society's
    name) is a span of the passage. One person by default: the passage already holds two towns to
    tell apart, and SmolLM2-135M answers 5 of 6 such questions at 2048 tokens but only half once a
    second person's facts sit next to them (pass `n_people` for the harder variant)."""
    people = _people(rng, n_people)
    passage = " ".join(s for p in people for s in _biography(rng, p))
    # One question, drawn here: the budget is then exact for it (the questions differ in length).
    ask, prefix, answer = rng.choice([q for p in people for q in _rc_questions(p)])
    qa = [(_qa_text(ask, prefix), answer)]
    budget = _prompt_budget(context_length, qa[0][0])
    used = count_model_tokens(RC_HEADER) + 2 + count_model_tokens(passage) + 2
    if used > budget:
        raise ValueError("the passage does not fit in the context length")
    paragraphs = _essay(rng, budget - used)
    paragraphs.insert(rng.randint(0, len(paragraphs)), [passage])
    return NaturalSample(_join(RC_HEADER, paragraphs), qa)


NATURAL_TASKS: dict[str, Callable[[random.Random, int], NaturalSample]] = {
    "ruler_single_needle": ruler_single_needle,
    "ruler_multi_key": ruler_multi_key,
    "ruler_multi_value": ruler_multi_value,
    "ruler_multi_query": ruler_multi_query,
    "ruler_variable_tracking": ruler_variable_tracking,
    "ruler_common_words": ruler_common_words,
    "ruler_frequent_words": ruler_frequent_words,
    "reading_comprehension": reading_comprehension,
}
