"""How one run trains beyond its config: :class:`TrainOptions`, shared by ``train`` (the command and the
Python API) and a sweep's trials."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TrainOptions:
    """``resume``: continue the run directory from its newest good checkpoint (or ``ckpt_path``). The MLflow
    run: its store (``tracking_uri``, default the run directory's SQLite file), ``experiment`` (default the
    config's name), ``run_name``, ``parent_run_id`` (a sweep's trial), ``tags`` and ``params`` (a sweep's axes)
    of a new run. ``callbacks``: further Lightning callbacks (a sweep's pruning and heartbeat)."""

    resume: bool = False
    ckpt_path: str | None = None
    tracking_uri: str | None = None
    experiment: str | None = None
    run_name: str | None = None
    parent_run_id: str | None = None
    tags: dict[str, str] | None = None
    callbacks: list | None = None
    params: dict[str, Any] | None = None
