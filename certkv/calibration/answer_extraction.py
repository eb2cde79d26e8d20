"""The final answer at the end of a generated trace, by one documented rule.

A reasoning trace, a worked solution or an agent's turn ends with the answer that is graded, and
the words before it may change under eviction without changing that answer. The ``final_answer``
and ``final_agreement`` utilities (:mod:`certkv.calibration.utility`) compare only what this rule
extracts. The rule looks, in this order, for

1. a marker: the last of ``####`` (GSM8K's convention), ``answer:`` and ``answer is`` (any case,
   so ``The answer is``, ``Final answer:``); the answer is what follows it up to the end of the
   first non-empty line after it, cut at that line's first sentence end (``.``, ``!`` or ``?``
   followed by a space), and empty when nothing follows the marker;
2. else the last number (an optional minus, digits, and ``,`` or ``.`` groups: ``-1,250.5``);
3. else the last non-empty line; the empty string for a blank text.

The text it returns is raw: the utilities normalise it
(:func:`certkv.calibration.utility.normalize_final_answer`).
"""

from __future__ import annotations

import re

__all__ = ["extract_final_answer"]

_MARKER = re.compile(r"####|\banswer\s*(?::|is\b)", re.IGNORECASE)
# A minus only where it is not a hyphen ("3-5" ends in 5); digits not inside a longer number.
_NUMBER = re.compile(r"(?:(?<!\w)-)?(?<![\d.,])\d+(?:[.,]\d+)*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def _after_marker(rest: str) -> str:
    """The first non-empty line of `rest`, up to its first sentence end ("" when all blank)."""
    for line in rest.splitlines():
        if line.strip():
            return _SENTENCE_END.split(line.strip(), maxsplit=1)[0]
    return ""


def extract_final_answer(text: str) -> str:
    """The final answer of a generated trace: after the last marker, else the last number, else
    the last non-empty line (the module docstring states the rule in full).

    Parameters
    ----------
    text : str
        A generated output (a candidate's or the full cache's answer), or any string.

    Returns
    -------
    str
        The extracted answer, raw (not normalised); "" for a blank text or a trailing marker.

    Examples
    --------
    >>> extract_final_answer("3 + 4 = 7, times 6 is 42.\\n#### 42")
    '42'
    >>> extract_final_answer("So the answer is Paris. It is the capital.")
    'Paris.'
    >>> extract_final_answer("First 12 apples, then 7 more: 19 apples")
    '19'
    >>> extract_final_answer("no number here\\nblue\\n\\n")
    'blue'
    >>> extract_final_answer("Answer:"), extract_final_answer("  ")
    ('', '')
    """
    text = str(text)
    markers = list(_MARKER.finditer(text))
    if markers:
        return _after_marker(text[markers[-1].end():])
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
