"""NQ_Rerank: preference rows from the confidence shift each retrieved context causes.

For a question Q with candidate contexts C1..Cn,

    Inc(Q, Ci) = Conf(H(Q + Ci)) − Conf(H(reference)),

where H(Q + Ci) is the hidden state of the RAG prompt holding Ci alone, and the reference is either
the QA prompt (`qa`, the paper's Eq. 3) or the RAG prompt with an empty context (`rag_empty`, closest to the paper's
appendix, which builds NQ_Rerank with the RAG prompt). A label rule (`preferences.selection`, each described in
its entry of `confrag.reranker.label_rules.RULES`) turns a question's candidates into `pos` and `neg`.

Every hidden state goes through the engine and the activation cache, and the candidate states are one
sharded, resumable artifact. `pos_scores` / `neg_scores` always hold Inc (the probe's teacher scores).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from confrag.infra.activation_store import ActivationStore
from confrag.infra.atomic import atomic_write_text, swapped_in
from confrag.infra.digests import fingerprint, write_folder_digest
from confrag.infra.finite import require_finite
from confrag.infra.sharded import ShardedCache
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.prompted import PromptedLLM
from confrag.probe.module import SavedProbe
from confrag.probe.ranking import candidate_states, state_artifact
from confrag.reranker.label_rules import RULES, SELECTIONS, check_selection, select
from confrag.retrieval.candidates import Candidates, subset_positions
from confrag.retrieval.corpus import document_text

log = logging.getLogger(__name__)

REFERENCES = ("qa", "rag_empty")
RERANK_INSTRUCTION = "Given a question, retrieve Wikipedia passages that answer the question."


@dataclass
class ConfidenceShifts:
    reference: dict[str, np.ndarray]  # reference kind -> Conf per question
    candidates: list[np.ndarray]  # per question: Conf(Q + Ci) for each candidate


def confidence_shifts(
    prompted: PromptedLLM,
    probe: SavedProbe,
    candidate_sets: Sequence[Candidates],
    *,
    engine: HiddenStateEngine,
    cache: ShardedCache,
    qa_states: np.ndarray | None = None,
    within: Sequence[Candidates] | None = None,
) -> ConfidenceShifts:
    """Conf of every reference prompt and every (question, candidate) RAG prompt, through `cache`.

    `qa_states` are these questions' QA-prompt states at the probe's layer, read from the probe
    stage's activation cache; when given they are used instead of being extracted again. `within`: candidate
    sets whose states an earlier stage cached (NQ_Rerank's); when every set of `candidate_sets` is one of them
    (same question, same passages in the same order), their states are read from that artifact instead of
    being extracted again under another question set's key."""
    picked = subset_positions(candidate_sets, within) if within is not None and qa_states is None else None
    if picked is not None:
        whole = confidence_shifts(prompted, probe, within, engine=engine, cache=cache)
        return ConfidenceShifts(
            {kind: values[picked] for kind, values in whole.reference.items()}, [whole.candidates[i] for i in picked]
        )
    layer = probe.layer
    probe.check(prompted.llm.identity, prompted.prompts_identity, layer)
    questions = [c.question for c in candidate_sets]
    rows_key = fingerprint([[c.qid, c.question] for c in candidate_sets])

    reference = {}
    if qa_states is not None:
        if len(qa_states) != len(questions):
            raise ValueError(f"qa_states holds {len(qa_states)} states for {len(questions)} questions")
        reference["qa"] = probe.confidence(qa_states)
    prompts = {
        "qa": [prompted.qa_prompt(q) for q in questions],
        "rag_empty": [prompted.rag_prompt(q, []) for q in questions],
    }
    for kind in REFERENCES:
        if kind in reference:
            continue
        artifact = state_artifact(cache, prompted, kind, rows_key, layer, len(questions))
        artifact.compute(
            lambda a, b, p=prompts[kind], k=kind: engine.extract(p[a:b], [layer], desc=f"states [{k}]"),
            desc=f"{kind} states",
            progress=cache.progress,
        )
        reference[kind] = probe.confidence(ActivationStore(artifact, [layer]).take(layer, range(len(questions))))

    states, bounds = candidate_states(prompted, candidate_sets, layer, engine=engine, cache=cache)
    conf = probe.confidence(states) if len(states) else np.zeros(0)
    # Inc is a difference of these: named by question here, so that no NaN reaches a preference row.
    for kind, values in reference.items():
        require_finite(
            values, stage="Inc", artifact=f"Conf of the {kind} prompts", rows=[c.qid for c in candidate_sets]
        )
    require_finite(
        conf, stage="Inc", artifact="Conf of the RAG prompts", rows=[c.qid for c in candidate_sets for _ in c.passages]
    )
    return ConfidenceShifts(reference, [conf[a:b] for a, b in zip(bounds[:-1], bounds[1:])])


def labelled(
    candidate_sets: Sequence[Candidates],
    shifts: ConfidenceShifts,
    reference: str,
    top_k: int,
    selection: str,
    utility: Sequence[np.ndarray] | None,
) -> Iterator[tuple[Candidates, np.ndarray, list[int], list[int]]]:
    """Per question: its candidates, the Inc of each against `reference`, and the rule's (pos, neg) indices;
    the one loop the rows and the gold-placement diagnostic both read, so they cannot label differently."""
    if reference not in REFERENCES:
        raise ValueError(f"reference={reference!r} is not one of {REFERENCES}")
    check_selection(selection, utility)
    for i, cs in enumerate(candidate_sets):
        inc = shifts.candidates[i] - shifts.reference[reference][i]
        pos, neg = select(selection, inc, shifts.candidates[i], None if utility is None else utility[i], top_k)
        yield cs, inc, pos, neg


# The rule whose labels the reference decides (it thresholds Inc: `LabelRule.uses_reference`, the paper's sign
# rule): the report's comparison of the references labels with it, whichever rule trains.
REFERENCE_RULE = next(rule.id for rule in RULES.values() if rule.uses_reference)


def build_rows(
    candidate_sets: Sequence[Candidates],
    shifts: ConfidenceShifts,
    reference: str,
    top_k: int,
    selection: str,
    utility: Sequence[np.ndarray] | None = None,
) -> tuple[list[dict], dict[str, int]]:
    """Preference rows in FlagEmbedding's format (plus `qid`), and the drop counts. `utility[i]` holds, per
    candidate of question i, whether the LLM's answer under it was correct (needed by `utility` only)."""
    rows, drops = [], {"no_positive": 0, "no_negative": 0, "neither": 0}
    for cs, inc, pos, neg in labelled(candidate_sets, shifts, reference, top_k, selection, utility):
        if not pos or not neg:
            drops["neither" if not pos and not neg else "no_positive" if not pos else "no_negative"] += 1
            continue
        rows.append(
            {
                "qid": cs.qid,
                "query": cs.question,
                "pos": [document_text(cs.passages[j]) for j in pos],
                "neg": [document_text(cs.passages[j]) for j in neg],
                "pos_scores": [float(inc[j]) for j in pos],
                "neg_scores": [float(inc[j]) for j in neg],
                "prompt": RERANK_INSTRUCTION,
            }
        )
    return rows, drops


def gold_placement(
    candidate_sets: Sequence[Candidates],
    shifts: ConfidenceShifts,
    reference: str,
    top_k: int,
    selection: str,
    utility: Sequence[np.ndarray] | None = None,
) -> dict[str, float]:
    """Of the questions trained on (a row kept: a positive and a negative) whose gold paragraph was retrieved: how
    often a gold passage lands in pos / neg. Questions whose row is dropped are counted apart
    (`dropped_with_gold`): they teach nothing, and counting them made a rule that drops most questions (utility)
    look as if its rows held the gold passage among the negatives."""
    counts = {"questions_with_gold": 0, "gold_in_pos": 0, "gold_in_neg": 0, "gold_in_neither": 0}
    counts["dropped_with_gold"] = 0
    for cs, _, pos, neg in labelled(candidate_sets, shifts, reference, top_k, selection, utility):
        gold = {j for j, flag in enumerate(cs.from_gold) if flag}
        if not gold:
            continue
        if not pos or not neg:  # build_rows drops it
            counts["dropped_with_gold"] += 1
            continue
        counts["questions_with_gold"] += 1
        key = "gold_in_pos" if gold & set(pos) else "gold_in_neg" if gold & set(neg) else "gold_in_neither"
        counts[key] += 1
    total = max(counts["questions_with_gold"], 1)
    return {**counts, **{f"{k}_rate": counts[k] / total for k in ("gold_in_pos", "gold_in_neg", "gold_in_neither")}}


def dataset_report(
    candidate_sets: Sequence[Candidates],
    shifts: ConfidenceShifts,
    top_k: int,
    splits: dict[str, list[dict]],
    reference: str,
    drops: dict[str, int],
    selection: str,
    utility: Sequence[np.ndarray] | None = None,
) -> dict[str, Any]:
    """Sizes, drops, the Inc distribution and gold placement for every reference choice and every rule whose
    data is there (`utility` needs the answers), and examples."""
    report: dict[str, Any] = {
        "reference": reference,
        "selection": selection,
        "top_k": top_k,
        "questions": len(candidate_sets),
        "rows": {s: len(r) for s, r in splits.items()},
        "dropped": drops,
        "by_reference": {},
        "by_selection": {},
    }
    for ref in REFERENCES:
        inc = np.concatenate([shifts.candidates[i] - shifts.reference[ref][i] for i in range(len(candidate_sets))])
        report["by_reference"][ref] = {
            "inc_quantiles": {q: float(np.quantile(inc, q)) for q in (0.05, 0.25, 0.5, 0.75, 0.95)} if len(inc) else {},
            "share_positive": float((inc > 0).mean()) if len(inc) else 0.0,
            "gold": gold_placement(candidate_sets, shifts, ref, top_k, REFERENCE_RULE),
            "kept": len(build_rows(candidate_sets, shifts, ref, top_k, REFERENCE_RULE)[0]),
        }
    for rule in SELECTIONS:
        if RULES[rule].needs_answers and utility is None:
            continue
        report["by_selection"][rule] = {
            "gold": gold_placement(candidate_sets, shifts, reference, top_k, rule, utility),
            "kept": len(build_rows(candidate_sets, shifts, reference, top_k, rule, utility)[0]),
        }
    if utility is not None:
        flat = np.concatenate([np.asarray(u, dtype=bool) for u in utility]) if utility else np.zeros(0, bool)
        report["utility"] = {
            "candidates": int(flat.size),
            "correct_share": float(flat.mean()) if flat.size else 0.0,
            "questions_with_a_correct_candidate": float(np.mean([bool(np.any(u)) for u in utility])),
        }
    report["examples"] = _examples(candidate_sets, shifts, reference)
    return report


def _examples(candidate_sets, shifts, reference, count: int = 3) -> list[dict]:
    """Figure 3 / 6 style: confidence before, and after a helpful and a harmful context."""
    examples = []
    for i, cs in enumerate(candidate_sets):
        if len(examples) == count:
            break
        if not any(cs.from_gold) or len(cs.passages) < 2:
            continue
        conf = shifts.candidates[i]
        best, worst = int(np.argmax(conf)), int(np.argmin(conf))
        examples.append(
            {
                "question": cs.question,
                "answers": list(cs.answers),
                "confidence_before": float(shifts.reference[reference][i]),
                "raises": {
                    "context": document_text(cs.passages[best])[:300],
                    "confidence": float(conf[best]),
                    "has_answer": cs.has_answer[best],
                },
                "lowers": {
                    "context": document_text(cs.passages[worst])[:300],
                    "confidence": float(conf[worst]),
                    "has_answer": cs.has_answer[worst],
                },
            }
        )
    return examples


def relevance_rows(candidate_sets: Sequence[Candidates], qids: set[str], top_k: int) -> list[dict]:
    """The ablation's labels: passages holding a gold answer are positives, the others negatives (the
    top-K of each in retrieval order); questions lacking either are left out."""
    rows = []
    for c in candidate_sets:
        if c.qid not in qids:
            continue
        pos = [document_text(p) for p, hit in zip(c.passages, c.has_answer) if hit][:top_k]
        neg = [document_text(p) for p, hit in zip(c.passages, c.has_answer) if not hit][:top_k]
        if pos and neg:
            rows.append({"qid": c.qid, "query": c.question, "pos": pos, "neg": neg, "prompt": RERANK_INSTRUCTION})
    return rows


def split_by_question(rows: list[dict], test_fraction: float, seed: int) -> dict[str, list[dict]]:
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1) (got {test_fraction})")
    qids = sorted({r["qid"] for r in rows})
    rng = np.random.default_rng(seed)
    test = set(rng.permutation(qids)[: round(len(qids) * test_fraction)].tolist())
    return {"train": [r for r in rows if r["qid"] not in test], "test": [r for r in rows if r["qid"] in test]}


def save_rows(splits: dict[str, list[dict]], directory: Path) -> None:
    """Each split as JSONL (FlagEmbedding reads it) and as a `datasets` Arrow folder."""
    from datasets import Dataset

    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        atomic_write_text(directory / f"{split}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        if rows:  # built beside, then swapped in: a killed run never leaves half a dataset, nor none
            with swapped_in(directory / f"{split}_arrow") as tmp:
                Dataset.from_list(rows).save_to_disk(str(tmp))
    # Over what this call wrote only: a rule's rows saved into a subfolder later carry their own digest.
    written = [f"{split}.jsonl" for split in splits] + [f"{split}_arrow" for split, rows in splits.items() if rows]
    write_folder_digest(directory, written)
