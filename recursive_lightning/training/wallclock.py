"""A run's wall-clock over its segments: a resumed run adds its own seconds to those its checkpoint holds.

``result.json``'s ``seconds`` and the summary line are the sum of the segments (each from the start of its
``train`` command to its last checkpoint, the last one to its end), ``data_seconds`` the part of them spent
preparing the data (one-off: the first run on a corpus builds it), and ``steps`` the run's real step count;
the summary also says what this segment trained, so that a resumed run's summary does not read as if all its
steps took this segment's seconds.
"""

from __future__ import annotations

import time

from lightning.pytorch.callbacks import Callback

KEY = "wall_clock"


class WallClock(Callback):
    """Seconds and segments of the run so far, kept in every checkpoint under ``checkpoint["wall_clock"]``."""

    def __init__(self, t0: float | None = None, data: float = 0.0) -> None:
        self.t0 = time.time() if t0 is None else t0
        self.data = (
            data  # seconds of this segment's data preparation (corpus, tokenizer, shards; inside t0's)
        )
        self.data_before = 0.0  # the same of the earlier segments
        self.before = 0.0  # seconds of the earlier segments (from the checkpoint resumed)
        self.segments = 0  # earlier segments
        self.start_step = 0  # the step this segment started at

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        rec = checkpoint.get(KEY) or {}
        self.before = float(rec.get("seconds") or 0.0)
        self.data_before = float(rec.get("data_seconds") or 0.0)
        self.segments = int(rec.get("segments") or 0)
        # a run resumed at its last step trains none: no train start follows to set this
        self.start_step = int(checkpoint.get("global_step") or 0)

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[KEY] = {
            "seconds": self.seconds(),
            "segments": self.segments + 1,
            "data_seconds": self.data_before + self.data,
        }

    def segment_seconds(self) -> float:
        return time.time() - self.t0

    def seconds(self) -> float:
        """The run's wall-clock: the earlier segments' plus this one's so far."""
        return self.before + self.segment_seconds()

    def run_totals(self, step: int) -> tuple[float, int]:
        """(seconds, segments) of the run at ``step``: a resume that trained no step (the run was already at
        its ``max_steps``) is not a segment of it, so it adds neither."""
        if self.segments and step == self.start_step:
            return self.before, self.segments
        return self.seconds(), self.segments + 1

    def data_seconds(self, step: int) -> float:
        """Seconds of the run's data preparation at ``step``, part of its ``run_totals`` seconds: one-off work
        (the first run on a corpus builds its tokenizer and shards, later ones read them), reported apart."""
        if self.segments and step == self.start_step:
            return self.data_before
        return self.data_before + self.data
