"""Greedy answers cached per rendered prompt, and their correctness.

`AnswerStore` answers (question, contexts) items: no contexts is the closed-book QA prompt, otherwise
the RAG prompt over the contexts in the given order. Every answer is stored under the hash of its
rendered prompt, so whatever asks for it (K = 1 and K = 3 runs, two rerankers that pick the same
top-1, a β sweep, a rerun) generates it once.

Layout: `<cache>/answers/<store key>/<chunk key>/`, the store key hashing the LLM identity, the
prompt templates' identity (with the chat template), `max_new_tokens` and the generator version.
Missing prompts are generated in chunks; each chunk is a one-shard `ShardedArtifact` whose spec lists
its prompt hashes, written atomically. A killed run leaves only whole chunks; the rerun finds them,
and cuts the still missing prompts into the same chunks as the uninterrupted run would have (sorted
by length, then hash), so it ends with the same answers.

Answers are batched greedy generations (`generate_greedy`, by default reusing the keys/values of
the prefix the prompts of a chunk share; `generation` picks the path, e.g. a static cache on a GPU).
Padding, batch composition and the path can move float rounding, so a prompt generated alone might in
rare near-ties decode differently. A prompt is generated once per store; should two processes filling
one cache generate it in different chunks, every reader takes the answer of the chunk whose name sorts
first, so all agree whichever order they found the chunks in. Neither the batch size nor the path
enters the key: they change how fast an answer comes, not which answer greedy decoding means.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from confrag.data.qa_metrics import exact_match, has_answer, has_answer_dpr, token_f1
from confrag.infra import checks
from confrag.infra.digests import fingerprint
from confrag.infra.locks import compute_shards
from confrag.infra.sharded import CacheMismatchError, ShardedArtifact
from confrag.llm.batching import check_batch_size
from confrag.llm.context import fit_rag_prompts
from confrag.llm.generation import GreedyOptions, generate_greedy
from confrag.llm.prompted import PromptedLLM

log = logging.getLogger(__name__)

# Bump when how answers are produced changes (decoding, post-processing), so old answers are not reused.
GENERATOR = "generate_greedy.v1"
KIND = "answers"


@dataclass(frozen=True)
class ScoredAnswer:
    """An answer and its correctness: has_answer (the main metric), exact match, token F1 and DPR's own
    has_answer (None in records written before it was scored: `eval.metric=has_answer_dpr` refuses them)."""

    answer: str
    has_answer: bool
    em: bool
    f1: float
    has_answer_dpr: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def score_answer(answer: str, gold: Sequence[str]) -> ScoredAnswer:
    return ScoredAnswer(
        answer=answer,
        has_answer=has_answer(answer, gold),
        em=exact_match(answer, gold),
        f1=round(token_f1(answer, gold), 6),
        has_answer_dpr=has_answer_dpr(answer, gold),
    )


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:32]


class AnswerStore:
    """Greedy answers of one LLM with one set of prompt templates, cached by rendered prompt.

    `generated` counts the prompts this object sent to the LLM and `reused` those found in the cache."""

    # The run builds it from the `rag` node's checked settings (`AnswerSettings.store`, where the options are
    # grouped); scripts, benchmarks and tests name by keyword the one or two options they change
    # (max_new_tokens=2), as a transformers pipeline takes its generation options.
    def __init__(
        self,
        prompted: PromptedLLM,
        cache_dir: str | Path,
        max_new_tokens: int = 32,
        batch_size: int | str = 16,
        chunk_size: int = 64,
        progress: bool = True,
        generation: GreedyOptions | None = None,
        truncate_passages: bool = False,
    ) -> None:
        self.truncate_passages = checks.flag(truncate_passages, "truncate_passages")
        for key, value in (("max_new_tokens", max_new_tokens), ("chunk_size", chunk_size)):
            checks.positive_int(value, key)
        check_batch_size(batch_size, "batch_size")
        self.generation = generation or GreedyOptions()
        self.prompted, self.llm = prompted, prompted.llm
        self.root = Path(cache_dir)
        self.max_new_tokens, self.batch_size, self.chunk_size, self.progress = (
            max_new_tokens,
            batch_size,
            chunk_size,
            progress,
        )
        self.spec = {
            "llm": prompted.llm.identity,
            "prompts": prompted.prompts_identity,
            "max_new_tokens": max_new_tokens,
            "generator": GENERATOR,
        }
        self.key = fingerprint(self.spec)
        self.kind = f"{KIND}/{self.key}"
        self.dir = self.root / self.kind
        self._known: dict[str, str] = {}
        self._source: dict[str, str] = {}  # prompt hash -> name of the chunk its answer comes from
        self._seen_chunks: set[str] = set()
        self.generated = 0
        self.reused = 0

    # --- prompts ----------------------------------------------------------------------------------
    def prompt(self, question: str, contexts: Sequence[Any] = ()) -> str:
        """The QA prompt without contexts, else the RAG prompt over `contexts` (objects with .title/.text)."""
        if not contexts:
            return self.prompted.qa_prompt(question)
        return self.prompted.rag_prompt(question, contexts)

    def answer(self, items: Sequence[tuple[str, Sequence[Any]]]) -> list[str]:
        """Answers to (question, contexts) items, in order. A RAG prompt to generate is first checked against
        the LLM's context (less max_new_tokens): refused naming the question, or, with `truncate_passages`
        (`rag.truncate_passages`), its passages cut to fit (the cut prompt is the one answered and cached)."""
        prompts = [self.prompt(question, contexts) for question, contexts in items]
        self._refresh()
        # Only prompts to generate are measured: a cached answer was generated from a prompt that fitted.
        todo = [
            i
            for i, (p, (_, contexts)) in enumerate(zip(prompts, items))
            if contexts and prompt_hash(p) not in self._known
        ]
        if todo:
            fitted, _ = fit_rag_prompts(
                [items[i] for i in todo],
                [f"question {items[i][0][:80]!r} with {len(items[i][1])} passage(s)" for i in todo],
                self.prompted.limit(self.max_new_tokens),
                self.truncate_passages,
                where="RAG answers",
                option="rag.truncate_passages",
            )
            for i, prompt in zip(todo, fitted):
                prompts[i] = prompt
        return self.answer_prompts(prompts)

    # --- cache ------------------------------------------------------------------------------------
    def _chunk(self, spec: dict[str, Any], size: int) -> ShardedArtifact:
        return ShardedArtifact(self.root, self.kind, spec, size, shard_size=size, fmt="json")

    def _refresh(self) -> None:
        """Read the chunks written since the last look (by this process or another one)."""
        if not self.dir.is_dir():
            return
        for manifest_path in sorted(self.dir.glob("*/manifest.json")):
            name = manifest_path.parent.name
            if name in self._seen_chunks:
                continue
            chunk = self._open_chunk(manifest_path)
            if chunk is None or not chunk.complete:  # incomplete: a run killed while generating it
                continue
            self._learn(name, chunk.spec["prompt_hashes"], chunk.records())

    def _learn(self, chunk_name: str, hashes: Sequence[str], answers: Sequence[str]) -> None:
        for h, answer in zip(hashes, answers):
            if h not in self._source or chunk_name < self._source[h]:
                self._known[h], self._source[h] = answer, chunk_name
        self._seen_chunks.add(chunk_name)

    def _open_chunk(self, manifest_path: Path) -> ShardedArtifact | None:
        try:
            manifest = json.loads(manifest_path.read_text())
            spec = manifest["spec"]
            hashes = spec["prompt_hashes"]
            base = json.loads(json.dumps({k: v for k, v in spec.items() if k != "prompt_hashes"}))
            if (
                manifest["key"] != manifest_path.parent.name
                or base != json.loads(json.dumps(self.spec))
                or manifest["num_items"] != len(hashes)
            ):
                raise ValueError("manifest does not match its directory or this store")
            chunk = self._chunk({**self.spec, "prompt_hashes": list(hashes)}, len(hashes))
            if chunk.dir != manifest_path.parent:
                raise ValueError("manifest key does not match its content")
            return chunk
        except (OSError, ValueError, KeyError, TypeError, CacheMismatchError) as err:
            log.warning(
                "Ignoring answer chunk %s (%s); its prompts are regenerated when asked for.", manifest_path.parent, err
            )
            return None

    def answer_prompts(self, prompts: Sequence[str]) -> list[str]:
        """Answers to rendered prompts, in order; only prompts never answered before are generated."""
        hashes = [prompt_hash(p) for p in prompts]
        self._refresh()
        missing = {h: p for h, p in zip(hashes, prompts) if h not in self._known}
        self.reused += sum(h in self._known for h in hashes)
        if missing:
            self._generate(missing)
        return [self._known[h] for h in hashes]

    def _generate(self, missing: dict[str, str]) -> None:
        # A canonical order makes the chunks of a resumed run the chunks of an uninterrupted one, and the
        # chunks of processes asking for the same prompts at once the same chunks: they claim them in
        # turn (compute_shards), so each chunk is generated once.
        order = sorted(missing, key=lambda h: (len(missing[h]), h))
        groups = [order[i : i + self.chunk_size] for i in range(0, len(order), self.chunk_size)]
        log.info("answers %s: %d prompts to generate in %d chunk(s)", self.key, len(order), len(groups))
        jobs = []
        for number, chunk_hashes in enumerate(groups, start=1):
            chunk_prompts = [missing[h] for h in chunk_hashes]
            chunk = self._chunk({**self.spec, "prompt_hashes": chunk_hashes}, len(chunk_hashes))
            jobs.append(
                (
                    chunk,
                    lambda start, stop, p=chunk_prompts, n=number: generate_greedy(
                        self.llm.model,
                        self.llm.tokenizer,
                        p[start:stop],
                        self.max_new_tokens,
                        self.batch_size,
                        desc=f"answers {n}/{len(groups)}",
                        progress=self.progress,
                        options=self.generation,
                    ),
                )
            )
        compute_shards(jobs, desc=f"answers {self.key}", progress=False)
        for (chunk, _), chunk_hashes in zip(jobs, groups):
            self._learn(chunk.dir.name, chunk_hashes, chunk.records())
            self.generated += len(chunk_hashes) if chunk.computed else 0
