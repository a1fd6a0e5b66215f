"""``SweepOptions``: how ``run_sweep`` runs a sweep file (the ``sweep`` command's options)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class SweepOptions:
    """How ``run_sweep`` runs a sweep file (the ``sweep`` command's options). ``run_dir``: where trials, stores
    and the report go (default: the study's recorded directory for ``attach``, else ``runs/sweeps/<name>``);
    ``workers``: processes on this machine (default: the file's); ``storage`` / ``tracking_uri``: the Optuna and
    MLflow stores (default: the environment's, else SQLite files in the run directory); ``attach``: join an
    existing study as a worker; ``prepare``: create the study, its grid, the parent run and the data, then stop;
    ``worker``: a worker process a sweep started; ``max_trials``: stop this worker after that many trials;
    ``report``: write the report at the end."""

    run_dir: str | os.PathLike | None = None
    workers: int | None = None
    storage: str | None = None
    tracking_uri: str | None = None
    attach: bool = False
    prepare: bool = False
    worker: bool = False
    max_trials: int | None = None
    report: bool = True
