"""The LLM's likelihood of the gold answer after a prompt, and the prompt's hidden states, from one forward.

ℓ(prompt, answers) = max over the gold answers of the mean per-token log-probability of the answer's tokens right
after the prompt (teacher-forced): the signal REPLUG's LM-supervised retrieval, RA-DIT's retriever step and Atlas's
perplexity distillation train a retriever on (one forward per candidate context, no decoding). With causal
attention, the prompt's states at its last token do not see the answer appended after it, so the same forward gives
the Layer/2 state Conf(Q + C) is read from: the probe's signal and the likelihood come from one pass.

Rows are (prompt, answer) pairs grouped by length like the engine's batches; the token prefix every prompt shares
is prefilled once; the LM head runs on the answer positions only. Batches run on the engine's CPU workers, each on
its fixed intra-op threads, so the bytes do not depend on the core count (`confrag.llm.workers`). The result equals
separate forwards of prompt + answer (for ℓ) and of the prompt alone (for the states) up to float rounding (tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from confrag.llm.hidden_states import HiddenStateEngine, validate_layers
from confrag.llm.kv_cache import cache_argument, expanded_cache
from confrag.llm.last_token import LastTokenCapture
from confrag.llm.prompts import encode_prompts
from confrag.llm.workers import fixed_threads, longest_first, run_batches


@dataclass(frozen=True)
class PromptLikelihood:
    """ℓ per prompt (`likelihood`, shape (n,)) and its states at the last prompt token (`states`, (layers, n, d))."""

    likelihood: np.ndarray
    states: np.ndarray


def answer_token_ids(tokenizer, answers: Sequence[str]) -> list[list[int]]:
    """The tokens of each answer as the model would write them right after the generation prompt."""
    ids = [tokenizer(answer, add_special_tokens=False)["input_ids"] for answer in answers]
    empty = [answer for answer, seq in zip(answers, ids) if not seq]
    if empty:
        raise ValueError(f"gold answer(s) {empty[:3]!r} encode to zero tokens")
    return ids


class AnswerLikelihood:
    """ℓ and last-prompt-token states of prompts, through a `HiddenStateEngine`'s batching, prefix and workers."""

    def __init__(self, engine: HiddenStateEngine) -> None:
        self.engine = engine
        self.model = engine.model
        self.base = engine.base

    def score(
        self, prompts: Sequence[str], answers: Sequence[Sequence[str]], layers: Sequence[int] = ()
    ) -> PromptLikelihood:
        """`answers[i]`: the gold answers of prompt i (at least one). `layers`: the states to keep (may be empty)."""
        if len(answers) != len(prompts):
            raise ValueError(f"{len(answers)} answer lists for {len(prompts)} prompts")
        bare = [i for i, gold in enumerate(answers) if not gold]
        if bare:
            raise ValueError(f"prompt(s) {bare[:5]} have no gold answer: the likelihood needs at least one")
        tok = self.engine.tokenizer
        answer_ids = [answer_token_ids(tok, list(dict.fromkeys(gold))) for gold in answers]
        return self.score_ids(encode_prompts(tok, prompts), answer_ids, layers)

    @torch.inference_mode()
    def score_ids(
        self, prompt_ids: Sequence[list[int]], answer_ids: Sequence[Sequence[list[int]]], layers: Sequence[int] = ()
    ) -> PromptLikelihood:
        """`score` on token ids: `answer_ids[i]`, the token ids of prompt i's gold answers (the GPU benchmark's
        random-id workload calls it directly)."""
        layers = validate_layers(layers, self.engine.num_layers) if len(layers) else []
        prompts = prompt_ids
        pairs: list[tuple[int, list[int], list[int]]] = []  # (prompt index, prompt tokens, answer tokens)
        for i, (ids, gold) in enumerate(zip(prompt_ids, answer_ids)):
            pairs.extend((i, list(ids), list(a)) for a in gold)
        ell = np.full(len(prompts), -np.inf, dtype=np.float64)
        hidden = self.model.config.hidden_size
        states = np.zeros((len(layers), len(prompts), hidden), dtype=np.float32)
        if not pairs:
            return PromptLikelihood(ell.astype(np.float32), states)
        first = {}  # prompt index -> its first pair: where its states are read
        for at, (i, _, _) in enumerate(pairs):
            first.setdefault(i, at)
        engine = self.engine
        prefix_len = engine._shared_prefix_length(prompt_ids)  # every prompt keeps its last token
        rows, tokens = engine.batch_limits(engine.num_layers, max(len(p) + len(a) for _, p, a in pairs))
        batches = engine.length_batches([len(p) + len(a) - prefix_len for _, p, a in pairs], rows, tokens)
        device = engine.device
        bar = tqdm(total=len(batches), desc="answer likelihood", unit="batch", disable=not engine.progress, leave=False)
        with (
            fixed_threads(device, engine.threads),
            bar,
            LastTokenCapture(self.base, layers, engine.num_layers) as hooks,
        ):
            prefix = engine._prefix_cache(prompt_ids[0][:prefix_len]) if prefix_len else None

            def work(batch: list[int]) -> tuple[np.ndarray, np.ndarray]:
                return self._run_batch([pairs[j] for j in batch], prefix_len, prefix, layers, hooks)

            size = {id(b): max(len(pairs[j][1]) + len(pairs[j][2]) for j in b) * len(b) for b in batches}
            ordered = longest_first(batches, lambda b: size[id(b)])
            for batch, (batch_ell, batch_states) in run_batches(work, ordered, device, engine.workers, bar):
                for row, j in enumerate(batch):
                    i = pairs[j][0]
                    ell[i] = max(ell[i], float(batch_ell[row]))
                    if layers and first[i] == j:
                        states[:, i, :] = batch_states[:, row, :]
        return PromptLikelihood(ell.astype(np.float32), states)

    def _run_batch(self, pairs, prefix_len: int, prefix, layers, hooks: LastTokenCapture):
        batch = len(pairs)
        suffixes = [p[prefix_len:] + a for _, p, a in pairs]
        width = max(len(seq) for seq in suffixes)
        input_ids = torch.full((batch, width), self.engine.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, seq in enumerate(suffixes):  # right padding: the answer ends each row's real tokens
            input_ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        position_ids = (prefix_len + mask.cumsum(1) - 1).clamp(min=0)
        full_mask = torch.cat([torch.ones((batch, prefix_len), dtype=torch.long), mask], dim=1)
        last_prompt = torch.tensor([len(p) - prefix_len - 1 for _, p, _ in pairs])
        cache = None
        if prefix is not None:
            cache = expanded_cache([(layer.keys, layer.values) for layer in prefix.layers], batch)
        device = self.engine.device
        with hooks.batch(last_prompt.to(device)) as captured:
            out = self.base(
                input_ids=input_ids.to(device),
                attention_mask=full_mask.to(device),
                position_ids=position_ids.to(device),
                use_cache=cache is not None,
                **cache_argument(self.base, cache),
            )
        final = out.last_hidden_state
        # The position before each answer token predicts it: rows' answer spans, flattened.
        row_index = torch.cat([torch.full((len(a),), r, dtype=torch.long) for r, (_, _, a) in enumerate(pairs)])
        at = torch.cat([last_prompt[r] + torch.arange(len(a)) for r, (_, _, a) in enumerate(pairs)])
        targets = torch.cat([torch.tensor(a) for _, _, a in pairs]).to(device)
        logits = self.model.lm_head(final[row_index.to(device), at.to(device)]).float()
        token_logp = F.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        sums = torch.zeros(batch, dtype=torch.float64, device=device).index_add_(
            0, row_index.to(device), token_logp.double()
        )
        lengths = torch.tensor([len(a) for _, _, a in pairs], dtype=torch.float64, device=device)
        ell = (sums / lengths).cpu().numpy()
        kept = (
            np.stack([captured[layer].float().cpu().numpy() for layer in layers]) if layers else np.zeros((0, batch, 0))
        )
        return ell, kept
