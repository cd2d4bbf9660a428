"""After each fine-tuning: a reranker whose scores no longer vary is refused; its checkpoints leave the run."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from confrag.stages.rerankers import check_not_collapsed, remove_checkpoints

ROWS = [{"query": f"q{i}", "pos": [f"p{i}"], "neg": [f"n{i}a", f"n{i}b"]} for i in range(5)]


class Constant:
    def __init__(self, value: float) -> None:
        self.value = value

    def score(self, queries, passages):
        return np.full(len(passages), self.value, dtype=np.float32)


class ByLength:
    def score(self, queries, passages):
        return np.array([len(p) for p in passages], dtype=np.float32)


def test_a_collapsed_reranker_is_refused_with_the_settings_to_change():
    with pytest.raises(ValueError, match=r"reranker confidence_ft\.sign: .*no longer vary.*model\.lr"):
        check_not_collapsed(Constant(0.3), ROWS, "confidence_ft.sign")
    with pytest.raises(ValueError, match="no longer vary"):
        check_not_collapsed(Constant(float("nan")), ROWS, "x")
    assert check_not_collapsed(ByLength(), ROWS, "ok") == pytest.approx(1.0)


def test_checkpoints_are_removed_once_exported(tmp_path):
    last, best = tmp_path / "last.ckpt", tmp_path / "epoch000.ckpt"
    for path in (last, best):
        path.write_bytes(b"x")
    keep = tmp_path / "other.ckpt"
    keep.write_bytes(b"y")
    callback = SimpleNamespace(last_model_path=str(last), best_model_path=str(best), best_k_models={str(best): 1.0})
    remove_checkpoints(
        SimpleNamespace(checkpoint_callbacks=[callback, SimpleNamespace(last_model_path="", best_model_path="")])
    )
    assert not last.exists() and not best.exists() and keep.exists()
