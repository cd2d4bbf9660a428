"""The reranker: loss, preference data, the Lightning module on MiniLM, export and LoRA."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from lightning import Callback

from confrag.reranker.data import GroupDataset
from confrag.reranker.loss import distillation_kl, group_infonce
from confrag.reranker.metrics import ranking_metrics
from confrag.reranker.module import RerankerModule, minilm_dir
from confrag.reranker.rows import candidate_lists, load_rows, validate_rows
from confrag.reranker.tokenization import encode_pairs

from helpers.data import TOPICS
from helpers.modules import preference_data, reranker_module
from helpers.reranking import fast_trainer


def toy_rows() -> list[dict]:
    """8 rows: two positives about the query, four negatives about the other topics."""
    rows = []
    for i, (query, pos_a, pos_b) in enumerate(TOPICS):
        negs = [TOPICS[(i + d) % len(TOPICS)][1 + d % 2] for d in (1, 3, 5, 7)]
        rows.append(
            {
                "qid": f"t{i}",
                "query": query,
                "pos": [pos_a, pos_b],
                "neg": negs,
                "pos_scores": [0.3, 0.2],
                "neg_scores": [-0.1, -0.2, -0.3, -0.4],
                "prompt": "rank",
            }
        )
    return rows


class BackboneModeSpy(Callback):
    """Records whether the backbone is in training mode (dropout on) at every training step."""

    def __init__(self) -> None:
        self.modes: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.modes.append(all(m.training for m in pl_module.model.modules()))


def mean_group_loss(module: RerankerModule, rows: list[dict], group_size: int = 4) -> float:
    dataset = GroupDataset(rows, group_size, seed=0)
    items = [dataset[i] for i in range(len(dataset))]
    scores = module.score(
        [it["query"] for it in items for _ in it["passages"]], [p for it in items for p in it["passages"]]
    )
    return float(group_infonce(torch.from_numpy(scores).view(len(items), group_size), module.settings.tau))


# --- loss ----------------------------------------------------------------------------------------


def test_group_infonce_by_hand():
    scores = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, -1.0]])
    # τ = 0.5: logits [4, 2, 0] -> −4 + log(e^4 + e^2 + e^0) = log(1 + e^−2 + e^−4) = 0.1429316285
    #          logits [0, 2, −2] -> log(1 + e^2 + e^−2) = 2.1429316285; the mean is 1.1429316285.
    assert float(group_infonce(scores, 0.5)) == pytest.approx(1.1429316285, abs=1e-6)
    assert float(group_infonce(scores[:1], 0.5)) == pytest.approx(0.1429316285, abs=1e-6)
    # τ = 1 on the first row: log(1 + e^−1 + e^−2) = log(1.5032147244) = 0.4076059644
    assert float(group_infonce(scores[:1], 1.0)) == pytest.approx(0.4076059644, abs=1e-6)


def test_distillation_kl_by_hand():
    student = torch.tensor([[2.0, 1.0, 0.0]], requires_grad=True)
    teacher = torch.tensor([[0.3, -0.1, -0.2]], requires_grad=True)
    # Teacher at τ_t = 0.1: softmax([3, −1, −2]) = [0.9755588, 0.0178680, 0.0065733];
    # student at τ = 1: log_softmax([2, 1, 0]) = [−0.4076060, −1.4076060, −2.4076060];
    # KL = Σ t (log t − log s) = 0.3095373.
    kl = distillation_kl(student, teacher, 1.0, teacher_temperature=0.1)
    assert float(kl) == pytest.approx(0.3095373391, abs=1e-6)
    kl.backward()
    assert teacher.grad is None and student.grad is not None
    same = torch.tensor([[1.0, 0.5, -2.0]])
    assert float(distillation_kl(same, same, 0.7)) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("tau", [0.0, -1.0, float("nan")])
def test_non_positive_temperature_names_model_tau(tau):
    """The library names its parameter; the task's check names `model.tau` (tests/test_rerank_task.py)."""
    with pytest.raises(ValueError, match="^temperature must be > 0"):
        group_infonce(torch.zeros(2, 3), tau)
    with pytest.raises(ValueError, match="^tau must be > 0"):
        reranker_module(tau=tau)  # refused before any weights are loaded


def test_group_of_one_is_refused():
    with pytest.raises(ValueError, match="data.group_size"):
        group_infonce(torch.zeros(2, 1), 1.0)
    with pytest.raises(ValueError, match="^group_size must be an integer >= 2"):
        GroupDataset(toy_rows(), group_size=1)
    with pytest.raises(ValueError, match="^group_size"):
        preference_data(train=toy_rows(), group_size=1)


# --- rows and groups -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("pos", [], r"train row 1: field 'pos' must be a non-empty list"),
        ("neg", [], r"train row 1: field 'neg' must be a non-empty list"),
        ("neg", ["same", "other", "same"], r"train row 1: field 'neg' holds the same passage twice \(items 0 and 2\)"),
        ("pos", ["shared", "x"], r"train row 1: passage in both 'pos' and 'neg'"),
        ("pos_scores", [0.1], r"train row 1: field 'pos_scores' has 1 values for 2 passages in 'pos'"),
        ("neg_scores", None, r"train row 1: has 'pos_scores' but no 'neg_scores'"),
        ("query", "  ", r"train row 1: field 'query' must be a non-empty string"),
    ],
)
def test_bad_rows_name_the_row_and_field(field, value, message):
    rows = toy_rows()
    if field == "pos" and value and value[0] == "shared":
        rows[1]["neg"][0] = "shared"
    rows[1][field] = value
    with pytest.raises(ValueError, match=message):
        validate_rows(rows, "train")


def test_rows_load_from_jsonl_and_datasets_folder(tmp_path):
    from datasets import Dataset

    rows = toy_rows()
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert load_rows(path, "data.train") == rows
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "train_arrow"))
    assert load_rows(tmp_path / "train_arrow", "data.train") == rows
    path.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"data.train: .*train.jsonl, line 2: malformed JSON"):
        load_rows(path, "data.train")
    with pytest.raises(FileNotFoundError, match="data.test="):
        load_rows(tmp_path / "missing.jsonl", "data.test")


def test_groups_follow_flagembedding_sampling():
    rows = toy_rows()
    dataset = GroupDataset(rows, group_size=4, seed=7)
    for i, row in enumerate(rows):
        item = dataset[i]
        assert item["query"] == row["query"] and len(item["passages"]) == 4
        assert item["passages"][0] in row["pos"]
        negs = item["passages"][1:]
        assert set(negs) <= set(row["neg"]) and len(set(negs)) == 3  # without replacement: 4 available
        assert item["teacher_scores"] == [row["pos_scores"][row["pos"].index(item["passages"][0])]] + [
            row["neg_scores"][row["neg"].index(p)] for p in negs
        ]
    assert dataset[3] == GroupDataset(rows, group_size=4, seed=7)[3]  # reproducible
    # Fewer negatives than G − 1 = 9: 9 drawn without replacement from the 4 negatives repeated
    # ceil(9 / 4) = 3 times, so a negative comes up at most 3 times.
    for i in range(len(rows)):
        big = GroupDataset(rows, group_size=10, seed=0)[i]
        counts = [big["passages"][1:].count(n) for n in rows[i]["neg"]]
        assert sum(counts) == 9 and max(counts) <= 3 and len(big["passages"]) == 10
    # A fresh positive per epoch: over 8 rows and 6 epochs both positives of some row come up.
    seen = {}
    for epoch in range(6):
        dataset.set_epoch(epoch)
        for i in range(len(rows)):
            seen.setdefault(i, set()).add(dataset[i]["passages"][0])
    assert max(len(s) for s in seen.values()) == 2
    unscored = [{k: v for k, v in r.items() if not k.endswith("_scores")} for r in rows]
    assert GroupDataset(unscored, 4)[0]["teacher_scores"] is None


def test_truncation_is_counted_and_respects_the_budgets():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    long_passage = " ".join(f"word{i}" for i in range(200))
    long_query = "who " + " ".join(["really"] * 30) + " wrote hamlet"
    encoded = encode_pairs(
        tokenizer,
        ["who wrote hamlet", long_query, "who wrote hamlet"],
        ["Shakespeare wrote it.", "Shakespeare wrote it.", long_passage],
        query_max_len=8,
        passage_max_len=24,
    )
    ids, types, mask = (encoded.features[k] for k in ("input_ids", "token_type_ids", "attention_mask"))
    assert ids.shape == (3, 32)  # budget 8 + 24, reached by the truncated pair
    assert encoded.truncated_pairs == 1 and encoded.truncated_queries == 1
    assert int(((types[1] == 0) & (mask[1] == 1)).sum()) == 8 + 2  # [CLS] + 8 query tokens + [SEP]
    # The cap is the model's 512 positions, not 128 + 512.
    assert encode_pairs(tokenizer, ["q"], [" ".join(["word"] * 900)]).features["input_ids"].shape[1] == 512

    rows = toy_rows()
    rows[0]["neg"][0] = long_passage
    dm = preference_data(train=rows, test=rows, query_max_len=16, passage_max_len=24, batch_size=4, group_size=5)
    dm.setup("fit")
    assert dm.truncation["train"] == {"pairs": 48, "truncated_pairs": 1, "truncated_queries": 0}
    batches = list(dm.train_dataloader())
    assert [b["features"]["input_ids"].shape[0] for b in batches] == [20, 20]
    assert all(b["group_size"] == 5 and b["teacher_scores"].shape == (4, 5) for b in batches)
    assert dm.truncated_pairs == 1  # row 0 has 4 negatives and G − 1 = 4: the long one is always drawn
    test_batch = next(iter(dm.test_dataloader()))
    assert test_batch["group_sizes"] == [6] * 8 and dm.truncated_pairs == 2
    assert dm.val_dataloader() == []  # no validation rows: Lightning skips validation


# --- module --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.manual_seed(0)
    rows = toy_rows()
    module = reranker_module(lr=2e-4, seed=0)
    before = mean_group_loss(module, rows)
    dm = preference_data(train=rows, test=rows, batch_size=4, group_size=4, seed=0)
    spy = BackboneModeSpy()
    trainer = fast_trainer(max_steps=12, callbacks=[spy])
    trainer.fit(module, datamodule=dm)
    epoch_seen = trainer.train_dataloader.dataset.epoch  # trainer.test() below drops the train loader
    after = mean_group_loss(module, rows)
    tested = trainer.test(module, datamodule=dm, verbose=False)[0]
    export_dir = module.export(tmp_path_factory.mktemp("export") / "reranker")
    return {
        "module": module,
        "before": before,
        "after": after,
        "test": tested,
        "dm": dm,
        "export": export_dir,
        "rows": rows,
        "epoch_seen": epoch_seen,
        "modes": spy.modes,
    }


@pytest.mark.heavy
def test_infonce_training_lowers_the_loss(trained):
    assert trained["after"] < trained["before"] - 0.1, (trained["before"], trained["after"])
    assert trained["module"].trainer.global_step == 12
    # 8 rows / batch 4 = 2 steps an epoch: 6 epochs, each told to the dataset for fresh positives.
    assert trained["epoch_seen"] == 5
    assert len(trained["modes"]) == 12 and all(trained["modes"])  # fine-tuned with dropout on, as FlagEmbedding does


@pytest.mark.heavy
def test_test_metrics_are_table_1_metrics_of_the_scores(trained):
    module, rows = trained["module"], trained["rows"]
    lists = candidate_lists(rows, seed=0)
    scores = [module.score([c["query"]] * len(c["passages"]), c["passages"]).tolist() for c in lists]
    expected = ranking_metrics(scores, [c["labels"] for c in lists])
    assert set(trained["test"]) == {f"test/{k}" for k in expected}
    assert all(trained["test"][f"test/{k}"] == pytest.approx(v, abs=1e-6) for k, v in expected.items())
    assert expected["MRR@5"] > 0.5


@pytest.mark.heavy
def test_export_loads_in_transformers_flagreranker_path_and_crossencoder(trained):
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    module, directory = trained["module"], trained["export"]
    pairs = [[r["query"], p] for r in trained["rows"][:3] for p in r["pos"] + r["neg"][:2]]
    expected = module.score([q for q, _ in pairs], [p for _, p in pairs])

    # FlagEmbedding's FlagReranker: AutoModelForSequenceClassification + AutoTokenizer, raw logits.
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        flag = model(**tokenizer(pairs, padding=True, truncation=True, return_tensors="pt")).logits.view(-1).float()
    np.testing.assert_allclose(flag.numpy(), expected, atol=1e-5)

    cross = CrossEncoder(str(directory), device="cpu")
    assert isinstance(cross.activation_fn, torch.nn.Identity)  # raw logits, like FlagReranker
    np.testing.assert_allclose(cross.predict([tuple(p) for p in pairs]), expected, atol=1e-5)

    # Loading the export as a backbone keeps its trained head; fresh_head=True draws the seed's head.
    reloaded = reranker_module(backbone=str(directory))
    np.testing.assert_allclose(reloaded.score([q for q, _ in pairs], [p for _, p in pairs]), expected, atol=1e-5)
    fresh = reranker_module(backbone=str(directory), fresh_head=True, seed=0)
    untrained = reranker_module(seed=0)
    assert torch.equal(fresh.model.classifier.weight, untrained.model.classifier.weight)
    assert not torch.equal(fresh.model.classifier.weight, module.model.classifier.weight)


def test_a_head_of_another_size_needs_fresh_head(tmp_path):
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(minilm_dir(), num_labels=2).save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="model.fresh_head=true"):
        reranker_module(backbone=str(tmp_path / "two"))
    assert reranker_module(backbone=str(tmp_path / "two"), fresh_head=True).model.classifier.out_features == 1


def test_distillation_without_teacher_scores_names_the_setting():
    rows = [{k: v for k, v in r.items() if not k.endswith("_scores")} for r in toy_rows()]
    dm = preference_data(train=rows, batch_size=2, group_size=3)
    module = reranker_module(distill_weight=0.5)
    with pytest.raises(ValueError, match="model.distill_weight > 0 needs teacher scores"):
        module.training_step(next(iter(dm.train_dataloader())), 0)


def test_bad_settings_name_their_key():
    with pytest.raises(ValueError, match="model.lora: .*LoraConfig"):
        reranker_module(lora={"rank": 4})
    with pytest.raises(FileNotFoundError, match="model.backbone='./no/such/model'"):
        reranker_module(backbone="./no/such/model")
    with pytest.raises(ValueError, match="^batch_size must be an integer >= 1"):
        preference_data(train=toy_rows(), batch_size=0)


@pytest.mark.heavy
def test_lora_trains_only_adapters_and_head_and_exports_a_plain_model(tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    module = reranker_module(lr=1e-3, lora={"r": 4, "lora_alpha": 8, "target_modules": ["query", "value"]})
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert any("lora_B" in n for n in trainable) and any("classifier" in n for n in trainable)
    start = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    fast_trainer(max_steps=3).fit(module, datamodule=preference_data(train=toy_rows(), batch_size=4, group_size=4))
    changed = {n for n, p in module.model.named_parameters() if not torch.equal(p, start[n])}
    assert changed and changed <= trainable
    assert any("lora_B" in n for n in changed) and any("classifier" in n for n in changed)

    directory = module.export(tmp_path / "merged")
    plain = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    assert not any("lora" in n or "modules_to_save" in n for n in plain.state_dict())
    assert not (directory / "adapter_config.json").exists()
    queries, passages = ["who wrote the play hamlet"] * 3, [TOPICS[1][1], TOPICS[2][1], TOPICS[3][2]]
    loaded = reranker_module(backbone=str(directory)).score(queries, passages)
    np.testing.assert_allclose(loaded, module.score(queries, passages), atol=1e-5)
    assert type(module.model).__name__.startswith("Peft")  # the export merged a copy; training can go on


def test_a_new_reranker_kind_is_one_registered_class(monkeypatch, tmp_path):
    """Kinds are registered classes: a new one is a subclass plus `register_kind`; the module, its
    tokenization and its export ask the registry (no kind names compared elsewhere)."""
    from confrag.reranker import kinds
    from confrag.reranker.tokenization import encode_pairs

    monkeypatch.setattr(kinds, "KINDS", dict(kinds.KINDS))
    calls = []

    def encode(*args, **kwargs):
        calls.append("encode")
        return encode_pairs(*args, **kwargs)

    @kinds.register_kind
    class ToyKind(kinds.CrossEncoderKind):
        id = "toy_cross_encoder"
        description = "a cross-encoder that marks its export"

        def prepare_export(self, model):
            model.config.toy_kind = True

    ToyKind.encode = staticmethod(encode)
    module = reranker_module(kind="toy_cross_encoder", seed=0)
    assert isinstance(module.kind, ToyKind)
    assert preference_data(kind="toy_cross_encoder").encode is module.encode
    assert module.score(["capital of France"], ["Paris is the capital of France."]).shape == (1,)
    assert calls == ["encode"]
    module.export(tmp_path / "toy")
    assert json.loads((tmp_path / "toy" / "config.json").read_text())["toy_kind"] is True
    with pytest.raises(ValueError, match="registered twice"):
        kinds.register_kind(ToyKind)
    with pytest.raises(
        ValueError, match=r"^kind must be one of cross_encoder, qwen3_yes_no, bi_encoder, toy_cross_encoder"
    ):
        reranker_module(kind="late_interaction")
