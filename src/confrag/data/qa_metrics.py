"""Answer correctness for open-domain QA, as in DPR (Karpukhin et al., 2020) and Ni et al. (2025).

Normalization is SQuAD's (lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse
whitespace), preceded by Unicode NFKC so that e.g. a non-breaking space in "Carbon\\xa0dioxide" or a
full-width digit compares equal to its plain form. SQuAD's rules are otherwise kept exactly, so
scores stay comparable with published numbers; note that this means non-ASCII punctuation (em dash,
curly quotes) is kept and "Eminem's" becomes the single token "eminems".

`has_answer_dpr` is DPR's own rule (`dpr/data/qa_validation.py`, match type "string"): NFD, DPR's
SimpleTokenizer (runs of letters, digits and marks, or any other single non-space character), lower-cased
tokens, and the answer's token sequence found in the text's. It splits "Eminem's" into "eminem ' s" and
"1914–1918" into "1914 – 1918", so answers that the SQuAD normalization glues to their neighbours are
found; on the shared NQ sample it finds the answer in all 2,155 gold paragraphs, `has_answer` in 2,134
(tests/test_qa_metrics.py).
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Sequence

import regex

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """NFKC, then SQuAD normalization: lower-case, no punctuation, no articles, single spaces."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


# Hyphens and dashes (ASCII, Unicode's U+2010-U+2015, the minus sign) between words of a question.
_DASHES = re.compile("[-\u2010-\u2015\u2212]")


def normalize_question(text: str) -> str:
    """A question as compared across files (repeats, training against evaluation questions, a file's question
    against the data's): the answer normalization with hyphens and dashes read as spaces, so that "a 3-second
    rule" and "a 3 second rule" are one question (the answer normalization drops the hyphen: "3second")."""
    return normalize_answer(_DASHES.sub(" ", unicodedata.normalize("NFKC", text)))


def _normalized_answers(answers: Sequence[str]) -> list[str]:
    # A bare str is a Sequence[str] too; iterating it would silently score single characters.
    if isinstance(answers, str):
        raise TypeError(f"answers must be a sequence of strings, not a single str; got {answers!r}")
    if len(answers) == 0:
        raise ValueError("answers must contain at least one answer string; got an empty sequence")
    normalized = []
    for index, answer in enumerate(answers):
        if not isinstance(answer, str):
            raise TypeError(f"answers[{index}] must be a str; got {type(answer).__name__}")
        normalized.append(normalize_answer(answer))
    return normalized


def has_answer(response: str, answers: Sequence[str]) -> bool:
    """True when some answer, normalized, occurs in the normalized response on token boundaries."""
    padded_response = f" {normalize_answer(response)} "
    # Answers that normalize to "" (e.g. "*") would match every response, so they never count.
    return any(answer and f" {answer} " in padded_response for answer in _normalized_answers(answers))


# DPR's SimpleTokenizer: a run of letters / digits / combining marks, or one other non-space character.
_DPR_TOKEN = regex.compile(
    r"([\p{L}\p{N}\p{M}]+)|([^\p{Z}\p{C}])", flags=regex.IGNORECASE | regex.UNICODE | regex.MULTILINE
)


def dpr_tokens(text: str) -> list[str]:
    """DPR's tokens of `text`: NFD-normalized, tokenized as SimpleTokenizer does, lower-cased."""
    return [match.group().lower() for match in _DPR_TOKEN.finditer(unicodedata.normalize("NFD", text))]


def has_answer_dpr(response: str, answers: Sequence[str]) -> bool:
    """DPR's has_answer: some answer's token sequence occurs in the response's (see the module docstring)."""
    if isinstance(answers, str):
        raise TypeError(f"answers must be a sequence of strings, not a single str; got {answers!r}")
    if len(answers) == 0:
        raise ValueError("answers must contain at least one answer string; got an empty sequence")
    text = dpr_tokens(response)
    for answer in answers:
        tokens = dpr_tokens(answer)
        if tokens and any(text[i : i + len(tokens)] == tokens for i in range(len(text) - len(tokens) + 1)):
            return True
    return False


def exact_match(response: str, answers: Sequence[str]) -> bool:
    """True when the normalized response equals some normalized answer."""
    normalized_response = normalize_answer(response)
    # As in has_answer: an empty normalized answer must not make an empty response correct.
    return any(answer and normalized_response == answer for answer in _normalized_answers(answers))


def _token_f1(response_tokens: list[str], answer_tokens: list[str]) -> float:
    common = Counter(response_tokens) & Counter(answer_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(response_tokens)
    recall = num_same / len(answer_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(response: str, answers: Sequence[str]) -> float:
    """SQuAD v1.1 token F1 between response and answer, maximized over the answers."""
    response_tokens = normalize_answer(response).split()
    return max(_token_f1(response_tokens, answer.split()) for answer in _normalized_answers(answers))
