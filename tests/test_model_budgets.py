"""The reranker's and the dense encoder's token budgets: the passages their tokenizers cut are counted, logged and
reported (issue 34, item 1), not left silent. Truncation itself stays: that is what these models do."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import confrag.retrieval.lengths as lengths_module
from confrag.data import QARow
from confrag.reports.rerank import lengths_line
from confrag.reranker.backbone import resolve_backbone
from confrag.reranker.budget import PairBudget
from confrag.reranker.kinds import reranker_kind
from confrag.reranker.tokenization import pair_max_length
from confrag.retrieval.lengths import COUNT_FILE
from confrag.stages.rerankers import reranker_budget
from confrag.stages.retrieval import RetrievalSettings, build_retrieval, question_candidates

from helpers.settings import shipped_settings

LONG = " ".join(f"harbour{i} lantern{i}" for i in range(200))  # several hundred MiniLM tokens
DOCS = [
    ("d0", "Eiffel Tower", "The wrought iron lattice tower in Paris was designed by Gustave Eiffel."),
    ("d1", "Mount Everest", "Earth's highest mountain above sea level lies in the Mahalangur Himal range."),
    ("d2", "Harbour", LONG),
]
ROWS = [QARow("q0", "who designed the tower in paris", ("Gustave Eiffel",), ())]


def corpus_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in DOCS))
    return str(path)


def minilm_budget(kind: str, query_max_len: int = 8, passage_max_len: int = 24) -> PairBudget:
    spec = reranker_kind(kind)
    return PairBudget(spec.load_tokenizer(resolve_backbone(None)), spec, query_max_len, passage_max_len)


@pytest.mark.parametrize("kind", ["cross_encoder", "bi_encoder"])
def test_the_rerankers_budget_counts_the_candidate_it_cuts(kind):
    budget = minilm_budget(kind)
    short, long = "Gustave Eiffel designed it.", LONG
    counted = budget.count(["who designed it"] * 3, [short, long, long])  # a pair counted once
    limit = pair_max_length(budget.tokenizer, 8, 24) if kind == "cross_encoder" else 24
    assert counted["passages"] == 2 and counted["over_limit"] == 1 and counted["limit"] == limit
    # The backbone's own positions cap the budget: MiniLM reads 512 (cross-encoder) or 256 (bi-encoder) tokens.
    assert minilm_budget(kind, 8, 4000).limit[0] == (512 if kind == "cross_encoder" else 256)


def test_the_reranker_budget_comes_from_the_recipes_model_and_data_nodes():
    from helpers.modules import preference_data

    recipe = SimpleNamespace(
        identity={"model": {"backbone": "minilm", "kind": "bi_encoder"}},
        make_datamodule=lambda **kw: preference_data(query_max_len=16, passage_max_len=32, **kw),
    )
    budget = reranker_budget(recipe)
    assert budget.kind.id == "bi_encoder" and (budget.query_max_len, budget.passage_max_len) == (16, 32)
    assert budget.limit == (32, "the passage alone, special tokens included")


def test_dense_encoder_and_reranker_cuts_are_counted_in_the_candidates_report(tmp_path, caplog, monkeypatch):
    settings = shipped_settings(
        RetrievalSettings,
        "retrieval",
        corpus_path=corpus_file(tmp_path),
        corpus_format="confrag",
        words_per_passage=None,
        bi_encoder=True,
        top_n=3,
    )
    cache = tmp_path / "cache"
    with caplog.at_level("INFO"):
        retrieval = build_retrieval(settings, cache)
    # MiniLM's max_seq_length is 256: the long passage is cut before it is embedded, the two short ones are whole.
    assert retrieval.encoder_lengths == {"passages": 3, "over_limit": 1, "limit": 254}
    assert "passages cut by the dense encoder's budget: 1 of 3 (budget 254 tokens)" in caplog.text
    retrieval.reranker_budget = minilm_budget("cross_encoder")
    candidates, stats = question_candidates(retrieval, ROWS)
    lengths = stats["passage_lengths"]
    assert lengths["dense_encoder"]["over_limit"] == 1
    assert lengths["reranker"]["passages"] == 3 and lengths["reranker"]["over_limit"] == 1
    line = lengths_line(stats)
    assert "corpus passages cut by the dense encoder's budget: 1 of 3 (budget 254 tokens)" in line
    assert "candidate passages cut by the reranker's budget: 1 of 3 (budget 32 tokens: question and passage" in line
    # Counted once per corpus, encoder and limit: read back from the cache while whole, counted again when damaged.
    kept = list((cache / "retrieval" / "lengths").glob(f"*/{COUNT_FILE}"))
    assert len(kept) == 1
    with monkeypatch.context() as patch:
        patch.setattr(lengths_module, "count_over", lambda *_: pytest.fail("counted again"))
        assert build_retrieval(settings, cache).encoder_lengths == retrieval.encoder_lengths
    kept[0].write_text(json.dumps({"passages": 3, "over_limit": 0, "limit": 254}))
    assert build_retrieval(settings, cache).encoder_lengths["over_limit"] == 1


def test_without_a_dense_index_or_a_reranker_nothing_is_counted(tmp_path):
    settings = shipped_settings(
        RetrievalSettings,
        "retrieval",
        corpus_path=corpus_file(tmp_path),
        corpus_format="confrag",
        words_per_passage=None,
        bi_encoder=False,
        top_n=3,
    )
    retrieval = build_retrieval(settings, tmp_path / "cache")
    assert retrieval.encoder_lengths is None
    _, stats = question_candidates(retrieval, ROWS)
    assert "passage_lengths" not in stats and lengths_line(stats) is None


def test_the_count_needs_as_many_queries_as_passages():
    with pytest.raises(ValueError, match="2 queries but 1 passages"):
        minilm_budget("cross_encoder").count(["a", "b"], ["c"])
