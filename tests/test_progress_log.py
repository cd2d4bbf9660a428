"""Long stages say how far they are in train.log: a line per shard with the rate and the time left, and a line
while a slow shard is still computing (a shard of hundreds of answers takes minutes)."""

from __future__ import annotations

import logging
import re
import time

from confrag.infra import locks
from confrag.infra.sharded import ShardedArtifact


def slow_records(delay: float):
    def fn(start: int, stop: int) -> list[int]:
        time.sleep(delay)
        return list(range(start, stop))

    return fn


def test_each_shard_logs_its_rate_and_the_progress_of_the_whole(tmp_path, caplog):
    artifact = ShardedArtifact(tmp_path, "answers", {"x": 1}, 10, shard_size=4, fmt="json")
    with caplog.at_level(logging.INFO, logger="confrag.infra.locks"):
        artifact.compute(slow_records(0.0), desc="answers", progress=False)
    lines = [r.getMessage() for r in caplog.records if "computed shard" in r.getMessage()]
    assert len(lines) == 3
    assert re.search(r"computed shard 0 \(items \[0, 4\)\) in [\d.]+ s, [\d.]+ items/s \[pid \d+\]", lines[0])
    assert "answers: 1 of 3 shards, 4 of 10 items in" in lines[0] and "items/s, about" in lines[0]
    assert "answers: 3 of 3 shards, 10 of 10 items in" in lines[2] and "about 0 s left" in lines[2]


def test_a_slow_shard_says_it_is_still_computing(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(locks, "PROGRESS_LOG_SECONDS", 0.05)
    artifact = ShardedArtifact(tmp_path, "generations", {"x": 2}, 3, shard_size=3, fmt="json")
    with caplog.at_level(logging.INFO, logger="confrag.infra.locks"):
        artifact.compute(slow_records(0.3), desc="generations", progress=False)
    beats = [r.getMessage() for r in caplog.records if "still computing" in r.getMessage()]
    assert beats, "no progress line while the shard computed"
    assert re.match(r"generations [0-9a-f]{16}: shard 0 \(items \[0, 3\)\): still computing after [\d.]+ s", beats[0])
    assert "generations: 0 of 1 shards, 0 of 3 items" in beats[0]
    time.sleep(0.15)  # the heartbeat stops with its shard
    assert len([r for r in caplog.records if "still computing" in r.getMessage()]) == len(beats)


class Toy:
    """A linear regression as a LightningModule: a fit of a few steps in well under a second."""

    @staticmethod
    def fit(steps: int, callback, epochs: int = 1) -> None:
        import lightning as L
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        class Linear(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(3, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = torch.nn.functional.mse_loss(self.layer(x), y)
                self.log("train/loss", loss)
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        data = TensorDataset(torch.randn(steps * 2, 3), torch.randn(steps * 2, 1))
        trainer = L.Trainer(
            max_epochs=epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callback],
        )
        trainer.fit(Linear(), DataLoader(data, batch_size=2))


def test_a_fit_logs_its_steps_with_rate_and_time_left(caplog):
    """Lightning's bar writes nothing to train.log until a fit ends (23 silent minutes on 300 rows): the fit's
    steps, rate and time left go to the log, after the first step and every N steps."""
    from confrag.infra.fit_progress import FitProgress

    with caplog.at_level(logging.INFO, logger="confrag.infra.fit_progress"):
        Toy.fit(7, FitProgress("reranker rank", every_n_steps=3), epochs=2)
    lines = [r.getMessage() for r in caplog.records if r.name == "confrag.infra.fit_progress"]
    assert lines[0] == "reranker rank: training, 14 steps planned (max_epochs 2)"
    steps = [int(re.search(r"step (\d+) of 14", line).group(1)) for line in lines if " of 14 (epoch" in line]
    assert steps[:5] == [1, 3, 6, 9, 12]  # the first step, then every 3 (and a line at least every minute)
    pattern = r"reranker rank: step 3 of 14 \(epoch 1\), [\d.e+]+ steps/s, \d+ s so far, about \d+ s left, train/loss"
    assert re.match(pattern, lines[2]), lines[2]
    assert re.match(r"reranker rank: trained, 14 steps in \d+ s", lines[-1])


def test_every_lightning_fit_of_the_package_carries_the_progress_callback():
    """Every module that starts a Lightning fit gives it `FitProgress` (the probe, every reranker, the listwise
    students), so that no fit is silent in train.log."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "confrag"
    fitting = [p for p in src.rglob("*.py") if "trainer.fit(" in p.read_text()]
    assert len(fitting) >= 3, fitting
    assert [p.name for p in fitting if "FitProgress(" not in p.read_text()] == []
