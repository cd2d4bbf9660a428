"""Answer-correctness metrics: SQuAD/DPR normalization, has_answer, exact_match, token_f1."""

from __future__ import annotations

import pytest

from confrag.data.qa_metrics import exact_match, has_answer, normalize_answer, token_f1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Beatles!", "beatles"),
        ("  An  apple,   a day ", "apple day"),
        ("Theatre of the absurd", "theatre of absurd"),  # "the" only as a whole word
        ("A.B.C.", "abc"),  # ASCII punctuation is removed, not replaced by a space
        ("Eminem's", "eminems"),
        ("Carbon\xa0dioxide", "carbon dioxide"),  # NFKC turns the no-break space into a space
        ("１９０１", "1901"),  # NFKC folds full-width digits
        ("Wilhelm Röntgen", "wilhelm röntgen"),  # letters with diacritics are kept
        ("narrator—Orwell", "narrator—orwell"),  # SQuAD keeps non-ASCII punctuation
        ("*", ""),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_normalize_answer_composes_decomposed_accents() -> None:
    decomposed = "Ro\u0308ntgen"  # o + combining diaeresis
    assert normalize_answer(decomposed) == normalize_answer("Röntgen") == "röntgen"


def test_has_answer_finds_answer_in_sentence() -> None:
    assert has_answer("The first prize went to Wilhelm Röntgen.", ["Wilhelm Röntgen"])


def test_has_answer_ignores_case_articles_and_punctuation() -> None:
    assert has_answer("It was THE Beatles, of course!", ["Beatles"])
    assert has_answer("Super Bowl LII", ["Super Bowl LII,"])
    assert has_answer("They won in 2017.", ["Super Bowl LII,", "2017"])


def test_has_answer_matches_on_token_boundaries_only() -> None:
    assert not has_answer("It happened in 19012.", ["1901"])
    assert not has_answer("a catalogue", ["cat"])
    assert has_answer("It happened in 1901.", ["1901"])
    assert has_answer("1901", ["1901"])


def test_has_answer_false_when_absent() -> None:
    assert not has_answer("I do not know.", ["Paris", "Lyon"])
    assert not has_answer("", ["Paris"])


def test_answer_that_normalizes_to_empty_never_matches() -> None:
    assert not has_answer("anything at all", ["*"])
    assert not exact_match("", ["*"])
    assert has_answer("the symbol ×", ["*", "the symbol ×"])


def test_exact_match() -> None:
    assert exact_match("The Eiffel Tower.", ["eiffel tower"])
    assert exact_match("paris", ["Lyon", "Paris"])
    assert not exact_match("Paris, France", ["Paris"])


def test_token_f1_values() -> None:
    assert token_f1("Paris", ["Paris"]) == 1.0
    assert token_f1("London", ["Paris"]) == 0.0
    # 1 shared token; precision 1/2, recall 1/1 -> F1 2/3.
    assert token_f1("Paris France", ["Paris"]) == pytest.approx(2 / 3)
    # Maximum over answers, and articles do not count as tokens.
    assert token_f1("the Paris France", ["London", "Paris France"]) == 1.0


def test_token_f1_counts_repeated_tokens_once_per_occurrence() -> None:
    # Common multiset {new: 1}: precision 1/2, recall 1/2.
    assert token_f1("new new", ["new york"]) == pytest.approx(0.5)


def test_token_f1_empty_response_scores_zero() -> None:
    assert token_f1("", ["Paris"]) == 0.0


@pytest.mark.parametrize("metric", [has_answer, exact_match, token_f1])
def test_empty_answers_rejected(metric) -> None:
    with pytest.raises(ValueError, match="at least one answer"):
        metric("Paris", [])


@pytest.mark.parametrize("metric", [has_answer, exact_match, token_f1])
def test_single_string_answers_rejected(metric) -> None:
    # Iterating "Paris" would score the characters P, a, r, i, s.
    with pytest.raises(TypeError, match="not a single str"):
        metric("a", "Paris")


def test_non_string_answer_rejected_with_index() -> None:
    with pytest.raises(TypeError, match=r"answers\[1\] must be a str"):
        has_answer("1901", ["1901", 1901])


def test_has_answer_dpr_splits_what_squad_normalization_glues():
    from confrag.data.qa_metrics import dpr_tokens, has_answer_dpr

    assert dpr_tokens("Eminem's 1914–1918 Café") == ["eminem", "'", "s", "1914", "–", "1918", "cafe\u0301"]
    # The SQuAD normalization makes "eminems" and "19141918"; DPR's tokens keep the answer whole.
    assert has_answer_dpr("Eminem's album", ["Eminem"]) and not has_answer("Eminem's album", ["Eminem"])
    assert has_answer_dpr("the war of 1914–1918", ["1914"]) and not has_answer("the war of 1914–1918", ["1914"])
    assert has_answer_dpr("Le Café de Flore", ["café"]) and not has_answer_dpr("Cafeteria", ["cafe"])
    assert dpr_tokens("*") == ["*"] and has_answer_dpr("a * b", ["*"])  # punctuation is a token of its own
    assert not has_answer_dpr("abc", ["*"])
    with pytest.raises(TypeError):
        has_answer_dpr("x", "x")


def test_has_answer_dpr_finds_every_gold_paragraphs_answer_in_the_shared_sample():
    """The counts the module docstring states: DPR's rule finds the answer in every gold paragraph of the
    shared NQ sample, the normalized-substring rule in 2,134 of 2,155."""
    from confrag.data.nq import default_questions_path, load_questions_jsonl
    from confrag.data.qa_metrics import has_answer_dpr

    path = default_questions_path()
    if not path.is_file():
        pytest.skip(f"the shared NQ sample is not at {path}")
    rows = load_questions_jsonl(path)
    assert len(rows) == 2155
    assert sum(has_answer_dpr(r.contexts[0].text, r.answers) for r in rows) == 2155
    assert sum(has_answer(r.contexts[0].text, r.answers) for r in rows) == 2134
