"""A run directory before training starts: the config it keeps (a resume must match it), the checkpoint a run
resumes from, and the metrics a finished run recorded (``result.json``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from recursive_lightning.config import RunConfig, load_yaml
from recursive_lightning.errors import ConfigError
from recursive_lightning.files import atomic_write_text, writable_dir_problem
from recursive_lightning.run_dir import RunDir, has_periodic_checkpoints
from recursive_lightning.training.checkpoint import CheckpointError, candidates, latest_good, read_checkpoint
from recursive_lightning.training.parallel import resolve_precision

# fields a resume may change: how far and where the run trains, not what it trains
RESUMABLE_CHANGES = (
    "train.max_steps",
    "train.progress",
    "train.keep_host_memory",
    "train.devices",
    "train.accelerator",
)


def prepare_run_dir(cfg: RunConfig, run_dir: Path, resume: bool) -> None:
    """Check that ``run_dir`` can hold the run (writable; no checkpoints unless ``resume``; a resume with the
    config it was started with) and keep ``cfg`` in it as ``config.yaml``."""
    ckpt_dir = RunDir(run_dir).checkpoints
    saved_cfg = RunDir(run_dir).config
    problem = writable_dir_problem(run_dir)
    if problem is not None:
        raise ConfigError(
            f"--run-dir '{run_dir}' cannot hold the run: {problem}; choose a folder you can write to."
        )
    if resume and saved_cfg.exists():
        check_same_config(RunConfig.from_dict(load_yaml(saved_cfg)), cfg, run_dir)
    if not resume and latest_good(ckpt_dir) is not None:
        raise ConfigError(
            f"--run-dir '{run_dir}' already holds checkpoints; pass --resume to continue it or choose a new --run-dir."
        )
    run_dir.mkdir(parents=True, exist_ok=True)


def keep_config(cfg: RunConfig, run_dir: Path) -> None:
    """Keep ``cfg`` in ``run_dir`` as ``config.yaml`` once every check has passed: a new run's config, or a
    resume's allowed changes (e.g. a larger --max-steps extends the run: resume uses it from now on)."""
    saved_cfg = RunDir(run_dir).config
    if not saved_cfg.exists() or RunConfig.from_dict(load_yaml(saved_cfg)).flat() != cfg.flat():
        atomic_write_text(saved_cfg, cfg.to_yaml())


def resume_checkpoint(cfg: RunConfig, run_dir: Path, resume: bool, ckpt_path: str | None) -> str | None:
    """The checkpoint the run continues from: ``ckpt_path`` (checked to come from a run of ``cfg``), else with
    ``resume`` the newest good one in ``run_dir`` (None: none yet, the run starts at step 0)."""
    if ckpt_path is not None and Path(ckpt_path).is_dir() and not (Path(ckpt_path) / ".metadata").is_file():
        raise CheckpointError(
            f"--ckpt-path '{ckpt_path}' is a directory but not a sharded checkpoint (no .metadata inside); pass a "
            f".ckpt file such as '{Path(ckpt_path) / RunDir.LAST}', or --resume alone for the run's newest one."
        )
    if ckpt_path is not None and not Path(ckpt_path).is_dir():
        # an explicit --ckpt-path: one sentence if it is damaged or was written by a different run
        check_checkpoint_config(read_checkpoint(ckpt_path), cfg, ckpt_path)
    if not resume or ckpt_path is not None:
        check_max_steps(cfg, ckpt_path)
        return ckpt_path
    ckpt_dir, last = RunDir(run_dir).checkpoints, RunDir(run_dir).last_checkpoint
    if last.exists() or has_periodic_checkpoints(ckpt_dir):
        good = latest_good(ckpt_dir)
        if good is None:  # every checkpoint damaged: none to resume from, and step 0 would relog the run
            newest = candidates(ckpt_dir)[0]
            raise CheckpointError(
                f"--resume: every checkpoint in '{ckpt_dir}' is damaged or truncated (the newest, '{newest}', "
                "cannot be read); restore one from a backup, or start the run again with a new --run-dir."
            )
        if last.exists() and good != last:
            read_checkpoint(last)  # raises one sentence naming the damaged file and the good one
        check_max_steps(cfg, good)
        return str(good)  # latest_good already checked it reads
    check_not_restarted(run_dir)
    print(
        f"train --resume: '{run_dir}' holds no checkpoint yet; training from step 0.",
        file=sys.stderr,
        flush=True,
    )
    return None


def check_not_restarted(run_dir: Path) -> None:
    """A run that saved a checkpoint once (its ``checkpoints/`` folder made, or its result written) and logs to
    an MLflow run cannot start again at step 0 in that run: its metric history would hold every step twice."""
    rd = RunDir(run_dir)
    if rd.recorded_run_id() and (rd.checkpoints.is_dir() or rd.result.is_file()):
        raise ConfigError(
            f"--resume: the checkpoints of the run in '{run_dir}' are gone, so it would train again from step 0 "
            f"into the MLflow run that already holds its steps; restore a checkpoint into '{rd.checkpoints}', or "
            "start the run afresh with a new --run-dir."
        )


def check_max_steps(cfg: RunConfig, resume_from: str | Path | None) -> None:
    """A resume trains on to ``train.max_steps``: one below the checkpoint's step would stop at once and keep a
    config that no longer matches the run, so it is refused."""
    if resume_from is None or Path(resume_from).is_dir():
        return
    ckpt = torch.load(resume_from, map_location="cpu", weights_only=True, mmap=True)  # reads no tensor
    step = int(ckpt.get("global_step", 0))
    if cfg.train.max_steps < step:
        raise ConfigError(
            f"train.max_steps {cfg.train.max_steps} is below step {step}, where '{resume_from}' stopped; pass "
            f"--max-steps {step} or more to continue the run."
        )


def resumed_precision(cfg: RunConfig, resume_from: str | None) -> str | None:
    """With ``train.precision: auto``, the precision the checkpoint's run trained in, so a resume continues in it
    (None: resolve it anew). A checkpoint that does not record it was written under the rule before
    ``BF16_MIN_WIDTH`` (bf16-mixed on any CPU with native bf16, whatever the model's width)."""
    if cfg.train.precision != "auto" or resume_from is None or Path(resume_from).is_dir():
        return None
    ckpt = torch.load(resume_from, map_location="cpu", weights_only=True, mmap=True)  # reads no tensor
    recorded = (ckpt.get("recursive_lightning") or {}).get("precision")
    return recorded or resolve_precision(cfg.train, cfg.train.accelerator)


def check_checkpoint_config(ckpt: dict, cfg: RunConfig, path: str) -> None:
    """A --ckpt-path must come from a run of this config (model and data); else litdata and the optimiser
    fail deep inside Lightning (e.g. "item_loader state doesn't match")."""
    extra = ckpt.get("recursive_lightning") or {}
    if not extra.get("run"):
        return
    try:
        theirs = RunConfig.from_dict(extra["run"]).flat()
    except ConfigError:
        return
    ours = cfg.flat()
    for k in ours:
        if (k.startswith("model.") or k.startswith("data.")) and k != "data.num_workers":
            if k in theirs and theirs[k] != ours[k]:
                raise ConfigError(
                    f"--ckpt-path '{path}' was written by a run with {k} {theirs[k]!r}, but this run has "
                    f"{ours[k]!r}; pass a checkpoint of this run (or train that config instead)."
                )


def check_same_config(saved: RunConfig, cfg: RunConfig, run_dir: Path) -> None:
    """A resume runs the config the run was started with (up to ``RESUMABLE_CHANGES``)."""
    a, b = saved.flat(), cfg.flat()
    for k in a:
        if k in RESUMABLE_CHANGES:
            continue
        if a.get(k) != b.get(k):
            raise ConfigError(
                f"--resume: {k} is {b.get(k)!r} but the run in '{run_dir}' was started with {a.get(k)!r}; "
                "resume with the same config or use a new --run-dir."
            )


def previous_result(run_dir: Path, steps: int) -> dict:
    """What ``result.json`` recorded at ``steps`` (a finished run resumed without training), else {}."""
    try:
        old = json.loads(RunDir(run_dir).result.read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) and old.get("steps") == steps else {}
