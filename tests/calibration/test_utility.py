"""Utilities follow their benchmarks' definitions and stay in [0, 1]."""

from __future__ import annotations

import random

import pytest

from certkv.calibration.utility import (
    UTILITIES,
    agreement,
    contains,
    exact_match,
    f1,
    lcs_length,
    normalize_answer,
    rouge_l,
    score,
)
from certkv.errors import CertkvError


def test_normalize_answer_is_squad():
    assert normalize_answer("  The Quick, brown fox!  ") == "quick brown fox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theory") == "theory"  # articles only as whole words


def test_exact_match():
    assert exact_match("The answer is 42.", ["42"]) == 0.0
    assert exact_match("the 42.", ["42"]) == 1.0
    assert exact_match("Paris", ["London", "paris"]) == 1.0
    assert exact_match("Paris", "paris") == 1.0


def test_contains_is_ruler_string_match():
    assert contains("The special magic number is 7421.", ["7421"]) == 1.0
    assert contains("the code is ABC-12", ["abc-12"]) == 1.0
    assert contains("the value is 12", ["123", "12"]) == 1.0  # best over references
    assert contains("nothing here", ["7421"]) == 0.0


def test_f1_squad_values():
    assert f1("the cat sat", ["cat sat on mat"]) == pytest.approx(2 * (2 / 2) * (2 / 4) / (2 / 2 + 2 / 4))
    assert f1("x b b", ["b b c"]) == pytest.approx(2 / 3)  # token multiset overlap: b, b
    assert f1("a b b", ["b b c"]) == pytest.approx(0.8)  # "a" is an article: dropped
    assert f1("x", ["y", "x"]) == 1.0
    assert f1("", [""]) == 1.0
    assert f1("the", ["cat"]) == 0.0  # normalises to empty vs non-empty


def test_rouge_l():
    assert lcs_length("a b c d e".split(), "a c e x".split()) == 3
    # pred "p q r s t" (5 tokens), ref "p r t x" (4): LCS 3, P = 3/5, R = 3/4
    assert rouge_l("p q r s t", ["p r t x"]) == pytest.approx(2 * 0.6 * 0.75 / (0.6 + 0.75))
    assert rouge_l("police killed the gunman", ["police kill the gunman"]) == pytest.approx(2 / 3)
    assert rouge_l("same words", ["Same words."]) == 1.0
    assert rouge_l("x y", ["z"]) == 0.0


def test_lcs_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.choice("abc") for _ in range(rng.randint(0, 7))]
        b = [rng.choice("abc") for _ in range(rng.randint(0, 7))]
        best = 0
        for mask in range(1 << len(a)):
            sub = [x for i, x in enumerate(a) if mask >> i & 1]
            it = iter(b)
            if all(x in it for x in sub):
                best = max(best, len(sub))
        assert lcs_length(a, b) == best


def test_agreement_uses_full_answer_not_labels():
    assert agreement("Paris.", "paris") == 1.0
    assert agreement("Rome", "Paris") == 0.0
    assert score("agreement", "Paris", [], full_answer="Paris") == 1.0
    with pytest.raises(CertkvError, match="full-KV answer"):
        score("agreement", "Paris", ["Paris"], full_answer=None)


def test_score_registry_and_bounds():
    assert set(UTILITIES) == {"exact_match", "contains", "f1", "rouge_l", "agreement"}
    rng = random.Random(1)
    words = ["the", "a", "cat", "dog", "42", "Paris", "x.", ""]
    for name in UTILITIES:
        for _ in range(100):
            pred = " ".join(rng.choice(words) for _ in range(rng.randint(0, 5)))
            refs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
            value = score(name, pred, refs, full_answer=refs[0])
            assert isinstance(value, float) and 0.0 <= value <= 1.0
            assert score(name, refs[0], refs, full_answer=refs[0]) == 1.0  # a reference scores 1
    with pytest.raises(CertkvError, match="unknown utility"):
        score("bleu", "a", ["a"])
    with pytest.raises(CertkvError, match="lists none"):
        score("f1", "a", [])


def test_blank_references_do_not_make_every_prediction_right():
    from certkv.calibration.utility import contains

    assert contains("anything at all", ["", "4729"]) == 0.0
    assert contains("it is 4729", ["", "4729"]) == 1.0
