"""Timing the gate comparison's parts: each part a gate's signals cost (`registry.Part`, named by the
signal registry) and the answer paths (closed-book answer, RAG answer, retrieval with reranking), run
fresh (no cache) on a few test questions with the run's batch sizes, in seconds per question. The wall
time of a gate is then a cost model over them (`confrag.gates.evaluation.wall_time_per_question`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from confrag.data.nq import QARow
from confrag.gates.registry import PARTS
from confrag.gates.signal_maker import SignalMaker
from confrag.llm.generation import generate_greedy
from confrag.rag.settings import AnswerSettings
from confrag.retrieval import Candidates
from confrag.stages.gate_questions import reranked
from confrag.stages.rerank import Scorer
from confrag.stages.retrieval import Retrieval, question_candidates


@dataclass
class TimingRun:
    """What a part's `measure` reads: the cached and the fresh (uncached) signal makers, the timing
    questions, their QA prompts, the closed-book answers (`closed_book` fills them: it runs first), the
    clean top-K contexts and the hidden-state layers; and the answer paths every comparison times."""

    maker: SignalMaker
    retrieval: Retrieval
    scorer: Scorer
    rows: Sequence[QARow]
    clean: Sequence[Candidates]
    layers: Sequence[int]
    k: int
    answers: AnswerSettings
    fresh: SignalMaker = field(init=False)
    questions: list[str] = field(init=False)
    qa_prompts: list[str] = field(init=False)
    contexts: list[list[Any]] = field(init=False)
    responses: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.fresh = self.maker.without_cache()
        self.questions = [r.question for r in self.rows]
        self.qa_prompts = self.fresh.qa_prompts(self.questions)
        self.contexts = [c.passages[: self.k] for c in self.clean]
        self._rag_prompts = [
            self.maker.prompted.rag_prompt(c.question, context) for c, context in zip(self.clean, self.contexts)
        ]
        self._generate = dict(
            max_new_tokens=self.answers.max_new_tokens, batch_size=self.answers.batch_size, progress=False
        )

    def _greedy(self, prompts: Sequence[str], **options: Any) -> list[str]:
        return generate_greedy(self.maker.llm.model, self.maker.llm.tokenizer, prompts, **options)

    def warm_up(self) -> None:
        self._greedy(self.qa_prompts[:1], max_new_tokens=1, progress=False)  # untimed

    def closed_book(self) -> None:
        self.responses.extend(self._greedy(self.qa_prompts, **self._generate))

    def rag_answer(self) -> None:
        self._greedy(self._rag_prompts, **self._generate)

    def retrieve(self) -> None:
        candidates = question_candidates(self.retrieval, self.rows, self.retrieval.settings.candidates_path)[0]
        reranked(candidates, self.scorer)


def measure_parts(run: TimingRun, parts: set[str]) -> dict[str, float]:
    """Seconds per question of each part, computed fresh (no cache) on `run.rows` with the run's batch sizes."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"no timed part named {unknown}; parts: {', '.join(sorted(PARTS))}")
    run.warm_up()
    timings = {}
    # closed_book first: the response parts read its answers.
    for part in ["closed_book", *sorted(parts - {"closed_book"})]:
        start = time.perf_counter()
        PARTS[part].measure(run)
        timings[part] = (time.perf_counter() - start) / len(run.rows)
    # A part that runs another one again on its way (BRIDGE's matching writes its internal passages) is
    # charged only its own share.
    for part in timings:
        repeated = sum(timings.get(other, 0.0) for other in PARTS[part].repeats)
        if PARTS[part].repeats:
            timings[part] = max(timings[part] - repeated, 0.0)
    return timings
