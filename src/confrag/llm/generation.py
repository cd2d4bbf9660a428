"""Batched greedy generation with a progress bar."""

from __future__ import annotations

from typing import Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from confrag.llm.prompts import encode_prompts


@torch.inference_mode()
def generate_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int = 32,
    batch_size: int = 16,
    desc: str = "generating",
    progress: bool = True,
) -> list[str]:
    """Greedy answers, in the order of `prompts`. Prompts are sorted by length and left-padded."""
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1 (got {max_new_tokens}, {batch_size})")
    ids = encode_prompts(tokenizer, prompts)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    answers: list[str] = [""] * len(ids)
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    for batch in tqdm(batches, desc=desc, unit="batch", disable=not progress):
        width = max(len(ids[i]) for i in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, index in enumerate(batch):
            input_ids[row, width - len(ids[index]):] = torch.tensor(ids[index])
            mask[row, width - len(ids[index]):] = 1
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad_id,
        )
        for row, index in enumerate(batch):
            answers[index] = tokenizer.decode(output[row, width:], skip_special_tokens=True).strip()
    return answers
