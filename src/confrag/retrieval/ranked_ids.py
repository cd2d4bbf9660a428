"""Candidates from another tool's retrieval: ranked passage ids per question, resolved against the corpus.

Formats (`retrieval.candidates_format`; `auto` decides from the file):

- `confrag`: this project's candidates file, texts included (`confrag.retrieval.candidates`).
- `flashrag`: FlashRAG's retrieval output: its saved dataset (`intermediate_data.json`, a JSON list, or a
  JSONL file, of `{"id", "question", "golden_answers", "output": {"retrieval_result": [{"id", "contents"},
  ...]}}`), or its retrieval cache (`{"<question>": [{"id", "contents"}, ...]}`, joined by question text).
  Each `contents` must be the corpus's passage of that id, as given (`retrieval.words_per_passage: null`).
- `ranked_ids`: any file of ranked passage ids per question: JSONL `{"qid": str, "ids": [str, ...]}` (also
  `"id"` for the question, `"question"`, and `"scores"` aligned with the ids), or a TREC run file
  (`qid Q0 docid rank score tag` per line, any suffix but .json / .jsonl; ordered by score, as trec_eval reads
  it: repeated or contradicting ranks are named in a warning, a passage twice for one question refused).

Every id must name a passage of the corpus (with `words_per_passage: null` a document's id; else
`<document id>#<chunk>`); an unknown id, a text that differs from the corpus's, a question of the data
the file lacks, or a question under a qid that is not the data's is refused, naming the file and line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confrag.data.jsonl import DataFormatError, numbered_lines, read_jsonl
from confrag.data.nq import QARow
from confrag.infra import checks
from confrag.retrieval.candidates import Candidates, make_candidates, same_question
from confrag.retrieval.corpus import Corpus, CorpusPassage

CANDIDATES_FORMATS = ("auto", "confrag", "flashrag", "ranked_ids")
_RANKED_FIELDS = '{"qid": str, "ids": [str, ...], "scores": [float, ...] (optional), "question": str (optional)}'
_FLASHRAG_FIELDS = '{"id", "question", "output": {"retrieval_result": [{"id", "contents"}, ...]}}'
SHOWN = 3

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankedList:
    """One question's ranked ids as a file gives them."""

    qid: str | None  # None: joined by question text (FlashRAG's retrieval cache)
    question: str | None
    ids: list[str]
    scores: list[float]
    contents: list[str] | None  # the file's text of each passage (FlashRAG), checked against the corpus
    where: str  # file and line


def detect_candidates_format(path: str | Path) -> str:
    """`confrag`, `flashrag` or `ranked_ids`, from the suffix and the first record."""
    path = Path(path)
    name = path.name.lower()
    if name.endswith(".json"):
        return "flashrag"
    if not name.endswith((".jsonl", ".jsonl.gz")):
        return "ranked_ids"  # a TREC run file
    with contextlib.closing(read_jsonl(path, "a JSON object per line")) as lines:
        for _, obj in lines:
            if isinstance(obj, Mapping) and "contexts" in obj:
                return "confrag"
            if isinstance(obj, Mapping) and "output" in obj:
                return "flashrag"
            return "ranked_ids"
    raise DataFormatError(f"{path}: no records")


def _ids(value: Any, where: str, field: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise DataFormatError(f'{where}: field "{field}" must be a non-empty list of passage ids; got {value!r}')
    return [
        checks.identifier(v, f'{where}: field "{field}" item {j}', error=DataFormatError) for j, v in enumerate(value)
    ]


def _ranked_record(obj: Any, where: str) -> RankedList:
    if not isinstance(obj, Mapping):
        raise DataFormatError(f"{where}: each line must be a JSON object {_RANKED_FIELDS}")
    key = "qid" if "qid" in obj else "id"
    qid = checks.identifier(obj.get(key), f'{where}: field "{key}"', error=DataFormatError)
    field = next((f for f in ("ids", "pids", "docids") if f in obj), "ids")
    ids = _ids(obj.get(field), where, field)
    scores = obj.get("scores")
    if scores is None:
        scores = [float(len(ids) - j) for j in range(len(ids))]  # rank order as the score
    elif not isinstance(scores, list) or len(scores) != len(ids):
        raise DataFormatError(f'{where}: field "scores" must hold one number per id ({len(ids)}); got {scores!r}')
    for j, s in enumerate(scores):
        checks.number(s, f'{where}: field "scores" item {j}', error=DataFormatError)
    question = obj.get("question")
    text = question if isinstance(question, str) else None
    return RankedList(qid, text, ids, [float(s) for s in scores], None, where)


def _trec_lists(path: Path) -> list[RankedList]:
    """A TREC run file's lists, each ordered by score, best first, as trec_eval orders them (it reads no rank):
    repeated ranks, or ranks that contradict the scores, are resolved by the scores (ties by rank, then line) and
    named in a warning; a passage listed twice for one question is refused naming both lines. Lines are decoded
    one at a time, so a byte that is not UTF-8 is named by file and line."""
    rows: dict[str, list[tuple[float, int, int, str]]] = {}
    seen: dict[tuple[str, str], int] = {}
    for lineno, line in numbered_lines(path, any_name=True):
        if not line.strip():
            continue
        parts = line.split()
        try:
            qid, _, docid, rank, score = parts[0], parts[1], parts[2], int(parts[3]), float(parts[4])
        except (IndexError, ValueError):
            raise DataFormatError(
                f"{path}, line {lineno}: a TREC run line is `qid Q0 docid rank score tag`; got {line.strip()[:80]!r}"
            ) from None
        if not math.isfinite(score):
            raise DataFormatError(f"{path}, line {lineno}: score {parts[4]!r} is not a finite number")
        if (qid, docid) in seen:
            raise DataFormatError(
                f"{path}, line {lineno}: passage {docid!r} of question {qid!r} again (first at line "
                f"{seen[qid, docid]}); one line per passage and question"
            )
        seen[qid, docid] = lineno
        rows.setdefault(qid, []).append((score, rank, lineno, docid))
    if not rows:
        raise DataFormatError(f"{path}: no lines; a TREC run file holds `qid Q0 docid rank score tag` per line")
    lists, reordered = [], []
    for qid, hits in rows.items():
        by_score = sorted(hits, key=lambda h: (-h[0], h[1], h[2]))
        ranks = [h[1] for h in hits]
        if len(set(ranks)) < len(ranks) or [h[1] for h in by_score] != sorted(ranks):
            reordered.append(qid)
        first = min(h[2] for h in hits)
        lists.append(
            RankedList(qid, None, [h[3] for h in by_score], [h[0] for h in by_score], None, f"{path}, line {first}")
        )
    if reordered:
        log.warning(
            "%s: %d of %d questions have repeated ranks or ranks that contradict their scores (e.g. %s): ordered by "
            "score, best first, as trec_eval does (ties by rank, then line)",
            path,
            len(reordered),
            len(rows),
            ", ".join(repr(q) for q in reordered[:SHOWN]),
        )
    return lists


def _flashrag_docs(docs: Any, where: str) -> tuple[list[str], list[str], list[float]]:
    if not isinstance(docs, list) or not docs:
        raise DataFormatError(f'{where}: the retrieval result must be a non-empty list of {{"id", "contents"}}')
    ids, contents, scores = [], [], []
    for j, doc in enumerate(docs):
        if not isinstance(doc, Mapping) or not isinstance(doc.get("contents"), str):
            raise DataFormatError(f'{where}: retrieval result {j} must be an object {{"id", "contents": str}}')
        ids.append(checks.identifier(doc.get("id"), f'{where}: retrieval result {j} "id"', error=DataFormatError))
        contents.append(doc["contents"])
        score = doc.get("score", len(docs) - j)
        scores.append(float(checks.number(score, f'{where}: retrieval result {j} "score"', error=DataFormatError)))
    return ids, contents, scores


def _flashrag_item(obj: Any, where: str) -> RankedList:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("output"), Mapping):
        raise DataFormatError(f"{where}: each item must be FlashRAG's {_FLASHRAG_FIELDS}")
    qid = checks.identifier(obj.get("id"), f'{where}: field "id"', error=DataFormatError)
    ids, contents, scores = _flashrag_docs(obj["output"].get("retrieval_result"), where)
    question = obj.get("question")
    return RankedList(qid, question if isinstance(question, str) else None, ids, scores, contents, where)


def _flashrag_lists(path: Path) -> list[RankedList]:
    if path.name.lower().endswith((".jsonl", ".jsonl.gz")):
        with contextlib.closing(read_jsonl(path, f"FlashRAG's {_FLASHRAG_FIELDS}")) as lines:
            return [_flashrag_item(obj, f"{path}, line {n}") for n, obj in lines]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise DataFormatError(f"{path}: not a readable JSON file ({err})") from None
    if isinstance(data, list):  # the saved dataset (intermediate_data.json)
        return [_flashrag_item(obj, f"{path}, item {i}") for i, obj in enumerate(data)]
    if isinstance(data, Mapping):  # the retrieval cache: question -> documents
        out = []
        for i, (question, docs) in enumerate(data.items()):
            ids, contents, scores = _flashrag_docs(docs, f"{path}, entry {i} ({question[:40]!r})")
            out.append(RankedList(None, question, ids, scores, contents, f"{path}, entry {i}"))
        return out
    raise DataFormatError(f"{path}: expected FlashRAG's saved dataset (a list) or retrieval cache (an object)")


def read_ranked_lists(path: str | Path, candidates_format: str = "auto") -> list[RankedList]:
    """Every question's ranked ids of a `flashrag` or `ranked_ids` file, checked as read."""
    checks.choice(candidates_format, "candidates_format", CANDIDATES_FORMATS)
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"candidates file {path} not found; set it with retrieval.candidates_path")
    fmt = detect_candidates_format(path) if candidates_format == "auto" else candidates_format
    if fmt == "flashrag":
        lists = _flashrag_lists(path)
    elif path.name.lower().endswith((".jsonl", ".jsonl.gz")):
        with contextlib.closing(read_jsonl(path, _RANKED_FIELDS)) as lines:
            lists = [_ranked_record(obj, f"{path}, line {n}") for n, obj in lines]
    else:
        lists = _trec_lists(path)
    if not lists:
        raise DataFormatError(f"{path}: no questions")
    seen: dict[str, str] = {}
    for item in lists:
        key = item.qid if item.qid is not None else f"question {item.question!r}"
        if key in seen:
            raise DataFormatError(f"{item.where}: {key} again (first at {seen[key]}); one ranked list per question")
        seen[key] = item.where
    return lists


def check_against_corpus(lists: Sequence[RankedList], corpus: Corpus, source: str) -> None:
    """Every id a passage of `corpus`; every text the file gives equal to the corpus's (DataFormatError naming
    the file, line and id of the first SHOWN offenders)."""
    by_pid = {p.pid: p for p in corpus.passages}
    unknown = [(item.where, pid) for item in lists for pid in item.ids if pid not in by_pid]
    if unknown:
        split = any("#" in p.pid for p in corpus.passages[:1])
        hint = (
            " The corpus is split into passages `<document id>#<chunk>`: set retrieval.words_per_passage=null to "
            "keep its documents as given, under their own ids"
            if split
            else ""
        )
        named = "; ".join(f"{where}: id {pid!r}" for where, pid in unknown[:SHOWN])
        raise DataFormatError(
            f"{source}: {len(unknown)} passage id(s) are not in the corpus of {len(corpus)} passages ({named}).{hint}"
        )
    differ = [
        (item.where, pid)
        for item in lists
        for pid, text in zip(item.ids, item.contents or ())
        if _normal(text) != _normal(_flashrag_contents(by_pid[pid]))
    ]
    if differ:
        named = "; ".join(f"{where}: id {pid!r}" for where, pid in differ[:SHOWN])
        raise DataFormatError(
            f"{source}: {len(differ)} passage(s) hold another text than the corpus's passage of the same id "
            f"({named}); the file was retrieved from another corpus or version"
        )


def _flashrag_contents(passage: CorpusPassage) -> str:
    return f"{passage.title}\n{passage.text}" if passage.title else passage.text


def _normal(text: str) -> str:
    title, _, body = text.partition("\n") if "\n" in text else ("", "", text)
    return " ".join(f"{title.strip().strip(chr(34))} {body}".split())


def check_questions(lists: Sequence[RankedList], rows: Sequence[QARow], source: str) -> None:
    """Every list names a question of the data (by qid, or by text for a file without qids), and a list that
    gives its question gives the data's: a file retrieved for another question set is refused before any stage
    (naming the file, line and question). Which questions a stage draws is known later; one without a list is
    refused there (`ranked_candidates`)."""
    by_qid = {row.qid: row for row in rows}
    texts = {" ".join(row.question.lower().split()) for row in rows}
    problems = []
    for item in lists:
        if item.qid is None:
            if " ".join((item.question or "").lower().split()) not in texts:
                problems.append(f"{item.where}: question {item.question!r} is not in the data")
        elif item.qid not in by_qid:
            problems.append(f"{item.where}: qid {item.qid!r} is not in the data")
        elif item.question is not None and not same_question(item.question, by_qid[item.qid].question):
            problems.append(
                f"{item.where}: qid {item.qid!r} asks {item.question!r}, the data {by_qid[item.qid].question!r}"
            )
    if problems:
        raise DataFormatError(
            f"{source}: {len(problems)} of its {len(lists)} questions do not match the data's "
            f"({'; '.join(problems[:SHOWN])}); it was retrieved for another question set or version"
        )


def ranked_candidates(
    rows: Sequence[QARow], lists: Sequence[RankedList], corpus: Corpus, source: str
) -> list[Candidates]:
    """Each row's candidates: its ranked list (by qid, or by question text for a file without qids) resolved
    to the corpus's passages. Refuses a row without a list, and a list whose question is not the row's."""
    check_against_corpus(lists, corpus, source)
    by_pid = {p.pid: p for p in corpus.passages}
    by_qid = {item.qid: item for item in lists if item.qid is not None}
    by_text = {" ".join(item.question.lower().split()): item for item in lists if item.qid is None and item.question}
    found, missing, differ = [], [], []
    for row in rows:
        item = by_qid.get(row.qid) or by_text.get(" ".join(row.question.lower().split()))
        if item is None:
            missing.append(row.qid)
            continue
        if item.question is not None and not same_question(item.question, row.question):
            differ.append(f"{item.where}: qid {row.qid!r} asks {item.question!r}, the data {row.question!r}")
        found.append(
            make_candidates(
                row.qid,
                row.question,
                row.answers,
                [by_pid[i] for i in item.ids],
                item.scores,
                corpus.gold_source_of.get(row.qid),
            )
        )
    if missing:
        raise DataFormatError(
            f"{source}: no ranked list for {len(missing)} of {len(rows)} questions, e.g. {missing[:SHOWN]}"
        )
    if differ:
        shown = "; ".join(differ[:SHOWN])
        raise DataFormatError(f"{source}: {len(differ)} question(s) differ from the data's: {shown}")
    return found
