"""The public API's entries that are not one function elsewhere: a sweep and an evaluation from Python,
with the keyword options of the ``sweep`` and ``eval`` commands."""

from __future__ import annotations

import os
from typing import Any

from recursive_lightning.evaluation.options import EvalOptions
from recursive_lightning.evaluation.run import evaluate_checkpoint
from recursive_lightning.sweep.runner import main as sweep_main


def run_sweep(
    path: str | os.PathLike,
    run_dir: str | os.PathLike,
    *,
    workers: int | None = None,
    storage: str | None = None,
    tracking_uri: str | None = None,
    max_trials: int | None = None,
    report: bool = True,
) -> int:
    """Run (or resume) the sweep file ``path`` into ``run_dir``, as ``recursive_lightning sweep`` does, and
    return its exit status: 0 when every grid point finished (the report is ``run_dir/report.md``), else the
    command's code for a failed or unfinished sweep. Call it from the main thread (it handles SIGTERM)."""
    argv = [os.fspath(path), "--run-dir", os.fspath(run_dir)]
    for flag, value in (
        ("--workers", workers),
        ("--storage", storage),
        ("--tracking-uri", tracking_uri),
        ("--max-trials", max_trials),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return sweep_main(argv + ([] if report else ["--no-report"]))


def evaluate(checkpoint: str | os.PathLike, **options: Any) -> dict[str, Any]:
    """Evaluate a checkpoint (a ``.ckpt`` file or a run directory) as ``recursive_lightning eval`` does:
    ``ppl_sets={"heldout": "embedded:heldout"}``, ``tasks=None`` or lm-eval task names, ``shots``, ``limit``,
    ``context_lengths``, ``device`` (default cpu; the CLI picks cuda when there is one), ``mlflow``... (the fields
    of :class:`EvalOptions`). Returns the JSON-ready result (also written to ``<run>/eval``)."""
    return evaluate_checkpoint(checkpoint, EvalOptions(**options))
