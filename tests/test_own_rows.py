"""The rerank task on your own preference rows (`preferences.rows_path`, FlagEmbedding's format): checked as the
project's rows are, split by query, the aligned reranker trained from the base, Table 1 on the held-out queries."""

from __future__ import annotations

import json

import pytest

from confrag.data import DataFormatError
from confrag.stages.own_rows import own_rows
from confrag.train import run_task

from helpers.runs import compose_cfg

TOPICS = ["Paris", "Everest", "Python", "Amazon", "Saturn", "Mozart", "Nile", "Tokyo", "Sahara", "Einstein"]


def row(i: int, topic: str) -> dict:
    return {
        "query": f"tell me about {topic}",
        "pos": [f"{topic} is described here in detail.", f"More facts about {topic}."],
        "neg": [f"Nothing about it: filler text number {i}.", "An unrelated passage.", "Another unrelated one."],
        "pos_scores": [0.4, 0.2],
        "neg_scores": [-0.1, -0.3, -0.2],
    }


def huge_row(i: int, topic: str, negatives: int) -> dict:
    return {
        **row(i, topic),
        "neg": [f"Unrelated passage number {j} about nothing." for j in range(negatives)],
        "neg_scores": [-j / negatives for j in range(negatives)],
    }


def rows_file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


FAST = ["trainer.max_epochs=1", "data.batch_size=2", "data.group_size=3", "data.passage_max_len=32", "logger=csv"]


def test_your_rows_train_in_cpu_sized_batches_with_as_many_groups_a_step_as_the_papers(tmp_path):
    """300 rows took 25 min and 12.2 GB on a CPU (4 groups of 8 pairs of up to 512 tokens held at once): the
    experiment holds 2 groups of at most 128 + 256 tokens at once (the peak measured with every pair at that cap:
    docs/usage.md#your-rows) and accumulates their gradients to the same 4 groups a step as the paper's batches."""
    rows = compose_cfg(["+experiment=reranker_rows", "preferences.rows_path=my_rows.jsonl"], tmp_path)
    paper = compose_cfg(["+experiment=reranker_smollm2"], tmp_path)
    data = rows.data
    assert data.batch_size * data.group_size * (data.query_max_len + data.passage_max_len) <= 2 * 8 * 384
    assert data.batch_size * rows.trainer.accumulate_grad_batches == paper.data.batch_size
    same = ("backbone", "kind", "tau", "lr", "weight_decay", "warmup_ratio")  # the model as the paper's but its lengths
    assert data.group_size == paper.data.group_size and all(rows.model[k] == paper.model[k] for k in same)


@pytest.mark.task
def test_the_rerank_task_trains_on_your_rows_split_by_query(tmp_path):
    # The same query twice (up to case and punctuation): both rows on one side of the split.
    rows = [row(i, t) for i, t in enumerate(TOPICS)] + [{**row(10, "Paris"), "query": "Tell me about PARIS!"}]
    rows[1] = huge_row(1, TOPICS[1], 10_000)  # FlagEmbedding's mined negatives, far too many: cut, named, no stall
    path = rows_file(tmp_path / "my_rows.jsonl", rows)
    data = own_rows(path, 0.3, 0, 100)
    assert data.report["queries"] == 10 and sum(data.report["rows"].values()) == 11
    assert data.report["rows_cut"] == {"rows": 1, "max_passages": 100}
    sides = {r["qid"]: split for split, split_rows in data.splits.items() for r in split_rows}
    paris = [r for split_rows in data.splits.values() for r in split_rows if "paris" in r["query"].lower()]
    assert len(paris) == 2 and len({sides[r["qid"]] for r in paris}) == 1
    cfg = compose_cfg(["+experiment=reranker_rows", f"preferences.rows_path={path}", *FAST], tmp_path)
    run_task(cfg)
    out = tmp_path / "out"
    summary = (out / "summary.txt").read_text()
    assert "Your rows — my_rows.jsonl: 10 queries, rows train" in summary and "(split by query)" in summary
    table = json.loads((out / "metrics.json").read_text())["table1"]
    assert [r["id"] for r in table] == ["base", "own_rows_ft"]
    assert (out / "reranker" / "config.json").is_file() and not (out / "nq_rerank_dataset").exists()
    card = (out / "reranker" / "README.md").read_text()
    assert card.startswith("# A reranker fine-tuned with confrag on my_rows.jsonl")
    assert "| base + FT on your rows |" in card


def test_a_row_of_10000_negatives_is_cut_to_a_seeded_sample_named_in_the_log(tmp_path, caplog):
    rows = [row(i, t) for i, t in enumerate(TOPICS)]
    rows[3] = huge_row(3, TOPICS[3], 10_000)
    path = rows_file(tmp_path / "mined.jsonl", rows)
    with caplog.at_level("WARNING", logger="confrag.stages.own_rows"):
        data = own_rows(path, 0.3, 0, 100)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"preferences.rows_path={path}: 1 of 10 rows hold more than 100 positives or negatives" in warning
    assert (
        "(preferences.rows_max_passages)" in warning
        and "row 4 ('tell me about Amazon': 2 positives, 10000 neg" in warning
    )
    (cut,) = [r for split in data.splits.values() for r in split if "Amazon" in r["query"]]
    assert len(cut["neg"]) == len(cut["neg_scores"]) == 100 and cut["pos"] == rows[3]["pos"]
    numbers = [int(p.split()[3]) for p in cut["neg"]]
    assert numbers == sorted(numbers) and cut["neg_scores"] == [-j / 10_000 for j in numbers]  # scores kept aligned
    assert own_rows(path, 0.3, 0, 100).splits == data.splits  # seeded: the same sample every run
    assert own_rows(path, 0.3, 0, None).report["rows_cut"]["rows"] == 0  # null: every passage


def test_the_collapse_check_scores_a_bounded_sample_of_each_group():
    from confrag.stages.rerankers import COLLAPSE_PASSAGES, check_not_collapsed

    class Counting:
        pairs = 0

        def score(self, queries, passages):
            Counting.pairs += len(passages)
            return [float(len(p)) for p in passages]

    rows = [huge_row(0, "Amazon", 10_000), row(1, "Nile")]
    assert check_not_collapsed(Counting(), rows, "own_rows") > 0
    assert Counting.pairs == COLLAPSE_PASSAGES + 5 == 69  # 10,002 candidates: 64 of them; the small group whole


@pytest.mark.task
def test_bad_rows_are_refused_by_file_and_line_before_anything_runs(tmp_path):
    rows = [row(i, t) for i, t in enumerate(TOPICS)]
    rows[3] = {**rows[3], "neg_scores": [0.1, float("nan"), 0.2]}
    path = rows_file(tmp_path / "bad.jsonl", rows)
    cfg = compose_cfg(["+experiment=reranker_rows", f"preferences.rows_path={path}", *FAST], tmp_path)
    with pytest.raises(
        (ValueError, DataFormatError), match=r"bad.jsonl.* line 4: field 'neg_scores' item 1 must be a finite"
    ):
        run_task(cfg)
    cfg = compose_cfg(["+experiment=reranker_smollm2", f"preferences.rows_path={path}", *FAST], tmp_path)
    with pytest.raises(ValueError, match=r"base_reranker.train=true .*preferences.relevance_baseline=true"):
        run_task(cfg)
    cfg = compose_cfg(["+experiment=cbdr_tiny_llama", f"preferences.rows_path={path}", "logger=csv"], tmp_path)
    with pytest.raises(ValueError, match=r"the cbdr task builds its rerankers from the probe's candidates"):
        run_task(cfg)
    assert not (tmp_path / "cache").exists()
    one = rows_file(tmp_path / "one.jsonl", rows[:1])
    with pytest.raises(
        ValueError, match=r"1 distinct queries split by preferences.test_fraction=0.2 leave 1 to train and 0"
    ):
        own_rows(one, 0.2, 0, None)
