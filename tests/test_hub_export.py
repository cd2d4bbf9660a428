"""What the rerank task publishes: the exported reranker's model card, NQ_Rerank as a parquet `datasets`
dataset with its card, and the Hub upload, which is off by default and never called here (the folders it
would push are checked instead)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from datasets import load_dataset
from huggingface_hub import DatasetCard, ModelCard

from confrag.instantiators import settings_from
from confrag.reports.hub import HubSettings, RerankRun, dataset_card, reranker_card, write_dataset, write_reranker_card
from confrag.tasks import rerank as rerank_task

from helpers.runs import compose_cfg
from helpers.settings import shipped_settings

TABLE1 = [  # as the rerank stage's table1() writes them: the label, the id, the metrics
    {"system": "BM25", "id": "bm25", "MRR@5": 33.33, "Top-1": 20.0},
    {"system": "base + confidence FT (sign)", "id": "confidence_ft.sign", "MRR@5": 41.5, "Top-1": 30.0},
]
ROWS = {
    "train": [
        {
            "qid": "q1",
            "query": "who wrote hamlet",
            "pos": ["Hamlet\nHamlet is a tragedy by William Shakespeare."],
            "neg": ["Macbeth\nMacbeth is a tragedy."],
            "pos_scores": [0.2],
            "neg_scores": [-0.1],
            "prompt": "Given a query A and a passage B ...",
        },
        {
            "qid": "q2",
            "query": "capital of france",
            "pos": ["Paris\nParis is the capital of France."],
            "neg": ["Lyon\nLyon is a city.", "Nice\nNice is a city."],
            "pos_scores": [0.3],
            "neg_scores": [-0.2, -0.05],
            "prompt": "Given a query A and a passage B ...",
        },
    ],
    "test": [
        {
            "qid": "q3",
            "query": "largest planet",
            "pos": ["Jupiter\nJupiter is the largest planet."],
            "neg": ["Mars\nMars is red."],
            "pos_scores": [0.4],
            "neg_scores": [-0.3],
            "prompt": "Given a query A and a passage B ...",
        }
    ],
}


def run_facts(**overrides) -> RerankRun:
    values = dict(
        llm="smollm2_135m",
        backbone="minilm",
        exported="confidence_ft.sign",
        rule="sign",
        reference="rag_empty",
        top_k=5,
        rows={"train": 2, "test": 1},
        test_questions=1,
        table1=TABLE1,
        command="python train.py +experiment=reranker_smollm2",
    )
    return RerankRun(**{**values, **overrides})


def exported_folder(tmp_path, name="reranker"):
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    return folder


def test_model_card_front_matter_and_body(tmp_path):
    folder = exported_folder(tmp_path)
    card = ModelCard.load(write_reranker_card(folder, run_facts()))
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert card.data.license == "apache-2.0" and card.data.pipeline_tag == "text-ranking"
    assert card.data.library_name == "sentence-transformers" and "rule-sign" in card.data.tags
    text = card.text
    assert "n = 1 questions" in text and "| base + confidence FT (sign) | 41.50 | 30.00 |" in text
    # The exported row named by its label (from its id); the id is no column of the card's table.
    assert text.lstrip().startswith("# base + confidence FT (sign): a reranker aligned") and "confidence_ft" not in text
    assert "| Reranker | MRR@5 | Top-1 |" in text
    assert "rule `sign`, reference `rag_empty`" in text and "2 train, 1 test rows" in text
    assert "python train.py +experiment=reranker_smollm2" in text and "cc-by-sa-3.0" in text
    # A backbone given by HF id is named as such.
    assert ModelCard.load(
        write_reranker_card(folder, run_facts(backbone="BAAI/bge-reranker-v2-m3"))
    ).data.base_model == ("BAAI/bge-reranker-v2-m3")


def test_the_cards_state_this_run_s_facts_not_the_embedded_default_s():
    """A reranker fine-tuned as it comes, on a user's question set, from a command with local paths: the card
    says so, credits no NQ, and shows the paths' file names only."""
    run = run_facts(
        base_trained=False,
        questions="popqa",
        command="python train.py +experiment=cbdr_tiny_llama dataset=popqa dataset.questions_path=/home/me/popqa.jsonl "
        "'dataset.corpus_path=/data/my corpus.jsonl'",
    )
    card = reranker_card(run)
    assert "fine-tuned on NQ_Rerank as it comes" in card and "first trained as the base reranker" not in card
    assert "Natural Questions" not in card and "`popqa` question set" in card and "the training rows: other" in card
    assert "dataset.questions_path=<path>/popqa.jsonl" in card and "/home/me" not in card and "/data/" not in card
    rows = dataset_card(run, {"train": "data/train-0.parquet"})
    assert "Natural Questions" not in rows and "license: other" in rows and "/home/me" not in rows
    default = reranker_card(run_facts())
    assert "first trained as the base reranker" in default and "Natural Questions" in default
    # The dev guard kept the base's weights: the card says the model scores as the base does.
    assert "Weights kept" not in default
    assert "**Weights kept**: the base reranker's" in reranker_card(run_facts(kept_base=True))


def test_model_card_needs_an_exported_model_and_table_rows(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no exported model"):
        write_reranker_card(tmp_path, run_facts())
    with pytest.raises(ValueError, match="needs the run's Table 1 rows"):
        write_reranker_card(exported_folder(tmp_path), run_facts(table1=[]))


def test_a_cross_fitted_export_gets_a_card_per_fold_and_one_at_its_top(tmp_path):
    """`FoldedReranker.export` writes one model per fold (`fold<f>/`): the task's card step used to refuse it after
    every fold had trained (a cross-fitted `task_name=rerank` run ended in FileNotFoundError)."""
    for f in range(3):
        exported_folder(tmp_path / "reranker", f"fold{f}")
    top = write_reranker_card(tmp_path / "reranker", run_facts())
    assert "One reranker per fold, in `fold0/` to `fold2/`" in top.read_text()
    for f in range(3):
        card = ModelCard.load(tmp_path / "reranker" / f"fold{f}" / "README.md")
        assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
        assert f"This is fold{f} of 3: trained without the questions of its fold" in card.text


def test_nq_rerank_dataset_loads_with_datasets(tmp_path):
    folder = write_dataset(ROWS, tmp_path / "nq_rerank_dataset", run_facts())
    names = sorted(p.name for p in (folder / "data").iterdir())
    assert [n.split("-")[0] for n in names] == ["test", "train"] and all(n.endswith(".parquet") for n in names)
    loaded = load_dataset(str(folder))
    assert set(loaded) == {"train", "test"}
    assert loaded["train"].to_list() == ROWS["train"] and loaded["test"].to_list() == ROWS["test"]
    card = DatasetCard.load(folder / "README.md")
    assert card.data.license == "cc-by-sa-3.0" and "Natural Questions" in card.text
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # built beside, renamed
    # Rewritten in place; an empty split is left out; no rows at all is refused.
    write_dataset({"train": ROWS["train"], "test": []}, folder, run_facts())
    assert set(load_dataset(str(folder))) == {"train"}
    with pytest.raises(ValueError, match="no rows in any split"):
        write_dataset({"train": []}, tmp_path / "empty", run_facts())


def test_each_run_s_dataset_loads_its_own_rows(tmp_path, monkeypatch):
    """`load_dataset(folder)` keys its cache by the card's file paths: with fixed file names, a second run's
    folder (also named nq_rerank_dataset) read back the first run's rows from that cache."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    first = write_dataset(ROWS, tmp_path / "run1" / "nq_rerank_dataset", run_facts())
    other = {"train": ROWS["train"][:1], "test": ROWS["test"]}
    second = write_dataset(other, tmp_path / "run2" / "nq_rerank_dataset", run_facts())
    assert load_dataset(str(first))["train"].to_list() == ROWS["train"]
    assert load_dataset(str(second))["train"].to_list() == other["train"]


def test_hub_push_is_off_by_default_and_needs_both_repo_ids(tmp_path):
    cfg = compose_cfg(["+experiment=reranker_tiny_llama"], tmp_path)
    assert settings_from(HubSettings, cfg.hub, "hub") == shipped_settings(HubSettings, "hub", push=False)
    with pytest.raises(ValueError, match="hub.push is true: hub.reranker_repo must be a repo id"):
        shipped_settings(HubSettings, "hub", push=True, dataset_repo="me/rows").require("reranker_repo", "dataset_repo")
    with pytest.raises(ValueError, match="hub.push is true: hub.dataset_repo must be a repo id.*'rows'"):
        shipped_settings(HubSettings, "hub", push=True, reranker_repo="me/reranker", dataset_repo="rows").require(
            "reranker_repo", "dataset_repo"
        )
    with pytest.raises(ValueError, match="hub.push is true: hub.reranker_repo must be a repo id"):
        rerank_task.check(compose_cfg(["+experiment=reranker_tiny_llama", "hub.push=true"], tmp_path))
    with pytest.raises(ValueError, match="hub.push must be true or false"):
        shipped_settings(HubSettings, "hub", push="yes")
    with pytest.raises(ValueError, match=r"hub: unknown key\(s\) \['repo'\]"):
        rerank_task.check(compose_cfg(["+experiment=reranker_tiny_llama", "+hub.repo=me/x"], tmp_path))


def test_publish_writes_the_folders_and_pushes_only_when_asked(tmp_path, monkeypatch):
    cfg = compose_cfg(["+experiment=reranker_tiny_llama"], tmp_path)
    recipe = rerank_task.check(cfg).recipe
    out = tmp_path / "out"
    exported_folder(out)
    base, aligned = object(), object()
    stage = SimpleNamespace(
        main="confidence_ft.sign",
        preferences=SimpleNamespace(splits=ROWS),
        base=SimpleNamespace(module=base),
        rerankers={"base": base, "confidence_ft.sign": aligned},
    )
    pushed = []

    def never(*args, **kwargs):
        raise AssertionError("push_to_hub called with hub.push false")

    monkeypatch.setattr(rerank_task, "push_folder", never)
    rerank_task.publish(cfg, recipe, stage, TABLE1, 1, shipped_settings(HubSettings, "hub"), out)
    card = ModelCard.load(out / "reranker" / "README.md")
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert card.text.count("python train.py") == 1 and "Weights kept" not in card.text
    assert load_dataset(str(out / "nq_rerank_dataset"))["train"].num_rows == 2
    # Asked to push: each folder goes to its own repo (recorded here, never uploaded).
    monkeypatch.setattr(rerank_task, "push_folder", lambda *args: pushed.append(args) or "url")
    hub = shipped_settings(
        HubSettings, "hub", push=True, reranker_repo="me/reranker", dataset_repo="me/rows", private=True
    )
    rerank_task.publish(cfg, recipe, stage, TABLE1, 1, hub, out)
    assert pushed == [
        (out / "reranker", "me/reranker", "model", True),
        (out / "nq_rerank_dataset", "me/rows", "dataset", True),
    ]
    # The exported row is the base's module (`as_trained`: the dev guard kept the base): the card says so.
    stage.rerankers["confidence_ft.sign"] = base
    rerank_task.publish(cfg, recipe, stage, TABLE1, 1, shipped_settings(HubSettings, "hub"), out)
    assert "**Weights kept**: the base reranker's" in (out / "reranker" / "README.md").read_text()
