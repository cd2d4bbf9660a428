"""Every corpus passage and candidate measured in the LLM's tokens before the LLM loads, as the questions are
(`confrag.stages.rerank.fitted_questions`): NQ_Rerank's Conf(Q + C) prompts and the answers' RAG prompts hold
passages of the corpus (or of a candidates file), and a passage past the context failed only inside the
hidden-state engine, after the LLM had loaded, naming nothing.

What one passage may hold (`retrieval.max_passage_tokens`; null: the most that fits) is what is left of the
context after the tokens to generate and the longest question's one-passage RAG prompt without its passage,
less a few tokens for merges at the joins. A passage past it is refused, naming its id, its file and line
(or its question's paragraph), its length and the limit, or cut to it with `retrieval.cut_passages`.
Prompts holding K passages are still checked whole where they are built (`rag.truncate_passages`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from confrag.data.jsonl import read_jsonl
from confrag.data.nq import QARow
from confrag.llm.loading import prompt_tokenizer
from confrag.llm.prompts import PromptTemplates, encode_prompts
from confrag.retrieval.corpus import Corpus, CorpusPassage, located_documents, passages_fingerprint
from confrag.retrieval.lengths import PassageTooLongError, TokenBudget, fit_passages
from confrag.retrieval.ranked_ids import check_against_corpus, check_questions, read_ranked_lists
from confrag.stages.retrieval import RetrievalSettings, load_corpus

JOIN_MARGIN = 4  # tokens kept free: a passage measured alone may tokenize a little longer inside the prompt
CUT_OPTION = "retrieval.cut_passages"


def llm_passage_budget(
    llm: dict[str, Any],
    templates: PromptTemplates,
    questions: Sequence[QARow],
    max_new_tokens: int,
    settings: RetrievalSettings,
) -> TokenBudget:
    """What one passage may hold in the LLM's one-passage prompts for every one of `questions`, from the
    tokenizer and the config alone; `retrieval.max_passage_tokens` above it is refused."""
    tokenizer, context = prompt_tokenizer(llm)
    empty = CorpusPassage(pid="", title="", text="", source_id="")
    prompts = [templates.rag_prompt(tokenizer, row.question, [empty]) for row in questions]
    overhead = max(len(ids) for ids in encode_prompts(tokenizer, prompts))
    fits = context - max_new_tokens - overhead - JOIN_MARGIN
    if fits < 1:
        raise PassageTooLongError(
            f"the LLM's context of {context} tokens less max_new_tokens={max_new_tokens} leaves no room for a passage "
            f"beside the longest question ({overhead} tokens of prompt)"
        )
    limit = settings.max_passage_tokens
    if limit is not None and limit > fits:
        raise ValueError(
            f"retrieval.max_passage_tokens={limit} is more than one passage may hold in the LLM's prompts ({fits} "
            f"tokens: a context of {context} less max_new_tokens={max_new_tokens} and the longest question's prompt); "
            f"lower it or set it to null"
        )
    if limit is None:
        return TokenBudget("the LLM", tokenizer, fits, f"a context of {context} tokens less the prompt and answer")
    return TokenBudget("the LLM", tokenizer, limit, f"retrieval.max_passage_tokens={limit}")


def checked_corpus(
    settings: RetrievalSettings, budget: TokenBudget, questions: Sequence[QARow]
) -> tuple[Corpus, dict[str, Any]]:
    """The retrieval corpus with every passage checked against `budget` (refused naming file and line, or cut
    with `retrieval.cut_passages`), a candidates file's passages, ids and `questions` checked too; the counts."""
    corpus = load_corpus(settings)
    passages, cut = fit_passages(corpus.passages, budget, settings.cut_passages, _locator(settings, corpus), CUT_OPTION)
    if cut:
        corpus = Corpus(passages, corpus.gold_source_of, passages_fingerprint(passages))
    lengths = {"llm": {"limit": budget.limit, "passages": len(passages), "cut": cut}}
    kind = settings.candidates_kind
    if kind == "confrag":
        lengths["llm"]["candidates_over_limit"] = check_candidates_file(settings, budget)
    elif kind:
        lists = read_ranked_lists(settings.candidates_path, kind)
        source = f"retrieval.candidates_path={settings.candidates_path}"
        check_against_corpus(lists, corpus, source)
        check_questions(lists, questions, source)
    return corpus, lengths


def checked_paragraphs(
    settings: RetrievalSettings, budget: TokenBudget, rows: Sequence[QARow], where: str
) -> tuple[Corpus, dict[str, Any]]:
    """The corpus of `rows`' own paragraphs (HotpotQA's supporting paragraphs, read from the file `where`) with every
    passage checked against `budget` as the retrieval corpus is (`checked_corpus`); the counts."""
    corpus = load_corpus(settings, rows)

    def locate(indices: Sequence[int]) -> list[str]:
        return [f"{where}, a paragraph of question {corpus.passages[i].source_id.split('.')[0]!r}" for i in indices]

    passages, cut = fit_passages(corpus.passages, budget, settings.cut_passages, locate, CUT_OPTION)
    if cut:
        corpus = Corpus(passages, corpus.gold_source_of, passages_fingerprint(passages))
    return corpus, {"llm": {"limit": budget.limit, "passages": len(passages), "cut": cut}}


def _locator(settings: RetrievalSettings, corpus: Corpus):
    """Where the passages at some indices come from: the corpus file's line (read again, only for them), or
    the question file's paragraph."""

    def locate(indices: Sequence[int]) -> list[str]:
        wanted = {corpus.passages[i].source_id for i in indices}
        if not settings.corpus_path:
            return [
                f"{settings.questions_path}, the paragraph of question {corpus.passages[i].source_id!r}"
                for i in indices
            ]
        found: dict[str, str] = {}
        for position, doc_id, _, _ in located_documents(settings.corpus_path, settings.corpus_format):
            if doc_id in wanted:
                found[doc_id] = position
                if len(found) == len(wanted):
                    break
        return [f"{settings.corpus_path}, {found.get(corpus.passages[i].source_id, '?')}" for i in indices]

    return locate


def check_candidates_file(settings: RetrievalSettings, budget: TokenBudget) -> int:
    """A candidates file's passages (its own texts) against `budget`: refused naming the file, line and context
    unless `retrieval.cut_passages` (then they are cut where the file is read); returns how many are over."""
    path = settings.candidates_path
    texts, places = [], []
    with contextlib.closing(read_jsonl(path, "a candidates row")) as lines:
        for lineno, obj in lines:
            for j, ctx in enumerate(obj.get("contexts") or []):
                texts.append(f"{ctx.get('title', '')}\n{ctx['text']}" if ctx.get("title") else ctx["text"])
                places.append((lineno, j, ctx.get("pid") or f"{obj.get('qid')}@ctx{j}", len(ctx["text"])))
    over = budget.over(texts)
    if over and not settings.cut_passages:
        named = "; ".join(
            f"passage {places[i][2]!r} ({path}, line {places[i][0]}, contexts[{places[i][1]}]: "
            f"{places[i][3]:,} characters, {n:,} tokens)"
            for i, n in over[:3]
        )
        raise PassageTooLongError(
            f"{len(over)} candidate passage(s) are longer than the {budget.limit} tokens one passage may hold in "
            f"the LLM's prompts ({budget.option}): {named}{'; ...' if len(over) > 3 else ''}. Shorten them, or set "
            f"{CUT_OPTION}=true to cut them to {budget.limit} tokens"
        )
    return len(over)
