"""HotpotQA loading: the official distractor JSON and Hugging Face rows give the same QARows; bad input is named."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from confrag.data import DataFormatError, Passage, QARow, hotpotqa_rows_from_records, load_hotpotqa
from confrag.retrieval.corpus import corpus_from_gold_paragraphs

FIXTURES = Path(__file__).parent / "fixtures"
OFFICIAL = FIXTURES / "hotpotqa_distractor_sample.json"
HF = FIXTURES / "hotpotqa_hf_sample.jsonl"


def official_rows() -> list[dict]:
    return json.loads(OFFICIAL.read_text())


def test_official_rows_become_qarows_with_supporting_paragraphs():
    rows = load_hotpotqa(OFFICIAL)
    assert [row.qid for row in rows] == ["5a8b0001fixture0001", "5a8b0002fixture0002", "5a8b0003fixture0003"]
    first = rows[0]
    assert first.answers == ("River Calder",)
    # Supporting-fact paragraphs only (not the distractors), in order of first mention, sentences joined.
    assert first.contexts == (
        Passage(
            "Harbour at Dusk",
            '"Harbour at Dusk" is an oil painting by Mara Linden, completed in 1887. It hangs in the Westgate Gallery.',
        ),
        Passage(
            "Elsworth Mill",
            "Elsworth Mill is a market town in the north of the county. The River Calder runs "
            "past its old wool mills. Mara Linden was born there in 1852.",
        ),
    )
    # A title named by two supporting facts is one paragraph; the order follows the supporting facts.
    assert [p.title for p in rows[1].contexts] == ["Tarrow Bridge", "Pellin Viaduct"]
    assert rows[1].answers == ("no",)


def test_hf_rows_equal_official_rows_in_files_and_in_memory(tmp_path):
    official = load_hotpotqa(OFFICIAL)
    assert load_hotpotqa(HF) == official
    gz = tmp_path / "hotpot.jsonl.gz"
    gz.write_bytes(gzip.compress(HF.read_bytes()))
    assert load_hotpotqa(gz) == official
    records = [json.loads(line) for line in HF.read_text().splitlines()]
    assert hotpotqa_rows_from_records(records) == official
    assert hotpotqa_rows_from_records(official_rows()) == official  # either shape in memory


def test_limit_and_corpus_from_gold_paragraphs():
    rows = load_hotpotqa(OFFICIAL, limit=2)
    assert len(rows) == 2 and all(isinstance(row, QARow) for row in rows)
    corpus = corpus_from_gold_paragraphs(rows)  # the gold paragraphs form a retrieval pool like NQ's
    assert {p.title for p in corpus.passages} == {"Harbour at Dusk", "Elsworth Mill", "Tarrow Bridge", "Pellin Viaduct"}


def write_official(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "hotpot_dev_distractor.json"
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda r: r.update(supporting_facts=[["No Such Page", 0]]),
            "'No Such Page', which is not in the row's context",
        ),
        (lambda r: r.pop("answer"), 'field "answer" must be a non-empty string'),
        (lambda r: r.update(question="  "), 'field "question" must be a non-empty string'),
        (lambda r: r.update(context="text"), 'field "context" must be a list'),
        (lambda r: r.update(supporting_facts=[]), 'field "supporting_facts" must name at least one'),
        (lambda r: r.pop("_id"), 'field "_id" (official) or "id"'),
    ],
)
def test_bad_official_row_names_file_and_row(tmp_path, mutate, message):
    rows = official_rows()
    mutate(rows[2])
    path = write_official(tmp_path, rows)
    with pytest.raises(DataFormatError) as err:
        load_hotpotqa(path)
    assert f"{path}, row 2 (0-based)" in str(err.value)
    assert message in str(err.value)


def test_bad_hf_line_names_file_and_line(tmp_path):
    lines = HF.read_text().splitlines()
    broken = json.loads(lines[1])
    broken["context"]["sentences"].pop()  # titles and sentences no longer pair up
    path = tmp_path / "hotpot.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(broken), lines[2]]) + "\n")
    with pytest.raises(DataFormatError, match=r"hotpot\.jsonl, line 2: field \"context\" must hold equally long"):
        load_hotpotqa(path)
    path.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(DataFormatError, match=r"line 2: malformed JSON"):
        load_hotpotqa(path)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataFormatError, match=r"not found; set the path with the `eval.hotpotqa_path`"):
        load_hotpotqa(tmp_path / "missing.json")
    duplicate = write_official(tmp_path, official_rows()[:1] * 2)
    with pytest.raises(DataFormatError, match=r"row 1 \(0-based\): duplicate id '5a8b0001fixture0001'"):
        load_hotpotqa(duplicate)
    not_list = write_official(tmp_path, {"data": []})
    with pytest.raises(DataFormatError, match="expected a JSON list of rows"):
        load_hotpotqa(not_list)
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DataFormatError, match=r"allowed suffixes are \.json, \.jsonl, \.jsonl\.gz"):
        load_hotpotqa(tmp_path / "rows.csv")
    with pytest.raises(ValueError, match="limit must be an integer >= 1 or None"):
        load_hotpotqa(OFFICIAL, limit=0)


# ---------------------------------------------------------------- passages in the LLM's tokens, before it loads


def long_hotpotqa(path: Path) -> Path:
    """The official sample with one supporting paragraph (question 2's "Elsworth Mill") past the tiny LLM's context."""
    records = official_rows()
    for title, sentences in records[0]["context"]:
        if title == "Elsworth Mill":
            sentences.append(" The mill " + "kept-grinding-" * 1500)  # no whitespace: no 100-word split shortens it
    path.write_text(json.dumps(records))
    return path


@pytest.mark.task
def test_hotpotqa_passages_are_measured_before_the_llm_loads(tmp_path, monkeypatch):
    """NQ's corpus was measured in the LLM's tokens before the LLM loaded; HotpotQA's supporting paragraphs were
    not: an overlong one failed only inside generation, after the probe, NQ_Rerank and the rerankers."""
    import dataclasses

    import confrag.llm.loading as loading
    import confrag.stages.evaluation as evaluation_stage
    import confrag.stages.nq_rerank as nq_rerank
    from confrag.recipes import evaluation_recipe
    from confrag.retrieval.corpus import document_text
    from confrag.retrieval.lengths import PassageTooLongError
    from confrag.stages.evaluation import hotpotqa_material
    from confrag.train import run_task

    from helpers.runs import compose_cfg

    def refuse(*args, **kwargs):
        raise AssertionError("the LLM loaded")

    for module in (loading, nq_rerank, evaluation_stage):
        monkeypatch.setattr(module, "load_llm", refuse)
    path = long_hotpotqa(tmp_path / "hotpot_long.json")
    cfg = compose_cfg(["+experiment=cbdr_tiny_llama", f"eval.hotpotqa_path={path}", "logger=csv"], tmp_path)
    with pytest.raises(PassageTooLongError) as err:
        run_task(cfg)
    message = str(err.value)
    assert message.startswith("1 passage(s) are longer than the ") and "retrieval.cut_passages=true" in message
    assert f"({path}, a paragraph of question '5a8b0001fixture0001': " in message
    assert not (tmp_path / "cache" / "probes").exists()  # before the probe's stage too
    # Cut on the LLM's tokens when asked, and counted (the evaluation retrieves from this corpus).
    recipe, answers, evaluation = evaluation_recipe(cfg)
    retrieval = dataclasses.replace(recipe.retrieval, cut_passages=True)
    material = hotpotqa_material(evaluation, answers, recipe.llm, recipe.templates, retrieval, 0)
    assert material.lengths["llm"]["cut"] == 1 and len(material.rows) == 3
    assert not material.budget.over([document_text(p) for p in material.corpus.passages])
