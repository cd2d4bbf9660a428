"""The alignment node of the rerank task (`alignment`): which teacher the base reranker learns from, which student
learns, with which loss; the listwise rows it adds beside the paper's.

The teacher is an entry of `confrag.reranker.listwise_teachers.ALIGNMENT_TEACHERS`. `inc` is the paper's: the probe's
rows under the label rules of `preferences` (sign, rank, utility), group InfoNCE in `RerankerModule`; the rerank
stage trains those rows as it always did and this node adds nothing. Every other teacher is listwise: a target over
each preference question's candidates, learned by a student (`confrag.reranker.listwise_student.STUDENTS`) over the
base's top `top_k` with KL(softmax(target) ‖ softmax(f / τ)) + λ · KL(softmax(base / τ) ‖ softmax(f / τ)) in the
student's Lightning module, for `steps` steps, from the same questions the paper's rows train on (fold by fold when
cross-fitted). Each adds the row `aligned.<teacher>` (`confrag.reranker.systems`) to Tables 1 and 2, `compare` more
of them (the controls: `relevance`, `base`). With `fusion_weight`, the diagnostic row `fusion` z(base) + w · z(ℓ)
(it reads the gold answer: a bound on what a student of ℓ could add, never a reranker) joins them.

What the teachers read is computed once for every preference question (`listwise_material`): the base's scores of
every candidate, the LLM's likelihood ℓ of the gold answer (`stages.likelihood`, cached) and the LLM's greedy answer
under each of the base's top k (the answer cache Table 2 shares). A trained student is cached under
`<cache>/rerankers/<key>` by its settings, teacher, the material's key and its training questions.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from confrag.data.qa_metrics import has_answer
from confrag.infra import checks
from confrag.infra.atomic import swapped_in
from confrag.infra.digests import fingerprint, folder_problem, write_folder_digest
from confrag.infra.locks import once
from confrag.infra.run_context import RunContext
from confrag.llm.batching import check_batch_size
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import PromptTemplates
from confrag.rag.settings import AnswerSettings
from confrag.reranker.aligned import AlignedReranker, load_student, student_base
from confrag.reranker.backbone import resolve_backbone
from confrag.reranker.listwise_data import ListwiseData
from confrag.reranker.listwise_student import CARD, LEARNED, STUDENTS, ListwiseSettings, StudentBase, fit_listwise
from confrag.reranker.listwise_teachers import (
    ALIGNMENT_TEACHERS,
    ANSWERS,
    LIKELIHOOD,
    LISTWISE,
    TeacherInputs,
    teacher_targets,
)
from confrag.reranker.pair_scorer import PairScorer
from confrag.reranker.systems import FUSION, aligned
from confrag.retrieval.candidates import Candidates
from confrag.retrieval.corpus import document_text
from confrag.retrieval.dense import MeanPoolEncoder
from confrag.stages.base_reranker import BaseReranker
from confrag.stages.diagnostics import fusion_scorer, lookup_scorer
from confrag.stages.likelihood import likelihood_stage
from confrag.stages.nq_rerank import PreferenceStage

log = logging.getLogger(__name__)

TRAINING_CARD = "confrag_training.json"
Scorer = Callable[[str, list[str]], np.ndarray]  # a Table 1 row: (query, passages) -> one score per passage


@dataclass(frozen=True)
class AlignmentSettings:
    """The `alignment` config node. Defaults: conf/alignment/default.yaml."""

    teacher: str  # an ALIGNMENT_TEACHERS entry: inc (the paper's rows only) or a listwise teacher
    compare: tuple[str, ...]  # more listwise teachers, each its own row, trained with the same student and settings
    student: str  # a STUDENTS entry
    top_k: int  # the base's top k each student reorders (the loss and the scoring both)
    tau: float | str  # the student's temperature, or "learned"
    teacher_tau: float  # τ_T: the graded teachers' scores (ℓ, the base's) divided by it
    anchor: float  # λ
    lr: float
    steps: int
    batch_size: int
    warmup_ratio: float
    weight_decay: float
    train_embeddings: bool
    train_layers: int | None
    precision: str
    head_lr: float | None  # a fresh head's lr (residual_cross_encoder's; None: lr; other students: unused)
    dropout: bool  # the student's encoder trains with dropout (False: eval mode, as the fair study trained)
    seed: int | None  # the students' seed (None: the run's): a sweep over it retrains the students alone
    weight: float  # w of a residual student at scoring
    fusion_weight: float | None  # w of the fusion row z(base) + w·z(ℓ) (reads the gold answer); None: no row
    max_answers: int | None  # the gold answers ℓ takes the best of (None: all)
    extract_batch_size: int | str  # the ℓ forward's batch rows ("auto": from free device memory)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compare", tuple(self.compare or ()))
        problems: list[str] = []
        checks.collect(problems, checks.choice, self.teacher, "teacher", tuple(ALIGNMENT_TEACHERS))
        for name in self.compare:
            checks.collect(problems, checks.choice, name, "compare", LISTWISE, hint="(listwise teachers)")
        checks.collect(problems, checks.choice, self.student, "student", tuple(STUDENTS))
        checks.collect(problems, checks.positive_int, self.top_k, "top_k")
        checks.collect(problems, checks.number, self.teacher_tau, "teacher_tau", 0, low_open=True)
        checks.collect(problems, checks.number, self.weight, "weight", 0)
        checks.collect(problems, checks.non_negative_int, self.seed, "seed", allow_none=True)
        checks.collect(problems, checks.number, self.fusion_weight, "fusion_weight", 0, allow_none=True)
        checks.collect(problems, checks.positive_int, self.max_answers, "max_answers", allow_none=True)
        checks.collect(problems, check_batch_size, self.extract_batch_size, "extract_batch_size")
        if not problems and self.student in STUDENTS:
            try:
                self.listwise(0)  # the student's own checks (lr, steps, τ, λ, precision, ...), each under its key
            except ValueError as err:
                problems.append(str(err))
        allowed = getattr(ALIGNMENT_TEACHERS.get(self.teacher), "students", None)
        if allowed is not None and self.student not in allowed:
            problems.append(
                f"student must be one of {', '.join(allowed)} with teacher={self.teacher} ("
                f"{ALIGNMENT_TEACHERS[self.teacher].description}); a listwise student learns from one of "
                f"{', '.join(LISTWISE)}; got {self.student!r}"
            )
        checks.refuse(problems)

    def listwise(self, seed: int) -> ListwiseSettings:
        """The student's training settings (`seed`: the run's, unless `alignment.seed` sets one)."""
        fields = {f.name for f in dataclasses.fields(ListwiseSettings)} - {"seed", "head_lr"}
        seed = seed if self.seed is None else self.seed
        # head_lr is for a student with a fresh head; the others train every weight at lr (a node such as
        # alignment=likelihood sets it for its residual cross-encoder and may be given another student)
        head_lr = self.head_lr if self.student in STUDENTS and STUDENTS[self.student].fresh_head else None
        return ListwiseSettings(**{k: getattr(self, k) for k in fields}, seed=seed, head_lr=head_lr)

    @property
    def teachers(self) -> tuple[str, ...]:
        """The listwise teachers trained, each a row: `teacher` (unless it is the paper's `inc`), then `compare`."""
        first = (self.teacher,) if ALIGNMENT_TEACHERS[self.teacher].listwise else ()
        return tuple(dict.fromkeys([*first, *self.compare]))

    @property
    def reads(self) -> frozenset[str]:
        reads = frozenset().union(*(ALIGNMENT_TEACHERS[t].reads for t in self.teachers))
        return reads | ({LIKELIHOOD} if self.fusion_weight is not None else frozenset())

    @property
    def rows(self) -> list[str]:
        """The Table 1 rows this node adds (the fusion row aside: a diagnostic)."""
        return [aligned(t) for t in self.teachers]

    @property
    def active(self) -> bool:
        return bool(self.teachers) or self.fusion_weight is not None

    @property
    def reads_vectors(self) -> bool:
        return bool(self.teachers) and STUDENTS[self.student].reads_vectors


@dataclass
class ListwiseMaterial:
    """What every listwise row of a run reads, for every preference question: the base's scores of its candidates
    (and, for a student that reads them, the base's vectors), cut to the base's top k; each teacher's inputs; ℓ."""

    candidates: list[Candidates]
    data: ListwiseData
    inputs: list[TeacherInputs]
    likelihood: list[np.ndarray] | None
    key: str
    scorer: PairScorer  # the base reranker's (the exports' `base/`)
    built_on: StudentBase
    encoder: MeanPoolEncoder | None


def base_folder(base: BaseReranker) -> str:
    """Where the base reranker's files are: its export, or the backbone it is as it comes."""
    return str(base.directory) if base.directory is not None else resolve_backbone(base.module.hparams.backbone)


# wide: what the listwise teachers read comes from four nodes (alignment, llm, prompts, rag) and the stage's
# preference questions and base, in the run's context; the one caller passes the recipe's fields.
def listwise_material(
    settings: AlignmentSettings,
    llm: dict[str, Any],
    templates: PromptTemplates,
    answers: AnswerSettings,
    stage: PreferenceStage,
    base: BaseReranker,
    ctx: RunContext,
    batch_size: int,
) -> ListwiseMaterial:
    """The base's scores of every candidate of the preference questions, ℓ and the LLM's answers where the teachers
    read them (the LLM loads only then; both through their caches)."""
    candidates, scorer = stage.candidates, PairScorer.of(base.module)
    texts = [[document_text(p) for p in c.passages] for c in candidates]
    flat_q = [c.question for c, t in zip(candidates, texts) for _ in t]
    flat = scorer.score(flat_q, [p for t in texts for p in t], batch_size=batch_size)
    bounds = np.cumsum([0] + [len(t) for t in texts])
    scores = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    folder = base_folder(base)
    encoder = MeanPoolEncoder(folder) if settings.reads_vectors else None
    questions = [c.question for c in candidates]
    if encoder is not None:
        queries = encoder.encode_cached(questions, ctx.cache_dir)
        flat_v = encoder.encode_cached([p for t in texts for p in t], ctx.cache_dir)
        vectors = [flat_v[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    else:
        queries, vectors = np.zeros((len(questions), 0), np.float32), [np.zeros((len(t), 0)) for t in texts]
    data = ListwiseData.from_lists(questions, queries, vectors, passage_texts=texts, base_scores=scores)
    data = data.top_k(settings.top_k)
    ell, ell_key, labels = None, None, None
    need_answers = ANSWERS in settings.reads and stage.utility is None
    if LIKELIHOOD in settings.reads or need_answers:
        prompted = PromptedLLM(load_llm(llm), templates)
        try:
            if LIKELIHOOD in settings.reads:
                found = likelihood_stage(prompted, candidates, ctx, settings.extract_batch_size, settings.max_answers)
                ell, ell_key = found.per_question, found.key
            if need_answers:
                labels = shortlist_labels(answers.store(prompted, ctx.cache_dir, ctx.progress), candidates, data.mask)
        finally:
            del prompted
            gc.collect()
    if ANSWERS in settings.reads and labels is None:  # NQ_Rerank answered every candidate (the utility rule)
        labels = [u.astype(np.int8) for u in stage.utility]
    inputs = [
        TeacherInputs(c, None if ell is None else ell[i], None if labels is None else labels[i], scores[i])
        for i, c in enumerate(candidates)
    ]
    base_key = base.directory.name if base.directory is not None else fingerprint(dict(base.module.hparams))
    key = fingerprint(
        {
            "lists": [[c.qid, c.question, t] for c, t in zip(candidates, texts)],
            "base": base_key,
            "top_k": settings.top_k,
            "likelihood": ell_key,
            "utility": None if labels is None else fingerprint([u.tolist() for u in labels]),
            "vectors": None if encoder is None else encoder.key,
        }
    )
    return ListwiseMaterial(candidates, data, inputs, ell, key, scorer, student_base(scorer, folder), encoder)


def shortlist_labels(store, candidates: list[Candidates], mask: np.ndarray) -> list[np.ndarray]:
    """The `utility` teacher's labels over the base's top k (`mask`): 1 where the LLM's greedy answer with the
    candidate alone holds a gold answer, 0 where not, -1 below the top k (never answered)."""
    items = [(c.question, [c.passages[j]]) for i, c in enumerate(candidates) for j in np.flatnonzero(mask[i])]
    answered = iter(store.answer(items))
    labels = []
    for i, c in enumerate(candidates):
        row = np.full(len(c.passages), -1, dtype=np.int8)
        for j in np.flatnonzero(mask[i][: len(c.passages)]):
            row[j] = int(has_answer(next(answered), c.answers))
        labels.append(row)
    return labels


@dataclass(frozen=True)
class ListwiseRun:
    """Where a fold's students train and how: the run's context, its folder suffix, the accelerator, a smoke run."""

    ctx: RunContext
    suffix: str
    accelerator: str
    fast_dev_run: bool


def listwise_rerankers(
    settings: AlignmentSettings, material: ListwiseMaterial, train_qids: set[str], run: ListwiseRun
) -> tuple[dict[str, AlignedReranker], dict[str, Any]]:
    """Each listwise teacher's student trained on the questions `train_qids` (read from the cache when the same
    settings, teacher, material and questions trained one before), as a Table 1 row `aligned.<teacher>`."""
    rows = [i for i, c in enumerate(material.candidates) if c.qid in train_qids]
    listwise = settings.listwise(run.ctx.seed)
    if run.fast_dev_run:
        listwise = dataclasses.replace(listwise, steps=1)
    rerankers, training = {}, {}
    for teacher in settings.teachers:
        targets, missing = teacher_targets(teacher, [material.inputs[i] for i in rows], settings.teacher_tau)
        spec = {
            "listwise": listwise.identity(),
            "teacher": teacher,
            "teacher_tau": settings.teacher_tau,
            "material": material.key,
            "questions": sorted(material.candidates[i].qid for i in rows),
        }
        directory = Path(run.ctx.cache_dir) / "rerankers" / fingerprint(spec)
        student, info = ensure_student(listwise, material, rows, targets, directory, run, aligned(teacher))
        student.weight_at_scoring = settings.weight
        name = aligned(teacher)
        meta = {"teacher": teacher, "student": settings.student, "teacher_tau": settings.teacher_tau}
        rerankers[name] = AlignedReranker(student, material.scorer, settings.top_k, material.encoder, meta)
        training[name] = {**info, "teacher": teacher, "student": settings.student, "no_target": missing}
    return rerankers, training


# wide: one student's training, its cache folder and the run: the parts `listwise_rerankers` computed for it.
def ensure_student(
    settings: ListwiseSettings,
    material: ListwiseMaterial,
    rows: list[int],
    targets: list,
    directory: Path,
    run: ListwiseRun,
    row: str,
):
    """The student of the row `row` from `directory` when it is there and whole, else trained now and saved there."""
    card = directory / TRAINING_CARD

    def train():
        start = time.perf_counter()
        student = fit_listwise(settings, material.data.subset(rows), targets, material.built_on, run.accelerator)
        info = {
            "name": f"listwise_{settings.student}{run.suffix}",
            "train_questions": len(rows),
            "steps": settings.steps,
            "temperature": student.temperature,
            "learned_temperature": settings.tau == LEARNED,
            "train_seconds": time.perf_counter() - start,
        }
        if not run.fast_dev_run:
            with swapped_in(directory) as tmp:
                student.save(tmp)
                (tmp / TRAINING_CARD).write_text(json.dumps(info, indent=2))
                write_folder_digest(tmp)
        return student, info

    if run.fast_dev_run:
        return train()

    def read():
        if (directory / CARD).is_file() and card.is_file() and not folder_problem(directory):
            log.info("%s: the %s student read from the cache (%s)", row, settings.student, directory)
            return load_student(directory, material.built_on), json.loads(card.read_text())
        return None

    directory.parent.mkdir(parents=True, exist_ok=True)
    return once(directory.parent / f".{directory.name}.lock", f"the listwise student {directory.name}", read, train)


def alignment_material(recipe: Any, stage: PreferenceStage, base: BaseReranker, ctx: RunContext):
    """What the `alignment` node's rows of the rerank recipe `recipe` read (None when the node adds no row)."""
    settings: AlignmentSettings = recipe.alignment
    if not settings.active:
        return None
    return listwise_material(
        settings, recipe.llm, recipe.templates, recipe.answers, stage, base, ctx, recipe.reranker.eval_batch_size
    )


def with_listwise(
    found: tuple[dict, dict],
    recipe: Any,
    material: ListwiseMaterial | None,
    qids: set[str],
    ctx: RunContext,
    suffix: str,
) -> tuple[dict, dict]:
    """`found` (the paper's rows trained on `qids`: rerankers and their training info) with the listwise rows of the
    rerank recipe `recipe`'s alignment node trained on the same questions."""
    settings: AlignmentSettings = recipe.alignment
    if material is None or not settings.teachers:
        return found
    accelerator = "gpu" if recipe.reranker.device == "cuda" else "cpu"  # where the run's rerankers train
    run = ListwiseRun(ctx, suffix, accelerator, recipe.reranker.fast_dev_run)
    rerankers, training = listwise_rerankers(settings, material, qids, run)
    return {**found[0], **rerankers}, {**found[1], **training}


def fusion_rows(settings: AlignmentSettings, material: ListwiseMaterial | None, base: Scorer) -> dict[str, Scorer]:
    """Table 1's diagnostic row `fusion` (z(base) + w · z(ℓ) over the preference candidates), when asked for."""
    if material is None or settings.fusion_weight is None:
        return {}
    likelihood = lookup_scorer(material.candidates, material.likelihood)
    return {FUSION: fusion_scorer(base, likelihood, settings.fusion_weight)}
