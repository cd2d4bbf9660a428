"""Retrieval: passage splitting, corpora, BM25 and dense retrievers, candidate contexts and their files."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest

from confrag.data import DataFormatError, Passage, QARow, default_questions_path, load_questions_jsonl
from confrag.infra.sharded import ShardedArtifact
from confrag.retrieval import (
    BM25Retriever,
    Candidates,
    CandidatesMismatchError,
    Corpus,
    CorpusPassage,
    DenseRetriever,
    MeanPoolEncoder,
    corpus_from_gold_paragraphs,
    default_model_dir,
    load_candidates_jsonl,
    load_corpus_jsonl,
    match_candidates,
    retrieve_candidates,
    save_candidates_jsonl,
    split_passages,
    validate_candidates_jsonl,
    validate_corpus_jsonl,
)
from confrag.retrieval.candidates import make_candidates
from confrag.retrieval.corpus import passages_fingerprint

TOY_DOCS = [
    ("Photosynthesis", "Plants convert sunlight, water and carbon dioxide into glucose and oxygen in their leaves."),
    (
        "Eiffel Tower",
        "The wrought iron lattice tower in Paris was designed by the engineering company of Gustave Eiffel.",
    ),
    ("Mount Everest", "Earth's highest mountain above sea level lies in the Mahalangur Himal range of the Himalayas."),
    ("Python", "A high-level general-purpose programming language whose design emphasizes code readability."),
    ("Great Barrier Reef", "The world's largest coral reef system is located off the coast of Queensland, Australia."),
]


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def toy_corpus() -> Corpus:
    passages = [CorpusPassage(pid=f"d{i}#0", title=t, text=x, source_id=f"d{i}") for i, (t, x) in enumerate(TOY_DOCS)]
    return Corpus(passages=passages, gold_source_of={}, fingerprint=passages_fingerprint(passages))


def write_lines(path: Path, lines: list[str]) -> Path:
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


@pytest.fixture(scope="module")
def dense_toy() -> DenseRetriever:
    return DenseRetriever(toy_corpus(), progress=False)


# ---------------------------------------------------------------- splitting


def test_split_counts_words_and_names_passages() -> None:
    passages = split_passages("T", words(250), "doc7")
    assert [len(p.text.split()) for p in passages] == [100, 100, 50]
    assert [p.pid for p in passages] == ["doc7#0", "doc7#1", "doc7#2"]
    assert {(p.title, p.source_id) for p in passages} == {("T", "doc7")}
    # Chunks are consecutive and lose no word.
    assert " ".join(p.text for p in passages) == words(250)


def test_split_merges_short_tail_and_keeps_long_one() -> None:
    assert [len(p.text.split()) for p in split_passages("", words(219), "d")] == [100, 119]
    assert [len(p.text.split()) for p in split_passages("", words(220), "d")] == [100, 100, 20]
    # A short document is one passage, however short.
    assert [len(p.text.split()) for p in split_passages("", words(7), "d")] == [7]
    assert split_passages("", "  \n ", "d") == []
    # Whitespace runs collapse, as in DPR's passages.
    assert split_passages("", "a  b\n\tc", "d")[0].text == "a b c"


def test_split_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match=r"^words_per_passage.*>= 1.*0"):
        split_passages("", words(10), "d", words_per_passage=0)


# ---------------------------------------------------------------- corpora


def test_nq_corpus_collapses_shared_paragraphs_and_keeps_gold_mapping() -> None:
    shared = Passage("Shared", words(130))
    rows = [
        QARow("q1", "first?", ("a",), (shared,)),
        QARow("q2", "second?", ("b",), (Passage("Own", words(30)),)),
        QARow("q3", "third?", ("c",), (shared,)),  # same paragraph as q1
        QARow("q4", "no gold?", ("d",), ()),
    ]
    corpus = corpus_from_gold_paragraphs(rows)
    assert [p.pid for p in corpus.passages] == ["q1#0", "q1#1", "q2#0"]
    assert corpus.gold_source_of == {"q1": "q1", "q2": "q2", "q3": "q1"}
    # The fingerprint follows the passages: a changed paragraph or split size gives another key.
    changed = [rows[0], QARow("q2", "second?", ("b",), (Passage("Own", words(31)),))]
    assert corpus_from_gold_paragraphs(rows).fingerprint == corpus.fingerprint
    assert corpus_from_gold_paragraphs(changed).fingerprint != corpus.fingerprint
    assert corpus_from_gold_paragraphs(rows, words_per_passage=50).fingerprint != corpus.fingerprint


def test_nq_corpus_of_shared_file_has_its_36_duplicates() -> None:
    rows = load_questions_jsonl(default_questions_path())
    corpus = corpus_from_gold_paragraphs(rows)
    assert len(corpus.gold_source_of) == len(rows)
    assert len(rows) - len(set(corpus.gold_source_of.values())) == 36
    assert len({p.pid for p in corpus.passages}) == len(corpus.passages)


def test_nq_corpus_without_paragraphs_is_refused() -> None:
    with pytest.raises(DataFormatError, match="ctxs"):
        corpus_from_gold_paragraphs([QARow("q", "why?", ("a",), ())])


def test_corpus_jsonl_loads_and_splits(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "corpus.jsonl.gz",
        [
            json.dumps({"id": "a", "title": "A", "text": words(150)}),
            "",
            json.dumps({"id": "b", "title": "B", "text": "short text"}),
        ],
    )
    corpus = load_corpus_jsonl(path)
    assert [(p.pid, p.source_id, len(p.text.split())) for p in corpus.passages] == [
        ("a#0", "a", 100),
        ("a#1", "a", 50),
        ("b#0", "b", 2),
    ]
    assert corpus.gold_source_of == {}


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "x", "title": "X", "text": ', r"line 2: malformed JSON"),
        ('["x", "X", "text"]', r'line 2: each line must be a JSON object \{"id"'),
        ('{"id": "x", "title": "X"}', r'line 2: field "text" must be a non-empty string'),
        ('{"id": true, "title": "X", "text": "t"}', r'line 2: field "id" must be a non-empty string'),
        ('{"id": "x", "title": 3, "text": "t"}', r'line 2: field "title" must be a string'),
    ],
)
def test_malformed_corpus_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write_lines(tmp_path / "corpus.jsonl", [json.dumps({"id": "ok", "title": "", "text": "fine"}), line])
    with pytest.raises(DataFormatError, match=re.escape(str(path)) + ", " + message):
        load_corpus_jsonl(path)


def test_duplicate_corpus_id_names_both_lines(tmp_path: Path) -> None:
    doc = json.dumps({"id": "x", "title": "", "text": "t"})
    path = write_lines(tmp_path / "corpus.jsonl", [doc, json.dumps({"id": "y", "title": "", "text": "u"}), doc])
    with pytest.raises(DataFormatError, match=r"line 3: duplicate id 'x' \(first at line 1\)"):
        load_corpus_jsonl(path)


def test_corpus_file_suffix_and_existence_are_checked(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match="not found"):
        load_corpus_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(DataFormatError, match=r"allowed suffixes are \.jsonl, \.jsonl\.gz"):
        load_corpus_jsonl(write_lines(tmp_path / "corpus.json", ["{}"]))


# ---------------------------------------------------------------- BM25


def test_bm25_puts_exact_match_first_and_caps_top_n() -> None:
    retriever = BM25Retriever(toy_corpus())
    hits = retriever.search(["wrought iron lattice tower", "coral reef off Queensland"], top_n=2)
    assert [[i for i, _ in row] for row in hits][0][0] == 1
    assert hits[1][0][0] == 4
    assert all(row[0][1] > row[1][1] for row in hits)
    capped = retriever.search(["programming language readability"], top_n=50)[0]
    assert len(capped) == len(TOY_DOCS) and capped[0][0] == 3
    assert [s for _, s in capped] == sorted((s for _, s in capped), reverse=True)
    # Only stopwords or unknown words: every passage scores 0, in passage order.
    assert retriever.search(["the of and", "zzzz"], top_n=3) == [[(0, 0.0), (1, 0.0), (2, 0.0)]] * 2
    with pytest.raises(ValueError, match=r"^top_n"):
        retriever.search(["x"], top_n=0)


def test_bm25_index_cache_is_reused_and_keyed_by_corpus(tmp_path: Path) -> None:
    corpus = toy_corpus()
    first = BM25Retriever(corpus, cache_dir=tmp_path)
    assert first.index_dir is not None and first.index_dir.is_dir()
    assert not list(first.index_dir.parent.glob(".tmp-*"))
    again = BM25Retriever(corpus, cache_dir=tmp_path)
    queries = ["highest mountain Himalayas", "glucose sunlight"]
    assert again.search(queries, 3) == first.search(queries, 3)
    # A damaged index is rebuilt, not trusted.
    (first.index_dir / "params.index.json").write_text("{broken")
    assert BM25Retriever(corpus, cache_dir=tmp_path).search(queries, 3) == first.search(queries, 3)
    assert json.loads((first.index_dir / "params.index.json").read_text())
    smaller = Corpus(corpus.passages[:3], {}, passages_fingerprint(corpus.passages[:3]))
    assert BM25Retriever(smaller, cache_dir=tmp_path).index_dir != first.index_dir


# ---------------------------------------------------------------- dense


def test_dense_embeddings_equal_sentence_transformers(dense_toy: DenseRetriever) -> None:
    from sentence_transformers import SentenceTransformer

    sentences = ["who designed the tower in Paris?", "ok", "Röntgen won the first Nobel Prize in Physics. " * 60]
    reference = SentenceTransformer(str(default_model_dir()), device="cpu").encode(sentences, convert_to_numpy=True)
    ours = dense_toy.encode(sentences)
    assert ours.shape == (3, 384)
    np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # The same encoder without a corpus: the cosine of a query with each passage.
    cosine = MeanPoolEncoder().cosine(sentences[0], sentences[1:])
    np.testing.assert_allclose(cosine, reference[1:] @ reference[0], atol=1e-5, rtol=0)


def test_encoder_cache_reads_back_what_it_wrote(tmp_path: Path) -> None:
    encoder = MeanPoolEncoder(device="cpu")
    texts = [f"{title}. {text}" for title, text in TOY_DOCS]
    cached = encoder.encode_cached(texts, tmp_path, shard_size=2)
    np.testing.assert_allclose(cached, encoder.encode(texts), atol=1e-5, rtol=0)
    shards = sorted(tmp_path.rglob("shard-*.npy"))
    assert len(shards) == (len(texts) + 1) // 2
    # A second call reads the cache (a shard rewritten with its digest shows up) instead of encoding again.
    ShardedArtifact.from_directory(shards[0].parent).write(0, np.zeros_like(np.load(shards[0])))
    assert not encoder.encode_cached(texts, tmp_path, shard_size=2)[:2].any()
    # Other texts are another artifact, and no texts need none.
    other = encoder.encode_cached(texts[::-1], tmp_path, shard_size=2)
    np.testing.assert_allclose(other, cached[::-1], atol=1e-5, rtol=0)
    assert encoder.encode_cached([], tmp_path).shape == (0, cached.shape[1])


def test_dense_ranks_paraphrase_first(dense_toy: DenseRetriever) -> None:
    # No content word shared with the right passage, so only meaning can find it.
    hits = dense_toy.search(["What is the tallest peak on the planet?", "How do trees make food from light?"], top_n=2)
    assert [row[0][0] for row in hits] == [2, 0]
    assert len(dense_toy.search(["anything"], top_n=99)[0]) == len(TOY_DOCS)


def test_dense_cache_round_trips(tmp_path: Path, dense_toy: DenseRetriever) -> None:
    first = DenseRetriever(dense_toy.corpus, cache_dir=tmp_path, progress=False, shard_size=2)
    files = sorted(p.name for p in tmp_path.rglob("*.npy"))
    assert files == ["shard-00000.npy", "shard-00001.npy", "shard-00002.npy"]
    np.testing.assert_allclose(first.passage_embeddings, dense_toy.passage_embeddings, atol=1e-6)
    # A second retriever reads the cache: a shard rewritten with its digest shows up in its embeddings.
    shard = next(tmp_path.rglob("shard-00000.npy"))
    artifact = ShardedArtifact.from_directory(shard.parent)
    artifact.write(0, np.zeros_like(np.load(shard)))
    assert (
        not DenseRetriever(dense_toy.corpus, cache_dir=tmp_path, progress=False, shard_size=2)
        .passage_embeddings[:2]
        .any()
    )
    # A shard changed behind the cache's back fails its checksum and is recomputed.
    np.save(shard, np.ones_like(np.load(shard)))
    again = DenseRetriever(dense_toy.corpus, cache_dir=tmp_path, progress=False, shard_size=2)
    np.testing.assert_allclose(again.passage_embeddings, dense_toy.passage_embeddings, atol=1e-6)


# ---------------------------------------------------------------- candidates


def test_bm25_candidates_on_real_nq_rows_mostly_hold_gold() -> None:
    rows = load_questions_jsonl(default_questions_path(), limit=200)
    corpus = corpus_from_gold_paragraphs(rows)
    candidates = retrieve_candidates(rows[:30], corpus, BM25Retriever(corpus), top_n=20)
    assert [c.qid for c in candidates] == [r.qid for r in rows[:30]]
    assert all(len(c.passages) == len(c.scores) == len(c.has_answer) == 20 for c in candidates)
    rate = sum(c.gold_retrieved for c in candidates) / len(candidates)
    print(f"BM25 top-20 gold-retrieved rate on 30 rows (corpus of 200): {rate:.2f}")
    assert rate >= 0.6
    for c in candidates:
        assert c.from_gold == [p.source_id == corpus.gold_source_of[c.qid] for p in c.passages]
        assert c.scores == sorted(c.scores, reverse=True)
    # The first question's gold paragraph names its answer, so a retrieved gold passage has it.
    first = candidates[0]
    assert any(h for h, g in zip(first.has_answer, first.from_gold) if g)


def test_retrieve_candidates_checks_top_n_and_corpus() -> None:
    corpus = toy_corpus()
    retriever = BM25Retriever(corpus)
    rows = [QARow("q", "Who designed the Eiffel tower?", ("Gustave Eiffel",), ())]
    with pytest.raises(ValueError, match=r"^top_n must be an integer >= 1; got 0"):
        retrieve_candidates(rows, corpus, retriever, top_n=0)
    other = Corpus(corpus.passages[:2], {}, passages_fingerprint(corpus.passages[:2]))
    with pytest.raises(ValueError, match="different corpus"):
        retrieve_candidates(rows, other, retriever)
    (only,) = retrieve_candidates(rows, corpus, retriever, top_n=2)
    assert only.has_answer == [True, False] and not only.gold_retrieved


def test_candidates_jsonl_round_trip(tmp_path: Path) -> None:
    rows = load_questions_jsonl(default_questions_path(), limit=20)
    corpus = corpus_from_gold_paragraphs(rows)
    candidates = retrieve_candidates(rows[:5], corpus, BM25Retriever(corpus), top_n=4)
    for name in ("cands.jsonl", "cands.jsonl.gz"):
        path = save_candidates_jsonl(candidates, tmp_path / name)
        assert load_candidates_jsonl(path) == candidates
    assert [c.gold_retrieved for c in load_candidates_jsonl(path)] == [c.gold_retrieved for c in candidates]


def test_prebuilt_candidates_need_only_the_basic_fields(tmp_path: Path) -> None:
    row = {
        "qid": 7,
        "question": "who?",
        "answers": ["Ada Lovelace"],
        "contexts": [
            {"title": "A", "text": "Ada Lovelace wrote it.", "score": 3},
            {"title": "", "text": "Someone else.", "score": 1.5},
        ],
    }
    (loaded,) = load_candidates_jsonl(write_lines(tmp_path / "c.jsonl", [json.dumps(row)]))
    assert isinstance(loaded, Candidates) and loaded.qid == "7"
    assert loaded.scores == [3.0, 1.5] and loaded.has_answer == [True, False]
    assert [p.pid for p in loaded.passages] == ["7@ctx0", "7@ctx1"] and not loaded.gold_retrieved


@pytest.mark.parametrize(
    "line, message",
    [
        ("{oops", r"line 2: malformed JSON"),
        (
            '{"qid": "b", "question": "q", "answers": [], "contexts": []}',
            r'line 2: field "answers" must be a non-empty list',
        ),
        ('{"qid": "b", "question": "q", "answers": ["a"]}', r'line 2: field "contexts" must be a list'),
        (
            '{"qid": "b", "question": "q", "answers": ["a"], '
            '"contexts": [{"title": "", "text": "t", "score": "high"}]}',
            r'line 2, contexts\[0\]: field "score" must be a finite number',
        ),
        (
            '{"qid": "b", "question": "q", "answers": ["a"], "contexts": [{"title": "", "text": "t", "score": NaN}]}',
            r'line 2, contexts\[0\]: field "score" must be a finite number',
        ),
        (
            '{"qid": "a", "question": "q", "answers": ["a"], "contexts": []}',
            r"line 2: duplicate qid 'a' \(first at line 1\)",
        ),
    ],
)
def test_malformed_candidates_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    good = json.dumps({"qid": "a", "question": "q", "answers": ["a"], "contexts": []})
    path = write_lines(tmp_path / "c.jsonl", [good, line])
    with pytest.raises(DataFormatError, match=re.escape(str(path)) + ", " + message):
        load_candidates_jsonl(path)


# ---------------------------------------------------------------- joined by id, checked by content


def shifted_candidates_file(tmp_path: Path, rows: list[QARow], corpus: Corpus) -> Path:
    """A candidates file built from the same NQ file with one line removed at its start: every default
    qid (a line position) now carries the next row's question and contexts."""
    built = retrieve_candidates(rows[1:], corpus, BM25Retriever(corpus), top_n=3)
    renamed = [
        make_candidates(rows[i].qid, c.question, c.answers, c.passages, c.scores, c.gold_source)
        for i, c in enumerate(built)
    ]
    return save_candidates_jsonl(renamed, tmp_path / "shifted.jsonl")


def test_candidates_under_the_right_qids_but_other_questions_are_refused(tmp_path: Path) -> None:
    rows = load_questions_jsonl(default_questions_path(), limit=12)
    corpus = corpus_from_gold_paragraphs(rows)
    path = shifted_candidates_file(tmp_path, rows, corpus)
    loaded = load_candidates_jsonl(path)
    assert [c.qid for c in loaded] == [r.qid for r in rows[:11]]  # by qid alone, every row "has" candidates
    with pytest.raises(CandidatesMismatchError) as caught:
        match_candidates(rows[:11], loaded, source=f"candidates file {path}")
    message = str(caught.value)
    assert str(path) in message and "11 of 11 questions differ" in message
    assert (
        f"qid '{rows[0].qid}': the data asks {rows[0].question!r}, candidates file {path} has {rows[1].question!r}"
        in message
    )
    assert message.count("the data asks") == 3  # the first mismatches, not all of them
    with pytest.raises(CandidatesMismatchError, match=str(path)):
        validate_candidates_jsonl(path, rows[:11])


def test_matching_candidates_come_back_in_row_order_up_to_normalization(tmp_path: Path) -> None:
    rows = load_questions_jsonl(default_questions_path(), limit=6)
    corpus = corpus_from_gold_paragraphs(rows)
    candidates = retrieve_candidates(rows, corpus, BM25Retriever(corpus), top_n=2)
    retyped = [
        make_candidates(c.qid, f"  {c.question.upper()}? ", c.answers, c.passages, c.scores, c.gold_source)
        for c in candidates
    ]  # case, punctuation and spacing do not make another question
    matched = match_candidates(list(reversed(rows)), retyped)
    assert [c.qid for c in matched] == [r.qid for r in reversed(rows)]
    with pytest.raises(CandidatesMismatchError, match=r"file\.jsonl: no candidates for 1 of 6 questions"):
        match_candidates(rows, retyped[1:], source="file.jsonl")
    path = save_candidates_jsonl(candidates, tmp_path / "c.jsonl.gz")
    assert validate_candidates_jsonl(path, rows) == 6 and validate_candidates_jsonl(path) == 6


def test_corpus_file_is_validated_whole_without_building_anything(tmp_path: Path) -> None:
    good = [json.dumps({"id": f"d{i}", "title": "t", "text": f"text {i}"}) for i in range(3)]
    path = write_lines(tmp_path / "corpus.jsonl", good)
    assert validate_corpus_jsonl(path) == 3
    bad = write_lines(tmp_path / "bad.jsonl", good + ['{"id": "d9", "title": "t"}'])
    with pytest.raises(DataFormatError, match=r'bad\.jsonl, line 4: field "text" must be a non-empty string'):
        validate_corpus_jsonl(bad)
    with pytest.raises(
        DataFormatError, match=r'each line must be confrag \{"id": str, "title": str, "text": str\} or flashrag'
    ):
        validate_corpus_jsonl(write_lines(tmp_path / "json.jsonl", good + ["{oops"]))
    with pytest.raises(DataFormatError, match="no documents"):
        validate_corpus_jsonl(write_lines(tmp_path / "blank.jsonl", ["", " "]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "blank.jsonl", "corpus.jsonl", "json.jsonl"]
