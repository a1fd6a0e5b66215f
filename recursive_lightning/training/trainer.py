"""The Lightning Trainer of a run, and the fit that stops cleanly on SIGTERM and Ctrl-C.

``build_trainer(cfg, run_dir, ...)`` trains: checkpoints every ``train.checkpoint_every`` steps (the two newest
and ``last.ckpt``) and the best by held-out loss (``best.ckpt``) in ``<run_dir>/checkpoints``, validation every
``train.val_every`` steps, the config's precision, devices and strategy. ``build_trainer(cfg,
validate_only=True)`` validates a checkpoint on one device, with no logger, checkpoints or progress bar."""

from __future__ import annotations

import logging
import shlex
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from recursive_lightning.config import RunConfig
from recursive_lightning.errors import Terminated
from recursive_lightning.run_dir import RunDir
from recursive_lightning.training import parallel
from recursive_lightning.training.checkpoint import read_checkpoint, save_atomic

BEST = RunDir.BEST  # the best checkpoint's stem

# Lightning's lines that say nothing about this run: the srun hint where SLURM's client is installed but the
# run is not a SLURM step (a sweep starts its own steps, sweep/slurm.py), a deprecation inside Lightning itself,
# the __len__ note for litdata's streaming dataset (litdata shards by worker itself), and the device, logger-tip
# and "max_steps reached" info lines (the run's summary line says what it trained and where)
_NOISE = (
    r"The `srun` command is available on your system but is not used",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Your `IterableDataset` has `__len__` defined",
    # a resume writes into its own checkpoint folder (a new run into one with checkpoints is refused before)
    r"Checkpoint directory .* exists and is not empty",
    # a resumed run directory that was moved or copied: the best checkpoint is found by its path in the run
    # directory (trainer.best_checkpoint), not by the folder Lightning recorded
    r"The dirpath has changed from",
)
# Lightning's "[rank: 0] Received SIGTERM" info line: the command says in one sentence how it stopped
_SIGNAL_LOGGER = "lightning.pytorch.trainer.connectors.signal_connector"


def quiet_lightning() -> None:
    """Silence :data:`_NOISE` and Lightning's rank-zero info lines; its warnings that matter still show."""
    for message in _NOISE:
        warnings.filterwarnings("ignore", message=message)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger(_SIGNAL_LOGGER).setLevel(logging.WARNING)  # its warnings (a failed requeue) still show


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writes through :func:`~recursive_lightning.training.checkpoint.save_atomic`
    (never half a file) and reads through ``read_checkpoint`` (one sentence for a damaged file)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        save_atomic(checkpoint, path)

    def load_checkpoint(
        self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return read_checkpoint(path, map_location=map_location or "cpu")


def build_trainer(
    cfg: RunConfig,
    run_dir: Path | None = None,
    *,
    logger: Any = False,
    callbacks: Sequence[L.Callback] = (),
    validate_only: bool = False,
    precision: str | None = None,
) -> L.Trainer:
    """The Trainer of ``cfg``: one that trains into ``run_dir`` (``callbacks`` after its checkpoint callbacks),
    or with ``validate_only`` one that validates on one device; ``precision`` overrides ``train.precision``'s
    (a resume continues in its checkpoint's, ``resume.resumed_precision``)."""
    quiet_lightning()
    t = cfg.train
    common: dict[str, Any] = {
        "accelerator": t.accelerator,
        "precision": precision or parallel.resolve_precision(t, t.accelerator, cfg.model),
        "limit_val_batches": cfg.data.val_batches,
        "enable_model_summary": False,
        "use_distributed_sampler": False,
    }
    if validate_only:
        return L.Trainer(
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            **common,
        )
    if run_dir is None:
        raise ValueError("build_trainer: a trainer that trains needs its run_dir")
    ckpt_dir = RunDir(run_dir).checkpoints
    periodic = ModelCheckpoint(
        dirpath=ckpt_dir,
        filename=RunDir.STEP,
        auto_insert_metric_name=False,
        every_n_train_steps=t.checkpoint_every,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
        enable_version_counter=False,
    )
    best = ModelCheckpoint(
        dirpath=ckpt_dir,
        filename=BEST,
        monitor="val/heldout/loss",
        mode="min",
        save_top_k=1,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    cbs = [periodic, best, *callbacks]
    if t.progress:
        cbs.append(TQDMProgressBar(refresh_rate=max(1, min(10, t.max_steps // 50))))
    strategy = parallel.resolve_strategy(cfg)
    return L.Trainer(
        default_root_dir=str(run_dir),
        max_steps=t.max_steps,
        max_epochs=-1,
        val_check_interval=t.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every,
        gradient_clip_val=t.grad_clip if t.strategy != "fsdp" else None,
        accumulate_grad_batches=t.accumulate,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        plugins=[AtomicCheckpointIO()] if t.strategy != "fsdp" else [],
        logger=logger,
        callbacks=cbs,
        enable_progress_bar=t.progress,
        **common,
    )


def fit(
    trainer: L.Trainer,
    module: L.LightningModule,
    dm: Any,
    ckpt_path: str | None,
    cfg: RunConfig,
    run_dir: Path,
) -> None:
    """Train from ``ckpt_path`` (None: step 0) to ``train.max_steps``, then validate at the last step unless a
    validation just ran there in this process (a resumed finished run trains no step and validates its last
    checkpoint again, so its result is never lost). Under bf16 / fp16 autocast on CUDA the float32 GEMMs run on
    TF32 meanwhile (``parallel.tf32_under_mixed_precision``). SIGTERM raises ``Terminated``; Ctrl-C
    KeyboardInterrupt."""
    device = "cuda" if isinstance(trainer.accelerator, CUDAAccelerator) else "cpu"
    try:
        with parallel.tf32_under_mixed_precision(str(trainer.precision), device):
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=False)
            if trainer.global_step % cfg.train.val_every != 0 or not val_metrics(trainer):
                trainer.validate(module, datamodule=dm, verbose=False)
    except SIGTERMException:  # Lightning stops at the next step (or validation batch) and raises SystemExit()
        where = _how_to_resume(cfg, run_dir)
        raise Terminated(f"train: stopped by SIGTERM at step {trainer.global_step}; {where}") from None
    except SystemExit as e:
        # Lightning turns Ctrl-C inside fit into sys.exit(1) after its own shutdown (trainer/call.py): report it
        # as the interrupt it was (exit 130, run KILLED), not as a failure, with the command that continues it
        if trainer.interrupted and e.code == 1 and not isinstance(e, SIGTERMException):
            where = _how_to_resume(cfg, run_dir)
            raise KeyboardInterrupt(f"train: interrupted at step {trainer.global_step}; {where}") from None
        raise


def _how_to_resume(cfg: RunConfig, run_dir: Path) -> str:
    """The end of the sentence of a run stopped inside fit: the exact command that continues it."""
    command = f"python -m recursive_lightning train --resume --run-dir {shlex.quote(str(run_dir))}"
    if RunDir(run_dir).has_checkpoint_files():
        return f"the run is resumable from its last checkpoint: {command}"
    return (
        f"no checkpoint was written yet (train.checkpoint_every {cfg.train.checkpoint_every}): a --resume "
        f"starts from step 0: {command}"
    )


def val_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The validation metrics the trainer holds (``val/<set>/<metric>``)."""
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}


def best_checkpoint(trainer: L.Trainer, run_dir: Path) -> Path | None:
    """The best checkpoint's file, in ``run_dir`` where it lies now (a copied or moved run restores the old
    folder's path with the callback's state)."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.filename == BEST and cb.best_model_path:
            return RunDir(run_dir).checkpoints / Path(cb.best_model_path).name
    return None
