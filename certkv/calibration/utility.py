"""Utilities: scores in [0, 1] of one answer.

The loss a candidate incurs on a request is ``utility(full answer) − utility(candidate answer)``, so
a utility must be deterministic and bounded. Reference-based utilities take the best score over the
acceptable answers (a request lists every acceptable answer). ``agreement`` compares with the
full-KV answer instead and needs no labels.

Definitions follow the benchmarks they come from: SQuAD's answer normalisation and token F1,
RULER's case-insensitive substring match, and ROUGE-L's LCS F-measure (implemented here to avoid
a dependency).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence

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
        raise CertkvError("this utility needs reference answers, but the request lists none; use utility: agreement")
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


def agreement(prediction: str, full_answer: str | None) -> float:
    """Exact match (normalised) with the full-KV answer: no labels needed."""
    if full_answer is None:
        raise CertkvError("utility agreement needs the full-KV answer")
    return _exact(str(prediction), str(full_answer))


#: name -> scorer(prediction, answers, full_answer)
UTILITIES: dict[str, Callable[[str, Sequence[str], str | None], float]] = {
    "exact_match": lambda pred, answers, full: exact_match(pred, answers),
    "contains": lambda pred, answers, full: contains(pred, answers),
    "f1": lambda pred, answers, full: f1(pred, answers),
    "rouge_l": lambda pred, answers, full: rouge_l(pred, answers),
    "agreement": lambda pred, answers, full: agreement(pred, full),
}


def score(name: str, prediction: str, answers: Sequence[str] | str = (), full_answer: str | None = None) -> float:
    """Score `prediction` with the utility `name`; the full answer is only read by agreement."""
    try:
        fn = UTILITIES[name]
    except KeyError:
        raise CertkvError(f"unknown utility {name!r}; use one of: {', '.join(UTILITIES)}") from None
    return fn(prediction, answers, full_answer)
