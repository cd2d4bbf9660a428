"""The stages' recipes built from the config: what each `_target_` node becomes, and the settings nodes
as typed settings. Like `instantiators`, a config-boundary module: the stages never see the config. What
every stage shares (cache, seed, progress, run folder, rank) is not in a recipe: it is the run's
`RunContext` (`instantiators.run_context`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from confrag.cbdr.settings import CBDRNode, CBDRSettings, cbdr_settings
from confrag.data.gold_needs import GoldNeed
from confrag.infra import checks
from confrag.infra.distributed import rank_trainer_devices
from confrag.instantiators import (
    built,
    check_node_keys,
    instantiate_list,
    node_parameters,
    plain,
    refuse_moved_keys,
    settings_from,
)
from confrag.llm.config import LLMConfig
from confrag.llm.loading import model_num_layers
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import PromptTemplates
from confrag.probe.datamodule import probe_layer
from confrag.probe.module import check_probe_settings
from confrag.rag.settings import AnswerSettings, EvalSettings
from confrag.reports.hub import HubSettings
from confrag.reranker.confidence_sources import GOLD_SOURCES
from confrag.reranker.data import PreferenceDataModule
from confrag.reranker.kinds import reranker_kind
from confrag.reranker.module import RerankerModule
from confrag.reranker.settings import PairBatching, RerankerSettings
from confrag.stages.alignment import AlignmentSettings
from confrag.stages.base_reranker import BaseRerankerSettings
from confrag.stages.nq_rerank import PreferenceSettings
from confrag.stages.probe import DEFAULT_MONITOR, ProbeRecipe
from confrag.stages.rerank import RerankRecipe
from confrag.stages.rerankers import RerankerRecipe
from confrag.stages.retrieval import RetrievalSettings

R = TypeVar("R")

# The reranker `data` keys that change what training learns (not workers, not the scoring batch).
RERANKER_DATA_KEYS = ("group_size", "batch_size", "query_max_len", "passage_max_len")
TRAINER_KEYS = ("max_epochs", "max_steps", "accumulate_grad_batches", "precision")


def probe_recipe(node: DictConfig, monitor: str | None = None, where: str = "") -> ProbeRecipe:
    """From a node holding the probe's `data` (NQConfidenceDataModule), `model` and `trainer`: the probe
    task's root config, or the `probe` node of a later task. The probe's layer (`model.layer`) is resolved here,
    once, from the LLM's layer count (its config alone: no weights load), and handed as an integer to the data
    module and the model; both nodes' settings are checked here, before anything runs. `monitor`: the dev metric
    the checkpoint is chosen by (the probe task's checkpoint callback's; else the node's `monitor`, else
    val/gold_mrr). `where`: the node's key in the run's config ("probe." in a later task), so that messages name
    overrides that work."""
    data_cfg, model_cfg, trainer_cfg = node.data, node.model, node.trainer
    data_key, model_key = f"{where}data", f"{where}model"
    with checks.config_key(model_key, node_parameters(model_cfg)):
        layer = probe_layer(model_cfg.get("layer"), model_num_layers(llm_node(data_cfg.llm)))
        # The model's own checks (dropout, lr, ...) and keys, without building one: its input width comes with the data.
        check_node_keys(model_cfg, given=("input_dim", "layer"))
        check_probe_settings(**{k: v for k, v in plain(model_cfg).items() if not k.startswith("_")})
    datamodule = built(data_cfg, data_key, config_node=data_key, layer=layer)
    with checks.config_key(data_key, node_parameters(data_cfg)):  # its checks against the LLM's config
        datamodule.check_settings()
    if model_cfg.get("optimizer") == "lbfgs" and data_cfg.get("batch_size") is not None:
        raise ValueError(
            f"{model_key}.optimizer=lbfgs takes whole-split batches: set {data_key}.batch_size=null "
            f"(got {data_cfg.batch_size})"
        )
    return ProbeRecipe(
        make_datamodule=lambda: instantiate(data_cfg, config_node=data_key, layer=layer, _convert_="all"),
        make_model=lambda **kw: instantiate(model_cfg, layer=layer, **kw, _convert_="all"),
        make_trainer=lambda **kw: instantiate(trainer_cfg, **{**rank_devices(trainer_cfg), **kw}),
        identity={
            "model": OmegaConf.to_container(model_cfg, resolve=True),
            "max_epochs": trainer_cfg.get("max_epochs"),
        },
        layer=layer,
        monitor=str(monitor or node.get("monitor") or DEFAULT_MONITOR),
    )


def rank_devices(trainer_cfg: DictConfig) -> dict:
    """A one-device GPU trainer in a rank of a multi-process launch trains on that rank's GPU."""
    devices = trainer_cfg.get("devices")
    chosen = rank_trainer_devices(trainer_cfg.get("accelerator"), devices)
    return {} if chosen is devices else {"devices": chosen}


def reranker_recipe(cfg: DictConfig) -> RerankerRecipe:
    """The reranker's settings (`model`: RerankerSettings) and batching (`data`: PairBatching), each built and
    checked here without loading a backbone, and the trainer; the stages build the module and the data module from
    them."""
    settings = typed_node(cfg.model, "model", RerankerSettings)
    batching = typed_node(cfg.data, "data", PairBatching)
    on_gpu = cfg.trainer.get("accelerator") in ("gpu", "cuda")
    return RerankerRecipe(
        make_model=lambda **kw: RerankerModule(settings.replace(**kw)),
        make_datamodule=lambda **kw: PreferenceDataModule(batching, **kw),
        make_trainer=lambda extra_callbacks=(), **kw: instantiate(
            cfg.trainer,
            callbacks=[*instantiate_list(cfg.get("callbacks")), *extra_callbacks],
            **{**rank_devices(cfg.trainer), **kw},
        ),
        identity={
            "model": settings.identity(),
            "data": {k: getattr(batching, k) for k in RERANKER_DATA_KEYS},
            "trainer": {k: cfg.trainer.get(k) for k in TRAINER_KEYS},
            "seed": cfg.seed,
        },
        eval_batch_size=batching.eval_batch_size,
        fast_dev_run=bool(cfg.trainer.get("fast_dev_run")),
        device="cuda" if on_gpu else None,
    )


def typed_node(node: DictConfig, key: str, cls: type[R]) -> R:
    """The settings object a `_target_` node builds (its values checked, each named under `key`), refused when
    the node's `_target_` builds anything else."""
    found = built(node, key)
    if not isinstance(found, cls):
        raise ValueError(f"{key}._target_ must be {cls.__module__}.{cls.__name__} (got {type(found).__name__})")
    return found


def llm_node(node: DictConfig) -> dict:
    """The `llm` node as the plain mapping the stages load the LLM from, checked once here as an `LLMConfig`
    (a key missing or unknown named; every bad value at once, under `llm.`: `llm.repo_id is required when
    source=hf`)."""
    settings_from(LLMConfig, node, "llm")
    return plain(node)


def templates(cfg: DictConfig) -> PromptTemplates:
    return settings_from(PromptTemplates, cfg.prompts, "prompts")


def rerank_recipe(cfg: DictConfig) -> RerankRecipe:
    """Everything the rerank stage is built from; every setting checked here, before anything runs (a key that
    moved, set by a config file, refused first naming its new place: `refuse_moved_keys`)."""
    refuse_moved_keys(cfg)
    retrieval = settings_from(RetrievalSettings, cfg.retrieval, "retrieval")
    with checks.config_key("retrieval", node_parameters(cfg.retrieval), others=False):  # not a file's own errors
        retrieval.check_files()
    preferences = settings_from(PreferenceSettings, cfg.preferences, "preferences")
    if preferences.top_k > retrieval.top_n and not retrieval.candidates_path:
        raise ValueError(
            f"preferences.top_k={preferences.top_k} is larger than the retrieval.top_n="
            f"{retrieval.top_n} candidates of a question; lower it or raise retrieval.top_n"
        )
    relevance = [key for key in ("relevance_baseline", "mix_relevance") if getattr(preferences, key)]
    if float(cfg.model.distill_weight) > 0 and preferences.teacher == "inc" and relevance:
        raise ValueError(
            "model.distill_weight > 0 with preferences.teacher=inc distils the probe's Inc, which the relevance rows "
            f"of {' and '.join('preferences.' + k for k in relevance)} do not carry: set "
            f"{' '.join('preferences.' + k + '=false' for k in relevance)}, or distil toward the base reranker "
            "(preferences.teacher=base), whose scores every row gets"
        )
    return RerankRecipe(
        alignment=alignment_settings(cfg, preferences),
        probe=probe_recipe(cfg.probe, where="probe."),
        llm=llm_node(cfg.llm),
        templates=templates(cfg),
        retrieval=retrieval,
        preferences=preferences,
        answers=settings_from(AnswerSettings, cfg.rag, "rag"),
        base=settings_from(BaseRerankerSettings, cfg.get("base_reranker"), "base_reranker"),
        reranker=reranker_recipe(cfg),
    )


def alignment_settings(cfg: DictConfig, preferences: PreferenceSettings) -> AlignmentSettings:
    """The `alignment` node, its student checked against the base it starts from (before any weights load)."""
    alignment = settings_from(AlignmentSettings, cfg.alignment, "alignment")
    if alignment.reads_vectors and not reranker_kind(cfg.model.kind).embeds_apart:
        raise ValueError(
            f"alignment.student={alignment.student} reads the base's query and passage vectors: the base must be a "
            f"bi-encoder (model=reranker_minilm_bi base_reranker.train=false: MiniLM as it comes); got model.kind="
            f"{cfg.model.kind}. Or "
            "train alignment.student=residual_cross_encoder or cross_encoder"
        )
    if alignment.active and preferences.rows_path:
        raise ValueError(
            f"alignment.teacher={alignment.teacher} (or alignment.fusion_weight) reads the preference questions' "
            "candidates, which your own rows (preferences.rows_path) do not come with: leave alignment at its default"
        )
    return alignment


def evaluation_recipe(cfg: DictConfig) -> tuple[RerankRecipe, AnswerSettings, EvalSettings]:
    """What the cbdr and gates tasks share: the rerank stage, the answers (`rag`), the questions (`eval`)."""
    recipe = rerank_recipe(cfg)
    if recipe.preferences.rows_path:
        raise ValueError(
            f"preferences.rows_path={recipe.preferences.rows_path}: your own rows train the rerank task's reranker "
            f"(+experiment=reranker_rows); the {cfg.task_name} task builds its rerankers from the probe's candidates: "
            "leave preferences.rows_path null here"
        )
    return recipe, recipe.answers, settings_from(EvalSettings, cfg.eval, "eval")


def cbdr_recipe(
    cfg: DictConfig, answers: AnswerSettings, evaluation: EvalSettings, retrieval: RetrievalSettings
) -> CBDRSettings:
    """The `cbdr` node (each bad value as `cbdr.<key>`), its K checked against the candidates retrieved."""
    node = settings_from(CBDRNode, cfg.cbdr, "cbdr")
    if max(*answers.top_k, node.top_k) > retrieval.top_n and not retrieval.candidates_path:
        raise ValueError(
            f"rag.top_k={list(answers.top_k)} / cbdr.top_k={node.top_k} ask for more contexts than the "
            f"retrieval.top_n={retrieval.top_n} candidates retrieved per question; lower K or raise retrieval.top_n"
        )
    return cbdr_settings(node, answers, evaluation)


@dataclass(frozen=True)
class Exported(Generic[R]):
    """What `check` returns for a task that exports a folder to the Hugging Face Hub (probe, rerank): its
    stage's recipe and the `hub` settings."""

    recipe: R
    hub: HubSettings


def exported(cfg: DictConfig, recipe: Callable[[], R], *repos: str) -> Exported[R]:
    """The `hub` node (with `hub.push`, the repos named in `repos` required), then the stage's recipe."""
    hub = hub_settings(cfg, *repos)
    return Exported(recipe(), hub)


def hub_settings(cfg: DictConfig, *repos: str) -> HubSettings:
    """The `hub` node; with `hub.push`, each of `repos` (e.g. "probe_repo") must name a repo."""
    return settings_from(HubSettings, cfg.get("hub"), "hub").require(*repos)


def shipped_prompted_llm(llm: str, prompts: str, cache_dir: str, **changes) -> PromptedLLM:
    """The LLM of the shipped node conf/llm/<llm>.yaml (`changes` over its values, e.g. dtype) with the prompts of
    conf/prompts/<prompts>.yaml, loaded: how a study outside a Hydra run (experiments/) gets the run's LLM."""
    from confrag.infra.paths import config_dir
    from confrag.llm.loading import load_llm

    node = OmegaConf.load(config_dir() / "llm" / f"{llm}.yaml")
    values = llm_node(OmegaConf.merge(node, {"cache_dir": cache_dir, **changes}))
    prompt_node = OmegaConf.load(config_dir() / "prompts" / f"{prompts}.yaml")
    return PromptedLLM(load_llm(values), PromptTemplates(**plain(prompt_node)))


# Where a question set without gold paragraphs runs in one command (named after the settings that read them).
OWN_QUESTIONS = (
    "+experiment=cbdr_own_questions or reranker_own_questions sets all but the corpus (cbdr_own_questions_tiny_llama: "
    "the same on a tiny random LLM, a smoke test in minutes): docs/usage.md, your own questions"
)


def gold_paragraph_needs(recipe: RerankRecipe) -> list[GoldNeed]:
    """Every setting of a rerank recipe that reads the questions' gold paragraphs ("ctxs"), with the overrides that
    do without (the probe's from its data module, which knows its node): what a question set without any must
    change, all named at once before any stage (`question_budget.check_recipe_questions`)."""
    needs = recipe.probe.make_datamodule().gold_paragraph_needs()
    if not (recipe.retrieval.corpus_path or recipe.retrieval.candidates_path):
        needs.append(
            GoldNeed(
                "dataset.corpus_path=null (the corpus is the questions' gold paragraphs)",
                "dataset.corpus_path=<your corpus>",
                "retrieval.candidates_path=<your candidates, texts included>",
            )
        )
    if recipe.base.train and not recipe.base.questions_path:
        needs.append(
            GoldNeed(
                "base_reranker.train=true (its relevance rows: the questions' gold paragraphs as positives)",
                "base_reranker.train=false",
                "base_reranker.questions_path=<a question file with gold paragraphs, none of its questions here>",
            )
        )
    if recipe.preferences.confidence in GOLD_SOURCES:
        needs.append(
            GoldNeed(
                f"preferences.confidence={recipe.preferences.confidence} (Conf 1 on the question's own paragraph)",
                "preferences.confidence=probe",
            )
        )
    return needs
