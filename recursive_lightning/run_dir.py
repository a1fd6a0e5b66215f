"""The layout of a run directory and of a sweep directory: the one module that names their files.

A run directory (``train``; a sweep's trial is one too)::

    config.yaml          the fully resolved config (resume uses it)
    checkpoints/         last.ckpt, step=NNNNNN.ckpt (the newest periodic ones), best.ckpt
    mlflow.db            SQLite tracking store (unless the run logs elsewhere)
    mlartifacts/         MLflow artifacts of that SQLite store
    mlflow_run_id        the MLflow run the directory logs to (a resume continues it)
    mlflow_tracking_uri  the store of that run (a SQLite file inside, or beside the sweep around it, kept relative)
    result.json          final metrics, written when training finishes
    .writer.lock         locked by the one process writing the directory (training/run_lock.py)
    init_tokenizer.json  an uptraining run's source tokenizer (training/uptrain.py)
    eval/, probes/       what ``eval`` and ``probe`` write by default
    trial.yaml           a sweep trial's config as its ``train`` process reads it
    sweep_result.json    a sweep trial's result as the sweep records it, before telling the study

A sweep directory::

    sweep.yaml, sweep.json   the sweep file as started, and what the study was prepared with
    optuna.db, mlflow.db     the study and the tracking store (unless elsewhere), mlartifacts/
    trials/<point>/          one run directory per grid point
    report.md, report.html   the report, its figures (report_*.png) beside them
    .sweep.lock, .report.lock, .devices/<host>/   one preparer, one report writer, the devices held
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    """One run directory: where each of its files lies, and the questions asked of them."""

    path: Path

    CONFIG = "config.yaml"
    RESULT = "result.json"
    CHECKPOINTS = "checkpoints"
    LAST = "last.ckpt"
    BEST = "best"  # the best checkpoint's stem: best.ckpt
    STEP = "step={step:06d}"  # a periodic checkpoint's stem, as Lightning's ModelCheckpoint formats it
    RUN_ID = "mlflow_run_id"
    TRACKING_URI = "mlflow_tracking_uri"
    MLFLOW_DB = "mlflow.db"
    ARTIFACTS = "mlartifacts"
    WRITER_LOCK = ".writer.lock"
    INIT_TOKENIZER = "init_tokenizer.json"
    EVAL = "eval"
    PROBES = "probes"
    TRIAL_CONFIG = "trial.yaml"
    SWEEP_RESULT = "sweep_result.json"

    def __init__(self, path: str | os.PathLike) -> None:
        object.__setattr__(self, "path", Path(path))

    @classmethod
    def of_checkpoint(cls, ckpt: str | os.PathLike) -> RunDir:
        """The run directory of ``<run_dir>/checkpoints/x.ckpt``; else the checkpoint's own folder."""
        parent = Path(ckpt).parent
        return cls(parent.parent if parent.name == cls.CHECKPOINTS else parent)

    @property
    def config(self) -> Path:
        return self.path / self.CONFIG

    @property
    def result(self) -> Path:
        return self.path / self.RESULT

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / self.LAST

    def step_checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{self.STEP.format(step=step)}.ckpt"

    @property
    def run_id_file(self) -> Path:
        return self.path / self.RUN_ID

    @property
    def tracking_uri_file(self) -> Path:
        return self.path / self.TRACKING_URI

    @property
    def mlflow_db(self) -> Path:
        return self.path / self.MLFLOW_DB

    @property
    def artifacts(self) -> Path:
        return self.path / self.ARTIFACTS

    @property
    def writer_lock(self) -> Path:
        return self.path / self.WRITER_LOCK

    @property
    def init_tokenizer(self) -> Path:
        return self.path / self.INIT_TOKENIZER

    @property
    def eval_dir(self) -> Path:
        return self.path / self.EVAL

    @property
    def probes_dir(self) -> Path:
        return self.path / self.PROBES

    @property
    def trial_config(self) -> Path:
        return self.path / self.TRIAL_CONFIG

    @property
    def sweep_result(self) -> Path:
        return self.path / self.SWEEP_RESULT

    def holds_run(self) -> bool:
        """Whether a run was started here (checkpoints or an MLflow run id), whatever its config file says."""
        return self.checkpoints.exists() or self.run_id_file.exists()

    def has_checkpoint_files(self) -> bool:
        """Whether ``checkpoints/`` holds any checkpoint file (readable or not)."""
        return self.checkpoints.is_dir() and any(self.checkpoints.glob("*.ckpt"))

    def recorded_run_id(self) -> str | None:
        """The MLflow run id the directory records, if any."""
        return self.run_id_file.read_text().strip() if self.run_id_file.is_file() else None


def checkpoints_newest_first(folder: str | os.PathLike) -> list[Path]:
    """The checkpoint files of a folder (a run's ``checkpoints/``), newest first: last.ckpt, then periodic step
    checkpoints, then best."""
    d = Path(folder)
    if not d.is_dir():
        return []
    out = [d / RunDir.LAST] if (d / RunDir.LAST).exists() else []
    out += sorted(d.glob("step*.ckpt"), key=checkpoint_step, reverse=True)
    out += list(d.glob(f"{RunDir.BEST}*.ckpt"))
    return out


def checkpoint_step(path: Path) -> int:
    """The step a periodic checkpoint's name carries (``step=000120.ckpt``: 120); -1 for other names."""
    m = re.search(r"step=?(\d+)", path.name)
    return int(m.group(1)) if m else -1


def has_periodic_checkpoints(folder: str | os.PathLike) -> bool:
    return any(Path(folder).glob("step*.ckpt"))


@dataclass(frozen=True)
class SweepDir:
    """One sweep directory: the study's files, the report's and one run directory per grid point."""

    path: Path

    INFO = "sweep.json"
    SPEC = "sweep.yaml"
    TRIALS = "trials"
    OPTUNA_DB = "optuna.db"
    MLFLOW_DB = RunDir.MLFLOW_DB
    ARTIFACTS = RunDir.ARTIFACTS
    REPORT = "report.md"
    REPORT_HTML = "report.html"
    REPORT_ARTIFACTS = "report"  # the folder of the parent MLflow run's artifacts the report is logged to
    REPORT_HTML_ARTIFACT = f"{REPORT_ARTIFACTS}/{REPORT_HTML}"
    SWEEP_LOCK = ".sweep.lock"
    REPORT_LOCK = ".report.lock"
    DEVICES = ".devices"

    def __init__(self, path: str | os.PathLike) -> None:
        object.__setattr__(self, "path", Path(path))

    @staticmethod
    def is_sweep(path: str | os.PathLike) -> bool:
        """Whether ``path`` is a sweep's directory (its record or its study's SQLite file)."""
        d = Path(path)
        return (d / SweepDir.INFO).is_file() or (d / SweepDir.OPTUNA_DB).is_file()

    @property
    def info(self) -> Path:
        return self.path / self.INFO

    @property
    def spec(self) -> Path:
        return self.path / self.SPEC

    @property
    def trials(self) -> Path:
        return self.path / self.TRIALS

    def trial(self, key: str) -> RunDir:
        """The run directory of the grid point named ``key``."""
        return RunDir(self.trials / str(key))

    @property
    def optuna_db(self) -> Path:
        return self.path / self.OPTUNA_DB

    @property
    def mlflow_db(self) -> Path:
        return self.path / self.MLFLOW_DB

    @property
    def artifacts(self) -> Path:
        return self.path / self.ARTIFACTS

    @property
    def sweep_lock(self) -> Path:
        return self.path / self.SWEEP_LOCK

    @property
    def report_lock(self) -> Path:
        return self.path / self.REPORT_LOCK

    def devices(self, host: str) -> Path:
        """The folder of the device locks this machine's workers hold."""
        return self.path / self.DEVICES / host

    @staticmethod
    def report_files(out: str | os.PathLike) -> tuple[Path, Path]:
        """``report.md`` and ``report.html`` in ``out`` (the sweep directory unless written elsewhere)."""
        return Path(out) / SweepDir.REPORT, Path(out) / SweepDir.REPORT_HTML

    def runs_folder(self) -> Path:
        """Where the sweep's run directories lie: ``trials/`` (a folder of runs otherwise: itself)."""
        return self.trials if self.trials.is_dir() else self.path
