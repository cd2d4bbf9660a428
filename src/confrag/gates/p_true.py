"""P(True) (Kadavath et al., 2022): the LLM judges its own closed-book answer; the signal is the
probability it gives to "True" among the two verdicts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from confrag.gates.registry import UnavailableSignalError
from confrag.infra import checks
from confrag.llm.loading import LoadedLLM
from confrag.llm.prompts import encode_prompts

# Kadavath et al. (2022), "Language Models (Mostly) Know What They Know": the model judges its own
# proposed answer; P(True) is the probability it gives to "True".
P_TRUE_TEMPLATE = (
    "Question: {question}\nProposed answer: {answer}\nIs the proposed answer true or false? "
    "Reply with one word: True or False."
)
# The surface forms of each verdict whose first token counts for it (with and without the leading space
# a tokenizer may put before a word).
VERDICTS = {"True": ("True", " True", "true", " true"), "False": ("False", " False", "false", " false")}


def verdict_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, list[int]]:
    """The first token ids of each verdict's surface forms. Refused, naming the signal, when the tokenizer
    cannot tell "True" from "False" by their first token (an unknown-word token, or a shared piece): then
    the LLM cannot give P(True)."""
    ids: dict[str, set[int]] = {}
    for verdict, forms in VERDICTS.items():
        firsts = set()
        for form in forms:
            encoded = tokenizer(form, add_special_tokens=False)["input_ids"]
            if encoded and encoded[0] != tokenizer.unk_token_id:
                firsts.add(int(encoded[0]))
        ids[verdict] = firsts
    shared = ids["True"] & ids["False"]
    if not ids["True"] or not ids["False"] or shared:
        raise UnavailableSignalError(
            "signal p_true: this LLM's tokenizer cannot tell 'True' from 'False' by their first token "
            f"(first token ids: True {sorted(ids['True'])}, False {sorted(ids['False'])}"
            + (f", shared {sorted(shared)}" if shared else "")
            + "); gates reading p_true cannot run with it"
        )
    return {verdict: sorted(firsts) for verdict, firsts in ids.items()}


def p_true_prompts(
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    answers: Sequence[str],
    template: str = P_TRUE_TEMPLATE,
) -> list[str]:
    """The self-evaluation prompt per (question, its closed-book answer), through the chat template."""
    if len(questions) != len(answers):
        raise ValueError(f"{len(questions)} questions and {len(answers)} answers; P(True) needs one answer each")
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template; set llm.chat_template")
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": template.format(question=q, answer=a)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q, a in zip(questions, answers)
    ]


@torch.inference_mode()
def verdict_probabilities(llm: LoadedLLM, prompts: Sequence[str], batch_size: int = 8) -> np.ndarray:
    """(n, 2): the next-token probability mass of "True" and of "False" (each summed over its surface
    forms' first tokens) after each prompt: one forward per prompt, no generation."""
    checks.positive_int(batch_size, "batch_size")
    verdicts = verdict_token_ids(llm.tokenizer)
    ids = encode_prompts(llm.tokenizer, prompts)
    if any(len(seq) == 0 for seq in ids):
        raise ValueError("a P(True) prompt encodes to zero tokens")
    tokenizer = llm.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = np.zeros((len(ids), 2))
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = max(len(ids[i]) for i in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, index in enumerate(batch):  # left padding: the next token of every row is at the end
            input_ids[row, width - len(ids[index]) :] = torch.tensor(ids[index])
            mask[row, width - len(ids[index]) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = llm.model(
            input_ids=input_ids.to(llm.device),
            attention_mask=mask.to(llm.device),
            position_ids=positions.to(llm.device),
        ).logits[:, -1]
        probs = torch.softmax(logits.float(), dim=-1).cpu()
        for row, index in enumerate(batch):
            out[index] = [float(probs[row, verdicts[v]].sum()) for v in ("True", "False")]
    if not np.all(np.isfinite(out)):
        bad = int(np.flatnonzero(~np.isfinite(out).all(axis=1))[0])
        raise ValueError(f"P(True): NaN or inf verdict probability for prompt {bad}")
    return out


def p_true_from_verdicts(verdicts: np.ndarray) -> np.ndarray:
    """P(True) = p(True) / (p(True) + p(False)): the verdict's probability among the two verdicts (a small
    model spreads mass over other first tokens; the ratio keeps what it says about its answer)."""
    verdicts = np.asarray(verdicts, dtype=np.float64)
    total = verdicts.sum(axis=1)
    return np.where(total > 0, verdicts[:, 0] / np.where(total > 0, total, 1.0), 0.5)
