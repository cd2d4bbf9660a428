"""NQ_Confidence: the LLM's own answers, their correctness, and the hidden states of the same prompts.

For each selected question and each prompt kind

- `qa`        the QA prompt (closed book; the paper's training states),
- `rag_gold`  the RAG prompt holding the question's gold paragraph,
- `rag_other` the RAG prompt holding another question's gold paragraph,
- `rag_cand<j>` the RAG prompt holding the question's j-th retrieved candidate (`train_states` ending in
  `+candidates`): the post-retrieval states the probe is later applied to, with their hard contexts,

the stage caches the greedy answer and the last-prompt-token hidden states of the requested layers.
The label of a state is "the answer under that prompt contains a gold answer" (has_answer; exact
match is kept beside it). Questions are split train/dev/test by question, stratified on the
closed-book label in the proportions of `splits.proportions` (default: the paper's 1000/300/500); with
`splits.balance`, each split's examples are class-balanced by down-sampling the majority class, at most
`splits.sizes` per class (the paper's 1000/300/500). Without it every state is kept, and the probe
balances the classes by weighting its loss (`model.class_weight=balanced`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from confrag.data.nq import QARow, rows_fingerprint
from confrag.data.qa_metrics import exact_match, has_answer
from confrag.infra.activation_store import ActivationStore
from confrag.infra.digests import fingerprint
from confrag.infra.locks import compute_shards
from confrag.infra.sharded import ShardedArtifact, ShardedCache
from confrag.llm.context import PromptLimit, fit_rag_prompts
from confrag.llm.generation import generate_greedy
from confrag.llm.hidden_states import HiddenStateEngine, extraction_key, validate_layers
from confrag.llm.prompted import PromptedLLM
from confrag.probe.confidence_splits import (
    SPLITS,
    balanced_examples,
    stratified_question_splits,
)
from confrag.probe.data_options import AnswerOptions, ExtractionOptions, SplitOptions
from confrag.probe.prompt_kinds import (
    CANDIDATE_KIND,
    KINDS,
    PAIRS_KIND,
    Example,
    kinds_of,
    pairs_only,
    uses_candidates,
)

log = logging.getLogger(__name__)


@dataclass
class ConfidenceData:
    rows: list[QARow]
    layers: list[int]
    train_states: str
    stores: dict[str, ActivationStore]
    responses: dict[str, list[str]]
    labels: dict[str, np.ndarray]
    exact: dict[str, np.ndarray]
    split_of: list[str]
    examples: dict[str, list[Example]]
    identity: dict[str, Any] = field(default_factory=dict)
    requested_questions: int | None = None  # set when more questions were asked for than the data holds
    pair_question: np.ndarray | None = None  # `candidates`: the question row of each (question, candidate) pair

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"questions": len(self.rows)}
        if self.requested_questions is not None:
            out["questions_requested"] = self.requested_questions
        for kind, labels in self.labels.items():
            out[f"{kind}/has_answer"] = float(labels.mean()) if len(labels) else 0.0
            out[f"{kind}/exact_match"] = float(self.exact[kind].mean()) if len(labels) else 0.0
        candidate_labels = [
            labels for kind, labels in self.labels.items() if kind.startswith(CANDIDATE_KIND) or kind == PAIRS_KIND
        ]
        if candidate_labels:
            out["candidates/has_answer"] = float(np.concatenate(candidate_labels).mean())
        for split, examples in self.examples.items():
            positives = sum(e.label for e in examples)
            out[f"{split}/examples"] = len(examples)
            out[f"{split}/positives"] = positives
        return out


def resolve_layers(spec: str | int | Sequence[int], num_layers: int) -> list[int]:
    """`all` (0..L), `mid` (Layer/2), one layer, or a list; validated against the model."""
    if spec == "all":
        return list(range(num_layers + 1))
    if spec == "mid":
        return [num_layers // 2]
    if isinstance(spec, (int, np.integer)):
        spec = [int(spec)]
    if isinstance(spec, str):
        raise ValueError(f"layers={spec!r}: use 'all', 'mid', an integer or a list of integers")
    return validate_layers(list(spec), num_layers)


def partner_indices(num_rows: int, seed: int) -> np.ndarray:
    """For each question, another question whose paragraph serves as the unrelated context."""
    if num_rows < 2:
        raise ValueError("rag_other needs at least two questions")
    order = np.random.default_rng(seed).permutation(num_rows)
    partner = np.empty(num_rows, dtype=np.int64)
    partner[order] = np.roll(order, -1)  # a cycle: nobody is their own partner
    return partner


def build_prompts(
    prompted: PromptedLLM,
    rows: Sequence[QARow],
    kind: str,
    seed: int,
    candidates: Sequence[Sequence[Any]] | None = None,
) -> list[str]:
    if kind == "qa":
        return [prompted.qa_prompt(row.question) for row in rows]
    return [prompted.rag_prompt(question, list(ps)) for question, ps in rag_items(rows, kind, seed, candidates)]


def rag_items(
    rows: Sequence[QARow], kind: str, seed: int, candidates: Sequence[Sequence[Any]] | None = None
) -> list[tuple[str, list[Any]]]:
    """(question, passages) of each row's prompt of a RAG kind: its gold paragraph, another row's, or its
    retrieved candidate of one rank."""
    if kind.startswith(CANDIDATE_KIND):
        j = int(kind[len(CANDIDATE_KIND) :])
        if candidates is None or len(candidates) != len(rows) or any(len(c) <= j for c in candidates):
            raise ValueError(f"prompt kind {kind!r} needs at least {j + 1} retrieved candidates for every question")
        return [(row.question, [c[j]]) for row, c in zip(rows, candidates)]
    missing = [row.qid for row in rows if not row.contexts]
    if missing:
        raise ValueError(f"prompt kind {kind!r} needs a gold paragraph; rows without one: {missing[:5]}")
    if kind == "rag_gold":
        return [(row.question, list(row.contexts[:1])) for row in rows]
    if kind == "rag_other":
        partner = partner_indices(len(rows), seed)
        return [(row.question, list(rows[j].contexts[:1])) for row, j in zip(rows, partner)]
    raise ValueError(f"unknown prompt kind {kind!r}; known: {KINDS}")


def fitted_prompts(
    limit: PromptLimit,
    items: Sequence[tuple[str, Sequence[Any]]],
    labels: Sequence[str],
    truncate: bool,
    spec: dict[str, Any],
    config_node: str = "data",
) -> list[str]:
    """The RAG prompts of `items`, checked against `limit`, the LLM's context (refused by row, or cut with
    `<config_node>.truncate_passages`); when some were cut, `spec` records the cut prompts (the states are
    theirs). `config_node`: where the probe's data settings live in the run's config (`probe.data` in a later
    task), so that the advice works as an override."""
    prompts, cut = fit_rag_prompts(
        items,
        labels,
        limit,
        truncate,
        where=f"NQ_Confidence [{spec['kind']}]",
        option=f"{config_node}.truncate_passages",
        question_option=f"{config_node}.truncate_questions",
    )
    if cut:  # absent when nothing was cut: the keys of prompts that fit are those they always had
        spec["cut_to_fit"] = fingerprint([[i, prompts[i]] for i in cut])
    return prompts


@dataclass(frozen=True)
class ConfidenceDataSettings:
    """How NQ_Confidence is built (the probe data module's settings): which states, the splits and their balance,
    how answers are generated and states extracted (confrag.probe.data_options), and how a RAG prompt longer than
    the context is treated. `config_node`: where these settings live in the run's config (`data`, or `probe.data`
    in a later task), so that an error's advice works as an override."""

    train_states: str
    splits: SplitOptions
    extraction: ExtractionOptions
    answers: AnswerOptions
    truncate_passages: bool
    config_node: str = "data"


def build_confidence_data(
    prompted: PromptedLLM,
    rows: Sequence[QARow],
    *,
    settings: ConfidenceDataSettings,
    cache: ShardedCache,
    seed: int = 0,
    candidates: Sequence[Sequence[Any]] | None = None,
) -> ConfidenceData:
    """NQ_Confidence for `rows`, its answers and states in `cache`; `candidates[i]` (passages with .title and
    .text) are question i's retrieved contexts, needed by the `+candidates` options (one prompt kind per rank)."""
    train_states, layers = settings.train_states, settings.extraction.layers
    max_new_tokens, gen_batch_size = settings.answers.max_new_tokens, settings.answers.batch_size
    generation = settings.answers.generation
    extract_batch_size, extract_threads = settings.extraction.batch_size, settings.extraction.threads
    truncate_passages, config_node = settings.truncate_passages, settings.config_node
    cache_dir, shard_size, progress = cache.root, cache.shard_size, cache.progress
    num_candidates = min((len(c) for c in candidates), default=0) if candidates is not None else 0
    # The flat pairs option takes every question's whole list; the ranked options one kind per common rank.
    kinds = kinds_of(train_states, 0 if pairs_only(train_states) else num_candidates)
    if uses_candidates(train_states) and num_candidates == 0:
        raise ValueError(
            f"{config_node}.train_states={train_states!r} needs retrieved candidates for every question "
            f"({config_node}.candidates.top_n >= 1)"
        )
    sizes, proportions = settings.splits.checked_sizes(f"{config_node}.splits")
    rows = list(rows)
    llm = prompted.llm
    layer_list = resolve_layers(layers, llm.num_layers)
    base_spec = {"llm": llm.identity, "prompts": prompted.prompts_identity, "rows": rows_fingerprint(rows)}
    # The batch composition changes the states' last bits: a non-default batch size keys its own states.
    numerics = extraction_key(extract_batch_size, threads=extract_threads)
    # Built at the first shard to compute: with a DeferredLLM, a complete cache never loads the weights.
    engine = functools.cache(
        lambda: HiddenStateEngine(
            llm.model,
            llm.tokenizer,
            batch_size=extract_batch_size,
            progress=progress,
            compile=settings.extraction.compile,
            threads=extract_threads,
        )
    )

    # Every answer and state shard of every prompt kind goes into one pool of claimable shards: processes
    # filling the cache together (torchrun ranks, parallel jobs) never wait while some shard is free.
    jobs, artifacts = [], {}
    limit = prompted.limit(max_new_tokens)
    for kind in kinds:
        kind_spec = {**base_spec, "kind": kind, "partner_seed": seed if kind == "rag_other" else None}
        if kind.startswith(CANDIDATE_KIND):  # the contexts are part of what the states are states of
            j = int(kind[len(CANDIDATE_KIND) :])
            kind_spec["contexts"] = fingerprint([[c[j].title, c[j].text] for c in candidates])
        if kind == "qa":  # questions were fitted by the caller (fit_questions)
            prompts = build_prompts(prompted, rows, kind, seed, candidates)
        else:
            labels = [f"{row.qid} [{kind}]" for row in rows]
            items = rag_items(rows, kind, seed, candidates)
            prompts = fitted_prompts(limit, items, labels, truncate_passages, kind_spec, config_node)
        generations = ShardedArtifact(
            cache_dir, "generations", {**kind_spec, "max_new_tokens": max_new_tokens}, len(rows), shard_size, fmt="json"
        )
        activations = ShardedArtifact(
            cache_dir,
            "activations",
            {**kind_spec, "layers": layer_list, "store": "float32", **numerics},
            len(rows),
            shard_size,
            fmt="npy",
        )
        jobs.append(
            (
                generations,
                lambda a, b, p=prompts, k=kind: generate_greedy(
                    llm.model,
                    llm.tokenizer,
                    p[a:b],
                    max_new_tokens,
                    gen_batch_size,
                    desc=f"answers [{k}]",
                    progress=progress,
                    options=generation,
                ),
            )
        )
        jobs.append(
            (activations, lambda a, b, p=prompts, k=kind: engine().extract(p[a:b], layer_list, desc=f"states [{k}]"))
        )
        artifacts[kind] = (generations, activations)
    owners = {kind: np.arange(len(rows)) for kind in kinds}  # the question row of each item of a kind
    if pairs_only(train_states):
        pair_question = np.array([i for i, c in enumerate(candidates) for _ in c], dtype=np.int64)
        pair_spec = {
            **base_spec,
            "kind": PAIRS_KIND,
            "contexts": fingerprint([[int(i), p.title, p.text] for i, c in enumerate(candidates) for p in c]),
        }
        items = [(rows[i].question, [p]) for i, c in enumerate(candidates) for p in c]
        labels = [f"{rows[i].qid} [candidate {r}]" for i, c in enumerate(candidates) for r in range(len(c))]
        prompts = fitted_prompts(limit, items, labels, truncate_passages, pair_spec, config_node)
        generations = ShardedArtifact(
            cache_dir,
            "generations",
            {**pair_spec, "max_new_tokens": max_new_tokens},
            len(prompts),
            shard_size,
            fmt="json",
        )
        activations = ShardedArtifact(
            cache_dir, "activations", {**pair_spec, "layers": layer_list, "store": "float32", **numerics}, len(prompts),
            shard_size,
            fmt="npy",
        )  # fmt: skip
        jobs.append(
            (
                generations,
                lambda a, b: generate_greedy(
                    llm.model, llm.tokenizer, prompts[a:b], max_new_tokens, gen_batch_size, desc="answers [pairs]",
                    progress=progress, options=generation,
                ),
            )
        )  # fmt: skip
        jobs.append((activations, lambda a, b: engine().extract(prompts[a:b], layer_list, desc="states [pairs]")))
        artifacts[PAIRS_KIND] = (generations, activations)
        owners[PAIRS_KIND] = pair_question
        kinds = (*kinds, PAIRS_KIND)
    compute_shards(jobs, desc="NQ_Confidence answers and hidden states", progress=progress)

    stores, responses, labels, exact = {}, {}, {}, {}
    for kind, (generations, activations) in artifacts.items():
        responses[kind] = generations.records()
        golds = [rows[i].answers for i in owners[kind]]
        labels[kind] = np.array([has_answer(r, g) for r, g in zip(responses[kind], golds)], dtype=np.int64)
        exact[kind] = np.array([exact_match(r, g) for r, g in zip(responses[kind], golds)], dtype=np.int64)
        stores[kind] = ActivationStore(activations, layer_list)

    split_of = stratified_question_splits(question_labels(labels, owners, len(rows)), seed, proportions)
    examples = {}
    for split in SPLITS:
        candidates = [
            Example(kind, j, int(labels[kind][j]))
            for kind in kinds
            for j, i in enumerate(owners[kind])
            if split_of[i] == split
        ]
        balanced = settings.splits.balance
        examples[split] = balanced_examples(candidates, int(sizes[split]), seed) if balanced else candidates
    identity = {
        **base_spec,
        "layers": layer_list,
        "train_states": train_states,
        "activations": {kind: stores[kind].key for kind in kinds},
    }
    data = ConfidenceData(
        rows, layer_list, train_states, stores, responses, labels, exact, split_of, examples, identity,
        pair_question=owners.get(PAIRS_KIND),
    )  # fmt: skip
    log.info("NQ_Confidence: %s", data.summary())
    return data


def question_labels(labels: dict[str, np.ndarray], owners: dict[str, np.ndarray], num_rows: int) -> np.ndarray:
    """The per-question label the splits are stratified on: the closed-book answer's, or without QA states
    (`candidates`) whether some candidate made the LLM answer correctly."""
    if "qa" in labels:
        return labels["qa"]
    found = np.zeros(num_rows, dtype=np.int64)
    np.maximum.at(found, owners[PAIRS_KIND], labels[PAIRS_KIND])
    return found


def activation_identity(data: ConfidenceData, layer: int) -> dict[str, Any]:
    """What a probe trained on `layer` of this data must match at inference: model, prompts, layer."""
    return {
        "llm": data.identity["llm"],
        "prompts": data.identity["prompts"],
        "layer": int(layer),
        "train_states": data.train_states,
        "key": fingerprint({**data.identity, "layer": int(layer)}),
    }
