"""DRAGIN's closed-book draft: one greedy generation per question with, per draft token, its entropy,
log-probability, highest probability and the attention it receives (what DRAGIN's RIND and the
uncertainty gates read, `DraftSignals`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from confrag.gates.base import DraftSignals
from confrag.infra import checks
from confrag.llm.loading import LoadedLLM
from confrag.llm.prompts import encode_prompts


@contextlib.contextmanager
def _eager_attention(model: PreTrainedModel) -> Iterator[None]:
    """SDPA returns no attention weights; switch to eager attention for the block, then switch back."""
    previous = model.config._attn_implementation
    if previous == "eager":
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, (list, tuple)) else [configured])
    ids.add(tokenizer.eos_token_id)
    return {i for i in ids if i is not None}


def _received_attention(attention: torch.Tensor, length: int) -> np.ndarray:
    """attention: (heads, steps, steps) of query draft token j over key draft token i. Returns, per
    token i < length, the max over queries j with i <= j < length per head, averaged over heads."""
    if length == 0:
        return np.zeros(0)
    sub = attention[:, :length, :length]
    itself_or_later = torch.tril(torch.ones(length, length, dtype=torch.bool))  # j >= i
    received = torch.where(itself_or_later, sub, torch.zeros_like(sub)).amax(dim=1)  # max over queries j
    return received.mean(dim=0).numpy().astype(np.float64)


@torch.inference_mode()
def draft_token_signals(
    llm: LoadedLLM, prompts: Sequence[str], max_new_tokens: int = 32, batch_size: int = 8, progress: bool = False
) -> DraftSignals:
    """One greedy generation per prompt (the closed-book draft) with, per draft token, the entropy of
    the distribution it was drawn from (raw logits), the token's log-probability and that distribution's
    highest probability (the same number for a greedy token, unless the generation config's logits
    processors changed the choice), and the attention it receives in the last layer:
    the max over the token itself and every later draft token, per head, then averaged over heads
    (DRAGIN's code; its paper writes "later tokens", but then a one-token answer could never trigger).

    The draft ends at the first EOS or after `max_new_tokens`; one extra token is generated and dropped
    so that the last draft token has also been read as a query. Eager attention is used for the call
    (SDPA exposes no weights), so a draft can differ from an SDPA greedy answer where two tokens are
    within float rounding of each other."""
    checks.positive_int(max_new_tokens, "max_new_tokens")
    checks.positive_int(batch_size, "batch_size")
    model, tokenizer = llm.model, llm.tokenizer
    ids = encode_prompts(tokenizer, prompts)
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    texts, tokens, entropies, attentions, logprobs, max_probs = ([None] * len(ids) for _ in range(6))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    with _eager_attention(model):
        for batch in tqdm(batches, desc="drafts", unit="batch", disable=not progress):
            width = max(len(ids[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for row, index in enumerate(batch):  # left padding: every row's next token is at the end
                input_ids[row, width - len(ids[index]) :] = torch.tensor(ids[index])
                mask[row, width - len(ids[index]) :] = 1
            output = model.generate(
                input_ids=input_ids.to(llm.device),
                attention_mask=mask.to(llm.device),
                max_new_tokens=max_new_tokens + 1,
                do_sample=False,
                num_beams=1,
                pad_token_id=pad_id,
                return_dict_in_generate=True,
                output_logits=True,
                output_attentions=True,
            )
            steps = len(output.logits)
            log_probs = torch.log_softmax(torch.stack(output.logits, dim=1).float(), dim=-1)  # (B, steps, V)
            entropy = -(log_probs.exp() * log_probs).sum(dim=-1).cpu()
            max_prob = log_probs.amax(dim=-1).exp().cpu()
            chosen = output.sequences[:, width : width + steps].to(log_probs.device)
            chosen_logprob = log_probs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).cpu()
            # Step s >= 1 read draft token s-1 as its query (the extra step reads the last kept token).
            heads = output.attentions[0][-1].shape[1]
            attention = torch.zeros(len(batch), heads, steps, steps)
            for step in range(1, steps):
                attention[:, :, step - 1, :step] = (
                    output.attentions[step][-1][:, :, 0, width : width + step].float().cpu()
                )
            for row, index in enumerate(batch):
                generated = output.sequences[row, width:].tolist()
                length = next((i for i, t in enumerate(generated) if t in eos), len(generated))
                length = min(length, max_new_tokens)
                draft_ids = generated[:length]
                texts[index] = tokenizer.decode(draft_ids, skip_special_tokens=True).strip()
                tokens[index] = [tokenizer.decode([t]) for t in draft_ids]
                entropies[index] = entropy[row, :length].numpy().astype(np.float64)
                logprobs[index] = chosen_logprob[row, :length].numpy().astype(np.float64)
                max_probs[index] = max_prob[row, :length].numpy().astype(np.float64)
                attentions[index] = _received_attention(attention[row], length)
    return DraftSignals(
        texts=texts, tokens=tokens, entropy=entropies, attention=attentions, logprob=logprobs, max_prob=max_probs
    )
