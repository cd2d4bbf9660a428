"""Conflicting contexts: gold passages with the answer swapped for another question's answer of the same kind."""

from __future__ import annotations

import pytest

from confrag.data.conflicts import answer_kind, build_conflicts, substitute_answers
from confrag.data.nq import Passage, QARow
from confrag.data.qa_metrics import has_answer


def row(qid, question, answers, title, text):
    return QARow(qid=qid, question=question, answers=tuple(answers), contexts=(Passage(title, text),))


ROWS = [
    row(
        "y1",
        "when did the berlin wall fall",
        ["1989"],
        "Berlin Wall",
        "The wall fell in 1989. By 1990 it was gone; 1989 is remembered.",
    ),
    row("y2", "when was the eiffel tower built", ["1889"], "Eiffel Tower", "Built for the 1889 World's Fair in Paris."),
    row(
        "n1",
        "who wrote hamlet",
        ["William Shakespeare", "Shakespeare"],
        "Hamlet",
        "Hamlet is a tragedy by William Shakespeare. SHAKESPEARE wrote it around 1600; Shakespearean drama followed.",
    ),
    row(
        "n2",
        "who painted the mona lisa",
        ["Leonardo da Vinci"],
        "Mona Lisa",
        "The Mona Lisa was painted by Leonardo da Vinci.",
    ),
    row("n3", "what is the capital of france", ["Paris"], "Paris", "Paris is the capital and largest city of France."),
    row(
        "s1",
        "who is spider-man's alter ego",
        ["Peter Parker"],
        "Spider-Man",
        "Spider-Man is the alias of Peter Parker.",
    ),
    row(
        "o1",
        "where is the gallbladder",
        ["beneath the liver"],
        "Gallbladder",
        "The gallbladder sits beneath the liver.",
    ),
    row("x1", "how many moons does mars have", ["two"], "Mars", "Mars has a pair of small moons, Phobos and Deimos."),
    row("d1", "when did deadpool 2 come out", ["May 18, 2018"], "Deadpool 2", "It was released on May 18, 2018."),
]


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        ("1989", "year"),
        ("May 18, 2018", "date"),
        ("18 May 2018", "date"),
        ("291 episodes", "number"),
        ("$1.5 million", "number"),
        ("William Shakespeare", "name"),
        ("Wilhelm Conrad Röntgen", "name"),
        ("beneath the liver", "other"),
        ("planner Raymond Unwin", "other"),
        ("12345", "number"),
    ],
)
def test_answer_kinds(answer, kind):
    assert answer_kind(answer) == kind


def test_substitution_is_case_insensitive_on_whole_words_longest_first():
    text, count = substitute_answers(
        "Shakespeare and william  shakespeare; SHAKESPEARE's Shakespearean",
        ["Shakespeare", "William Shakespeare"],
        "Marlowe",
    )
    assert text == "Marlowe and Marlowe; Marlowe's Shakespearean"
    assert count == 3
    assert substitute_answers("paid 1\\2 back", ["1\\2"], r"\g<0>")[0] == r"paid \g<0> back"  # taken literally


def test_conflicting_passages_support_another_answer_of_the_same_kind():
    conflicts = build_conflicts(ROWS, seed=0)
    by_qid = {example.qid: example for example in conflicts.examples}
    # "two" is not in the Mars passage; the only date has no other date to take a substitute from.
    assert conflicts.skipped == {"answer_not_in_passage": 1, "no_substitute": 1}
    assert set(by_qid) == {"y1", "y2", "n1", "n2", "n3", "s1", "o1"}
    donors = {r.qid: r for r in ROWS}
    for example in conflicts.examples:
        source = donors[example.qid]
        passage = f"{example.passage.title}\n{example.passage.text}"
        assert not has_answer(passage, source.answers)  # the gold answer is gone, title included
        assert has_answer(passage, [example.substitute])  # and the passage now supports another answer
        assert example.donor_qid != example.qid
        assert example.substitute in donors[example.donor_qid].answers
        assert answer_kind(example.substitute) == example.kind == answer_kind(example.replaced_answer)
        assert example.original == source.contexts[0] and example.answers == source.answers
        assert example.as_row() == QARow(example.qid, source.question, source.answers, (example.passage,))
    assert by_qid["y1"].substitute == "1889" and by_qid["y1"].replacements == 2
    assert by_qid["y1"].passage.text == "The wall fell in 1889. By 1990 it was gone; 1889 is remembered."
    hamlet = by_qid["n1"]
    assert hamlet.replacements == 2 and "Shakespearean" in hamlet.passage.text  # whole words only
    assert by_qid["n3"].passage.title == by_qid["n3"].substitute  # the title leaked the answer too
    assert "Spider-Man" in by_qid["s1"].passage.title  # only the answer changes
    assert conflicts.rows() == [example.as_row() for example in conflicts.examples]


def test_substitutes_are_seeded():
    names = [
        row(f"n{i}", f"who is person {i}", [f"Person Number{i}"], "People", f"It was Person Number{i} indeed.")
        for i in range(8)
    ]
    first = build_conflicts(names, seed=3)
    assert [e.substitute for e in first.examples] == [e.substitute for e in build_conflicts(names, seed=3).examples]
    choices = {tuple(e.substitute for e in build_conflicts(names, seed=s).examples) for s in range(5)}
    assert len(choices) > 1


def test_a_substitute_containing_a_gold_answer_is_not_used():
    rows = [
        row("a", "which state is seattle in", ["Washington"], "Seattle", "Seattle is in Washington."),
        row(
            "b", "where is the white house", ["Washington D.C."], "White House", "The White House is in Washington D.C."
        ),
    ]
    conflicts = build_conflicts(rows, seed=0)
    # Each other's answer contains "Washington": no workable substitute for either.
    assert conflicts.examples == [] and conflicts.skipped == {"no_substitute": 2}


def test_conflicts_on_real_nq_rows(nq_rows):
    conflicts = build_conflicts(nq_rows, seed=0)
    assert len(conflicts.examples) + sum(conflicts.skipped.values()) == len(nq_rows)
    assert len(conflicts.examples) >= 0.8 * len(nq_rows)
    for example in conflicts.examples:
        assert not has_answer(f"{example.passage.title}\n{example.passage.text}", example.answers)


def test_bad_seed():
    with pytest.raises(ValueError, match="seed must be an integer"):
        build_conflicts(ROWS, seed="0")
