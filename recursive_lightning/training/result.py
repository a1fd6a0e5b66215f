"""What a finished ``train`` returns and keeps in its run directory (``result.json``): :class:`TrainResult`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursive_lightning.files import atomic_write_text
from recursive_lightning.run_dir import RunDir
from recursive_lightning.tracking.runs import default_tracking_uri
from recursive_lightning.uris import mask_url


@dataclass
class TrainResult:
    """One run's outcome: where it lies, its MLflow run, how far it trained (``steps``, ``tokens``), how long
    (``seconds``, of which ``data_seconds`` preparing data; ``segment_*`` this command's part of a resumed run),
    its final validation ``metrics`` and its checkpoints. ``to_dict`` is what ``result.json`` holds."""

    run_dir: Path
    steps: int
    tokens: int
    metrics: dict[str, float]
    last_checkpoint: Path | None
    best_checkpoint: Path | None
    mlflow_run_id: str
    tracking_uri: str
    seconds: float  # wall-clock of the run: the sum of its segments (training/wallclock.py)
    extra: dict[str, Any] = field(default_factory=dict)
    segment_steps: int | None = None  # steps this command trained (None: the whole run)
    segment_seconds: float | None = None
    segments: int = 1
    data_seconds: float = 0.0  # the part of ``seconds`` spent preparing the data (training/wallclock.py)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "steps": self.steps,
            "tokens": self.tokens,
            "metrics": self.metrics,
            "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "best_checkpoint": str(self.best_checkpoint) if self.best_checkpoint else None,
            "mlflow_run_id": self.mlflow_run_id,
            "tracking_uri": mask_url(self.tracking_uri),  # no password on disk (read back: uris.reveal)
            "seconds": self.seconds,
            "segments": self.segments,
            "data_seconds": self.data_seconds,
        }

    def save(self) -> None:
        """Write ``result.json`` into the run directory (atomically)."""
        atomic_write_text(RunDir(self.run_dir).result, json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> TrainResult:
        """The ``result.json`` of ``run_dir`` (see ``from_dict``); OSError when there is none."""
        run_dir = Path(run_dir)
        return cls.from_dict(json.loads(RunDir(run_dir).result.read_text()), run_dir)

    @classmethod
    def from_dict(cls, d: dict[str, Any], run_dir: Path) -> TrainResult:
        """A ``result.json`` read back from ``run_dir`` where it lies now: paths recorded inside the run directory
        at the time (the checkpoints) follow it when it was moved or copied, and the tracking store is the one
        the directory records (``default_tracking_uri``). Raises KeyError / TypeError / ValueError on a
        damaged record."""
        old = d.get("run_dir")

        def here(path: str | None) -> Path | None:
            return None if not path else rebased(path, old, run_dir)

        return cls(
            run_dir=run_dir,
            steps=int(d["steps"]),
            tokens=int(d["tokens"]),
            metrics={k: float(v) for k, v in d["metrics"].items()},
            last_checkpoint=here(d.get("last_checkpoint")),
            best_checkpoint=here(d.get("best_checkpoint")),
            mlflow_run_id=str(d["mlflow_run_id"]),
            tracking_uri=default_tracking_uri(run_dir),
            seconds=float(d.get("seconds") or 0.0),
            segments=int(d.get("segments") or 1),
            data_seconds=float(d.get("data_seconds") or 0.0),
        )


def rebased(path: str | os.PathLike, old_dir: str | os.PathLike | None, new_dir: str | os.PathLike) -> Path:
    """``path``, recorded while its directory was ``old_dir``, where that directory lies now (``new_dir``); a path
    outside ``old_dir`` (or with no ``old_dir`` recorded) as it was."""
    if old_dir:
        try:
            return Path(new_dir) / Path(path).relative_to(old_dir)
        except ValueError:
            pass
    return Path(path)
