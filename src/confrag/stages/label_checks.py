"""What NQ_Rerank's labels need from the candidates: checked before the LLM loads, and named when a label rule or
the relevance control is left without a row.

On a corpus of your own that holds neither the questions' own paragraphs nor their answers (a FlashRAG corpus used as
given, `retrieval.words_per_passage=null`), the perfect-relevance control (`preferences.confidence=relevance`: Conf 1
on the question's own paragraph) has nothing to mark, and the control fine-tuned on relevance labels
(`preferences.relevance_baseline=true`: a passage holding a gold answer is positive) has no positive. Both failed only
after the probe, NQ_Rerank's confidence and the base reranker, as "data.train: no preference rows", naming neither
the control nor the reason. Both depend on the candidates alone (no LLM, no probe), so they are counted here on the
preference questions' candidates before anything loads; what only the probe's confidence decides (which questions
a rule keeps under `preferences.confidence=probe`) is named with its counts where it comes out empty.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from confrag.reranker.confidence_sources import relevance_shifts
from confrag.reranker.label_rules import RULES
from confrag.reranker.preferences import build_rows, relevance_rows, split_by_question
from confrag.retrieval.candidates import Candidates
from confrag.stages.nq_rerank import PreferenceSettings

log = logging.getLogger(__name__)

CONTROL = (
    "preferences.relevance_baseline=true (the control fine-tuned on relevance labels: a candidate holding a gold "
    "answer is positive)"
)


@dataclass(frozen=True)
class CandidateCounts:
    """Of a set of questions' candidates: how many questions lack what each control labels by."""

    questions: int
    without_own_paragraph: int  # no candidate from the question's own (gold) paragraph
    gold_unknown: int  # ... because the question's gold paragraph is not known at all (a corpus of your own)
    without_answer: int  # no candidate holds a gold answer
    only_answers: int  # every candidate holds one (no negative for the relevance labels)

    @classmethod
    def of(cls, candidates: Sequence[Candidates]) -> CandidateCounts:
        return cls(
            len(candidates),
            sum(not c.gold_retrieved for c in candidates),
            sum(c.gold_source is None for c in candidates),
            sum(not any(c.has_answer) for c in candidates),
            sum(all(c.has_answer) for c in candidates),
        )

    def answers_text(self) -> str:
        return (
            f"{self.without_answer} have no candidate holding a gold answer and {self.only_answers} only such "
            "candidates (a row needs one of each)"
        )


def check_label_sources(settings: PreferenceSettings, candidates: Sequence[Candidates], seed: int) -> None:
    """Refuse, before the LLM loads, the controls these candidates cannot label: `preferences.confidence=relevance`
    when no question has its own paragraph among its candidates (or the selection rule would keep an empty
    train or test split: its rows are known without the LLM), `preferences.relevance_baseline=true` when no
    question has both a candidate holding an answer and one without. `seed`: the run's (NQ_Rerank's split)."""
    counts = CandidateCounts.of(candidates)
    source_check = SOURCE_CHECKS.get(settings.confidence)
    problems = source_check(settings, candidates, counts, seed) if source_check else []
    if settings.relevance_baseline and not relevance_rows(candidates, {c.qid for c in candidates}, settings.top_k):
        problems.append(
            f"{CONTROL} has no row: of the {counts.questions} NQ_Rerank questions, {counts.answers_text()}. Use a "
            "corpus that holds the questions' answers, raise retrieval.top_n, or set preferences.relevance_baseline"
            "=false"
        )
    if problems:
        raise ValueError("; ".join(problems))


def _relevance_confidence_problems(
    settings: PreferenceSettings, candidates: Sequence[Candidates], counts: CandidateCounts, seed: int
) -> list[str]:
    missing, total = counts.without_own_paragraph, counts.questions
    head = (
        f"preferences.confidence=relevance needs each question's own paragraph among its candidates (Conf 1 on it, "
        f"0 elsewhere): {missing} of the {total} NQ_Rerank questions have none"
    )
    if missing == total:
        why = (
            " (their gold paragraph is not known: a corpus of your own names no question's paragraph)"
            if counts.gold_unknown == total
            else ""
        )
        return [
            f"{head}{why}, so the control has nothing to mark (rule sign keeps no question, rule rank would order "
            "ties by retrieval). Use the questions' own paragraphs as the corpus (leave dataset.corpus_path unset), "
            "a candidates file naming each question's gold_source, or a larger retrieval.top_n; or set "
            "preferences.confidence=probe"
        ]
    rule = RULES[settings.selection]
    if not rule.needs_answers:  # the rows are known now: the same rule, shifts and split as NQ_Rerank's
        rows, drops = build_rows(candidates, relevance_shifts(candidates), settings.reference, settings.top_k, rule.id)
        split = split_by_question([{"qid": c.qid} for c in candidates], settings.test_fraction, seed)
        test = {r["qid"] for r in split["test"]}
        n_test = sum(r["qid"] in test for r in rows)
        if not n_test or n_test == len(rows):
            return [
                f"{head}, and rule {rule.id} keeps {len(rows) - n_test} train and {n_test} test rows (dropped: "
                f"{drops}). Raise preferences.num_questions or retrieval.top_n, use a corpus holding the questions' "
                "own paragraphs, or set preferences.confidence=probe"
            ]
    if missing:
        log.warning("%s: rule sign drops them, rule rank labels their candidates by retrieval order", head)
    return []


# The confidence sources (`preferences.confidence`) whose labels the candidates alone decide, with their check.
SOURCE_CHECKS: dict[str, Callable[[PreferenceSettings, Sequence[Candidates], CandidateCounts, int], list[str]]] = {
    "relevance": _relevance_confidence_problems,
}


def checks_candidates(settings: PreferenceSettings) -> bool:
    """Whether `check_label_sources` has anything to check for these settings."""
    return settings.confidence in SOURCE_CHECKS or settings.relevance_baseline


def empty_split_message(settings: PreferenceSettings, questions: int, rows: dict[str, int], dropped: dict) -> str:
    """NQ_Rerank's selection rule left an empty train or test split: the rule, where its Conf came from, and the
    counts that led there."""
    kept = questions - sum(dropped.values())
    return (
        f"NQ_Rerank has {rows['train']} train and {rows['test']} test rows: label rule preferences.selection="
        f"{settings.selection} on Conf from preferences.confidence={settings.confidence} kept {kept} of its "
        f"{questions} questions (dropped: {dropped}); raise preferences.num_questions or retrieval.top_n, or try "
        "another preferences.reference / preferences.selection"
    )


def no_training_rows_message(settings: PreferenceSettings, questions: int, suffix: str = "") -> str:
    """The selection rule kept no row among an aligned reranker's training questions (a fold's, or what the dev
    split left): the rule, its confidence source and the count."""
    where = f" of fold {suffix.removeprefix('_fold')}" if suffix else ""
    return (
        f"label rule preferences.selection={settings.selection} on Conf from preferences.confidence="
        f"{settings.confidence} kept no row among the {questions} training questions{where}: raise "
        "preferences.num_questions, lower preferences.cross_fit or preferences.dev_fraction, or try another "
        "preferences.selection"
    )


def relevance_control_rows(
    candidates: Sequence[Candidates], qids: set[str], top_k: int, rule: str, suffix: str = ""
) -> list[dict]:
    """The relevance control's rows on `qids` (the training questions the selection rule kept rows for), refused
    with the counts when there are none (the row-list's "data.train: no preference rows" named neither)."""
    rows = relevance_rows(candidates, qids, top_k)
    if not rows:
        counts = CandidateCounts.of([c for c in candidates if c.qid in qids])
        where = f" of fold {suffix.removeprefix('_fold')}" if suffix else ""
        raise ValueError(
            f"{CONTROL} has no training row{where}: it trains on the {counts.questions} training questions that rule "
            f"{rule} kept rows for; of these, {counts.answers_text()}. Set preferences.relevance_baseline=false, or "
            "use a corpus that holds the questions' answers"
        )
    return rows
