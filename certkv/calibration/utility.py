"""Utilities: scores in [0, 1] of one answer.

The loss a candidate incurs on a request is ``utility(full answer) − utility(candidate answer)``, so
a utility must be deterministic and bounded. Reference-based utilities take the best score over the
acceptable answers (a request lists every acceptable answer). The label-free ones
(:data:`LABEL_FREE`: ``agreement`` and the long-output ones) compare with the full-KV answer
instead, so the full answer scores 1 against itself and the loss is ``1 − utility(candidate)``.

Definitions follow the benchmarks they come from: SQuAD's answer normalisation and token F1,
RULER's case-insensitive substring match, and ROUGE-L's LCS F-measure (implemented here to avoid
a dependency). For long outputs (docs/long-generations.md): ``prefix_agreement`` and
``token_agreement`` on whitespace words, ``rouge_l_full`` against the full answer, and
``final_answer`` / ``final_agreement`` on the answer extracted from the end of a trace
(:mod:`certkv.calibration.answer_extraction`).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence

from certkv.calibration.answer_extraction import extract_final_answer
from certkv.errors import CertkvError

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation and articles, collapse whitespace."""
    text = str(text).lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _tokens(text: str) -> list[str]:
    return normalize_answer(text).split()


def _references(answers: Sequence[str] | str) -> list[str]:
    refs = [answers] if isinstance(answers, str) else list(answers)
    if not refs:
        raise CertkvError(
            "this utility needs reference answers, but the request lists none; use a label-free utility: "
            + ", ".join(sorted(LABEL_FREE))
        )
    return [str(a) for a in refs]


def _exact(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def _contains(prediction: str, reference: str) -> float:
    if not str(reference).strip():
        # A blank reference is "contained" in every prediction; it only matches a blank one.
        return float(not str(prediction).strip())
    return float(str(reference).lower() in str(prediction).lower())


def _overlap_f(n_common: int, n_pred: int, n_ref: int) -> float:
    """F1 from a match count; two empty token lists agree (1.0), one empty one does not (0.0)."""
    if n_pred == 0 or n_ref == 0:
        return float(n_pred == n_ref)
    if n_common == 0:
        return 0.0
    precision, recall = n_common / n_pred, n_common / n_ref
    return 2 * precision * recall / (precision + recall)


def _f1(prediction: str, reference: str) -> float:
    pred, ref = _tokens(prediction), _tokens(reference)
    counts: dict[str, int] = {}
    for tok in ref:
        counts[tok] = counts.get(tok, 0) + 1
    common = 0
    for tok in pred:
        if counts.get(tok, 0) > 0:
            counts[tok] -= 1
            common += 1
    return _overlap_f(common, len(pred), len(ref))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence (O(len(a)·len(b)) time, O(len(b)) memory)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def _rouge_l(prediction: str, reference: str) -> float:
    pred, ref = _tokens(prediction), _tokens(reference)
    return _overlap_f(lcs_length(pred, ref), len(pred), len(ref))


def _best(metric: Callable[[str, str], float], prediction: str, answers: Sequence[str] | str) -> float:
    return max(metric(str(prediction), ref) for ref in _references(answers))


def exact_match(prediction: str, answers: Sequence[str] | str) -> float:
    """1.0 when the normalised prediction equals a normalised reference."""
    return _best(_exact, prediction, answers)


def contains(prediction: str, answers: Sequence[str] | str) -> float:
    """RULER's string match: 1.0 when some reference occurs in the prediction, ignoring case."""
    return _best(_contains, prediction, answers)


def f1(prediction: str, answers: Sequence[str] | str) -> float:
    """SQuAD token F1 after normalisation, best over references."""
    return _best(_f1, prediction, answers)


def rouge_l(prediction: str, answers: Sequence[str] | str) -> float:
    """ROUGE-L F-measure (β = 1) on normalised tokens, best over references."""
    return _best(_rouge_l, prediction, answers)


def _full(full_answer: str | None, name: str) -> str:
    """The full-KV answer a label-free utility compares with; its absence is an error naming `name`."""
    if full_answer is None:
        raise CertkvError(f"utility {name} needs the full-KV answer (score(..., full_answer=...))")
    return str(full_answer)


def agreement(prediction: str, full_answer: str | None) -> float:
    """Exact match (normalised) with the full-KV answer: no labels needed."""
    return _exact(str(prediction), _full(full_answer, "agreement"))


def _words(text: str) -> list[str]:
    """The raw text's whitespace-separated words: case and punctuation kept, spacing ignored."""
    return str(text).split()


def _share(n_equal: int, pred: list[str], full: list[str]) -> float:
    """`n_equal` over the longer word list; two empty outputs are identical (1.0)."""
    longest = max(len(pred), len(full))
    return 1.0 if longest == 0 else n_equal / longest


def prefix_agreement(prediction: str, full_answer: str | None) -> float:
    """The share of the full-KV output the candidate reproduces before its first divergence.

    Label-free, for long generations: under greedy decoding a candidate that diverges once goes
    its own way, so what it is worth is how far it followed the full output. A "token" is a
    whitespace word of the raw text: tokenizer-free (it needs only the two strings) and strict,
    since any change of a model token changes the word that holds it (case and punctuation
    count; only a difference of spacing does not). The share is over the longer of the two
    outputs, so 1.0 means identical word sequences: a candidate that runs on past the full
    output's end (it missed the end of sequence) loses what it added, and one that stops early
    reproduces only its own length.

    Parameters
    ----------
    prediction : str
        The candidate's output.
    full_answer : str or None
        The full cache's output for the same request; None is an error.

    Returns
    -------
    float
        ``common prefix words / max(words in prediction, words in full answer)``; 1.0 when both
        are blank, 0.0 when exactly one is.

    Examples
    --------
    >>> prefix_agreement("a b c d", "a b c d")
    1.0
    >>> prefix_agreement("a b X d", "a b c d")  # diverges at word 2 of 4
    0.5
    >>> prefix_agreement("a b", "a b c d"), prefix_agreement("a b c d e", "a b c d")
    (0.5, 0.8)
    >>> prefix_agreement("", ""), prefix_agreement("x", "")
    (1.0, 0.0)
    """
    pred, full = _words(prediction), _words(_full(full_answer, "prefix_agreement"))
    common = 0
    for mine, theirs in zip(pred, full):
        if mine != theirs:
            break
        common += 1
    return _share(common, pred, full)


def token_agreement(prediction: str, full_answer: str | None) -> float:
    """The share of positions where the candidate's word equals the full-KV output's.

    Label-free. Unlike :func:`prefix_agreement` a divergence costs only the words that differ,
    so a candidate that swaps one word and then continues as the full output did keeps the rest
    (an inserted or dropped word shifts every later position, and they all count as different).
    Words are :func:`prefix_agreement`'s (whitespace words of the raw text), and the denominator
    is the longer output, so missing or extra words count as unequal.

    Parameters
    ----------
    prediction : str
        The candidate's output.
    full_answer : str or None
        The full cache's output for the same request; None is an error.

    Returns
    -------
    float
        ``#{i : pred[i] == full[i]} / max(len(pred), len(full))``; 1.0 when both are blank.

    Examples
    --------
    >>> token_agreement("a X c d", "a b c d")
    0.75
    >>> token_agreement("a b", "a b c d"), token_agreement("X a b c", "a b c")
    (0.5, 0.0)
    >>> token_agreement("", "")
    1.0
    """
    pred, full = _words(prediction), _words(_full(full_answer, "token_agreement"))
    return _share(sum(mine == theirs for mine, theirs in zip(pred, full)), pred, full)


def rouge_l_full(prediction: str, full_answer: str | None) -> float:
    """ROUGE-L F-measure against the full-KV output instead of references (label-free).

    The same definition as :func:`rouge_l` (SQuAD-normalised tokens, longest common
    subsequence, β = 1), so it forgives a reordering or a paraphrased stretch that the
    position-wise agreements count in full: for summaries and other outputs where the full
    output is one good answer among many.

    Parameters
    ----------
    prediction : str
        The candidate's output.
    full_answer : str or None
        The full cache's output for the same request; None is an error.

    Returns
    -------
    float
        ``rouge_l(prediction, [full_answer])``: 1.0 for identical normalised tokens (two blank
        outputs included), 0.0 when one of them is blank and the other is not.

    Examples
    --------
    >>> round(rouge_l_full("p q r s t", "p r t x"), 4)  # LCS 3: precision 3/5, recall 3/4
    0.6667
    >>> rouge_l_full("The cat sat.", "the cat sat"), rouge_l_full("", "x")
    (1.0, 0.0)
    """
    return _rouge_l(str(prediction), _full(full_answer, "rouge_l_full"))


_MINUS = re.compile(r"(?<![\w.,])-(?=\d)")
_DECIMAL_POINT = re.compile(r"(?<=\d)\.(?=\d)")


def normalize_final_answer(answer: str) -> str:
    """SQuAD's normalisation (:func:`normalize_answer`) after spelling out a number's sign and
    decimal point, which dropping punctuation would erase (``-5`` and ``5``, ``3.5`` and ``35``
    would be the same answer); thousands separators still drop (``1,250`` is ``1250``).

    Examples
    --------
    >>> normalize_final_answer("The Eiffel Tower!")
    'eiffel tower'
    >>> normalize_final_answer("-3.5"), normalize_final_answer("35"), normalize_final_answer("1,250")
    ('minus 3 point 5', '35', '1250')
    """
    return normalize_answer(_DECIMAL_POINT.sub(" point ", _MINUS.sub("minus ", str(answer))))


def _final(text: str) -> str:
    return normalize_final_answer(extract_final_answer(text))


def final_answer(prediction: str, answers: Sequence[str] | str) -> float:
    """Exact match of the answer extracted from the end of the prediction with a reference.

    For traces whose graded answer comes last (worked solutions, reasoning, ``#### 42``): the
    words before it may change under eviction at no loss. The extraction is
    :func:`~certkv.calibration.answer_extraction.extract_final_answer` (after the last ``####``,
    ``answer:`` or ``answer is``; else the last number; else the last non-empty line). The
    references are final answers themselves: they are normalised, not extracted from.

    Parameters
    ----------
    prediction : str
        A generated output (the candidate's, or the full cache's for ``utility_full``).
    answers : sequence of str, or str
        The request's acceptable final answers; none is an error.

    Returns
    -------
    float
        1.0 when :func:`normalize_final_answer` makes the extracted answer equal a reference's.

    Examples
    --------
    >>> final_answer("6 times 7 is 42.\\n#### 42", ["42"])
    1.0
    >>> final_answer("We add 2 and 3, so the answer is 5.", ["five", "5"])
    1.0
    >>> final_answer("It falls to -5 degrees", ["5"])
    0.0
    """
    extracted = _final(str(prediction))
    return max(float(extracted == normalize_final_answer(ref)) for ref in _references(answers))


def final_agreement(prediction: str, full_answer: str | None) -> float:
    """Whether the candidate's extracted final answer is the full-KV output's (label-free).

    The extraction and normalisation of :func:`final_answer`, applied to both outputs: a
    candidate may reason differently as long as it ends on the full cache's answer.

    Parameters
    ----------
    prediction : str
        The candidate's output.
    full_answer : str or None
        The full cache's output for the same request; None is an error.

    Returns
    -------
    float
        1.0 when the two extracted answers normalise equal (two outputs without any answer too).

    Examples
    --------
    >>> final_agreement("3 and 4 make 7. Answer: 7", "Adding: 3 + 4 = 7\\n#### 7")
    1.0
    >>> final_agreement("so 8 in all", "so 7 in all")
    0.0
    """
    return float(_final(str(prediction)) == _final(_full(full_answer, "final_agreement")))


#: The utilities that compare with the full-KV answer and read no reference answers.
LABEL_FREE = frozenset({"agreement", "prefix_agreement", "token_agreement", "rouge_l_full", "final_agreement"})

#: name -> scorer(prediction, answers, full_answer)
UTILITIES: dict[str, Callable[[str, Sequence[str], str | None], float]] = {
    "exact_match": lambda pred, answers, full: exact_match(pred, answers),
    "contains": lambda pred, answers, full: contains(pred, answers),
    "f1": lambda pred, answers, full: f1(pred, answers),
    "rouge_l": lambda pred, answers, full: rouge_l(pred, answers),
    "agreement": lambda pred, answers, full: agreement(pred, full),
    "prefix_agreement": lambda pred, answers, full: prefix_agreement(pred, full),
    "token_agreement": lambda pred, answers, full: token_agreement(pred, full),
    "rouge_l_full": lambda pred, answers, full: rouge_l_full(pred, full),
    "final_answer": lambda pred, answers, full: final_answer(pred, answers),
    "final_agreement": lambda pred, answers, full: final_agreement(pred, full),
}


def score(name: str, prediction: str, answers: Sequence[str] | str = (), full_answer: str | None = None) -> float:
    """Score `prediction` with the utility `name`; the full answer is read only by the
    :data:`LABEL_FREE` ones, the references only by the others."""
    try:
        fn = UTILITIES[name]
    except KeyError:
        raise CertkvError(f"unknown utility {name!r}; use one of: {', '.join(UTILITIES)}") from None
    return fn(prediction, answers, full_answer)
