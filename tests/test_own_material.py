"""Your own material used as given and checked before any stage: a corpus kept in its own passages
(`retrieval.words_per_passage: null`), candidates from FlashRAG's retrieval output or any file of ranked ids,
a prebuilt FAISS index with its sentence-transformers encoder, and every passage measured in the LLM's tokens
before the LLM loads (refused naming passage, file, line and limit, or cut with `retrieval.cut_passages`)."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import pytest

import confrag.llm.loading as loading
import confrag.stages.nq_rerank as nq_rerank
from confrag.data import DataFormatError, QARow
from confrag.retrieval import load_corpus_jsonl, retrieve_candidates
from confrag.retrieval.corpus import document_text
from confrag.retrieval.lengths import PassageTooLongError, TokenBudget, count_over, fit_passages
from confrag.retrieval.minilm import minilm_dir
from confrag.retrieval.prebuilt_index import PrebuiltDenseRetriever, PrebuiltIndexError
from confrag.retrieval.ranked_ids import check_questions, ranked_candidates, read_ranked_lists
from confrag.train import run_task

from helpers.runs import compose_cfg

DOCS = [
    ("d0", "Photosynthesis", "Plants convert sunlight, water and carbon dioxide into glucose in their leaves."),
    ("d1", "Eiffel Tower", "The wrought iron lattice tower in Paris was designed by Gustave Eiffel and his company."),
    ("d2", "Mount Everest", "Earth's highest mountain above sea level lies in the Mahalangur Himal range."),
    ("d3", "Python", "A high-level general-purpose programming language that emphasizes code readability."),
]
ROWS = [
    QARow("q0", "who designed the tower in paris", ("Gustave Eiffel",), ()),
    QARow("q1", "what is the highest mountain on earth", ("Everest",), ()),
]


def flashrag_corpus(path: Path, docs=DOCS) -> Path:
    """FlashRAG's corpus layout: {"id", "contents": "\\"title\\"\\ntext"} (a quoted title, as wiki-18 writes it)."""
    lines = [json.dumps({"id": i, "contents": f'"{title}"\n{text}'}) for i, title, text in docs]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_flashrag_corpus_is_kept_in_its_own_passages_under_its_own_ids(tmp_path):
    long_text = " ".join(f"w{i}" for i in range(250))  # split at 100 words otherwise
    path = flashrag_corpus(tmp_path / "corpus.jsonl", [*DOCS, ("d4", "Long", long_text)])
    corpus = load_corpus_jsonl(path, words_per_passage=None)
    assert [p.pid for p in corpus.passages] == ["d0", "d1", "d2", "d3", "d4"]
    assert corpus.passages[1].title == "Eiffel Tower" and corpus.passages[1].text == DOCS[1][2]
    assert corpus.passages[4].text == long_text and corpus.passages[4].source_id == "d4"
    split = load_corpus_jsonl(path, words_per_passage=100)
    assert [p.pid for p in split.passages][-3:] == ["d4#0", "d4#1", "d4#2"] and split.fingerprint != corpus.fingerprint


@pytest.mark.parametrize("value, ok", [("null", True), ("0", False), ("ten", False)])
def test_words_per_passage_null_is_a_setting_and_bad_values_are_named(value, ok, tmp_path):
    from confrag.instantiators import settings_from
    from confrag.stages.retrieval import RetrievalSettings

    cfg = compose_cfg(["+experiment=reranker_tiny_llama", f"retrieval.words_per_passage={value}"], tmp_path)
    if ok:
        assert settings_from(RetrievalSettings, cfg.retrieval, "retrieval").words_per_passage is None
    else:
        with pytest.raises(ValueError, match="retrieval.words_per_passage must be an integer >= 1 .*or null"):
            settings_from(RetrievalSettings, cfg.retrieval, "retrieval")


# ---------------------------------------------------------------- candidates from other tools


def flashrag_output(path: Path, corpus, picks: dict[str, list[int]]) -> Path:
    """FlashRAG's saved dataset (intermediate_data.json) with each question's retrieval result."""
    items = []
    for row in ROWS:
        docs = [{"id": corpus.passages[j].pid, "contents": document_text(corpus.passages[j])} for j in picks[row.qid]]
        items.append(
            {
                "id": row.qid,
                "question": row.question,
                "golden_answers": list(row.answers),
                "output": {"retrieval_result": docs},
            }
        )
    path.write_text(json.dumps(items, indent=1))
    return path


def test_flashrag_retrieval_output_becomes_candidates_of_the_corpus(tmp_path):
    corpus = load_corpus_jsonl(flashrag_corpus(tmp_path / "corpus.jsonl"), words_per_passage=None)
    path = flashrag_output(tmp_path / "intermediate_data.json", corpus, {"q0": [1, 3], "q1": [2, 0, 1]})
    found = ranked_candidates(ROWS, read_ranked_lists(path), corpus, "test")
    assert [[p.pid for p in c.passages] for c in found] == [["d1", "d3"], ["d2", "d0", "d1"]]
    assert found[0].has_answer == [True, False] and found[1].scores == [3.0, 2.0, 1.0]
    # FlashRAG's retrieval cache: question -> documents, joined by question text.
    cache = {row.question: [{"id": "d2", "contents": document_text(corpus.passages[2])}] for row in ROWS}
    (tmp_path / "retrieval_cache.json").write_text(json.dumps(cache))
    found = ranked_candidates(ROWS, read_ranked_lists(tmp_path / "retrieval_cache.json", "flashrag"), corpus, "t")
    assert [c.qid for c in found] == ["q0", "q1"] and found[1].passages[0].pid == "d2"


def test_ids_texts_and_questions_that_do_not_match_the_corpus_are_refused_by_file_and_item(tmp_path):
    corpus = load_corpus_jsonl(flashrag_corpus(tmp_path / "corpus.jsonl"), words_per_passage=None)
    path = flashrag_output(tmp_path / "out.json", corpus, {"q0": [1], "q1": [2]})
    items = json.loads(path.read_text())
    items[1]["output"]["retrieval_result"][0]["id"] = "d9"
    path.write_text(json.dumps(items))
    with pytest.raises(
        DataFormatError, match=r"1 passage id\(s\) are not in the corpus of 4 passages .*item 1: id 'd9'"
    ):
        ranked_candidates(ROWS, read_ranked_lists(path), corpus, "retrieval.candidates_path")
    items[1]["output"]["retrieval_result"][0] = {"id": "d2", "contents": "Mount Everest\nanother text"}
    path.write_text(json.dumps(items))
    with pytest.raises(DataFormatError, match=r"hold another text than the corpus's .*item 1: id 'd2'"):
        ranked_candidates(ROWS, read_ranked_lists(path), corpus, "retrieval.candidates_path")
    # A corpus split into passages names them "<doc>#<chunk>": the message says how to keep the documents.
    split = load_corpus_jsonl(tmp_path / "corpus.jsonl", words_per_passage=100)
    with pytest.raises(DataFormatError, match="retrieval.words_per_passage=null"):
        ranked_candidates(
            ROWS, read_ranked_lists(flashrag_output(tmp_path / "o.json", corpus, {"q0": [1], "q1": [2]})), split, "x"
        )
    with pytest.raises(DataFormatError, match=r"no ranked list for 1 of 3 questions, e.g. \['q2'\]"):
        ranked_candidates(
            [*ROWS, QARow("q2", "what else", ("x",), ())], read_ranked_lists(path.with_name("o.json")), corpus, "x"
        )


def test_any_file_of_ranked_ids_jsonl_or_trec_run_becomes_candidates(tmp_path):
    corpus = load_corpus_jsonl(flashrag_corpus(tmp_path / "corpus.jsonl"), words_per_passage=None)
    ranked = tmp_path / "ranked.jsonl"
    ranked.write_text('{"qid": "q0", "ids": ["d1", "d0"], "scores": [2.5, 0.5]}\n{"qid": "q1", "ids": ["d2"]}\n')
    found = ranked_candidates(ROWS, read_ranked_lists(ranked), corpus, "x")
    assert [p.pid for p in found[0].passages] == ["d1", "d0"] and found[0].scores == [2.5, 0.5]
    run = tmp_path / "bm25.trec"
    run.write_text("q1 Q0 d0 2 1.0 bm25\nq1 Q0 d2 1 3.0 bm25\nq0 Q0 d1 1 9.0 bm25\n")
    found = ranked_candidates(ROWS, read_ranked_lists(run), corpus, "x")
    assert [p.pid for p in found[1].passages] == ["d2", "d0"] and found[1].scores == [3.0, 1.0]
    run.write_text("q1 Q0 d0\n")
    with pytest.raises(DataFormatError, match=r"bm25.trec, line 1: a TREC run line is `qid Q0 docid rank score tag`"):
        read_ranked_lists(run)
    ranked.write_text(
        '{"qid": "q0", "ids": ["d1"], "question": "who painted the mona lisa"}\n{"qid": "q1", "ids": ["d2"]}\n'
    )
    with pytest.raises(DataFormatError, match=r"ranked.jsonl, line 1: qid 'q0' asks 'who painted the mona lisa'"):
        ranked_candidates(ROWS, read_ranked_lists(ranked), corpus, "x")
    # Before any stage: a list of a question the data does not hold (another question set) is refused.
    ranked.write_text('{"qid": "q0", "ids": ["d1"]}\n{"qid": "x7", "ids": ["d2"]}\n')
    with pytest.raises(
        DataFormatError, match=r"1 of its 2 questions do not match .*line 2: qid 'x7' is not in the data"
    ):
        check_questions(read_ranked_lists(ranked), ROWS, "x")
    check_questions(read_ranked_lists(ranked)[:1], ROWS, "x")


def test_a_trec_run_is_ordered_by_score_its_rank_conflicts_named_and_bad_bytes_placed(tmp_path, caplog):
    """Repeated ranks were ordered by doc-id string and ranks contradicting the scores kept without a word; a
    non-UTF-8 byte gave a raw UnicodeDecodeError. Now: trec_eval's order (score, best first), the questions
    reordered named, a passage listed twice refused, a bad byte named by file and line."""
    corpus = load_corpus_jsonl(flashrag_corpus(tmp_path / "corpus.jsonl"), words_per_passage=None)
    run = tmp_path / "dense.run"
    # q0: two passages at rank 1; q1: ranks that say d2 first while the scores say d0.
    run.write_text("q0 Q0 d1 1 2.0 x\nq0 Q0 d0 1 5.0 x\nq1 Q0 d2 1 1.0 x\nq1 Q0 d0 2 3.0 x\nq1 Q0 d3 3 0.5 x\n")
    with caplog.at_level("WARNING", logger="confrag.retrieval.ranked_ids"):
        found = ranked_candidates(ROWS, read_ranked_lists(run), corpus, "x")
    assert [p.pid for p in found[0].passages] == ["d0", "d1"] and found[0].scores == [5.0, 2.0]
    assert [p.pid for p in found[1].passages] == ["d0", "d2", "d3"] and found[1].scores == [3.0, 1.0, 0.5]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "dense.run: 2 of 2 questions have repeated ranks or ranks that contradict their scores" in warning
    assert "'q0', 'q1'" in warning and "ordered by score, best first, as trec_eval does" in warning
    caplog.clear()
    run.write_text("q0 Q0 d1 1 2.0 x\nq0 Q0 d0 2 1.0 x\n")  # consistent: nothing said
    with caplog.at_level("WARNING", logger="confrag.retrieval.ranked_ids"):
        assert [item.ids for item in read_ranked_lists(run)] == [["d1", "d0"]] and not caplog.records
    run.write_text("q0 Q0 d1 1 2.0 x\nq0 Q0 d0 2 1.0 x\nq0 Q0 d1 3 0.5 x\n")
    with pytest.raises(
        DataFormatError, match=r"dense.run, line 3: passage 'd1' of question 'q0' again \(first at line 1\)"
    ):
        read_ranked_lists(run)
    run.write_bytes(b"q0 Q0 d1 1 2.0 x\nq1 Q0 d\xe9 1 1.0 x\n")  # Latin-1, not UTF-8
    with pytest.raises(DataFormatError, match=r"dense.run, line 2: not valid UTF-8"):
        read_ranked_lists(run)
    run.write_text("q0 Q0 d1 1 nan x\n")
    with pytest.raises(DataFormatError, match=r"dense.run, line 1: score 'nan' is not a finite number"):
        read_ranked_lists(run)


def test_a_trec_run_deeper_than_retrieval_top_n_is_cut_to_it_and_the_cut_is_logged(tmp_path, caplog):
    """A run file's lists are cut to `retrieval.top_n`, as a retriever's are (they were used whole: 10 candidates a
    question under top_n=6, silently); the cut is logged and counted in the stats the reports print."""
    from confrag.reports.rerank import retrieval_line
    from confrag.stages.retrieval import RetrievalSettings, build_retrieval, question_candidates

    from helpers.settings import shipped_settings

    corpus_path = flashrag_corpus(tmp_path / "corpus.jsonl")
    run = tmp_path / "bm25.trec"
    order = {"q0": ["d1", "d0", "d3", "d2"], "q1": ["d2", "d3"]}
    run.write_text(
        "".join(f"{q} Q0 {d} {r + 1} {9.0 - r} bm25\n" for q, ids in order.items() for r, d in enumerate(ids))
    )
    settings = shipped_settings(
        RetrievalSettings,
        "retrieval",
        corpus_path=str(corpus_path),
        corpus_format="flashrag",
        words_per_passage=None,
        candidates_path=str(run),
        bi_encoder=False,
        top_n=3,
    )
    retrieval = build_retrieval(settings, tmp_path / "cache")
    with caplog.at_level("INFO", logger="confrag.stages.retrieval"):
        found, stats = question_candidates(retrieval, ROWS, str(run))
    assert [[p.pid for p in c.passages] for c in found] == [["d1", "d0", "d3"], ["d2", "d3"]]
    assert [len(c.scores) for c in found] == [3, 2] and [len(c.has_answer) for c in found] == [3, 2]
    assert stats["file_depth"] == {"top_n": 3, "lists_cut": 1, "file_longest": 4}
    assert "1 of 2 questions' lists cut to their first 3 candidates (retrieval.top_n; the file gives up to 4)" in (
        caplog.text
    )
    assert "cut to their first 3 (retrieval.top_n) for 1 questions (the file gives up to 4)" in retrieval_line(stats)
    caplog.clear()
    with caplog.at_level("INFO", logger="confrag.stages.retrieval"):  # the rerank task's early label check
        _, quiet = question_candidates(retrieval, ROWS, str(run), log_cut=False)
    assert "lists cut" not in caplog.text and quiet["file_depth"] == stats["file_depth"]  # counted, said once
    found, stats = question_candidates(retrieval, ROWS, str(run), top_n=2)  # a stage's own depth (the base's)
    assert [len(c.passages) for c in found] == [2, 2] and stats["file_depth"]["lists_cut"] == 1


# ---------------------------------------------------------------- a prebuilt FAISS index


def build_index(path: Path, corpus, drop: int = 0, transform=None) -> Path:
    """The index FlashRAG would build: the encoder's vectors of the corpus in file order, inner product
    (`transform` makes another index of the same size and dimension from them)."""
    from sentence_transformers import SentenceTransformer

    vectors = SentenceTransformer(str(minilm_dir()), device="cpu").encode([document_text(p) for p in corpus.passages])
    if transform is not None:
        vectors = transform(vectors)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors[: len(vectors) - drop], dtype=np.float32))
    faiss.write_index(index, str(path))
    return path


def test_a_prebuilt_faiss_index_with_its_encoder_is_the_dense_retriever(tmp_path):
    corpus = load_corpus_jsonl(flashrag_corpus(tmp_path / "corpus.jsonl"), words_per_passage=None)
    retriever = PrebuiltDenseRetriever(corpus, build_index(tmp_path / "e.index", corpus), minilm_dir())
    found = retrieve_candidates(ROWS, corpus, retriever, top_n=2)
    assert [c.passages[0].pid for c in found] == ["d1", "d2"]
    query = retriever.encode([ROWS[0].question])[0]
    assert np.allclose(retriever.passage_vectors([1]) @ query, found[0].scores[:1], atol=1e-5)
    with pytest.raises(PrebuiltIndexError, match=r"holds 3 vectors, the corpus 4 passages"):
        PrebuiltDenseRetriever(corpus, build_index(tmp_path / "short.index", corpus, drop=1), minilm_dir())


def test_a_prebuilt_index_of_another_encoder_or_order_is_refused_on_a_sample_of_passages(tmp_path):
    """An index of the right size and dimension from another encoder passed, and the run blamed the corpus later."""
    corpus = load_corpus_jsonl(flashrag_corpus(tmp_path / "corpus.jsonl"), words_per_passage=None)
    rotation = np.linalg.qr(np.random.default_rng(3).normal(size=(384, 384)))[0].astype(np.float32)
    other_encoder = build_index(tmp_path / "other.index", corpus, transform=lambda v: v @ rotation)
    with pytest.raises(PrebuiltIndexError, match=r"other.index: of 4 passages of the corpus encoded by .* do not find"):
        PrebuiltDenseRetriever(corpus, other_encoder, minilm_dir())
    reordered = build_index(tmp_path / "reordered.index", corpus, transform=lambda v: v[::-1].copy())
    with pytest.raises(PrebuiltIndexError, match=r"4 do not find their own vector first .*passage 0 finds 3"):
        PrebuiltDenseRetriever(corpus, reordered, minilm_dir())
    PrebuiltDenseRetriever(corpus, build_index(tmp_path / "e.index", corpus), minilm_dir())  # its own: accepted


def test_a_prebuilt_index_is_checked_against_the_corpus_before_any_stage(tmp_path):
    corpus_path = flashrag_corpus(tmp_path / "corpus.jsonl")
    corpus = load_corpus_jsonl(corpus_path, words_per_passage=None)
    short = build_index(tmp_path / "short.index", corpus, drop=1)
    base = [
        "+experiment=reranker_tiny_llama",
        f"dataset.corpus_path={corpus_path}",
        "retrieval.words_per_passage=null",
        f"retrieval.dense_index_path={short}",
        f"retrieval.dense_encoder={minilm_dir()}",
        "logger=csv",
    ]
    (tmp_path / "out").mkdir()  # as Hydra makes the run folder before the task starts
    with pytest.raises(
        PrebuiltIndexError, match=r"short.index: the FAISS index holds 3 vectors, the corpus 4 passages"
    ):
        run_task(compose_cfg(base, tmp_path))
    failure = json.loads((tmp_path / "out" / "failure.json").read_text())  # recorded in the run folder too
    assert failure["exception"].endswith("PrebuiltIndexError") and "holds 3 vectors" in failure["message"]
    with pytest.raises(
        ValueError, match=r"^retrieval\.dense_encoder .*needs the corpus's documents as given: set words_per_passage"
    ):
        run_task(compose_cfg([*base, "retrieval.words_per_passage=100"], tmp_path))
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------- passage lengths in the LLM's tokens


@pytest.fixture
def no_llm(monkeypatch):
    """Fails the test if the LLM's weights load."""

    def refuse(*args, **kwargs):
        raise AssertionError("the LLM loaded")

    monkeypatch.setattr(loading, "load_llm", refuse)
    monkeypatch.setattr(nq_rerank, "load_llm", refuse)


@pytest.mark.task
def test_a_1mb_passage_without_whitespace_is_refused_before_the_llm_loads(tmp_path, no_llm):
    corpus_path = tmp_path / "corpus.jsonl"
    flashrag_corpus(corpus_path, [*DOCS[:2], ("huge", "Huge", "x" * 1_000_000), *DOCS[2:]])
    cfg = compose_cfg(["+experiment=reranker_tiny_llama", f"dataset.corpus_path={corpus_path}", "logger=csv"], tmp_path)
    with pytest.raises(PassageTooLongError) as err:
        run_task(cfg)
    message = str(err.value)
    assert message.startswith("1 passage(s) are longer than the ")
    assert f"passage 'huge#0' ({corpus_path}, line 3: 1,000,000 characters, " in message
    assert "tokens one passage may hold in the LLM's prompts (a context of 2048 tokens" in message
    assert "retrieval.cut_passages=true" in message
    cfg = compose_cfg(
        ["+experiment=reranker_tiny_llama", f"dataset.corpus_path={corpus_path}", "retrieval.max_passage_tokens=4000"],
        tmp_path,
    )
    with pytest.raises(ValueError, match=r"retrieval.max_passage_tokens=4000 is more than one passage may hold"):
        run_task(cfg)


def test_overlong_passages_are_cut_on_the_llms_tokens_when_asked(tiny_llama, tmp_path):
    corpus = load_corpus_jsonl(
        flashrag_corpus(tmp_path / "c.jsonl", [*DOCS[:1], ("cjk", "長文", "漢字" * 3000)]), words_per_passage=None
    )
    budget = TokenBudget("the LLM", tiny_llama.tokenizer, 100, "retrieval.max_passage_tokens=100")
    expected = r"passage 'cjk' \(c.jsonl, line 2: 6,000 characters, [\d,]+ tokens\)"
    with pytest.raises(PassageTooLongError, match=expected):
        fit_passages(
            corpus.passages, budget, False, lambda idx: ["c.jsonl, line 2" for _ in idx], "retrieval.cut_passages"
        )
    passages, cut = fit_passages(corpus.passages, budget, True, lambda idx: [], "retrieval.cut_passages")
    assert cut == 1 and passages[0] == corpus.passages[0] and passages[1].title == "長文"
    assert 90 <= len(tiny_llama.tokenizer(document_text(passages[1]), add_special_tokens=False)["input_ids"]) <= 100
    assert passages[1].text and "漢字".startswith(passages[1].text[:2])
    # The encoder's budget is counted, not refused: its tokenizer cuts the rest.
    counted = count_over(budget, [document_text(p) for p in corpus.passages] * 2)
    assert counted == {"passages": 2, "over_limit": 1, "limit": 100}


# ---------------------------------------------------------------- controls a corpus as given cannot label

UNRELATED = [  # made-up words: no NQ answer, no question's own paragraph
    (f"u{i}", f"Zorblat {i}", f"Vastrel grooves of the flimmer quench plinthwort {i} beside gromwell yarrowkettles.")
    for i in range(40)
]


@pytest.mark.task
def test_controls_the_corpus_cannot_label_are_refused_before_the_llm_loads(tmp_path, no_llm):
    """A FlashRAG corpus as given, without the questions' answers or paragraphs: the relevance control failed after
    the probe and the base reranker as "data.train: no preference rows"; the relevance confidence kept no row."""
    corpus_path = flashrag_corpus(tmp_path / "corpus.jsonl", UNRELATED)
    base = ["+experiment=reranker_tiny_llama", f"dataset.corpus_path={corpus_path}", "retrieval.words_per_passage=null"]
    with pytest.raises(ValueError) as err:
        run_task(compose_cfg([*base, "logger=csv"], tmp_path))
    assert str(err.value).startswith(
        "preferences.relevance_baseline=true (the control fine-tuned on relevance labels: a candidate holding a gold "
        "answer is positive) has no row: of the 24 NQ_Rerank questions, 24 have no candidate holding a gold answer"
    )
    cfg = compose_cfg([*base, "preferences.confidence=relevance", "preferences.relevance_baseline=false"], tmp_path)
    with pytest.raises(ValueError) as err:
        run_task(cfg)
    assert str(err.value).startswith(
        "preferences.confidence=relevance needs each question's own paragraph among its candidates (Conf 1 on it, 0 "
        "elsewhere): 24 of the 24 NQ_Rerank questions have none (their gold paragraph is not known"
    )
    assert not (tmp_path / "cache" / "probes").exists()  # refused before the probe, too
