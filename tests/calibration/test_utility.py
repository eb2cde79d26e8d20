"""Utilities follow their benchmarks' definitions and stay in [0, 1]."""

from __future__ import annotations

import doctest
import os
import random

import pytest

from certkv.calibration import answer_extraction, utility
from certkv.calibration.answer_extraction import extract_final_answer
from certkv.calibration.utility import (
    LABEL_FREE,
    UTILITIES,
    agreement,
    contains,
    exact_match,
    f1,
    final_agreement,
    final_answer,
    lcs_length,
    normalize_answer,
    normalize_final_answer,
    prefix_agreement,
    rouge_l,
    rouge_l_full,
    score,
    token_agreement,
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


def _brute_force_lcs(a: list[str], b: list[str]) -> int:
    """The longest subsequence of `a` that is one of `b`, by trying every subset of `a`."""
    best = 0
    for mask in range(1 << len(a)):
        sub = [x for i, x in enumerate(a) if mask >> i & 1]
        it = iter(b)
        if all(x in it for x in sub):
            best = max(best, len(sub))
    return best


def test_lcs_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.choice("abc") for _ in range(rng.randint(0, 7))]
        b = [rng.choice("abc") for _ in range(rng.randint(0, 7))]
        assert lcs_length(a, b) == _brute_force_lcs(a, b)


def test_agreement_uses_full_answer_not_labels():
    assert agreement("Paris.", "paris") == 1.0
    assert agreement("Rome", "Paris") == 0.0
    assert score("agreement", "Paris", [], full_answer="Paris") == 1.0
    with pytest.raises(CertkvError, match="full-KV answer"):
        score("agreement", "Paris", ["Paris"], full_answer=None)


def test_score_registry_and_bounds():
    assert set(UTILITIES) == {
        "exact_match", "contains", "f1", "rouge_l", "agreement",
        "prefix_agreement", "token_agreement", "rouge_l_full", "final_answer", "final_agreement",
    }
    rng = random.Random(1)
    words = ["the", "a", "cat", "dog", "42", "Paris", "x.", ""]
    for name in UTILITIES:
        for _ in range(100):
            pred = " ".join(rng.choice(words) for _ in range(rng.randint(0, 5)))
            refs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
            value = score(name, pred, refs, full_answer=refs[0])
            assert isinstance(value, float) and 0.0 <= value <= 1.0
            if name != "final_answer":  # it scores what it extracts from a reference, e.g. its last number
                assert score(name, refs[0], refs, full_answer=refs[0]) == 1.0  # a reference scores 1
    with pytest.raises(CertkvError, match="unknown utility"):
        score("bleu", "a", ["a"])
    with pytest.raises(CertkvError, match="lists none"):
        score("f1", "a", [])


def test_blank_references_do_not_make_every_prediction_right():
    from certkv.calibration.utility import contains

    assert contains("anything at all", ["", "4729"]) == 0.0
    assert contains("it is 4729", ["", "4729"]) == 1.0


# -- utilities for long outputs ---------------------------------------------------------------------


def test_the_docstring_examples_run():
    for module in (utility, answer_extraction):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted >= 5, (module.__name__, result)


def test_prefix_agreement_counts_words_before_the_first_divergence():
    full = "one two three four five"
    assert prefix_agreement(full, full) == 1.0
    assert prefix_agreement("zero two three four five", full) == 0.0  # divergence at 0
    assert prefix_agreement("one two THREE four five", full) == pytest.approx(2 / 5)  # case counts
    assert prefix_agreement("one two", full) == pytest.approx(2 / 5)  # stopped early
    assert prefix_agreement(full + " six seven", full) == pytest.approx(5 / 7)  # ran past the end
    assert prefix_agreement("one  two\nthree four five ", full) == 1.0  # spacing is not a divergence
    assert prefix_agreement("one two three four five.", full) == pytest.approx(4 / 5)  # punctuation is
    assert prefix_agreement("", "") == 1.0
    assert prefix_agreement("", full) == 0.0 and prefix_agreement(full, "") == 0.0


def test_prefix_agreement_matches_an_independent_common_prefix():
    rng = random.Random(2)
    for _ in range(300):
        full = [rng.choice("ab") for _ in range(rng.randint(0, 8))]
        pred = [rng.choice("ab") for _ in range(rng.randint(0, 8))]
        longest = max(len(full), len(pred))
        expected = 1.0 if longest == 0 else len(os.path.commonprefix([pred, full])) / longest
        assert prefix_agreement(" ".join(pred), " ".join(full)) == pytest.approx(expected)


def test_token_agreement_is_position_wise_over_the_longer_output():
    full = "one two three four"
    assert token_agreement(full, full) == 1.0
    assert token_agreement("one TWO three four", full) == pytest.approx(3 / 4)  # one word swapped
    assert token_agreement("zero two three four", full) == pytest.approx(3 / 4)  # divergence at 0 costs one word
    assert token_agreement("two three four", full) == 0.0  # a dropped word shifts every later one
    assert token_agreement("one two", full) == pytest.approx(2 / 4)  # missing words count
    assert token_agreement(full + " five six", full) == pytest.approx(4 / 6)  # extra words count
    assert token_agreement("", "") == 1.0 and token_agreement("", full) == 0.0 and token_agreement(full, "") == 0.0


def test_rouge_l_full_matches_a_brute_force_lcs():
    rng = random.Random(3)
    for _ in range(200):
        pred = [rng.choice(["p", "q", "r"]) for _ in range(rng.randint(0, 7))]
        full = [rng.choice(["p", "q", "r"]) for _ in range(rng.randint(0, 7))]
        lcs = _brute_force_lcs(pred, full)
        if not pred or not full:
            expected = float(pred == full)
        elif lcs == 0:
            expected = 0.0
        else:
            precision, recall = lcs / len(pred), lcs / len(full)
            expected = 2 * precision * recall / (precision + recall)
        text, full_text = " ".join(pred), " ".join(full)
        assert rouge_l_full(text, full_text) == pytest.approx(expected)
        assert rouge_l_full(text, full_text) == rouge_l(text, [full_text])  # rouge_l's definition


def test_extract_final_answer_rule():
    assert extract_final_answer("48 / 2 = 24 clips in May. 48 + 24 = 72\n#### 72") == "72"
    assert extract_final_answer("So THE ANSWER IS 12. Then we check it.") == "12."  # any case, first sentence
    assert extract_final_answer("Final answer: blue whale\nthanks") == "blue whale"  # up to the end of the line
    assert extract_final_answer("answer: 3\n#### 4") == "4"  # the last marker wins
    assert extract_final_answer("Answer:\n\n  Lisbon  \nmore") == "Lisbon"  # first non-empty line after it
    assert extract_final_answer("the answer is") == ""  # nothing after the marker
    assert extract_final_answer("answers are 5") == "5"  # not a marker: last number
    assert extract_final_answer("it cost $1,250.50 and 7 cents, then -3") == "-3"
    assert extract_final_answer("pages 3-5") == "5"  # a hyphen is not a minus
    assert extract_final_answer("total 1,250.50") == "1,250.50"
    assert extract_final_answer("first line\nlast line\n \n") == "last line"
    assert extract_final_answer("") == "" and extract_final_answer(" \n ") == ""


def test_final_answer_keeps_signs_and_decimal_points():
    assert normalize_final_answer("The Answer!") == normalize_answer("The Answer!")
    assert final_answer("so it is -5", ["-5"]) == 1.0 and final_answer("so it is -5", ["5"]) == 0.0
    assert final_answer("#### 3.5", ["35"]) == 0.0 and final_answer("#### 3.5", ["3.5"]) == 1.0
    assert final_answer("#### 1,250", ["1250"]) == 1.0
    assert final_answer("The answer is The Eiffel Tower.", ["eiffel tower"]) == 1.0
    assert final_answer("1984 was written by Orwell", ["1984"]) == 1.0  # the last number
    assert final_answer("Orwell wrote 1984", ["Orwell wrote 1984"]) == 0.0  # references are not extracted
    assert final_answer("", [""]) == 1.0 and final_answer("", ["x"]) == 0.0


def test_final_agreement_compares_the_extracted_answers():
    assert final_agreement("7 + 5 = 12\n#### 12", "Seven and five: the answer is 12.") == 1.0
    assert final_agreement("7 + 5 = 13\n#### 13", "7 + 5 = 12\n#### 12") == 0.0
    assert final_agreement("we get 12 then 13", "we get 13") == 1.0  # only the final answer counts
    assert final_agreement("", "") == 1.0 and final_agreement("", "12") == 0.0


@pytest.mark.parametrize("name", sorted(LABEL_FREE))
def test_label_free_utilities_need_the_full_answer_and_no_labels(name):
    assert LABEL_FREE <= set(UTILITIES)
    with pytest.raises(CertkvError, match=f"utility {name} needs the full-KV answer"):
        score(name, "a b", ["a b"], full_answer=None)
    assert score(name, "a b", [], full_answer="a b") == 1.0  # no references read


def test_references_are_required_by_final_answer():
    with pytest.raises(CertkvError, match="lists none"):
        score("final_answer", "#### 4", [], full_answer="#### 4")


@pytest.mark.parametrize("name", sorted(LABEL_FREE))
def test_label_free_loss_is_zero_for_the_full_output_and_bounded_otherwise(name):
    rng = random.Random(4)
    words = ["The", "answer", "is", "12.", "####", "7", "-3", "x", "\n", "a"]
    for _ in range(100):
        full = " ".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        cand = " ".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        utility_full = score(name, full, [], full_answer=full)  # calibration's full row
        copy = "".join(list(full))  # the candidate reproduced the full output
        assert utility_full - score(name, copy, [], full_answer=full) == 0.0
        loss = utility_full - score(name, cand, [], full_answer=full)
        assert utility_full == 1.0 and 0.0 <= loss <= 1.0
        if name in ("prefix_agreement", "token_agreement"):  # no loss exactly when the words are the same
            assert (loss == 0.0) == (cand.split() == full.split())


# -- ROUGE-L against the reference implementation --------------------------------------------------

_WORDS = ("cat", "sat", "on", "mat", "the", "a", "dog", "Ran", "fast,", "home.", "7", "x-ray", "an", "It's")


def _random_text(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 30)))


class _SquadTokens:
    """rouge-score's tokenizer interface over certkv's own tokens (SQuAD-normalised words)."""

    def tokenize(self, text: str) -> list[str]:
        return utility._tokens(text)


def test_rouge_l_equals_rouge_score_on_thousands_of_pairs():
    """certkv's ROUGE-L is the reference implementation's (Google's `rouge-score`: LCS F-measure,
    β = 1) on certkv's tokens, to the last bit but rounding, over 3000 random pairs that repeat
    words (long common subsequences), mix case and punctuation and sometimes normalise to nothing."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_SquadTokens())
    rng = random.Random(20261207)
    compared = 0
    for _ in range(3000):
        prediction, reference = _random_text(rng), _random_text(rng)
        if not normalize_answer(prediction) or not normalize_answer(reference):
            continue  # the documented difference: below
        expected = scorer.score(reference, prediction)["rougeL"].fmeasure
        assert rouge_l(prediction, reference) == pytest.approx(expected, rel=1e-12, abs=1e-12), (prediction, reference)
        assert rouge_l_full(prediction, reference) == pytest.approx(expected, rel=1e-12, abs=1e-12)
        compared += 1
    assert compared > 2500
    # Where one side normalises to no token both give 0; two empty outputs agree for certkv (1.0,
    # the full cache's blank answer matched) where rouge-score scores 0.
    assert rouge_l("the", "cat") == scorer.score("cat", "the")["rougeL"].fmeasure == 0.0
    assert rouge_l("a", "the") == 1.0 and scorer.score("the", "a")["rougeL"].fmeasure == 0.0


def test_rouge_l_equals_rouge_score_default_tokenizer_on_plain_words():
    """On lowercase alphanumeric words without articles the two tokenisers agree, so certkv's
    ROUGE-L is rouge-score's out of the box (no stemming) there."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    rng = random.Random(7)
    plain = ("cat", "sat", "on", "mat", "dog", "ran", "fast", "home", "7", "42")
    for _ in range(1000):
        prediction = " ".join(rng.choice(plain) for _ in range(rng.randint(1, 25)))
        reference = " ".join(rng.choice(plain) for _ in range(rng.randint(1, 25)))
        expected = scorer.score(reference, prediction)["rougeL"].fmeasure
        assert rouge_l(prediction, reference) == pytest.approx(expected, rel=1e-12, abs=1e-12)
