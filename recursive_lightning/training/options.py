"""How one run trains beyond its config: :class:`TrainOptions`, shared by ``train`` (the command and the
Python API) and a sweep's trials."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recursive_lightning.errors import UserError


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


def check_resume_flags(resume: bool, ckpt_path: str | None, init_from: str | None) -> None:
    """``train``'s flags that say where the weights come from, in one sentence when they do not fit together:
    ``--resume`` continues the run in ``--run-dir`` (from ``--ckpt-path`` if given: the checkpoint it continues
    from), ``--init-from`` starts a new run from a pretrained model's weights."""
    if resume and init_from is not None:
        raise UserError(
            "--resume and --init-from exclude each other: --resume continues the run in --run-dir (its config "
            "already names what it was initialised from), --init-from starts a new run; pass one of them."
        )
    if ckpt_path is not None and not resume:
        raise UserError(
            f"--ckpt-path '{ckpt_path}' names the checkpoint a --resume continues from; add --resume to continue "
            "the run in --run-dir from it, or pass --init-from to start a new run from its weights."
        )
