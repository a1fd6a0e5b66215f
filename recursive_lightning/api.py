"""The public API's entries for a sweep and an evaluation from Python: the library functions the ``sweep`` and
``eval`` commands call, with their typed options and results."""

from __future__ import annotations

import os
from typing import Any

from recursive_lightning.evaluation.options import EvalOptions
from recursive_lightning.evaluation.run import evaluate_checkpoint
from recursive_lightning.sweep.options import SweepOptions
from recursive_lightning.sweep.outcome import SweepOutcome
from recursive_lightning.sweep.runner import run_sweep

__all__ = ["EvalOptions", "SweepOptions", "SweepOutcome", "evaluate", "run_sweep"]


def evaluate(checkpoint: str | os.PathLike, **options: Any) -> dict[str, Any]:
    """Evaluate a checkpoint (a ``.ckpt`` file or a run directory) as ``recursive_lightning eval`` does:
    ``ppl_sets={"heldout": "embedded:heldout"}``, ``tasks=None`` or lm-eval task names, ``shots``, ``limit``,
    ``context_lengths``, ``device`` (default cpu; the CLI picks cuda when there is one), ``mlflow``... (the fields
    of :class:`EvalOptions`). Returns the JSON-ready result (also written to ``<run>/eval``)."""
    return evaluate_checkpoint(checkpoint, EvalOptions(**options))
