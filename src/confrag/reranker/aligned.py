"""A listwise student as a reranker of any candidate list: the rows `aligned.<teacher>` of Tables 1-2, and their
exports.

The student learned to reorder the base's top k (`ListwiseData.top_k`): scoring a question's passages, it reorders
the base's top k of them by its own score f and leaves the rest after them in the base's order; the score returned
is that order (n for the first of n passages, down to 1), so Top-K, P@K and MRR read the shortlist reranker it is. f
is the student's kind's (`confrag.reranker.listwise_student.STUDENTS`): the base reranker fine-tuned whole
(`cross_encoder`), or base + w · SCALE · g(q, p) (`residual_cross_encoder`, g a cross-encoder with a head that was
zero at the start; `residual_head`, g linear on q ⊙ p), or the fine-tuned query tower's SCALE · cos(q', p).

`export(folder)` writes the student (for `cross_encoder`, the fine-tuned reranker's own `save_pretrained` folder,
which sentence-transformers' `CrossEncoder` loads when the base is a cross-encoder), the base reranker under
`base/` (`PairScorer`), `aligned.json` (teacher, student, k, w) and a README saying how it scores; `load_aligned`
reads it back as this class, through confrag.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from confrag.infra.atomic import swapped_in
from confrag.infra.digests import require_whole_folder, write_folder_digest
from confrag.reranker.bi_encoder import SCALE
from confrag.reranker.kinds import reranker_kind
from confrag.reranker.listwise_data import ListwiseData
from confrag.reranker.listwise_student import CARD, STUDENTS, ListwiseSettings, ListwiseStudent, StudentBase
from confrag.reranker.pair_scorer import PairScorer
from confrag.retrieval.dense import MeanPoolEncoder

ALIGNED, BASE_FOLDER = "aligned.json", "base"


def shortlist_order(f: np.ndarray, base: np.ndarray, top_k: int) -> np.ndarray:
    """Scores giving the order: the base's top `top_k` (ties by position) by f, then the rest by the base; n for the
    first of n passages down to 1."""
    base = np.asarray(base, dtype=np.float64)
    by_base = np.argsort(-base, kind="stable")
    top, rest = by_base[:top_k], by_base[top_k:]
    order = np.concatenate([top[np.argsort(-np.asarray(f, dtype=np.float64)[top], kind="stable")], rest])
    scores = np.empty(len(base), dtype=np.float32)
    scores[order] = np.arange(len(base), 0, -1, dtype=np.float32)
    return scores


@dataclass
class AlignedReranker:
    """A trained student behind the `score(queries, passages)` of a Table 1 / Table 2 row."""

    student: ListwiseStudent
    base: PairScorer  # the base reranker: its scores choose the top k, and a residual student adds to them
    top_k: int
    encoder: MeanPoolEncoder | None  # the base bi-encoder, for a student that reads its vectors
    meta: dict[str, Any] = field(default_factory=dict)  # teacher, student, settings: the export's card

    def scorer_for(self, query: str) -> AlignedReranker:
        return self

    def to(self, device: str) -> AlignedReranker:
        self.student.to(device)
        return self

    def listwise(self, questions: list[str], passages: list[list[str]], base: list[np.ndarray]) -> ListwiseData:
        """The questions' lists as the student reads them, cut to the base's top k."""
        if self.encoder is not None:
            queries = self.encoder.encode(questions)
            vectors = [self.encoder.encode(p) for p in passages]
        else:  # a student that reads no vectors: width 0
            queries, vectors = np.zeros((len(questions), 0), np.float32), [np.zeros((len(p), 0)) for p in passages]
        data = ListwiseData.from_lists(questions, queries, vectors, passage_texts=passages, base_scores=base)
        return data.top_k(self.top_k)

    def score(self, queries: Sequence[str], passages: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """The order this reranker puts each query's passages in, as scores: the pairs are grouped by query text
        and each group's passages get n (first) down to 1 (last), the base's top k reordered by the student.
        Sorting by them is the reranking; they are positions, not f: `student_scores` gives f."""
        groups, base, f = self._scored(queries, passages, batch_size)
        out = np.zeros(len(queries), dtype=np.float32)
        for row, at in enumerate(groups.values()):
            out[at] = shortlist_order(f[row, : len(at)], base[at], self.top_k)
        return out

    def student_scores(self, queries: Sequence[str], passages: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """The student's own score f of each pair in its query's base top k (grouped by query text, as `score`);
        NaN for the passages below the base's top k, which the student never scores."""
        groups, _, f = self._scored(queries, passages, batch_size)
        out = np.full(len(queries), np.nan, dtype=np.float32)
        for row, at in enumerate(groups.values()):
            own = f[row, : len(at)]  # -inf outside the top k `ListwiseData.top_k` kept: the student never scored it
            out[at] = np.where(np.isfinite(own), own, np.nan)
        return out

    def _scored(self, queries: Sequence[str], passages: Sequence[str], batch_size: int):
        """The pairs' positions by query text, the base's scores and the student's f (one row a query)."""
        if len(queries) != len(passages):
            raise ValueError(f"{len(queries)} queries for {len(passages)} passages")
        groups: dict[str, list[int]] = {}
        for i, query in enumerate(queries):
            groups.setdefault(query, []).append(i)
        base = self.base.score(list(queries), list(passages), batch_size=batch_size)
        lists = [[passages[i] for i in at] for at in groups.values()]
        data = self.listwise(list(groups), lists, [base[at] for at in groups.values()])
        return groups, base, self.student.score(data)

    def export(self, directory: str | Path) -> Path:
        """The folder `load_aligned` reads (see the module's docstring), built beside and swapped in."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        with swapped_in(directory) as tmp:
            self.student.save(tmp)
            self.base.export(tmp / BASE_FOLDER)
            meta = {**self.meta, "top_k": self.top_k, "weight": self.student.weight_at_scoring, "scale": SCALE}
            (tmp / ALIGNED).write_text(json.dumps(meta, indent=2, default=str))
            (tmp / "README.md").write_text(card(self.student.settings, meta))
            write_folder_digest(tmp)
        return directory


def card(settings: ListwiseSettings, meta: dict[str, Any]) -> str:
    """How an exported aligned reranker scores, and how to load it."""
    kind = STUDENTS[settings.student]
    lines = [
        f"# Aligned reranker: {settings.student} student of the {meta.get('teacher', '?')} teacher",
        "",
        f"{(kind.__doc__ or '').strip()}",
        "",
        f"It reorders the base reranker's top {meta['top_k']} of a question's passages by its score f and keeps the "
        f"rest after them in the base's order; the base reranker is in `{BASE_FOLDER}/`."
        + (f" f = base + w · {SCALE:g} · g(q, p) with w = {meta['weight']:g}." if kind.residual else ""),
        "",
        "```python",
        "from confrag.reranker.aligned import load_aligned",
        "",
        'reranker = load_aligned("<this folder>")',
        'queries, passages = ["who wrote hamlet"] * 2, ["Hamlet is a tragedy by Shakespeare.", "Rome."]',
        "order = reranker.score(queries, passages)           # positions: n (first) .. 1 per query; sort by them",
        "f = reranker.student_scores(queries, passages)      # the student's f over the base's top k (NaN below)",
        "```",
    ]
    if kind.exports_reranker:
        lines += [
            "",
            "The folder itself is the fine-tuned reranker, loadable as its base is (a cross-encoder: "
            '`sentence_transformers.CrossEncoder("<this folder>")`), scoring every passage without the shortlist.',
        ]
    return "\n".join(lines) + "\n"


def student_base(base: PairScorer, folder: str | Path | None) -> StudentBase:
    """What a student is built on from the base reranker `base` (its files in `folder`; None: the embedded MiniLM):
    a bi-encoder base's encoder for the students that copy an encoder, else the embedded MiniLM's."""
    encoder_dir = Path(folder) if folder is not None and reranker_kind(base.kind).embeds_apart else None
    return StudentBase(encoder_dir=encoder_dir, reranker=base)


def load_student(directory: str | Path, base: StudentBase | None = None) -> ListwiseStudent:
    """An exported student (`ListwiseStudent.export`), checked against its digest, in eval mode."""
    directory = Path(directory)
    require_whole_folder(directory, "exported listwise student")
    settings = ListwiseSettings(**json.loads((directory / CARD).read_text())["settings"])
    return STUDENTS[settings.student].read(directory, base or StudentBase())


def load_aligned(directory: str | Path) -> AlignedReranker:
    """An exported aligned reranker (`AlignedReranker.export`), checked against its digest."""
    directory = Path(directory)
    require_whole_folder(directory, "aligned reranker export")
    meta = json.loads((directory / ALIGNED).read_text())
    base = PairScorer.load(directory / BASE_FOLDER)
    built_on = student_base(base, directory / BASE_FOLDER)
    student = load_student(directory, built_on)
    encoder = MeanPoolEncoder(built_on.encoder_dir, device="cpu") if student.reads_vectors else None
    return AlignedReranker(student, base, int(meta["top_k"]), encoder, meta)
