"""The fair-student study's trained students, kept on disk so that the study resumes where it stopped.

A study trains some forty students (an hour of cross-encoders on a CPU for every four), longer than a working
session: each student's scores over the whole study are written once it is trained, keyed by what produced them
(its settings, its teacher and τ_T, its training questions, and the study's inputs: the questions, ℓ and the
base's scores), with the student itself, and read back, checked against their digest, when the study runs again.
The dev grid's fold-0 student of the chosen setting is the cross-fit's fold-0, seed-0 student: trained once.

A residual student scores f = base + w·(f₁ − base), where f₁ is its score at w = 1 (`ListwiseStudent` scales its
correction by w and nothing else), so one forward at w = 1 serves every w of the dev grid.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from confrag.infra.atomic import npy_bytes, written_once
from confrag.infra.digests import bytes_digest, fingerprint, folder_problem, write_folder_digest
from confrag.infra.finite import require_finite
from confrag.infra.locks import once
from confrag.reranker.aligned import load_student
from confrag.reranker.listwise_data import ListwiseData
from confrag.reranker.listwise_student import ListwiseSettings, ListwiseStudent

log = logging.getLogger(__name__)

SCORES = "scores.npy"
CARD = "trained.json"
STUDENT = "student"
RESIDUAL = ("residual_cross_encoder", "residual_head")  # the kinds that scale a correction by w at scoring


@dataclass(frozen=True)
class Trained:
    """One trained student's scores at w = 1 over every question of the study (-inf outside its mask)."""

    student: str  # its kind
    scores: np.ndarray
    base: np.ndarray
    folder: Path

    def at(self, rows: list[int], weight: float = 1.0) -> np.ndarray:
        """Its scores on `rows` at w = `weight` (a kind that is not residual ignores w, as it does when scoring)."""
        f1, base = self.scores[rows], self.base[rows]
        if self.student not in RESIDUAL or weight == 1.0:
            return f1
        finite = np.isfinite(f1)
        f1, base = np.where(finite, f1, 0.0), np.where(finite, base, 0.0)  # -inf - -inf would warn, then be masked
        return np.where(finite, base + weight * (f1 - base), -np.inf).astype(np.float32)

    def load(self) -> ListwiseStudent:
        """The student itself, checked against its digest (to score questions outside the study)."""
        return load_student(self.folder / STUDENT)


@dataclass(frozen=True)
class StudentStore:
    """Trained students of one study under `directory`, keyed by `identity` (the study's inputs) and their training."""

    directory: Path
    identity: str
    data: ListwiseData

    @classmethod
    def of(cls, directory: str | Path, data: ListwiseData, ell: list[np.ndarray], qids: list[str]) -> StudentStore:
        base = data.base_scores
        identity = fingerprint({
            "qids": qids, "ell": [bytes_digest(np.asarray(e, dtype=np.float32).tobytes()) for e in ell],
            "base": bytes_digest(np.where(data.mask, base, 0.0).astype(np.float32).tobytes()),
            "mask": bytes_digest(data.mask.tobytes()), "questions": data.questions,
        })  # fmt: skip
        return cls(Path(directory), identity, data)

    def key(self, settings: ListwiseSettings, teacher: str, teacher_tau: float, rows: list[int]) -> str:
        return fingerprint({"study": self.identity, "settings": settings.identity(), "teacher": teacher,
                            "teacher_tau": teacher_tau, "rows": list(rows)})  # fmt: skip

    def get(
        self,
        settings: ListwiseSettings,
        teacher: str,
        teacher_tau: float,
        rows: list[int],
        fit: Callable[[], ListwiseStudent],
    ) -> Trained:
        """The student of these settings read back, or `fit()` now and written with its scores."""
        key = self.key(settings, teacher, teacher_tau, rows)
        folder = self.directory / key

        def read() -> Trained | None:
            if not (folder / CARD).is_file() or folder_problem(folder, [CARD, SCORES]):
                return None
            scores = np.load(folder / SCORES, allow_pickle=False)
            log.info("student %s (%s, %d questions): read back from %s", settings.student, teacher, len(rows), key)
            return Trained(settings.student, scores, self.data.base_scores, folder)

        def build() -> Trained:
            student = fit()
            student.weight_at_scoring = 1.0
            scores = student.score(self.data)
            require_finite(np.where(self.data.mask, scores, 0.0), stage="fair student", artifact=f"scores of {key}")
            if folder.is_dir():  # a damaged earlier result: replaced whole
                shutil.rmtree(folder)
            with written_once(folder) as tmp:
                (tmp / SCORES).write_bytes(npy_bytes(scores))
                card = {"settings": asdict(settings), "teacher": teacher, "teacher_tau": teacher_tau,
                        "training_questions": len(rows), "study": self.identity}  # fmt: skip
                (tmp / CARD).write_text(json.dumps(card, indent=1))
                student.export(tmp / STUDENT)
                write_folder_digest(tmp, [CARD, SCORES])
            return Trained(settings.student, scores, self.data.base_scores, folder)

        self.directory.mkdir(parents=True, exist_ok=True)
        return once(self.directory / f".{key}.lock", f"the fair-study student {key}", read, build)
