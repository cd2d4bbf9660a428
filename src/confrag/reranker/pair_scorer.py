"""A reranker's scoring parts outside Lightning: the model that gives one logit per (query, passage) pair, its
tokenizer, its kind (`confrag.reranker.kinds`) and its length budgets. The `cross_encoder` listwise student
fine-tunes one whole (`confrag.reranker.listwise_student`), and an aligned reranker loaded outside a run scores its
base with one (`confrag.reranker.aligned`); `RerankerModule` holds the same parts for the paper's training.

`export` writes what `RerankerModule.export` writes (a `save_pretrained` folder the kind's library loads:
sentence-transformers' `CrossEncoder` for a cross-encoder, `SentenceTransformer` for a bi-encoder) plus
`pair_scorer.json` (kind and budgets), so `PairScorer.load` reads it back as it was trained.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from confrag.infra.digests import require_whole_folder, write_folder_digest
from confrag.infra.finite import require_finite
from confrag.reranker.backbone import minilm_dir
from confrag.reranker.kinds import reranker_kind

CARD = "pair_scorer.json"
# The embedded default's kind: all-MiniLM-L6-v2 scored as the bi-encoder it was trained as (SCALE · cosine).
EMBEDDED_KIND = "bi_encoder"


@dataclass
class PairScorer:
    model: nn.Module
    tokenizer: Any
    kind: str
    query_max_len: int
    passage_max_len: int

    @classmethod
    def of(cls, module: Any) -> PairScorer:
        """A `RerankerModule`'s scoring parts (its weights shared: a student that trains them copies them first)."""
        h = module.hparams
        return cls(module.plain_model(), module.tokenizer, h.kind, int(h.query_max_len), int(h.passage_max_len))

    @classmethod
    def load(cls, folder: str | Path, kind: str | None = None) -> PairScorer:
        """An exported scorer: `kind` and the budgets from its `pair_scorer.json` (an export of this module), or,
        for a `RerankerModule` export, `kind` given and the budgets its tokenizer allows."""
        folder = Path(folder)
        card = folder / CARD
        if card.is_file():
            require_whole_folder(folder, "exported scorer")
            meta = json.loads(card.read_text())
            kind, budgets = meta["kind"], (int(meta["query_max_len"]), int(meta["passage_max_len"]))
        elif kind is None:
            raise ValueError(f"{folder} has no {CARD}: name its reranker kind")
        else:
            budgets = None
        spec = reranker_kind(kind)
        tokenizer = spec.load_tokenizer(str(folder))
        model = spec.load(str(folder), tokenizer, False, 0, False)
        limit = int(tokenizer.model_max_length)
        query_max_len, passage_max_len = budgets or (limit, limit)
        return cls(model.float().eval(), tokenizer, kind, query_max_len, passage_max_len)

    @classmethod
    def embedded(cls) -> PairScorer:
        """The embedded all-MiniLM-L6-v2 as the bi-encoder it is: the studies' base."""
        return cls.load(minilm_dir(), EMBEDDED_KIND)

    def features(self, queries: Sequence[str], passages: Sequence[str], device: torch.device) -> dict:
        encoded = reranker_kind(self.kind).encode(
            self.tokenizer, list(queries), list(passages), self.query_max_len, self.passage_max_len
        )
        return {k: v.to(device) for k, v in encoded.features.items()}

    def logits(self, queries: Sequence[str], passages: Sequence[str]) -> torch.Tensor:
        """One logit per pair, with gradients (training)."""
        device = next(self.model.parameters()).device
        return self.model(**self.features(queries, passages, device)).logits.view(-1).float()

    @torch.no_grad()
    def score(self, queries: Sequence[str], passages: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """One logit per pair, in eval mode."""
        was_training = self.model.training
        self.model.eval()
        try:
            out = [
                self.logits(queries[i : i + batch_size], passages[i : i + batch_size]).cpu()
                for i in range(0, len(queries), batch_size)
            ]
        finally:
            self.model.train(was_training)
        scores = torch.cat(out).numpy() if out else np.zeros(0, dtype=np.float32)
        require_finite(scores, stage="pair scoring", artifact=f"the scores of a {self.kind} reranker")
        return scores

    def export(self, folder: str | Path) -> None:
        """The model and tokenizer with `save_pretrained` (the kind's library loads them) and `pair_scorer.json`,
        into `folder` (a folder being built: the caller swaps it in)."""
        folder = Path(folder)
        reranker_kind(self.kind).prepare_export(self.model)
        self.model.save_pretrained(str(folder))
        self.tokenizer.save_pretrained(str(folder))
        meta = {"kind": self.kind, "query_max_len": self.query_max_len, "passage_max_len": self.passage_max_len}
        (folder / CARD).write_text(json.dumps(meta, indent=2))
        write_folder_digest(folder)
