"""The closed vocabulary of the built-in tasks and of the embedded model's tokenizer.

The embedded model is a word-level model: every word the built-in tasks can write is one token
(with a leading-space marker), every digit is its own token, and punctuation is split off. Keeping
the vocabulary here, next to nothing else, lets the task generators, the tokenizer builder and the
token counter agree without importing one another.
"""

from __future__ import annotations

import re

SPACE = "\u2581"  # the leading-space marker of the Metaspace pre-tokenizer

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
DIGITS = [str(d) for d in range(10)]
PUNCTUATION = [".", "?", ":", "=", ","]

# Keys of records and names of variables: one token each, so that a record is one lookup.
KEY_WORDS = """
apple river stone cloud maple tiger ocean amber falcon cedar lemon violet copper meadow
harbor willow thunder pepper crystal badger canyon orchid walnut sparrow glacier saffron
lantern otter prairie cobalt juniper raven summit velvet marble heron quartz tulip bison
coral ember fennel garnet hazel indigo jasper kettle lotus mango nectar olive pebble quill
rosemary salmon thistle umber vesper wren yarrow zephyr acorn birch cactus dahlia eagle
fjord ginger hollow iris jackal koala lilac mint nutmeg onyx panda quince radish sage
topaz urchin vine wasp yak zinnia alder bramble cricket dune elm flint grove
""".split()

# Words of the fixed templates and of the filler text.
TEMPLATE_WORDS = """
The the magic number for is Question What Answer are all numbers of VAR value Which variables
assigned first second third part code Repeat
grass green sky blue sun yellow Here we go There and back again
""".split()


def vocabulary() -> list[str]:
    """All tokens of the embedded tokenizer, in id order (specials first)."""
    words = list(dict.fromkeys(TEMPLATE_WORDS + KEY_WORDS))
    return (
        SPECIAL_TOKENS
        + [SPACE]
        + DIGITS
        + PUNCTUATION
        + [SPACE + w for w in words]
    )


_PIECE = re.compile(r"\d|[^\W\d_]+|[^\w\s]")


def count_tokens(text: str) -> int:
    """Number of embedded-tokenizer tokens in `text` (without special tokens).

    Mirrors the tokenizer: each whitespace-separated chunk starts with a space marker that either
    joins the following word or, before a digit or punctuation mark, is a token of its own; every
    digit and punctuation mark is one token.
    """
    n = 0
    for chunk in text.split():
        pieces = _PIECE.findall(chunk)
        n += len(pieces)
        if not pieces or not pieces[0][0].isalpha():
            n += 1  # a bare space marker before a digit or punctuation
    return n
