"""A Lightning fit's progress in the log (train.log): its steps, rate and time left, every few steps.

Lightning's progress bar draws on the terminal and writes nothing to the log file until the fit ends; a fit of the
reranker on a few hundred rows runs for minutes (25 on a busy CPU), and train.log stayed silent all that while.
`FitProgress` is given to every fit the stages start (the probe, every reranker, the listwise students): a line
when training starts (steps planned), after the first step (the first rate), then every `every_n_steps` optimizer
steps or after `every_seconds` without a line, whichever comes first, and one when it ends. Only rank 0 logs.
"""

from __future__ import annotations

import logging
import math
import time

from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)

EVERY_N_STEPS = 20  # a line every this many optimizer steps ...
EVERY_SECONDS = 60.0  # ... or after this long without one, whichever comes first


def duration(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `1 h 02 min`."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class FitProgress(Callback):
    """Logs a fit's optimizer steps with their rate and the time left (`what`: the model trained, e.g. `reranker
    rank`)."""

    def __init__(self, what: str, every_n_steps: int = EVERY_N_STEPS, every_seconds: float = EVERY_SECONDS) -> None:
        if int(every_n_steps) < 1 or not float(every_seconds) > 0:
            raise ValueError(f"every_n_steps must be >= 1 and every_seconds > 0; got {every_n_steps}, {every_seconds}")
        self.what, self.every_n_steps, self.every_seconds = what, int(every_n_steps), float(every_seconds)
        self.start = self.last = 0.0
        self.first_step = self.logged_step = 0
        self.total: float = math.inf

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = self.last = time.perf_counter()
        self.first_step = self.logged_step = int(trainer.global_step)
        try:
            self.total = float(trainer.estimated_stepping_batches)
        except Exception:  # an iterable without a length and no max_steps: the total is not known
            self.total = math.inf
        if trainer.is_global_zero:
            planned = "an unknown number of" if math.isinf(self.total) else f"{int(self.total)}"
            log.info("%s: training, %s steps planned (max_epochs %s)", self.what, planned, trainer.max_epochs)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, now = int(trainer.global_step), time.perf_counter()
        if step == self.logged_step:  # no optimizer step since the last line (gradient accumulation)
            return
        due = step - self.first_step == 1 or step % self.every_n_steps == 0 or now - self.last >= self.every_seconds
        if due and trainer.is_global_zero:
            self.last, self.logged_step = now, step
            log.info("%s", self.line(step, now, trainer))

    def line(self, step: int, now: float, trainer) -> str:
        done, elapsed = step - self.first_step, now - self.start
        rate = done / elapsed if elapsed > 0 else math.inf
        of = "" if math.isinf(self.total) else f" of {int(self.total)}"
        left = "" if math.isinf(self.total) or not rate else f", about {duration((self.total - step) / rate)} left"
        loss = trainer.callback_metrics.get("train/loss")
        loss_text = "" if loss is None else f", train/loss {float(loss):.4f}"
        return (
            f"{self.what}: step {step}{of} (epoch {trainer.current_epoch + 1}), {rate:.3g} steps/s, "
            f"{duration(elapsed)} so far{left}{loss_text}"
        )

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            step, elapsed = int(trainer.global_step), time.perf_counter() - self.start
            log.info("%s: trained, %d steps in %s", self.what, step - self.first_step, duration(elapsed))
